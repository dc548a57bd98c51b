"""The KV-cache attention without a GPU: its specializations, the split policy, offline compiles
and the NumPy reference that the GPU tests compare against."""
import concurrent.futures

import numpy as np
import pytest
from hypothesis import given, settings

from cuflash.core.compile import compile_offline
from cuflash.core.decode_spec import MAX_SPLITS, DecodeSpec
from cuflash.core.policy import all_decode_specs, decode_spec, decode_splits
from cuflash.core.render import generate
from cuflash.serving import attention_with_kvcache_reference
from cuflash.testing import kvcache_problems, varlen_problems
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
# packed queries over a cache (cu_seqlens_q): paged and contiguous, 16-bit and FP8
_SAMPLE += [decode_spec(d, t, c, False, rows, "sm90a", leftpad=True)  # left-padded contiguous caches
            for d, t, c, rows in ((128, "bf16", "bf16", 16), (256, "bf16", "e4m3", 16), (64, "fp16", "fp16", 64))]
_SAMPLE += [decode_spec(d, t, c, paged, rows, arch, packed_q=True)
            for d, t, c, paged, rows, arch in ((128, "bf16", "bf16", True, 64, "sm90a"), (64, "fp16", "fp16", False, 16, "sm90a"),
                                              (128, "bf16", "e4m3", True, 32, "sm90a"), (128, "bf16", "bf16", True, 64, "sm80"))]


def test_sample_of_specs_compiles_without_spills():
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(_report, _SAMPLE))
    spilled = [(name, regs) for name, regs, spills in reports if spills]
    assert not spilled, spilled
    assert all(regs <= 255 for _, regs, _ in reports)


def _mod_digests():
    """Digests of an ALiBi score_mod (a captured [heads] array) and a window mask_mod, registered."""
    from cuflash import mods
    from cuflash.core import mod_codegen

    slopes = np.ones(8, dtype=np.float32)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def recent(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 64

    return (mod_codegen.register(mods.trace_score_mod(alibi)), mod_codegen.register(mods.trace_mask_mod(recent)))


def test_specs_with_mods_compile_without_spills():
    """The mods per score element cost registers, not spills, on Hopper (sm80's 64-row head dim
    128 tiles spill a few dozen bytes with two mods that load arrays: docs/serving.md)."""
    score, mask = _mod_digests()
    specs = [decode_spec(d, t, c, paged, rows, "sm90a").replace(score_mod=score, mask_mod=mask)
             for d, t, c, paged, rows in ((128, "bf16", "bf16", True, 16), (128, "bf16", "bf16", False, 64),
                                          (128, "bf16", "e4m3", False, 64))]
    specs.append(decode_spec(64, "fp16", "fp16", False, 32, "sm80").replace(score_mod=score))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(_report, specs))
    assert not [(name, regs) for name, regs, spills in reports if spills]
    source = generate(specs[0])
    assert all(f" {name}(const DecodeParams params, const __grid_constant__ Cfg::Mods mods)" in source
               for name in specs[0].kernel_names)
    plain = generate(decode_spec(128, "bf16", "bf16", True, 16, "sm90a"))
    assert "Mods" not in plain.split("#include \"cuflash/decode.cuh\"")[1]


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


