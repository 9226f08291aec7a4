"""Training of the built-in byte-level looped model: corpus, trainer, and evaluation."""
