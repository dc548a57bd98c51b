"""Benchmark on the FlashAttention papers' grid, against torch SDPA when it is installed: the
forward (``mode="fwd"``), the backward (``"bwd"``, FLOPs 2.5x the forward's) or both in one timed
call (``"fwdbwd"``, 3.5x).

Grid: ``total_tokens`` tokens in all (batch = total_tokens // seqlen), hidden size ``hidden``
(heads = hidden // head_dim), seqlen_q = seqlen_k, layout bhsd, random normal inputs. FLOPs come
from :func:`cuflash.reference.attention_flops` (causal counts only the allowed pairs).

Timing: one CUDA event pair per repetition with the L2 cache flushed before each (as
``triton.testing.do_bench`` does); the median is reported. The implementations of a configuration
(cuflash and its peers) are timed in interleaved rounds, each round a share of the repetitions of
every one, in an order that rotates from round to round, and each share right after about
``BENCH_HEAT_MS`` of GPU work of the same implementation. The H200's clock follows the power
drawn over the last tens of milliseconds (between about 1450 and 1980 MHz): with one warm-up call
per share and the same order in every round, implementations ran up to 17% faster than on the
clock of their own load, by amounts that depended on their place in the order. torch is
optional and never imported at module level; it reads the same CuPy buffers through DLPack, and
both libraries are synchronized around every timed region.

FP8 (``dtype="fp8"``, forward only): cuflash on inputs quantized per tensor (e4m3 unless told,
bf16 output), and in the same run cuflash's bf16 kernel and torch SDPA (bf16) on the same values;
FLOPs as for bf16, the tables add the ratio FP8 / bf16 of cuflash. :func:`fp8_error_table` gives
FP8's error against the float64 reference (``python -m cuflash bench --fp8-errors``).

All of cuflash's timing code lives in this module.
"""
from __future__ import annotations

import datetime
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial

from cuflash.core.spec import WS_SCHEDULE_FIELDS

DEFAULT_HEAD_DIMS = (64, 128, 256)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
OVERHEAD_PROBLEM = dict(batch=1, heads=1, seqlen=16, head_dim=64, dtype="bf16")

#: torch SDPA backends compared against: key -> (SDPBackend member, label in tables).
TORCH_BACKENDS = {
    "flash": ("FLASH_ATTENTION", "torch SDPA flash (FlashAttention-2)"),
    "cudnn": ("CUDNN_ATTENTION", "torch SDPA cuDNN"),
}

#: ``--dtype`` of the FP8 benchmark; its format is ``fp8_format`` ("e4m3" or "e5m2").
FP8 = "fp8"
BENCH_DTYPES = ("fp16", "bf16", "fp32", FP8)
#: Key and table label of cuflash's bf16 kernel, timed beside FP8 at the same shape.
BF16_PEER = ("cuflash-bf16", "cuflash bf16")
#: Key and table label of cuflash's FP8 call on a V made once by ``prepare_v`` (a KV cache), timed
#: where the kernel takes one (the Hopper FP8 kernel).
PREPARED_V_PEER = ("cuflash-fp8-prepared-v", "cuflash FP8, V from prepare_v")

#: Interleaved rounds the repetitions of a configuration's implementations are split over.
BENCH_ROUNDS = 5
#: Milliseconds of GPU work an implementation runs right before each share of its repetitions, so
#: that it is timed on the clock its own load sets (:func:`event_timer`); at most
#: ``_MAX_HEAT_CALLS`` calls.
BENCH_HEAT_MS = 50.0
_MAX_HEAT_CALLS = 1000
#: Key of cuflash's own call among the timed implementations (not a peer key).
_OURS = "cuflash"

_L2_FLUSH_BYTES = 256 * 2**20
_BOOL_OVERRIDES = ("overlap", "warp_specialized") + WS_SCHEDULE_FIELDS
_SPEC_OVERRIDE_KEYS = ("block_m", "block_n", "num_warps", "num_stages") + _BOOL_OVERRIDES
MODES = ("fwd", "bwd", "fwdbwd")
#: FLOPs of a mode in units of the forward's.
_MODE_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


# -- configuration ----------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchConfig:
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int
    dtype: str
    mode: str = "fwd"

    @property
    def label(self) -> str:
        causal = "causal" if self.causal else "non-causal"
        return f"{self.mode} {self.dtype} hd{self.head_dim} {causal} N={self.seqlen} b={self.batch} h={self.heads}"

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.seqlen, self.head_dim)