def test_calls_with_mods_pass_their_arrays_and_keep_a_plan_per_graph(monkeypatch):
    """On the CPU stand-ins (tests/fake_device.py): a call with mods compiles a spec named by
    them, every kernel takes the mods' packed arrays as its second argument, and a plan is kept
    per traced graph (new captured arrays or a new expression: a new plan, never a stale one)."""
    cupy = pytest.importorskip("cupy")
    import fake_device

    import cuflash
    from cuflash import kvcache
    from cuflash.core import compile as _compile
    from cuflash.core import mod_codegen
    from cuflash.core.params import DECODE_STRUCT

    driver = fake_device.FakeDriver(sizes=None)
    fake_device.install(monkeypatch, cupy, driver=driver)
    kernels = tuple(fake_device.FakeKernel(ptr) for ptr in (0xA, 0xB, 0xC))  # attend, append, merge
    specs = []
    monkeypatch.setattr(_compile, "get_kernel", lambda spec, device_id: specs.append(spec) or kernels)
    kvcache._plans.clear()
    try:
        batch, seqlen_q, heads, heads_k, d, capacity = 2, 4, 8, 2, 128, 256
        q = fake_device.fake_array(cupy, (batch, seqlen_q, heads, d), np.float16, 0x1000_0000)
        k, v = (fake_device.fake_array(cupy, (batch, capacity, heads_k, d), np.float16, 0x2000_0000 + i * 0x100_0000)
                for i in range(2))
        lens = fake_device.fake_array(cupy, (batch,), np.int32, 0x3000_0000)
        slopes = fake_device.fake_array(cupy, (heads,), np.float32, 0x3100_0000)
        other_slopes = fake_device.fake_array(cupy, (heads,), np.float32, 0x3200_0000)

        def alibi_of(table):
            def alibi(score, b, h, q_idx, kv_idx):
                return score - table[h] * (q_idx - kv_idx)
            return alibi

        def recent(b, h, q_idx, kv_idx):
            return q_idx - kv_idx < 64

        def call(score_mod, mask_mod=None, **kwargs):
            driver.sizes = None
            before = len(driver.launches)
            out = cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=1, score_mod=score_mod,
                                                 mask_mod=mask_mod, **kwargs)
            assert out.shape == q.shape
            return driver.launches[before:]

        first = call(alibi_of(slopes), recent)
        spec = specs[-1]
        assert spec.has_mods and spec.score_mod and spec.mask_mod and spec.score_mod in spec.name
        plan = next(iter(kvcache._plans.values()))
        assert plan._driver is not None  # launched straight through the driver
        assert plan.mods == (mod_codegen.pack_arrays(cuflash.mods.trace_score_mod(alibi_of(slopes)))
                             + mod_codegen.pack_arrays(cuflash.mods.trace_mask_mod(recent)))
        assert int.from_bytes(plan.mods[:8], "little") == slopes.data.ptr
        # the launch reads two arguments: the parameter block and the mods' arrays
        driver.sizes = [DECODE_STRUCT.size, len(plan.mods)]
        plan.launch(q, k, v, None, None, cupy.empty(q.shape, q.dtype), plan.lse_scratch)
        (_, args), = driver.launches[-1:]
        assert args[1] == plan.mods and len(first) == 1 and first[0][0][0] == 0xA

        call(alibi_of(slopes), recent)  # the same function and arrays: the same plan, nothing compiled
        assert len(kvcache._plans) == 1 and len(specs) == 1
        call(alibi_of(other_slopes), recent)  # other arrays: the same kernel, a plan of their own
        assert len(kvcache._plans) == 2 and specs[-1].name == spec.name
        new_plan = [p for p in kvcache._plans.values() if p is not plan][0]
        assert int.from_bytes(new_plan.mods[:8], "little") == other_slopes.data.ptr
        call(None, recent)  # another expression: another spec
        assert len(kvcache._plans) == 3 and not specs[-1].score_mod and specs[-1].mask_mod == spec.mask_mod
        call(None, None)  # no mods: the kernels' one argument
        assert not specs[-1].has_mods and kvcache._plans and list(kvcache._plans.values())[-1].mods == b""
        with pytest.raises(ValueError, match="softcap=5.0 and score_mod"):
            call(alibi_of(slopes), softcap=5.0)
    finally:
        kvcache._plans.clear()
        fake_device.uninstall(cupy)


def test_reference_of_packed_queries_is_each_sequences_own():
    """cu_seqlens_q: each sequence's rows are the reference of that sequence alone (its cache row,
    its length); a sequence with fewer keys than queries leaves its first rows with no key; rows
    past the last offset stay NaN."""
    rng = np.random.default_rng(4)
    counts, lens = [1, 0, 7, 3], [30, 5, 5, 40]
    k, v = rng.standard_normal((2, 4, 48, 2, 16))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    q = rng.standard_normal((offsets[-1] + 2, 4, 16))
    out, lse, _, _ = attention_with_kvcache_reference(q, k, v, np.array(lens), cu_seqlens_q=offsets)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    for b, n in enumerate(counts):
        rows = slice(offsets[b], offsets[b + 1])
        want, want_lse, _, _ = attention_with_kvcache_reference(q[None, rows], k[b:b + 1], v[b:b + 1], np.array([lens[b]]))
        assert np.array_equal(out[rows], want[0]) and np.array_equal(lse[:, rows], want_lse[0])
    assert (lse[:, offsets[2]:offsets[2] + 2] == -np.inf).all() and np.isnan(out[-2:]).all()
    with pytest.raises(ValueError, match="no k_new"):
        attention_with_kvcache_reference(q, k, v, np.array(lens), cu_seqlens_q=offsets, k_new=k[:, :1], v_new=v[:, :1])


