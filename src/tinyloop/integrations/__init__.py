"""Bridges to other tools, each behind an optional extra; import a module here only when you use it."""
