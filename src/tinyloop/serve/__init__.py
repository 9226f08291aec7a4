"""`tinyloop MODEL serve`: an OpenAI-compatible HTTP server (needs the `serve` extra: fastapi, uvicorn,
prometheus-client). `create_app(model, ...)` builds the application for embedding in another server."""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def create_app(model: Any, **options: Any) -> Any:
    """The FastAPI application serving `model` (see tinyloop.serve.app.create_app for the options)."""
    from tinyloop.serve.app import create_app as build

    return build(model, **options)