def test_packed_queries_launch_one_unsplit_grid_over_the_longest_sequence(monkeypatch):
    """On the CPU stand-ins (tests/fake_device.py): a call with cu_seqlens_q compiles a packed-q
    spec and launches blocks (batch x kv heads, row tiles of max_seqlen_q x group rows, 1 split
    unless num_splits asks)
    with q's packed strides, the offsets, total_q and the lengths; the call again reuses its plan,
    other offsets make another."""
    cupy = pytest.importorskip("cupy")
    import fake_device

    import cuflash
    from cuflash import kvcache
    from cuflash.core import compile as _compile
    from cuflash.core import kvcache as _kv
    from cuflash.core.params import DECODE_PARAM_FIELDS, DECODE_STRUCT

    driver = fake_device.FakeDriver(sizes=[DECODE_STRUCT.size])
    fake_device.install(monkeypatch, cupy, driver=driver)
    kernels = tuple(fake_device.FakeKernel(ptr) for ptr in (0xA, 0xB, 0xC))  # attend, append, merge
    specs = []
    monkeypatch.setattr(_compile, "get_kernel", lambda spec, device_id: specs.append(spec) or kernels)
    monkeypatch.setattr(_kv, "poisoned_outputs", lambda cupy, q: (
        cupy.empty(q.shape, q.dtype), cupy.empty((q.shape[1], q.shape[0]), cupy.float32)))
    kvcache._plans.clear()
    try:
        batch, total_q, heads, heads_k, d, pages, page_size = 3, 10, 8, 2, 128, 20, 16
        q = fake_device.fake_array(cupy, (total_q, heads, d), np.float16, 0x1000_0000)
        k, v = (fake_device.fake_array(cupy, (pages, page_size, heads_k, d), np.float16, 0x2000_0000 + i * 0x100_0000)
                for i in range(2))
        table = fake_device.fake_array(cupy, (batch, 4), np.int32, 0x3000_0000)
        lens = fake_device.fake_array(cupy, (batch,), np.int32, 0x3100_0000)
        offsets = fake_device.fake_array(cupy, (batch + 1,), np.int32, 0x3200_0000)
        out, lse = cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=offsets,
                                                  max_seqlen_q=5, return_lse=True)
        assert out.shape == q.shape and lse.shape == (heads, total_q)
        spec = specs[-1]
        assert spec.packed_q and spec.paged and "_packed" in spec.name and spec.block_m == 32  # 5 x 4 rows
        (launch, args), = driver.launches
        assert launch[0] == 0xA and launch[1] == (batch * heads_k, 1, 1)
        params = dict(zip((name for name, _, _ in DECODE_PARAM_FIELDS), DECODE_STRUCT.unpack(args[0])))
        assert params["cu_seqlens_q"] == offsets.data.ptr and params["cu_seqlens_k"] == 0
        assert params["cache_seqlens"] == lens.data.ptr and params["page_table"] == table.data.ptr
        assert (params["q_batch_stride"], params["q_row_stride"], params["q_head_stride"]) == (0, heads * d, d)
        assert (params["o_batch_stride"], params["o_row_stride"], params["o_head_stride"]) == (0, heads * d, d)
        assert params["total_q"] == total_q and params["seqlen_q"] == 5 and params["num_splits"] == 1
        assert params["lse"] == lse.data.ptr and params["q"] == q.data.ptr
        cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=offsets,
                                       max_seqlen_q=5)
        assert len(kvcache._plans) == 1 and len(specs) == 1 and len(driver.launches) == 2
        other = fake_device.fake_array(cupy, (batch + 1,), np.int32, 0x3300_0000)
        cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=other,
                                       max_seqlen_q=5)
        assert len(kvcache._plans) == 2
        (_, args), = driver.launches[-1:]
        fields = dict(zip((name for name, _, _ in DECODE_PARAM_FIELDS), DECODE_STRUCT.unpack(args[0])))
        assert fields["cu_seqlens_q"] == other.data.ptr
        # splits only when asked: [heads, total_q] partials per split
        kvcache._plans.clear()
        driver.launches.clear()
        monkeypatch.setattr(_kv, "_workspace", lambda cupy_, size, key, dtype="float32": fake_device.fake_array(
            cupy, (size,), dtype, 0x4000_0000 if dtype == "float32" else 0x4800_0000))
        cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=offsets,
                                       max_seqlen_q=5, num_splits=4)
        (launch, args), = driver.launches
        params = dict(zip((name for name, _, _ in DECODE_PARAM_FIELDS), DECODE_STRUCT.unpack(args[0])))
        assert launch[1] == (batch * heads_k, 1, 4) and params["num_splits"] == 4 and params["o_part"]
        assert params["lse_part"] - params["o_part"] == 4 * 4 * heads * total_q * d
        with pytest.raises(ValueError, match="num_splits=0"):
            cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=offsets,
                                           max_seqlen_q=5, num_splits=0)
        with pytest.raises(ValueError, match="k_new and v_new with cu_seqlens_q"):
            cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=offsets,
                                           max_seqlen_q=5, k_new=k[:batch, :1], v_new=v[:batch, :1])
    finally:
        kvcache._plans.clear()
        fake_device.uninstall(cupy)


