"""Block sparsity of a mask_mod: which (query tile, key tile) pairs a kernel must visit.

:func:`block_mask` evaluates a mask_mod on every tile and classifies it as empty (no pair is
allowed: skipped), full (every pair is allowed: no element mask) or partial (the mask_mod runs
element-wise). The result, a :class:`BlockMask`, holds per query tile the key tiles to visit in
ascending order, and the transpose (per key tile, the query tiles) that a key-outer backward
walks. It is reusable across calls and steps with the same shape and tiles. Batch and head
dimensions of 1 broadcast: a mask_mod that reads neither ``b`` nor ``h`` is classified once.

The classification runs on the GPU (a kernel generated from the mask, one block per tile) when
the arrays the mask captures are CuPy arrays, else on the host in NumPy, one row of query tiles
at a time.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from .core import modset as _modset
from .core import trace as _trace

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class BlockMask:
    """The tiles of a mask_mod over [batch, heads, seqlen_q, seqlen_k] in tiles of block_m query
    rows and block_n keys. ``kind`` is int8 [b, h, q_tiles, k_tiles] (b and h are 1 where the mask
    reads neither): EMPTY, PARTIAL or FULL. ``kv_counts`` [b, h, q_tiles] and ``kv_indices``
    [b, h, q_tiles, k_tiles] list each query tile's tiles to visit first (ascending; -1 after the
    count); ``q_counts`` / ``q_indices`` the same per key tile."""

    shape: tuple
    block_m: int
    block_n: int
    kind: np.ndarray
    kv_counts: np.ndarray
    kv_indices: np.ndarray
    q_counts: np.ndarray
    q_indices: np.ndarray
    digest: str
    graph: object = None      # the traced mask_mod, which the kernels run on partial tiles
    _tables: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def sparsity(self) -> float:
        """The share of tiles skipped."""
        return float(np.mean(self.kind == EMPTY)) if self.kind.size else 0.0

    def dense(self) -> np.ndarray:
        """The tile kinds broadcast to [batch, heads, q_tiles, k_tiles]."""
        batch, heads = self.shape[:2]
        return np.broadcast_to(self.kind, (batch, heads) + self.kind.shape[2:])


def mask_mod_of(block_mask, mask_mod, problem):
    """The mask_mod of a call with a block mask: the mask's own, or the call's when it traces to
    the same graph; the mask must have been made for the call's batch, heads and lengths."""
    if block_mask is None:
        return mask_mod
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cuflash.BlockMask (cuflash.block_mask), got {type(block_mask).__name__}")
    shape = (problem.batch, problem.heads, problem.seqlen_q, problem.seqlen_k)
    if tuple(block_mask.shape) != shape:
        raise ValueError(f"block_mask was made for (batch, heads, seqlen_q, seqlen_k)={tuple(block_mask.shape)}; "
                         f"this call has {shape}")
    if mask_mod is None:
        return block_mask.graph
    if _modset.traced(mask_mod, "mask").digest != block_mask.digest:
        raise ValueError("mask_mod differs from the mask_mod block_mask was made from; pass one of them")
    return mask_mod


