"""A few decode steps over a paged KV cache with ALiBi (a score_mod reading a slopes array) and a
StreamingLLM mask (the first 4 keys and the last 256), checked against the float64 reference.

Needs a CUDA GPU: python examples/serving_decode.py
"""
import cupy
import numpy as np

import cuflash
from cuflash.serving import attention_with_kvcache_reference
from cuflash.testing import assert_attention_close

batch, heads, heads_k, head_dim, page_size, max_pages = 4, 32, 8, 128, 16, 64
rng = np.random.default_rng(0)
slopes = cupy.asarray([2.0 ** -(8 * (i + 1) / heads) for i in range(heads)], dtype=cupy.float32)


def alibi(score, b, h, q_idx, kv_idx):  # q_idx: the query's position in its sequence
    return score - slopes[h] * (q_idx - kv_idx)


def streaming(b, h, q_idx, kv_idx):
    return (kv_idx < 4) | (q_idx - kv_idx < 256)


pages = rng.permutation(batch * max_pages).reshape(batch, max_pages).astype(np.int32)
shape = (batch * max_pages, page_size, heads_k, head_dim)
k_cache = cupy.asarray(rng.standard_normal(shape), dtype=cupy.float16)
v_cache = cupy.asarray(rng.standard_normal(shape), dtype=cupy.float16)
lens = cupy.asarray([100, 400, 7, 900], dtype=cupy.int32)
page_table = cupy.asarray(pages)
for step in range(3):
    q = cupy.asarray(rng.standard_normal((batch, 1, heads, head_dim)), dtype=cupy.float16)
    k_new, v_new = (cupy.asarray(rng.standard_normal((batch, 1, heads_k, head_dim)), dtype=cupy.float16)
                    for _ in range(2))
    before = (k_cache.get(), v_cache.get())  # for the reference, which appends to copies
    out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new, v_new=v_new,
                                              page_table=page_table, return_lse=True, score_mod=alibi,
                                              mask_mod=streaming)
    kwargs = dict(k_new=k_new, v_new=v_new, page_table=pages, score_mod=alibi, mask_mod=streaming)
    ref, ref_lse, _, _ = attention_with_kvcache_reference(q, *before, lens, **kwargs)
    naive, naive_lse, _, _ = attention_with_kvcache_reference(q, *before, lens, naive=True, **kwargs)
    assert_attention_close(out, ref, "fp16", baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)
    print(f"step {step}: lengths {lens.get().tolist()} match the reference")
    lens += 1  # the caller moves the lengths forward (the kernel appended at lens[b])
