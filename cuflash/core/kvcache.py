"""KV-cache attention: validation, specialization and launch (the kernels are decode.cuh's).

The host checks everything it can see (shapes, dtypes, devices, strides, the page table's
shape); lengths and page ids stay on the device, where the kernels check them against the cache.
Nothing here reads a device value, synchronizes or compiles once a call's kernel is loaded, so
a call can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools
import math
import struct
import threading
from dataclasses import dataclass

import numpy as np

from . import dtypes, modset, policy
from .decode_spec import CACHE_DTYPES, MAX_SPLITS, DecodeSpec
from .params import DECODE_STRUCT
from .launch import _memory_bandwidth_gbs, _multiprocessors
from .spec import HEAD_DIMS, ceil_div
from .validate import GRID_YZ_MAX, aligned_for_async_copy, float32_number, real_number, validate_softcap, validate_window

_PARAMS = np.dtype((np.void, DECODE_STRUCT.size))
_LOG2E = 1.0 / math.log(2.0)
#: Before sm_89, e4m3 codes convert on chip to their value times 2^-8 (fp8_tiles.cuh); the scales
#: put it back.
_E4M3_FACTOR = 256.0


@dataclass(frozen=True)
class KVCacheProblem:
    batch: int
    seqlen_q: int
    heads: int
    heads_k: int
    head_dim: int
    dtype: dtypes.DType
    cache_dtype: str          # the queries' tag, or "e4m3" / "e5m2"
    paged: bool
    capacity: int             # keys one sequence's cache holds
    page_size: int
    num_pages: int            # pages (paged) or sequences of the cache
    seqlen_new: int
    causal: bool
    scale: float
    device_id: int
    k_strides: tuple          # bytes: (sequence or page, row, head) of k_cache
    v_strides: tuple
    window: tuple = (-1, -1)  # (left, right) keys around a query's position; -1: unbounded
    softcap: float = 0.0      # 0: none
    varlen: bool = False      # packed sequences: q [total_q, heads, d], k/v [total_k, heads_k, d]
    total_q: int = 0
    total_k: int = 0
    packed_q: bool = False    # queries packed [total_q, heads, d] by cu_seqlens_q over a cache
    leftpad: bool = False     # keys from each sequence's cache_leftpad row

    @property
    def packed(self) -> bool:
        """Whether q, the output and the LSE are packed by offsets ([heads, total_q] LSE)."""
        return self.varlen or self.packed_q

    @property
    def group(self) -> int:
        return self.heads // self.heads_k

    @property
    def rows(self) -> int:
        """Query rows per kv head: tokens times grouped heads."""
        return self.seqlen_q * self.group


def _array(cupy, name, x, ndim):
    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be a CuPy array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-d, got shape {x.shape}")
    return x


def _rows_aligned(x) -> bool:
    """16-byte copies of whole rows: a contiguous last dim, a 16-byte aligned base and strides."""
    return x.strides[-1] == x.itemsize and aligned_for_async_copy(x)


def _contiguous(x) -> bool:
    """C-contiguous with a 16-byte aligned base (what q, the output and new keys are read as)."""
    return x.flags.c_contiguous and x.data.ptr % 16 == 0


def _int32_array(cupy, name, x, shape_text, device):
    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be an int32 CuPy array {shape_text}, got {type(x).__name__}")
    if x.dtype != np.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    if x.data.device_id != device:
        raise ValueError(f"{name} is on device {x.data.device_id}, q on device {device}")
    return x


def offsets(cupy, name, x, device):
    """An int32 CuPy array [batch + 1] of packed sequences' offsets, checked (a contiguous copy
    where strided)."""
    if not isinstance(x, cupy.ndarray) or x.dtype != np.int32 or x.ndim != 1 or x.size < 1:
        raise TypeError(f"{name} must be an int32 CuPy array [batch + 1] of offsets, got "
                        f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")
    if x.data.device_id != device:
        raise ValueError(f"{name} is on device {x.data.device_id}, q on device {device}")
    return x if x.strides == (4,) else x.copy()


def leftpad(cupy, x, q, page_table, batch=None):
    """cache_leftpad checked: an int32 CuPy array [batch] (q's, or packed queries' ``batch``) on
    q's device (contiguous), for a contiguous cache."""
    if page_table is not None:
        raise ValueError("cache_leftpad applies to contiguous caches, not with page_table or cache_batch_idx")
    if not isinstance(q, cupy.ndarray) or (batch is None and q.ndim != 4):
        return x  # the call names q
    _int32_array(cupy, "cache_leftpad", x, "[batch]", q.data.device_id)
    batch = q.shape[0] if batch is None else batch
    if x.ndim != 1 or x.size != batch:
        raise ValueError(f"cache_leftpad must be int32 [batch={batch}], got shape {x.shape}")
    return cupy.ascontiguousarray(x)


