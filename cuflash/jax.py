"""cuflash for JAX: JAX arrays on a CUDA GPU in, JAX arrays out, differentiable, eager only.

    import jax, cuflash.jax
    out = cuflash.jax.attention(q, k, v, causal=True)    # q, k, v: jax.Array on a GPU, bhsd or bshd
    out, vjp = jax.vjp(lambda q, k, v: cuflash.jax.attention(q, k, v, causal=True), q, k, v)
    dq, dk, dv = vjp(dout)                                # cuflash's backward

The call is a ``jax.custom_vjp`` whose backward is cuflash's. Called eagerly, ``jax.grad``,
``jax.value_and_grad`` and ``jax.vjp`` run a custom_vjp's forward and backward on concrete arrays,
so they work. cuflash launches its kernels from Python and is not an XLA operation: under
``jax.jit``, ``jax.vmap``, ``jax.lax.scan``, ``jax.checkpoint`` or a second derivative the call
would get tracers, and raises a TypeError instead.

Arrays cross to CuPy and back through DLPack without a copy (bfloat16 as uint16 codes, which
every CuPy version takes). JAX runs on its own streams, which never wait for CuPy's, so each call
is a synchronization point:

- it waits for its inputs (``block_until_ready``) and for the work JAX has queued on the device:
  a result of an earlier call that JAX drops goes back to CuPy's memory pool at once, while a JAX
  kernel queued before may still read it;
- cuflash runs on CuPy's current stream of the arrays' device;
- the call waits for that stream before it returns: JAX may free or reuse an input's memory as
  soon as the call lets go of it, and reads the results without waiting for CuPy.

The results and cuflash's workspaces come from CuPy's memory pool, beside JAX's: leave it room
(``XLA_PYTHON_CLIENT_MEM_FRACTION``, or ``XLA_PYTHON_CLIENT_PREALLOCATE=false``). JAX is imported
here only: ``import cuflash`` never imports it.
"""
from __future__ import annotations

import ctypes
import functools
import math

try:
    import jax
    import jax.dlpack
except ImportError as exc:  # jax is optional: only this module needs it
    raise ImportError("cuflash.jax needs JAX with CUDA (pip install 'jax[cuda13]' or 'jax[cuda12]'); "
                      "cuflash itself does not") from exc

import numpy as np

from .backward import attention_backward as _attention_backward
from .core import modset as _modset
from .core import trace as _trace
from .core.validate import validate_variants, variant_mods
from .forward import attention as _attention

LAYOUTS = ("bhsd", "bshd")
_BF16 = np.dtype(jax.numpy.bfloat16)
_DTYPES = (np.dtype(np.float16), _BF16, np.dtype(np.float32))
_Tracer = jax.core.Tracer
_KDL_CUDA = 2  # DLPack's device type of CUDA memory
_KDL_UINT, _KDL_BFLOAT = 1, 4  # DLPack's type codes


# -- DLPack: bfloat16 as uint16 codes ---------------------------------------------------------------

class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("dtype", _DLDataType), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensorVersioned(ctypes.Structure):  # DLPack 1.0: a version and flags before the tensor
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


# Own prototypes, so that the shared ctypes.pythonapi functions keep their settings.
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def _retype(capsule, code: int, new_code: int):
    """The DLPack capsule with its 16-bit type code ``code`` rewritten to ``new_code`` (in place)."""
    name = _capsule_name(capsule)
    address = _capsule_pointer(capsule, name)
    if name == b"dltensor_versioned":
        tensor = _DLManagedTensorVersioned.from_address(address).dl_tensor
    elif name == b"dltensor":
        tensor = _DLTensor.from_address(address)
    else:
        raise BufferError(f"not an unused DLPack capsule: {name!r}")
    dtype = tensor.dtype
    if (dtype.code, dtype.bits, dtype.lanes) != (code, 16, 1):
        raise BufferError(f"DLPack type (code {dtype.code}, {dtype.bits} bits, {dtype.lanes} lanes) is not "
                          f"(code {code}, 16 bits, 1 lane)")
    dtype.code = new_code
    return capsule


class _Retyped:
    """A DLPack producer of ``array``'s 16-bit memory under another type code: bfloat16 crosses
    as uint16, which CuPy before 14 takes and bfloat16 not."""

    __slots__ = ("array", "codes")

    def __init__(self, array, code: int, new_code: int):
        self.array, self.codes = array, (code, new_code)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, **kwargs):  # the consumer's stream (and version, copy) go to the producer
        return _retype(self.array.__dlpack__(**kwargs), *self.codes)


def _to_cupy(cupy, x):
    """A CuPy view of a JAX array on the current device, ordered after it on CuPy's current stream."""
    if x.dtype == _BF16:
        return cupy.from_dlpack(_Retyped(x, _KDL_BFLOAT, _KDL_UINT)).view(_BF16)
    return cupy.from_dlpack(x)


