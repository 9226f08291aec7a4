"""Ray Serve on 127.0.0.1 (ray.init(num_cpus=2)): the deployment answers the OpenAI client as the
single-process server does."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from serve_helpers import running_server
from shared_data import require_module

for _name in ("ray", "fastapi", "uvicorn", "openai", "httpx"):
    require_module(_name)

import httpx  # noqa: E402
import openai  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

import tinyloop  # noqa: E402
from tinyloop.integrations.ray import serve_application  # noqa: E402

SEQ = 128
OPTIONS = {"served_model_name": "tiny", "max_batch": 2, "max_seq_len": SEQ}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def single_server() -> Iterator[str]:
    with running_server(tinyloop.Model("tiny", max_seq_len=SEQ), **OPTIONS) as url:
        yield url


@contextmanager
def ray_serve(replicas: int) -> Iterator[str]:
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = serve_application("tiny", replicas=replicas, num_cpus=0.5, model_options={"max_seq_len": SEQ}, **OPTIONS)
        serve.run(app, name="tinyloop", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/health", timeout=10).status_code != 200:  # replicas load the model in the background
            assert time.monotonic() < deadline, "the replicas did not load the model"
            time.sleep(0.5)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def answers(url: str) -> list[object]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    out: list[object] = []
    for prompt in ("The loop ", "Once upon"):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
        out.append((r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens if r.usage else None))
    r = client.completions.create(model="tiny", prompt="Seeded ", max_tokens=6, temperature=0.9, seed=5)
    out.append(r.choices[0].text)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0)  # fmt: skip
    out.append(chat.choices[0].message.content)
    stream = client.completions.create(model="tiny", prompt="The loop ", max_tokens=6, temperature=0, stream=True)
    out.append("".join(c.choices[0].text for c in stream))
    return out


def test_ray_serve_answers_the_openai_client_like_the_single_server() -> None:
    with single_server() as url:
        expected = answers(url)
    with ray_serve(replicas=2) as url:
        got = answers(url)
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
    assert got == expected
    assert expected[0][1] == "length" and expected[0][2] == 6
    assert models["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("flags", [["--replicas", "2"], ["--autoscale"], ["--num-gpus", "1"]])
def test_cli_ray_flags_need_ray(flags, capsys) -> None:
    from tinyloop.cli.main import main

    assert main(["tiny", "serve", *flags]) == 2
    assert "need --ray" in capsys.readouterr().err
