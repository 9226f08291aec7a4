"""Which tests are `interpret` and `slow`: `python -m pytest -m "not slow"` is the fast subset."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).absolute().parent
# Modules that run Triton kernels in Triton's CPU interpreter (a Python call per program): `interpret`, `slow`.
INTERPRET_MODULES = (
    "kernels/test_triton_kernels.py",
    "kernels/test_fused_decode.py",
    "stochastic/test_triton_interpreter.py",
)
# Other tests over ~2 s on the 2-core CPU VM (pytest --durations): `slow`. Every case of a parametrized test.
SLOW_TESTS = (
    "families/test_text_and_exits.py::test_cli_text_model_stop_strings_regex_and_warmup",
    "families/test_text_and_exits.py::test_cli_generate_is_tokenizer_first",
    "train/test_trainer.py::test_toy_training_learns_and_exports",
    "generation/test_cli_generation.py::test_speculate_stops_like_generate",
    "generation/test_cli_generation.py::test_generate_with_regex_json_schema_and_depth_schedule",
    "cli/test_cli.py::test_generate_in_bfloat16_on_cpu_keeps_the_greedy_text",
    "cli/test_cli.py::test_generate_greedy_is_repeatable_and_log_level_zero_is_quiet",
    "cache/test_handle_lifetime.py::test_cli_cache_window",
    "cli/test_dtype_auto.py::test_speculate_takes_the_same_dtype_as_generate",
)


def add_markers(items: list[pytest.Item]) -> None:
    """Marks the listed tests (pytest_collection_modifyitems in conftest.py)."""
    for item in items:
        if not item.path.is_relative_to(TESTS):
            continue
        module = item.path.relative_to(TESTS).as_posix()
        if module in INTERPRET_MODULES:
            item.add_marker(pytest.mark.interpret)
            item.add_marker(pytest.mark.slow)
        name = getattr(item, "originalname", item.name)
        if f"{module}::{name}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
