"""Attention over packed sequences of their own lengths (variable-length batches): the forward on
the Hopper warp-specialized kernel's varlen specialization (elsewhere on the KV-cache kernel's),
the backward in one launch of the Hopper backward or sequence by sequence."""
from __future__ import annotations

import dataclasses
import math
import struct
import sys

import numpy as np

from .core import compile as _compile
from .core import kvcache as _kv
from .fp8 import _xp


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                     scale=None, window_size=(-1, -1), softcap=0.0, return_lse=False, sinks=None, score_mod=None,
                     mask_mod=None):
    """Attention of each packed sequence to its own keys, as FlashAttention's varlen call.

    Args:
        q: CuPy array [total_q, heads, head_dim], float16 or bfloat16: the queries of all
            sequences, one after another; sequence b's are rows ``cu_seqlens_q[b]`` to
            ``cu_seqlens_q[b + 1]``.
        k, v: [total_k, heads_k, head_dim] in q's dtype, packed the same way by ``cu_seqlens_k``;
            heads a multiple of heads_k.
        cu_seqlens_q, cu_seqlens_k: int32 CuPy arrays [batch + 1] of offsets, read on the device.
        max_seqlen_q: the longest sequence's query count (sizes the grid); None reads the offsets
            on the host once (a synchronization).
        max_seqlen_k: the longest sequence's key count, checked when given (as FlashAttention's
            call takes it); the forward reads the key offsets on the device and needs none.
        causal: aligned bottom-right per sequence (query i of a sequence of n queries and m keys
            sees keys up to i + m - n). window_size, softcap, scale: as for
            :func:`cuflash.attention_with_kvcache`.
        return_lse: also return the natural-log LSE, float32 [heads, total_q].
        sinks: attention sinks, a float CuPy array [heads] (see :func:`cuflash.attention`).
        score_mod, mask_mod: as for :func:`cuflash.attention`, with ``b`` the sequence's index
            and ``q_idx`` / ``kv_idx`` positions within the sequence (from 0). They run on the
            Hopper kernel (sm90a), elsewhere on the KV-cache kernel, per score element.

    Returns:
        The output [total_q, heads, head_dim] in q's dtype (and the LSE). Sequences may be empty;
        a row with no key gives 0 and -inf. A sequence whose offsets are decreasing or outside
        q, k or v, or with more queries than ``max_seqlen_q``, gives no output: its rows stay
        NaN where no valid sequence covers them, as do rows that no sequence covers. Runs on the
        current CuPy stream.
        The gradients: :func:`attention_varlen_backward`.
    """
    import cupy

    from .forward import _arch, _on_device

    if max_seqlen_k is not None:
        _maxima(max_seqlen_q, max_seqlen_k)
    # a repeated call: straight to its launch plan (with mods: where they trace to graphs kept for
    # their function and captured values, the same graphs and arrays as the plan's)
    key = _plan_key(cupy, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, scale, window_size, softcap, sinks)
    if key is not None and (score_mod is not None or mask_mod is not None):
        from .core import modset
        from .forward import _Same

        score_mod, score_kept = modset.traced_kept(score_mod, "score")
        mask_mod, mask_kept = modset.traced_kept(mask_mod, "mask")
        key = key + (_Same(score_mod), _Same(mask_mod)) if score_kept and mask_kept else None
    plan = _plans.get(key) if key is not None else None
    if plan is not None and not (q.data.ptr | k.data.ptr | v.data.ptr) % 16:
        out, lse = _kv.poisoned_outputs(cupy, q)
        plan.launch(q, k, v, out, lse)
        return (out, lse) if return_lse else out
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a CuPy array, got {type(x).__name__}")
        if x.ndim != 3:
            raise ValueError(f"{name} must be 3-d [total, heads, head_dim] (packed sequences), got shape {x.shape}")
    if k.shape != v.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k {k.dtype} {k.shape} and v {v.dtype} {v.shape} must match each other and q's dtype "
                         f"{q.dtype}")
    device = q.data.device_id
    cu_q = _kv.offsets(cupy, "cu_seqlens_q", cu_seqlens_q, device)
    cu_k = _kv.offsets(cupy, "cu_seqlens_k", cu_seqlens_k, device)
    if cu_q.size != cu_k.size:
        raise ValueError(f"cu_seqlens_q has {cu_q.size} offsets and cu_seqlens_k {cu_k.size}: one per sequence "
                         f"boundary each")
    batch = cu_q.size - 1
    total_q, heads, head_dim = q.shape
    total_k, heads_k, _ = k.shape
    if max_seqlen_q is None:
        host = cu_q.get()
        max_seqlen_q = int(np.max(np.diff(host), initial=0)) if batch else 0
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, (int, np.integer)) or max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q={max_seqlen_q!r} must be a non-negative integer")
    # validate_kvcache checks the rest on 4-d views: [1, total, heads, d] (a "cache" of total_k keys,
    # copied where its rows are not 16-byte copyable)
    if total_k == 0:  # no keys at all: a one-row stand-in, never read (every sequence's key range is empty)
        k, v = (cupy.zeros((1,) + x.shape[1:], dtype=x.dtype) for x in (k, v))
        key = None  # a plan would launch on the call's own (empty) k and v
    k4, v4 = (x[None] if _kv._rows_aligned(x[None]) else x.copy()[None] for x in (k, v))
    problem, q4, _, _, _ = _kv.validate_kvcache(
        q[None], k4, v4, cache_seqlens=None, k_new=None, v_new=None, page_table=None,
        causal=causal, scale=scale, fp8_format=None, window_size=window_size, softcap=softcap)
    if total_q >= 2**31 or total_k >= 2**31:
        raise ValueError(f"total_q={total_q} and total_k={total_k} must be below 2**31")
    problem = _kv.KVCacheProblem(
        batch, int(max_seqlen_q), heads, heads_k, head_dim, problem.dtype, problem.cache_dtype, False, total_k,
        total_k, batch, 0, problem.causal, problem.scale, device, (0, *k4.strides[1:3]), (0, *v4.strides[1:3]),
        problem.window, problem.softcap, True, total_q, total_k)
    if math.ceil(problem.rows / 64) > 65535:
        raise ValueError(f"max_seqlen_q x heads / heads_k = {problem.rows} query rows per kv head is too many")
    sinks_arg = sinks
    if sinks is not None:
        from .core.validate import validate_sinks
        sinks = validate_sinks(sinks, problem.heads, problem.device_id)
    mods = _varlen_mods(problem, score_mod, mask_mod)
    with _on_device(device):
        out, lse = _kv.poisoned_outputs(cupy, q)
        hopper = _hopper(q, k, v, cu_q, cu_k, out, lse, int(max_seqlen_q), problem, sinks, mods) \
            if batch and max_seqlen_q and out.size else None
        if hopper is not None:
            if key is not None and cu_q is cu_seqlens_q and cu_k is cu_seqlens_k and sinks is sinks_arg:
                if len(_plans) >= _MAX_PLANS:
                    _plans.clear()
                _plans[key] = hopper
        elif batch and max_seqlen_q and out.size:
            # the KV-cache kernel: its own softcap and window, the call's mods per score element
            from .core import modset
            own_mods = modset.prepare(score_mod, mask_mod, device, _varlen_extents(problem))
            spec = _kv.select_spec(problem, _arch(device), own_mods)
            kernels = _compile.get_kernel(spec, device)
            plan = _kv.KVCachePlan(kernels, spec, problem, page_table=None, cache_seqlens=None, splits=1,
                                   k_descale=(1.0, None, False), v_descale=(1.0, None, False),
                                   stream=cupy.cuda.get_current_stream().ptr, cu_seqlens=(cu_q, cu_k),
                                   sinks=sinks, mods=own_mods)
            plan.launch(q4, k4, v4, None, None, out, lse)
    return (out, lse) if return_lse else out