def paper_grid(head_dims=DEFAULT_HEAD_DIMS, seqlens=DEFAULT_SEQLENS, causal=(False, True),
               dtype="bf16", total_tokens=16384, hidden=2048, mode="fwd") -> list[BenchConfig]:
    """The FlashAttention papers' configurations, in print order (head_dim, causal, seqlen)."""
    configs = []
    for head_dim in head_dims:
        heads = hidden // head_dim
        if heads < 1:
            raise ValueError(f"hidden={hidden} is smaller than head_dim={head_dim}")
        for is_causal in causal:
            for seqlen in seqlens:
                batch = max(1, total_tokens // seqlen)
                configs.append(BenchConfig(head_dim, seqlen, is_causal, batch, heads, dtype, mode))
    return configs


def parse_spec_override(text: str | None) -> dict:
    """``"block_m=64,block_n=64,num_warps=4,num_stages=3"`` -> dict of ints."""
    if not text:
        return {}
    overrides = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        key = key.strip()
        if not sep or key not in _SPEC_OVERRIDE_KEYS:
            raise ValueError(f"--spec-override item {item.strip()!r} must be KEY=INT with KEY one of "
                             f"{', '.join(_SPEC_OVERRIDE_KEYS)}")
        try:
            overrides[key] = bool(int(value)) if key in _BOOL_OVERRIDES else int(value)
        except ValueError:
            raise ValueError(f"--spec-override {key}={value.strip()!r} is not an integer") from None
    return overrides


# -- timers -----------------------------------------------------------------------------------
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
    scratch = cupy.empty(_L2_FLUSH_BYTES, dtype=cupy.uint8) if flush_l2 else None
    for _ in range(max(warmup, 1)):
        fn()
    pairs = []
    for _ in range(reps):
        if scratch is not None:
            scratch.fill(0)
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
    scratch = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda") if flush_l2 else None
    for _ in range(max(warmup, 1)):
        fn()
    pairs = []
    for _ in range(reps):
        if scratch is not None:
            scratch.zero_()
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


# -- inputs and peers -------------------------------------------------------------------------
def random_inputs(shape, dtype_tag: str, seed: int = 0):
    """q, k, v: standard normal CuPy arrays of ``shape`` in the dtype of ``dtype_tag``."""
    import cupy

    from cuflash.core import dtypes
    element = dtypes.from_tag(dtype_tag).numpy
    rng = cupy.random.default_rng(seed)
    return tuple(rng.standard_normal(shape, dtype=cupy.float32).astype(element) for _ in range(3))


def import_torch():
    """torch when it is importable and sees a CUDA device, else None."""
    try:
        import torch
        import torch.nn.attention  # noqa: F401  (sdpa_kernel, SDPBackend)
    except Exception:
        return None
    return torch if torch.cuda.is_available() else None


def to_torch(array):
    """Zero-copy torch view of a CuPy array through DLPack."""
    import torch
    try:
        return torch.from_dlpack(array)
    except Exception:
        # Fall back on the 16-bit pattern for DLPack exporters without a bfloat16 code.
        from cuflash.core import dtypes
        if array.dtype != dtypes.from_tag("bf16").numpy:
            raise
        import cupy
        return torch.from_dlpack(array.view(cupy.uint16)).view(torch.bfloat16)


def _torch_sdpa(torch, backend_key, q, k, v, causal, mode="fwd", dout=None):
    """A call of torch SDPA on one backend: the forward, the backward of a retained forward
    (returning the three gradients), or both."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, TORCH_BACKENDS[backend_key][0])
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward():
        with sdpa_kernel(backend):
            return sdpa(q, k, v, is_causal=causal)
    if mode == "fwd":
        return forward
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    if mode == "fwdbwd":
        return lambda: torch.autograd.grad(forward(), (q, k, v), dout)
    out = forward()
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


class _PeakMemory:
    """Peak bytes held in CuPy's memory pool above its level at entry (a CuPy memory hook)."""

    def __init__(self):
        import cupy
        self._hook = type("_Hook", (cupy.cuda.MemoryHook,), dict(
            name="cuflash-peak", malloc_postprocess=self._malloc, free_postprocess=self._free))()
        self.current = self.peak = 0

    def _malloc(self, **kwargs):
        self.current += kwargs["mem_size"]
        self.peak = max(self.peak, self.current)

    def _free(self, **kwargs):
        self.current -= kwargs["mem_size"]

    def __enter__(self):
        self._hook.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hook.__exit__(*exc)


def backward_extra_bytes(q, k, v, out, lse, dout, causal) -> int:
    """Peak device bytes one cuflash backward allocates beyond its outputs (dq, dk, dv)."""
    import cupy

    import cuflash
    _synchronize_all()
    with _PeakMemory() as peak:
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
        _synchronize_all()
    outputs = sum(int(g.nbytes) for g in grads)
    del grads
    cupy.get_default_memory_pool().free_all_blocks()
    return peak.peak - outputs


def _free_device_memory():
    import gc

    import cupy
    gc.collect()   # an exception recorded by the timing holds its frames (and their arrays) in a cycle
    cupy.get_default_memory_pool().free_all_blocks()


def _from_torch(tensor):
    """A CuPy view of a torch tensor's contiguous copy (DLPack)."""
    import cupy
    return cupy.from_dlpack(tensor.contiguous())


def _max_abs_diff(a, b) -> float:
    """max |a - b| in float32, on the arrays' own module (CuPy or NumPy)."""
    from cuflash.fp8 import _xp
    xp = _xp(a)
    return float(xp.abs(a.astype(xp.float32) - b.astype(xp.float32)).max())


def _peer_labels():
    """(key, table label) of every peer a result may hold, in table order."""
    return [BF16_PEER, PREPARED_V_PEER] + [(key, label) for key, (_, label) in TORCH_BACKENDS.items()]


# -- one configuration ------------------------------------------------------------------------
def _spec_for(config: BenchConfig, arch: str, overrides: dict):
    from cuflash.core.policy import default_bwd_spec, default_spec
    overrides = dict(overrides)
    family = overrides.pop("family", None)
    deterministic = overrides.pop("deterministic", False)
    if config.mode == "bwd":
        for key in _BOOL_OVERRIDES:
            overrides.pop(key, None)
        spec = default_bwd_spec(config.head_dim, config.dtype, config.causal, arch, deterministic, family)
    else:
        spec = default_spec(config.head_dim, config.dtype, config.causal, arch, family, seqlen=config.seqlen)
    return spec.replace(**overrides) if overrides else spec


def bench_config(config: BenchConfig, *, arch: str, reps: int = 30, torch=None,
                 overrides: dict | None = None, flush_l2: bool = True, fp8_format: str = "e4m3") -> dict:
    """Time cuflash (and torch SDPA's backends when ``torch`` is given) on one configuration, in
    interleaved rounds (:func:`interleaved_median_ms`); ``config.dtype == "fp8"`` goes to
    :func:`bench_fp8_config`."""
    if config.dtype == FP8:
        return bench_fp8_config(config, arch=arch, reps=reps, torch=torch, overrides=overrides, flush_l2=flush_l2,
                                fp8_format=fp8_format)
    from cuflash.reference import attention_flops

    flops = int(_MODE_FLOPS[config.mode] * attention_flops(config.batch, config.heads, config.seqlen, config.seqlen,
                                                           config.head_dim, config.causal))
    result = dict(asdict(config), direction=config.mode, flops=flops, spec=None, ms=None, tflops=None,
                  error=None, peers={}, extra_bytes=None)
    overrides = dict(overrides or {})
    try:
        spec = _spec_for(config, arch, overrides)
    except (ValueError, TypeError) as exc:
        result["error"] = str(exc)
        return result
    result["spec"] = spec.name
    forced = spec if set(overrides) - {"deterministic"} else None
    _time_config(result, config, forced, overrides, reps, torch, flush_l2)
    _free_device_memory()   # the inputs and outputs went with _time_config's frame
    return result


def _time_config(result, config, forced, overrides, reps, torch, flush_l2):
    import cuflash

    deterministic = bool(overrides.get("deterministic", False))
    q, k, v = random_inputs(config.shape, config.dtype)
    dout = random_inputs(config.shape, config.dtype, seed=1)[0] if config.mode != "fwd" else None
    if config.mode == "fwd":
        def ours_call():
            return cuflash.attention(q, k, v, causal=config.causal, spec=forced)
    elif config.mode == "bwd":
        fwd_out, fwd_lse = cuflash.attention(q, k, v, causal=config.causal, return_lse=True)

        def ours_call():
            return cuflash.attention_backward(dout, q, k, v, fwd_out, fwd_lse, causal=config.causal,
                                              deterministic=deterministic, spec=forced)
    else:
        def ours_call():
            out, backward = cuflash.attention_with_grad(q, k, v, causal=config.causal, deterministic=deterministic,
                                                        family=overrides.get("family"))
            return out, backward(dout)

    def output():   # after the timing: the output the peers are checked against, the backward's memory
        if config.mode == "bwd":
            result["extra_bytes"] = backward_extra_bytes(q, k, v, fwd_out, fwd_lse, dout, config.causal)
        return ours_call() if config.mode == "fwd" else None

    torch_calls = _torch_calls(torch, (q, k, v), dout, config) if torch is not None else {}
    timed = _time_interleaved({_OURS: ours_call}, torch_calls, reps, flush_l2)
    ours = _record_ours(result, timed[_OURS], output)
    _record_torch_peers(result, torch_calls, timed, ours)


def _torch_calls(torch, qkv, dout, config) -> dict:
    """torch SDPA's calls on ``qkv`` (CuPy arrays read through DLPack), by backend key; a call that
    cannot be built is replaced by one raising its exception (reported like a failed timing)."""
    qt, kt, vt = (to_torch(x) for x in qkv)
    dt = to_torch(dout) if dout is not None else None
    calls = {}
    for key in TORCH_BACKENDS:
        try:
            calls[key] = _torch_sdpa(torch, key, qt, kt, vt, config.causal, config.mode, dt)
        except Exception as exc:
            calls[key] = _raising(exc)
    return calls


def _raising(exc):
    """A call that raises ``exc``."""
    def call():
        raise exc
    return call


def _time_interleaved(cuflash_calls: dict, torch_calls: dict, reps: int, flush_l2: bool) -> dict:
    """:func:`interleaved_median_ms` of cuflash's calls (CuPy events) and torch's (torch events)."""
    timers = {name: event_timer(cuda_event_times_ms, call, flush_l2) for name, call in cuflash_calls.items()}
    timers.update((key, event_timer(torch_event_times_ms, call, flush_l2)) for key, call in torch_calls.items())
    return interleaved_median_ms(timers, reps)


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


def _peer_entry(outcome, flops: int, ours_tflops, ours=None, output=None) -> dict:
    """A peer of ``result["peers"]`` from its timing ``outcome`` (ms, or the exception its call
    raised): ``ratio`` is ``ours_tflops`` over the peer's, ``max_abs_diff`` of ``output()`` (the
    peer's output) against ``ours`` when that is given; an error keeps the first line of its message."""
    peer = dict(ms=None, tflops=None, ratio=None, max_abs_diff=None, error=None)
    try:
        if isinstance(outcome, Exception):
            raise outcome
        peer["ms"], peer["tflops"] = outcome, flops / outcome / 1e9
        if ours_tflops:
            peer["ratio"] = ours_tflops / peer["tflops"]
        if ours is not None:
            peer["max_abs_diff"] = _max_abs_diff(ours, output())
    except Exception as exc:
        peer["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        peer["ms"] = peer["tflops"] = peer["ratio"] = None
    return peer


def _torch_output(call):
    """A torch call's output as a CuPy array, both libraries synchronized."""
    theirs = _from_torch(call())
    _synchronize_all()
    return theirs


def _record_torch_peers(result, torch_calls: dict, timed: dict, ours):
    """torch SDPA's backends into ``result["peers"]``; ``ratio`` is cuflash's TFLOP/s over the peer's."""
    for key, call in torch_calls.items():
        result["peers"][key] = _peer_entry(timed[key], result["flops"], result["tflops"], ours,
                                           partial(_torch_output, call))


def bench_fp8_config(config: BenchConfig, *, arch: str, reps: int = 30, torch=None, overrides: dict | None = None,
                     flush_l2: bool = True, fp8_format: str = "e4m3") -> dict:
    """Time cuflash's FP8 forward on one configuration (``config.dtype == "fp8"``): inputs drawn in
    bf16 and quantized per tensor to ``fp8_format``, bf16 output. In the same run: cuflash's bf16
    kernel on the bf16 inputs (peer :data:`BF16_PEER`, whose ``ratio`` is FP8 / bf16) and, when
    ``torch`` is given, torch SDPA's backends on them, all timed in interleaved rounds
    (:func:`interleaved_median_ms`). ``max_abs_diff`` of a peer is against the FP8 output."""
    from cuflash.reference import attention_flops

    flops = attention_flops(config.batch, config.heads, config.seqlen, config.seqlen, config.head_dim, config.causal)
    result = dict(asdict(config), direction=config.mode, flops=flops, fp8_format=fp8_format, spec=None, ms=None,
                  tflops=None, error=None, peers={}, extra_bytes=None)
    if config.mode != "fwd":
        result["error"] = f"FP8 attention has a forward only (mode={config.mode!r})"
        return result
    overrides = dict(overrides or {})
    overrides.pop("deterministic", None)
    try:
        spec = _spec_for(BenchConfig(config.head_dim, config.seqlen, config.causal, config.batch, config.heads,
                                     fp8_format, "fwd"), arch, overrides)
    except (ValueError, TypeError) as exc:
        result["error"] = str(exc)
        return result
    result["spec"] = spec.name
    _time_fp8(result, config, spec if overrides else None, reps, torch, flush_l2, fp8_format)
    _free_device_memory()   # the inputs and outputs went with _time_fp8's frame
    return result


def _time_fp8(result, config, forced, reps, torch, flush_l2, fp8_format):
    import cuflash

    from cuflash.fp8 import quantize_fp8

    flops = result["flops"]
    q, k, v = random_inputs(config.shape, "bf16")
    (q8, q_descale), (k8, k_descale), (v8, v_descale) = (quantize_fp8(x, fp8_format, "tensor") for x in (q, k, v))

    def fp8_call():
        return cuflash.attention(q8, k8, v8, causal=config.causal, fp8_format=fp8_format, q_descale=q_descale,
                                 k_descale=k_descale, v_descale=v_descale, out_dtype="bf16", spec=forced)

    def bf16_call():
        return cuflash.attention(q, k, v, causal=config.causal)

    def prepared_call():
        return cuflash.attention(q8, k8, prepared, causal=config.causal, fp8_format=fp8_format, q_descale=q_descale,
                                 k_descale=k_descale, v_descale=v_descale, out_dtype="bf16", spec=forced)

    calls = {_OURS: fp8_call, BF16_PEER[0]: bf16_call}
    try:
        prepared = cuflash.prepare_v(v8)
        prepared_call()
        calls[PREPARED_V_PEER[0]] = prepared_call
    except (TypeError, ValueError):  # a kernel that reads V itself (or inputs off the GPU)
        pass
    torch_calls = _torch_calls(torch, (q, k, v), None, config) if torch is not None else {}
    timed = _time_interleaved(calls, torch_calls, reps, flush_l2)
    ours = _record_ours(result, timed[_OURS], fp8_call)
    bf16 = result["peers"][BF16_PEER[0]] = _peer_entry(timed[BF16_PEER[0]], flops, result["tflops"], ours, bf16_call)
    if PREPARED_V_PEER[0] in timed:
        peer = _peer_entry(timed[PREPARED_V_PEER[0]], flops, None, ours, prepared_call)
        if peer["tflops"] and bf16["tflops"]:   # FP8 on the prepared V over cuflash bf16
            peer["ratio"] = peer["tflops"] / bf16["tflops"]
        result["peers"][PREPARED_V_PEER[0]] = peer
    _record_torch_peers(result, torch_calls, timed, ours)


def format_line(result: dict) -> str:
    config = BenchConfig(**{f: result[f] for f in BenchConfig.__dataclass_fields__ if f in result})
    label = config.label
    if config.dtype == FP8:
        label = label.replace(f" {FP8} ", f" {FP8} {result.get('fp8_format', 'e4m3')} ", 1)
    if result["ms"] is None:
        line = f"{label}: error: {result['error']}"
    else:
        line = f"{label}: {result['ms']:.3f} ms, {result['tflops']:.1f} TFLOP/s"
        if result.get("extra_bytes") is not None:
            qkv = config.batch * config.heads * config.seqlen * config.head_dim * 2
            line += f", extra memory {result['extra_bytes'] / 2**20:.1f} MiB ({result['extra_bytes'] / qkv:.2f}x q's bytes)"
    for key, peer in result["peers"].items():
        if peer["tflops"] is None:
            line += f" | {key} n/a"
        elif peer["ratio"] is None:
            line += f" | {key} {peer['tflops']:.1f}"
        else:
            line += f" | {key} {peer['tflops']:.1f} ({peer['ratio']:.2f}x)"
    return line


# -- reports ----------------------------------------------------------------------------------
def _fmt(value, digits=0):
    return "–" if value is None else f"{value:.{digits}f}"


def markdown_tables(report: dict) -> str:
    """One TFLOP/s table per (head_dim, causal): implementations as rows, seqlens as columns."""
    results = report["results"]
    gpu = report["environment"].get("gpu") or "GPU"
    lines = []
    groups = []
    for r in results:
        key = (r.get("mode", "fwd"), r["dtype"], r["head_dim"], r["causal"])
        if key not in groups:
            groups.append(key)
    for mode, dtype, head_dim, causal in groups:
        rows = [r for r in results if (r.get("mode", "fwd"), r["dtype"], r["head_dim"], r["causal"])
                == (mode, dtype, head_dim, causal)]
        seqlens = [r["seqlen"] for r in rows]
        fp8_format = rows[0].get("fp8_format", "e4m3")
        note = (f"; FP8 {fp8_format} inputs quantized per tensor, bf16 output; the others bf16"
                if dtype == FP8 else "")
        lines.append(f"**{mode} {dtype} head_dim={head_dim} {'causal' if causal else 'non-causal'}** "
                     f"(TFLOP/s, {gpu}{note})")
        lines.append("")
        lines.append("| impl | " + " | ".join(str(s) for s in seqlens) + " |")
        lines.append("|---|" + "---|" * len(seqlens))
        ours = f"cuflash FP8 {fp8_format}" if dtype == FP8 else "cuflash"
        lines.append(f"| {ours} | " + " | ".join(_fmt(r["tflops"]) for r in rows) + " |")
        for key, label in _peer_labels():
            if any(key in r["peers"] for r in rows):
                cells = [_fmt(r["peers"].get(key, {}).get("tflops")) for r in rows]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if dtype == FP8:
            ratios = [r["peers"].get(BF16_PEER[0], {}).get("ratio") for r in rows]
            lines.append("| FP8 / bf16 (cuflash) | " + " | ".join("–" if x is None else f"{x:.2f}x" for x in ratios)
                         + " |")
            ratios = [r["peers"].get(PREPARED_V_PEER[0], {}).get("ratio") for r in rows]
            if any(x is not None for x in ratios):
                lines.append("| FP8, V from prepare_v / bf16 (cuflash) | "
                             + " | ".join("–" if x is None else f"{x:.2f}x" for x in ratios) + " |")
        lines.append("")
    overhead = report.get("overhead")
    if overhead:
        lines.append("**Host overhead per call** (b=1, h=1, s=16, d=64, bf16; µs)")
        lines.append("")
        lines.append("| impl | µs per call |")
        lines.append("|---|---|")
        for key, value in overhead["us_per_call"].items():
            lines.append(f"| {key} | {_fmt(value, 1)} |")
        lines.append("")
    return "\n".join(lines)


def write_plot(report: dict, path: str) -> bool:
    """TFLOP/s vs seqlen, one panel per (head_dim, causal). False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = report["results"]
    head_dims = sorted({r["head_dim"] for r in results})
    causal_values = sorted({r["causal"] for r in results})
    fig, axes = plt.subplots(len(causal_values), len(head_dims), squeeze=False,
                             figsize=(4.5 * len(head_dims), 3.5 * len(causal_values)))
    for row, causal in enumerate(causal_values):
        for col, head_dim in enumerate(head_dims):
            ax = axes[row][col]
            rows = [r for r in results if r["head_dim"] == head_dim and r["causal"] == causal]
            seqlens = [r["seqlen"] for r in rows]
            series = {"cuflash": [r["tflops"] for r in rows]}
            for key, label in _peer_labels():
                if any(key in r["peers"] for r in rows):
                    series[label] = [r["peers"].get(key, {}).get("tflops") for r in rows]
            for label, values in series.items():
                points = [(s, t) for s, t in zip(seqlens, values) if t is not None]
                if points:
                    ax.plot(*zip(*points), marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"hd{head_dim} {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    title = f"{results[0].get('mode', 'fwd')} {results[0]['dtype']}" if results else ""
    fig.suptitle(f"{title} on {report['environment'].get('gpu')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -- host overhead ----------------------------------------------------------------------------
def measure_overhead(torch=None, calls: int = 2000) -> dict:
    """Warm host time per call on a tiny problem, where launch overhead dominates."""
    import cuflash
    p = OVERHEAD_PROBLEM
    q, k, v = random_inputs((p["batch"], p["heads"], p["seqlen"], p["head_dim"]), p["dtype"])
    us = {"cuflash": host_overhead_us(lambda: cuflash.attention(q, k, v), calls=calls)}
    if torch is not None:
        qt, kt, vt = (to_torch(x) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        try:
            us["torch SDPA"] = host_overhead_us(lambda: sdpa(qt, kt, vt), calls=calls)
        except Exception:
            us["torch SDPA"] = None
    return dict(problem=p, calls=calls, us_per_call=us)


# -- FP8 error table --------------------------------------------------------------------------
#: Problem of :func:`fp8_error_table`: per-head descales, bf16 output, not causal; the outlier
#: inputs have 4 head-dim channels of q and k 50x larger and a softmax scale of 1 / (50 sqrt(d)).
FP8_ERROR_PROBLEM = dict(batch=1, heads=2, seqlen=1024, granularity="head", out_dtype="bf16", outliers=4,
                         outlier_factor=50.0, seed=5)


def fp8_error_table(attention=None, *, head_dims=DEFAULT_HEAD_DIMS, formats=("e4m3", "e5m2"), xp=None,
                    echo=None, **problem) -> list[dict]:
    """FP8 attention's error against the float64 reference of the float inputs (before
    quantization and rotation), per head dim, format, input kind (``"N(0,1)"`` or ``"outliers"``)
    and rotation.

    ``attention(q, k, v, **kwargs)`` computes the output from FP8 codes with the keyword arguments
    of ``cuflash.attention`` (default: ``cuflash.attention`` on CuPy arrays; pass
    :func:`cuflash.reference.attention_fp8_naive`'s output with ``xp=numpy`` to run on the CPU).
    ``problem`` overrides :data:`FP8_ERROR_PROBLEM`. Each row holds ``max_error`` and
    ``mean_error`` (|out - float64 reference|), ``kernel_max_error`` (against the float64 attention
    of the dequantized inputs: what the kernel adds to quantization) and ``naive_max_error`` (the
    same error of :func:`cuflash.reference.attention_fp8_naive`, the CPU model of the kernel).
    """
    import math

    import numpy as np

    from cuflash.testing import Fp8AttentionProblem, to_numpy

    if attention is None:
        import cupy

        import cuflash
        attention, xp = cuflash.attention, cupy
    xp = np if xp is None else xp
    p = dict(FP8_ERROR_PROBLEM, **problem)
    rows = []
    for head_dim in head_dims:
        for fp8_format in formats:
            for kind in ("N(0,1)", "outliers"):
                for rotate in (False, True):
                    outliers = kind == "outliers"
                    fp8_problem = Fp8AttentionProblem(
                        p["batch"], p["heads"], p["heads"], p["seqlen"], p["seqlen"], head_dim, fp8_format,
                        p["granularity"], p["out_dtype"],
                        scale=1 / (p["outlier_factor"] * math.sqrt(head_dim)) if outliers else None,
                        outliers=p["outliers"] if outliers else 0, outlier_factor=p["outlier_factor"], rotate=rotate)
                    inputs = fp8_problem.make_inputs(xp, seed=p["seed"])
                    out = attention(inputs.q, inputs.k, inputs.v, **fp8_problem.attention_kwargs(inputs))
                    out = to_numpy(out[0] if isinstance(out, tuple) else out).astype(np.float64)
                    want, _ = fp8_problem.float_reference(inputs)
                    dequantized, _ = fp8_problem.reference(inputs)
                    naive, _ = fp8_problem.naive(inputs)
                    error = np.abs(out - want)
                    row = dict(head_dim=head_dim, fp8_format=fp8_format, inputs=kind, rotated=rotate,
                               granularity=p["granularity"], out_dtype=p["out_dtype"], seqlen=p["seqlen"],
                               max_error=float(error.max()), mean_error=float(error.mean()),
                               kernel_max_error=float(np.abs(out - dequantized).max()),
                               naive_max_error=float(np.abs(naive.astype(np.float64) - want).max()))
                    rows.append(row)
                    if echo is not None:
                        echo(format_fp8_error_line(row))
    return rows


def format_fp8_error_line(row: dict) -> str:
    rotated = "rotated" if row["rotated"] else "plain"
    return (f"fp8 {row['fp8_format']} hd{row['head_dim']} {row['inputs']} {rotated}: max error {row['max_error']:.4f}, "
            f"mean {row['mean_error']:.5f}, vs dequantized {row['kernel_max_error']:.4f}, "
            f"naive model max {row['naive_max_error']:.4f}")


def fp8_error_markdown(rows: list[dict], gpu: str | None = None) -> str:
    """The README's FP8 error table: one row per (head dim, format, inputs, rotation)."""
    if not rows:
        return ""
    first = rows[0]
    lines = [f"**FP8 attention error against the float64 reference** ({gpu or 'GPU'}; {first['granularity']} "
             f"descales, {first['out_dtype']} output, seqlen {first['seqlen']}, non-causal)", "",
             "| head dim | format | inputs | rotation | max error | mean error | max error vs dequantized "
             "| naive model max error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['head_dim']} | {r['fp8_format']} | {r['inputs']} | {'yes' if r['rotated'] else 'no'} "
                     f"| {r['max_error']:.4f} | {r['mean_error']:.5f} | {r['kernel_max_error']:.4f} "
                     f"| {r['naive_max_error']:.4f} |")
    lines.append("")
    return "\n".join(lines)


def _run_fp8_errors(args) -> int:
    """``python -m cuflash bench --fp8-errors``: the error table on this GPU."""
    from ..cli import environment
    rows = fp8_error_table(head_dims=args.head_dims, echo=print)
    table = fp8_error_markdown(rows, environment().get("gpu"))
    print()
    print(table)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(problem=FP8_ERROR_PROBLEM, rows=rows), handle, indent=2)
        print(f"wrote {args.json}")
    if args.md:
        with open(args.md, "w") as handle:
            handle.write(table + "\n")
        print(f"wrote {args.md}")
    return 0


# -- driver -----------------------------------------------------------------------------------
def run_benchmark(head_dims=DEFAULT_HEAD_DIMS, seqlens=DEFAULT_SEQLENS, causal=(False, True),
                  dtype="bf16", total_tokens=16384, hidden=2048, reps=30, use_torch=True,
                  spec_override=None, overhead=False, grid=True, flush_l2=True, mode="fwd", echo=print,
                  fp8_format="e4m3") -> dict:
    """Run the benchmark and return its report (the ``--json`` content); ``echo`` gets each line.
    ``dtype="fp8"`` times FP8 inputs of ``fp8_format`` (see :func:`bench_fp8_config`)."""
    from ..cli import environment
    from cuflash.core.compile import device_arch

    overrides = parse_spec_override(spec_override) if isinstance(spec_override, str) else dict(spec_override or {})
    torch = import_torch() if use_torch else None
    env = environment()
    if torch is not None:
        env["torch"] = torch.__version__
        env["cudnn"] = torch.backends.cudnn.version()
    arch = device_arch()
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        environment=env,
        settings=dict(mode=mode, dtype=dtype, total_tokens=total_tokens, hidden=hidden, reps=reps,
                      **(dict(fp8_format=fp8_format, fp8_granularity="tensor", fp8_out_dtype="bf16")
                         if dtype == FP8 else {}),
                      spec_override=overrides or None, arch=arch, flush_l2=flush_l2,
                      timing=f"median of CUDA event pairs in {BENCH_ROUNDS} interleaved rounds of rotating order, "
                      f"each share after {BENCH_HEAT_MS:g} ms of the same implementation's GPU work"
                      + (", L2 flushed before each" if flush_l2 else "")),
        results=[],
        overhead=None,
    )
    if use_torch and torch is None:
        echo("torch with CUDA is not importable: timing cuflash alone")
    if grid:
        for config in paper_grid(head_dims, seqlens, causal, dtype, total_tokens, hidden, mode):
            result = bench_config(config, arch=arch, reps=reps, torch=torch, overrides=overrides,
                                  flush_l2=flush_l2, fp8_format=fp8_format)
            report["results"].append(result)
            echo(format_line(result))
    if overhead:
        report["overhead"] = measure_overhead(torch)
        for key, value in report["overhead"]["us_per_call"].items():
            echo(f"host overhead {key}: " + ("n/a" if value is None else f"{value:.1f} µs per call"))
    return report


