"""Block sparsity of a mask_mod: which (query tile, key tile) pairs a kernel must visit.

:func:`block_mask` evaluates a mask_mod on every tile and classifies it as empty (no pair is
allowed: skipped), full (every pair is allowed: no element mask) or partial (the mask_mod runs
element-wise). The result, a :class:`BlockMask`, holds per query tile the key tiles to visit in
ascending order, and the transpose (per key tile, the query tiles) that a key-outer backward
walks. It is reusable across calls and steps with the same shape and tiles. Batch and head
dimensions of 1 broadcast: a mask_mod that reads neither ``b`` nor ``h`` is classified once.

The classification runs on the host in NumPy, one row of query tiles at a time (arrays the mask
captures are copied to the host once).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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

    @property
    def sparsity(self) -> float:
        """The share of tiles skipped."""
        return float(np.mean(self.kind == EMPTY)) if self.kind.size else 0.0

    def dense(self) -> np.ndarray:
        """The tile kinds broadcast to [batch, heads, q_tiles, k_tiles]."""
        batch, heads = self.shape[:2]
        return np.broadcast_to(self.kind, (batch, heads) + self.kind.shape[2:])


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
               block_n: int = 128) -> BlockMask:
    """Classify every (query tile, key tile) of a mask_mod (a function or its traced graph).

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (see :mod:`cuflash.mods`).
        batch, heads, seqlen_q, seqlen_k: the problem it masks (heads: query heads).
        block_m, block_n: the tiles (positive multiples of 16); a kernel with smaller tiles that
            divide these visits every tile of a visited block.

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
    arrays = [np.asarray(a.get() if hasattr(a, "get") else a) for a in graph.arrays]
    b_count = batch if _reads(graph, "b") else min(batch, 1)
    h_count = heads if _reads(graph, "h") else min(heads, 1)
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
    kv_counts, kv_indices = _lists(kind)
    q_counts, q_indices = _lists(np.swapaxes(kind, 2, 3))
    return BlockMask((batch, heads, seqlen_q, seqlen_k), block_m, block_n, kind, kv_counts, kv_indices, q_counts,
                     q_indices, graph.digest)


__all__ = ["BlockMask", "block_mask", "EMPTY", "PARTIAL", "FULL"]