#: Launch plans of the Hopper forward by everything a call's validation and launch depend on but
#: the addresses of q, k, v and the outputs (the offsets' and sinks' addresses sit in the plan).
_plans: dict = {}
_MAX_PLANS = 256


def _plan_key(cupy, q, k, v, cu_q, cu_k, max_seqlen_q, causal, scale, window_size, softcap, sinks):
    """The key of a call's plan, or None for one that always takes the full path (anything but
    CuPy arrays, max_seqlen_q read from the offsets, offsets that are copied, another device)."""
    nd = cupy.ndarray
    if type(q) is not nd or type(k) is not nd or type(v) is not nd or type(cu_q) is not nd or type(cu_k) is not nd:
        return None
    if type(max_seqlen_q) is not int or type(causal) is not bool or not (sinks is None or type(sinks) is nd):
        return None
    device = q.data.device_id
    if cupy.cuda.runtime.getDevice() != device or cu_q.strides != (4,) or cu_k.strides != (4,):
        return None
    key = (q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape, v.strides, v.dtype, cu_q.data.ptr,
           cu_q.shape, cu_q.dtype, cu_q.data.device_id, cu_k.data.ptr, cu_k.shape, cu_k.dtype, cu_k.data.device_id,
           max_seqlen_q, causal, scale, window_size, softcap,
           None if sinks is None else (sinks.data.ptr, sinks.shape, sinks.strides, sinks.dtype, sinks.data.device_id),
           device, cupy.cuda.get_current_stream().ptr)
    try:
        hash(key)
    except TypeError:  # a list window or an unhashable scale: the full path takes or names it
        return None
    return key