def add_arguments(parser):
    parser.add_argument("--mode", choices=MODES, default="fwd",
                        help="fwd, bwd (FLOPs 2.5x the forward) or fwdbwd (3.5x); default fwd")
    parser.add_argument("--deterministic", action="store_true", help="bwd/fwdbwd: the deterministic backward")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(DEFAULT_HEAD_DIMS))
    parser.add_argument("--seqlens", type=int, nargs="+", default=list(DEFAULT_SEQLENS))
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--dtype", default="bf16",
                        help="fp16, bf16, fp32 or fp8 (default bf16); fp8: inputs quantized per tensor, bf16 output, "
                             "timed beside cuflash bf16 and torch SDPA bf16 (forward only)")
    parser.add_argument("--fp8-format", choices=("e4m3", "e5m2"), default="e4m3",
                        help="format of --dtype fp8 (default e4m3)")
    parser.add_argument("--fp8-errors", action="store_true",
                        help="print FP8 attention's error against the float64 reference (e4m3 and e5m2, "
                             "--head-dims, N(0,1) and outlier inputs, with and without the rotation) instead of timing")
    parser.add_argument("--total-tokens", type=int, default=16384, help="batch = total_tokens // seqlen")
    parser.add_argument("--hidden", type=int, default=2048, help="heads = hidden // head_dim")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per config (median)")
    parser.add_argument("--no-torch", action="store_true", help="do not time torch SDPA even if installed")
    parser.add_argument("--no-flush-l2", action="store_true", help="keep L2 warm between repetitions")
    parser.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    parser.add_argument("--md", metavar="PATH", help="write the Markdown tables to this file")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    parser.add_argument("--spec-override", metavar="K=V,...",
                        help="force tile parameters: block_m=..,block_n=..,num_warps=..,num_stages=..")
    parser.add_argument("--family", choices=("mma", "wgmma", "simt"),
                        help="time this kernel family instead of the default one")
    parser.add_argument("--overhead", action="store_true",
                        help="also measure warm host overhead per call on a tiny problem")
    parser.add_argument("--no-grid", action="store_true", help="skip the grid (with --overhead)")


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


