"""Which tests are `interpret` and `slow`: `python -m pytest -m "not slow"` is the fast subset."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).absolute().parent
# Modules that run Triton kernels in Triton's CPU interpreter (a Python call per program): `interpret`, `slow`.
INTERPRET_MODULES = (
    "kernels/test_triton_kernels.py",
    "kernels/test_fused_decode.py",
    "kernels/test_persistent_mlp.py",
    "kernels/test_batch_invariant.py",
    "stochastic/test_triton_interpreter.py",
)
# Other tests over ~1.3 s on an idle 2-core CPU VM (pytest --durations), mostly end-to-end CLI runs in a
# subprocess: `slow`. An entry covers every case of a parametrized test.
SLOW_TESTS = (
    "families/test_text_and_exits.py::test_cli_text_model_stop_strings_regex_and_warmup",
    "families/test_text_and_exits.py::test_cli_generate_is_tokenizer_first",
    "train/test_trainer.py::test_toy_training_learns_and_exports",
    "generation/test_cli_generation.py::test_speculate_stops_like_generate",
    "generation/test_cli_generation.py::test_generate_with_regex_json_schema_and_depth_schedule",
    "generation/test_cli_generation.py::test_speculate_matches_generate_and_prints_stats",
    "generation/test_cli_generation.py::test_speculate_with_depth_schedule_matches_generate",
    "generation/test_spec_sampling.py::test_speculative_sampling_matches_the_verifier_end_to_end",
    "engine/test_cpu_int4_decode.py::test_builtin_model_in_bfloat16_generates_as_float32",
    "cli/test_cli.py::test_generate_in_bfloat16_on_cpu_keeps_the_greedy_text",
    "cli/test_cli.py::test_generate_greedy_is_repeatable_and_log_level_zero_is_quiet",
    "cli/test_cli.py::test_lens_prints_a_row_per_position_and_draws_a_heatmap",
    "cli/test_benchmark.py::test_command_line_end_to_end",
    "cache/test_handle_lifetime.py::test_cli_cache_window",
    "api/test_generate_batch.py::test_batched_rows_equal_each_request_alone",
    "api/test_scheduler.py::test_abort_frees_the_slot_without_leaks_over_1000_requests",
    "api/test_isolation.py::test_no_cache_or_memory_growth_over_a_thousand_mixed_requests",
    "cli/test_cli_errors.py::test_a_closed_pipe_ends_quietly",
    "cli/test_cli_errors.py::test_convert_entry_point_is_guarded_too",
    "cli/test_cli.py::test_generate_streams_prompt_and_continuation",
    "integrations/test_lm_eval.py::test_loglikelihood_equals_score_and_naive_reference",
    "families/test_text_and_exits.py::test_adaptive_exit_runs_in_the_models_kv_mode",
    "families/test_text_and_exits.py::test_adaptive_criteria",
    "format/test_format_atomic.py::test_sigterm_mid_write_removes_the_temporary_file",
    "cli/test_dtype_auto.py::test_speculate_takes_the_same_dtype_as_generate",
    "integrations/test_lm_eval.py::test_cli_errors_are_one_line",
    "integrations/test_lm_eval.py::test_shipped_task_through_lm_evals_evaluator_repeats",
    "integrations/test_lm_eval.py::test_cli_sweep_writes_table_json_and_both_argument_orders",
    "integrations/test_lm_eval.py::test_greedy_generate_until_equals_generate_with_the_same_stops",
    "serve/test_serve_lifecycle.py::test_sigterm_ends_in_flight_requests_and_exits_0",
    "serve/test_serve_openai_api.py::test_streamed_completion_equals_the_whole_one_sync_and_async",
    "serve/test_serve_openai_api.py::test_same_seed_same_text_and_n_choices",
    "serve/test_serve_openai_api.py::test_chat_stream_role_first_content_usage_then_done",
    "jobs/test_batch_job.py::test_200_mixed_rows_equal_generate_row_by_row_and_bad_rows_go_to_the_errors_file",
    "jobs/test_batch_job.py::test_scoring_tasks_equal_the_introspection_api",
    "jobs/test_batch_job.py::test_interrupted_job_resumes_to_the_same_output",
    "jobs/test_batch_job.py::test_cli_job_killed_after_its_first_shard_resumes_to_the_same_output",
    "integrations/test_ray_data.py::test_ray_job_equals_the_local_job",
    "integrations/test_ray_data.py::test_predictor_in_map_batches_on_a_users_dataset",
    "integrations/test_ray_serve.py::test_ray_serve_answers_the_openai_client_like_the_single_server",
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