def hopper_spec(head_dim: int, dtype: str, causal: bool, max_seqlen_q: int, arch: str):
    """The warp-specialized varlen specialization for packed sequences of up to max_seqlen_q
    queries (the tiles of the dense kernel at that length), or None where the default kernel is
    not the warp-specialized one."""
    from .core.policy import SHORT_SEQLEN, default_spec

    spec = default_spec(head_dim, dtype, causal, arch, seqlen=min(max_seqlen_q, SHORT_SEQLEN + 1))
    return spec.replace(varlen=True) if spec.warp_specialized else None


def _with_softcap(window, cap, causal, score_mod, mask_mod):
    """The call's (score_mod, mask_mod) with its softcap as the score_mod, checked beside its
    window and cap as attention's are (a cap beside a score_mod, a window beside a mask_mod)."""
    from .core.validate import variant_mods
    from .mods import _softcap_mod

    if score_mod is not None or mask_mod is not None:
        variant_mods((tuple(window), cap), causal, score_mod, mask_mod)
    return (_softcap_mod(cap) if cap else score_mod), mask_mod


def _varlen_mods(problem, score_mod, mask_mod):
    """The forward's mods (modset.prepare), its softcap among them; None where it has none."""
    from .core import modset

    if score_mod is None and mask_mod is None and not problem.softcap:
        return None
    score_mod, mask_mod = _with_softcap(problem.window, problem.softcap, problem.causal, score_mod, mask_mod)
    return modset.prepare(score_mod, mask_mod, problem.device_id, _varlen_extents(problem))


def _varlen_extents(problem) -> dict:
    """The symbols' counts of a packed forward (modset.check_bounds): its sequences, heads and
    max_seqlen_q; the keys of a sequence are not known on the host."""
    return {"b": problem.batch, "h": problem.heads, "q_idx": problem.seqlen_q, "kv_idx": None}


