"""Backward specs, rendering and NVRTC compile checks, and the same-precision gradient baseline:
no GPU needed (these run in CI)."""
import re

import numpy as np
import pytest

import cuflash
from cuflash.core.compile import compile_offline
from cuflash.reference import attention_backward_naive, attention_backward_reference
from cuflash.core.bwd_spec import BwdSpec
from cuflash.core.policy import all_default_bwd_specs, default_bwd_spec
from cuflash.core.spec import ARCHS, HEAD_DIMS


def test_names_and_kernel_symbols():
    spec = default_bwd_spec(128, "bf16", True, "sm80")
    assert spec.name == "bwd_bf16_hd128_causal_m64n64w4s2_sm80"
    assert spec.kernel_names == (spec.name + "_pre", spec.name + "_dkdv", spec.name + "_dq")
    assert default_bwd_spec(128, "bf16", True, "sm80", deterministic=True).name.endswith("_det_sm80")
    assert default_bwd_spec(64, "fp32", False, "sm80").deterministic  # float32 is always deterministic


def test_default_family_per_target():
    assert default_bwd_spec(128, "bf16", True, "sm90a").name == "bwd_bf16_hd128_causal_m64n128w8s2_wgmma_tma_sm90a"
    assert default_bwd_spec(64, "bf16", True, "sm90a").num_stages == 3
    assert default_bwd_spec(256, "fp16", False, "sm90a").split_head_dim
    # padded to 64 / 128 / 256 columns where that ran faster than the portable kernel (H200)
    for head_dim in (40, 72, 96, 120, 176, 192, 248):
        assert default_bwd_spec(head_dim, "bf16", True, "sm90a").family == "wgmma"
    for head_dim in (8, 32, 136, 160, 168):
        assert default_bwd_spec(head_dim, "bf16", True, "sm90a").family == "mma"
    assert default_bwd_spec(128, "bf16", True, "sm90a", family="mma").family == "mma"
    assert default_bwd_spec(128, "fp32", True, "sm90a").family == "simt"
    with pytest.raises(ValueError, match="wgmma"):
        BwdSpec(128, "bf16", False, 64, 128, 8, 2, "sm80", family="wgmma")
    with pytest.raises(ValueError, match="family='simt' does not take dtype=bf16"):
        default_bwd_spec(128, "bf16", True, "sm90a", family="simt")
    # forced elsewhere, the Hopper backward computes the next of 64 / 128 / 256 columns
    padded = default_bwd_spec(96, "bf16", True, "sm90a", family="wgmma")
    assert (padded.padded_head_dim, padded.block_n, padded.split_head_dim) == (128, 128, False)
    assert padded.name == "bwd_bf16_hd96_causal_m64n128w8s2_wgmma_tma_sm90a"
    wide = default_bwd_spec(160, "fp16", False, "sm90a", True, family="wgmma")
    assert (wide.padded_head_dim, wide.block_n, wide.split_head_dim) == (256, 64, True)
    assert default_bwd_spec(32, "bf16", False, "sm90a", family="wgmma").num_stages == 3  # 64's tiles
    source = cuflash.generate(padded)
    assert "kHeadDim = 128;" in source and "kHeadDimStored = 96;" in source and "kChunksValid = 12;" in source


@pytest.mark.parametrize("head_dim,family", [(40, None), (120, None), (176, None), (160, "wgmma")])
def test_padded_hopper_backward_compiles_without_spills(head_dim, family):
    pytest.importorskip("cupy")
    report = compile_offline(default_bwd_spec(head_dim, "bf16", True, "sm90a", family=family))
    assert not report.spills and "Potential Performance Loss" not in report.log, report.log


@pytest.mark.parametrize("arch", ARCHS)
def test_every_default_backward_spec_renders_and_fits(arch):
    specs = all_default_bwd_specs(arch)
    assert {(s.head_dim, s.dtype, s.causal) for s in specs} == {
        (d, t, c) for d in HEAD_DIMS for t in ("fp16", "bf16", "fp32") for c in (False, True)}
    for spec in specs:
        source = cuflash.generate(spec)
        for name in spec.kernel_names:  # the Hopper K/V-outer kernel takes its tensor maps too
            maps = ", const __grid_constant__ cuflash::BwdTensorMaps maps" if spec.tma_loads and "dkdv" in name else ""
            assert f"{name}(const BwdParams params{maps})" in source
        assert spec.smem_bytes <= 232448 and spec.dq_smem_bytes <= 232448


