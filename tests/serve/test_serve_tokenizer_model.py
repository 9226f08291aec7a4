"""A model with an embedded tokenizer (a converted Ouro checkpoint): its chat template, incremental text
while streaming, its end tokens, and /tokenize."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

import tinyloop
from families.family_helpers import copy_vectors
from serve_helpers import running_server


@pytest.fixture(scope="module")
def ouro(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[tinyloop.Model, str]]:
    from tinyloop.convert.from_hf import convert_hf

    root = tmp_path_factory.mktemp("ouro")
    path = root / "ouro.tinyloop"
    convert_hf(copy_vectors("ouro", root / "ouro-hf"), path, progress=False)
    with tinyloop.Model(Path(path), max_seq_len=256, device="cpu") as model:
        with running_server(model, max_batch=2, max_seq_len=128) as url:
            yield model, url


def test_chat_uses_the_template_and_streams_the_same_text(ouro: tuple[tinyloop.Model, str]) -> None:
    model, url = ouro
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "héllo wörld"}]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    ids = model.chat_prompt(messages)
    expected = model.generate(ids, 12, temperature=0, stop_tokens=list(model.tokenizer.stop_ids))
    assert whole.choices[0].message.content == model.decode(expected)
    assert whole.usage is not None and whole.usage.prompt_tokens == ids.size
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content
    tokenized = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    assert tokenized["tokens"] == ids.tolist()
    assert httpx.post(f"{url}/tokenize", json={"prompt": "héllo"}).json()["tokens"] == model.encode("héllo").tolist()


def test_lens_shows_each_tokens_text_and_bytes(ouro: tuple[tinyloop.Model, str]) -> None:
    model, url = ouro
    text = "héllo wörld €😀"
    body = httpx.post(f"{url}/v1/lens", json={"prompt": text, "loops": 2, "top_k": 2}, timeout=60).json()
    tokens = body["tokens"]
    assert [t["id"] for t in tokens] == model.encode(text).tolist()
    lens = model.score_logit_lens(model.encode(text), loops=2)
    assert [[row["top"][0]["id"] for row in p["iterations"]] for p in body["positions"]] == lens.argmax(-1).T.tolist()
    spelled = b"".join(bytes(t["bytes"]) for t in tokens if t["id"] != model.tokenizer.meta.bos_id)
    assert spelled.decode("utf-8") == text  # every token's bytes are known, partial ones included
    assert any(t["partial"] for t in tokens)  # the emoji's bytes are split over byte-level tokens
    for t in tokens:
        if t["partial"]:
            assert t["text"] == "".join(f"\\x{b:02X}" for b in t["bytes"])
        elif t["id"] != model.tokenizer.meta.bos_id:
            assert t["text"] == model.decode([t["id"]]) and "\ufffd" not in t["text"]
