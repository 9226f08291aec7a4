"""`Grammar`: a regular language generated text must belong to, from a regex or a JSON schema."""

from __future__ import annotations

import functools
import json
import re
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads only when an index is built: CLI argument errors stay fast
    import torch

    from tinyloop.grammar.index import TokenIndex
    from tinyloop.grammar.vocab import TokenVocab

# Constructs Python's `re` accepts but a finite automaton cannot express (or the automaton library reads
# differently); found by a scan so the error can name their position.
_UNSUPPORTED = (
    ("(?=", "lookahead"),
    ("(?!", "negative lookahead"),
    ("(?<=", "lookbehind"),
    ("(?<!", "negative lookbehind"),
    ("(?>", "atomic group"),
    ("(?(", "conditional group"),
    ("(?P=", "backreference"),
)


class Grammar:
    """Generation may only produce text that `pattern` fully matches (Python `re.fullmatch` semantics).

    Leading `^` and trailing `$` are accepted and redundant. Lookaround, backreferences, atomic groups,
    word boundaries and `\\A`/`\\Z` are refused (ValueError naming their position): a finite automaton
    cannot check them. The token index is built per vocabulary on first use and cached.
    """

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str):
            raise ValueError(f"a grammar pattern must be a str, got {type(pattern).__name__}")
        self.pattern = _validate(pattern)
        self.source = pattern
        self._indexes: dict[tuple[str, str], TokenIndex] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_regex(cls, pattern: str) -> Grammar:
        return cls(pattern)

    @classmethod
    def from_json_schema(cls, schema: str | dict[str, Any], whitespace: str | None = None) -> Grammar:
        """JSON text valid under `schema` (a dict or JSON text). `whitespace` is the regex allowed
        between tokens (default: at most one space)."""
        from outlines_core.json_schema import build_regex_from_schema

        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"JSON schema is not valid JSON: {exc}") from None
        _check_schema_keywords(parsed, "")
        try:
            pattern = build_regex_from_schema(text, whitespace)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ValueError(f"unsupported JSON schema: {exc}") from None
        return cls(pattern)

    def __repr__(self) -> str:
        return f"Grammar({self.source!r})"

    def index(self, vocab: TokenVocab, device: torch.device | str = "cpu") -> TokenIndex:
        """The automaton x vocabulary index (masks on `device`), built once per vocabulary and device."""
        from tinyloop.grammar.index import TokenIndex

        key = (vocab.key, str(device))
        with self._lock:
            if key not in self._indexes:
                self._indexes[key] = TokenIndex.build(self.pattern, vocab, device)
            return self._indexes[key]


# Keywords the schema-to-regex translation would silently ignore: refused, so no output can break them.
_UNSUPPORTED_SCHEMA = (
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems", "not",
    "if", "then", "else", "dependentRequired", "dependentSchemas", "contains",
)  # fmt: skip


def _check_schema_keywords(node: Any, where: str) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_schema_keywords(item, f"{where}/{i}")
    elif isinstance(node, dict):
        in_properties = where.endswith("/properties") or where.endswith("/$defs") or where.endswith("/definitions")
        for key, value in node.items():
            if not in_properties and key in _UNSUPPORTED_SCHEMA:
                raise ValueError(f"unsupported JSON schema keyword {key!r} at {where or '/'}")
            if key not in ("enum", "const", "default", "examples"):
                _check_schema_keywords(value, f"{where}/{key}")


def _validate(pattern: str) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            re.compile(pattern)
    except re.error as exc:
        pos = exc.pos if exc.pos is not None else len(pattern)
        raise ValueError(f"invalid regular expression at position {pos}: {exc.msg}: {pattern!r}") from None
    _check_supported(pattern)
    body = pattern
    if body.startswith("^"):
        body = body[1:]
    if body.endswith("$") and not _escaped(body, len(body) - 1):
        body = body[:-1]
    return _with_python_classes(body)


