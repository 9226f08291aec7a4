"""`tinyloop MODEL serve`: the OpenAI-compatible HTTP server (tinyloop.serve) on one host and port."""

from __future__ import annotations

import argparse
import importlib.util
import signal
import socket
import sys
import threading
from typing import Any

from tinyloop.cli.args import (
    CliError,
    Parser,
    add_device_arguments,
    loop_count,
    loops_list,
    non_negative_float,
    positive_int,
    torch_dtype,
)

SERVE_MODULES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client"}


def build_parser() -> Parser:
    p = Parser(prog="tinyloop serve", description="Serve the model over the OpenAI HTTP API (/v1/completions, "
               "/v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize).")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000; 0 picks a free one)")
    p.add_argument("--max-batch", type=positive_int, default=8, help="requests decoded together (default: 8)")
    p.add_argument("--max-queue", type=positive_int, default=256,
                   help="requests waiting at most; more are refused with HTTP 503 (default: 256)")  # fmt: skip
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and tokenizer endpoints")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the file's stem)")
    p.add_argument(
        "--max-seq-len",
        type=positive_int,
        default=None,
        help="positions per request (default: the model's)",
    )
    p.add_argument(
        "--max-loops",
        type=loop_count,
        default=None,
        help="deepest loops a request may ask (default: the model's default loops)",
    )
    add_device_arguments(p)
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                   help="before GET /health answers 200, run a few requests through every decode batch size, so that "
                   "kernel compiles and CUDA graph captures are not paid by the first requests (default: on CUDA "
                   "only)")  # fmt: skip
    p.add_argument("--warm-up-loops", type=loops_list, default=None, metavar="L1,L2,...",
                   help="the depths the warm-up covers, each at most --max-loops: a GPU captures a decode graph per "
                   "batch size and depth (default: the model's default loops; implies --warm-up)")  # fmt: skip
    p.add_argument("--shutdown-grace", type=non_negative_float, default=10.0, metavar="S",
                   help="on SIGTERM/SIGINT: seconds in-flight requests may take to finish before they are aborted "
                   "(default: 10)")  # fmt: skip
    ray = p.add_argument_group("replicas on Ray Serve (the 'ray' extra)")
    ray.add_argument("--ray", action="store_true", help="serve through Ray Serve: the same API from --replicas copies")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="the cluster to join (default: RAY_ADDRESS, else a local Ray instance)")  # fmt: skip
    ray.add_argument("--replicas", type=positive_int, default=1,
                     help="replicas (with --autoscale: the most; default: 1)")  # fmt: skip
    ray.add_argument("--num-gpus", type=non_negative_float, default=0.0, help="GPUs per replica (default: 0)")
    ray.add_argument("--autoscale", action="store_true",
                     help="scale 1..--replicas on requests in flight per replica (target: --max-batch)")  # fmt: skip
    return p


def run_serve(path: str, argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    missing = [pip for module, pip in SERVE_MODULES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise CliError(f"tinyloop serve needs the 'serve' extra: pip install 'loopformer[serve]' "
                       f"(missing: {', '.join(missing)})", code=1)  # fmt: skip
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in [0, 65535], got {args.port}")
    if args.warm_up_loops and args.warm_up is False:
        raise CliError("--warm-up-loops names depths to warm up; drop --no-warm-up")
    if args.warm_up_loops and args.max_loops is not None and max(args.warm_up_loops) > args.max_loops:
        raise CliError(f"--warm-up-loops {max(args.warm_up_loops)} exceeds --max-loops {args.max_loops}")
    if args.ray:
        return _serve_on_ray(path, args)
    if args.ray_address is not None or args.replicas != 1 or args.num_gpus or args.autoscale:
        raise CliError("--ray-address, --replicas, --num-gpus and --autoscale need --ray")
    sock = _listening_socket(args.host, args.port)  # before loading: a taken port is one line, at once
    from tinyloop.api.model import Model
    from tinyloop.serve.server import serve

    def load() -> Model:
        return Model(path, max_seq_len=args.max_seq_len, device=args.device, dtype=torch_dtype(args.dtype, args.device))

    host, port = sock.getsockname()[:2]
    print(f"tinyloop serve: listening on http://{host}:{port} (OpenAI API under /v1; GET /health answers 200 "
          "once the model is ready)", file=sys.stderr, flush=True)  # fmt: skip
    serve(load, sock, served_model_name=args.served_model_name, api_key=args.api_key, max_batch=args.max_batch,
          max_queue=args.max_queue, max_loops=args.max_loops, shutdown_grace_s=args.shutdown_grace,
          warm_up=args.warm_up, warm_up_loops=args.warm_up_loops)  # fmt: skip
    return 0


def _listening_socket(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise CliError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", code=1) from None
    sock.set_inheritable(True)
    return sock


def _serve_on_ray(path: str, args: Any) -> int:
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise CliError("serve --ray needs the 'ray' extra: pip install 'loopformer[ray]'", code=1)
    if args.port == 0:
        raise CliError("serve --ray needs a fixed --port (Ray Serve's proxy binds it on every node)")
    import ray
    from ray import serve

    from tinyloop.integrations.ray import serve_application

    app = serve_application(
        path, replicas=args.replicas, num_gpus=args.num_gpus, autoscale=args.autoscale,
        model_options={"max_seq_len": args.max_seq_len, "device": args.device,
                       "dtype": torch_dtype(args.dtype, args.device)},
        served_model_name=args.served_model_name, api_key=args.api_key, max_batch=args.max_batch,
        max_queue=args.max_queue, max_seq_len=args.max_seq_len, max_loops=args.max_loops,
        shutdown_grace_s=args.shutdown_grace, warm_up=args.warm_up, warm_up_loops=args.warm_up_loops,
    )  # fmt: skip
    ray.init(address=args.ray_address, log_to_driver=False)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name="tinyloop", route_prefix="/")
        print(f"tinyloop serve: {args.replicas} replica(s) on Ray Serve at http://{args.host}:{args.port} (OpenAI API "
              "under /v1; Ctrl-C stops them)", file=sys.stderr, flush=True)  # fmt: skip
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        serve.shutdown()
        ray.shutdown()
    return 0
