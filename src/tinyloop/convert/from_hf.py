"""`tinyloop-convert --from-hf DIR`: a Hugging Face Ouro or Huginn folder -> one `.tinyloop` file.

Every tensor is checked (missing, unknown, wrong shape or dtype) before anything is written; then the
writer pulls one canonical tensor at a time, which reads (and fuses) only its own source tensors.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from tinyloop import log
from tinyloop.config import ArchConfig
from tinyloop.convert.hf_families import FamilyPlan, plan_for
from tinyloop.convert.hf_files import HFFolder, read_folder
from tinyloop.format.header import ModelHeader
from tinyloop.format.tokenizer_meta import TokenizerMeta
from tinyloop.layout import TensorSpec, model_specs

_FLOAT_SOURCES = {"F32", "F16", "BF16"}
# Special tokens each chat template needs as single tokens.
_CHAT_TOKENS = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "huginn": ("<|begin_text|>", "<|begin_header|>", "<|end_header|>", "<|end_turn|>"),
}


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names) - limit} more)"


def check_tensors(folder: HFFolder, plan: FamilyPlan) -> None:
    """Refuse missing, unknown, wrongly shaped or non-float source tensors, naming them."""
    needed: dict[str, tuple[int, ...]] = {}
    for recipe in plan.recipes.values():
        for name, shape in recipe.parts:
            needed[name] = shape
    missing = sorted(n for n in needed if n not in folder.tensors)
    if missing:
        raise folder.fail("tensors", f"every tensor of a {plan.family} checkpoint", f"missing {_names(missing)}")
    unknown = sorted(n for n in folder.tensors if n not in needed and n not in plan.ignored)
    if unknown:
        raise folder.fail("tensors", f"only tensors of a {plan.family} checkpoint", f"unknown {_names(unknown)}")
    for name, shape in needed.items():
        loc = folder.tensors[name]
        if loc.shape != shape:
            raise folder.fail(f"tensor {name!r}", f"shape {list(shape)} (from config.json)", str(list(loc.shape)))
        if loc.dtype not in _FLOAT_SOURCES:
            raise folder.fail(f"tensor {name!r}", f"a dtype in {sorted(_FLOAT_SOURCES)}", loc.dtype)


def _ids(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def tokenizer_meta(folder: HFFolder, plan: FamilyPlan, cfg: ArchConfig) -> TokenizerMeta | None:
    """The embedded tokenizer: tokenizer.json plus special ids from the JSON configs and the family."""
    tj = folder.tokenizer_json
    if tj is None:
        return None
    vocab: dict[str, int] = {}
    model_vocab = tj.get("model", {}).get("vocab") if isinstance(tj.get("model"), dict) else None
    if isinstance(model_vocab, dict):
        vocab.update({k: v for k, v in model_vocab.items() if isinstance(v, int)})
    for tok in tj.get("added_tokens") or []:
        if isinstance(tok, dict) and isinstance(tok.get("content"), str) and isinstance(tok.get("id"), int):
            vocab[tok["content"]] = tok["id"]

    def first_id(key: str) -> int | None:
        for source in (folder.generation_config, folder.config):
            ids = _ids(source.get(key))
            if ids:
                return ids[0]
        return None

    def in_vocab(ids: list[int]) -> list[int]:
        return [i for i in ids if 0 <= i < cfg.vocab_size]

    eos = in_vocab(_ids(folder.generation_config.get("eos_token_id", folder.config.get("eos_token_id"))))
    stops = [vocab[text] for text, _ in plan.stop_tokens if text in vocab]
    absent = [text for text, _ in plan.stop_tokens if text not in vocab]
    if absent:
        log.info(f"warning: tokenizer.json has no {absent}; generation stops only at {sorted(set(stops + eos))}")
    bos = first_id("bos_token_id")
    if bos is None and plan.add_bos:
        bos = vocab.get("<|begin_text|>")
    bos = bos if bos is not None and 0 <= bos < cfg.vocab_size else None
    pad = first_id("pad_token_id")
    add_bos = folder.tokenizer_config.get("add_bos_token", plan.add_bos) is True and bos is not None
    template = plan.chat_template
    lacking = [t for t in _CHAT_TOKENS.get(template, ()) if t not in vocab]
    if lacking:
        log.info(f"warning: tokenizer.json lacks {lacking}; --chat is disabled for this model")
        template = "none"
    source_template = folder.tokenizer_config.get("chat_template")
    return TokenizerMeta(
        tokenizer_json=tj,
        bos_id=bos,
        eos_ids=tuple(eos),
        pad_id=pad if pad is not None and 0 <= pad < cfg.vocab_size else None,
        stop_ids=tuple(sorted(set(in_vocab(stops) + eos))),
        add_bos=add_bos,
        chat_template=template,
        source_chat_template=source_template if isinstance(source_template, str) else None,
    )


def _float_dtype(folder: HFFolder, requested: str | None) -> str:
    """`auto`: the source's own precision, so a 16-bit conversion is exact (F32 stays F32)."""
    if requested is not None and requested.lower() != "auto":
        return requested.upper()
    dtypes = folder.source_dtypes & _FLOAT_SOURCES
    return "F32" if "F32" in dtypes else "BF16" if "BF16" in dtypes else "F16"


def prepare_hf(
    directory: str | os.PathLike[str], state_start: str | None = None
) -> tuple[HFFolder, FamilyPlan, TokenizerMeta | None]:
    """Read and check a folder without writing anything: its family plan and tokenizer metadata."""
    folder = read_folder(directory)
    plan = plan_for(folder, Path(directory).resolve().name)
    if state_start is not None:
        if plan.cfg.state_start == "prelude":
            raise ValueError(f"--state-start applies to models with a separate loop state; {plan.family} has none")
        std = plan.cfg.state_init_std or math.sqrt(2 / 5)
        plan.cfg = plan.cfg.replace(state_start=state_start, state_init_std=std if state_start == "random" else 0.0)
    check_tensors(folder, plan)
    for check in plan.checks:
        check(folder)
    meta = tokenizer_meta(folder, plan, plan.cfg)
    if meta is None:
        log.info("warning: no tokenizer.json in the folder; the model will take token ids only")
    return folder, plan, meta


def convert_hf(
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str],
    bits: int = 16,
    group_size: int | None = 64,
    float_dtype: str | None = None,
    progress: bool = True,
    state_start: str | None = None,
) -> ModelHeader:
    """Convert a Hugging Face Ouro / Huginn folder; float_dtype None or 'auto' keeps the source precision."""
    import torch

    from tinyloop.format.writer import write_model_streamed

    folder, plan, meta = prepare_hf(directory, state_start)
    specs = {s.name for s in model_specs(plan.cfg)}
    assert specs == set(plan.recipes), sorted(specs ^ set(plan.recipes))

    def source(spec: TensorSpec) -> Any:
        t = plan.recipes[spec.name].build(folder)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            sources = ", ".join(name for name, _ in plan.recipes[spec.name].parts)
            raise folder.fail(f"tensor {sources}", "finite values", "NaN or infinite values")
        return t

    metadata = {"tokenizer": meta.to_json()} if meta is not None else None
    return write_model_streamed(
        out, plan.cfg, source, bits, group_size, _float_dtype(folder, float_dtype), progress, metadata
    )