def poisoned_outputs(cupy, q):
    """The output and LSE [heads, total_q], NaN until written: all-ones bytes are NaN in fp16, bf16
    and float32 (a byte memset runs at full bandwidth, unlike a 16-bit fill)."""
    out = cupy.empty(q.shape, dtype=q.dtype)
    lse = cupy.empty((q.shape[1], q.shape[0]), dtype=cupy.float32)
    for x in (out, lse):
        x.data.memset_async(0xFF, x.nbytes)
    return out, lse


def validate_kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new, v_new, page_table, causal, scale, fp8_format,
                     window_size=(-1, -1), softcap=0.0, packed=None, leftpad=False):
    """Check a call's host-visible inputs; returns (problem, q, cache_seqlens, k_new, v_new) with
    q and the new keys copied where their rows are not 16-byte copyable, and an int length
    broadcast to a device array. ``packed``: (batch, max_seqlen_q) of queries packed
    [total_q, heads, head_dim] by offsets; ``leftpad``: the call passes cache_leftpad."""
    import cupy

    q = _array(cupy, "q", q, 4 if packed is None else 3)
    k_cache = _array(cupy, "k_cache", k_cache, 4)
    v_cache = _array(cupy, "v_cache", v_cache, 4)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__module__}.{type(causal).__name__} {causal!r}")
    causal = bool(causal)
    entry = dtypes.from_numpy(q.dtype)
    if not entry.tensor_core:
        raise TypeError(f"q has dtype {q.dtype}; the KV-cache kernels take float16 or bfloat16 queries")
    batch, seqlen_q, heads, head_dim = q.shape if packed is None else (*packed, *q.shape[1:])
    if fp8_format is None:
        cache_tag = entry.tag
        if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
            raise TypeError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must have q's dtype "
                            f"({q.dtype}), or hold FP8 codes with fp8_format='e4m3' or 'e5m2'")
    else:
        if fp8_format not in ("e4m3", "e5m2"):
            raise ValueError(f"fp8_format={fp8_format!r}; use 'e4m3' or 'e5m2'")
        cache_tag = fp8_format
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if x.dtype not in (np.uint8, np.int8):
                raise TypeError(f"{name} has dtype {x.dtype}; with fp8_format={fp8_format!r} it holds 1-byte "
                                f"FP8 codes (uint8)")
    assert cache_tag in CACHE_DTYPES
    device = q.data.device_id
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.data.device_id != device:
            raise ValueError(f"{name} is on device {x.data.device_id}, q on device {device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must have the same shape")
    slots, page_size, heads_k, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim}, the cache {cache_head_dim}")
    if head_dim not in HEAD_DIMS or (fp8_format and head_dim % 16):
        raise ValueError(f"head_dim={head_dim} is not supported (multiples of {16 if fp8_format else 8} "
                         f"from {16 if fp8_format else 8} to 256)")
    if heads_k < 1 or heads % heads_k:
        raise ValueError(f"q has {heads} heads, the cache {heads_k}: heads must be a multiple of heads_k")
    if k_cache.size == 0 and batch:
        raise ValueError(f"k_cache and v_cache {k_cache.shape} are empty: a cache holds at least one key "
                         f"(or one page) per sequence")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not _rows_aligned(x):
            raise ValueError(f"{name} (strides {x.strides}, base {x.data.ptr:#x}) must have a contiguous last "
                             f"dim and 16-byte aligned rows: the kernels read and append rows in place")
    if page_table is None:
        if slots != batch:
            raise ValueError(f"k_cache holds {slots} sequences, q {batch}: without a page table the cache is "
                             f"[batch, max_seqlen, heads_k, head_dim]")
        capacity, num_pages, paged = page_size, slots, False
    else:
        _int32_array(cupy, "page_table", page_table, "[batch, max_pages]", device)
        if page_table.ndim == 2 and page_table.shape[0] == batch and page_table.shape[1] < 1:
            raise ValueError(f"page_table {page_table.shape} holds no pages: each sequence needs max_pages >= 1")
        if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.strides[1] != 4:
            raise ValueError(f"page_table must be int32 [batch={batch}, max_pages] with contiguous rows, got shape "
                             f"{page_table.shape}, strides {page_table.strides}")
        if page_table.shape[1] < 1 or slots < 1 or page_size < 1:
            raise ValueError(f"a paged cache needs pages: page_table {page_table.shape}, k_cache {k_cache.shape}")
        capacity, num_pages, paged = page_table.shape[1] * page_size, slots, True
        if capacity >= 2**31:
            raise ValueError(f"page_table {page_table.shape} x page_size {page_size} = {capacity} keys is too many")
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if abs(x.strides[0]) >= 2**31 or (page_size - 1) * abs(x.strides[1]) >= 2**31:
                raise ValueError(f"{name} (shape {x.shape}, strides {x.strides}) has pages of 2 GiB or more: a page's "
                                 f"stride and its rows must span under 2**31 bytes")
    if cache_seqlens is None:  # packed sequences (varlen): the offsets hold the lengths
        pass
    elif isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        if not 0 <= int(cache_seqlens) <= capacity:
            raise ValueError(f"cache_seqlens={int(cache_seqlens)} is outside the cache's [0, {capacity}] keys")
        cache_seqlens = cupy.full(batch, int(cache_seqlens), dtype=cupy.int32)
    else:
        _int32_array(cupy, "cache_seqlens", cache_seqlens, "[batch]", device)
        if cache_seqlens.shape != (batch,):
            raise ValueError(f"cache_seqlens must be int32 [batch={batch}], got shape {cache_seqlens.shape}")
        if cache_seqlens.strides != (4,):
            cache_seqlens = cache_seqlens.copy()
    seqlen_new = 0
    if (k_new is None) != (v_new is None):
        raise ValueError("pass k_new and v_new together, or neither")
    if k_new is not None:
        k_new = _array(cupy, "k_new", k_new, 4)
        v_new = _array(cupy, "v_new", v_new, 4)
        seqlen_new = k_new.shape[1]
        want = (batch, seqlen_new, heads_k, head_dim)
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            if x.shape != want:
                raise ValueError(f"{name} must be [batch, seqlen_new, heads_k, head_dim] = {want}, got {x.shape}")
            if x.dtype != k_cache.dtype:
                raise TypeError(f"{name} has dtype {x.dtype}; it must match the cache's {k_cache.dtype}"
                                + (" (FP8 codes, e.g. from cuflash.quantize_fp8)" if fp8_format else ""))
            if x.data.device_id != device:
                raise ValueError(f"{name} is on device {x.data.device_id}, q on device {device}")
        k_new, v_new = (x if _contiguous(x) else x.copy() for x in (k_new, v_new))
    if not _contiguous(q):
        q = q.copy()
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float32_number("scale", scale)
    if batch * heads_k >= 2**31:
        raise ValueError(f"batch x heads_k = {batch * heads_k} is too many")
    if seqlen_new and batch > GRID_YZ_MAX:  # the append kernel's grid holds the batch in z
        raise ValueError(f"batch={batch} with k_new: at most {GRID_YZ_MAX} sequences append in one call")
    problem = KVCacheProblem(batch, seqlen_q, heads, heads_k, head_dim, entry, cache_tag, paged, capacity,
                             page_size if paged else capacity, num_pages, seqlen_new, causal, float(scale), device,
                             tuple(k_cache.strides[:3]), tuple(v_cache.strides[:3]),
                             validate_window(window_size, causal), validate_softcap(softcap),
                             packed_q=packed is not None, total_q=q.shape[0] if packed is not None else 0,
                             leftpad=bool(leftpad))
    if ceil_div(problem.rows, 64) > 65535:
        raise ValueError(f"seqlen_q x heads / heads_k = {problem.rows} query rows per kv head is too many")
    return problem, q, cache_seqlens, k_new, v_new


