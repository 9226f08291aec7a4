"""Constrained decoding: regular-expression and JSON-schema grammars compiled to per-state token masks."""

from tinyloop.grammar.grammar import Grammar
from tinyloop.grammar.index import TokenIndex

__all__ = ["Grammar", "TokenIndex"]
