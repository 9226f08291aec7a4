"""`--regex` / `--json-schema` for the generate and speculate verbs: parsed into a Grammar, one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tinyloop.cli.args import CliError, Parser


def add_constraint_arguments(p: Parser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--regex", default=None, help="constrain the continuation to match this regular expression")
    g.add_argument("--json-schema", default=None, metavar="FILE_OR_JSON", help="constrain it to JSON valid here")


def build_grammar(args: Any) -> Any:
    """A tinyloop.Grammar from --regex / --json-schema, or None."""
    if args.regex is None and args.json_schema is None:
        return None
    from tinyloop.grammar import Grammar

    try:
        if args.regex is not None:
            return Grammar.from_regex(args.regex)
        return Grammar.from_json_schema(_schema_text(args.json_schema))
    except ValueError as exc:
        flag = "--regex" if args.regex is not None else "--json-schema"
        raise CliError(f"{flag}: {_one_line(str(exc))}") from None


def _schema_text(value: str) -> str:
    text = value.strip()
    if text[:1] in ("{", "[") or text in ("true", "false"):
        return text
    try:
        text = Path(value).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"not inline JSON and not a readable file: {exc.strerror}: {value!r}") from None
    return text


def _one_line(text: str) -> str:
    return " ".join(text.split())
