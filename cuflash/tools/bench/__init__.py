"""``python -m cuflash bench``: the forward, backward and FP8 benchmark against torch SDPA.

config (the grid and modes) -> timing (CUDA-event medians of heated, interleaved shares) ->
runner (one configuration; the driver), with peers (torch SDPA), report (lines, tables, plot) and
fp8_errors (FP8's error table) beside it. All of cuflash's timing code lives in this package.
"""
from .config import (BENCH_DTYPES, BF16_PEER, DEFAULT_HEAD_DIMS, DEFAULT_SEQLENS, FP8, MODES, OVERHEAD_PROBLEM,
                     PREPARED_V_PEER, BenchConfig, paper_grid, parse_spec_override)
from .fp8_errors import FP8_ERROR_PROBLEM, fp8_error_markdown, fp8_error_table, format_fp8_error_line
from .peers import TORCH_BACKENDS, import_torch, to_torch
from .report import format_line, markdown_tables, write_plot
from .runner import (add_arguments, backward_extra_bytes, bench_config, bench_fp8_config, measure_overhead,
                  parse_bench_dtype, random_inputs, run, run_benchmark)
from .timing import (BENCH_HEAT_MS, BENCH_ROUNDS, cuda_event_median_ms, cuda_event_times_ms, event_timer,
                     first_call_seconds, host_overhead_us, interleaved_median_ms, rotated, split_reps,
                     torch_event_median_ms, torch_event_times_ms)

__all__ = ["BENCH_DTYPES", "BF16_PEER", "DEFAULT_HEAD_DIMS", "DEFAULT_SEQLENS", "FP8", "MODES", "OVERHEAD_PROBLEM",
           "PREPARED_V_PEER", "BenchConfig", "paper_grid", "parse_spec_override", "FP8_ERROR_PROBLEM",
           "fp8_error_markdown", "fp8_error_table", "format_fp8_error_line", "TORCH_BACKENDS", "import_torch",
           "to_torch", "format_line", "markdown_tables", "write_plot", "add_arguments", "backward_extra_bytes",
           "bench_config", "bench_fp8_config", "measure_overhead", "parse_bench_dtype", "random_inputs", "run",
           "run_benchmark", "BENCH_HEAT_MS", "BENCH_ROUNDS", "cuda_event_median_ms", "cuda_event_times_ms",
           "event_timer", "first_call_seconds", "host_overhead_us", "interleaved_median_ms", "rotated", "split_reps",
           "torch_event_median_ms", "torch_event_times_ms"]
