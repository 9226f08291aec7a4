"""POST /v1/lens and /v1/trajectory against Model.score_logit_lens / score_with_uncertainty /
score_trajectory, the stream's token ids and per-token loops, and the explorer page's files."""

from __future__ import annotations

import json

import httpx
import numpy as np

import tinyloop

PROMPT = "Loops é€!"  # multi-byte characters: a byte model shows their bytes as partial tokens


def _softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_lens_equals_score_logit_lens_and_score_with_uncertainty(tiny_model: tinyloop.Model, base_url: str) -> None:
    body = httpx.post(f"{base_url}/v1/lens", json={"prompt": PROMPT, "loops": 5, "top_k": 3}, timeout=60).json()
    ids = tiny_model.encode(PROMPT)
    assert [t["id"] for t in body["tokens"]] == ids.tolist() and body["loops"] == 5 and body["top_k"] == 3
    lens = tiny_model.score_logit_lens(ids, loops=5)  # [L, T, V]
    probs = _softmax(lens)
    scores = tiny_model.score_with_uncertainty(ids, loops=5)
    assert len(body["positions"]) == ids.size
    for t, position in enumerate(body["positions"]):
        assert len(position["iterations"]) == 5
        tops = [row["top"][0]["id"] for row in position["iterations"]]
        assert tops == lens[:, t].argmax(-1).tolist()
        assert position["top1_changes"] == int((np.diff(tops) != 0).sum())
        assert all(top == tops[-1] for top in tops[position["settled_at"] - 1 :])
        assert position["settled_at"] == 1 or tops[position["settled_at"] - 2] != tops[-1]
        for i, row in enumerate(position["iterations"]):
            expected = np.argsort(-probs[i, t], kind="stable")[:3]
            assert [c["id"] for c in row["top"]] == expected.tolist()
            np.testing.assert_allclose([c["prob"] for c in row["top"]], probs[i, t, expected], rtol=1e-6)
            p = probs[i, t]
            np.testing.assert_allclose(row["entropy"], -(p * np.log(p)).sum(), rtol=1e-6)
            if i == 0:
                assert row["kl_prev"] is None
            else:
                np.testing.assert_allclose(row["kl_prev"], scores.kl[i - 1, t], rtol=1e-3, atol=1e-6)
        np.testing.assert_allclose(position["iterations"][-1]["entropy"], scores.entropy[t], rtol=1e-4)
    text = [t["text"] for t in body["tokens"]]
    assert text[:6] == ["L", "o", "o", "p", "s", " "]
    assert text[6:8] == ["\\xC3", "\\xA9"] and body["tokens"][6]["partial"]  # é = C3 A9, one byte per token
    assert b"".join(bytes(t["bytes"]) for t in body["tokens"]).decode() == PROMPT


def test_trajectory_equals_score_trajectory(tiny_model: tinyloop.Model, base_url: str) -> None:
    ids = tiny_model.encode(PROMPT)
    body = httpx.post(f"{base_url}/v1/trajectory", json={"tokens": ids.tolist(), "loops": 4}, timeout=60).json()
    states = tiny_model.score_trajectory(ids, loops=4).astype(np.float64)[1:]  # prelude output, then each loop
    np.testing.assert_allclose(body["state_norm"], np.linalg.norm(states[1:], axis=-1), rtol=1e-5)
    step = np.linalg.norm(states[1:] - states[:-1], axis=-1) / np.linalg.norm(states[:-1], axis=-1)
    np.testing.assert_allclose(body["relative_step"], step, rtol=1e-5)
    scores = tiny_model.score_with_uncertainty(ids, loops=4)
    np.testing.assert_allclose(body["kl"], scores.kl, rtol=1e-6)
    np.testing.assert_allclose(body["entropy"], scores.entropy, rtol=1e-6)
    assert body["loops"] == 4 and len(body["tokens"]) == ids.size


def test_stream_carries_token_ids_and_each_tokens_loops(tiny_model: tinyloop.Model, base_url: str) -> None:
    prompt = tiny_model.encode("The loop")
    request = {"model": "tiny", "prompt": prompt.tolist(), "max_tokens": 12, "temperature": 0, "stream": True,
               "return_token_ids": True, "loops": 6, "exit_criterion": "kl", "exit_tol": 0.05}  # fmt: skip
    ids, loops = [], None
    with httpx.stream("POST", f"{base_url}/v1/completions", json=request, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                ids += choice.get("token_ids", [])
                loops = choice.get("token_loops", loops)
    with tinyloop.Scheduler(tiny_model, max_batch=1, max_seq_len=64) as alone:  # the same request alone
        handle = alone.submit(prompt, max_tokens=12, loops=6, temperature=0, exit_criterion="kl", exit_tol=0.05)
        assert ids == handle.result(60).tolist()
    assert loops == handle.stats.token_loops and len(loops) == 12 and min(loops) < 6  # some tokens exited early


def test_bad_lens_requests_get_a_clear_400(base_url: str) -> None:
    cases = [
        ({"prompt": "a", "tokens": [1]}, "give either prompt"), ({"tokens": [1, 256]}, "[0, 256)"),
        ({"tokens": []}, "at least one token"), ({"prompt": "a", "loops": 0}, "loops"),
        ({"prompt": "a", "top_k": 21}, "top_k"), ({"prompt": "a", "model": "other"}, "does not exist"),
    ]  # fmt: skip
    for request, message in cases:
        response = httpx.post(f"{base_url}/v1/lens", json=request, timeout=60)
        assert response.status_code in (400, 404) and message in response.json()["error"]["message"], request


def test_the_page_and_its_files_are_served_from_the_package(base_url: str) -> None:
    page = httpx.get(f"{base_url}/", timeout=60)
    assert page.status_code == 200 and "tinyloop explorer" in page.text
    for name, kind in (("explorer.js", "javascript"), ("explorer.css", "css")):
        response = httpx.get(f"{base_url}/static/{name}", timeout=60)
        assert response.status_code == 200 and kind in response.headers["content-type"]
    assert "http" not in page.text.replace("http://www.w3.org", "")  # nothing fetched from elsewhere
