"""Warm-up before the server reports ready: --warm-up / --no-warm-up, /health 503 "warming up" meanwhile,
a failed warm-up reported like a load error, off by default on the CPU."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest

import tinyloop
from serve_helpers import running_server
from tinyloop.api.scheduler import Scheduler
from tinyloop.cli.main import main
from tinyloop.cli.serve_cmd import build_parser

BODY = {"model": "tiny", "prompt": "The loop ", "max_tokens": 8, "temperature": 0}


def wait_for_health(url: str, timeout: float = 60.0) -> httpx.Response:
    """GET /health until it answers something other than 503 'loading' / 'warming up' (or the time is up)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{url}/health")
        message = r.json().get("error", {}).get("message", "") if r.status_code == 503 else ""
        if r.status_code != 503 or "failed" in message or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def greedy_text(model: tinyloop.Model) -> str:
    prompt = np.frombuffer(BODY["prompt"].encode(), dtype=np.uint8).astype(np.int32)
    ids = model.generate(prompt, BODY["max_tokens"], temperature=0.0)
    return bytes(ids.astype(np.uint8)).decode("utf-8", errors="replace")


def test_the_cli_takes_warm_up_and_no_warm_up_and_passes_it_to_the_server(monkeypatch) -> None:
    parser = build_parser()
    assert parser.parse_args([]).warm_up is None  # decided by the model's device
    assert parser.parse_args(["--warm-up"]).warm_up is True
    assert parser.parse_args(["--no-warm-up"]).warm_up is False
    passed: list[Any] = []

    def serve(model, sock, **options):  # type: ignore[no-untyped-def]
        sock.close()
        passed.append(options["warm_up"])

    monkeypatch.setattr("tinyloop.serve.server.serve", serve)
    for flags in ([], ["--warm-up"], ["--no-warm-up"]):
        assert main(["tiny", "serve", "--port", "0", *flags]) == 0
    assert passed == [None, True, False]


def test_health_says_warming_up_until_the_warm_up_ends(tiny_model, monkeypatch, capsys) -> None:
    entered, release = threading.Event(), threading.Event()
    reports: list[Any] = []
    warm_up = Scheduler.warm_up

    def held(self, loops=None):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(30)
        reports.append(warm_up(self, loops))
        return reports[-1]

    monkeypatch.setattr(Scheduler, "warm_up", held)
    with running_server(lambda: tiny_model, warm_up=True) as url:
        assert entered.wait(30), "the warm-up did not start"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["message"] == "the model is warming up"
        early = httpx.post(f"{url}/v1/completions", json=BODY)
        assert early.status_code == 503 and "warming up" in early.json()["error"]["message"]
        release.set()
        assert wait_for_health(url).status_code == 200
        assert reports and reports[0].buckets == (4, 2, 1)  # the test server's max_batch 4
        logged = re.findall(r"warm-up: \d+\.\d s, decode steps of 4, 2, 1 rows at 8 loops \(9 requests\)\n",
                            capsys.readouterr().err)  # fmt: skip
        assert len(logged) == 1
        r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy_text(tiny_model)
        metrics = httpx.get(f"{url}/metrics").text  # the warm-up's requests are not served traffic
        assert "tinyloop_generation_tokens_total 8.0" in metrics
        assert 'tinyloop_requests_finished_total{finish_reason="length"} 1.0' in metrics


def test_a_failed_warm_up_is_reported_like_a_load_error(tiny_model, monkeypatch) -> None:
    def broken(self, loops=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("a broken kernel")

    monkeypatch.setattr(Scheduler, "warm_up", broken)
    with running_server(lambda: tiny_model, warm_up=True) as url:
        health = wait_for_health(url)
        assert health.status_code == 503
        assert health.json()["error"]["message"] == "the model failed to warm up: a broken kernel"
        r = httpx.post(f"{url}/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["message"] == "the model failed to warm up: a broken kernel"


@pytest.mark.parametrize("warm_up", [None, False])
def test_no_warm_up_on_the_cpu_by_default_or_when_turned_off(tiny_model, monkeypatch, warm_up) -> None:
    calls: list[object] = []
    monkeypatch.setattr(Scheduler, "warm_up", lambda self, loops=None: calls.append(self))
    assert tiny_model.device.type == "cpu"
    with running_server(lambda: tiny_model, warm_up=warm_up) as url:
        assert wait_for_health(url).status_code == 200
    assert calls == []


def test_the_cli_passes_the_warm_up_depths_and_refuses_what_cannot_run(monkeypatch, capsys) -> None:
    parser = build_parser()
    assert parser.parse_args([]).warm_up_loops is None
    assert parser.parse_args(["--warm-up-loops", "8,2"]).warm_up_loops == [2, 8]
    passed: list[Any] = []

    def serve(model, sock, **options):  # type: ignore[no-untyped-def]
        sock.close()
        passed.append((options["warm_up"], options["warm_up_loops"]))

    monkeypatch.setattr("tinyloop.serve.server.serve", serve)
    assert main(["tiny", "serve", "--port", "0", "--warm-up-loops", "2,4"]) == 0
    assert passed == [(None, [2, 4])]
    capsys.readouterr()
    for flags, message in ((["--warm-up-loops", "2", "--no-warm-up"], "drop --no-warm-up"),
                           (["--warm-up-loops", "2,9", "--max-loops", "8"], "--warm-up-loops 9 exceeds --max-loops 8"),
                           (["--warm-up-loops", "2,2"], "must be distinct positive integers")):  # fmt: skip
        assert main(["tiny", "serve", "--port", "0", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert len(passed) == 1


def test_warm_up_depths_warm_up_each_and_turn_the_warm_up_on(tiny_model, capsys) -> None:
    assert tiny_model.device.type == "cpu"  # where the warm-up is otherwise off
    with running_server(lambda: tiny_model, warm_up_loops=(2, 8), max_loops=8) as url:
        assert wait_for_health(url).status_code == 200
        r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy_text(tiny_model)
    logged = re.findall(r"warm-up: \d+\.\d s, decode steps of 4, 2, 1 rows at 2, 8 loops \(18 requests\)\n",
                        capsys.readouterr().err)  # fmt: skip
    assert len(logged) == 1
    with pytest.raises(ValueError, match="warm_up is False"):
        running_server(lambda: tiny_model, warm_up=False, warm_up_loops=(2,)).__enter__()
