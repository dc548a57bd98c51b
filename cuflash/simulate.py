"""The forward kernel's tiled online-softmax algorithm and tile walk, run in float64 NumPy on the CPU.

:func:`simulate_tiled` follows the kernels' steps (tiles, base-2 online softmax, epilogue) and is
checked against :func:`cuflash.reference.attention_reference`; :func:`tile_schedule` is the walk
over key tiles that every query tile takes, :func:`query_schedule` the backward's over query tiles.
"""
from __future__ import annotations

import numpy as np

from .reference import _LN2, _LOG2E, _expand_kv_heads, _from_bhsd, _prepare


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_blocks(block_m: int, block_n: int) -> None:
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def tile_schedule(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, causal: bool,
                  window: tuple = (-1, -1)):
    """The key tiles each query tile visits, in the kernel's order, and which need masking.

    Query tile ``m`` covers rows ``[m * block_m, (m + 1) * block_m)``. It stops at key
    ``n_end = seqlen_k``, or under the causal mask at
    ``n_end = min(seqlen_k, m0 + block_m + seqlen_k - seqlen_q)`` (one past the last key its last
    row may attend), and visits ``ceil(n_end / block_n)`` key tiles from the last down to the first,
    so the only tiles that need masking come first and the loop's tail runs mask-free.

    A key tile is masked iff it holds a key past ``seqlen_k`` or, under the causal mask, a key past
    what the tile's first row may attend: ``n0 + block_n > seqlen_k`` or
    ``causal and n0 + block_n - 1 > m0 + seqlen_k - seqlen_q``.

    ``window=(left, right)`` (the Hopper kernels' KernelSpec.local; negative: no bound): row r
    sees keys ``r + offset - left`` to ``r + offset + right``. The walk starts at the key tile of
    ``m0 + offset - left`` and ends before ``m0 + block_m + offset + right``; a tile is also
    masked when it holds a key past the first row's right bound, or before the last row's left
    bound (``n0 < m0 + block_m - 1 + offset - left``): those are the last tiles visited.

    Returns ``[(m_block, [(n_block, masked), ...]), ...]`` with one entry per query tile
    (``ceil(seqlen_q / block_m)`` of them); a query tile whose rows attend nothing has no key tiles.
    """
    _check_blocks(block_m, block_n)
    offset = seqlen_k - seqlen_q
    left, right = window
    schedule = []
    for m_block in range(_ceil_div(seqlen_q, block_m)):
        m0 = m_block * block_m
        n_end = min(seqlen_k, m0 + block_m + offset) if causal else seqlen_k
        n_begin = 0
        if right >= 0:
            n_end = min(n_end, m0 + block_m + offset + right)
        if left >= 0:
            n_begin = max(0, m0 + offset - left)
        n_first = n_begin // block_n
        n_tiles = _ceil_div(n_end, block_n) - n_first if n_end > n_begin else 0
        tiles = []
        for n_block in reversed(range(n_first, n_first + n_tiles)):
            n0 = n_block * block_n
            masked = (n0 + block_n > seqlen_k or (causal and n0 + block_n - 1 > m0 + offset)
                      or (right >= 0 and n0 + block_n - 1 > m0 + offset + right)
                      or (left >= 0 and n0 < m0 + block_m - 1 + offset - left))
            tiles.append((n_block, masked))
        schedule.append((m_block, tiles))
    return schedule