def test_warps_split_the_head_dim_of_dk_and_dv():
    assert default_bwd_spec(256, "fp16", False, "sm80").d_split == 4
    uneven = default_bwd_spec(136, "fp16", False, "sm80")
    assert uneven.d_split == 2 and uneven.split_col == 80
    assert default_bwd_spec(128, "fp16", False, "sm80").d_split == 2
    assert default_bwd_spec(72, "fp16", False, "sm80").d_split == 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(head_dim=12), "head_dim=12"),
    (dict(block_m=24), "block_m=24"),
    (dict(block_n=96), "block_n=96"),
    (dict(num_stages=1), "num_stages=1"),
    (dict(dtype="fp32", family="mma"), "family='mma' does not take dtype=fp32"),
    (dict(dtype="fp32", block_m=32, block_n=32, family="simt"), "always deterministic"),
    (dict(block_m=128, num_warps=4, block_n=64), "num_warps=4 must be a multiple of block_m/16=8"),
    (dict(block_n=24), "block_n=24"),
    (dict(head_dim=256, block_m=128, num_stages=4), "shared memory"),
    (dict(varlen=True), "varlen applies to the wgmma backward"),
])
def test_invalid_backward_specs_are_named(kwargs, match):
    base = dict(head_dim=128, dtype="bf16", causal=False, block_m=64, block_n=128, num_warps=8,
                num_stages=2, arch="sm90a", family="mma")
    with pytest.raises(ValueError, match=re.escape(match)):
        BwdSpec(**{**base, **kwargs})


OFFLINE = [(d, t, c, det) for d in (8, 64, 72, 128, 136, 256) for t in ("bf16", "fp16") for c in (False, True)
           for det in (False, True) if not (t == "fp16" and c)] + \
          [(d, "fp32", c, True) for d in (64, 256) for c in (False, True)]


@pytest.mark.parametrize("arch", ["sm80", "sm90a"])
@pytest.mark.parametrize("head_dim,dtype,causal,deterministic", OFFLINE)
def test_backward_compiles_without_spills(head_dim, dtype, causal, deterministic, arch):
    pytest.importorskip("cupy")
    family = None if dtype == "fp32" else "mma"
    report = compile_offline(default_bwd_spec(head_dim, dtype, causal, arch, deterministic, family=family))
    assert report.log.count("Compiling entry function") == 3
    assert not report.spills, f"{report.spec.name}: {report.log}"


@pytest.mark.parametrize("head_dim,dtype,causal,deterministic",
                         [(d, t, c, det) for d in (64, 128, 256) for t in ("bf16", "fp16") for c in (False, True)
                          for det in (False, True) if t == "bf16" or not c])
def test_hopper_backward_compiles_without_spills(head_dim, dtype, causal, deterministic):
    pytest.importorskip("cupy")
    spec = default_bwd_spec(head_dim, dtype, causal, "sm90a", deterministic)
    assert spec.family == "wgmma"
    report = compile_offline(spec)
    assert not report.spills, f"{spec.name}: {report.log}"
    # ptxas says so when it serializes every wgmma of a kernel (an accumulator touched in flight)
    assert "Potential Performance Loss" not in report.log, f"{spec.name}: {report.log}"


@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False), (128, True), (256, True), (96, False)])
def test_hopper_varlen_backward_compiles_without_spills(head_dim, causal):
    pytest.importorskip("cupy")
    tma = default_bwd_spec(head_dim, "bf16", causal, "sm90a", False).replace(varlen=True)
    assert tma.tma_loads and tma.name.endswith("_varlen_tma_sm90a")
    # a slot's lse2 / delta copy starts at the 16-byte boundary below the tile's first row
    assert tma.stats_rows == tma.block_m + 4 and tma.replace(tma_loads=False).stats_rows == tma.block_m
    for spec in (tma, tma.replace(tma_loads=False)):
        report = compile_offline(spec)
        assert not report.spills, f"{spec.name}: {report.log}"
        assert "Potential Performance Loss" not in report.log, f"{spec.name}: {report.log}"
    with pytest.raises(ValueError, match="varlen applies"):
        default_bwd_spec(head_dim, "bf16", causal, "sm90a", True).replace(varlen=True, tma_loads=False)


