"""Serving helpers: combining partial attention results.

Attention over a union of key sets is a weighted combination of the attentions over its parts,
each weighted by its share of the softmax's denominator: with ``(O_i, LSE_i)`` the output and
natural-log LSE of part i,

    LSE = log(sum_i exp(LSE_i)),    O = sum_i exp(LSE_i - LSE) * O_i.

:func:`merge_states` computes that for a shared prefix attended once and each request's own
suffix, for a cascade, or for the pieces of a key range split across calls. It works on NumPy and
CuPy arrays alike (with the arrays' own module), in float32.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .fp8 import _xp

LAYOUTS = ("bhsd", "bshd")


def merge_states(outs: Sequence, lses: Sequence, *, layout: str = "bhsd"):
    """Merge partial attention results over disjoint key sets into the attention over their union.

    Args:
        outs: two or more outputs of the same query rows, each [batch, heads, seqlen_q, head_dim]
            (``layout="bshd"``: [batch, seqlen_q, heads, head_dim]), all of one dtype (float16,
            bfloat16 or float32), as :func:`cuflash.attention` returns them.
        lses: their natural-log LSEs, float32 [batch, heads, seqlen_q] (``return_lse=True``);
            ``-inf`` for a row that attended nothing in that part.
        layout: the outputs' layout.

    Returns:
        ``(out, lse)``: the output in the inputs' dtype and layout, and the float32 LSE. A row that
        attends nothing in every part gives 0 and ``-inf``; a NaN in one part's row stays in that row.
    """
    if isinstance(outs, (str, bytes)) or isinstance(lses, (str, bytes)) or not isinstance(outs, Sequence) \
            or not isinstance(lses, Sequence):
        raise TypeError(f"outs and lses must be sequences of arrays, got {type(outs).__name__} and "
                        f"{type(lses).__name__}")
    for name, items in (("outs", outs), ("lses", lses)):
        for i, x in enumerate(items):
            if not (hasattr(x, "shape") and hasattr(x, "dtype")):
                raise TypeError(f"{name}[{i}] must be a NumPy or CuPy array, got {type(x).__name__}")
    if len(outs) != len(lses) or len(outs) < 2:
        raise ValueError(f"merge_states takes two or more (out, lse) pairs; got {len(outs)} outputs and "
                         f"{len(lses)} LSEs")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; use 'bhsd' or 'bshd'")
    xp = _xp(outs[0])
    first = outs[0]
    if getattr(first, "ndim", None) != 4:
        raise ValueError(f"outs[0] must be 4-d ({layout}), got shape {getattr(first, 'shape', None)}")
    b, s1, s2, _ = first.shape
    rows = (b, s1, s2) if layout == "bhsd" else (b, s2, s1)
    for i, (out, lse) in enumerate(zip(outs, lses)):
        if _xp(out) is not xp or _xp(lse) is not xp:
            raise TypeError(f"outs[{i}] and lses[{i}] must be arrays of the same module as outs[0] ({xp.__name__})")
        if out.shape != first.shape or out.dtype != first.dtype:
            raise ValueError(f"outs[{i}] is {out.dtype} {out.shape}; outs[0] is {first.dtype} {first.shape}")
        if lse.shape != rows or lse.dtype != xp.float32:
            raise ValueError(f"lses[{i}] must be float32 {rows} (batch, heads, seqlen_q); got {lse.dtype} {lse.shape}")
    if str(first.dtype) not in ("float16", "bfloat16", "float32"):
        raise TypeError(f"outs have dtype {first.dtype}; merge_states takes float16, bfloat16 or float32 outputs")

    f32 = xp.float32
    stacked = xp.stack(list(lses))                                   # [parts, batch, heads, seqlen_q]
    top = stacked.max(axis=0)
    # Rows with no key in any part keep a finite pivot, so that exp(-inf - pivot) is exactly 0.
    pivot = xp.where(top == -xp.inf, f32(0), top)
    weights = xp.exp(stacked - pivot)
    total = weights.sum(axis=0)
    empty = total == 0
    lse = xp.where(empty, f32(-xp.inf), pivot + xp.log(xp.where(empty, f32(1), total))).astype(f32)
    shares = xp.where(empty, f32(0), weights / xp.where(empty, f32(1), total)).astype(f32)
    if layout == "bshd":
        shares = shares.transpose(0, 1, 3, 2)                        # [parts, batch, seqlen_q, heads]
    out = xp.zeros(first.shape, dtype=f32)
    for part, share in zip(outs, shares):
        # A part with no weight in a row adds nothing there (never 0 * NaN of a row it did not attend).
        contribution = share[..., None] * part.astype(f32)
        out += xp.where(share[..., None] == 0, f32(0), contribution)
    return out.astype(first.dtype), lse


def attention_with_kvcache_reference(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, page_table=None,
                                     causal=True, scale=None, window_size=(-1, -1), softcap=0.0, fp8_format=None,
                                     k_descale=None, v_descale=None, sinks=None, score_mod=None, mask_mod=None,
                                     rotary_cos=None, rotary_sin=None, rotary_interleaved=False, cache_batch_idx=None,
                                     cu_seqlens_q=None, cache_leftpad=None, naive=False):
    """What :func:`cuflash.attention_with_kvcache` computes, on NumPy arrays (CuPy arrays are
    copied to the host): the new keys appended to copies of the caches, then each sequence's
    attention over its keys, in float64 (``naive=True``: :func:`cuflash.reference.attention_naive`
    in q's precision, the FP8 cache's values rounded to it).

    Returns ``(out, lse, k_cache, v_cache)``: the output in q's layout [batch, seqlen_q, heads,
    head_dim], the LSE [batch, heads, seqlen_q], and the caches after the append (codes for an
    FP8 cache). A sequence whose length passes the capacity gets NaN rows and no new keys.
    ``score_mod`` and ``mask_mod`` (functions or traced graphs) are evaluated on index grids with
    ``b`` the sequence and ``q_idx`` the query's position after the sequence's keys (``length -
    seqlen_q + i``, length counting the new keys), as the kernel reads them; the mask and-ed with
    causal and the window; a softcap takes no score_mod beside it (ValueError). The rotary tables rotate
    the new keys as the call does (in float32) and q in float64 (``naive``: as the call does).
    ``cu_seqlens_q``: q packed [total_q, heads, head_dim] by these offsets (no new keys); the
    output is packed likewise and the LSE is [heads, total_q], NaN where no sequence covers a row.
    ``cache_leftpad``: sequence b's keys start at row ``cache_leftpad[b]`` of a contiguous cache,
    positions counted from there (a pad outside [0, length] gives NaN rows)."""
    import numpy as np

    from . import fp8, reference
    from . import mods as _mods
    from .problems import to_numpy

    q = to_numpy(q)
    k_cache, v_cache = to_numpy(k_cache).copy(), to_numpy(v_cache).copy()
    packed = cu_seqlens_q is not None
    if packed and (k_new is not None or rotary_cos is not None):
        raise ValueError("packed queries (cu_seqlens_q) take no k_new and no rotary tables")
    starts = to_numpy(cu_seqlens_q).astype(np.int64) if packed else None
    batch = starts.size - 1 if packed else q.shape[0]
    lens = np.broadcast_to(np.asarray(to_numpy(cache_seqlens), dtype=np.int64), (batch,))
    if cache_leftpad is not None and (page_table is not None or cache_batch_idx is not None):
        raise ValueError("cache_leftpad applies to contiguous caches, not with page_table or cache_batch_idx")
    pads = np.zeros(batch, np.int64) if cache_leftpad is None else to_numpy(cache_leftpad).astype(np.int64)
    if cache_batch_idx is not None:  # one page of max_seqlen keys per sequence
        page_table = to_numpy(cache_batch_idx).reshape(-1, 1)
    table = None if page_table is None else to_numpy(page_table).astype(np.int64)
    heads, head_dim = q.shape[-2:]
    page_size = k_cache.shape[1]
    capacity = page_size * (table.shape[1] if table is not None else 1)
    seqlen_new = 0 if k_new is None else k_new.shape[1]
    k_new = None if k_new is None else to_numpy(k_new)
    v_new = None if v_new is None else to_numpy(v_new)
    if rotary_cos is not None or rotary_sin is not None:
        from .core import rotary

        tables = (to_numpy(rotary_cos), to_numpy(rotary_sin), rotary_interleaved)
        # the new keys as the call writes them (float32, rounded to the cache's dtype); q in float64
        positions = lens - pads  # counted from each sequence's first key
        q_rotated = rotary.apply(np, q, k_new, positions, capacity, causal, window_size, *tables,
                                 *((np.float32, None) if naive else (np.float64, np.float64)))[0]
        k_new = rotary.apply(np, q, k_new, positions, capacity, causal, window_size, *tables)[1]
        q = q_rotated

    def where(b, j):
        j = np.asarray(j)
        return (table[b, j // page_size], j % page_size) if table is not None else (np.full_like(j, b), j)

    def values(codes, descale):
        """[keys, heads_k, head_dim] codes or values -> float64 values."""
        if fp8_format is None:
            return codes.astype(np.float64)
        factor = np.ones(1) if descale is None else np.asarray(to_numpy(descale), dtype=np.float64).reshape(-1)
        return fp8.from_fp8_bits(codes.view(np.uint8), fp8_format).astype(np.float64) * factor[None, :, None]

    if softcap and score_mod is not None:
        raise ValueError(f"softcap={softcap} and score_mod were both given; put the cap into the score_mod "
                         f"(cuflash.mods.softcap shows how)")
    out_dtype = np.float64 if not naive else q.dtype
    out = np.full(q.shape, np.nan) if packed else np.zeros(q.shape, dtype=np.float64)
    lse = np.full((heads, q.shape[0]), np.nan) if packed else np.zeros((batch, heads, q.shape[1]), dtype=np.float64)
    for b in range(batch):
        rows = slice(starts[b], starts[b + 1]) if packed else b
        qb = q[None, rows] if packed else q[b:b + 1]  # [1, seqlen_q, heads, head_dim]
        seqlen_q = qb.shape[1]
        old, pad = int(lens[b]), int(pads[b])
        if old < 0 or old + seqlen_new > capacity or not 0 <= pad <= old:
            if packed:
                out[rows], lse[:, rows] = np.nan, np.nan
            else:
                out[b], lse[b] = np.nan, np.nan
            continue
        if seqlen_new:
            page, row = where(b, np.arange(old, old + seqlen_new))
            k_cache[page, row], v_cache[page, row] = k_new[b], v_new[b]
        page, row = where(b, np.arange(pad, old + seqlen_new))
        ks = values(k_cache[page, row], k_descale)[None], values(v_cache[page, row], v_descale)[None]
        offset = old + seqlen_new - pad - seqlen_q  # the position of query 0
        window = _window_mask(window_size, causal, offset)
        mods = dict(score_mod=_mods.softcap(softcap) if softcap else None, mask_mod=window,
                    sinks=None if sinks is None else to_numpy(sinks))
        if score_mod is not None:
            mods["score_mod"] = _mods._rebased(score_mod, "score", b, offset)
        if mask_mod is not None:
            mods["mask_mod"] = _mods._rebased(mask_mod, "mask", b, offset, also=window)
        if naive:
            kk, vv = (x.astype(q.dtype) for x in ks)
            o, l = reference.attention_naive(qb, kk, vv, causal=causal, scale=scale, layout="bshd", **mods)
        else:
            o, l = reference.attention_reference(qb, *ks, causal=causal, scale=scale, layout="bshd", **mods)
        if packed:
            out[rows], lse[:, rows] = o[0], l[0]
        else:
            out[b], lse[b] = o[0], l[0]
    return out.astype(out_dtype), lse.astype(np.float32 if naive else np.float64), k_cache, v_cache


def attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None,
                               window_size=(-1, -1), softcap=0.0, sinks=None, score_mod=None, mask_mod=None,
                               naive=False):
    """What :func:`cuflash.attention_varlen` computes, on NumPy arrays (CuPy arrays are copied to
    the host): each packed sequence's attention over its own keys, in float64 (``naive=True``:
    :func:`cuflash.reference.attention_naive` in q's precision). ``score_mod`` and ``mask_mod``
    see ``b`` the sequence's index and ``q_idx`` / ``kv_idx`` positions within it, from 0.

    Returns ``(out, lse)``: [total_q, heads, head_dim] and [heads, total_q]; rows that no
    sequence covers are NaN, a row with no key 0 (LSE -inf)."""
    import numpy as np

    from . import mods as _mods
    from . import reference
    from .problems import to_numpy

    q, k, v = to_numpy(q), to_numpy(k), to_numpy(v)
    starts_q, starts_k = (to_numpy(x).astype(np.int64) for x in (cu_seqlens_q, cu_seqlens_k))
    if starts_q.shape != starts_k.shape or starts_q.ndim != 1:
        raise ValueError(f"cu_seqlens_q {starts_q.shape} and cu_seqlens_k {starts_k.shape} must be [batch + 1] each")
    fn = reference.attention_naive if naive else reference.attention_reference
    out = np.full(q.shape, np.nan)
    lse = np.full((q.shape[1], q.shape[0]), np.nan)
    for b in range(starts_q.size - 1):
        qs, ks = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        if qs.stop <= qs.start:
            continue
        mods = dict(sinks=None if sinks is None else to_numpy(sinks), window_size=window_size, softcap=softcap,
                    score_mod=None if score_mod is None else _mods._rebased(score_mod, "score", b),
                    mask_mod=None if mask_mod is None else _mods._rebased(mask_mod, "mask", b))
        o, l = fn(q[None, qs], k[None, ks], v[None, ks], causal=causal, scale=scale, layout="bshd", **mods)
        out[qs], lse[:, qs] = o[0], l[0]
    return out.astype(q.dtype if naive else np.float64), lse.astype(np.float32 if naive else np.float64)


def _window_mask(window_size, causal, offset):
    """The mask_mod of a sliding window for queries at positions q_idx + offset, or None."""
    from . import mods as _mods

    left, right = window_size
    return _mods._window_size_mask(left, -1 if causal else right, offset)


def _case_problems(case) -> list[str]:
    """What is wrong with a serving case's dtype, head dim, heads and variants (empty if nothing)."""
    from .core import dtypes
    from .core.spec import HEAD_DIMS
    from .core.validate import validate_variants

    problems = []
    if case.dtype not in ("fp16", "bf16") or dtypes.from_tag(case.dtype).tag != case.dtype:
        problems.append(f"dtype={case.dtype!r} (fp16 or bf16)")
    if case.head_dim not in HEAD_DIMS:
        problems.append(f"head_dim={case.head_dim} (multiples of 8 from 8 to 256)")
    if min(case.heads, case.heads_k) < 1 or case.heads % case.heads_k:
        problems.append(f"heads={case.heads}, heads_k={case.heads_k}: at least 1 each, heads a multiple of heads_k")
    try:
        validate_variants(case.window_size, case.softcap, case.causal)
    except (TypeError, ValueError) as exc:
        problems.append(str(exc))
    return problems


