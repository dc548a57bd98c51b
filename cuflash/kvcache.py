"""Attention over a KV cache: decode steps, speculative verification, chunked prefill."""
from __future__ import annotations

import numpy as np

from .core import compile as _compile
from .core import kvcache as _kv
from .core import modset as _modset
from .core.launch import outputs_unused


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, page_table=None,
                           causal=True, scale=None, window_size=(-1, -1), softcap=0.0, num_splits=None,
                           return_lse=False, fp8_format=None, k_descale=None, v_descale=None, sinks=None,
                           score_mod=None, mask_mod=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                           cache_batch_idx=None, cu_seqlens_q=None, max_seqlen_q=None, cache_leftpad=None):
    """Attend a few new query tokens per sequence to a KV cache (contiguous or paged).

    Args:
        q: CuPy array [batch, seqlen_q, heads, head_dim], float16 or bfloat16; seqlen_q from 1
            (decode) to a few dozen (speculative verification, chunked prefill).
        k_cache, v_cache: [batch, max_seqlen, heads_k, head_dim], or with ``page_table`` paged
            [num_pages, page_size, heads_k, head_dim]; q's dtype, or uint8 FP8 codes with
            ``fp8_format``. Rows must be 16-byte aligned with a contiguous last dim (they are
            read and appended in place); ``heads`` a multiple of ``heads_k``.
        cache_seqlens: int32 CuPy array [batch]: the keys each sequence's cache holds before
            this call (read on the device, never on the host), or one int for every sequence.
        k_new, v_new: optional [batch, seqlen_new, heads_k, head_dim] in the cache's dtype:
            written into the cache at positions ``cache_seqlens[b] ..`` before attending, which
            then covers ``cache_seqlens[b] + seqlen_new`` keys. ``cache_seqlens`` is not updated.
        page_table: int32 [batch, max_pages]: the pages of sequence b, in order; key j of it sits
            at row ``j % page_size`` of page ``page_table[b, j // page_size]``.
        causal: queries are the last seqlen_q tokens of each sequence (bottom-right alignment):
            token i attends keys up to ``length - seqlen_q + i``. False: every key.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        window_size: ``(left, right)``: a query at position i sees keys i - left to i + right
            (sliding-window attention, as Mistral's); -1 for unbounded. Causal: right is 0.
        softcap: ``softcap * tanh(score / softcap)`` on the scaled scores (Gemma 2); 0 for none.
        num_splits: split each sequence's keys over this many blocks, merged by the last to finish;
            None chooses from the multiprocessor count, the batch, heads and the cache's capacity.
        return_lse: also return the natural-log LSE, float32 [batch, heads, seqlen_q] (packed
            queries: [heads, total_q]).
        fp8_format: ``"e4m3"`` or ``"e5m2"`` for a cache of FP8 codes (:func:`cuflash.quantize_fp8`),
            converted on chip; values are ``codes * descale``.
        k_descale, v_descale: FP8 descales: a positive number, or a float32 CuPy array of shape
            () or (heads_k,) (per kv head).
        sinks: attention sinks (gpt-oss): a float CuPy array [heads], one logit per query head
            added to its rows' softmax sums, as for :func:`cuflash.attention`.
        score_mod, mask_mod: as for :func:`cuflash.attention` (:mod:`cuflash.mods`), on the scaled
            scores (after ``softcap``, which takes no score_mod beside it), with ``b`` the
            sequence, ``h`` the query head, ``q_idx`` the query's position in its sequence
            (``length - seqlen_q + i`` for token i, ``length`` the keys after the append) and
            ``kv_idx`` the key's, from 0. A mask_mod narrows what causal and the window allow.
        rotary_cos, rotary_sin: rotary position embeddings, as FlashAttention's call applies them:
            tables [seqlen_ro, rotary_dim / 2] (seqlen_ro at least the cache's capacity) by which
            the first rotary_dim dims of k_new are rotated at positions ``cache_seqlens[b] + j``
            before the append, and q's at its tokens' positions (causal or a window), else all at
            ``cache_seqlens[b]``. Needs k_new; 16-bit caches. ``rotary_interleaved``: rotate
            even / odd dim pairs (GPT-J) instead of the two halves (GPT-NeoX).
        cache_batch_idx: int32 CuPy array [batch]: sequence b's keys are row ``cache_batch_idx[b]``
            of a contiguous cache [num_slots, max_seqlen, heads_k, head_dim] (FlashAttention's
            argument); it runs as a paged cache of one page per sequence. Not with ``page_table``.
        cu_seqlens_q, max_seqlen_q: queries packed [total_q, heads, head_dim], sequence b's rows
            ``cu_seqlens_q[b]`` to ``cu_seqlens_q[b + 1]`` (int32 CuPy array [batch + 1], read on
            the device), so a batch mixes decode and prefill without padding. ``cache_seqlens``
            then counts every key, the queries' own included (no k_new); the output is packed
            like q, the LSE [heads, total_q], rows no sequence covers stay NaN, and the keys are
            split only when ``num_splits`` asks. ``max_seqlen_q`` (the most queries of one
            sequence; None reads the offsets on the host once) sizes the grid: a sequence with
            more gets NaN rows.
        cache_leftpad: int32 CuPy array [batch]: sequence b's keys start at row
            ``cache_leftpad[b]`` of a contiguous cache (left-padded caches, FlashAttention's
            argument) and end at ``cache_seqlens[b]`` (plus the new keys, appended there); positions
            (causal, the window, the mods' q_idx / kv_idx, the rotary tables') count from the
            first key. Not with ``page_table`` or ``cache_batch_idx``.

    Returns:
        The output shaped like q, in q's dtype (and the LSE). A row with no
        key gives 0 and -inf. A sequence whose length is negative or passes the cache's capacity
        (with the new keys), or whose keys sit on a page id outside the cache, gives NaN rows and
        gets no new keys; nothing outside the arrays is read or written. Runs on the current CuPy
        stream without synchronizing, so it can be captured in a CUDA graph once its kernel is
        compiled.
    """
    import cupy

    if cache_seqlens is None:  # None marks the packed-sequence path inside cuflash, never a call's
        raise TypeError("cache_seqlens must be an int32 CuPy array [batch] or an int, got None")
    if cache_batch_idx is not None:  # a contiguous cache's rows picked per sequence: pages of max_seqlen keys
        page_table = _one_page_each(cupy, cache_batch_idx, page_table)
    packed = None
    if cu_seqlens_q is not None or max_seqlen_q is not None:  # (offsets, batch, max_seqlen_q)
        packed = _packed_queries(cupy, q, cu_seqlens_q, max_seqlen_q, k_new, v_new, rotary_cos, rotary_sin)
    leftpad_arg = cache_leftpad
    if cache_leftpad is not None:
        cache_leftpad = _kv.leftpad(cupy, cache_leftpad, q, page_table, packed[1] if packed else None)
    if rotary_cos is not None or rotary_sin is not None:  # new arrays: the call then goes on as without
        positions = cache_seqlens if cache_leftpad is None or not isinstance(cache_seqlens, (int, cupy.ndarray)) \
            else cache_seqlens - cache_leftpad
        q, k_new = _rotated(cupy, q, k_cache, k_new, page_table, positions, causal, window_size, fp8_format,
                            rotary_cos, rotary_sin, rotary_interleaved)
    key = _plan_key(cupy, q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, causal, scale, num_splits,
                    fp8_format, k_descale, v_descale, window_size, softcap, sinks)
    if packed is not None and key is not None:  # offsets copied (strided): no plan keeps the copy
        key = key + (packed[0].data.ptr, packed[0].shape, packed[2]) if packed[0] is cu_seqlens_q else None
    if cache_leftpad is not None and key is not None:  # a contiguous copy: no plan keeps it
        key = key + (cache_leftpad.data.ptr, cache_leftpad.shape) if cache_leftpad is leftpad_arg else None
    if score_mod is not None or mask_mod is not None:
        # A call with mods has a plan when they trace to graphs kept for their function and captured
        # values (the same graphs hold the same arrays: the same kernel argument).
        from .forward import _Same

        score_mod, score_kept = _modset.traced_kept(score_mod, "score")
        mask_mod, mask_kept = _modset.traced_kept(mask_mod, "mask")
        key = key + (_Same(score_mod), _Same(mask_mod)) if key is not None and score_kept and mask_kept else None
    plan = _plans.get(key) if key is not None else None
    if plan is not None:
        q_ptr, k_ptr, v_ptr = q.data.ptr, k_cache.data.ptr, v_cache.data.ptr
        k_new_ptr, v_new_ptr = (0, 0) if k_new is None else (k_new.data.ptr, v_new.data.ptr)
        aligned = not (q_ptr | k_ptr | v_ptr | k_new_ptr | v_new_ptr) % 16
    if plan is not None and aligned:
        if packed is not None:
            out, lse = _kv.poisoned_outputs(cupy, q)
            plan.launch(q, k_cache, v_cache, None, None, out, lse)
            return (out, lse) if return_lse else out
        if not return_lse:
            out, lse = _new_output(cupy, plan, q), plan.lse_scratch
            plan.launch(q, k_cache, v_cache, k_new, v_new, out, lse,
                        pointers=(q_ptr, k_ptr, v_ptr, k_new_ptr, v_new_ptr, out.data.ptr, lse.data.ptr))
            return out
        out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty((plan.problem.batch, plan.problem.heads, plan.problem.seqlen_q), dtype=cupy.float32)
        plan.launch(q, k_cache, v_cache, k_new, v_new, out, lse)
        return out, lse
    return _full_call(cupy, key, q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, causal, scale,
                      num_splits, return_lse, fp8_format, k_descale, v_descale, window_size, softcap, sinks,
                      score_mod, mask_mod, packed, cache_leftpad)