def _problem(rng, dtype, b=1, h=2, hk=1, sq=37, sk=50, d=16):
    """(dout, q, k, v) with grouped-query heads."""
    return [rng.standard_normal(shape).astype(dtype) for shape in
            ((b, h, sq, d), (b, h, sq, d), (b, hk, sk, d), (b, hk, sk, d))]


@pytest.mark.parametrize("causal", [False, True])
def test_naive_backward_in_float32_is_close_to_the_reference(causal):
    dout, q, k, v = _problem(np.random.default_rng(1), np.float32)
    ours = attention_backward_naive(dout, q, k, v, causal=causal)
    ref = attention_backward_reference(dout, q, k, v, causal=causal)
    for a, r in zip(ours, ref):
        assert a.dtype == np.float32 and a.shape == r.shape
        np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-4)


def test_naive_backward_in_half_precision_errs_like_half_precision():
    import ml_dtypes
    for dtype, lo, hi in ((np.float16, 1e-5, 1e-2), (ml_dtypes.bfloat16, 1e-4, 1e-1)):
        dout, q, k, v = _problem(np.random.default_rng(2), dtype)
        ours = attention_backward_naive(dout, q, k, v, causal=True)
        ref = attention_backward_reference(dout, q, k, v, causal=True)
        for a, r in zip(ours, ref):
            assert a.dtype == np.dtype(dtype)
            assert lo < np.abs(a.astype(np.float64) - r).max() < hi


def test_every_tensor_core_kernel_needs_aligned_rows():
    # Both tensor-core families load with 16-byte cp.async; a misaligned view must be copied first.
    assert default_bwd_spec(128, "bf16", True, "sm90a").async_copies
    assert default_bwd_spec(128, "bf16", True, "sm90a", family="mma").async_copies
    assert not default_bwd_spec(128, "fp32", True, "sm90a").async_copies
    from cuflash.core.policy import default_spec
    assert default_spec(128, "bf16", True, "sm90a").async_copies
    assert not default_spec(128, "fp32", True, "sm90a").async_copies


def test_bench_picks_the_backward_family_it_is_asked_for():
    from cuflash.tools.bench.config import BenchConfig
    from cuflash.tools.bench.runner import _spec_for
    config = BenchConfig(128, 4096, True, 4, 16, "bf16", mode="bwd")
    assert _spec_for(config, "sm90a", {}).family == "wgmma"
    assert _spec_for(config, "sm90a", {"family": "mma"}).family == "mma"
    assert _spec_for(config, "sm90a", {"deterministic": True}).deterministic


