"""The training loop on CPU at toy scale: learning, exact resume, truncated backprop, budgets, weight files."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tinyloop.convert import weight_shards
from tinyloop.convert.weight_shards import load_weight_shards, save_weight_shards
from tinyloop.model.looped import loop_iteration
from tinyloop.model.weights import ModelWeights
from tinyloop.runtime.engine import Engine
from tinyloop.train import trainer as trainer_mod
from tinyloop.train.forward import RopeCache, train_logits
from tinyloop.train.params import Params, init_tensors
from tinyloop.train.schedule import step_units
from tinyloop.train.tiny_config import TEST_TINY_TRAIN_CONFIG
from tinyloop.train.trainer import TrainArgs, Trainer, run

CFG = TEST_TINY_TRAIN_CONFIG


def toy_args(corpus: Path, out: Path, **kw: object) -> TrainArgs:
    base: dict[str, object] = dict(
        config="test-tiny-train", batch_size=8, seq_len=64, lr=3e-3, warmup_steps=3, device="cpu",
        log_every=1, progress=False, eval_windows=4, eval_loops=[1, 4],
    )  # fmt: skip
    base.update(kw)
    return TrainArgs(data=corpus, out=out, **base)  # type: ignore[arg-type]


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_toy_training_learns_and_exports(corpus_dir: Path, tmp_path: Path) -> None:
    metrics = run(toy_args(corpus_dir, tmp_path, steps=30, ckpt_every_s=0.0))
    got = losses(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert sum("quick_val_bpb" in r for r in rows) >= 29  # saved (and quick-validated) after every step
    assert len(got) == 30
    first = sum(got[s] for s in range(1, 6)) / 5
    last = sum(got[s] for s in range(26, 31)) / 5
    assert last < first - 1.0, (first, last)
    assert metrics["eval"]["bpb_float"][4] < 8.0  # better than uniform bytes
    int4 = metrics["int4"]
    assert (tmp_path / int4["path"]).exists() and abs(int4["bpb"][4] - metrics["eval"]["bpb_float"][4]) < 0.3
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 30
    assert (tmp_path / "ckpt.pt").exists() and (tmp_path / "weights_fp16.safetensors").exists()


def test_resume_replays_the_uninterrupted_run(corpus_dir: Path, tmp_path: Path) -> None:
    whole, part = tmp_path / "whole", tmp_path / "part"
    Trainer(toy_args(corpus_dir, whole, steps=6)).train()
    Trainer(toy_args(corpus_dir, part, steps=6, stop_at=3)).train()
    assert sorted(losses(part)) == [1, 2, 3]
    Trainer(toy_args(corpus_dir, part, steps=6, resume=part / "ckpt.pt")).train()
    a, b = losses(whole), losses(part)
    for step in (4, 5, 6):
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7)


def test_truncated_backprop_detaches_early_iterations() -> None:
    params = Params(CFG, init_tensors(CFG, 0))
    w = ModelWeights.from_flat(CFG, params.flat())
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    ctx = RopeCache(CFG).context(2, 16, torch.device("cpu"))
    seen: list[tuple[bool, bool, bool]] = []

    def spy(w_, cfg, s, p, ctx_, loop):  # type: ignore[no-untyped-def]
        out = loop_iteration(w_, cfg, s, p, ctx_, loop)
        seen.append((torch.is_grad_enabled(), s.grad_fn is not None, out.requires_grad))
        return out

    logits = train_logits(w, CFG, tokens, ctx, 5, 2, spy)
    # Three iterations without autograd, then two with it; the state entering them has no history.
    assert seen == [(False, False, False)] * 3 + [(True, False, True), (True, True, True)]

    def body_grad(grad_loops: int) -> tuple[float, torch.Tensor]:
        params.zero_grad(set_to_none=True)
        out = train_logits(w, CFG, tokens, ctx, 5, grad_loops)
        out.square().mean().backward()
        g = params.flat()["body.0.mlp.down.weight"].grad
        assert g is not None
        return float(out.detach().square().mean()), g.clone()

    loss_full, g_full = body_grad(5)
    loss_trunc, g_trunc = body_grad(1)
    assert loss_full == pytest.approx(loss_trunc, rel=1e-6)  # same forward
    assert not torch.allclose(g_full, g_trunc)  # different backward
    assert torch.allclose(logits, train_logits(w, CFG, tokens, ctx, 5, 5))


def test_training_forward_matches_the_runtime() -> None:
    flat = init_tensors(CFG, 1)
    engine = Engine(CFG, ModelWeights.from_flat(CFG, flat), torch.device("cpu"), torch.float32)
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    ctx = RopeCache(CFG).context(2, 20, torch.device("cpu"))
    with torch.no_grad():
        got = train_logits(engine.weights, CFG, tokens, ctx, 3, 2)
    ref = engine.step(tokens, None, 3).logits
    assert ref is not None and torch.allclose(got, ref, atol=1e-5, rtol=1e-5)


def test_time_budget_plans_the_schedule_to_fit(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A virtual clock where every step costs exactly 10 ms per cost unit makes the planner deterministic.
    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(trainer_mod, "time", SimpleNamespace(monotonic=lambda: clock.now))
    real_step = Trainer.train_step

    def timed_step(self: Trainer) -> dict[str, float]:
        rec = real_step(self)
        clock.now += step_units(self.cfg, int(rec["loops"]), self.args.grad_loops) * 0.01
        return rec

    monkeypatch.setattr(Trainer, "train_step", timed_step)
    budget = 12.0
    args = toy_args(corpus_dir, tmp_path, time_budget_s=budget, log_every=100, batch_size=2, seq_len=32)
    trainer = Trainer(args, start_time=clock.now)
    trainer.train()
    plan = trainer.plan
    assert plan.from_time and plan.sec_per_unit == pytest.approx(0.01)
    assert plan.total_steps is not None and 40 < plan.total_steps == trainer.step  # the cosine completes
    assert clock.now <= trainer.deadline() <= 1000.0 + budget
    assert clock.now > trainer.deadline() - 0.05 * budget  # and little of the budget is left unused
    assert plan.warmup_steps == 3


def test_sharded_weights_round_trip_and_init(corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weight_shards, "MAX_SHARD_BYTES", 100_000)
    tensors = init_tensors(CFG, 2)
    paths = save_weight_shards(tmp_path, CFG, tensors)
    assert len(paths) > 1 and all(p.stat().st_size <= 100_000 + 10_000 for p in paths)
    for source in (tmp_path, paths[1], tmp_path / "weights_fp16.index.json"):
        cfg, loaded = load_weight_shards(source)
        assert cfg == CFG and set(loaded) == set(tensors)
        assert all(torch.equal(loaded[n], tensors[n].half().float()) for n in tensors)
    out = tmp_path / "again"
    trainer = Trainer(toy_args(corpus_dir, out, steps=3, init_weights=tmp_path))
    assert trainer.plan.warmup_steps == 3
    trainer.train()
    assert len(losses(out)) == 3