def _split_refusal(spec, score_graph) -> str:
    """Why a Hopper backward spec cannot take this score_mod ("" where it can): where it splits
    the head dim between warpgroups it takes only one whose derivative is 1."""
    from .core import mod_grad

    if spec.split_head_dim and score_graph is not None and not mod_grad.adds_only(score_graph):
        return f"at head_dim={spec.head_dim} it takes only a score_mod whose derivative is 1 (a bias added to the score)"
    return ""


def _hopper(q, k, v, cu_q, cu_k, out, lse, max_seqlen_q, problem, sinks=None, mods=None):
    """Run the forward on the Hopper warp-specialized kernel's varlen specialization where it
    applies (sm90a, fp16/bf16, a positive scale, rows TMA can read, a head dim the kernel takes; a
    window as the kernel's own bounds, spec.local; a softcap or the call's mods as its mods): its
    launch plan, or None where it does not apply."""
    from .core.launch import LaunchPlan
    from .core.validate import readable_by_tma, validate
    from .forward import _arch

    plain = problem.window == ((-1, 0) if problem.causal else (-1, -1))  # no window beyond the causal bound
    if _arch(problem.device_id) != "sm90a":
        return None
    if problem.scale <= 0 or not all(readable_by_tma(x[None]) for x in (q, k, v)):
        return None
    # the maps' view: every packed row as one sequence of batch 1; the kernel's: batch sequences of
    # up to max_seqlen_q queries, their rows found from the offsets (batch strides unused; its
    # seqlen_k, which only picks tiles and bands, taken as max_seqlen_q)
    rows = validate(q[None], k[None], v[None], causal=problem.causal, scale=problem.scale, layout="bshd")
    if rows.dtype.tag not in ("fp16", "bf16"):
        return None
    kernel_problem = dataclasses.replace(rows, batch=cu_q.size - 1, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_q,
                                         q_strides=(0, *rows.q_strides[1:]), k_strides=(0, *rows.k_strides[1:]),
                                         v_strides=(0, *rows.v_strides[1:]))
    spec = hopper_spec(rows.head_dim, rows.dtype.tag, rows.causal, max_seqlen_q, _arch(problem.device_id))
    if spec is None:
        return None
    if sinks is not None:
        spec = spec.replace(sinks=True, lse=True)
    if not plain:
        spec = spec.replace(local=True)
    # the offsets are checked against the call's own key count (0 where k is the one-row stand-in)
    varlen = struct.pack("<QQiiii", cu_q.data.ptr, cu_k.data.ptr, q.shape[0], problem.total_k, max_seqlen_q,
                         k.shape[0])
    if mods is not None:
        from .core import modset
        spec = spec.replace(score_mod=mods.score_digest, mask_mod=mods.mask_digest)
        varlen = (varlen, modset.kernel_argument(mods))
    kernel = _compile.get_kernel(spec, problem.device_id)
    out_strides = (0, out.strides[1] // out.itemsize, out.strides[0] // out.itemsize)
    plan = LaunchPlan(kernel, spec, kernel_problem, q, k, v, out, lse, out_strides, mods=varlen,
                      map_problem=rows, sinks=sinks, window=tuple(problem.window))
    plan.launch(q, k, v, out, lse)
    return plan


def _host_offsets(name, x, total):
    """The offsets on the host (a CuPy array is copied: one synchronization), checked."""
    host = np.asarray(x.get() if hasattr(x, "get") else x)
    if host.dtype != np.int32 or host.ndim != 1 or host.size < 1:
        raise TypeError(f"{name} must be int32 [batch + 1] offsets, got {host.dtype} {host.shape}")
    if host[0] != 0 or host[-1] != total or np.any(np.diff(host) < 0):
        raise ValueError(f"{name} must rise from 0 to {total} (the packed rows), got {host.tolist()[:8]}"
                         f"{' ...' if host.size > 8 else ''}")
    return host


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                              max_seqlen_k=None, causal=False, scale=None, deterministic=False, family=None, sinks=None,
                              window_size=(-1, -1), softcap=0.0, score_mod=None, mask_mod=None):
    """Gradients ``(dq, dk, dv)`` of :func:`attention_varlen`, and ``dsinks`` (a fourth, in the
    sinks' dtype) with ``sinks``.

    Args:
        dout: [total_q, heads, head_dim], the gradient of the output.
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_size, softcap, score_mod,
            mask_mod: as passed to the forward. score_mod and mask_mod run in one launch (family
            "wgmma"; at head dims 192 and up only a score_mod whose derivative is 1, as adding a
            bias); a softcap where that launch cannot take it runs sequence by sequence.
        out, lse: the forward's output and LSE ([heads, total_q], ``return_lse=True``).
        max_seqlen_q, max_seqlen_k: the longest sequence's query and key counts. With both, the
            one launch reads the offsets on the device only (no synchronization): a sequence
            whose offsets fall outside the packed rows, decrease, or pass these counts gets NaN
            gradients, as do rows that no such sequence covers. Without them the offsets are
            read on the host and checked (ValueError).
        deterministic: dQ in a fixed order (bit-identical runs).
        sinks: the forward's sinks (its LSE includes them).
        family: ``"wgmma"``: every sequence in one launch of the Hopper K/V-outer kernel's varlen
            specialization (sm90a, fp16/bf16, CuPy arrays, not deterministic);
            ``"sequences"``: each sequence on :func:`cuflash.attention_backward`; None:
            ``"wgmma"`` where it applies, else ``"sequences"``.

    The per-sequence walk runs :func:`cuflash.attention_backward` on each sequence's rows, writing
    straight into the packed gradients, and each sequence costs one backward call's host time.
    It reads the offsets on the host once (a synchronization for CuPy offsets; NumPy offsets are
    taken as they are), as the one launch does without max_seqlen_q and max_seqlen_k.
    Offsets read on the host must rise from 0 to the packed row counts (checked, ValueError). The
    keys of a sequence with no queries get zero gradients."""
    from .backward import _attention_backward
    from .core.validate import validate_sinks, validate_variants

    for name, x in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be a CuPy or NumPy array, got {type(x).__name__}")
    if q.ndim != 3 or k.ndim != 3:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be 3-d [total, heads, head_dim]")
    xp = _xp(q)
    total_q, total_k = q.shape[0], k.shape[0]
    sinks32 = None if sinks is None else validate_sinks(sinks, q.shape[1],
                                                       getattr(getattr(q, "device", None), "id", -1))
    maxima = _maxima(max_seqlen_q, max_seqlen_k)
    for name, x, want in (("dout", dout, q.shape), ("out", out, q.shape), ("lse", lse, (q.shape[1], total_q))):
        if tuple(x.shape) != tuple(want):
            raise ValueError(f"{name} has shape {tuple(x.shape)}; it must be {tuple(want)}")
    if family not in (None, "wgmma", "sequences"):
        raise ValueError(f"family={family!r}: the varlen backward's families are 'wgmma' and 'sequences'")
    if family == "wgmma" and deterministic:
        raise ValueError(f"family='wgmma', deterministic={deterministic}: the one-launch varlen backward is "
                         f"not deterministic")
    variants = validate_variants(window_size, softcap, causal)
    window = variants[0] if variants is not None else (-1, -1)
    cap = variants[1] if variants is not None else 0.0
    user_mods = score_mod is not None or mask_mod is not None
    score_mod, mask_mod = _with_softcap(window, cap, causal, score_mod, mask_mod)
    # family="wgmma" is taken as asked for: _hopper_backward names what it cannot run
    why = "" if family == "wgmma" else _one_launch_refusal(q, deterministic, score_mod) or _too_many(cu_seqlens_q)
    if user_mods and (why or family == "sequences"):
        raise ValueError(f"score_mod and mask_mod on attention_varlen_backward run in one launch of the Hopper "
                         f"backward (family='wgmma'), which does not run this call: "
                         f"{'family=' + repr(family) if family == 'sequences' else why}")
    one_launch = family == "wgmma" or (family is None and not why)
    offsets_q = offsets_k = None
    cupy = sys.modules.get("cupy")
    on_device = one_launch and maxima is not None and bool(maxima[1] and total_q and total_k) and cupy is not None \
        and all(isinstance(x, cupy.ndarray) for x in (cu_seqlens_q, cu_seqlens_k))
    if not on_device:  # the offsets read on the host and checked
        offsets_q = _host_offsets("cu_seqlens_q", cu_seqlens_q, total_q)
        offsets_k = _host_offsets("cu_seqlens_k", cu_seqlens_k, total_k)
        if offsets_q.size != offsets_k.size:
            raise ValueError(f"cu_seqlens_q has {offsets_q.size} offsets and cu_seqlens_k {offsets_k.size}")
        maxima = tuple(int(np.max(np.diff(x), initial=0)) for x in (offsets_q, offsets_k))
    if one_launch:
        grads = _hopper_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, offsets_q, offsets_k, maxima,
                                 causal, scale, window, score_mod, mask_mod)
        return grads if sinks is None else (*grads, _varlen_sinks_grad(dout, out, lse, sinks, sinks32))
    dq, dk, dv = (xp.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
    for b in range(offsets_q.size - 1):
        qs, ks = slice(int(offsets_q[b]), int(offsets_q[b + 1])), slice(int(offsets_k[b]), int(offsets_k[b + 1]))
        if qs.stop == qs.start:
            dk[ks] = 0
            dv[ks] = 0
            continue
        grads = (dq[qs][None], dk[ks][None], dv[ks][None])
        _attention_backward(dout[qs][None], q[qs][None], k[ks][None], v[ks][None], out[qs][None],
                            xp.ascontiguousarray(lse[:, qs])[None], grads, causal=causal, scale=scale, layout="bshd",
                            deterministic=deterministic, spec=None, **_variant_args(variants))
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, _varlen_sinks_grad(dout, out, lse, sinks, sinks32))


