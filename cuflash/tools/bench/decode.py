"""``python -m cuflash bench --mode decode`` / ``--mode varlen``: the serving calls.

Decode: KV-cache attention at the memory-bandwidth limit.

One query token (or a few) per sequence against a long cache, bf16, 32 query heads over 8 kv heads,
head dim 128. The figure of merit is bandwidth: the K and V bytes of the cache's attended keys
over the time. Timed in the same interleaved rounds: cuflash on a contiguous cache, on paged caches
(pages 16 and 256, shuffled), on an e4m3 cache (tokens per second against bf16), with 4 and 16
query tokens, with the queries packed by offsets (unsplit, and split as the padded call is), and
torch SDPA's cuDNN and flash backends on the contiguous cache where torch is importable. Also the host time of one small decode call beside torch SDPA's.
"""
from __future__ import annotations

from . import timing
from .peers import to_torch

#: (batch, keys per sequence) of the decode rows.
DECODE_SHAPES = ((64, 8192), (8, 65536), (1, 131072))
HEADS, HEADS_K, HEAD_DIM = 32, 8, 128


def _caches(cupy, batch, keys, page_size, rng, dtype):
    shape = (batch, keys, HEADS_K, HEAD_DIM)
    k = cupy.random.standard_normal(shape, dtype=cupy.float32).astype(dtype)
    v = cupy.random.standard_normal(shape, dtype=cupy.float32).astype(dtype)
    if page_size is None:
        return k, v, None
    pages = batch * keys // page_size
    order = rng.permutation(pages).astype("int32")
    table = cupy.asarray(order.reshape(batch, keys // page_size))
    paged = []
    for x in (k, v):
        flat = x.reshape(pages, page_size, HEADS_K, HEAD_DIM)
        out = cupy.empty_like(flat)
        out[cupy.asarray(order)] = flat   # page order[i] holds the i-th page of the sequences
        paged.append(out)
    return paged[0], paged[1], table


def decode_rows(torch=None, reps: int = 30, echo=print) -> list[dict]:
    """Time the decode configurations; one dict per (shape, variant) with GB/s and ratios."""
    import numpy as np
    import cupy

    import cuflash
    from cuflash.core.dtypes import from_tag

    bf16 = from_tag("bf16").numpy
    rng = np.random.default_rng(0)
    rows = []
    for batch, keys in DECODE_SHAPES:
        lens = cupy.full(batch, keys, dtype=cupy.int32)
        kv_bytes = 2 * batch * keys * HEADS_K * HEAD_DIM * 2
        k, v, _ = _caches(cupy, batch, keys, None, rng, bf16)
        calls, bytes_of = {}, {}
        queries = {n: cupy.random.standard_normal((batch, n, HEADS, HEAD_DIM), dtype=cupy.float32).astype(bf16)
                   for n in (1, 4, 16)}
        for n, q in queries.items():
            calls[f"cuflash q{n}"] = (lambda q=q: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens))
            bytes_of[f"cuflash q{n}"] = kv_bytes
        # the q1 problem with its queries packed by offsets (cu_seqlens_q): unsplit, and split as q1 is
        from cuflash import kvcache as _kvcache
        calls["cuflash q1"]()
        q1_splits = next(reversed(_kvcache._plans.values())).splits
        packed_q = queries[1].reshape(batch, HEADS, HEAD_DIM)
        offsets = cupy.arange(batch + 1, dtype=cupy.int32)
        for name, splits in (("cuflash packed q1", None), ("cuflash packed q1 split", q1_splits)):
            calls[name] = (lambda splits=splits: cuflash.attention_with_kvcache(
                packed_q, k, v, cache_seqlens=lens, cu_seqlens_q=offsets, max_seqlen_q=1, num_splits=splits))
            bytes_of[name] = kv_bytes
        paged = {}
        for page in (16, 256):
            pk, pv, table = paged[page] = _caches(cupy, batch, keys, page, rng, bf16)
            calls[f"cuflash paged {page}"] = (lambda pk=pk, pv=pv, table=table: cuflash.attention_with_kvcache(
                queries[1], pk, pv, cache_seqlens=lens, page_table=table))
            bytes_of[f"cuflash paged {page}"] = kv_bytes
        k8, v8 = (cupy.random.randint(0, 0x7E, size=k.shape, dtype=cupy.uint8) for _ in range(2))
        calls["cuflash e4m3"] = lambda: cuflash.attention_with_kvcache(queries[1], k8, v8, cache_seqlens=lens,
                                                                       fp8_format="e4m3")
        bytes_of["cuflash e4m3"] = kv_bytes // 2
        if torch is not None:
            qt = to_torch(queries[1]).transpose(1, 2)             # [batch, heads, 1, head_dim]
            kt, vt = (to_torch(x).transpose(1, 2) for x in (k, v))
            for name, backend in (("torch SDPA cuDNN", "CUDNN_ATTENTION"), ("torch SDPA flash", "FLASH_ATTENTION")):
                def peer(backend=getattr(torch.nn.attention.SDPBackend, backend)):
                    with torch.nn.attention.sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                calls[name] = peer
                bytes_of[name] = kv_bytes
        timers = {name: timing.event_timer(timing.cuda_event_times_ms, fn, flush_l2=True) for name, fn in calls.items()}
        timed = timing.interleaved_median_ms(timers, reps)
        base = timed.get("cuflash q1")
        cudnn = timed.get("torch SDPA cuDNN")
        for name, ms in timed.items():
            row = dict(batch=batch, keys=keys, variant=name, ms=None, gbps=None, error=None)
            if isinstance(ms, Exception):
                row["error"] = f"{type(ms).__name__}: {str(ms).splitlines()[0] if str(ms) else ''}"
            else:
                row.update(ms=ms, gbps=bytes_of[name] / ms / 1e6)
                if isinstance(base, float):
                    row["time_vs_q1"] = base / ms
                if isinstance(cudnn, float):
                    row["vs_cudnn"] = cudnn / ms
            rows.append(row)
            echo(format_decode_row(row))
        del calls, timers, k, v, paged, k8, v8, queries
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def format_decode_row(row: dict) -> str:
    head = f"decode b={row['batch']} keys={row['keys']} {row['variant']:<23}"
    if row["error"]:
        return f"{head} error: {row['error']}"
    extra = "".join(f"  {key}={row[key]:.2f}" for key in ("time_vs_q1", "vs_cudnn") if key in row)
    return f"{head} {row['ms'] * 1e3:9.1f} us {row['gbps']:7.0f} GB/s{extra}"


def decode_overhead(torch=None, calls: int = 2000) -> dict:
    """Host time per call of a small decode (batch 1, one token, 256 cached keys)."""
    import cupy

    import cuflash

    q = cupy.ones((1, 1, HEADS, HEAD_DIM), dtype=cupy.float16)
    k = cupy.ones((1, 256, HEADS_K, HEAD_DIM), dtype=cupy.float16)
    lens = cupy.full(1, 256, dtype=cupy.int32)
    us = {"cuflash.attention_with_kvcache": timing.host_overhead_us(
        lambda: cuflash.attention_with_kvcache(q, k, k, cache_seqlens=lens), calls=calls)}
    if torch is not None:
        qt, kt = to_torch(q).transpose(1, 2), to_torch(k).transpose(1, 2)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        try:
            us["torch SDPA"] = timing.host_overhead_us(lambda: sdpa(qt, kt, kt, enable_gqa=True), calls=calls)
        except Exception:
            us["torch SDPA"] = None
    return us


#: Varlen: tokens in all, their lengths' range, heads (hidden 2048) and head dim; the sliding
#: window of the window rows (window_size=(VARLEN_WINDOW - 1, 0)).
VARLEN_TOKENS, VARLEN_LENGTHS, VARLEN_HEADS, VARLEN_HEAD_DIM = 16384, (100, 4000), 16, 128
VARLEN_WINDOW = 1024


def window_pairs(n: int, window: int) -> int:
    """(query, key) pairs a causal window of ``window`` keys (the query's own included) attends
    in one sequence of n tokens."""
    full = min(n, window)
    return full * (full + 1) // 2 + (n - full) * window


def varlen_lengths(rng, total=VARLEN_TOKENS, lengths=VARLEN_LENGTHS) -> list[int]:
    """Random sequence lengths in ``lengths`` that add up to ``total`` (the last one trimmed, and
    dropped if that leaves it shorter than the range's low end)."""
    out, left = [], total
    while left >= lengths[0]:
        n = min(left, int(rng.integers(lengths[0], lengths[1] + 1)))
        out.append(n)
        left -= n
    return out


def varlen_rows(reps: int = 30, echo=print, seed: int = 0) -> list[dict]:
    """cuflash.attention_varlen, causal, on VARLEN_TOKENS tokens in sequences of random lengths,
    against cuflash.attention on a dense batch of the mean length, and the same for the backward
    (sequence by sequence, and in one launch on Hopper); both passes with a sliding window of
    VARLEN_WINDOW keys too, against the dense batch with that window; TFLOP/s over attended pairs
    (the backward counted as 2.5 forwards)."""
    import numpy as np
    import cupy

    import cuflash
    from cuflash.core.dtypes import from_tag
    from cuflash.reference import attention_flops

    bf16 = from_tag("bf16").numpy
    rng = np.random.default_rng(seed)
    lens = varlen_lengths(rng)
    total = sum(lens)
    q, k, v, dout = (cupy.random.standard_normal((total, VARLEN_HEADS, VARLEN_HEAD_DIM),
                                                 dtype=cupy.float32).astype(bf16) for _ in range(4))
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    mean = total // len(lens)
    dense = [cupy.random.standard_normal((len(lens), mean, VARLEN_HEADS, VARLEN_HEAD_DIM),
                                         dtype=cupy.float32).astype(bf16) for _ in range(4)]
    out, lse = cuflash.attention_varlen(q, k, v, cu, cu, max_seqlen_q=max(lens), causal=True, return_lse=True)
    dense_out, dense_lse = cuflash.attention(*dense[:3], causal=True, layout="bshd", return_lse=True)
    window = dict(causal=True, window_size=(VARLEN_WINDOW - 1, 0))
    maxima = dict(max_seqlen_q=max(lens), max_seqlen_k=max(lens))  # the one launch reads no offsets on the host
    w_out, w_lse = cuflash.attention_varlen(q, k, v, cu, cu, max_seqlen_q=max(lens), return_lse=True, **window)
    wd_out, wd_lse = cuflash.attention(*dense[:3], layout="bshd", return_lse=True, **window)
    calls = {
        "cuflash varlen": lambda: cuflash.attention_varlen(q, k, v, cu, cu, max_seqlen_q=max(lens), causal=True),
        "cuflash dense, mean length": lambda: cuflash.attention(*dense[:3], causal=True, layout="bshd"),
        "backward varlen, per sequence": lambda: cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu,
                                                                                   causal=True, family="sequences"),
        "backward varlen, one launch": lambda: cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu,
                                                                                 causal=True, family="wgmma", **maxima),
        "backward varlen, host offsets": lambda: cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu,
                                                                                   causal=True, family="wgmma"),
        "backward dense, mean length": lambda: cuflash.attention_backward(dense[3], *dense[:3], dense_out, dense_lse,
                                                                          causal=True, layout="bshd"),
        "window varlen": lambda: cuflash.attention_varlen(q, k, v, cu, cu, max_seqlen_q=max(lens), **window),
        "window dense, mean length": lambda: cuflash.attention(*dense[:3], layout="bshd", **window),
        "backward window varlen": lambda: cuflash.attention_varlen_backward(dout, q, k, v, w_out, w_lse, cu, cu,
                                                                            **window, **maxima),
        "backward window dense": lambda: cuflash.attention_backward(dense[3], *dense[:3], wd_out, wd_lse,
                                                                    layout="bshd", **window),
    }
    varlen = sum(attention_flops(1, VARLEN_HEADS, n, n, VARLEN_HEAD_DIM, True) for n in lens)
    dense_flops = attention_flops(len(lens), VARLEN_HEADS, mean, mean, VARLEN_HEAD_DIM, True)
    flops = {"cuflash varlen": varlen, "cuflash dense, mean length": dense_flops,
             "backward varlen, per sequence": 2.5 * varlen, "backward varlen, one launch": 2.5 * varlen,
             "backward varlen, host offsets": 2.5 * varlen,
             "backward dense, mean length": 2.5 * dense_flops}
    pair_flops = 4 * VARLEN_HEADS * VARLEN_HEAD_DIM
    flops["window varlen"] = pair_flops * sum(window_pairs(n, VARLEN_WINDOW) for n in lens)
    flops["window dense, mean length"] = pair_flops * len(lens) * window_pairs(mean, VARLEN_WINDOW)
    flops["backward window varlen"] = 2.5 * flops["window varlen"]
    flops["backward window dense"] = 2.5 * flops["window dense, mean length"]
    base_of = {name: ("backward " if name.startswith("backward") else "cuflash ") + "dense, mean length"
               for name in calls}
    base_of.update({"window varlen": "window dense, mean length", "backward window varlen": "backward window dense",
                    "window dense, mean length": "window dense, mean length",
                    "backward window dense": "backward window dense"})
    timers = {name: timing.event_timer(timing.cuda_event_times_ms, fn, flush_l2=True) for name, fn in calls.items()}
    timed = timing.interleaved_median_ms(timers, reps)
    rows = []
    for name, ms in timed.items():
        row = dict(variant=name, sequences=len(lens), tokens=total, ms=None, tflops=None, error=None)
        if isinstance(ms, Exception):
            row["error"] = f"{type(ms).__name__}: {str(ms).splitlines()[0] if str(ms) else ''}"
        else:
            row.update(ms=ms, tflops=flops[name] / ms / 1e9)
        rows.append(row)
    by_name = {row["variant"]: row for row in rows}
    for row in rows:
        base = by_name[base_of[row["variant"]]]["tflops"]
        if row["tflops"] and base:
            row["vs_dense"] = row["tflops"] / base
        head = f"varlen {row['sequences']} sequences, {row['tokens']} tokens, {row['variant']:<30}"
        echo(f"{head} error: {row['error']}" if row["error"] else
             f"{head} {row['ms']:8.3f} ms {row['tflops']:6.0f} TFLOP/s" +
             (f"  vs_dense={row['vs_dense']:.2f}" if "vs_dense" in row else ""))
    return rows
