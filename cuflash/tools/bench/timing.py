"""Timing: CUDA-event medians of heated shares in interleaved rounds of rotating order.

One CUDA event pair per repetition, the L2 cache flushed before each by reading a buffer larger
than it (so that the flush leaves no dirty lines whose write-back would land in the timed call);
the median is reported. The implementations of a configuration (cuflash and its peers) are timed in
interleaved rounds, each round a share of the repetitions of every one, in an order that rotates
from round to round, and each share right after about ``BENCH_HEAT_MS`` of GPU work of the same
implementation: the GPU's clock follows the power drawn over the last tens of milliseconds, so each
implementation is timed on the clock of its own load (docs/tuning.md, "Benchmark method"). torch is
optional and never imported at module level; both libraries are synchronized around every timed
region.
"""
from __future__ import annotations

import math
import statistics
import sys
import time

#: Interleaved rounds the repetitions of a configuration's implementations are split over.
BENCH_ROUNDS = 5
#: Milliseconds of GPU work an implementation runs right before each share of its repetitions, so
#: that it is timed on the clock its own load sets (:func:`event_timer`); at most
#: ``_MAX_HEAT_CALLS`` calls.
BENCH_HEAT_MS = 50.0
_MAX_HEAT_CALLS = 1000

_L2_FLUSH_BYTES = 256 * 2**20


def _cupy_flush_buffer():
    """A zeroed buffer of _L2_FLUSH_BYTES whose read (a max over its words) evicts the L2 cache."""
    import cupy
    return cupy.zeros(_L2_FLUSH_BYTES // 4, dtype=cupy.uint32)


def _synchronize_all():
    import cupy
    cupy.cuda.Device().synchronize()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def first_call_seconds(fn):
    """Host wall time of one call including its GPU work, and the call's result."""
    _synchronize_all()
    start = time.perf_counter()
    result = fn()
    _synchronize_all()
    return time.perf_counter() - start, result


def cuda_event_times_ms(fn, reps: int = 30, warmup: int = 3, flush_l2: bool = True) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn()`` on CuPy's current stream, one event pair
    per repetition. The warm-up calls run right before the timed ones, with no synchronization
    between: their GPU work keeps the GPU busy while the host prepares the first timed call, so
    no repetition times the host's launch latency (a call of cuflash spends tens of µs in Python
    before its kernel starts; after a synchronization the GPU would wait for it, inside the
    events)."""
    import cupy
    scratch = _cupy_flush_buffer() if flush_l2 else None
    for _ in range(max(warmup, 1)):
        fn()
    pairs = []
    for _ in range(reps):
        if scratch is not None:
            scratch.max()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    pairs[-1][1].synchronize()
    _synchronize_all()
    return [cupy.cuda.get_elapsed_time(s, e) for s, e in pairs]


def cuda_event_median_ms(fn, reps: int = 30, warmup: int = 3, flush_l2: bool = True) -> float:
    """Median milliseconds of ``fn()`` on CuPy's current stream (:func:`cuda_event_times_ms`)."""
    return statistics.median(cuda_event_times_ms(fn, reps, warmup, flush_l2))


def torch_event_times_ms(fn, reps: int = 30, warmup: int = 3, flush_l2: bool = True) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn()`` on torch's current stream, one event pair
    per repetition; warm-up as in :func:`cuda_event_times_ms`."""
    import torch
    _synchronize_all()
    scratch = torch.zeros(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush_l2 else None
    for _ in range(max(warmup, 1)):
        fn()
    pairs = []
    for _ in range(reps):
        if scratch is not None:
            scratch.max()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    _synchronize_all()
    return [s.elapsed_time(e) for s, e in pairs]


def torch_event_median_ms(fn, reps: int = 30, warmup: int = 3, flush_l2: bool = True) -> float:
    """Median milliseconds of ``fn()`` on torch's current stream (:func:`torch_event_times_ms`)."""
    return statistics.median(torch_event_times_ms(fn, reps, warmup, flush_l2))


def event_timer(times_ms, fn, flush_l2: bool = True, warmup: int = 3, heat_ms: float = BENCH_HEAT_MS):
    """A timer of ``fn`` for :func:`interleaved_median_ms`: ``reps -> [ms per repetition]`` through
    ``times_ms`` (:func:`cuda_event_times_ms` or :func:`torch_event_times_ms`). Its first use
    starts with ``warmup`` calls (the first call compiles) and one timed call, which says how long
    a call takes; every share of repetitions then follows calls of ``fn`` for about ``heat_ms`` of
    GPU time (at least one, at most ``_MAX_HEAT_CALLS``), with no synchronization in between."""
    call_ms = None

    def timer(reps: int) -> list[float]:
        nonlocal call_ms
        if call_ms is None:
            call_ms = statistics.median(times_ms(fn, 1, warmup, flush_l2))
        heat = min(_MAX_HEAT_CALLS, max(1, math.ceil(heat_ms / max(call_ms, 1e-3))))
        times = times_ms(fn, reps, heat, flush_l2)
        call_ms = statistics.median(times)
        return times
    return timer


def split_reps(reps: int, rounds: int) -> list[int]:
    """``reps`` split as evenly as possible over ``rounds`` rounds (fewer when ``reps`` is smaller:
    each round has at least one)."""
    rounds = max(1, min(rounds, reps))
    return [reps // rounds + (i < reps % rounds) for i in range(rounds)]


def rotated(items: list, round_index: int) -> list:
    """``items`` in the order of round ``round_index`` of interleaved rounds: starting at the
    round_index-th (mod their number) and going round, so that none is always timed after the
    same one."""
    start = round_index % len(items) if items else 0
    return items[start:] + items[:start]


def interleaved_median_ms(timers: dict, reps: int, rounds: int = BENCH_ROUNDS) -> dict:
    """Time ``{name: timer}`` (timers of :func:`event_timer`) in interleaved rounds: each round
    times every one for its share of ``reps`` (:func:`split_reps`), in the order of :func:`rotated`.
    Returns ``{name: median ms over all its repetitions}`` in the order given, or the exception a
    timer raised; one that raised is left out of the later rounds."""
    names = list(timers)
    times = {name: [] for name in names}
    failed = {}
    for round_index, share in enumerate(split_reps(reps, rounds)):
        for name in rotated(names, round_index):
            if name in failed:
                continue
            try:
                times[name].extend(timers[name](share))
            except Exception as exc:
                failed[name] = exc
    return {name: failed[name] if name in failed else statistics.median(times[name]) for name in names}


def host_overhead_us(fn, calls: int = 2000, warmup: int = 100) -> float:
    """Host wall time per call of ``calls`` back-to-back calls, synchronized at the end."""
    for _ in range(warmup):
        fn()
    _synchronize_all()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _synchronize_all()
    return (time.perf_counter() - start) / calls * 1e6