def run(args) -> int:
    """``python -m cuflash bench``."""
    from ..cli import causal_modes, gpu_status
    available, reason = gpu_status()
    if not available:
        print(f"cuflash bench: error: needs a CUDA GPU: {reason}", file=sys.stderr)
        return 1
    if getattr(args, "fp8_errors", False):
        return _run_fp8_errors(args)
    try:
        dtype = parse_bench_dtype(args.dtype, args.mode)
        spec_override = parse_spec_override(args.spec_override)
        if args.family:
            spec_override["family"] = args.family
        if args.deterministic:
            spec_override["deterministic"] = True
    except ValueError as exc:
        print(f"cuflash bench: error: {exc}", file=sys.stderr)
        return 2
    report = run_benchmark(head_dims=args.head_dims, seqlens=args.seqlens, causal=causal_modes(args.causal),
                           dtype=dtype, total_tokens=args.total_tokens, hidden=args.hidden, reps=args.reps,
                           use_torch=not args.no_torch, spec_override=spec_override,
                           overhead=args.overhead, grid=not args.no_grid, flush_l2=not args.no_flush_l2,
                           mode=args.mode, fp8_format=args.fp8_format)
    tables = markdown_tables(report)
    print()
    print(tables)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
        print(f"wrote {args.json}")
    if args.md:
        with open(args.md, "w") as handle:
            handle.write(tables + "\n")
        print(f"wrote {args.md}")
    if args.plot and report["results"]:
        if write_plot(report, args.plot):
            print(f"wrote {args.plot}")
        else:
            print("warning: matplotlib is not importable; no plot written", file=sys.stderr)
    return 1 if any(r["error"] for r in report["results"]) else 0
