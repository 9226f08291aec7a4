"""A client that goes away frees its slot; SIGTERM ends the server cleanly; the CLI's one-line refusals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tinyloop.cli.main import main

REPO = Path(__file__).absolute().parents[2]


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def wait_for(condition, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_a_client_that_disconnects_mid_stream_frees_its_slot(base_url: str) -> None:
    body = {"model": "tiny", "prompt": "a", "max_tokens": 300, "stream": True, "temperature": 0}
    aborted = 'tinyloop_requests_finished_total{finish_reason="abort"}'
    before = metric(base_url, aborted) if aborted in httpx.get(f"{base_url}/metrics").text else 0.0
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: a dropped iterator closes the connection at once
        next(line for line in lines if line.startswith("data: "))
        assert metric(base_url, "tinyloop_requests_running") == 1.0
    assert wait_for(lambda: metric(base_url, "tinyloop_requests_running") == 0.0, timeout=10)
    assert metric(base_url, aborted) == before + 1  # ended by the abort, not by max_tokens
    assert metric(base_url, "tinyloop_requests_waiting") == 0.0


def start_cli_server(*args: str) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    cmd = [sys.executable, "-m", "tinyloop.cli.main", "tiny", "serve", "--port", "0", "--max-batch", "2",
           "--max-seq-len", "320", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    for line in proc.stderr:
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return proc, match.group(1)
    proc.kill()
    raise AssertionError(f"the server did not start (exit {proc.wait()})")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False


def test_sigterm_ends_in_flight_requests_and_exits_0() -> None:
    proc, url = start_cli_server("--shutdown-grace", "1")
    try:
        assert wait_for(lambda: _healthy(url), timeout=60), "the model did not load"
        events: list[str] = []
        body = {"model": "tiny", "prompt": "a", "max_tokens": 300, "stream": True}

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                try:
                    events.extend(line for line in r.iter_lines() if line.startswith("data: "))
                except httpx.HTTPError:
                    events.append("cut")  # the grace period ended the response

        client = threading.Thread(target=stream)
        client.start()
        assert wait_for(lambda: bool(events) or _running(url))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        client.join(30)
        assert not client.is_alive()
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.get(f"{url}/health")
    finally:
        if proc.poll() is None:
            proc.kill()


def _running(url: str) -> bool:
    return metric(url, "tinyloop_requests_running") == 1.0


def test_cli_refusals_are_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert main(["tiny", "serve"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pip install 'loopformer[serve]'" in err and "fastapi" in err
    monkeypatch.undo()
    with socket_taken() as port:
        assert main(["tiny", "serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"cannot listen on 127.0.0.1:{port}" in err
    assert main(["tiny", "serve", "--max-batch", "0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


class socket_taken:
    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def test_health_is_503_while_the_model_loads(tiny_model) -> None:
    from serve_helpers import running_server

    release = threading.Event()

    def slow_load():  # type: ignore[no-untyped-def]
        release.wait(30)
        return tiny_model

    with running_server(slow_load) as url:
        loading = httpx.get(f"{url}/health")
        assert loading.status_code == 503 and loading.json()["error"]["type"] == "service_unavailable_error"
        early = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 1})
        assert early.status_code == 503 and "loading" in early.json()["error"]["message"]
        release.set()
        assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 200)


def test_a_client_that_gives_up_on_a_whole_response_frees_its_slot(base_url: str) -> None:
    body = {"model": "tiny", "prompt": "b", "max_tokens": 300, "temperature": 0}
    aborted = 'tinyloop_requests_finished_total{finish_reason="abort"}'
    before = metric(base_url, aborted) if aborted in httpx.get(f"{base_url}/metrics").text else 0.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    assert wait_for(lambda: metric(base_url, "tinyloop_requests_running") == 0.0, timeout=10)
    assert metric(base_url, aborted) == before + 1
