"""Fixtures of the serve tests: the built-in model and a real server around it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import tinyloop
from serve_helpers import running_server
from shared_data import require_module

for _name in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):  # the serve and dev extras
    require_module(_name)


@pytest.fixture(scope="session")
def tiny_model() -> tinyloop.Model:
    return tinyloop.Model("tiny")


@pytest.fixture(scope="module")
def base_url(tiny_model: tinyloop.Model) -> Iterator[str]:
    with running_server(tiny_model) as url:
        yield url
