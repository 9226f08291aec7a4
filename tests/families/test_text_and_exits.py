"""Embedded tokenizer (metadata, encode/decode, chat, streaming text, CLI) and per-token adaptive exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyloop.api.model import Model
from tinyloop.cache.kv import KVCache
from tinyloop.errors import TinyLoopFormatError
from tinyloop.format.header import read_header
from tinyloop.format.tokenizer_meta import TokenizerMeta, parse_tokenizer_meta
from tinyloop.model.slots import body_slot
from tinyloop.runtime.adaptive_exit import ExitCriterion, adaptive_decode_step
from tinyloop.runtime.loader import load_engine
from tinyloop.text.chat import render_chat


def test_tokenizer_metadata_is_embedded_and_validated(family_files) -> None:
    h = read_header(family_files["ouro"])
    meta = parse_tokenizer_meta(h.metadata["tokenizer"], h.config.vocab_size)
    assert meta.stop_ids == (0, 2) and meta.eos_ids == (2,) and meta.bos_id == 1 and meta.pad_id == 0
    assert meta.chat_template == "chatml" and not meta.add_bos and meta.source_chat_template == "{{ messages }}"
    hg = parse_tokenizer_meta(read_header(family_files["huginn"]).metadata["tokenizer"], 512)
    assert hg.chat_template == "huginn" and hg.add_bos and hg.bos_id == 0 and hg.stop_ids == (0, 1, 4)
    bad = json.loads(h.metadata["tokenizer"])
    for key, value, needle in [
        ("stop_ids", [512], "stop_ids"),
        ("chat_template", "jinja", "chat_template"),
        ("tokenizer_json", {"x": 1}, "tokenizer_json"),
        ("bos_id", True, "bos_id"),
    ]:
        with pytest.raises(ValueError, match=needle):
            parse_tokenizer_meta(json.dumps({**bad, key: value}), 512)
    with pytest.raises(ValueError, match="unknown"):
        parse_tokenizer_meta(json.dumps({**bad, "extra": 1}), 512)
    text = json.dumps(bad)
    inner = text.replace('"tokenizer_json": {', '"tokenizer_json": {"version": "0", ', 1)  # repeats "version" inside
    for dup in (text[:-1] + ', "bos_id": 3}', inner):
        with pytest.raises(ValueError, match="duplicate key"):
            parse_tokenizer_meta(dup, 512)


def test_header_refuses_a_bad_tokenizer(tmp_path: Path) -> None:
    from helpers import random_flat_weights
    from tinyloop.format.writer import write_model_streamed
    from tinyloop.presets import preset

    cfg = preset("test-tiny")
    flat = random_flat_weights(cfg, 0)
    meta = TokenizerMeta({"model": {}}, None, (), None, (300,), False, "none")
    with pytest.raises(TinyLoopFormatError, match="tokenizer.*bytes"):
        write_model_streamed(tmp_path / "a.tinyloop", cfg, lambda s: flat[s.name], progress=False,
                             metadata={"tokenizer": meta.to_json()})  # fmt: skip
    with pytest.raises(TinyLoopFormatError, match="stop_ids"):
        write_model_streamed(tmp_path / "a.tinyloop", cfg.replace(tokenizer="embedded"), lambda s: flat[s.name],
                             progress=False, metadata={"tokenizer": meta.to_json()})  # fmt: skip
    assert not (tmp_path / "a.tinyloop").exists()


def test_chat_templates() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi \n"}]
    assert render_chat("chatml", msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n hi \n<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat("huginn", msgs + [{"role": "assistant", "content": "ok"}], add_generation_prompt=False) == (
        "<|begin_text|><|begin_header|>system<|end_header|>\n\nBe brief.<|end_turn|>"
        "<|begin_header|>user<|end_header|>\n\nhi<|end_turn|><|begin_header|>Huginn<|end_header|>\n\nok<|end_turn|>"
        "<|end_text|>"
    )
    with pytest.raises(ValueError, match="no chat template"):
        render_chat("none", msgs)


def test_encode_decode_and_chat_ids(family_files) -> None:
    with Model(family_files["ouro"], max_seq_len=256, device="cpu") as m:
        ids = m.encode("The quick brown fox")
        assert ids.dtype == np.int32 and m.decode(ids) == "The quick brown fox"
        chat = m.chat_prompt([{"role": "user", "content": "hi"}])
        assert chat[0] == 1 and list(chat).count(2) == 1  # <|im_start|> ... <|im_end|> as single ids
    with Model(family_files["huginn"], max_seq_len=256, device="cpu") as m:
        assert m.encode("loops")[0] == 0  # Huginn prepends <|begin_text|>
        assert m.chat_prompt([{"role": "user", "content": "hi"}])[:2].tolist() == [0, 2]


def test_incremental_decoding_keeps_multibyte_characters_whole(family_files) -> None:
    with Model(family_files["ouro"], max_seq_len=256, device="cpu") as m:
        text = "naïve café → 🙂 loops 日本"
        ids = m.encode(text)
        assert len(ids) > len(text) // 2  # multi-byte characters are split over byte tokens
        dec = m.tokenizer.incremental()
        pieces = [dec.push(int(t)) for t in ids] + [dec.flush()]
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)


def test_generate_text_stops_at_end_tokens(family_files) -> None:
    with Model(family_files["ouro"], max_seq_len=256, device="cpu") as m:
        full = m.generate_tokens(m.encode("The quick"), 16, temperature=0, stop=False)
        stops = set(m.tokenizer.stop_ids)
        text = m.generate_text("The quick", 16, temperature=0)
        cut = next((i for i, t in enumerate(full.tolist()) if t in stops), len(full))
        assert text == m.decode(full[:cut])
        stopped = m.generate_tokens(m.encode("The quick"), 16, temperature=0)
        assert stopped.tolist() == full[:cut].tolist()  # the stop token is not returned
        assert isinstance(m.generate_text([{"role": "user", "content": "hi"}], 5, temperature=0), str)


def test_adaptive_exit_fills_skipped_iterations(family_files) -> None:
    _, eng = load_engine(family_files["huginn-zeros"], torch.device("cpu"), torch.float32)
    cache = KVCache(eng.cfg, 1, 16, 6, eng.device, eng.dtype)
    eng.step(torch.tensor([[5, 6, 7]]), cache, 6, last_only=True)
    crit = ExitCriterion("latent", threshold=1e9, min_loops=2)  # always exits after 2 iterations
    _, depth = adaptive_decode_step(eng, cache, 9, 6, crit)
    assert depth == 2 and int(cache.lengths[0]) == 4
    for j in range(eng.cfg.n_body):
        src = body_slot(eng.cfg, 1, j)
        for t in range(2, 6):
            assert torch.equal(cache.k[body_slot(eng.cfg, t, j), :, :, 3], cache.k[src, :, :, 3])
            assert torch.equal(cache.v[body_slot(eng.cfg, t, j), :, :, 3], cache.v[src, :, :, 3])


@pytest.mark.parametrize("kind", ["kl", "entropy", "argmax", "latent"])
def test_adaptive_criteria(family_files, kind: str) -> None:
    with Model(family_files["huginn-zeros"], max_seq_len=64, device="cpu") as m:
        prompt = [496, 263, 188, 163, 182, 103, 275]
        full = m.generate(prompt, 8, loops=6, temperature=0)
        never = {"kl": 0.0, "entropy": 0.0, "argmax": 99, "latent": 0.0}[kind]
        same = m.generate_tokens(prompt, 8, loops=6, temperature=0, exit_criterion=kind, exit_tol=never, stop=False)
        assert same.tolist() == full.tolist()
        assert m.last_family_stats is not None and m.last_family_stats.exit_depths == [6] * 8
        m.generate_tokens(prompt, 8, loops=6, temperature=0, exit_criterion=kind, min_loops=2, stop=False)
        depths = m.last_family_stats.exit_depths
        assert len(depths) == 8 and all(2 <= d <= 6 for d in depths[1:]) and depths[0] == 6
        with pytest.raises(ValueError, match="exit criterion"):
            m.generate_tokens(prompt, 2, exit_criterion="nope")


def test_ouro_gate_criterion_and_rule_arguments(family_files) -> None:
    with Model(family_files["ouro"], max_seq_len=64, device="cpu") as m:
        prompt = [252, 197, 494, 225, 97, 425, 88]
        m.generate_tokens(prompt, 6, temperature=0, exit_criterion="gate", exit_tol=0.0, stop=False)
        assert m.last_family_stats is not None and m.last_family_stats.exit_depths[1:] == [1] * 5
        with pytest.raises(ValueError, match="either"):
            m.generate_tokens(prompt, 2, exit_threshold=0.5, exit_criterion="kl")
    with Model(family_files["huginn"], max_seq_len=64, device="cpu") as m:
        with pytest.raises(ValueError, match="exit gate"):
            m.score_exit([5, 6], exit_threshold=0.5)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TINYLOOP_LOG_LEVEL": "0"}
    cmd = [sys.executable, "-m", "tinyloop.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, timeout=120, env=env, text=True)


def test_cli_generate_is_tokenizer_first(family_files) -> None:
    path = str(family_files["ouro"])
    res = _cli(path, "generate", "--prompt", "The quick café", "--max-tokens", "6", "--temperature", "0")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("The quick café") and "mean depth 4.00" in res.stderr
    with Model(family_files["ouro"], max_seq_len=64, device="cpu") as m:
        assert res.stdout == "The quick café" + m.generate_text("The quick café", 6, temperature=0) + "\n"
    res = _cli(str(family_files["huginn"]), "generate", "--prompt", "hi", "--max-tokens", "4", "--chat",
               "--exit-criterion", "kl", "--exit-tol", "0.01", "--loops", "6")  # fmt: skip
    assert res.returncode == 0 and "loops 6" in res.stderr, res.stderr


def test_cli_text_flags_are_checked() -> None:
    from tinyloop.cli.generate_cmd import build_parser

    args = build_parser().parse_args(["--chat", "--exit-threshold", "0.5", "--exit-criterion", "argmax"])
    assert args.chat and args.exit_threshold == 0.5 and args.exit_criterion == "argmax"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--exit-criterion", "nope"])


def test_cli_text_model_stop_strings_regex_and_warmup(family_files) -> None:
    """Stop strings, a regex over the BPE vocabulary and a depth warm-up work for models with an embedded
    tokenizer too (through the runtime's loop); with family exits they are refused up front."""
    import re

    path = str(family_files["ouro"])
    base = ["generate", "--prompt", "The quick", "--max-tokens", "12", "--temperature", "0", "--no-stop"]
    full = _cli(path, *base)
    assert full.returncode == 0, full.stderr
    text = full.stdout[len("The quick") : -1]
    stop = text[3:6]
    assert stop
    cut = _cli(path, *base, "--stop", stop)
    assert cut.returncode == 0, cut.stderr
    assert cut.stdout == "The quick" + text[: text.find(stop)] + "\n" and "stop: stop_string" in cut.stderr
    pattern = "(ab|cd)[0-9]{1,2}"
    con = _cli(
        path, "generate", "--prompt", "The quick", "--max-tokens", "16", "--temperature", "0", "--regex", pattern
    )
    assert con.returncode == 0, con.stderr
    assert re.fullmatch(pattern, con.stdout[len("The quick") : -1]), con.stdout
    warm = _cli(path, *base, "--l-warmup-tokens", "3", "--l-warmup-L", "1")
    assert warm.returncode == 0 and warm.stdout.startswith("The quick"), warm.stderr
    bad = _cli(path, *base, "--stop", "x", "--exit-criterion", "kl")
    assert bad.returncode == 2 and "do not combine" in bad.stderr


@pytest.mark.parametrize(("mode", "window"), [("int8", 0), ("window", 5), ("hidden", 0)])
def test_adaptive_exit_runs_in_the_models_kv_mode(family_files, mode: str, window: int) -> None:
    with Model(family_files["huginn-zeros"], max_seq_len=64, device="cpu", kv_mode=mode, cache_window=window) as m:
        prompt = [496, 263, 188, 163, 182, 103, 275]
        full = m.generate(prompt, 8, loops=6, temperature=0)
        never = m.generate_tokens(prompt, 8, loops=6, temperature=0, exit_criterion="kl", exit_tol=0.0, stop=False)
        assert never.tolist() == full.tolist()
        m.generate_tokens(prompt, 8, loops=6, temperature=0, exit_criterion="argmax", min_loops=2, stop=False)
        assert m.last_family_stats is not None and len(m.last_family_stats.exit_depths) == 8