def kernel_kinds(mask: BlockMask, block_m: int, block_n: int, causal: bool) -> np.ndarray:
    """The tile kinds at a kernel's tiles (block_m x block_n), from the mask's own: a kernel tile is
    empty (full) where every mask tile it overlaps is, partial otherwise; with ``causal``, tiles
    whose first key lies past every row's diagonal (bottom-right aligned) are empty."""
    seqlen_q, seqlen_k = mask.shape[2:]
    q_tiles, k_tiles = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    rows0 = np.arange(q_tiles) * block_m // mask.block_m
    rows1 = -(-np.minimum((np.arange(q_tiles) + 1) * block_m, seqlen_q) // mask.block_m)
    cols0 = np.arange(k_tiles) * block_n // mask.block_n
    cols1 = -(-np.minimum((np.arange(k_tiles) + 1) * block_n, seqlen_k) // mask.block_n)

    def counts(flags):  # flags summed over each kernel tile's mask tiles (2-d prefix sums)
        prefix = np.zeros(flags.shape[:2] + (flags.shape[2] + 1, flags.shape[3] + 1), np.int64)
        prefix[:, :, 1:, 1:] = flags.cumsum(2).cumsum(3)
        r0, r1, c0, c1 = rows0[:, None], rows1[:, None], cols0[None, :], cols1[None, :]
        return prefix[:, :, r1, c1] - prefix[:, :, r0, c1] - prefix[:, :, r1, c0] + prefix[:, :, r0, c0]

    total = (rows1 - rows0)[:, None] * (cols1 - cols0)[None, :]
    kind = np.ascontiguousarray(np.where(counts(mask.kind == EMPTY) == total, EMPTY,
                                         np.where(counts(mask.kind == FULL) == total, FULL, PARTIAL)), np.int8)
    if causal:
        last_row = np.minimum((np.arange(q_tiles) + 1) * block_m, seqlen_q) - 1
        past = np.arange(k_tiles)[None, :] * block_n > last_row[:, None] + seqlen_k - seqlen_q
        kind[:, :, past] = EMPTY
    return kind


def kernel_tables(mask: BlockMask, block_m: int, block_n: int, causal: bool, by_key: bool = False):
    """(counts, entries, packed, order) for a kernel with tiles block_m x block_n, made once per
    tile shape and device and kept with the mask: per query tile the count of key tiles to visit
    and the entries key tile << 1 | full, ascending (CuPy int32 [b, h, q_tiles] and [b, h, q_tiles,
    k_tiles]); ``by_key``: per key tile its query tiles, for a key-outer backward. packed: the
    kernel's BlockSparse struct (cuflash/mods.cuh); order: :func:`heaviest_first` of the counts (None
    ``by_key``)."""
    import cupy

    key = (block_m, block_n, causal, by_key, cupy.cuda.Device().id)
    found = mask._tables.get(key)
    if found is not None:
        return found
    counts, entries = host_tables(mask, block_m, block_n, causal, by_key)
    counts_d, entries_d = cupy.asarray(counts), cupy.asarray(entries)
    order_d = None if by_key else cupy.asarray(heaviest_first(counts))  # the forward's order of work
    b, h, q_tiles, k_tiles = entries.shape
    packed = struct.pack("<QQQ4qii", counts_d.data.ptr, entries_d.data.ptr, 0 if by_key else order_d.data.ptr,
                         h * q_tiles if b > 1 else 0, q_tiles if h > 1 else 0,
                         h * q_tiles * k_tiles if b > 1 else 0, q_tiles * k_tiles if h > 1 else 0, k_tiles, 0)
    found = mask._tables[key] = (counts_d, entries_d, packed, order_d)
    return found


def heaviest_first(counts: np.ndarray) -> np.ndarray:
    """Per (batch, head) row of ``counts`` (visits per tile, last axis), its tiles by falling
    count, the later tile first among equal counts (int32, the shape of counts): a forward that
    takes its tiles in this order from a shared counter ends on its lightest ones."""
    n = counts.shape[-1]
    return np.ascontiguousarray(n - 1 - np.argsort(-counts[..., ::-1], axis=-1, kind="stable"), np.int32)


def host_tables(mask: BlockMask, block_m: int, block_n: int, causal: bool, by_key: bool = False):
    """The (counts, entries) of kernel_tables on the host, in C order as the kernel reads them (the
    kinds come out of fancy indexing in another order, which cupy.asarray would keep)."""
    kind = kernel_kinds(mask, block_m, block_n, causal)  # C order
    if by_key:
        kind = np.ascontiguousarray(np.swapaxes(kind, 2, 3))
    counts, order = _lists(kind)
    full = np.take_along_axis(kind, np.maximum(order, 0), -1) == FULL
    entries = np.where(order >= 0, np.maximum(order, 0) * 2 + full, 0)
    return np.ascontiguousarray(counts, np.int32), np.ascontiguousarray(entries, np.int32)


def _reads(graph: _trace.Graph, symbol: str) -> bool:
    """Whether the graph's output depends on an index symbol."""
    seen, stack = set(), [graph.output]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        node = graph.nodes[i]
        if node.op == "sym":
            if node.args[0] == symbol:
                return True
        elif node.op == "load":
            stack.extend(node.args[1:])
        elif node.op != "const":
            stack.extend(node.args)
    return False


def _lists(kind: np.ndarray):
    """(counts, indices) of the non-empty tiles along the last axis, ascending, -1 padded."""
    visit = kind != EMPTY
    counts = visit.sum(axis=-1).astype(np.int32)
    n = kind.shape[-1]
    order = np.argsort(~visit, axis=-1, kind="stable").astype(np.int32)   # visited tiles first, in order
    indices = np.where(np.arange(n) < counts[..., None], order, -1).astype(np.int32)
    return counts, indices


def block_mask(mask_mod, batch: int, heads: int, seqlen_q: int, seqlen_k: int, *, block_m: int = 128,
               block_n: int = 128, device: str | None = None) -> BlockMask:
    """Classify every (query tile, key tile) of a mask_mod (a function or its traced graph).

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (see :mod:`cuflash.mods`).
        batch, heads, seqlen_q, seqlen_k: the problem it masks (heads: query heads).
        block_m, block_n: the tiles (positive multiples of 16); the kernels convert them to
            their own.
        device: ``"gpu"`` (a generated kernel, one block per tile; the arrays the mask captures
            must be CuPy arrays), ``"cpu"`` (NumPy), or None: the GPU when every captured array
            is a CuPy array and a device is there, else the host.

    Returns:
        A :class:`BlockMask`.
    """
    from .mods import _graph

    for name, value in (("batch", batch), ("heads", heads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name}={value!r} must be a non-negative integer")
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 16 or value % 16:
            raise ValueError(f"{name}={value!r} must be a positive multiple of 16")
    graph = _graph(mask_mod, "mask")
    b_count = batch if _reads(graph, "b") else min(batch, 1)
    h_count = heads if _reads(graph, "h") else min(heads, 1)
    if device not in (None, "gpu", "cpu"):
        raise ValueError(f"device={device!r} must be None, 'gpu' or 'cpu'")
    on_gpu = _on_gpu(graph) if device is None else device == "gpu"
    if on_gpu:
        kind = _kinds_on_gpu(graph, b_count, h_count, seqlen_q, seqlen_k, block_m, block_n)
    else:
        kind = _kinds_on_host(graph, b_count, h_count, seqlen_q, seqlen_k, block_m, block_n)
    kv_counts, kv_indices = _lists(kind)
    q_counts, q_indices = _lists(np.swapaxes(kind, 2, 3))
    return BlockMask((batch, heads, seqlen_q, seqlen_k), block_m, block_n, kind, kv_counts, kv_indices, q_counts,
                     q_indices, graph.digest, graph)


_window_masks: dict = {}
_MAX_WINDOW_MASKS = 64


def flash_mods(problem, window: tuple, softcap: float, score_mod, mask_mod, mask):
    """``(score_mod, mask_mod, block_mask)`` of a call with FlashAttention's ``window_size`` (checked
    ``(left, right)``) and ``softcap`` (a float, 0: none), beside the call's mods and block mask
    ``mask``: the cap as :func:`cuflash.mods.softcap`, the window as a mask_mod aligned
    bottom-right with its block mask, made once per shape."""
    from . import mods as _mods
    from .core.validate import variant_mods

    cap, bounds = variant_mods((window, softcap), problem.causal, score_mod,
                               mask if mask_mod is None else mask_mod)
    if cap:
        score_mod = _mods._softcap_mod(cap)
    if bounds is not None:
        left, right = bounds
        offset = problem.seqlen_k - problem.seqlen_q
        window_mod = _mods._window_size_mask(left, right, offset)
        shape = (problem.batch, problem.heads, problem.seqlen_q, problem.seqlen_k)
        key = (left, right, offset) + shape
        mask = _window_masks.get(key)
        if mask is None:
            if len(_window_masks) >= _MAX_WINDOW_MASKS:
                _window_masks.pop(next(iter(_window_masks)))
            mask = _window_masks[key] = block_mask(window_mod, *shape)
        mask_mod = window_mod
    return score_mod, mask_mod, mask


def _on_gpu(graph) -> bool:
    """Whether a mask is classified on the GPU: its captured arrays are all CuPy arrays (none
    captured: when CuPy sees a device)."""
    kinds = {type(a).__module__.split(".")[0] for a in graph.arrays}
    if kinds - {"cupy"}:
        return False
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver or no device: the host classifies
        return False


_builders: dict = {}


def _kinds_on_gpu(graph, b_count, h_count, seqlen_q, seqlen_k, block_m, block_n) -> np.ndarray:
    import cupy

    from .core import compile as _compile
    from .core import mod_codegen

    for name, array in zip(graph.array_names, graph.arrays):
        if not isinstance(array, cupy.ndarray):
            raise TypeError(f"device='gpu': the mask captures {name!r}, a {type(array).__name__}; the GPU "
                            f"classifies masks whose arrays are CuPy arrays")
    q_tiles, k_tiles = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    kind = cupy.zeros((b_count, h_count, q_tiles, k_tiles), dtype=cupy.int8)
    if kind.size:
        device = cupy.cuda.Device().id
        kernel = _builders.get((graph.digest, device))
        if kernel is None:
            source, name = mod_codegen.block_mask_source(graph)
            options = _compile.arch_options(_compile.device_arch(device))
            kernel = _builders[(graph.digest, device)] = cupy.RawModule(code=source, options=options).get_function(name)
        arrays = np.frombuffer(mod_codegen.pack_arrays(graph), dtype=np.dtype((np.void, max(len(graph.arrays), 1) * 56)))
        kernel((k_tiles, q_tiles, b_count * h_count), (256, 1, 1),
               (arrays, kind, np.int32(h_count), np.int32(seqlen_q), np.int32(seqlen_k), np.int32(block_m),
                np.int32(block_n)))
    return kind.get()


def _kinds_on_host(graph, b_count, h_count, seqlen_q, seqlen_k, block_m, block_n) -> np.ndarray:
    arrays = [np.asarray(a.get() if hasattr(a, "get") else a) for a in graph.arrays]
    q_tiles, k_tiles = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    kind = np.zeros((b_count, h_count, q_tiles, k_tiles), dtype=np.int8)
    b = np.arange(b_count)[:, None, None, None]
    h = np.arange(h_count)[None, :, None, None]
    kv = np.arange(seqlen_k)[None, None, None, :]
    pad = k_tiles * block_n - seqlen_k
    for qt in range(q_tiles):
        rows = np.arange(qt * block_m, min(seqlen_q, (qt + 1) * block_m))
        allowed = np.broadcast_to(_trace.evaluate(graph, {"b": b, "h": h, "q_idx": rows[None, None, :, None],
                                                          "kv_idx": kv}, arrays),
                                  (b_count, h_count, rows.size, seqlen_k))
        # Positions past seqlen_k count as allowed for "full" and not for "any" (tails are masked anyway).
        any_ = np.pad(allowed, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=False)
        all_ = np.pad(allowed, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=True)
        any_ = any_.reshape(b_count, h_count, rows.size, k_tiles, block_n).any(axis=(2, 4))
        all_ = all_.reshape(b_count, h_count, rows.size, k_tiles, block_n).all(axis=(2, 4))
        kind[:, :, qt] = np.where(all_ & any_, FULL, np.where(any_, PARTIAL, EMPTY))
    return kind


__all__ = ["BlockMask", "block_mask", "EMPTY", "PARTIAL", "FULL"]
