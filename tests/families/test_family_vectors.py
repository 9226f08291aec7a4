"""Converted Ouro / Huginn checkpoints reproduce their reference implementations (fp32 vectors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_helpers import max_rel, reference

from tinyloop.api.model import Model
from tinyloop.runtime.engine import Engine
from tinyloop.runtime.family_exit import ExitRule, exit_logits, exit_pdf, threshold_steps
from tinyloop.runtime.loader import load_engine

TOL = 1e-4
SEQS = ("seqA", "seqB")


def _engine(path) -> Engine:  # type: ignore[no-untyped-def]
    return load_engine(path, torch.device("cpu"), torch.float32)[1]


# ---- Huginn ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("steps", [1, 2, 4, 8])
def test_huginn_logits_zero_and_given_state(family_files, seq: str, steps: int) -> None:
    meta, ref = reference("huginn")
    ids = torch.tensor([meta["inputs"][seq]])
    zeros = _engine(family_files["huginn-zeros"])
    out = zeros.step(ids, None, steps)
    assert max_rel(out.logits, ref[f"{seq}.zeros.steps{steps}.logits"]) <= TOL
    rand = _engine(family_files["huginn"])
    assert rand.noise is not None
    rand.noise[: ids.shape[1]] = ref[f"{seq}.randinit.s0"][0]  # the state the reference drew
    out = rand.step(ids, None, steps)
    assert max_rel(out.logits, ref[f"{seq}.randinit.steps{steps}.logits"]) <= TOL


@pytest.mark.parametrize("seq", SEQS)
def test_huginn_trajectory_and_default_depth(family_files, seq: str) -> None:
    meta, ref = reference("huginn")
    ids = torch.tensor([meta["inputs"][seq]])
    eng = _engine(family_files["huginn-zeros"])
    out = eng.step(ids, None, 8, collect_states=True)
    assert out.states is not None
    assert max_rel(out.states[1], ref[f"{seq}.prelude_out"]) <= TOL
    for k in range(8):
        assert max_rel(out.states[2 + k], ref[f"{seq}.zeros.trajectory"][k]) <= TOL
    rand = _engine(family_files["huginn"])
    assert rand.noise is not None and rand.cfg.default_loops == 4
    rand.noise[: ids.shape[1]] = ref[f"{seq}.randinit.s0"][0]
    out = rand.step(ids, None, rand.cfg.default_loops, collect_states=True)
    assert max_rel(out.logits, ref[f"{seq}.default.logits"]) <= TOL
    for k in range(4):
        assert max_rel(out.states[2 + k], ref[f"{seq}.randinit.trajectory"][k]) <= TOL


def test_huginn_state_start_matches_reference_distribution(family_files) -> None:
    eng = _engine(family_files["huginn"])
    std = (2 / (5 * 64)) ** 0.5 * 64**0.5  # init_values.std * sqrt(n_embd)
    assert eng.cfg.state_start == "random" and abs(eng.cfg.state_init_std - std) < 1e-9
    assert eng.noise is not None and float(eng.noise.abs().max()) <= 3 * std + 1e-6


def test_huginn_greedy_generation_zero_state(family_files) -> None:
    meta, ref = reference("huginn")
    prompt = meta["inputs"]["seqA"]
    want = [383, 353, 407, 283, 432, 323, 89, 304, 334, 357, 424, 190]
    with Model(family_files["huginn-zeros"], max_seq_len=64, device="cpu") as m:
        assert m.generate(prompt, 12, loops=4, temperature=0).tolist() == want
        assert m.generate_tokens(prompt, 12, loops=4, temperature=0, stop=False).tolist() == want
    # Per-step logits through the cache.
    eng = _engine(family_files["huginn-zeros"])
    cache = eng.new_cache(1, 32, 4)
    logits = [eng.step(torch.tensor([prompt]), cache, 4, last_only=True).logits[0, -1]]
    for tok in want[:-1]:
        logits.append(eng.step(torch.tensor([[tok]]), cache, 4, last_only=True).logits[0, -1])
    assert max_rel(torch.stack(logits), ref["gen.zeros.step_logits"][0]) <= TOL


def test_huginn_greedy_generation_given_states(family_files) -> None:
    meta, ref = reference("huginn")
    prompt = meta["inputs"]["seqA"]
    want = [383, 341, 124, 464, 316, 240, 43, 501, 323, 89, 304, 427]
    with Model(family_files["huginn"], max_seq_len=64, device="cpu") as m:
        noise = m._engine.noise
        assert noise is not None
        noise[:18] = ref["gen.randinit.init_states"][0]  # state of position p = the one drawn for it
        assert m.generate(prompt, 12, loops=4, temperature=0).tolist() == want


# ---- Ouro ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seq", SEQS)
def test_ouro_logits_every_rule(family_files, seq: str) -> None:
    meta, ref = reference("ouro")
    ids = torch.tensor([meta["inputs"][seq]])
    eng = _engine(family_files["ouro"])
    w, cfg, every = eng.weights, eng.cfg, slice(None)
    out = eng.step(ids, None, 4, collect_states=True)
    assert max_rel(out.logits, ref[f"{seq}.default.logits"]) <= TOL
    q = float(cfg.extra["early_exit_threshold"])
    assert max_rel(exit_logits(w, cfg, out, ExitRule(threshold=q), every), ref[f"{seq}.default.logits"]) <= TOL
    for k in range(4):
        got = exit_logits(w, cfg, out, ExitRule(exit_at_step=k), every)
        assert max_rel(got, ref[f"{seq}.exit_at_step{k}.logits"]) <= TOL
        assert max_rel(eng.step(ids, None, k + 1).logits, ref[f"{seq}.total_ut_steps{k + 1}.logits"]) <= TOL
    entries = {e["name"]: e for e in meta["entries"]}
    for q in (0.5, 0.9):
        got = exit_logits(w, cfg, out, ExitRule(threshold=q), every)
        assert max_rel(got, ref[f"{seq}.exit_threshold{q}.logits"]) <= TOL
        steps = threshold_steps(exit_pdf(out.gates), q)[0].tolist()
        assert steps == entries[f"{seq}.exit_threshold{q}"]["exit_steps"]
    weighted = exit_logits(w, cfg, out, ExitRule(weighted=True), every)
    assert max_rel(weighted, ref[f"{seq}.weighted_exit.logits"]) <= TOL
    assert max_rel(weighted, ref[f"{seq}.labels.logits"]) <= TOL


@pytest.mark.parametrize("seq", SEQS)
def test_ouro_trajectory_gates_and_pdf(family_files, seq: str) -> None:
    meta, ref = reference("ouro")
    eng = _engine(family_files["ouro"])
    out = eng.step(torch.tensor([meta["inputs"][seq]]), None, 4, collect_states=True)
    assert out.states is not None
    for k in range(4):
        assert max_rel(out.states[2 + k], ref[f"{seq}.hidden_per_step"][k]) <= TOL
        assert max_rel(out.gates[k], ref[f"{seq}.gate_logits"][k]) <= TOL
    assert max_rel(exit_pdf(out.gates), ref[f"{seq}.exit_pdf"]) <= TOL


def test_ouro_model_api_score_exit(family_files) -> None:
    meta, ref = reference("ouro")
    ids = np.asarray(meta["inputs"]["seqB"], dtype=np.int32)
    with Model(family_files["ouro"], max_seq_len=64, device="cpu") as m:
        got = m.score_exit(ids, exit_threshold=0.5)
        assert max_rel(torch.from_numpy(got), ref["seqB.exit_threshold0.5.logits"][0]) <= TOL
        got = m.score_exit(ids, weighted_exit=True)
        assert max_rel(torch.from_numpy(got), ref["seqB.weighted_exit.logits"][0]) <= TOL
        got = m.score_exit(ids, exit_at_step=1)
        assert max_rel(torch.from_numpy(got), ref["seqB.exit_at_step1.logits"][0]) <= TOL
        with pytest.raises(ValueError, match="at most one"):
            m.score_exit(ids, exit_threshold=0.5, weighted_exit=True)


def test_ouro_greedy_generation(family_files) -> None:
    meta, ref = reference("ouro")
    prompt = meta["inputs"]["seqA"]
    want = [436, 38, 61, 256, 256, 256, 208, 142, 101, 83, 307, 242]
    with Model(family_files["ouro"], max_seq_len=64, device="cpu") as m:
        assert m.generate(prompt, 12, temperature=0).tolist() == want
        # stop=False: the tiny tokenizer's ids are not the reference's, so stops must not cut the run.
        assert m.generate_tokens(prompt, 12, temperature=0, exit_threshold=1.0, stop=False).tolist() == want
    eng = _engine(family_files["ouro"])
    cache = eng.new_cache(1, 32, 4)
    logits = [eng.step(torch.tensor([prompt]), cache, 4, last_only=True).logits[0, -1]]
    for tok in want[:-1]:
        logits.append(eng.step(torch.tensor([[tok]]), cache, 4, last_only=True).logits[0, -1])
    assert max_rel(torch.stack(logits), ref["gen.step_logits"][0]) <= TOL


@pytest.mark.parametrize("family", ["ouro", "huginn"])
@pytest.mark.parametrize("bits, bound", [(8, 0.05), (4, 0.5)])
def test_quantized_conversions_stay_close(family_files, tmp_path, family: str, bits: int, bound: float) -> None:
    """docs/FAMILIES.md states the measured errors (bench/family_quant_error.py); this guards them loosely."""
    from tinyloop.convert.from_hf import convert_hf

    meta, ref = reference(family)
    out = tmp_path / f"{family}-{bits}.tinyloop"
    zeros = "zeros" if family == "huginn" else None
    convert_hf(family_files[f"{family}-hf"], out, bits, 32, progress=False, state_start=zeros)
    eng = _engine(out)
    want = ref["seqB.default.logits" if family == "ouro" else "seqB.zeros.steps4.logits"]
    got = eng.step(torch.tensor([meta["inputs"]["seqB"]]), None, 4).logits
    assert max_rel(got, want) <= bound
