"""What the benchmark modes share: random inputs, the --dtype flag, and recording cuflash's timing."""
from __future__ import annotations

from .config import BENCH_DTYPES, FP8


def random_inputs(shape, dtype_tag: str, seed: int = 0):
    """q, k, v: standard normal CuPy arrays of ``shape`` in the dtype of ``dtype_tag``."""
    import cupy

    from cuflash.core import dtypes
    element = dtypes.from_tag(dtype_tag).numpy
    rng = cupy.random.default_rng(seed)
    return tuple(rng.standard_normal(shape, dtype=cupy.float32).astype(element) for _ in range(3))


def _free_device_memory():
    import gc

    import cupy
    gc.collect()   # an exception recorded by the timing holds its frames (and their arrays) in a cycle
    cupy.get_default_memory_pool().free_all_blocks()


def _record_ours(result, outcome, output):
    """Put cuflash's timing ``outcome`` (ms, or the exception its call raised) into ``result`` and
    return ``output()`` (the output the peers are checked against); None after an error."""
    try:
        if isinstance(outcome, Exception):
            raise outcome
        result.update(ms=outcome, tflops=result["flops"] / outcome / 1e9)
        return output()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        return None


def parse_bench_dtype(text: str, mode: str = "fwd") -> str:
    """``--dtype`` -> the tag timed: fp16, bf16, fp32 (or an alias of one), or fp8 (forward only)."""
    if text == FP8:
        if mode != "fwd":
            raise ValueError(f"--dtype fp8 times the forward only (got --mode {mode})")
        return FP8
    from cuflash.core import dtypes
    tag = dtypes.from_tag(text).tag
    if tag not in BENCH_DTYPES:
        raise ValueError(f"--dtype {text!r}: choose one of {', '.join(BENCH_DTYPES)} "
                         f"(FP8 formats through --dtype fp8 --fp8-format)")
    return tag