@settings(max_examples=40)
@given(problem=kvcache_problems(variants=True, max_length=300, fp8_formats=(None, "e4m3", "e5m2")))
def test_drawn_kvcache_problems_hide_nan_where_no_call_may_read(problem):
    """Every drawn problem is valid; its caches hold NaN past each length, before each left pad and
    in spare pages, and the reference (which reads only what a sequence owns) stays finite."""
    from cuflash import fp8

    inputs = problem.make_inputs(seed=0)
    k_cache, table = inputs["k_cache"], inputs["page_table"]
    if problem.fp8_format is not None:  # the codes' values
        assert k_cache.dtype == np.uint8
        k_cache = fp8.from_fp8_bits(k_cache, problem.fp8_format)
    pads = problem.leftpads or (0,) * problem.batch
    for b, n in enumerate(problem.lengths):
        keys = np.arange(pads[b], n)
        owned = (np.full(keys.size, b), keys) if table is None else \
            (table[b, keys // problem.page_size], keys % problem.page_size)
        assert np.isfinite(k_cache[owned].astype(np.float32)).all()
    finite = int(np.isfinite(k_cache.astype(np.float32)).any(axis=(2, 3)).sum())
    assert finite == sum(problem.lengths) - sum(pads)  # nothing else holds a number
    out, lse, _, _ = problem.reference(inputs)
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    rows = sum(problem.packed_counts) if problem.packed_counts is not None else problem.batch * problem.seqlen_q
    assert out.size == rows * problem.heads * problem.head_dim


@pytest.mark.parametrize("kwargs,match", [
    (dict(lengths=(3,)), "one per sequence"),
    (dict(lengths=(3, 300)), "from 0 to capacity"),
    (dict(page_size=7), "page_size=7 must divide"),
    (dict(heads=3), "heads a multiple of heads_k"),
    (dict(dtype="fp32"), "fp16 or bf16"),
    (dict(packed_counts=(1, 2), seqlen_new=1), "no new keys"),
    (dict(window_size=(-2, 0)), "window"),
    (dict(leftpads=(1, 20)), "leftpads"),
    (dict(leftpads=(1, 2), page_size=16), "contiguous caches"),
    (dict(fp8_format="e4m3", head_dim=72), "multiples of 16"),
    (dict(fp8_format="e3m4"), "e4m3 or e5m2"),
])
def test_invalid_kvcache_problems_are_named(kwargs, match):
    from cuflash.serving import KVCacheAttentionProblem

    base = dict(batch=2, heads=4, heads_k=2, head_dim=64, dtype="bf16", lengths=(3, 10), capacity=64)
    with pytest.raises(ValueError, match=match):
        KVCacheAttentionProblem(**{**base, **kwargs})


def test_varlen_reference_is_each_sequences_own_attention():
    """cuflash.serving.attention_varlen_reference: sequence b's rows are the reference of its own
    queries and keys, its mods read at b and positions from 0; rows past the offsets NaN."""
    from cuflash.serving import attention_varlen_reference

    rng = np.random.default_rng(6)
    lens_q, lens_k = [3, 0, 5], [4, 2, 9]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    q = rng.standard_normal((cu_q[-1] + 1, 4, 16))
    k, v = rng.standard_normal((2, cu_k[-1], 2, 16))
    bias = rng.standard_normal(3)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b] * (q_idx - kv_idx)

    out, lse = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True, score_mod=score_mod)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0]) and np.isnan(out[-1]).all()
    for b in (0, 2):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])

        def own(score, b_, h, q_idx, kv_idx, b=b):
            return score + bias[b] * (q_idx - kv_idx)

        want, want_lse = reference.attention_reference(q[None, qs], k[None, ks], v[None, ks], causal=True,
                                                       layout="bshd", score_mod=own)
        assert np.allclose(out[qs], want[0]) and np.allclose(lse[:, qs], want_lse[0])
    naive, _ = attention_varlen_reference(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), cu_q,
                                          cu_k, causal=True, score_mod=score_mod, naive=True)
    assert naive.dtype == np.float16 and np.nanmax(np.abs(naive - out)) < 1e-2