# The automaton library reads \d, \s and \w as Unicode classes of its own (its \w also takes combining marks,
# U+FE0E say, which Python's does not), so they are spelled out as Python reads them in str patterns.
_CLASS_ESCAPES = "dswDSW"


@functools.cache
def _python_ranges(letter: str) -> tuple[tuple[int, int], ...]:
    """The code points Python's `\\<letter>` matches (d, s or w; upper case: the complement), surrogates left
    out, as inclusive ranges."""
    if letter.isupper():
        gaps: list[tuple[int, int]] = []
        edge = 0
        ends = (*_python_ranges(letter.lower()), (0xD800, 0xDFFF), (sys.maxunicode + 1, sys.maxunicode + 1))
        for a, b in sorted(ends):
            if a > edge:
                gaps.append((edge, a - 1))
            edge = max(edge, b + 1)
        return tuple(gaps)
    rx = re.compile("\\" + letter)
    found: list[tuple[int, int]] = []
    start: int | None = None
    for c in range(sys.maxunicode + 2):
        member = c <= sys.maxunicode and not 0xD800 <= c <= 0xDFFF and rx.match(chr(c)) is not None
        if member and start is None:
            start = c
        elif not member and start is not None:
            found.append((start, c - 1))
            start = None
    return tuple(found)


def _class_members(letter: str) -> str:
    return "".join(f"\\x{{{a:x}}}" if a == b else f"\\x{{{a:x}}}-\\x{{{b:x}}}" for a, b in _python_ranges(letter))


def _with_python_classes(pattern: str) -> str:
    """`pattern` with each \\d, \\s, \\w and their complements replaced by the explicit class Python reads."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            nxt = pattern[i + 1 : i + 2]
            if nxt and nxt in _CLASS_ESCAPES:
                members = _class_members(nxt)
                out.append(members if in_class else f"[{members}]")
            else:
                out.append(pattern[i : i + 2])
            i += 2
            continue
        if in_class and ch == "]":
            in_class = False
        elif not in_class and ch == "[":
            in_class = True
            j = i + 1 + (pattern[i + 1 : i + 2] == "^")
            if pattern[j : j + 1] == "]":  # a ']' right after '[' or '[^' is a member
                out.append(pattern[i : j + 1])
                i = j + 1
                continue
        out.append(ch)
        i += 1
    return "".join(out)


def _escaped(pattern: str, i: int) -> bool:
    n = 0
    while i - n - 1 >= 0 and pattern[i - n - 1] == "\\":
        n += 1
    return n % 2 == 1


def _check_supported(pattern: str) -> None:
    i, in_class = 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            nxt = pattern[i + 1 : i + 2]
            if not in_class and (nxt.isdigit() and nxt != "0" or nxt in ("b", "B", "A", "Z")):
                what = "backreference" if nxt.isdigit() else f"anchor or word boundary '\\{nxt}'"
                raise ValueError(f"unsupported regular expression feature at position {i}: {what}: {pattern!r}")
            i += 2
            continue
        if in_class:
            if pattern.startswith("[:", i):
                raise ValueError(
                    f"unsupported regular expression feature at position {i}: '[:' inside a character class "
                    f"(POSIX classes are read differently by Python and the automaton): {pattern!r}"
                )
            if ch == "]":
                in_class = False
        elif ch == "[":
            in_class = True
            # A ']' right after '[' or '[^' is a literal member, not the end of the class.
            j = i + 1 + (pattern[i + 1 : i + 2] == "^")
            if pattern[j : j + 1] == "]":
                i = j
        elif ch == "(":
            for start, what in _UNSUPPORTED:
                if pattern.startswith(start, i):
                    raise ValueError(f"unsupported regular expression feature at position {i}: {what}: {pattern!r}")
        elif ch in "^$" and 0 < i < len(pattern) - 1:
            raise ValueError(f"unsupported regular expression feature at position {i}: anchor {ch!r} not at either end")
        i += 1
