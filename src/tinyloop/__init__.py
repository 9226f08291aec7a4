"""TinyLoop: a runtime for looped transformers."""