def descale_operand(cupy, name, value, heads_k, device):
    """(factor, array, per-head) of an FP8 descale: a positive number folds into the scales; a
    float32 array of shape (), (1,) or (heads_k,) is read on the device."""
    if value is None:
        return 1.0, None, False
    if real_number(value):
        return float32_number(name, value, positive=True), None, False
    if not isinstance(value, cupy.ndarray) or value.dtype != np.float32:
        raise TypeError(f"{name} must be a positive number or a float32 CuPy array of shape () or "
                        f"(heads_k={heads_k},), got {type(value).__name__}")
    if value.shape not in ((), (1,), (heads_k,)):
        raise ValueError(f"{name} must have shape () or (heads_k={heads_k},), got {value.shape}")
    if value.data.device_id != device:
        raise ValueError(f"{name} is on device {value.data.device_id}, q on device {device}")
    value = cupy.ascontiguousarray(value).reshape(-1)
    return 1.0, value, value.size > 1


def select_spec(problem: KVCacheProblem, arch: str, mods=None) -> DecodeSpec:
    """The problem's specialization; ``mods`` (a modset.ModSet, or None) names its mods."""
    spec = _spec(problem.head_dim, problem.dtype.tag, problem.cache_dtype, problem.paged, min(problem.rows, 64), arch,
                 problem.varlen, problem.packed_q, problem.leftpad)
    return spec if mods is None else spec.replace(score_mod=mods.score_digest, mask_mod=mods.mask_digest)