def query_schedule(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, causal: bool,
                   window: tuple = (-1, -1)):
    """The query tiles each key tile of the Hopper backward visits (its K/V-outer walk, with
    BwdSpec.local's window), first row of each: from ``m_begin``, the tile of the first row that
    sees key ``n0`` (``n0 - offset - right``, causal's right bound 0), to one past the last row
    that sees the tile's last key (``n0 + block_n - offset + left``), within ``seqlen_q``.

    Returns ``[(n_block, [m_block, ...]), ...]``, the query tiles in ascending order (the kernel
    visits them last to first).
    """
    _check_blocks(block_m, block_n)
    offset = seqlen_k - seqlen_q
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    schedule = []
    for n_block in range(_ceil_div(seqlen_k, block_n)):
        n0 = n_block * block_n
        begin, end = 0, seqlen_q
        if right >= 0:
            first = n0 - offset - right
            begin = 0 if first <= 0 else first // block_m * block_m
        if left >= 0:
            end = min(end, n0 + block_n - offset + left)
        tiles = _ceil_div(end - begin, block_m) if end > begin else 0
        schedule.append((n_block, [begin // block_m + t for t in range(tiles)]))
    return schedule


def simulate_tiled(q, k, v, *, causal: bool = False, scale: float | None = None,
                   layout: str = "bhsd", block_m: int = 128, block_n: int = 64, window: tuple = (-1, -1)):
    """The forward kernel's algorithm in float64 NumPy: tiles, online softmax in base 2, epilogue.

    Every (batch, head) pair runs the same walk from :func:`tile_schedule` (``window``: its
    ``window``, with causal's right bound 0). Q is zero-padded to a
    whole number of query tiles and K/V to whole key tiles, as the kernel's zero-filling loads do.
    Per key tile, with ``x = s * scale * log2(e)``::

        m_new = max(m_old, rowmax(x))
        m_use = 0 where m_new == -inf else m_new     # a row with nothing seen yet
        p     = exp2(x - m_use)
        alpha = exp2(m_old - m_use)
        l     = l * alpha + rowsum(p)
        acc   = acc * alpha + p @ v_tile

    Only tiles the schedule marks get the mask applied; every other tile is checked to hold no
    masked pair (RuntimeError otherwise). Epilogue: ``out = acc / l`` and
    ``lse = (m_use + log2(l)) * ln(2)``, with ``out = 0`` and ``lse = -inf`` where ``l == 0``
    (selecting on ``l == 0`` rather than ``l > 0`` lets a NaN row stay NaN).

    Shapes and layouts as in :func:`attention_reference`; returns float64 ``(out, lse)``. Meant for
    finite inputs: a NaN value row inside a visited masked tile spreads through ``0 * NaN`` here
    as it does in the kernel.
    """
    _check_blocks(block_m, block_n)
    qb, kb, vb, scale = _prepare(q, k, v, scale, layout, np.float64)
    batch, heads_q, seqlen_q, head_dim = qb.shape
    seqlen_k = kb.shape[2]
    kb, vb = _expand_kv_heads(kb, heads_q), _expand_kv_heads(vb, heads_q)
    q_rows = _ceil_div(seqlen_q, block_m) * block_m
    k_rows = max(_ceil_div(seqlen_k, block_n), 1) * block_n
    qp = np.zeros((batch, heads_q, q_rows, head_dim))
    qp[:, :, :seqlen_q] = qb
    kp = np.zeros((batch, heads_q, k_rows, head_dim))
    kp[:, :, :seqlen_k] = kb
    vp = np.zeros_like(kp)
    vp[:, :, :seqlen_k] = vb

    out = np.zeros((batch, heads_q, q_rows, head_dim))
    lse = np.full((batch, heads_q, q_rows), -np.inf)
    qk_scale = scale * _LOG2E
    offset = seqlen_k - seqlen_q
    with np.errstate(invalid="ignore", over="ignore"):
        for m_block, tiles in tile_schedule(seqlen_q, seqlen_k, block_m, block_n, causal, window):
            m0 = m_block * block_m
            rows = np.arange(m0, m0 + block_m)[:, None]
            q_tile = qp[:, :, m0:m0 + block_m]
            m_old = np.full((batch, heads_q, block_m), -np.inf)
            l_sum = np.zeros((batch, heads_q, block_m))
            acc = np.zeros((batch, heads_q, block_m, head_dim))
            for n_block, masked in tiles:
                n0 = n_block * block_n
                cols = np.arange(n0, n0 + block_n)[None, :]
                allowed = cols < seqlen_k
                if causal:
                    allowed = allowed & (cols <= rows + offset)
                if window[1] >= 0:
                    allowed = allowed & (cols <= rows + offset + window[1])
                if window[0] >= 0:
                    allowed = allowed & (cols >= rows + offset - window[0])
                # -- compute qk --
                x = (q_tile @ kp[:, :, n0:n0 + block_n].swapaxes(-1, -2)) * qk_scale
                if masked:
                    x = np.where(allowed, x, -np.inf)
                elif not allowed.all():
                    raise RuntimeError(f"tile (m={m_block}, n={n_block}) holds masked pairs but the "
                                       f"schedule runs it unmasked (seqlen_q={seqlen_q}, "
                                       f"seqlen_k={seqlen_k}, block_m={block_m}, block_n={block_n})")
                # -- online softmax --
                m_new = np.maximum(m_old, x.max(axis=-1))
                m_use = np.where(m_new == -np.inf, 0.0, m_new)
                p = np.exp2(x - m_use[..., None])
                alpha = np.exp2(m_old - m_use)
                l_sum = l_sum * alpha + p.sum(axis=-1)
                acc = acc * alpha[..., None] + p @ vp[:, :, n0:n0 + block_n]
                m_old = m_new
            # -- epilogue --
            m_use = np.where(m_old == -np.inf, 0.0, m_old)
            empty = l_sum == 0
            inv_l = np.where(empty, 0.0, 1.0 / np.where(empty, 1.0, l_sum))
            out[:, :, m0:m0 + block_m] = acc * inv_l[..., None]
            lse[:, :, m0:m0 + block_m] = np.where(
                empty, -np.inf, (m_use + np.log2(np.where(empty, 1.0, l_sum))) * _LN2)
    return _from_bhsd(out[:, :, :seqlen_q], layout), lse[:, :, :seqlen_q]