@settings(max_examples=25)
@given(problem=varlen_problems(variants=True, max_seqlen=200))
def test_drawn_varlen_problems_and_their_references(problem):
    """Every drawn problem is valid and its packed inputs match its counts; the references are
    finite (a row with no key gives 0) and the keys of a sequence with no queries get no gradient."""
    inputs = problem.make_inputs(seed=0)
    assert inputs["q"].shape[0] == sum(problem.lengths_q) and inputs["k"].shape[0] == sum(problem.lengths_k)
    assert list(np.diff(inputs["cu_seqlens_q"])) == list(problem.lengths_q)
    out, lse = problem.reference(inputs)
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    dq, dk, dv = problem.backward_reference(problem.make_dout(seed=0), inputs)
    assert all(np.isfinite(g).all() for g in (dq, dk, dv))
    cu_k = inputs["cu_seqlens_k"]
    for b, n in enumerate(problem.lengths_q):
        if n == 0:
            assert not dk[cu_k[b]:cu_k[b + 1]].any() and not dv[cu_k[b]:cu_k[b + 1]].any()


def test_reference_with_left_padded_caches_counts_positions_from_the_first_key():
    """cache_leftpad: a sequence's keys are rows pad .. length (the new keys appended at length),
    its positions counted from pad: the reference of the cache without its padding rows; a pad
    outside [0, length] gives NaN rows."""
    rng = np.random.default_rng(8)
    k, v = rng.standard_normal((2, 3, 40, 2, 16))
    q = rng.standard_normal((3, 2, 4, 16))
    kn, vn = rng.standard_normal((2, 3, 2, 2, 16))
    lens, pads = np.array([10, 30, 5]), np.array([3, 0, 7])
    slopes = rng.uniform(0.1, 0.5, 4)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    out, lse, k2, _ = attention_with_kvcache_reference(q, k, v, lens, k_new=kn, v_new=vn, cache_leftpad=pads,
                                                       window_size=(6, 0), score_mod=alibi)
    for b in range(2):
        n, pad = lens[b], pads[b]
        trimmed = [c[b:b + 1, pad:] for c in (k, v)]  # the cache without its padding rows
        want, want_lse, _, _ = attention_with_kvcache_reference(q[b:b + 1], *trimmed, np.array([n - pad]),
                                                                k_new=kn[b:b + 1], v_new=vn[b:b + 1],
                                                                window_size=(6, 0), score_mod=alibi)
        assert np.allclose(out[b], want[0]) and np.allclose(lse[b], want_lse[0])
        assert np.array_equal(k2[b, n:n + 2], kn[b])  # appended at the length, as without padding
    assert np.isnan(out[2]).all() and np.isnan(lse[2]).all()  # pad 7 past length 5
    with pytest.raises(ValueError, match="contiguous caches"):
        attention_with_kvcache_reference(q, k, v, lens, cache_leftpad=pads, cache_batch_idx=np.arange(3))