def check_mods(problem: KVCacheProblem, score_mod, mask_mod) -> None:
    """Refuse a softcap beside a score_mod, as cuflash.attention does (the kernel's cap would run
    before the score_mod; the cap belongs in the score_mod)."""
    if problem.softcap and score_mod is not None:
        from .validate import variant_mods
        variant_mods(((-1, -1), problem.softcap), problem.causal, score_mod, None)


@functools.lru_cache(maxsize=1024)
def _spec(head_dim, dtype, cache_dtype, paged, rows, arch, varlen=False, packed_q=False, leftpad=False):
    return policy.decode_spec(head_dim, dtype, cache_dtype, paged, rows, arch, varlen, packed_q, leftpad)


def choose_splits(spec: DecodeSpec, problem: KVCacheProblem, num_splits) -> int:
    if problem.varlen or problem.packed_q and num_splits is None:  # packed queries split only when asked
        return 1
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) \
                or not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits={num_splits!r} must be an integer from 1 to {MAX_SPLITS} (or None)")
        return int(num_splits)
    blocks = problem.batch * problem.heads_k * ceil_div(problem.rows, spec.block_m)
    return policy.decode_splits(blocks, ceil_div(problem.capacity, spec.block_n), _multiprocessors(problem.device_id),
                                policy.decode_blocks_per_sm(spec, _memory_bandwidth_gbs(problem.device_id)))


_workspaces: dict = {}
_retired: list = []


def _workspace(cupy, size: int, key, dtype="float32"):
    """A buffer of at least `size` elements per (device, stream, dtype), kept for the process: a
    graph that captured a launch keeps pointing at it. A bigger need takes a new one and keeps the
    old. The uint32 one (the splits' counts) starts at zero, and the kernels leave it at zero."""
    key = key + (dtype,)
    buf = _workspaces.get(key)
    if buf is None or buf.size < size:
        if buf is not None:
            _retired.append(buf)
        make = cupy.zeros if dtype == "uint32" else cupy.empty
        buf = _workspaces[key] = make(max(size, 1), dtype=dtype)
    return buf


#: The pointers that open the parameter block: q, k_cache, v_cache, k_new, v_new, out, lse (the
#: partials' and the rest are the plan's).
_POINTERS = struct.Struct("<7Q")


