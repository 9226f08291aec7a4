"""The server through the official OpenAI client: completions and chat, streaming and not, sampling controls."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import numpy as np
import openai
import pytest

import tinyloop


def text_of(model: tinyloop.Model, prompt: bytes, max_tokens: int, **kwargs: object) -> str:
    ids = model.generate(np.frombuffer(prompt, dtype=np.uint8).astype(np.int32), max_tokens, **kwargs)
    return bytes(ids.astype(np.uint8)).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def sse_events(base_url: str, path: str, body: dict[str, object]) -> list[str]:
    with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]


def test_greedy_completion_equals_model_generate_and_has_logprobs(client: openai.OpenAI, tiny_model) -> None:
    r = client.completions.create(model="tiny", prompt="The loop ", max_tokens=8, temperature=0, logprobs=2)
    choice = r.choices[0]
    assert choice.text == text_of(tiny_model, b"The loop ", 8, temperature=0)
    assert choice.finish_reason == "length"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (9, 8)
    lp = choice.logprobs
    assert lp is not None and "".join(lp.tokens) == choice.text and len(lp.token_logprobs) == 8
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprob)  # greedy takes the most likely
        assert top[token] == pytest.approx(logprob)


def test_streamed_completion_equals_the_whole_one_sync_and_async(client: openai.OpenAI, base_url: str) -> None:
    body = dict(model="tiny", prompt="Once upon", max_tokens=10, temperature=0)
    whole = client.completions.create(**body).choices[0].text
    pieces = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in pieces) == whole
    assert pieces[-1].choices[0].finish_reason == "length"

    async def run() -> tuple[str, str]:
        aclient = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        plain = await aclient.completions.create(**body)
        stream = await aclient.completions.create(**body, stream=True)
        streamed = "".join([c.choices[0].text async for c in stream])
        await aclient.close()
        return plain.choices[0].text, streamed

    assert asyncio.run(run()) == (whole, whole)


def test_chat_stream_role_first_content_usage_then_done(client: openai.OpenAI, base_url: str, tiny_model) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    prompt = b"system: Be brief.\nuser: Hello\nassistant:"  # the plain template of byte models
    assert whole.choices[0].message.content == text_of(tiny_model, prompt, 6, temperature=0)
    body = dict(model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True,
                stream_options={"include_usage": True})  # fmt: skip
    events = sse_events(base_url, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole.choices[0].message.content
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_stop_strings_end_the_text_before_the_stop(client: openai.OpenAI, tiny_model) -> None:
    full = text_of(tiny_model, b"The loop ", 12, temperature=0)
    stop = full[4:6]
    assert stop and full.index(stop) == 4  # the first occurrence: the text ends just before it
    r = client.completions.create(model="tiny", prompt="The loop ", max_tokens=12, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[:4], "stop")


def test_same_seed_same_text_and_n_choices(client: openai.OpenAI) -> None:
    body = dict(model="tiny", prompt="A", max_tokens=12, temperature=1.0, seed=11, n=2)
    first = client.completions.create(**body)
    again = client.completions.create(**body)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text  # each choice its own draw
    assert first.usage is not None and first.usage.completion_tokens == 24


def test_chat_logprobs_with_top_alternatives(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and "".join(c.token for c in content) == r.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob) and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode()) or entry.token == "\ufffd"


def test_response_format_json_schema_gives_valid_json(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Answer in JSON"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_extra_body_loops_and_depth_statistics(client: openai.OpenAI, tiny_model) -> None:
    r = client.completions.create(model="tiny", prompt="The loop ", max_tokens=6, temperature=0,
                                  extra_body={"loops": 2})  # fmt: skip
    assert r.choices[0].text == text_of(tiny_model, b"The loop ", 6, temperature=0, loops=2)
    assert r.usage is not None and r.usage.model_extra["loops_per_token"] == 2.0
    warm = client.completions.create(model="tiny", prompt="The loop ", max_tokens=4, temperature=0,
                                     extra_body={"loops": 4, "l_warmup_tokens": 2, "l_warmup_loops": 1})  # fmt: skip
    assert warm.usage is not None and warm.usage.model_extra["loops_per_token"] == (4 + 1 + 1 + 4) / 4


def test_models_health_tokenize_detokenize(client: openai.OpenAI, base_url: str) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{base_url}/health").status_code == 200
    ids = httpx.post(f"{base_url}/tokenize", json={"prompt": "héllo"}).json()
    assert ids["tokens"] == list("héllo".encode()) and ids["count"] == 6
    back = httpx.post(f"{base_url}/detokenize", json={"tokens": ids["tokens"]}).json()
    assert back == {"prompt": "héllo"}


def test_exit_criterion_in_extra_body_reports_its_depth(client: openai.OpenAI, tiny_model, base_url: str) -> None:
    extra = {"loops": 8, "exit_criterion": "kl", "exit_tol": 1e9}  # any KL passes: each token stops at min_loops
    r = client.completions.create(model="tiny", prompt="The loop ", max_tokens=4, temperature=0, extra_body=extra)
    ids = np.frombuffer(b"The loop ", dtype=np.uint8).astype(np.int32)
    expected = tiny_model.generate_tokens(ids, 4, 8, temperature=0, exit_criterion="kl", exit_tol=1e9)
    assert r.choices[0].text == bytes(expected.astype(np.uint8)).decode("utf-8", errors="replace")
    depths = tiny_model.last_family_stats.exit_depths
    assert r.usage is not None and r.usage.model_extra["loops_per_token"] == pytest.approx(sum(depths) / len(depths))
    assert r.usage.model_extra["loops_per_token"] < 8
    rate = re.search(r"^tinyloop_early_exit_rate (\S+)$", httpx.get(f"{base_url}/metrics").text, re.MULTILINE)
    assert rate is not None and float(rate.group(1)) > 0
