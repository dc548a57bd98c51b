"""The peers timed beside cuflash: torch SDPA's backends, read through DLPack (torch is optional
and imported only when a benchmark asks for it)."""
from __future__ import annotations

from functools import partial

from . import timing

#: torch SDPA backends compared against: key -> (SDPBackend member, label in tables).
TORCH_BACKENDS = {
    "flash": ("FLASH_ATTENTION", "torch SDPA flash (FlashAttention-2)"),
    "cudnn": ("CUDNN_ATTENTION", "torch SDPA cuDNN"),
}


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


def _from_torch(tensor):
    """A CuPy view of a torch tensor's contiguous copy (DLPack)."""
    import cupy
    return cupy.from_dlpack(tensor.contiguous())


def _max_abs_diff(a, b) -> float:
    """max |a - b| in float32, on the arrays' own module (CuPy or NumPy)."""
    from cuflash.fp8 import _xp
    xp = _xp(a)
    return float(xp.abs(a.astype(xp.float32) - b.astype(xp.float32)).max())


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
    timers = {name: timing.event_timer(timing.cuda_event_times_ms, call, flush_l2)
              for name, call in cuflash_calls.items()}
    timers.update((key, timing.event_timer(timing.torch_event_times_ms, call, flush_l2))
                  for key, call in torch_calls.items())
    return timing.interleaved_median_ms(timers, reps)


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
    timing._synchronize_all()
    return theirs


def _record_torch_peers(result, torch_calls: dict, timed: dict, ours):
    """torch SDPA's backends into ``result["peers"]``; ``ratio`` is cuflash's TFLOP/s over the peer's."""
    for key, call in torch_calls.items():
        result["peers"][key] = _peer_entry(timed[key], result["flops"], result["tflops"], ours,
                                           partial(_torch_output, call))
