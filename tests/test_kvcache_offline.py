"""The KV-cache attention without a GPU: its specializations, the split policy, offline compiles
and the NumPy reference that the GPU tests compare against."""
import concurrent.futures

import numpy as np
import pytest

from cuflash.core.compile import compile_offline
from cuflash.core.decode_spec import MAX_SPLITS, DecodeSpec
from cuflash.core.policy import all_decode_specs, decode_spec, decode_splits
from cuflash.core.render import generate
from cuflash.serving import attention_with_kvcache_reference
from cuflash import reference


def test_default_specs_cover_every_head_dim_and_fit():
    specs = all_decode_specs("sm90a")
    assert {s.head_dim for s in specs} == set(range(8, 257, 8))
    assert {(s.cache_dtype, s.paged) for s in specs} >= {("bf16", False), ("e4m3", True), ("e5m2", False)}
    for spec in specs:
        assert spec.smem_bytes <= 232448 and spec.num_stages >= 2
        assert spec.block_n % (16 * (4 // spec.warps_m)) == 0
        # the splits' merge reuses the ring for a weight per row and split, and one flag
        assert spec.smem_row_shift - spec.smem_stages >= 4 * (spec.block_m * MAX_SPLITS + 1)
    assert len({s.name for s in specs}) == len(specs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(head_dim=12), "head_dim=12"),
    (dict(dtype="fp32"), "dtype='fp32'"),
    (dict(cache_dtype="fp16"), "cache_dtype='fp16' with dtype='bf16'"),
    (dict(cache_dtype="e4m3", head_dim=72), "multiples of 16"),
    (dict(warps_m=3), "warps_m=3"),
    (dict(block_n=48), "block_n=48"),
    (dict(num_stages=1), "num_stages=1"),
    (dict(num_stages=8, block_n=128, head_dim=256), "shared memory"),
    (dict(varlen=True, paged=True), "varlen specs"),
])
def test_invalid_specs_are_named(kwargs, match):
    base = dict(head_dim=128, dtype="bf16", cache_dtype="bf16", paged=False, warps_m=1, block_n=64, num_stages=3,
                arch="sm90a")
    with pytest.raises(ValueError, match=match):
        DecodeSpec(**{**base, **kwargs})


def test_split_policy():
    # enough blocks without splits: none
    assert decode_splits(512, 128, 132) == 1 and decode_splits(200, 128, 132) == 1
    # one sequence of 8 kv heads: one wave of two blocks per multiprocessor
    assert decode_splits(8, 2048, 132) == 33 and decode_splits(64, 1024, 132) == 4
    # short sequences keep at least 4 key tiles per split
    assert decode_splits(8, 8, 132) == 2
    assert decode_splits(8, 3, 132) == 1
    # one block per multiprocessor for a contiguous cache and one row group (decode; FP8 at head
    # dim 128, whose codes go straight into the fragments), two else
    from cuflash.core.policy import decode_blocks_per_sm
    assert decode_splits(8, 2048, 132, per_sm=1) == 16
    assert decode_blocks_per_sm(decode_spec(128, "bf16", "bf16", False, 4, "sm90a")) == 1
    assert decode_blocks_per_sm(decode_spec(128, "bf16", "e4m3", False, 4, "sm90a")) == 1
    assert decode_blocks_per_sm(decode_spec(64, "bf16", "e4m3", False, 4, "sm90a")) == 2
    for cache, paged, rows in (("e4m3", True, 4), ("bf16", True, 4), ("bf16", False, 64)):
        assert decode_blocks_per_sm(decode_spec(128, "bf16", cache, paged, rows, "sm90a")) == 2
    # a memory of 3800 GB/s (H200) or more: FP8 caches at two, 16-bit ones as before
    for gbs, fp8 in ((3352, 1), (3800, 2), (4800, 2)):
        assert decode_blocks_per_sm(decode_spec(128, "bf16", "e4m3", False, 4, "sm90a"), gbs) == fp8
        assert decode_blocks_per_sm(decode_spec(128, "bf16", "bf16", False, 4, "sm90a"), gbs) == 1


def test_large_split_partials_are_merged_by_the_merge_kernel():
    from cuflash.core.policy import decode_merge_apart
    wide, narrow = decode_spec(128, "bf16", "bf16", False, 64, "sm90a"), decode_spec(128, "bf16", "bf16", False, 4, "sm90a")
    assert decode_merge_apart(wide, 64, 33) and decode_merge_apart(wide, 64 * 8, 9)  # 1 MB, 288 KB per row tile
    assert not decode_merge_apart(wide, 64 * 8, 8)      # 256 KB per row tile: the last split merges
    assert not decode_merge_apart(narrow, 4, 128)       # 4 rows of 128 splits: 256 KB
    assert not decode_merge_apart(wide, 64, 1)          # no splits, nothing to merge