def test_launch_backward_packs_every_field_and_launches_three_kernels():
    """launch.launch_backward on stand-ins for the arrays and kernels: each field of the parameter
    block (params.BWD_PARAM_FIELDS) holds what the problem says, and the three kernels get it with
    their grids (the GPU tests run it for real)."""
    from types import SimpleNamespace

    from cuflash.core import dtypes
    from cuflash.core.launch import launch_backward, rows_padded
    from cuflash.core.params import BWD_PARAM_FIELDS
    from cuflash.core.validate import Problem

    problem = Problem(dtypes.from_tag("bf16"), batch=3, heads=8, heads_k=2, seqlen_q=300, seqlen_k=500, head_dim=64,
                      causal=True, scale=0.125, layout="bhsd", device_id=0, q_strides=(1, 2, 3),
                      k_strides=(4, 5, 6), v_strides=(7, 8, 9))
    names = ("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv", "dq_accum", "lse2", "delta")
    tensors = {name: SimpleNamespace(data=SimpleNamespace(ptr=0x1000 * (i + 1))) for i, name in enumerate(names)}
    stride_names = ("q", "k", "v", "o", "do", "dq", "dk", "dv")
    strides = {t: (100 * i + 1, 100 * i + 2, 100 * i + 3) for i, t in enumerate(stride_names)}
    calls = []

    def kernel(tag):
        return lambda grid, block, args, shared_mem=0: calls.append((tag, grid, block, args, shared_mem))

    spec = default_bwd_spec(64, "bf16", True, "sm80")
    launch_backward((kernel("pre"), kernel("dkdv"), kernel("dq")), spec, SimpleNamespace(forward=problem), tensors,
                    strides)
    assert [c[0] for c in calls] == ["pre", "dkdv", "dq"]
    fields = np.dtype([(name, "<" + fmt) for name, _, fmt in BWD_PARAM_FIELDS])
    for _, _, _, args, _ in calls:
        (block,) = args
        assert block.nbytes == fields.itemsize
        params = np.frombuffer(block.tobytes(), dtype=fields)[0]
        for i, name in enumerate(names):
            assert params[name] == 0x1000 * (i + 1), name
        for t in stride_names:
            assert tuple(params[f"{t}_{s}_stride"] for s in ("batch", "head", "row")) == strides[t], t
        assert (params["heads"], params["group"], params["seqlen_q"], params["seqlen_k"]) == (8, 4, 300, 500)
        assert params["rows_padded"] == rows_padded(spec, 300) and params["rows_padded"] % spec.block_m == 0
        assert params["scale"] == np.float32(0.125)
        assert params["scale_log2"] == np.float32(0.125 * 1.4426950408889634)
    assert calls[1][1] == (-(-500 // spec.block_n), 2, 3) and calls[1][4] == spec.smem_bytes
    # packed sequences: the K/V-outer grid covers (key tiles of the longest, kv heads, sequences)
    # and the dQ conversion's (rows of the longest, heads, sequences); both take the offsets as
    # their second argument; the rows per head are the caller's
    calls.clear()
    varlen = bytes(range(24))
    spec = default_bwd_spec(64, "bf16", True, "sm90a").replace(varlen=True, tma_loads=False)
    launch_backward((kernel("pre"), kernel("dkdv"), kernel("dq")), spec, SimpleNamespace(forward=problem), tensors,
                    strides, padded=448, varlen=(varlen, 7, 260, 90))
    assert calls[0][1] == (448 // 32, 8, 3) and calls[1][1] == (-(-260 // spec.block_n), 2, 7)  # 32 rows per block
    assert calls[2][1] == (-(-90 // 32), 8, 7)
    assert all(len(c[3]) == 2 and c[3][1].tobytes() == varlen for c in calls[1:])
    assert all(np.frombuffer(c[3][0].tobytes(), dtype=fields)[0]["rows_padded"] == 448 for c in calls)


def test_hopper_backward_adds_dq_tiles_in_bulk():
    from cuflash.core.policy import default_bwd_spec
    for head_dim in (40, 64, 96, 128, 192, 256):
        spec = default_bwd_spec(head_dim, "bf16", False, "sm90a", family="wgmma")
        assert spec.bulk_dq and spec.replace(varlen=True, tma_loads=False).bulk_dq, head_dim
        # whole partial tiles: the accumulator's rows are as wide as the computed head dim
        assert spec.accum_head_dim == spec.padded_head_dim
        assert spec.smem_layout["total"] == spec.smem_bytes <= 227 * 1024
        # a split head dim writes its tile over the step's Q and dO tiles: no region of its own
        assert spec.double_dq != spec.split_head_dim and (spec.smem_layout["bars"] == spec.smem_layout["dq"]) \
            == spec.split_head_dim
        assert not spec.replace(local=True).double_dq
    # deterministic: the tiles go in in key-tile order, except at 256 (dQ by its own kernel)
    for head_dim, ordered in ((64, True), (128, True), (256, False)):
        spec = default_bwd_spec(head_dim, "bf16", True, "sm90a", True, family="wgmma")
        assert spec.ordered_dq == spec.bulk_dq == spec.accum_dq == ordered and not spec.atomic_dq
        assert not spec.replace(block_sparse=True, mask_mod="ab").ordered_dq
    assert not default_bwd_spec(128, "bf16", False, "sm90a", family="mma").bulk_dq


def test_hopper_backward_passes_its_tensor_maps_after_the_parameters(monkeypatch):
    from types import SimpleNamespace

    from cuflash.core import tma
    from cuflash.core.launch import launch_backward

    problem = SimpleNamespace(batch=3, heads=8, heads_k=2, seqlen_q=300, seqlen_k=500, scale=0.125)
    names = ("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv", "dq_accum", "lse2", "delta")
    tensors = {name: SimpleNamespace(data=SimpleNamespace(ptr=0x1000 * (i + 1))) for i, name in enumerate(names)}
    strides = {t: (1, 2, 3) for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")}
    seen = []

    def maps(spec, bp, q, k, v, dout):
        seen.append((q, k, v, dout))
        return np.frombuffer(bytes(range(256)) * 2, dtype=np.dtype((np.void, 512)))

    monkeypatch.setattr(tma, "backward_maps", maps)
    calls = []

    def kernel(tag):
        return lambda grid, block, args, shared_mem=0: calls.append((tag, args))

    spec = default_bwd_spec(128, "bf16", False, "sm90a")
    assert spec.tma_loads
    launch_backward((kernel("pre"), kernel("dkdv"), kernel("dq")), spec, SimpleNamespace(forward=problem), tensors,
                    strides)
    assert seen == [tuple(tensors[n] for n in ("q", "k", "v", "dout"))]
    pre, dkdv, dq = (args for _, args in calls)
    assert len(pre) == len(dq) == 1 and len(dkdv) == 2 and dkdv[1].tobytes() == bytes(range(256)) * 2


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("broadcast", [False, True])
def test_hopper_backward_loads_by_cp_async_where_tma_cannot_read(monkeypatch, broadcast, packed):
    """Dense batches and (packed) the one-launch varlen backward: TMA where the copy engine reads
    the views, cp.async for a kv head broadcast over two (head stride 0)."""
    cupy = pytest.importorskip("cupy")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import fake_device
    from cuflash.core import compile as _compile
    from cuflash.core import tma

    from cuflash import backward, varlen

    bf16 = np.dtype(ml_dtypes.bfloat16)
    fake_device.install(monkeypatch, cupy)
    backward._default.cache_clear()
    try:
        specs, maps = [], []
        kernels = tuple(fake_device.FakeKernel() for _ in range(3))
        monkeypatch.setattr(_compile, "get_kernel", lambda spec, device_id: specs.append(spec) or kernels)
        monkeypatch.setattr(tma, "backward_maps", lambda spec, bp, *arrays: maps.append(arrays) or np.zeros(
            1, dtype=np.dtype((np.void, 512))))
        rows, heads, head_dim = 256, 4, 64
        lead = () if packed else (1,)  # packed: [total rows, heads, head_dim]; else bhsd
        qshape = (rows, heads, head_dim) if packed else (1, heads, rows, head_dim)
        q, out, dout = (fake_device.fake_array(cupy, qshape, bf16, 0x1000_0000 * (i + 1)) for i in range(3))
        # k and v: two kv heads, or (broadcast) one head's rows seen by both (head stride 0)
        head_stride = 0 if broadcast else (head_dim if packed else rows * head_dim) * 2
        row_stride = ((1 if broadcast else 2) * head_dim if packed else head_dim) * 2
        kv_shape, kv_strides = (((rows, 2, head_dim), (row_stride, head_stride, 2)) if packed else
                                ((1, 2, rows, head_dim), (2 * rows * head_dim * 2, head_stride, row_stride, 2)))
        k, v = (fake_device.fake_array(cupy, kv_shape, bf16, 0x5000_0000 + i * 0x100_0000, kv_strides)
                for i in range(2))
        lse = fake_device.fake_array(cupy, lead + (heads, rows), np.float32, 0x6000_0000)
        if packed:
            offsets = np.array([0, 100, rows], dtype=np.int32)  # the host copy (the stand-in has no memory)
            monkeypatch.setattr(varlen, "_host_offsets", lambda name, x, total: offsets)
            cu = fake_device.fake_array(cupy, (3,), np.int32, 0x6800_0000)
            cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, causal=True)
        else:
            cuflash.attention_backward(dout, q, k, v, out, lse)
        (spec,) = specs
        assert spec.family == "wgmma" and spec.varlen == packed and spec.tma_loads != broadcast
        assert len(maps) == (0 if broadcast else 1)
        # the maps follow the parameters (packed: the offsets last)
        assert len(kernels[1].calls[0][2]) == (1 if broadcast else 2) + packed
    finally:
        fake_device.uninstall(cupy)
        backward._default.cache_clear()  # its specs were chosen for the stand-in device


def _dkdv_order(key_tiles, heads_batch, heads_per_chunk, chunked):
    """(key tile, head_batch) of each block in launch order, as bwd_common.cuh's dkdv_work numbers
    the grid (x: key tiles, y * z: kv head and batch pairs)."""
    order = []
    for linear in range(key_tiles * heads_batch):
        if not chunked:
            order.append((linear % key_tiles, linear // key_tiles))
            continue
        chunk, in_chunk = divmod(linear, key_tiles * heads_per_chunk)
        chunk_heads = min(heads_per_chunk, heads_batch - chunk * heads_per_chunk)
        order.append((in_chunk // chunk_heads, chunk * heads_per_chunk + in_chunk % chunk_heads))
    return order


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(1100, 1900), (1900, 1100), (64, 700), (700, 64), (1, 1)])
@pytest.mark.parametrize("heads_batch", [1, 5, 40])
def test_ordered_dq_turns_always_come(causal, seqlens, heads_batch):
    """The deterministic Hopper backward adds a dQ tile when its counter reads the block's key tile
    index. That needs every key tile before n to visit each query tile n visits, and to come
    before n in the launch order (so a block waits only for blocks already started)."""
    block_m, block_n = 64, 128
    seqlen_q, seqlen_k = seqlens
    offset = seqlen_k - seqlen_q
    key_tiles = -(-seqlen_k // block_n)

    def visits(n):  # DkdvWork: the query tiles key tile n visits
        m_begin = 0
        if causal and n * block_n - offset > 0:
            m_begin = (n * block_n - offset) // block_m * block_m
        return set(range(m_begin // block_m, -(-seqlen_q // block_m))) if m_begin < seqlen_q else set()

    for n in range(1, key_tiles):
        assert visits(n) <= visits(n - 1)
    heads_per_chunk = 32 if causal else 8
    position = {block: i for i, block in enumerate(_dkdv_order(key_tiles, heads_batch, heads_per_chunk, True))}
    assert len(position) == key_tiles * heads_batch
    for (n, hb), i in position.items():
        assert n == 0 or position[(n - 1, hb)] < i


def test_ordered_dq_has_its_turn_counters_in_the_parameter_block():
    from types import SimpleNamespace

    from cuflash.core.launch import launch_backward
    from cuflash.core.params import BWD_PARAM_FIELDS

    problem = SimpleNamespace(batch=2, heads=4, heads_k=2, seqlen_q=300, seqlen_k=500, scale=0.125)
    names = ("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv", "dq_accum", "lse2", "delta", "dq_sem")
    tensors = {name: SimpleNamespace(data=SimpleNamespace(ptr=0x1000 * (i + 1))) for i, name in enumerate(names)}
    strides = {t: (1, 2, 3) for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")}
    calls = []

    def kernel(grid, block, args, shared_mem=0):
        calls.append(args)

    spec = default_bwd_spec(128, "bf16", True, "sm90a", True).replace(tma_loads=False)
    assert spec.ordered_dq and spec.accum_dq
    launch_backward((kernel, kernel, kernel), spec, SimpleNamespace(forward=problem), tensors, strides)
    fields = np.dtype([(name, "<" + fmt) for name, _, fmt in BWD_PARAM_FIELDS])
    for args in calls:
        params = np.frombuffer(args[0].tobytes(), dtype=fields)[0]
        assert params["dq_sem"] == 0x1000 * len(names) and params["dq_accum"] == 0xA000


def test_small_kernels_grid_matches_their_rows_per_block():
    """The host's block size and rows per block of the preprocess and the dQ conversion are the
    kernels' own (bwd_common.cuh): a mismatch would leave rows without delta, lse2 or dQ."""
    from cuflash.core import launch
    from cuflash.core.render import include_dir

    header = (include_dir() / "cuflash" / "bwd_common.cuh").read_text()
    warps = int(re.search(r"constexpr int kRowsPerAuxBlock = (\d+);", header).group(1))
    rows_per_warp = int(re.search(r"constexpr int kAuxRowsPerWarp = (\d+);", header).group(1))
    assert launch._AUX_THREADS == 32 * warps
    assert launch._AUX_ROWS == warps * rows_per_warp