def _too_many(cu_seqlens_q) -> str:
    """Why the one launch cannot take these sequences ("" where it can): its grid holds them in z."""
    from .core.validate import GRID_YZ_MAX

    shape = np.shape(cu_seqlens_q)
    sequences = shape[0] - 1 if len(shape) == 1 else 0
    return f"it launches at most {GRID_YZ_MAX} sequences, cu_seqlens_q holds {sequences}" \
        if sequences > GRID_YZ_MAX else ""


def _maxima(max_seqlen_q, max_seqlen_k):
    """(max_seqlen_q, max_seqlen_k) checked, or None where either is not given."""
    for name, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, np.integer)) or not 0 <= x < 2**31):
            raise ValueError(f"{name}={x!r} must be a non-negative integer below 2**31")
    return None if max_seqlen_q is None or max_seqlen_k is None else (int(max_seqlen_q), int(max_seqlen_k))


def _variant_args(variants) -> dict:
    """The window_size and softcap arguments of checked variants (validate_variants; None: none)."""
    return {} if variants is None else dict(window_size=variants[0], softcap=variants[1])


def _varlen_sinks_grad(dout, out, lse, sinks, sinks32):
    """backward._sinks_grad over the packed rows (lse [heads, total_q]), in the sinks' dtype."""
    from .backward import _sinks_grad

    delta = (dout.astype("float32") * out.astype("float32")).sum(axis=-1).T  # [heads, total_q]
    return _sinks_grad(sinks32, lse[None], delta[None]).astype(sinks.dtype, copy=False)