def _to_jax(cupy, a):
    """A JAX array of a CuPy array's memory (kept alive by it), ordered after CuPy's current stream."""
    if a.dtype == _BF16:
        return jax.dlpack.from_dlpack(_Retyped(a.view(cupy.uint16), _KDL_UINT, _KDL_BFLOAT))
    return jax.dlpack.from_dlpack(a)


# -- the eager calls ---------------------------------------------------------------------------------

def _device_of(name: str, x) -> int:
    """The CUDA device of a concrete JAX array; a TypeError for a tracer."""
    if isinstance(x, _Tracer):
        raise TypeError(f"cuflash.jax.attention runs eagerly; it cannot be traced by jax.jit, jax.vmap, "
                        f"jax.lax.scan, jax.checkpoint or a second derivative ({name} is a {type(x).__name__}). "
                        f"Call it outside the traced function.")
    devices = x.devices()
    if len(devices) != 1:
        raise ValueError(f"{name} is spread over {len(devices)} devices; cuflash.jax.attention takes arrays on "
                         f"one CUDA GPU")
    kind, index = x.__dlpack_device__()
    if int(kind) != _KDL_CUDA:
        device, = devices
        raise ValueError(f"{name} is on {device} ({device.platform}); cuflash.jax.attention takes arrays on a "
                         f"CUDA GPU")
    return int(index)


def _on_cuda(named, work):
    """``work`` on CuPy views of the named JAX arrays, on their device; its CuPy results as JAX arrays."""
    device_id = None
    for name, x in named:
        index = _device_of(name, x)
        if device_id is None:
            device_id, first = index, name
        elif index != device_id:
            raise ValueError(f"{name} is on GPU {index} and {first} on GPU {device_id}; put them on one device")
    for _, x in named:
        x.block_until_ready()
    import cupy

    device = cupy.cuda.Device(device_id)
    with device:
        device.synchronize()  # JAX's queued work: it may still read memory an earlier result gave back
        results = work(*(_to_cupy(cupy, x) for _, x in named))
        cupy.cuda.get_current_stream().synchronize()  # done before JAX frees the inputs or reads the results
        return tuple(_to_jax(cupy, r) for r in results)


def _captured(x):
    """A JAX array a mod captures, as the array cuflash reads: a CuPy view of one on a GPU (the
    kernels), a NumPy array of one on the CPU (the reference)."""
    if isinstance(x, _Tracer):
        raise TypeError(f"a mod captures a traced JAX value ({type(x).__name__}); cuflash.jax.attention runs "
                        f"eagerly, with concrete arrays")
    if len(x.devices()) == 1 and int(x.__dlpack_device__()[0]) == _KDL_CUDA:
        import cupy

        with cupy.cuda.Device(int(x.__dlpack_device__()[1])):
            return _to_cupy(cupy, x)
    return np.asarray(x)


def _captured_key(x):
    """What tells a captured JAX array apart (its buffer: the graph keeps it alive); None for a tracer
    or one spread over devices, which are never kept."""
    try:
        return tuple(x.shape), str(x.dtype), x.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - no single buffer
        return None


for _module in ("jax", "jaxlib"):  # jax.Array's type lives in jaxlib
    _trace.ARRAY_CONVERTERS[_module] = (_captured, _captured_key)


def _named(**arrays):
    """(name, array) pairs of the arrays given, leaving out the None ones (absent sinks)."""
    return tuple((name, x) for name, x in arrays.items() if x is not None)


def _sinks_kwargs(rest, variants=None, mods=None) -> dict:
    """The ``sinks=`` of a call whose named arrays ended with the sinks (``rest``: them or nothing),
    its ``window_size`` and ``softcap`` (``variants``: both, or None for neither) and its traced
    mods (``mods``: score and mask graphs and the block mask, or None)."""
    kwargs = {"sinks": rest[0]} if rest else {}
    if variants is not None:
        kwargs.update(window_size=variants[0], softcap=variants[1])
    if mods is not None:
        kwargs.update(score_mod=mods[0], mask_mod=mods[1], block_mask=mods[2])
    return kwargs


def _forward(q, k, v, sinks, causal, scale, layout, return_lse, variants, mods):
    def work(q, k, v, *sinks_):
        result = _attention(q, k, v, causal=causal, scale=scale, layout=layout, return_lse=return_lse,
                            **_sinks_kwargs(sinks_, variants, mods))
        return result if return_lse else (result,)

    return _on_cuda(_named(q=q, k=k, v=v, sinks=sinks), work)


def _backward(causal, scale, layout, deterministic, variants, mods, residuals, dout):
    q, k, v, sinks, out, lse = residuals

    def work(dout, q, k, v, out, lse, *sinks_):
        return _attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, layout=layout,
                                   deterministic=deterministic, **_sinks_kwargs(sinks_, variants, mods))

    grads = _on_cuda(_named(dout=dout, q=q, k=k, v=v, out=out, lse=lse, sinks=sinks), work)
    return (*grads[:3], grads[3] if sinks is not None else None)