def test_left_padded_calls_pass_the_pads_and_refuse_pages(monkeypatch):
    """On the CPU stand-ins: cache_leftpad's address reaches the parameter block (and the plan's
    key: other pads, another plan); with a page table, a wrong size or dtype it is refused."""
    cupy = pytest.importorskip("cupy")
    import fake_device

    import cuflash
    from cuflash import kvcache
    from cuflash.core import compile as _compile
    from cuflash.core.params import DECODE_PARAM_FIELDS, DECODE_STRUCT

    driver = fake_device.FakeDriver(sizes=[DECODE_STRUCT.size])
    fake_device.install(monkeypatch, cupy, driver=driver)
    kernels = tuple(fake_device.FakeKernel(ptr) for ptr in (0xA, 0xB, 0xC))
    specs = []
    monkeypatch.setattr(_compile, "get_kernel", lambda spec, device_id: specs.append(spec) or kernels)
    kvcache._plans.clear()
    try:
        q = fake_device.fake_array(cupy, (2, 1, 8, 64), np.float16, 0x1000_0000)
        k, v = (fake_device.fake_array(cupy, (2, 64, 2, 64), np.float16, 0x2000_0000 + i * 0x100_0000) for i in range(2))
        lens = fake_device.fake_array(cupy, (2,), np.int32, 0x3100_0000)
        pads, other = (fake_device.fake_array(cupy, (2,), np.int32, base) for base in (0x3200_0000, 0x3300_0000))
        for leftpad in (pads, pads, other):
            cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, cache_leftpad=leftpad, num_splits=1)
            (_, args), = driver.launches[-1:]
            fields = dict(zip((name for name, _, _ in DECODE_PARAM_FIELDS), DECODE_STRUCT.unpack(args[0])))
            assert fields["cache_leftpad"] == leftpad.data.ptr and fields["cache_seqlens"] == lens.data.ptr
        assert len(kvcache._plans) == 2 and specs[-1].leftpad and "_leftpad" in specs[-1].name
        cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=1)
        assert not specs[-1].leftpad
        table = fake_device.fake_array(cupy, (2, 4), np.int32, 0x3400_0000)
        with pytest.raises(ValueError, match="contiguous caches"):
            cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, cache_leftpad=pads, page_table=table)
        with pytest.raises(ValueError, match=r"cache_leftpad must be int32 \[batch=2\]"):
            cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, cache_leftpad=pads[:1])
        with pytest.raises(TypeError, match="cache_leftpad must be int32"):
            cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, cache_leftpad=pads.view(np.float32))
    finally:
        kvcache._plans.clear()
        fake_device.uninstall(cupy)


def test_append_kv_launches_one_grid_and_names_bad_arguments(monkeypatch):
    """cuflash.append_kv on the CPU stand-ins: one launch over tokens x heads_k x 16-byte chunks
    with the caches' byte strides and their slot count; wrong shapes, dtypes and slot arrays are
    named before anything launches."""
    cupy = pytest.importorskip("cupy")
    import fake_device

    import cuflash
    from cuflash import kvcache

    calls = []
    fake_device.install(monkeypatch, cupy)
    monkeypatch.setattr(kvcache, "_append_kernel", lambda cupy_, device: lambda *launch: calls.append(launch))
    try:
        k_cache, v_cache = (fake_device.fake_array(cupy, (20, 16, 2, 128), np.float16, base)
                            for base in (0x2000_0000, 0x2100_0000))
        k, v = (fake_device.fake_array(cupy, (5, 2, 128), np.float16, base) for base in (0x1000_0000, 0x1100_0000))
        slots = fake_device.fake_array(cupy, (5,), np.int32, 0x3000_0000)
        cuflash.append_kv(k_cache, v_cache, k, v, slots)
        (grid, block, args), = calls
        items = 5 * 2 * (128 * 2 // 16)
        assert grid == (-(-items // 256),) and block == (256,)
        assert [a.data.ptr for a in args[:5]] == [k.data.ptr, v.data.ptr, k_cache.data.ptr, v_cache.data.ptr,
                                                  slots.data.ptr]
        assert [int(a) for a in args[5:]] == [2, 16, 320, 16, *k_cache.strides[:3], *v_cache.strides[:3], 2 * 128 * 2,
                                              128 * 2, items]
        bad = [(dict(k=k[:, :1]), ValueError, "tokens, heads_k, head_dim"),
               (dict(v=fake_device.fake_array(cupy, (5, 2, 128), np.float32, 0x1200_0000)), TypeError, "caches' dtype"),
               (dict(slot_mapping=slots[:4]), ValueError, r"slot_mapping must be int32 \[tokens=5\]"),
               (dict(slot_mapping=slots.view(np.float32)), TypeError, "slot_mapping must be int32"),
               (dict(v_cache=v_cache[:, :8]), ValueError, "must match")]
        for change, error, match in bad:
            call = {**dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slots), **change}
            with pytest.raises(error, match=match):
                cuflash.append_kv(call["k_cache"], call["v_cache"], call["k"], call["v"], call["slot_mapping"])
        assert len(calls) == 1
    finally:
        fake_device.uninstall(cupy)