def _one_launch_refusal(q, deterministic: bool, score_mod) -> str:
    """Why the one-launch backward cannot run these inputs ("" where it can): it takes CuPy
    fp16/bf16 arrays on sm90a, not deterministic, at a head dim whose default backward is the
    Hopper kernel, and there a score_mod whose derivative is 1 where that kernel splits the head
    dim (_hopper_backward checks the rest)."""
    from .core import modset
    from .core.dtypes import from_tag
    from .core.policy import default_bwd_spec
    from .forward import _arch

    cupy = sys.modules.get("cupy")
    if cupy is None or not isinstance(q, cupy.ndarray) or q.dtype.name not in ("float16", "bfloat16"):
        return f"it takes CuPy float16 or bfloat16 arrays, q is {type(q).__name__} {getattr(q, 'dtype', '')}"
    if deterministic:
        return "it is not deterministic"
    arch = _arch(q.device.id)
    if arch != "sm90a":
        return f"it runs on sm90a, the device is {arch}"
    spec = default_bwd_spec(q.shape[-1], from_tag(q.dtype.name).tag, False, "sm90a", False)
    if spec.family != "wgmma":
        return f"head_dim={q.shape[-1]} runs on the portable backward"
    return _split_refusal(spec, modset.traced(score_mod, "score"))