def _variant_parts(case) -> list[str]:
    """The name parts of a serving case's mask and variants."""
    parts = ["causal"] if case.causal else []
    if case.window_size != (-1, -1):
        parts.append("window{},{}".format(*case.window_size))
    if case.softcap:
        parts.append(f"softcap{case.softcap:g}")
    return parts


@dataclass(frozen=True)
class KVCacheAttentionProblem:
    """One :func:`cuflash.attention_with_kvcache` case for tests and fuzzing: the sizes, each
    sequence's keys in its cache, the new keys, the page size and the variants.

    ``lengths[b]``: the keys sequence b's cache holds before the call (with ``packed_counts``:
    all its keys, its queries' own included). ``seqlen_q`` queries per sequence, or with
    ``packed_counts`` that many per sequence, packed by ``cu_seqlens_q``. ``page_size`` None is a
    contiguous cache of ``capacity`` keys per sequence; else pages in shuffled order with spare
    pages among them."""

    batch: int
    heads: int
    heads_k: int
    head_dim: int
    dtype: str                  # "fp16" or "bf16"
    lengths: tuple
    capacity: int               # keys one sequence's cache holds
    seqlen_q: int = 1
    seqlen_new: int = 0         # keys appended by the call (k_new, v_new)
    page_size: int | None = None
    causal: bool = True
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    num_splits: int | None = None
    packed_counts: tuple | None = None
    leftpads: tuple | None = None  # each sequence's first key (cache_leftpad; contiguous caches)
    fp8_format: str | None = None  # a cache of FP8 codes ("e4m3" / "e5m2"), values codes * descale
    descale: float = 1.0           # k_descale and v_descale of an FP8 cache

    def __post_init__(self):
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        if self.leftpads is not None:
            object.__setattr__(self, "leftpads", tuple(int(n) for n in self.leftpads))
        object.__setattr__(self, "window_size", tuple(self.window_size))
        if self.packed_counts is not None:
            object.__setattr__(self, "packed_counts", tuple(int(n) for n in self.packed_counts))
        problems = _case_problems(self)
        if self.batch < 1:
            problems.append(f"batch={self.batch} must be at least 1")
        if len(self.lengths) != self.batch or any(not 0 <= n <= self.capacity - self.seqlen_new for n in self.lengths):
            problems.append(f"lengths={self.lengths}: one per sequence, from 0 to capacity={self.capacity} - "
                            f"seqlen_new={self.seqlen_new}")
        if self.page_size is not None and (self.page_size < 1 or self.capacity % self.page_size):
            problems.append(f"page_size={self.page_size} must divide capacity={self.capacity}")
        if self.packed_counts is not None and (len(self.packed_counts) != self.batch or self.seqlen_new
                                               or min(self.packed_counts, default=0) < 0):
            problems.append(f"packed_counts={self.packed_counts}: one count per sequence, and no new keys")
        if self.leftpads is not None and (self.page_size is not None or len(self.leftpads) != self.batch
                                          or any(not 0 <= p <= n for p, n in zip(self.leftpads, self.lengths))):
            problems.append(f"leftpads={self.leftpads}: one per sequence from 0 to its length, contiguous caches")
        if self.fp8_format is not None and (self.fp8_format not in ("e4m3", "e5m2") or self.head_dim % 16
                                            or not self.descale > 0):
            problems.append(f"fp8_format={self.fp8_format!r} (e4m3 or e5m2) takes head dims that are multiples of 16 "
                            f"and a positive descale, got head_dim={self.head_dim}, descale={self.descale}")
        if problems:
            raise ValueError("invalid KV-cache problem: " + "; ".join(problems))

    @property
    def name(self) -> str:
        """A short readable label, e.g. ``bf16 hd128 b3 h8/2 sq4 new4 page16 causal``."""
        queries = f"packed{list(self.packed_counts)}" if self.packed_counts is not None else f"sq{self.seqlen_q}"
        parts = [self.dtype, f"hd{self.head_dim}", f"b{self.batch}", f"h{self.heads}/{self.heads_k}", queries,
                 f"lens{list(self.lengths)}"]
        if self.seqlen_new:
            parts.append(f"new{self.seqlen_new}")
        parts.append(f"page{self.page_size}" if self.page_size else f"cap{self.capacity}")
        parts += _variant_parts(self)
        if self.num_splits is not None:
            parts.append(f"splits{self.num_splits}")
        if self.leftpads is not None:
            parts.append(f"leftpads{list(self.leftpads)}")
        if self.fp8_format is not None:
            parts.append(f"{self.fp8_format}x{self.descale:g}")
        return " ".join(parts)

    def make_inputs(self, xp=None, seed: int | None = None) -> dict:
        """The call's arrays on ``xp`` (default NumPy): q, k_cache, v_cache, cache_seqlens (int32),
        page_table, k_new, v_new and cu_seqlens_q (None where unused), N(0, 1) values in the
        problem's dtype (an FP8 cache's keys: codes of values / descale), and cache_leftpad (None
        where unused). Cache rows past each length, before its left pad, and the spare pages hold
        NaN: a kernel that reads them shows it."""
        import numpy as np

        from .core import dtypes

        xp = np if xp is None else xp
        rng = np.random.default_rng(seed)
        dtype = dtypes.DTYPES[self.dtype].numpy
        kv = (self.heads_k, self.head_dim)
        draw = lambda *shape: rng.standard_normal(shape, dtype=np.float32).astype(dtype)  # noqa: E731
        counts = self.packed_counts
        q = draw(sum(counts), self.heads, self.head_dim) if counts is not None else \
            draw(self.batch, self.seqlen_q, self.heads, self.head_dim)
        if self.fp8_format is not None:  # codes of N(0, 1) values / descale; 0x7F is NaN in both formats
            from . import fp8

            draw = lambda *shape: fp8.to_fp8_bits(  # noqa: E731
                rng.standard_normal(shape, dtype=np.float32) / self.descale, self.fp8_format)
            dtype = np.dtype(np.uint8)
        empty = np.uint8(0x7F) if self.fp8_format is not None else np.nan
        table = None
        if self.page_size is None:
            caches = [np.full((self.batch, self.capacity) + kv, empty).astype(dtype) for _ in range(2)]
        else:
            per_seq = self.capacity // self.page_size
            pages = self.batch * per_seq + 3
            table = rng.permutation(pages)[:self.batch * per_seq].reshape(self.batch, per_seq).astype(np.int32)
            caches = [np.full((pages, self.page_size) + kv, empty).astype(dtype) for _ in range(2)]
        pads = self.leftpads or (0,) * self.batch
        for b, n in enumerate(self.lengths):
            keys = np.arange(pads[b], n)
            where = (b, keys) if table is None else (table[b, keys // self.page_size], keys % self.page_size)
            for cache in caches:
                cache[where] = draw(keys.size, *kv)
        new = [draw(self.batch, self.seqlen_new, *kv) for _ in range(2)] if self.seqlen_new else [None, None]
        offsets = None if counts is None else np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        arrays = dict(q=q, k_cache=caches[0], v_cache=caches[1], cache_seqlens=np.asarray(self.lengths, np.int32),
                      page_table=table, k_new=new[0], v_new=new[1], cu_seqlens_q=offsets,
                      cache_leftpad=None if self.leftpads is None else np.asarray(self.leftpads, np.int32))
        return {name: None if x is None else xp.asarray(x) for name, x in arrays.items()}

    def call_kwargs(self, inputs: dict) -> dict:
        """The keywords of :func:`cuflash.attention_with_kvcache` beside q and the caches."""
        kwargs = {name: inputs[name] for name in ("cache_seqlens", "page_table", "k_new", "v_new", "cu_seqlens_q",
                                                  "cache_leftpad")}
        if self.packed_counts is not None:
            kwargs["max_seqlen_q"] = max(self.packed_counts, default=0)
        return dict(kwargs, causal=self.causal, window_size=self.window_size, softcap=self.softcap,
                    num_splits=self.num_splits, **self._fp8_kwargs())

    def _fp8_kwargs(self) -> dict:
        if self.fp8_format is None:
            return {}
        return dict(fp8_format=self.fp8_format, k_descale=self.descale, v_descale=self.descale)

    def _reference(self, inputs: dict, naive: bool):
        args = {name: inputs[name] for name in ("page_table", "k_new", "v_new", "cu_seqlens_q", "cache_leftpad")}
        return attention_with_kvcache_reference(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                                                inputs["cache_seqlens"], causal=self.causal,
                                                window_size=self.window_size, softcap=self.softcap, naive=naive,
                                                **args, **self._fp8_kwargs())

    def reference(self, inputs: dict):
        """float64 ``(out, lse, k_cache, v_cache)`` of :func:`attention_with_kvcache_reference`."""
        return self._reference(inputs, naive=False)

    def naive(self, inputs: dict):
        """The same in the inputs' precision: the accuracy baseline."""
        return self._reference(inputs, naive=True)


@dataclass(frozen=True)
class VarlenAttentionProblem:
    """One :func:`cuflash.attention_varlen` case for tests and fuzzing: packed sequences of
    ``lengths_q[b]`` queries and ``lengths_k[b]`` keys each (empty ones included), heads, dtype
    and variants; its inputs, the call's keywords, and the float64 references of the forward and
    of the gradients."""

    heads: int
    heads_k: int
    head_dim: int
    dtype: str                  # "fp16" or "bf16"
    lengths_q: tuple
    lengths_k: tuple
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0

    def __post_init__(self):
        for name in ("lengths_q", "lengths_k", "window_size"):
            object.__setattr__(self, name, tuple(int(n) for n in getattr(self, name)))
        problems = _case_problems(self)
        if len(self.lengths_q) != len(self.lengths_k) or min(self.lengths_q + self.lengths_k, default=0) < 0:
            problems.append(f"lengths_q={self.lengths_q} and lengths_k={self.lengths_k}: one non-negative count "
                            f"per sequence each")
        if problems:
            raise ValueError("invalid varlen problem: " + "; ".join(problems))

    @property
    def name(self) -> str:
        """A short readable label, e.g. ``bf16 hd128 h8/2 q[0, 17] k[5, 40] causal``."""
        parts = [self.dtype, f"hd{self.head_dim}", f"h{self.heads}/{self.heads_k}", f"q{list(self.lengths_q)}",
                 f"k{list(self.lengths_k)}", *_variant_parts(self)]
        return " ".join(parts)

    def make_inputs(self, xp=None, seed: int | None = None) -> dict:
        """q, k, v (N(0, 1) in the problem's dtype, packed) and the int32 offsets cu_seqlens_q and
        cu_seqlens_k on ``xp`` (default NumPy)."""
        import numpy as np

        from .core import dtypes

        xp = np if xp is None else xp
        rng = np.random.default_rng(seed)
        dtype = dtypes.DTYPES[self.dtype].numpy
        draw = lambda *shape: rng.standard_normal(shape, dtype=np.float32).astype(dtype)  # noqa: E731
        total_q, total_k = sum(self.lengths_q), sum(self.lengths_k)
        arrays = dict(q=draw(total_q, self.heads, self.head_dim), k=draw(total_k, self.heads_k, self.head_dim),
                      v=draw(total_k, self.heads_k, self.head_dim))
        for name, lengths in (("cu_seqlens_q", self.lengths_q), ("cu_seqlens_k", self.lengths_k)):
            arrays[name] = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
        return {name: xp.asarray(x) for name, x in arrays.items()}

    def call_kwargs(self) -> dict:
        """The keywords of :func:`cuflash.attention_varlen` (and its backward) beside the arrays."""
        return dict(max_seqlen_q=max(self.lengths_q, default=0), max_seqlen_k=max(self.lengths_k, default=0),
                    causal=self.causal, window_size=self.window_size, softcap=self.softcap)

    def _arrays(self, inputs):
        return tuple(inputs[name] for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))

    def reference(self, inputs: dict):
        """float64 ``(out, lse)`` of :func:`attention_varlen_reference`."""
        return attention_varlen_reference(*self._arrays(inputs), causal=self.causal, window_size=self.window_size,
                                          softcap=self.softcap)

    def naive(self, inputs: dict):
        """The same in the inputs' precision: the accuracy baseline."""
        return attention_varlen_reference(*self._arrays(inputs), causal=self.causal, window_size=self.window_size,
                                          softcap=self.softcap, naive=True)

    def make_dout(self, xp=None, seed: int | None = None):
        """A random N(0, 1) output gradient shaped like the packed q."""
        import numpy as np

        from .core import dtypes

        rng = np.random.default_rng(None if seed is None else seed + 1)
        shape = (sum(self.lengths_q), self.heads, self.head_dim)
        dout = rng.standard_normal(shape, dtype=np.float32).astype(dtypes.DTYPES[self.dtype].numpy)
        return dout if xp is None else xp.asarray(dout)

    def backward_reference(self, dout, inputs: dict, naive: bool = False):
        """``(dq, dk, dv)`` packed, each sequence's :func:`cuflash.reference.attention_backward_reference`
        (``naive``: ``attention_backward_naive``, the baseline); keys of a sequence with no
        queries get zero gradients."""
        import numpy as np

        from . import reference
        from .problems import to_numpy

        dout = to_numpy(dout)
        q, k, v, cu_q, cu_k = (to_numpy(x) for x in self._arrays(inputs))
        fn = reference.attention_backward_naive if naive else reference.attention_backward_reference
        grads = [np.zeros(x.shape, dtype=x.dtype if naive else np.float64) for x in (q, k, v)]
        for b in range(len(self.lengths_q)):
            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            if qs.stop == qs.start:
                continue
            parts = fn(dout[None, qs], q[None, qs], k[None, ks], v[None, ks], causal=self.causal, layout="bshd",
                       window_size=self.window_size, softcap=self.softcap)
            for grad, part, rows in zip(grads, parts, (qs, ks, ks)):
                grad[rows] = part[0]
        return tuple(grads)


__all__ = ["merge_states", "attention_with_kvcache_reference", "attention_varlen_reference",
           "KVCacheAttentionProblem", "VarlenAttentionProblem"]
