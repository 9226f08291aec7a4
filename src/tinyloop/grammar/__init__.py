"""Constrained decoding: regular-expression and JSON-schema grammars compiled to per-state token masks."""

from tinyloop.grammar.grammar import Grammar

__all__ = ["Grammar"]
