"""The `tokenizer` metadata key: an embedded Hugging Face tokenizer and its special ids (pure stdlib).

The value is a JSON object (see docs/format.md, "2.3 tokenizer"); this module parses and validates it
without importing the `tokenizers` library, so header-only tools stay light.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tinyloop.strict_json import unique_keys as _unique_keys

TOKENIZER_FORMAT = "hf-tokenizers"
TOKENIZER_VERSION = 1
CHAT_TEMPLATES = ("none", "chatml", "huginn")
_KEYS = (
    "format", "version", "tokenizer_json", "bos_id", "eos_ids", "pad_id", "stop_ids", "add_bos",
    "chat_template", "source_chat_template",
)  # fmt: skip


class TokenizerMetaError(ValueError):
    """The `tokenizer` metadata is malformed; the message says which field and why."""


@dataclass(frozen=True)
class TokenizerMeta:
    """What a `.tinyloop` file says about its tokenizer.

    tokenizer_json: the parsed content of the checkpoint's tokenizer.json.
    stop_ids: generation stops after emitting any of these (the family's end tokens + eos ids).
    chat_template: which built-in template renders chat prompts ('none': no chat support).
    source_chat_template: the checkpoint's own Jinja template, kept for reference (never rendered).
    """

    tokenizer_json: dict[str, Any]
    bos_id: int | None
    eos_ids: tuple[int, ...]
    pad_id: int | None
    stop_ids: tuple[int, ...]
    add_bos: bool
    chat_template: str
    source_chat_template: str | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": TOKENIZER_FORMAT,
                "version": TOKENIZER_VERSION,
                "tokenizer_json": self.tokenizer_json,
                "bos_id": self.bos_id,
                "eos_ids": list(self.eos_ids),
                "pad_id": self.pad_id,
                "stop_ids": list(self.stop_ids),
                "add_bos": self.add_bos,
                "chat_template": self.chat_template,
                "source_chat_template": self.source_chat_template,
            },
            ensure_ascii=False,
            separators=(",", ":"),
        )


def _is_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def parse_tokenizer_meta(text: str, vocab_size: int) -> TokenizerMeta:
    """Parse and check the metadata string; raise TokenizerMetaError naming the first problem."""
    try:
        obj = json.loads(text, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as exc:
        raise TokenizerMetaError(f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise TokenizerMetaError(f"must be a JSON object, found {type(obj).__name__}")
    missing = [k for k in _KEYS if k not in obj]
    extra = sorted(k for k in obj if k not in _KEYS)
    if missing or extra:
        raise TokenizerMetaError(f"must have exactly the keys {list(_KEYS)}: missing {missing}, unknown {extra}")
    if obj["format"] != TOKENIZER_FORMAT or obj["version"] != TOKENIZER_VERSION:
        found = f"{obj['format']!r}/{obj['version']!r}"
        raise TokenizerMetaError(f"format/version must be {TOKENIZER_FORMAT!r}/{TOKENIZER_VERSION}, found {found}")
    tj = obj["tokenizer_json"]
    if not isinstance(tj, dict) or not isinstance(tj.get("model"), dict):
        raise TokenizerMetaError("'tokenizer_json' must be a tokenizer.json object with a 'model' object")
    for key in ("bos_id", "pad_id"):
        if obj[key] is not None and not _is_id(obj[key], vocab_size):
            raise TokenizerMetaError(f"{key!r} must be null or an id in [0, {vocab_size}), found {obj[key]!r}")
    for key in ("eos_ids", "stop_ids"):
        ids = obj[key]
        if not isinstance(ids, list) or not all(_is_id(i, vocab_size) for i in ids):
            raise TokenizerMetaError(f"{key!r} must be a list of ids in [0, {vocab_size}), found {ids!r}"[:200])
    if not isinstance(obj["add_bos"], bool):
        raise TokenizerMetaError(f"'add_bos' must be true or false, found {obj['add_bos']!r}")
    if obj["add_bos"] and obj["bos_id"] is None:
        raise TokenizerMetaError("'add_bos' is true but 'bos_id' is null")
    if obj["chat_template"] not in CHAT_TEMPLATES:
        raise TokenizerMetaError(
            f"'chat_template' must be one of {list(CHAT_TEMPLATES)}, found {obj['chat_template']!r}"
        )
    src = obj["source_chat_template"]
    if src is not None and not isinstance(src, str):
        raise TokenizerMetaError("'source_chat_template' must be null or a string")
    return TokenizerMeta(
        tokenizer_json=tj,
        bos_id=obj["bos_id"],
        eos_ids=tuple(obj["eos_ids"]),
        pad_id=obj["pad_id"],
        stop_ids=tuple(obj["stop_ids"]),
        add_bos=obj["add_bos"],
        chat_template=obj["chat_template"],
        source_chat_template=src,
    )
