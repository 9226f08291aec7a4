"""Shared by the family tests: the reference vector folders, a tiny tokenizer, relative errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from shared_data import shared_path

SPECIALS = {
    "ouro": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "huginn": ["<|begin_text|>", "<|end_text|>", "<|begin_header|>", "<|end_header|>", "<|end_turn|>", "<|pad|>"],
}
TEXTS = [
    "The quick brown fox jumps over the lazy dog. Looped transformers reuse their weights.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Ouro and Huginn think in loops; the answer comes after several iterations.",
]


def tiny_tokenizer_json(family: str, vocab_size: int = 320) -> str:
    """A byte-level BPE trained on a few sentences, with the family's special tokens first (ids 0..)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS[family],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS, trainer)
    return str(tok.to_str())


def family_dir(family: str) -> Path:
    """The family's reference vectors in `../shared` (a failure on CI when missing, a visible skip elsewhere)."""
    return shared_path("vectors", f"{family}-tiny")


def copy_vectors(family: str, dest: Path, tokenizer: bool = True) -> Path:
    """The reference checkpoint folder (config, generation config, weights), plus a tiny tokenizer."""
    source = family_dir(family)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(source / name, dest / name)
        (dest / name).chmod(0o644)
    if tokenizer:
        (dest / "tokenizer.json").write_text(tiny_tokenizer_json(family))
        (dest / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return dest


def reference(family: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    source = family_dir(family)
    meta = json.loads((source / "reference.json").read_text())
    return meta, load_file(str(source / "reference.safetensors"))


def max_rel(got, ref) -> float:  # type: ignore[no-untyped-def]
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())
