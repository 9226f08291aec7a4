"""Request bodies of the OpenAI API (the fields tinyloop reads), and their translation into engine options.

Unknown fields are ignored, as OpenAI-compatible servers do; a field tinyloop cannot honour with a
non-default value (penalties, logit_bias, tools, echo, best_of) is refused (HTTP 400) instead of ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tinyloop.grammar import Grammar
from tinyloop.serve.errors import APIError


class StreamOptions(BaseModel):
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingRequest(BaseModel):
    """Fields common to /v1/completions and /v1/chat/completions (looped-model controls included)."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # looped-model controls (extra_body in the openai client)
    loops: int | None = None
    top_k: int = 0
    exit_threshold: float | None = None
    exit_criterion: str | None = None
    exit_tol: float | None = None
    min_loops: int | None = None
    l_warmup_tokens: int = 0
    l_warmup_loops: int = 2
    regex: str | None = None
    return_token_ids: bool = False  # streams: each chunk's token ids and, at the end, each token's loops


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def refuse_unsupported(req: SamplingRequest) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise APIError(400, f"{name} is not supported (leave it 0)", param=name)
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of not in (None, req.n):
            raise APIError(400, "best_of must equal n (or be left out)", param="best_of")
    if isinstance(req, ChatRequest) and req.tools:
        raise APIError(400, "tools are not supported", param="tools")


def grammar_of(req: SamplingRequest) -> Grammar | None:
    """The grammar response_format or regex asks for (invalid schemas and patterns: HTTP 400)."""
    fmt = req.response_format
    if req.regex is not None and fmt is not None and fmt.type != "text":
        raise APIError(400, "give either regex or response_format, not both", param="regex")
    try:
        if req.regex is not None:
            return Grammar(req.regex)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Grammar.from_json_schema({"type": "object"})
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema (an object)", "response_format")
        return Grammar.from_json_schema(schema)
    except ValueError as exc:
        param = "regex" if req.regex is not None else "response_format"
        raise APIError(400, str(exc), param=param) from None


def engine_options(req: SamplingRequest, max_tokens: int, logprobs: int | None) -> dict[str, Any]:
    """Keyword arguments of Model.generate (or the exit options) for one choice of `req`."""
    options: dict[str, Any] = {
        "max_tokens": max_tokens, "loops": req.loops, "temperature": req.temperature, "top_k": req.top_k,
        "top_p": req.top_p, "seed": req.seed, "stop": req.stop or None, "grammar": grammar_of(req),
        "l_warmup_tokens": req.l_warmup_tokens, "l_warmup_loops": req.l_warmup_loops, "logprobs": logprobs,
    }  # fmt: skip
    for name in ("exit_threshold", "exit_criterion", "exit_tol", "min_loops"):
        value = getattr(req, name)
        if value is not None:
            options[name] = value
    return options