def append_kv(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Write new keys and values into a KV cache by slot, as vLLM's ``reshape_and_cache``: token
    t's rows go to slot ``slot_mapping[t]``, so packed tokens of many sequences land in one call
    (before an :func:`attention_with_kvcache` with ``cu_seqlens_q``, whose lengths then count them).

    Args:
        k_cache, v_cache: paged [num_pages, page_size, heads_k, head_dim] (slot = page *
            page_size + row) or contiguous [batch, max_seqlen, heads_k, head_dim] (slot = b *
            max_seqlen + position); float16, bfloat16 or uint8 FP8 codes; rows 16-byte aligned
            with a contiguous last dim (they are written in place).
        k, v: [tokens, heads_k, head_dim] in the caches' dtype (FP8 caches: codes).
        slot_mapping: int32 CuPy array [tokens], read on the device. A negative slot skips its
            token (padding); so does a slot past the caches: nothing outside them is written.

    Runs on the current CuPy stream without synchronizing (a CUDA graph can capture it).
    """
    import cupy

    for name, x, ndim in (("k_cache", k_cache, 4), ("v_cache", v_cache, 4), ("k", k, 3), ("v", v, 3)):
        _kv._array(cupy, name, x, ndim)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} {k_cache.shape} and v_cache {v_cache.dtype} {v_cache.shape} "
                         f"must match")
    if k_cache.dtype.itemsize not in (1, 2) or k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
        raise TypeError(f"k ({k.dtype}) and v ({v.dtype}) must have the caches' dtype ({k_cache.dtype}): float16, "
                        f"bfloat16 or uint8 FP8 codes")
    tokens = k.shape[0]
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [tokens, heads_k, head_dim] = "
                         f"[tokens, {k_cache.shape[2]}, {k_cache.shape[3]}]")
    device = k_cache.data.device_id
    _kv._int32_array(cupy, "slot_mapping", slot_mapping, "[tokens]", device)
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"slot_mapping must be int32 [tokens={tokens}], got shape {slot_mapping.shape}")
    row_bytes = k_cache.shape[3] * k_cache.dtype.itemsize
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.data.device_id != device:
            raise ValueError(f"{name} is on device {x.data.device_id}, k_cache on device {device}")
        if not _kv._rows_aligned(x) or row_bytes % 16:
            raise ValueError(f"{name} (shape {x.shape}, strides {x.strides}) must have a contiguous last dim and "
                             f"16-byte aligned rows of a multiple of 16 bytes")
    for name, x in (("k", k), ("v", v)):
        if x.data.device_id != device:
            raise ValueError(f"{name} is on device {x.data.device_id}, k_cache on device {device}")
    if tokens == 0 or k_cache.size == 0:
        return
    k, v = (x if _kv._contiguous(x) else x.copy() for x in (k, v))  # C order, 16-byte aligned
    slots = cupy.ascontiguousarray(slot_mapping)
    chunks = row_bytes // 16
    items = tokens * k_cache.shape[2] * chunks
    from .forward import _on_device

    with _on_device(device):
        _append_kernel(cupy, device)(
            (-(-items // 256),), (256,),
            (k, v, k_cache, v_cache, slots, np.int32(k_cache.shape[2]), np.int32(chunks),
             np.int64(k_cache.shape[0] * k_cache.shape[1]), np.int32(k_cache.shape[1]),
             *(np.int64(st) for st in k_cache.strides[:3]), *(np.int64(st) for st in v_cache.strides[:3]),
             np.int64(k.strides[0]), np.int64(k.strides[1]), np.int64(items)))


_APPEND_KERNELS: dict = {}


def _append_kernel(cupy, device: int):
    kernel = _APPEND_KERNELS.get(device)
    if kernel is None:
        from .core.compile import arch_options, device_arch

        module = cupy.RawModule(code='#include "cuflash/append.cuh"\n', options=arch_options(device_arch(device)))
        kernel = _APPEND_KERNELS[device] = module.get_function("cuflash_append_kv")
    return kernel


def _packed_queries(cupy, q, cu_seqlens_q, max_seqlen_q, k_new, v_new, rotary_cos, rotary_sin):
    """(offsets, batch, max_seqlen_q) of a call with packed queries, checked."""
    if cu_seqlens_q is None:
        raise ValueError("max_seqlen_q goes with cu_seqlens_q (packed queries)")
    if k_new is not None or v_new is not None:
        raise ValueError("k_new and v_new with cu_seqlens_q: write the new keys into the cache first; "
                         "cache_seqlens then counts them")
    if rotary_cos is not None or rotary_sin is not None:
        raise ValueError("rotary_cos and rotary_sin rotate k_new, which packed queries (cu_seqlens_q) do not take")
    if not isinstance(q, cupy.ndarray) or q.ndim != 3:
        raise ValueError(f"q must be a 3-d CuPy array [total_q, heads, head_dim] with cu_seqlens_q, got "
                         f"{type(q).__name__} {getattr(q, 'shape', '')}")
    offsets = _kv.offsets(cupy, "cu_seqlens_q", cu_seqlens_q, q.data.device_id)
    batch = offsets.size - 1
    if max_seqlen_q is None:
        max_seqlen_q = int(np.max(np.diff(offsets.get()), initial=0)) if batch else 0
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, (int, np.integer)) \
            or not 0 <= max_seqlen_q < 2**31:
        raise ValueError(f"max_seqlen_q={max_seqlen_q!r} must be a non-negative integer below 2**31")
    if q.shape[0] >= 2**31:
        raise ValueError(f"total_q={q.shape[0]} must be below 2**31")
    return offsets, batch, int(max_seqlen_q)


def _one_page_each(cupy, cache_batch_idx, page_table):
    if page_table is not None:
        raise ValueError("pass cache_batch_idx or page_table, not both")
    if not isinstance(cache_batch_idx, cupy.ndarray) or cache_batch_idx.dtype != cupy.int32 \
            or cache_batch_idx.ndim != 1:
        raise TypeError(f"cache_batch_idx must be an int32 CuPy array [batch], got "
                        f"{getattr(cache_batch_idx, 'dtype', type(cache_batch_idx).__name__)} "
                        f"{getattr(cache_batch_idx, 'shape', '')}")
    return cupy.ascontiguousarray(cache_batch_idx).reshape(-1, 1)


def _rotated(cupy, q, k_cache, k_new, page_table, cache_seqlens, causal, window_size, fp8_format, cos, sin,
             interleaved):
    from .core import rotary

    if fp8_format is not None:
        raise ValueError("rotary_cos and rotary_sin apply to 16-bit caches; rotate the keys before quantizing "
                         "them for an FP8 cache")
    if not isinstance(k_cache, cupy.ndarray) or k_cache.ndim != 4 or not isinstance(q, cupy.ndarray):
        return q, k_new  # the full path names it
    device = q.data.device_id
    for name, x in (("rotary_cos", cos), ("rotary_sin", sin)):
        if isinstance(x, cupy.ndarray) and x.data.device_id != device:
            raise ValueError(f"{name} is on device {x.data.device_id}, q on device {device}")
    capacity = k_cache.shape[1] * (page_table.shape[1] if isinstance(page_table, cupy.ndarray) and
                                   page_table.ndim == 2 else 1)
    with cupy.cuda.Device(device):
        return rotary.apply(cupy, q, k_new, cache_seqlens, capacity, causal, window_size, cos, sin, interleaved)


def _new_output(cupy, plan, q):
    """A planned call's output: the plan's last one again where nothing uses it any more
    (launch.outputs_unused), else a new one."""
    spare = plan.spare
    if spare:
        try:
            entry = spare.pop()  # atomic: threads sharing the plan never take the same entry
        except IndexError:
            pass
        else:
            if outputs_unused(entry, q.shape, None):
                spare.append(entry)
                return entry[0]
            del entry
    out = cupy.empty(q.shape, dtype=q.dtype)
    if not spare:
        spare.append((out,))
    return out


def _full_call(cupy, key, q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, causal, scale, num_splits,
               return_lse, fp8_format, k_descale, v_descale, window_size, softcap, sinks, score_mod=None,
               mask_mod=None, packed=None, leftpad=None):
    from .core.validate import validate_sinks
    from .forward import _arch, _on_device

    if fp8_format is None and (k_descale is not None or v_descale is not None):
        raise ValueError("k_descale and v_descale apply to FP8 caches only; pass fp8_format='e4m3' or 'e5m2'")
    original = (q, k_new, v_new, cache_seqlens)
    problem, q, cache_seqlens, k_new, v_new = _kv.validate_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new, page_table=page_table,
        causal=causal, scale=scale, fp8_format=fp8_format, window_size=window_size, softcap=softcap,
        packed=None if packed is None else packed[1:], leftpad=leftpad is not None)
    sinks32 = None if sinks is None else validate_sinks(sinks, problem.heads, problem.device_id)
    if q.size == 0 or problem.rows == 0:  # no query rows: nothing to attend, nothing launched
        if problem.seqlen_new and problem.batch:
            raise ValueError(f"q {q.shape} has no query rows: k_new and v_new are appended only by a call that "
                             f"attends")
        out, lse = _outputs(cupy, problem, q)
        return (out, lse) if return_lse else out
    _kv.check_mods(problem, score_mod, mask_mod)
    # positions depend on the lengths, read on the device: only the sequence and head are bounded here
    mods = _modset.prepare(score_mod, mask_mod, problem.device_id,
                           {"b": problem.batch, "h": problem.heads, "q_idx": None, "kv_idx": None})
    if any(a is not b for a, b in zip((q, k_new, v_new, cache_seqlens, sinks32), original + (sinks,))):
        key = None  # copied inputs (the plan would keep a copy of the lengths): the full path again
    descales = tuple(_kv.descale_operand(cupy, name, value, problem.heads_k, problem.device_id)
                     for name, value in (("k_descale", k_descale), ("v_descale", v_descale)))
    with _on_device(problem.device_id):
        spec = _kv.select_spec(problem, _arch(problem.device_id), mods)
        splits = _kv.choose_splits(spec, problem, num_splits)
        out, lse = _outputs(cupy, problem, q)
        kernels = _compile.get_kernel(spec, problem.device_id)
        plan = _kv.KVCachePlan(kernels, spec, problem, page_table=page_table, cache_seqlens=cache_seqlens,
                               splits=splits, k_descale=descales[0], v_descale=descales[1],
                               stream=cupy.cuda.get_current_stream().ptr, sinks=sinks32, mods=mods,
                               cu_seqlens=(None if packed is None else packed[0], None), leftpad=leftpad)
        plan.launch(q, k_cache, v_cache, k_new, v_new, out, lse)
        if key is not None:
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            _plans[key] = plan
    return (out, lse) if return_lse else out


def _outputs(cupy, problem, q):
    """The output and LSE of a call: [batch, heads, seqlen_q] LSE, or packed queries' NaN-started
    ones ([heads, total_q] LSE; rows no sequence covers stay NaN)."""
    if problem.packed:
        return _kv.poisoned_outputs(cupy, q)
    return cupy.empty(q.shape, dtype=q.dtype), cupy.empty((problem.batch, problem.heads, problem.seqlen_q),
                                                           dtype=cupy.float32)


#: Launch plans by everything a call's validation and launch depend on but the addresses of q,
#: the caches, the new keys and the outputs (the page table and lengths arrays are part of it:
#: their addresses sit in the plan's parameter block; the mods' graphs too: they hold the arrays
#: whose addresses sit in the mods' argument).
_plans: dict = {}
_MAX_PLANS = 256


def _plan_key(cupy, q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, causal, scale, num_splits,
              fp8_format, k_descale, v_descale, window_size, softcap, sinks):
    """The key of a call's plan, or None for one that always takes the full path (anything but
    CuPy arrays, a length given as a number, descales given as arrays)."""
    nd = cupy.ndarray
    if type(q) is not nd or type(k_cache) is not nd or type(v_cache) is not nd or type(cache_seqlens) is not nd:
        return None
    if not (k_new is None or type(k_new) is nd and type(v_new) is nd) or not (page_table is None or type(page_table) is nd):
        return None
    if type(k_descale) is nd or type(v_descale) is nd or not (sinks is None or type(sinks) is nd):
        return None
    if type(causal) is not bool:  # the full path checks it (a plan key would take 1 for True)
        return None
    try:
        key = (q.shape, q.strides, q.dtype, k_cache.shape, k_cache.strides, k_cache.dtype, v_cache.shape,
                v_cache.strides, v_cache.dtype, cache_seqlens.data.ptr, cache_seqlens.shape, cache_seqlens.strides,
                cache_seqlens.dtype,
                None if k_new is None else (k_new.shape, k_new.strides, k_new.dtype, v_new.shape, v_new.strides,
                                            v_new.dtype),
                None if page_table is None else (page_table.data.ptr, page_table.shape, page_table.strides,
                                                 page_table.dtype),
                causal, scale, num_splits, fp8_format, k_descale, v_descale,
                tuple(window_size) if isinstance(window_size, list) else window_size, softcap,
                None if sinks is None else (sinks.data.ptr, sinks.shape, sinks.strides, sinks.dtype), q.data.device_id,
                cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr)
        hash(key)
    except TypeError:  # something unhashable: the full path names it
        return None
    return key


__all__ = ["attention_with_kvcache", "append_kv"]
