"""The training loop: random loop counts, truncated backprop, AdamW, time-budget planning, checkpoints."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from tinyloop.config import ArchConfig
from tinyloop.convert.weight_shards import load_weight_shards, save_weight_shards
from tinyloop.layout import parameter_count
from tinyloop.model.looped import loop_iteration
from tinyloop.model.weights import ModelWeights
from tinyloop.train.evaluate import EVAL_LOOPS, bpb_by_loops, engine_from_file, engine_from_flat, eval_windows
from tinyloop.train.forward import IterationFn, RopeCache, train_logits
from tinyloop.train.params import Params, init_tensors
from tinyloop.train.plan import Plan, eval_units, seconds_per_unit, steps_that_fit
from tinyloop.train.schedule import batch_offsets, loop_count, lr_at, step_units
from tinyloop.train.tiny_config import train_config

CKPT_NAME = "ckpt.pt"
SKIP_MEASURE = 3  # first steps of a run pay for kernel selection and allocator growth
MEASURE_STEPS = 20


@dataclass
class TrainArgs:
    data: Path
    out: Path
    config: str = "tiny"
    steps: int | None = None
    time_budget_s: float | None = None
    batch_size: int = 64
    seq_len: int = 1024
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None  # default 100, or 20 when starting from --init-weights
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mean_loops: float = 6.0
    max_loops: int = 16
    grad_loops: int = 4
    device: str | None = None
    compile: bool = False
    seed: int = 0
    resume: Path | None = None
    init_weights: Path | None = None
    eval_only: bool = False
    eval_windows: int = 64
    eval_loops: list[int] = field(default_factory=lambda: list(EVAL_LOOPS))
    eval_batch: int | None = None
    log_every: int = 25
    ckpt_every_s: float = 120.0
    stop_at: int | None = None  # end this run after this step index (tests simulate interruptions)
    progress: bool = True
    export: bool = True


def log(msg: str) -> None:
    print(msg, flush=True)


class Trainer:
    def __init__(self, args: TrainArgs, start_time: float | None = None) -> None:
        self.args = args
        self.start = time.monotonic() if start_time is None else start_time
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 for the float32 evaluation matmuls
        args.out.mkdir(parents=True, exist_ok=True)
        self.train_data = np.fromfile(args.data / "train.bin", dtype=np.uint8)
        self.val_data = np.fromfile(args.data / "val.bin", dtype=np.uint8)
        check_corpus(args.data, {"train": self.train_data, "val": self.val_data})
        self.step = 0
        self.tokens_seen = 0
        self.train_time_s = 0.0
        self.cfg = train_config(args.config)
        tensors, resumed = self._initial_tensors()
        self.params = Params(self.cfg, tensors).to(self.device)
        self.weights = ModelWeights.from_flat(self.cfg, self.params.flat())
        self.opt = self._optimizer()
        warmup = args.warmup_steps if args.warmup_steps is not None else (20 if args.init_weights else 100)
        self.plan = Plan(total_steps=args.steps, warmup_steps=warmup)
        if resumed is not None:
            self._restore(resumed)
        self.rope = RopeCache(self.cfg)
        self.iteration: IterationFn = loop_iteration
        if args.compile and self.device.type == "cuda":
            self.iteration = torch.compile(loop_iteration)
        self.log_file = args.out / "train_log.jsonl"
        self.recent_losses: list[float] = []
        self.samples: list[tuple[float, float]] = []  # (cost units, seconds) of measured steps

    # ---- setup ------------------------------------------------------------------------------
    def _initial_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        args = self.args
        if args.resume is not None:
            ckpt = torch.load(args.resume, map_location="cpu", weights_only=True)
            cfg = ArchConfig.from_dict(ckpt["config"])
            if cfg != self.cfg:
                log(f"note: checkpoint config {cfg.name!r} replaces --config {args.config!r}")
                self.cfg = cfg
            return ckpt["params"], ckpt
        if args.init_weights is not None:
            found, tensors = load_weight_shards(args.init_weights)
            if found is not None and found != self.cfg:
                log(f"note: weights' config {found.name!r} replaces --config {args.config!r}")
                self.cfg = found
            return tensors, None
        return init_tensors(self.cfg, args.seed), None

    def _optimizer(self) -> torch.optim.AdamW:
        decay = [p for p in self.params.ordered() if p.dim() >= 2]
        no_decay = [p for p in self.params.ordered() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.args.lr, betas=(0.9, 0.95), eps=1e-8)

    def _restore(self, ckpt: dict[str, Any]) -> None:
        self.opt.load_state_dict(ckpt["optimizer"])
        self.step = int(ckpt["step"])
        self.tokens_seen = int(ckpt["tokens_seen"])
        self.train_time_s = float(ckpt["train_time_s"])
        self.plan = Plan(**ckpt["plan"])
        if self.args.steps is not None:
            self.plan.total_steps = self.args.steps
        if self.args.time_budget_s is not None:
            self.plan.from_time = False  # measure again on this machine
        torch.set_rng_state(ckpt["torch_rng"])
        log(f"resumed from {self.args.resume} at step {self.step}")

    # ---- one step ---------------------------------------------------------------------------
    def _autocast(self) -> Any:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def batch(self, step: int) -> torch.Tensor:
        a = self.args
        offsets = batch_offsets(a.seed, step, len(self.train_data), a.batch_size, a.seq_len + 1)
        rows = np.stack([self.train_data[o : o + a.seq_len + 1] for o in offsets])
        return torch.from_numpy(rows).to(self.device, non_blocking=True).long()

    def loss(self, tokens: torch.Tensor, loops: int, grad_loops: int) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        ctx = self.rope.context(inputs.shape[0], inputs.shape[1], self.device)
        with self._autocast():
            logits = train_logits(self.weights, self.cfg, inputs, ctx, loops, grad_loops, self.iteration)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def train_step(self) -> dict[str, float]:
        a = self.args
        loops = loop_count(a.seed, self.step, a.mean_loops, 1, a.max_loops)
        total = self.plan.total_steps if self.plan.total_steps is not None else 10**9
        lr = lr_at(self.step, a.lr, self.plan.warmup_steps, total, a.min_lr_ratio)
        for g in self.opt.param_groups:
            g["lr"] = lr
        tokens = self.batch(self.step)
        try:
            loss = self.loss(tokens, loops, a.grad_loops)
            loss.backward()
        except Exception as exc:  # a compile failure must not lose a paid-for GPU run
            if self.iteration is loop_iteration:
                raise
            log(f"warning: torch.compile failed ({type(exc).__name__}: {exc}); continuing without compile")
            self.iteration = loop_iteration
            self.opt.zero_grad(set_to_none=True)
            loss = self.loss(tokens, loops, a.grad_loops)
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params.parameters(), a.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        value = float(loss.detach())  # synchronizes, so step timings are real
        if not math.isfinite(value):
            raise FloatingPointError(f"loss became {value} at step {self.step}")
        self.step += 1
        self.tokens_seen += tokens.shape[0] * (tokens.shape[1] - 1)
        return {"loss": value, "lr": lr, "loops": loops, "grad_norm": float(grad_norm)}

    # ---- planning ---------------------------------------------------------------------------
    def _eval_reserve_s(self, sec_per_unit: float) -> float:
        a = self.args
        sweep = eval_units(self.cfg, a.eval_loops, a.eval_windows, a.batch_size)
        # Float32 evaluation is slower than bf16 training (x3 margin); two sweeps (float and INT4).
        return 2 * 3 * sweep * sec_per_unit

    def deadline(self) -> float:
        """Monotonic time by which training must stop (budget minus end-of-run work)."""
        a = self.args
        assert a.time_budget_s is not None
        # Saving, evaluation and export; the fixed part shrinks for toy budgets.
        reserve = min(10.0, 0.1 * a.time_budget_s) + 0.02 * a.time_budget_s
        # Before the plan exists (toy budgets), the steps measured so far estimate the evaluation cost.
        spu = self.plan.sec_per_unit or (seconds_per_unit(self.samples) if self.samples else None)
        if spu is not None:
            reserve += self._eval_reserve_s(spu)
        return self.start + a.time_budget_s - reserve

    def _plan_from_time(self, samples: list[tuple[float, float]]) -> None:
        a = self.args
        self.plan.sec_per_unit = seconds_per_unit(samples)
        left = self.deadline() - time.monotonic()
        total = steps_that_fit(
            self.cfg, a.seed, self.step, 0.97 * left, self.plan.sec_per_unit, a.mean_loops, a.max_loops,
            a.grad_loops, a.steps,
        )  # fmt: skip
        self.plan.total_steps = max(total, self.step + 1)
        self.plan.warmup_steps = min(self.plan.warmup_steps, max(1, self.plan.total_steps // 10))
        self.plan.from_time = True
        log(
            f"plan: {self.plan.total_steps} steps ({self.plan.sec_per_unit * 1e3:.2f} ms per unit, "
            f"{left:.0f}s of training left, warmup {self.plan.warmup_steps})"
        )

    # ---- outputs ----------------------------------------------------------------------------
    def save(self) -> None:
        out = self.args.out
        state = {
            "format": "tinyloop-train-ckpt",
            "config": self.cfg.to_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "train_time_s": self.train_time_s,
            "plan": dataclasses.asdict(self.plan),
            "params": self.params.detached(),
            "optimizer": self.opt.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "seed": self.args.seed,
        }
        tmp = out / f".{CKPT_NAME}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, out / CKPT_NAME)
        save_weight_shards(out, self.cfg, self.params.detached())

    def write_log(self, record: dict[str, Any]) -> None:
        with self.log_file.open("a") as f:
            f.write(json.dumps(record) + "\n")

    @torch.no_grad()
    def quick_val_loss(self, windows: int = 8) -> float:
        """Validation bits per byte at the default loop count on a few windows (progress signal only)."""
        a = self.args
        w = eval_windows(self.val_data, windows, a.seq_len).to(self.device).long()
        loss = self.loss(w, self.cfg.default_loops, 0)
        return float(loss) / math.log(2)

    # ---- the run ----------------------------------------------------------------------------
    def train(self) -> None:
        a = self.args
        if a.time_budget_s is None and self.plan.total_steps is None:
            raise ValueError("give --steps or --time-budget-s")
        log(
            f"training {self.cfg.name} ({parameter_count(self.cfg) / 1e6:.2f}M params) on {self.device}: "
            f"batch {a.batch_size} x {a.seq_len}, lr {a.lr}, loops ~ Poisson({a.mean_loops}) in [1, {a.max_loops}], "
            f"backprop through the last {a.grad_loops}; train {len(self.train_data)} bytes, val {len(self.val_data)}"
        )
        samples = self.samples
        first = self.step
        last_save = time.monotonic()
        bar = tqdm(
            total=self.plan.total_steps, initial=self.step, disable=not a.progress, file=sys.stderr,
            mininterval=2.0, dynamic_ncols=True,
        )  # fmt: skip
        step_s = 0.0
        while True:
            total = self.plan.total_steps
            if total is not None and self.step >= total:
                break
            if a.stop_at is not None and self.step >= a.stop_at:
                break
            if a.time_budget_s is not None and time.monotonic() + 1.5 * step_s > self.deadline():
                log(f"stopping at step {self.step}: time budget reached")
                break
            t0 = time.monotonic()
            rec = self.train_step()
            step_s = time.monotonic() - t0
            self.train_time_s += step_s
            bytes_s = a.batch_size * a.seq_len / step_s
            if self.step - first > SKIP_MEASURE:
                samples.append((step_units(self.cfg, int(rec["loops"]), a.grad_loops), step_s))
            if a.time_budget_s is not None and not self.plan.from_time and len(samples) == MEASURE_STEPS:
                self._plan_from_time(samples)
                bar.total = self.plan.total_steps
            self.recent_losses = (self.recent_losses + [rec["loss"]])[-50:]
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.1e}", bps=f"{bytes_s:.3g}", refresh=False)
            record = {"step": self.step, **rec, "bytes_per_s": bytes_s, "elapsed_s": time.monotonic() - self.start}
            if self.step % a.log_every == 0 or self.step == 1:
                self.write_log(record)
                log(
                    f"step {self.step}/{self.plan.total_steps or '?'} loss {rec['loss']:.4f} "
                    f"lr {rec['lr']:.2e} loops {int(rec['loops'])} bytes/s {bytes_s:.0f} "
                    f"elapsed {record['elapsed_s']:.0f}s"
                )
            if time.monotonic() - last_save > a.ckpt_every_s:
                val = self.quick_val_loss()
                self.write_log({"step": self.step, "quick_val_bpb": val, "elapsed_s": time.monotonic() - self.start})
                log(f"step {self.step}: quick val bits/byte at {self.cfg.default_loops} loops {val:.4f}; saving")
                self.save()
                last_save = time.monotonic()
        bar.close()
        self.save()
        log(f"saved checkpoint and weights at step {self.step} ({self.tokens_seen} bytes seen)")

    def evaluate_and_export(self) -> dict[str, Any]:
        a = self.args
        windows = eval_windows(self.val_data, a.eval_windows, a.seq_len)
        batch = a.eval_batch or (16 if self.device.type == "cuda" else 4)
        t0 = time.monotonic()
        engine = engine_from_flat(self.cfg, self.params.detached(), self.device)
        bpb_float = bpb_by_loops(engine, windows, a.eval_loops, batch)
        del engine
        log("float bits/byte by loops: " + _fmt(bpb_float))
        metrics: dict[str, Any] = {
            "config": self.cfg.to_dict(),
            "params": parameter_count(self.cfg),
            "steps": self.step,
            "planned_steps": self.plan.total_steps,
            "tokens_seen": self.tokens_seen,
            "train_time_s": self.train_time_s,
            "train_bytes_per_s": self.tokens_seen / self.train_time_s if self.train_time_s else None,
            "final_train_loss_mean_last_50": float(np.mean(self.recent_losses)) if self.recent_losses else None,
            "eval": {"windows": int(windows.shape[0]), "seq_len": a.seq_len, "bpb_float": bpb_float},
            "device": str(self.device),
        }
        if a.export:
            metrics["int4"] = self._export_int4(windows, batch)
        metrics["eval_time_s"] = time.monotonic() - t0
        metrics["elapsed_s"] = time.monotonic() - self.start
        (a.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
        log(f"wrote {a.out / 'metrics.json'} (elapsed {metrics['elapsed_s']:.0f}s)")
        return metrics

    def _export_int4(self, windows: torch.Tensor, batch: int) -> dict[str, Any]:
        try:
            from tinyloop.format.writer import write_model
        except ImportError as exc:
            log(f"skipping the .tinyloop export: {exc}")
            return {"skipped": str(exc)}
        path = self.args.out / f"{self.cfg.name}.tinyloop"
        write_model(path, self.cfg, self.params.detached(), bits=4, group_size=64, float_dtype="F16", progress=False)
        bpb = bpb_by_loops(engine_from_file(path, self.device), windows, self.args.eval_loops, batch)
        log(f"INT4 bits/byte by loops: {_fmt(bpb)} ({path.stat().st_size} bytes)")
        return {"path": path.name, "bytes": path.stat().st_size, "bpb": bpb}


def check_corpus(data_dir: Path, splits: dict[str, np.ndarray]) -> None:
    """Refuse split files that differ from their manifest (a half-copied corpus must not train)."""
    manifest_path = data_dir / "manifest.json"
    if not manifest_path.exists():
        log(f"note: no manifest.json in {data_dir}; split hashes not checked")
        return
    manifest = json.loads(manifest_path.read_text())
    for name, arr in splits.items():
        want = manifest["splits"][name]["sha256"]
        got = hashlib.sha256(arr.tobytes()).hexdigest()
        if got != want:
            raise ValueError(f"{data_dir / (name + '.bin')}: sha256 {got} differs from the manifest's {want}")
    log(f"corpus {data_dir}: split hashes match the manifest (built with Python {manifest['python_version']})")


def _fmt(curve: dict[int, float]) -> str:
    return ", ".join(f"{n}: {v:.4f}" for n, v in curve.items())


def run(args: TrainArgs, start_time: float | None = None) -> dict[str, Any]:
    """Train (unless eval_only), then evaluate and export; returns the metrics."""
    trainer = Trainer(args, start_time)
    if not args.eval_only:
        trainer.train()
    if args.stop_at is not None and not args.eval_only:
        return {"steps": trainer.step}
    return trainer.evaluate_and_export()