class KVCachePlan:
    """The launches of one call shape (the caller keys plans by everything but the arrays'
    addresses): the kernels, their grids, and the parameter block with all but the first seven
    pointers filled in. Append (with new keys), then attend (the last split of each row tile to
    finish merges the splits' partials, or the merge kernel after it: merge_grid)."""

    __slots__ = ("spec", "problem", "kernels", "splits", "template", "mods", "grid", "merge_grid", "buffers",
                 "_lse_scratch", "_driver", "_stream", "spare")

    def __init__(self, kernels, spec: DecodeSpec, problem: KVCacheProblem, *, page_table, cache_seqlens, splits,
                 k_descale, v_descale, stream: int, cu_seqlens=(None, None), sinks=None, mods=None,
                 leftpad=None):
        """``mods``: the call's modset.ModSet (spec.has_mods), whose packed arrays every kernel
        takes as its second argument; kept alive with the plan."""
        import cupy

        if bool(mods) != spec.has_mods:
            raise ValueError(f"spec {spec.name} {'takes' if spec.has_mods else 'has no'} mods; the call passes "
                             f"{'none' if mods is None else 'some'}")
        self.spec, self.problem, self.kernels, self.splits = spec, problem, kernels, splits
        self.mods = b"" if mods is None else modset.kernel_argument(mods)
        self.spare = []  # the (out,) last handed out, for launch.outputs_unused
        k_factor, k_array, k_per_head = k_descale
        v_factor, v_array, v_per_head = v_descale
        per_head = k_per_head or v_per_head
        if per_head and (k_array is None or v_array is None or not (k_per_head and v_per_head)):
            ones = cupy.ones(problem.heads_k, dtype=cupy.float32)
            k_array = ones * np.float32(k_factor) if k_array is None else cupy.broadcast_to(k_array, ones.shape).copy()
            v_array = ones * np.float32(v_factor) if v_array is None else cupy.broadcast_to(v_array, ones.shape).copy()
            k_factor = v_factor = 1.0
        boost = _E4M3_FACTOR if problem.cache_dtype == "e4m3" and not spec.fp8_exact_convert else 1.0
        # the partials' query rows of one split: [batch, heads, seqlen_q], or [heads, total_q]
        rows = problem.heads * problem.total_q if problem.packed else problem.batch * problem.heads * problem.seqlen_q
        o_part = lse_part = counts = 0
        self.buffers = (page_table, cache_seqlens, leftpad, k_array, v_array, *cu_seqlens, sinks, mods)
        self.grid = (problem.batch * problem.heads_k, ceil_div(problem.rows, spec.block_m), splits)
        merge_apart = policy.decode_merge_apart(spec, problem.rows, splits)
        # the merge kernel: a block per (kv head, spec.merge_rows rows)
        self.merge_grid = (self.grid[0], min(65535, ceil_div(problem.rows, spec.merge_rows)), 1) if merge_apart else None
        if splits > 1:
            ws = _workspace(cupy, splits * rows * (problem.head_dim + 1), (problem.device_id, stream))
            o_part, lse_part = ws.data.ptr, ws.data.ptr + 4 * splits * rows * problem.head_dim
            tiles = _workspace(cupy, self.grid[0] * self.grid[1], (problem.device_id, stream), "uint32")
            counts = tiles.data.ptr
            self.buffers += (ws, tiles)
        d, h = problem.head_dim, problem.heads
        # q and out: C-contiguous bshd, or packed [total_q, heads, d] (varlen)
        q_strides = (0 if problem.packed else problem.seqlen_q * h * d, h * d, d)
        new_strides = (problem.seqlen_new * problem.heads_k * d, problem.heads_k * d, d)
        size = problem.cache_dtype in ("e4m3", "e5m2") and 1 or 2
        raw = DECODE_STRUCT.pack(
            0, 0, 0, 0, 0, 0, 0, o_part, lse_part, counts,
            page_table.data.ptr if page_table is not None else 0,
            cache_seqlens.data.ptr if cache_seqlens is not None else 0, leftpad.data.ptr if leftpad is not None else 0,
            k_array.data.ptr if k_array is not None else 0, v_array.data.ptr if v_array is not None else 0,
            *(c.data.ptr if c is not None else 0 for c in cu_seqlens), sinks.data.ptr if sinks is not None else 0,
            *q_strides, *(s // size for s in problem.k_strides), *(s // size for s in problem.v_strides),
            *new_strides, *new_strides, *q_strides,
            problem.batch, problem.heads, problem.heads_k, problem.group, problem.seqlen_q, problem.seqlen_new,
            problem.capacity, problem.page_size,
            problem.page_size.bit_length() - 1 if problem.page_size & (problem.page_size - 1) == 0 else -1,
            problem.num_pages, page_table.strides[0] // 4 if page_table is not None else 0,
            splits, int(merge_apart), 1 if per_head else 0, *problem.window, problem.softcap * _LOG2E,
            problem.scale * _LOG2E * k_factor * boost, v_factor * boost, problem.total_q, problem.total_k,
        )
        self.template = raw
        self._lse_scratch = None
        self._stream = stream
        self._driver = _driver_launcher(kernels, stream, raw, self.mods)

    @property
    def lse_scratch(self):
        """The LSE of calls that do not return it (made on first use, then reused)."""
        if self._lse_scratch is None:
            import cupy
            p = self.problem
            self._lse_scratch = cupy.empty((p.heads, p.total_q) if p.packed else (p.batch, p.heads, p.seqlen_q),
                                           dtype=cupy.float32)
        return self._lse_scratch

    def launch(self, q, k_cache, v_cache, k_new, v_new, out, lse, pointers=None) -> None:
        """Launch on the current stream with these arrays (shaped and strided as the plan's; q,
        out and the new keys C-contiguous); ``pointers``: their addresses, where the caller has
        them."""
        problem = self.problem
        if problem.batch == 0:
            return
        if pointers is None:
            pointers = (q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, k_new.data.ptr if k_new is not None else 0,
                        v_new.data.ptr if v_new is not None else 0, out.data.ptr, lse.data.ptr)
        if self._driver is not None:
            self._driver(self, pointers, bool(out.size))
            return
        raw = bytearray(self.template)
        _POINTERS.pack_into(raw, 0, *pointers)
        params = (np.frombuffer(raw, dtype=_PARAMS),)
        if self.mods:
            params += (np.frombuffer(self.mods, dtype=np.dtype((np.void, len(self.mods)))),)
        attend, append, merge = self.kernels
        if problem.seqlen_new:
            append((problem.seqlen_new, problem.heads_k, problem.batch), (128, 1, 1), params)
        if not out.size:
            return
        attend(self.grid, (self.spec.threads, 1, 1), params, shared_mem=self.spec.smem_bytes)
        if self.merge_grid:
            merge(self.merge_grid, (self.spec.threads, 1, 1), params)


def _driver_launcher(kernels, stream: int, template: bytes, mods: bytes = b""):
    """A launch of the plan's kernels straight through the driver (CuPy's binding of
    cuLaunchKernel), the parameter block, the kernels' first argument, kept for the plan and its
    pointers written per call under a lock (``mods``: the second argument, written once); None
    where that is unavailable."""
    from .launch import DriverArguments, bind_context
    try:
        from cupy.cuda import driver
        launch_kernel, error = driver.launchKernel, driver.CUDADriverError
        # CuPy's RawKernel holds the loaded function (its .kernel) once it is compiled
        attend, append, merge = (int(k.kernel.ptr) for k in kernels)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    arguments = DriverArguments([len(template), len(mods)] if mods else [len(template)])
    arguments.write(0, template)
    if mods:
        arguments.write(1, mods)
    buffer, shift, argv = arguments.buffer, arguments.shift, arguments.argv_address
    lock = threading.Lock()
    plan_launches: dict = {}  # attend_rows -> the plan's launches, made once (the spec's sizes are computed)

    def launches_of(plan, attend_rows: bool) -> tuple:
        problem = plan.problem
        launches = []
        if problem.seqlen_new:
            launches.append((append, problem.seqlen_new, problem.heads_k, problem.batch, 128, 0))
        if attend_rows:
            launches.append((attend, *plan.grid, plan.spec.threads, plan.spec.smem_bytes))
            if plan.merge_grid:
                launches.append((merge, *plan.merge_grid, plan.spec.threads, 0))
        return plan_launches.setdefault(attend_rows, tuple(launches))

    def run(plan, pointers, attend_rows: bool) -> None:
        launches = plan_launches.get(attend_rows) or launches_of(plan, attend_rows)
        with lock:  # one parameter block for every thread that launches this plan
            _POINTERS.pack_into(buffer, shift, *pointers)
            for handle, gx, gy, gz, threads, smem in launches:
                try:
                    launch_kernel(handle, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)
                except error as exc:
                    bind_context(exc)
                    launch_kernel(handle, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)
    run.arguments = arguments  # kept alive with the launcher
    return run
