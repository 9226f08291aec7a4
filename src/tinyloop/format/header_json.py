"""Bounded reading of a `.tinyloop` header's JSON (pure stdlib): the top-level object member by member, so a
hostile header is refused after the entries a model can need instead of being parsed in full."""

from __future__ import annotations

import json
import re
from json.decoder import scanstring  # type: ignore[attr-defined]  # C-accelerated, stable since 3.0
from typing import Any, NoReturn

from tinyloop.format.spec import MAX_ENTRY_CHARS, MAX_METADATA_KEYS, MAX_TENSORS, METADATA_JSON_LIMITS
from tinyloop.strict_json import unique_keys


def loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=unique_keys)


_DECODER = json.JSONDecoder(object_pairs_hook=unique_keys)
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_FIRST_CHAR_TYPE = {"{": "object", "[": "array", '"': "string", "t": "boolean", "f": "boolean", "n": "null"}


def show(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def clip(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def type_name(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


class BoundedJson:
    """The header scanner; `fail` (what, expected, found) raises the caller's error."""

    def fail(self, what: str, expected: str, found: str) -> NoReturn:
        raise NotImplementedError

    def scan(self, text: str) -> dict[str, Any]:
        """The header object, read member by member: tensor entries are parsed one at a time from at most
        MAX_ENTRY_CHARS characters and counted, so a header of a million entries is refused after
        MAX_TENSORS of them instead of being parsed in full (seconds and gigabytes)."""
        pos = self.skip(text, 0)
        if not text.startswith("{", pos):
            self.fail("header", "a JSON object", self.type_at(text, pos))
        doc: dict[str, Any] = {}
        pos = self.skip(text, pos + 1)
        if text.startswith("}", pos):
            pos += 1
        else:
            while True:
                key, pos = self.key(text, pos, doc)
                if key == "__metadata__":
                    doc[key], pos = self.scan_metadata(text, pos)
                else:
                    if len(doc) >= MAX_TENSORS + 1:
                        self.fail("header", f"at most {MAX_TENSORS} tensor entries", "more")
                    doc[key], pos = self.value(text, pos, f"tensor {show(key)}", MAX_ENTRY_CHARS)
                pos, more = self.after_member(text, pos)
                if not more:
                    break
        if self.skip(text, pos) != len(text):
            self.fail("header", "a well-formed JSON object", f"invalid JSON (extra data at char {pos})")
        return doc

    def scan_metadata(self, text: str, pos: int) -> tuple[Any, int]:
        """`__metadata__`: an object of strings (anything else is refused before it is parsed)."""
        if not text.startswith("{", pos):
            found = self.type_at(text, pos)
            self.fail("__metadata__", "an object of strings (not a tinyloop file?)", found)
        meta: dict[str, str] = {}
        pos = self.skip(text, pos + 1)
        if text.startswith("}", pos):
            return meta, pos + 1
        while True:
            key, pos = self.key(text, pos, meta)
            if len(meta) >= MAX_METADATA_KEYS:
                self.fail("__metadata__", f"at most {MAX_METADATA_KEYS} keys", "more")
            if not text.startswith('"', pos):
                self.fail(f"metadata {key!r}", "a string", self.type_at(text, pos))
            meta[key], pos = self.string(text, pos + 1)
            pos, more = self.after_member(text, pos)
            if not more:
                return meta, pos

    def key(self, text: str, pos: int, seen: dict[str, Any]) -> tuple[str, int]:
        if not text.startswith('"', pos):
            self.fail("header", "a well-formed JSON object", f"invalid JSON (a key expected at char {pos})")
        key, pos = self.string(text, pos + 1)
        if key in seen:
            self.fail("header", "a well-formed JSON object", f"invalid JSON (duplicate key {key!r})")
        pos = self.skip(text, pos)
        if not text.startswith(":", pos):
            self.fail("header", "a well-formed JSON object", f"invalid JSON (':' expected at char {pos})")
        return key, self.skip(text, pos + 1)

    def string(self, text: str, pos: int) -> tuple[str, int]:
        try:
            return scanstring(text, pos, True)
        except ValueError as exc:
            self.fail("header", "a well-formed JSON object", f"invalid JSON ({clip(str(exc))})")

    def value(self, text: str, pos: int, what: str, limit: int) -> tuple[Any, int]:
        try:
            value, length = _DECODER.raw_decode(text[pos : pos + limit])
        except (ValueError, RecursionError) as exc:
            if len(text) - pos > limit:
                self.fail(what, f"a JSON value of at most {limit} characters", "a longer or malformed one")
            self.fail("header", "a well-formed JSON object", f"invalid JSON ({clip(str(exc))})")
        return value, pos + length

    def after_member(self, text: str, pos: int) -> tuple[int, bool]:
        pos = self.skip(text, pos)
        if text.startswith(",", pos):
            return self.skip(text, pos + 1), True
        if text.startswith("}", pos):
            return pos + 1, False
        self.fail("header", "a well-formed JSON object", f"invalid JSON (',' or '}}' expected at char {pos})")

    @staticmethod
    def skip(text: str, pos: int) -> int:
        match = _WHITESPACE.match(text, pos)
        assert match is not None
        return match.end()

    @staticmethod
    def type_at(text: str, pos: int) -> str:
        return "nothing" if pos >= len(text) else _FIRST_CHAR_TYPE.get(text[pos], "number")

    def bounded_json(self, key: str, text: str) -> None:
        """Refuse a metadata JSON document too long or with too many objects and arrays to need parsing."""
        max_chars, max_containers = METADATA_JSON_LIMITS[key]
        if len(text) > max_chars:
            self.fail(f"metadata {key!r}", f"at most {max_chars} characters", f"{len(text)}")
        containers = text.count("{") + text.count("[")
        if containers > max_containers:
            self.fail(f"metadata {key!r}", f"at most {max_containers} objects and arrays", f"{containers}")