def _hopper_backward(dout, q, k, v, out, lse, cu_q, cu_k, offsets_q, offsets_k, maxima, causal, scale,
                     window=(-1, -1), score_mod=None, mask_mod=None):
    """attention_varlen_backward on the Hopper K/V-outer kernel's varlen specialization: one launch
    of blocks (key tile, kv head, sequence); the preprocess and the dQ conversion run over all
    packed rows as one sequence. ``offsets_q`` / ``offsets_k``: the offsets checked on the host,
    or None (the kernels check them; the gradients start as NaN); ``maxima``: (max_seqlen_q,
    max_seqlen_k). ``window``: checked (left, right), bounded by the kernel; the mods (a softcap
    among them) checked beside it."""
    import cupy

    from .core import modset as _modset
    from .core.bwd_spec import VARLEN_DQ_GAP
    from .core.launch import launch_backward, rows_padded
    from .core.policy import default_bwd_spec
    from .backward import loadable
    from .core.validate import validate_backward
    from .forward import _arch, _on_device

    for name, x in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"family='wgmma' takes CuPy arrays; {name} is a {type(x).__name__}")
    bp = validate_backward(dout[None], q[None], k[None], v[None], out[None], lse[None], causal=causal, scale=scale,
                           layout="bshd", deterministic=False)
    problem = bp.forward
    arch = _arch(problem.device_id)
    if arch != "sm90a" or problem.dtype.tag not in ("fp16", "bf16"):
        raise ValueError(f"family='wgmma' runs on sm90a with fp16 or bf16 inputs (device {problem.device_id} is "
                         f"{arch}, dtype {problem.dtype.tag})")
    plain = window[0] < 0 and (causal or window[1] < 0)  # no bound beyond the causal one
    spec = default_bwd_spec(problem.head_dim, problem.dtype.tag, causal, arch, False, family="wgmma").replace(
        varlen=True, local=not plain)
    mods = _modset.prepare(score_mod, mask_mod, problem.device_id,
                           {"b": np.shape(cu_q)[0] - 1, "h": q.shape[1], "q_idx": maxima[0], "kv_idx": maxima[1]})
    if mods is not None:
        why = _split_refusal(spec, mods.score)
        if why:
            raise ValueError(f"family='wgmma': {why}, not a softcap or this score_mod")
        spec = spec.replace(score_mod=mods.score_digest, mask_mod=mods.mask_digest)
    total_q, heads, head_dim = q.shape
    total_k, heads_k = k.shape[:2]
    max_seqlen_q, max_seqlen_k = maxima
    checked = offsets_q is not None
    with _on_device(problem.device_id):
        # the kernels' offsets: CuPy arrays as given (contiguous), host offsets copied to the device
        cu_q, cu_k = (_kv.offsets(cupy, name, x if isinstance(x, cupy.ndarray) else cupy.asarray(h), problem.device_id)
                      for name, x, h in (("cu_seqlens_q", cu_q, offsets_q), ("cu_seqlens_k", cu_k, offsets_k)))
        if cu_q.size != cu_k.size:
            raise ValueError(f"cu_seqlens_q has {cu_q.size} offsets and cu_seqlens_k {cu_k.size}")
        sequences = cu_q.size - 1
        why = _too_many(cu_q)
        if why:
            raise ValueError(f"family='wgmma': {why}")
        dq, dk, dv = (cupy.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
        if not checked:  # NaN (all-ones bytes) where no sequence the kernels accept writes
            for x in (dq, dk, dv):
                x.data.memset_async(0xFF, x.nbytes)
        if not sequences or not heads_k or (checked and (not total_q or not total_k or not max_seqlen_k)):
            if checked:
                for x in (dq, dk, dv):
                    x.fill(0)
            return dq, dk, dv
        spec, (q, k, v, dout), copied = loadable(spec, q, k, v, dout, view=lambda x: x[None])
        if copied:
            bp = validate_backward(dout[None], q[None], k[None], v[None], out[None], lse[None], causal=causal,
                                   scale=scale, layout="bshd", deterministic=False)
        out, lse = cupy.ascontiguousarray(out), cupy.ascontiguousarray(lse)
        # one query tile more than the packed rows need: a sequence's last tile reads past its end;
        # dQ's accumulator puts VARLEN_DQ_GAP rows after each sequence
        padded = rows_padded(spec, total_q) + max(spec.block_m, spec.dq_tiles[0]) + VARLEN_DQ_GAP * sequences
        stats = cupy.empty((2, heads * padded), dtype=cupy.float32)
        accum = cupy.empty((1, heads, padded, spec.accum_head_dim), dtype=cupy.float32)
        tensors = dict(q=q, k=k, v=v, o=out, dout=dout, lse=lse, dq=dq, dk=dk, dv=dv, dq_accum=accum,
                       lse2=stats[0], delta=stats[1])
        strides = {name: (0, x.strides[1] // x.itemsize, x.strides[0] // x.itemsize)
                   for name, x in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout), ("dq", dq), ("dk", dk),
                                   ("dv", dv))}
        args = struct.pack("<QQiiii", cu_q.data.ptr, cu_k.data.ptr, total_q, total_k, max_seqlen_q, max_seqlen_k)
        launch_backward(_compile.get_kernel(spec, problem.device_id), spec, bp, tensors, strides,
                        _modset.kernel_argument(mods), padded=padded,
                        varlen=(args, sequences, max_seqlen_k, max_seqlen_q), window=window)
    return dq, dk, dv


def attention_varlen_with_grad(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                               causal=False, scale=None, deterministic=False, sinks=None, window_size=(-1, -1),
                               softcap=0.0, score_mod=None, mask_mod=None):
    """The forward output and a function from ``dout`` to ``(dq, dk, dv)`` (and ``dsinks`` with
    ``sinks``), as :func:`cuflash.attention_with_grad` for packed sequences; with max_seqlen_q
    and max_seqlen_k neither pass reads the offsets on the host (see
    :func:`attention_varlen_backward`)."""
    from .core import modset

    # traced once for both passes
    score_mod, mask_mod = modset.traced(score_mod, "score"), modset.traced(mask_mod, "mask")
    out, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, causal=causal,
                                scale=scale, return_lse=True, sinks=sinks, window_size=window_size, softcap=softcap,
                                score_mod=score_mod, mask_mod=mask_mod)

    def backward(dout):
        return attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                                         scale=scale, deterministic=deterministic, sinks=sinks,
                                         window_size=window_size, softcap=softcap, score_mod=score_mod,
                                         mask_mod=mask_mod)
    return out, backward


__all__ = ["attention_varlen", "attention_varlen_backward", "attention_varlen_with_grad"]