def test_memory_bandwidth_from_the_runtime(monkeypatch):
    """The FP8 split policy's memory bandwidth: twice the memory clock times the bus width (an
    H100's 2619 MHz over 5120 bits: 3352 GB/s), or 0 where the runtime cannot say."""
    cupy = pytest.importorskip("cupy")
    from cuflash.core import launch

    attributes = {36: 2619000, 37: 5120}
    monkeypatch.setattr(cupy.cuda.runtime, "deviceGetAttribute", lambda attr, device: attributes[attr])
    launch._memory_bandwidth_gbs.cache_clear()
    assert round(launch._memory_bandwidth_gbs(2)) == 3352
    del attributes[36]
    launch._memory_bandwidth_gbs.cache_clear()
    assert launch._memory_bandwidth_gbs(2) == 0

    def fails(attr, device):
        raise cupy.cuda.runtime.CUDARuntimeError(1)
    monkeypatch.setattr(cupy.cuda.runtime, "deviceGetAttribute", fails)
    launch._memory_bandwidth_gbs.cache_clear()
    assert launch._memory_bandwidth_gbs(2) == 0
    launch._memory_bandwidth_gbs.cache_clear()


def _report(spec):
    r = compile_offline(spec)
    return spec.name, r.registers, r.spills


_SAMPLE = [decode_spec(d, t, c, paged, rows, arch) for arch in ("sm80", "sm90a")
           for d, t, c, paged, rows in ((64, "bf16", "bf16", False, 16), (72, "fp16", "fp16", True, 32),
                                        (128, "bf16", "bf16", True, 16), (128, "bf16", "bf16", False, 64),
                                        (128, "bf16", "e4m3", True, 16), (128, "fp16", "e5m2", False, 32),
                                        (128, "bf16", "e4m3", False, 64),
                                        (256, "bf16", "bf16", True, 64), (256, "bf16", "e4m3", False, 16),
                                        (96, "bf16", "bf16", True, 32))]
_SAMPLE += [decode_spec(d, t, t, False, 64, "sm90a", varlen=True) for d, t in ((64, "bf16"), (128, "fp16"), (256, "bf16"))]


def test_sample_of_specs_compiles_without_spills():
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(_report, _SAMPLE))
    spilled = [(name, regs) for name, regs, spills in reports if spills]
    assert not spilled, spilled
    assert all(regs <= 255 for _, regs, _ in reports)


def test_sources_name_their_kernels():
    spec = decode_spec(128, "bf16", "e4m3", True, 16, "sm90a")
    source = generate(spec)
    for name in spec.kernel_names:
        assert f" {name}(" in source
    assert "kFp8Cvt = true" in source and "kPaged = true" in source


def _cache(rng, batch, capacity, heads_k, head_dim, page_size=None):
    k = rng.standard_normal((batch, capacity, heads_k, head_dim))
    v = rng.standard_normal((batch, capacity, heads_k, head_dim))
    if page_size is None:
        return k, v, None
    pages = batch * capacity // page_size
    order = rng.permutation(pages)
    kp, vp = np.empty((pages, page_size, heads_k, head_dim)), np.empty((pages, page_size, heads_k, head_dim))
    kp[order], vp[order] = (x.reshape(pages, page_size, heads_k, head_dim) for x in (k, v))
    return kp, vp, order.reshape(batch, capacity // page_size).astype(np.int32)


@pytest.mark.parametrize("page_size", [None, 4])
def test_reference_is_per_sequence_attention_after_the_append(page_size):
    rng = np.random.default_rng(1)
    k, v, table = _cache(rng, 2, 16, 2, 8, page_size)
    q = rng.standard_normal((2, 3, 4, 8))
    kn, vn = rng.standard_normal((2, 2, 2, 8)), rng.standard_normal((2, 2, 2, 8))
    lens = np.array([5, 14])
    out, lse, k2, v2 = attention_with_kvcache_reference(q, k, v, lens, k_new=kn, v_new=vn, page_table=table)
    dense_k, _, _ = _cache(np.random.default_rng(1), 2, 16, 2, 8)   # the same draws, contiguous
    for b, n in enumerate(lens):
        keys = np.concatenate([dense_k[b, :n], kn[b]])[None]
        vals = []
        for j in range(n):
            page, row = (table[b, j // page_size], j % page_size) if table is not None else (b, j)
            vals.append(v[page, row])
        values = np.concatenate([np.stack(vals), vn[b]])[None]
        want, want_lse = reference.attention_reference(q[b:b + 1], keys, values, causal=True, layout="bshd")
        assert np.allclose(out[b], want[0]) and np.allclose(lse[b], want_lse[0])
    assert not np.shares_memory(k2, k) and np.array_equal(k, _cache(np.random.default_rng(1), 2, 16, 2, 8, page_size)[0])


def test_reference_marks_overfull_and_negative_lengths_nan():
    rng = np.random.default_rng(2)
    k, v, _ = _cache(rng, 3, 8, 1, 8)
    q = rng.standard_normal((3, 1, 2, 8))
    kn = rng.standard_normal((3, 2, 1, 8))
    out, lse, k2, _ = attention_with_kvcache_reference(q, k, v, np.array([6, 7, -1]), k_new=kn, v_new=kn)
    assert np.isfinite(out[0]).all() and np.isnan(out[1:]).all() and np.isnan(lse[1:]).all()
    assert np.array_equal(k2[1], k[1]) and np.array_equal(k2[0, 6:8], kn[0])
