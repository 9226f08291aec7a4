"""Run the application under uvicorn on an already bound socket until SIGTERM / SIGINT.

On a signal uvicorn stops accepting connections and lets in-flight responses finish for up to
`shutdown_grace_s` seconds, then cancels them (a cancelled stream aborts its request); the engine then
stops, aborting whatever is left, and the process exits 0.
"""

from __future__ import annotations

import math
import signal
import socket
from typing import Any

import uvicorn

from tinyloop.serve.app import create_app


def serve(model: Any, sock: socket.socket, *, shutdown_grace_s: float = 10.0, **options: Any) -> None:
    """Serve `model` (a Model or a function that loads one) on the bound socket `sock`."""
    app = create_app(model, shutdown_grace_s=shutdown_grace_s, **options)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=max(math.ceil(shutdown_grace_s), 1),
                            access_log=False)  # fmt: skip
    server = uvicorn.Server(config)

    def shut_down(signum: int, frame: object) -> None:
        server.should_exit = True

    # uvicorn handles the signals while it runs and raises them again once it has shut down; around it this
    # handler asks for the same shutdown (a signal before uvicorn took over) and keeps the exit status 0.
    previous = {sig: signal.signal(sig, shut_down) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
