"""Matrix kernels behind one dispatch point (dense, INT8, INT4; CPU reference and GPU backends)."""

from tinyloop.kernels.dispatch import embedding, linear, register_linear_kernel

__all__ = ["embedding", "linear", "register_linear_kernel"]