# The flags are static (nondiff_argnums); q, k, v and the sinks (None: none) are differentiated. One
# function returns the output alone, the other the LSE too (whose cotangent is ignored, as
# FlashAttention's).

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _attention_out(q, k, v, sinks, causal, scale, layout, deterministic, variants, mods):
    return _forward(q, k, v, sinks, causal, scale, layout, False, variants, mods)[0]


def _attention_out_fwd(q, k, v, sinks, causal, scale, layout, deterministic, variants, mods):
    out, lse = _forward(q, k, v, sinks, causal, scale, layout, True, variants, mods)
    return out, (q, k, v, sinks, out, lse)


def _attention_out_bwd(causal, scale, layout, deterministic, variants, mods, residuals, dout):
    return _backward(causal, scale, layout, deterministic, variants, mods, residuals, dout)


_attention_out.defvjp(_attention_out_fwd, _attention_out_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _attention_lse(q, k, v, sinks, causal, scale, layout, deterministic, variants, mods):
    return _forward(q, k, v, sinks, causal, scale, layout, True, variants, mods)


def _attention_lse_fwd(q, k, v, sinks, causal, scale, layout, deterministic, variants, mods):
    out, lse = _forward(q, k, v, sinks, causal, scale, layout, True, variants, mods)
    return (out, lse), (q, k, v, sinks, out, lse)


def _attention_lse_bwd(causal, scale, layout, deterministic, variants, mods, residuals, cotangents):
    return _backward(causal, scale, layout, deterministic, variants, mods, residuals, cotangents[0])


_attention_lse.defvjp(_attention_lse_fwd, _attention_lse_bwd)


# -- the call ----------------------------------------------------------------------------------------

def _check(q, k, v, layout, sinks=None):
    for name, x in (("q", q), ("k", k), ("v", v), ("sinks", sinks)):
        if x is None and name == "sinks":
            continue
        if not isinstance(x, jax.Array):  # tracers are jax.Arrays too: the eager calls name them
            raise TypeError(f"{name} must be a jax.Array, got {type(x).__module__}.{type(x).__name__}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{name}.dtype={x.dtype} is not supported; use jax.numpy.float16, bfloat16 or float32")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; use 'bhsd' ([batch, heads, seqlen, head_dim]) or "
                         f"'bshd' ([batch, seqlen, heads, head_dim])")
    if q.ndim != 4:
        raise ValueError(f"q must be 4-d ({layout}), got q.shape={tuple(q.shape)}")


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, layout: str = "bhsd",
              return_lse: bool = False, deterministic: bool = False, sinks=None, window_size=(-1, -1),
              softcap: float = 0.0, score_mod=None, mask_mod=None, block_mask=None):
    """:func:`cuflash.attention` on JAX arrays on a CUDA GPU, differentiable with respect to q, k
    and v (and the sinks) (``jax.grad``, ``jax.value_and_grad``, ``jax.vjp``), eagerly only.

    Args:
        q: [batch, heads, seqlen_q, head_dim] (``layout="bshd"``: [batch, seqlen_q, heads, head_dim]),
            float16, bfloat16 or float32, on one CUDA GPU.
        k, v: [batch, heads_k, seqlen_k, head_dim] in the same layout and dtype, on q's device;
            heads a multiple of heads_k (grouped-query attention).
        causal, scale, layout: as for :func:`cuflash.attention` (causal aligned bottom-right).
        return_lse: also return the natural-log LSE, float32 [batch, heads, seqlen_q]; it is not
            differentiated through.
        deterministic: the backward accumulates dQ in a fixed order (bit-identical runs).
        sinks: attention sinks, one logit per query head ([heads], float16, bfloat16 or float32,
            on q's device), as for :func:`cuflash.attention`; their gradient has their dtype.
        window_size, softcap: FlashAttention's sliding window ``(left, right)`` (-1: unbounded)
            and logit cap (0: none), as for :func:`cuflash.attention` (Gemma 2's, say).
        score_mod, mask_mod, block_mask: as for :func:`cuflash.attention`; the mods are traced once
            for both passes and may capture JAX arrays (on q's GPU; constants, not differentiated).

    Returns:
        The output, in ``layout`` and q's dtype (and the LSE with ``return_lse``), on q's device,
        complete when the call returns.

    Raises:
        TypeError: inside ``jax.jit``, ``jax.vmap`` and the other transformations that trace.
    """
    _check(q, k, v, layout, sinks)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    variants = validate_variants(window_size, softcap, causal)  # hashable: a static argument
    mods = None  # traced here, once for both passes: graphs are static arguments too
    if score_mod is not None or mask_mod is not None or block_mask is not None:
        mods = (_modset.traced(score_mod, "score"), _modset.traced(mask_mod, "mask"), block_mask)
        if variants is not None:
            variant_mods(variants, causal, mods[0], mods[1] if block_mask is None else block_mask)
    function = _attention_lse if return_lse else _attention_out
    return function(q, k, v, sinks, causal, float(scale), layout, deterministic, variants, mods)


__all__ = ["attention", "LAYOUTS"]
