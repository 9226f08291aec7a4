"""Bad arguments at the API's entry points: each a ValueError / TypeError naming the argument and what it
accepts; the byte-level model's text is its UTF-8 bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tinyloop
from tinyloop.api import arguments
from tinyloop.config import MAX_LOOPS

PROMPT = np.array([72, 101, 108, 108, 111, 32, 119], dtype=np.int32)


@pytest.fixture(scope="module")
def model(tiny_files):
    with tinyloop.Model(tiny_files["f32"], max_seq_len=64) as m:
        yield m


@pytest.mark.parametrize("loops", [MAX_LOOPS + 1, 10**6, 2**70])
def test_scoring_loops_are_bounded(model, loops: int) -> None:
    calls = (
        model.score, model.score_last, model.score_logit_lens, model.score_trajectory,
        model.score_with_uncertainty, model.score_with_consistency,
    )  # fmt: skip
    for call in calls:
        with pytest.raises(ValueError, match=rf"loops must be in \[1, {MAX_LOOPS}\].*got {loops}"):
            call(PROMPT, loops=loops)


@pytest.mark.parametrize("loops", [1.0, "4", True, [2]])
def test_loops_of_the_wrong_type_are_type_errors(model, loops: object) -> None:
    with pytest.raises(TypeError, match="loops must be an integer"):
        model.score_last(PROMPT, loops=loops)  # type: ignore[arg-type]


def test_speculative_verify_loops_are_bounded(model) -> None:
    with pytest.raises(ValueError, match="verify_loops must be in"):
        model.generate_speculative(PROMPT, 4, draft_loops=2, verify_loops=MAX_LOOPS + 1)


def test_a_default_above_the_constant_is_refused_by_the_config(model) -> None:
    cfg = model.header.config
    assert arguments.max_loops(cfg) == MAX_LOOPS
    with pytest.raises(ValueError, match=rf"'default_loops' must be an integer in \[1, {MAX_LOOPS}\]"):
        type(cfg)(**{**cfg.to_dict(), "default_loops": MAX_LOOPS + 8})


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_dtype_by_name_equals_dtype_by_value(tiny_files, name: str, dtype: torch.dtype) -> None:
    with tinyloop.Model(tiny_files["f32"], dtype=name) as a, tinyloop.Model(tiny_files["f32"], dtype=dtype) as b:
        assert np.array_equal(a.score_last(PROMPT, loops=2), b.score_last(PROMPT, loops=2))


@pytest.mark.parametrize(
    "dtype, error, message",
    [
        (torch.int8, ValueError, "dtype must be one of torch.float32, torch.bfloat16, torch.float16.*torch.int8"),
        (torch.float64, ValueError, "dtype must be one of"),
        ("half", ValueError, "dtype must be one of .*'half'"),
        ("cuda", ValueError, "dtype must be one of"),
        (16, TypeError, "dtype must be a torch.dtype .* got int"),
    ],
)
def test_unsupported_dtypes_are_refused_before_loading(tiny_files, dtype, error, message) -> None:
    with pytest.raises(error, match=message):
        tinyloop.Model(tiny_files["f32"], dtype=dtype)


def test_float16_on_the_cpu_warns_once(tiny_files, monkeypatch, capsys) -> None:
    monkeypatch.setattr(arguments, "_warned_cpu_float16", False)
    monkeypatch.setenv("TINYLOOP_LOG_LEVEL", "1")
    for _ in range(2):
        tinyloop.Model(tiny_files["f32"], device="cpu", dtype=torch.float16).close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "float16 on the CPU" in line]
    assert len(warnings) == 1 and "10x slower" in warnings[0]


def test_load_takes_what_model_takes(tiny_files) -> None:
    with tinyloop.load(tiny_files["f32"], 32, "cpu", kv_mode="int8", dtype="float32") as m:
        assert m.kv_mode == "int8" and m.max_seq_len == 32
    with tinyloop.load(tiny_files["f32"], cache_window=8) as m:
        assert m.kv_mode == "window" and m.cache_window == 8
    with pytest.raises(ValueError, match="kv_mode must be one of"):
        tinyloop.load(tiny_files["f32"], kv_mode="int4")


@pytest.mark.parametrize("item", [object(), "abc", PROMPT])
def test_pool_register_refuses_what_is_not_a_prefix_cache(item: object) -> None:
    with pytest.raises(TypeError, match="register takes a prefix cache .*got "):
        tinyloop.PrefixPool().register(item)  # type: ignore[arg-type]


def test_byte_model_text_is_its_utf8_bytes(model) -> None:
    text = "héllo, €!"
    ids = model.encode(text)
    assert ids.dtype == np.int32 and ids.tolist() == list(text.encode("utf-8"))
    assert model.decode(ids) == text
    assert model.decode([104, 0xC3]) == "h\ufffd"  # a cut character decodes to U+FFFD
    assert model.decode([]) == ""
    with pytest.raises(TypeError, match="text must be a str"):
        model.encode(b"abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no bos token"):
        model.encode("abc", add_bos=True)
    with pytest.raises(ValueError, match="no chat template"):
        model.generate_text([{"role": "user", "content": "hi"}], 4)


def test_byte_model_generate_text_decodes_the_generated_bytes(model) -> None:
    prompt = "Hello w"
    text = model.generate_text(prompt, 12, loops=2, temperature=0.0)
    ids = model.generate(model.encode(prompt), 12, loops=2, temperature=0.0)
    assert len(set(ids.tolist())) > 1  # not a degenerate stream
    assert text == bytes(ids.tolist()).decode("utf-8", errors="replace")
    pieces = list(model.generate_text_stream(prompt, 12, loops=2, temperature=0.0))
    assert "".join(pieces) == text


def test_introspection_refuses_results_that_cannot_fit_before_running(model, monkeypatch) -> None:
    import tinyloop.cache.memory as memory

    cfg = model.header.config
    states = (4 + 2) * len(PROMPT) * cfg.d_model * 4  # float32 states of every iteration
    lens = 2 * 4 * len(PROMPT) * cfg.vocab_size * 4
    monkeypatch.setattr(memory, "available_host_bytes", lambda: states + lens - 1)
    with pytest.raises(RuntimeError, match="^out of memory"):
        model.score_logit_lens(PROMPT, loops=4)
    assert model.score_logit_lens(PROMPT, loops=4, top_k=3)[0].shape == (4, len(PROMPT), 3)
    assert model.score_trajectory(PROMPT, loops=4).shape == (6, len(PROMPT), cfg.d_model)
    monkeypatch.setattr(memory, "available_host_bytes", lambda: states - 1)
    for call in (model.score_trajectory, model.score_with_uncertainty, model.score_with_consistency):
        with pytest.raises(RuntimeError, match="^out of memory"):
            call(PROMPT, loops=4)
