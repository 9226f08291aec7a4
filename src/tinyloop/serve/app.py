"""`create_app(model, ...)`: the FastAPI application of `tinyloop MODEL serve` (OpenAI-compatible).

Text: a byte model's text is its UTF-8 bytes; a tokenizer model's is its embedded tokenizer's, decoded
incrementally while streaming. Chat prompts use the model's chat template; byte models use
`text.chat.PLAIN_TEMPLATE` (each message as `role: content` on its own line, then `assistant:`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from tinyloop import log
from tinyloop.serve.engine import ServeEngine
from tinyloop.serve.errors import APIError, error_body
from tinyloop.serve.explorer import STATIC, LensRequest, lens_report, sequence_ids, trajectory_report
from tinyloop.serve.generation import ChoiceRunner, End, Piece
from tinyloop.serve.metrics import ServerMetrics
from tinyloop.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
    engine_options,
    refuse_unsupported,
)
from tinyloop.serve.responses import chat_logprobs, completion_logprobs, usage
from tinyloop.text.bytes import ByteTokenizer
from tinyloop.text.chat import PLAIN_TEMPLATE, render_chat

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions


class ServerState:
    """The model, its engine and the server's metrics; `ready` once the model has loaded and, where warm_up is
    on (None: on CUDA, or where warm_up_loops names depths), its scheduler has warmed up at warm_up_loops."""

    def __init__(
        self,
        name: str | None,
        api_key: str | None,
        engine_options: dict[str, Any],
        warm_up: bool | None,
        warm_up_loops: tuple[int, ...] | None = None,
    ) -> None:
        self.name = name
        self.api_key = api_key
        self.engine_options = engine_options
        self.warm_up = warm_up
        self.warm_up_loops = warm_up_loops
        self.warming_up = False
        self.metrics = ServerMetrics()
        self.model: Any = None
        self.engine: Any = None
        self.runner: ChoiceRunner | None = None
        self.load_error: str | None = None
        self.created = int(time.time())

    def attach(self, model: Any, name: str) -> None:
        codec = model.tokenizer if model.has_tokenizer else ByteTokenizer()
        self.engine = ServeEngine(model, **self.engine_options)
        self.engine.start()
        wanted = (bool(self.warm_up_loops) or model.device.type == "cuda") if self.warm_up is None else self.warm_up
        if wanted:
            self.warming_up = True
            report = self.engine.scheduler.warm_up(self.warm_up_loops)
            self.warming_up = False
            log.info(f"warm-up: {report.seconds:.1f} s, decode steps of {', '.join(map(str, report.buckets))} rows "
                     f"at {', '.join(map(str, report.loops))} loops ({report.requests} requests)")  # fmt: skip
        self.codec = codec
        opts = self.engine_options
        threads = opts["max_batch"] + 2 * opts["max_queue"] + 8  # one per stream that may be waiting for a token
        self.runner = ChoiceRunner(self.engine, codec, self.metrics, codec.stop_ids, threads)
        self.name = self.name or name
        self.model = model

    def ready(self) -> ChoiceRunner:
        if self.runner is None:
            raise APIError(503, self.load_error or f"{self.not_ready()}; retry when GET /health answers 200")
        return self.runner

    def not_ready(self) -> str:
        """Why requests are refused: the load error, or the stage the model is in."""
        if self.load_error is not None:
            return self.load_error
        return "the model is warming up" if self.warming_up else "the model is still loading"


def create_app(
    model: Any,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_batch: int = 8,
    max_queue: int = 256,
    max_seq_len: int | None = None,
    max_loops: int | None = None,
    shutdown_grace_s: float = 10.0,
    warm_up: bool | None = None,
    warm_up_loops: Sequence[int] | None = None,
) -> FastAPI:
    """The server's application for `model` (a tinyloop.Model, or a function returning one, called on a
    background thread at startup: GET /health answers 503 until it returns). served_model_name: the id
    clients send as `model` (default: the model file's stem). api_key: required as `Authorization: Bearer`
    on /v1 and the tokenizer endpoints. max_batch / max_queue / max_seq_len / max_loops: the scheduler's
    rows, waiting requests, positions per request (default: the model's) and deepest loops (default: the
    model's default loops). shutdown_grace_s: what in-flight requests may take at shutdown. warm_up: run
    `Scheduler.warm_up` after loading, before GET /health answers 200 (None: where the model is on CUDA or
    warm_up_loops is given), at the depths warm_up_loops names (default: the model's default loops)."""
    if warm_up is False and warm_up_loops:
        raise ValueError("warm_up_loops names depths to warm up, but warm_up is False")
    engine_options = dict(max_batch=max_batch, max_queue=max_queue, max_seq_len=max_seq_len, max_loops=max_loops)
    depths = tuple(warm_up_loops) if warm_up_loops else None
    state = ServerState(served_model_name, api_key, engine_options, warm_up, depths)

    def load() -> None:
        try:
            loaded = model() if callable(model) and not hasattr(model, "generate") else model
            state.attach(loaded, _default_name(loaded))
        except Exception as exc:  # reported by /health and every endpoint instead of a dead server
            state.load_error = f"the model failed to {'warm up' if state.warming_up else 'load'}: {exc}"

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if hasattr(model, "generate"):
            load()
        else:
            threading.Thread(target=load, name="tinyloop-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.stop(timeout=shutdown_grace_s)

    app = FastAPI(title="tinyloop", lifespan=lifespan)
    app.state.tinyloop = state
    _install_error_handlers(app)

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {state.api_key}":
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")  # fmt: skip

    def checked(req: SamplingRequest) -> ChoiceRunner:
        runner = state.ready()
        if req.model != state.name:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{state.name}'",
                           param="model", code="model_not_found")  # fmt: skip
        refuse_unsupported(req)
        return runner

    @app.get("/health")
    def health() -> Response:
        if state.runner is None:
            return _error(APIError(503, state.not_ready()))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    def metrics() -> Response:
        counts = state.engine.counts() if state.runner is not None else {}  # not the warm-up's requests
        return Response(state.metrics.render(counts), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    def models() -> dict[str, Any]:
        state.ready()
        card = {"id": state.name, "object": "model", "created": state.created, "owned_by": "tinyloop",
                "max_model_len": state.engine.max_seq_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        state.ready()
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        ids = _encode(state, req.prompt) if req.prompt is not None else _chat_ids(state, req.messages or [])
        return {"tokens": ids.tolist(), "count": int(ids.size), "max_model_len": state.engine.max_seq_len}

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        state.ready()
        try:
            return {"prompt": state.model.decode(np.asarray(req.tokens, dtype=np.int64))}
        except ValueError as exc:
            raise APIError(400, str(exc), param="tokens") from None

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(req: CompletionRequest, http: Request) -> Response:
        runner = checked(req)
        prompts = _completion_prompts(state, req.prompt)
        default = COMPLETION_DEFAULT_MAX_TOKENS
        return await _serve(state, runner, http, req, prompts, "text_completion", default, req.logprobs)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(req: ChatRequest, http: Request) -> Response:
        runner = checked(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        prompt = _chat_ids(state, req.messages)
        k = (req.top_logprobs or 0) if req.logprobs else None
        return await _serve(state, runner, http, req, [prompt], "chat.completion", None, k)

    @app.get("/", include_in_schema=False)
    def explorer_page() -> Response:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    async def scored(req: LensRequest, report: Callable[[np.ndarray], dict[str, Any]]) -> dict[str, Any]:
        state.ready()
        if req.model is not None and req.model != state.name:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{state.name}'",
                           param="model", code="model_not_found")  # fmt: skip
        try:
            ids = sequence_ids(state.model, state.codec, req)
            body = await anyio.to_thread.run_sync(report, ids)  # the model's lock serialises it with decode steps
        except ValueError as exc:
            raise APIError(400, str(exc), param=_param_of_lens(str(exc))) from None
        return {**body, "model": state.name}

    @app.post("/v1/lens", dependencies=[Depends(authorize)])
    async def lens(req: LensRequest) -> dict[str, Any]:
        return await scored(req, lambda ids: lens_report(state.model, state.codec, ids, req.loops, req.top_k))

    @app.post("/v1/trajectory", dependencies=[Depends(authorize)])
    async def trajectory(req: LensRequest) -> dict[str, Any]:
        return await scored(req, lambda ids: trajectory_report(state.model, state.codec, ids, req.loops))

    return app


def _param_of_lens(message: str) -> str:
    if message.startswith("loops"):
        return "loops"
    return "tokens" if message.startswith(("token", "the sequence")) else "prompt"


async def _serve(
    state: ServerState,
    runner: ChoiceRunner,
    http: Request,
    req: SamplingRequest,
    prompts: list[np.ndarray],
    kind: str,
    default_max: int | None,
    logprobs: int | None,
) -> Response:
    """Submit n choices per prompt, then answer with one JSON body or an SSE stream."""
    arrival = time.perf_counter()
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    base = engine_options(req, 0, logprobs)  # the grammar compiled once for every choice
    if state.codec.stop_ids:
        base["stop_tokens"] = list(state.codec.stop_ids)
    jobs = []
    for prompt in prompts:
        room = state.engine.max_seq_len - int(prompt.size)
        max_tokens = requested if requested is not None else (default_max or room)
        for j in range(req.n):
            options = dict(base, max_tokens=max_tokens)
            if req.seed is not None:
                options["seed"] = req.seed + j  # choices differ, and repeat for the same seed
            jobs.append((prompt, options))

    def submit_all() -> list[Any]:  # on a worker thread: building a grammar's token index takes a while
        requests: list[Any] = []
        try:
            for prompt, options in jobs:
                requests.append(runner.submit(prompt, options))
        except BaseException:
            for r in requests:
                state.engine.abort(r)
            raise
        return requests

    requests = await anyio.to_thread.run_sync(submit_all)
    meta = {"id": f"{'chatcmpl' if kind != 'text_completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()), "model": state.name}  # fmt: skip
    prompt_tokens = sum(int(p.size) for p in prompts)
    events = runner.merged(requests, arrival)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        sse = _sse(
            state,
            kind,
            meta,
            events,
            len(requests),
            prompt_tokens,
            include_usage,
            logprobs,
            bool(getattr(req, "return_token_ids", False)),
        )
        return StreamingResponse(sse, media_type="text/event-stream")
    texts = ["" for _ in requests]
    records: list[list[Any]] = [[] for _ in requests]
    ends: dict[int, End] = {}

    async def collect() -> None:
        async for event in events:
            if isinstance(event, Piece):
                texts[event.index] += event.text
                records[event.index].extend(zip(event.tokens, event.logprobs, strict=False))
            else:
                ends[event.index] = event

    if not await _until_done_or_gone(collect(), http):
        return Response(status_code=499)  # the client left; its requests were aborted (nobody reads this)
    choices = []
    for i, text in enumerate(texts):
        choice: dict[str, Any] = {"index": i, "finish_reason": ends[i].finish_reason}
        if kind == "text_completion":
            choice["text"] = text
            lp = completion_logprobs(state.codec, records[i], logprobs) if logprobs is not None else None
            choice["logprobs"] = lp
        else:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = chat_logprobs(state.codec, records[i]) if logprobs is not None else None
        choices.append(choice)
    body = {**meta, "object": kind, "choices": choices,
            "usage": usage(prompt_tokens, [e.stats for e in ends.values()])}  # fmt: skip
    return JSONResponse(body)


async def _sse(
    state: ServerState,
    kind: str,
    meta: dict[str, Any],
    events: AsyncIterator[Piece | End],
    n: int,
    prompt_tokens: int,
    include_usage: bool,
    logprobs: int | None,
    token_ids: bool = False,
) -> AsyncIterator[str]:
    """The SSE stream. token_ids (tinyloop's extension): each chunk's choice also carries the ids of the
    tokens it holds, and the finishing chunk `token_loops`, the iterations each generated token ran."""
    chunk_kind = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
    extra = {"usage": None} if include_usage else {}

    def chunk(choice: dict[str, Any]) -> str:
        return f"data: {json.dumps({**meta, 'object': chunk_kind, 'choices': [choice], **extra})}\n\n"

    def choice(index: int, text: str | None, reason: str | None, lp: Any = None) -> dict[str, Any]:
        if kind == "text_completion":
            return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": reason}
        delta = {} if text is None else {"content": text}
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}

    stats = []
    try:
        if kind != "text_completion":
            for i in range(n):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})  # fmt: skip
        async for event in events:
            if isinstance(event, Piece):
                lp = None
                if logprobs is not None and event.tokens:
                    pairs = list(zip(event.tokens, event.logprobs, strict=False))
                    lp = (completion_logprobs(state.codec, pairs, logprobs) if kind == "text_completion"
                          else chat_logprobs(state.codec, pairs))  # fmt: skip
                if event.text or lp is not None or (token_ids and event.tokens):
                    body = choice(event.index, event.text, None, lp)
                    yield chunk({**body, "token_ids": event.tokens} if token_ids else body)
            else:
                stats.append(event.stats)
                body = choice(event.index, None, event.finish_reason)
                yield chunk({**body, "token_loops": event.stats.token_loops} if token_ids else body)
        if include_usage:
            body = {**meta, "object": chunk_kind, "choices": [], "usage": usage(prompt_tokens, stats)}
            yield f"data: {json.dumps(body)}\n\n"
    except APIError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    except Exception as exc:  # mid-stream the status is sent already: the error goes as an event
        yield f"data: {json.dumps(error_body(500, f'{type(exc).__name__}: {exc}'))}\n\n"
    yield "data: [DONE]\n\n"


async def _until_done_or_gone(work: Any, http: Request, poll_s: float = 0.25) -> bool:
    """Run `work`; if the client disconnects first, cancel it (which aborts its requests) and return False."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                task.result()  # re-raises the work's error (an APIError becomes the response)
                return True
            if await http.is_disconnected():
                return False
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _default_name(model: Any) -> str:
    from pathlib import Path

    return Path(str(model.path)).stem if getattr(model, "path", None) else "tinyloop"


def _encode(state: ServerState, text: str) -> np.ndarray:
    try:
        ids = state.codec.encode(text)
    except ValueError as exc:
        raise APIError(400, str(exc), param="prompt") from None
    return np.asarray(ids, dtype=np.int32)


def _completion_prompts(state: ServerState, prompt: Any) -> list[np.ndarray]:
    """A completion's prompts: a str, a list of str, a token list or a list of token lists."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt")
    vocab = state.model.config["vocab_size"]
    out = []
    for item in items:
        ids = _encode(state, item) if isinstance(item, str) else np.asarray(item, dtype=np.int64)
        if ids.size == 0:
            raise APIError(400, "prompt must hold at least one token", param="prompt")
        if ids.min() < 0 or ids.max() >= vocab:
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        out.append(ids.astype(np.int32))
    return out


def _chat_ids(state: ServerState, messages: list[Any]) -> np.ndarray:
    plain = []
    for m in messages:
        content = m.content
        if isinstance(content, list):  # content parts: only text parts are understood
            if any(part.get("type") != "text" for part in content):
                raise APIError(400, "only text content parts are supported", param="messages")
            content = "".join(str(part.get("text", "")) for part in content)
        plain.append({"role": m.role, "content": content or ""})
    try:
        if state.model.has_tokenizer:
            ids = state.model.chat_prompt(plain)
        else:
            ids = state.codec.encode(render_chat(PLAIN_TEMPLATE, plain))
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    return np.asarray(ids, dtype=np.int32)


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return _error(exc)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return _error(APIError(400, message, param=loc[0] if loc else None))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    handlers: dict[Any, Callable[..., Any]] = {
        APIError: api_error, RequestValidationError: validation_error, HTTPException: http_error,
    }  # fmt: skip
    for kind, handler in handlers.items():
        app.add_exception_handler(kind, handler)
