"""Cross-iteration stochastic rounding of looped INT4 weights (format 2.0 rounding channels).

No imports here: the torch-free header parser reads `channel_kinds` from this package.
"""
