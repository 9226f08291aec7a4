"""Load test of `tinyloop serve` on the loopback interface (bounded in requests and time).

Starts the server in this process (uvicorn on 127.0.0.1, a free port) around a model (default: the
built-in `tiny`), then N concurrent streaming clients send M greedy completion requests in total, drawn
from U distinct prompts. Each output (its token ids) must equal that prompt's single-request output (Model.generate,
computed first): a lost, cut or mixed-up request fails the run. Reports requests/s, generated tokens/s,
TTFT and latency percentiles (client-side), and the server's running / waiting requests and the process
RSS after the run against after the first burst. The first burst (one request per client, sent as soon as
GET /health answers 200) is reported apart: with `--no-warm-up` on a GPU it pays the kernel compiles and
graph captures that the server's warm-up (`--warm-up`, the default on CUDA) pays before it reports ready.

    python bench/serve_load.py --clients 16 --requests 200 [--warm-up | --no-warm-up]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import resource
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import uvicorn

sys.path.insert(0, str(Path(__file__).absolute().parent.parent / "src"))

import tinyloop  # noqa: E402
from tinyloop.serve import create_app  # noqa: E402

WORDS = "the loop runs its middle block again and again until the answer settles into place".split()


def prompts(count: int) -> list[str]:
    """Distinct prompts of varied length (deterministic)."""
    rng = np.random.default_rng(0)
    return [f"{i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(2, 24)))) for i in range(count)]


def rss_mib() -> float:
    """The process's resident memory now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def engine_only(
    model: tinyloop.Model, jobs: list[str], clients: int, max_tokens: int, args: argparse.Namespace
) -> float:
    """Tokens/s of the same jobs through tinyloop.Scheduler directly (no HTTP), `clients` threads at a time."""
    pending = list(enumerate(jobs))
    lock = threading.Lock()
    tokens = [0]
    with tinyloop.Scheduler(model, args.max_batch, args.max_seq_len, max_queue=len(jobs)) as scheduler:

        def worker() -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    _, prompt = pending.pop()
                out = scheduler.submit(model.encode(prompt), max_tokens, temperature=0).result()
                with lock:
                    tokens[0] += len(out)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return tokens[0] / (time.perf_counter() - t0)


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[list[int], float, float, int]:
    """The streamed token ids (tinyloop's return_token_ids extension: exact for any vocabulary, where a model
    without a tokenizer has no text for ids past 256), the time to the first token, the latency and the count."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}  # fmt: skip
    t0 = time.perf_counter()
    ttft = None
    ids: list[int] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and chunk["choices"][0].get("token_ids"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                ids.extend(chunk["choices"][0]["token_ids"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if ttft is None:
        raise RuntimeError(f"no token streamed for prompt {prompt!r}")
    return ids, ttft, time.perf_counter() - t0, tokens


async def run_clients(url: str, jobs: list[str], clients: int, max_tokens: int, limit_s: float) -> list[tuple]:
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for i, p in enumerate(jobs):
        queue.put_nowait((i, p))
    results: list[tuple] = [None] * len(jobs)  # type: ignore[list-item]

    async def client_loop() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=limit_s) as client:
            while not queue.empty():
                i, p = queue.get_nowait()
                results[i] = (p, *await one_request(client, p, max_tokens))

    await asyncio.wait_for(asyncio.gather(*(client_loop() for _ in range(clients))), limit_s)
    return results


def wait_until_ready(server: uvicorn.Server, url: str, deadline: float) -> float:
    """When GET /health first answered 200 (the model loaded and, with warm-up, warmed up)."""
    while time.perf_counter() < deadline:
        if server.started and httpx.get(f"{url}/health").status_code == 200:
            return time.perf_counter()
        time.sleep(0.05)
    raise TimeoutError("the server did not report ready within --limit-s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--unique", type=int, default=32, help="distinct prompts (each checked against generate)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--baseline", action="store_true", help="also time the same jobs through the Scheduler directly")
    ap.add_argument("--limit-s", type=float, default=600.0, help="abort the run after this many seconds")
    ap.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                    help="the server's warm-up before it reports ready (default: on CUDA only)")  # fmt: skip
    args = ap.parse_args()
    if not (0 < args.clients <= 256 and 0 < args.requests <= 10_000 and 0 < args.unique <= args.requests):
        ap.error("need 0 < clients <= 256, 0 < unique <= requests <= 10000")

    model = tinyloop.Model(args.model)
    texts = prompts(args.unique)
    print(f"references: {args.unique} prompts through Model.generate alone ...", file=sys.stderr)
    reference = {p: model.generate(model.encode(p), args.max_tokens, temperature=0).tolist() for p in texts}

    app = create_app(model, served_model_name="tiny", max_batch=args.max_batch, max_queue=args.requests,
                     max_seq_len=args.max_seq_len, warm_up=args.warm_up)  # fmt: skip
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # loopback only
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    started = time.perf_counter()
    try:
        ready_s = wait_until_ready(server, url, started + args.limit_s) - started
        t0 = time.perf_counter()
        first = asyncio.run(run_clients(url, texts[: args.clients], args.clients, args.max_tokens, args.limit_s))
        first_wall = time.perf_counter() - t0
        rss_warm = rss_mib()
        jobs = [texts[i % args.unique] for i in range(args.requests)]
        t0 = time.perf_counter()
        results = asyncio.run(run_clients(url, jobs, args.clients, args.max_tokens, args.limit_s))
        wall = time.perf_counter() - t0
        metrics = httpx.get(f"{url}/metrics").text
        counts = app.state.tinyloop.engine.counts()
        rss_after = rss_mib()
    finally:
        server.should_exit = True
        thread.join(30)
    baseline = engine_only(model, jobs, args.clients, args.max_tokens, args) if args.baseline else None
    wrong = [p for p, ids, *_ in [*first, *results] if ids != reference[p]]
    ttft = np.array([r[2] for r in results]) * 1000
    latency = np.array([r[3] for r in results]) * 1000
    tokens = sum(r[4] for r in results)
    report = {
        "model": args.model, "clients": args.clients, "requests": args.requests, "unique_prompts": args.unique,
        "max_tokens": args.max_tokens, "max_batch": args.max_batch, "device": str(model.device),
        "server_warm_up": args.warm_up, "ready_s": round(ready_s, 2), "first_burst_wall_s": round(first_wall, 2),
        "first_burst_ttft_ms_p50": round(float(np.percentile([r[2] for r in first], 50)) * 1000, 1),
        "first_burst_ttft_ms_max": round(max(r[2] for r in first) * 1000, 1),
        "wall_s": round(wall, 2),
        "requests_per_s": round(args.requests / wall, 2), "tokens_per_s": round(tokens / wall, 1),
        "ttft_ms_p50": round(float(np.percentile(ttft, 50)), 1),
        "ttft_ms_p99": round(float(np.percentile(ttft, 99)), 1),
        "latency_ms_p50": round(float(np.percentile(latency, 50)), 1),
        "latency_ms_p99": round(float(np.percentile(latency, 99)), 1),
        "outputs_equal_to_alone": len(first) + len(results) - len(wrong), "mismatched": len(wrong),
        "running_after": counts["running"], "waiting_after": counts["waiting"],
        "engine_only_tokens_per_s": None if baseline is None else round(baseline, 1),
        "rss_mib_after_first_burst": round(rss_warm, 1), "rss_mib_after_run": round(rss_after, 1),
        "prefix_hit_tokens": counts.get("prefix_hit_tokens", 0),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch_threads": _threads(),
    }  # fmt: skip
    print(json.dumps(report, indent=1))
    assert "tinyloop_requests_running 0.0" in metrics
    return 1 if wrong or counts["running"] or counts["waiting"] else 0


def _threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    sys.exit(main())
