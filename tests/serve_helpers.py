"""Starting a real server (uvicorn on a loopback port, in a thread) for the serve tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SEQ = 320  # positions per request in the test servers


@contextmanager
def running_server(model: Any, **options: Any) -> Iterator[str]:
    """Serve `model` on 127.0.0.1 and a free port; yields the base URL. A few short rows by default:
    the scheduler allocates max_batch x max_seq_len positions at start."""
    import uvicorn

    from tinyloop.serve import create_app

    options = {"served_model_name": "tiny", "max_batch": 4, "max_seq_len": SEQ, **options}
    app = create_app(model, **options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
