"""Specs, rendering and NVRTC compile checks: no GPU needed (these run in CI)."""
import concurrent.futures
import os
import re

import numpy as np
import pytest

import cuflash
from cuflash.core.compile import compile_offline
from cuflash.core.policy import FP8_WGMMA_MIN_HEAD_DIM, HOPPER_TILES, WGMMA_HEAD_DIMS, all_default_specs, default_spec
from cuflash.core.spec import ARCHS, HEAD_DIMS, KernelSpec


def test_spec_name_is_readable_and_filename_safe():
    spec = KernelSpec(128, "bf16", True, 128, 64, 4, 2, "sm80")
    assert spec.name == "fwd_bf16_hd128_causal_m128n64w4s2_sm80"
    assert KernelSpec(64, "fp16", False, 128, 64, 4, 2, "sm90a").name == "fwd_fp16_hd64_m128n64w4s2_sm90a"
    assert KernelSpec(64, "fp16", False, 128, 64, 4, 3, "sm90a", True).name == "fwd_fp16_hd64_m128n64w4s3o_sm90a"
    for s in all_default_specs("sm90a"):
        assert re.fullmatch(r"[A-Za-z0-9_]+", s.name)


def test_specs_are_hashable_and_frozen():
    a = default_spec(96, "bf16", False, "sm80")
    assert a == default_spec(96, "bf16", False, "sm80") and len({a, a.replace(num_stages=3)}) == 2
    with pytest.raises(Exception):
        a.head_dim = 64


@pytest.mark.parametrize("kwargs,match", [
    (dict(head_dim=12), "head_dim=12"),
    (dict(dtype="fp64"), "dtype='fp64'"),
    (dict(arch="sm70"), "arch='sm70'"),
    (dict(block_m=96), "block_m=96"),
    (dict(block_n=24), "block_n=24"),
    (dict(num_stages=1), "num_stages=1"),
    (dict(num_stages=2, overlap=True), "num_stages=2 must be at least 3 with overlap"),
    (dict(head_dim=256, block_n=256, num_stages=4), "shared memory"),
])
def test_invalid_specs_are_named(kwargs, match):
    base = dict(head_dim=128, dtype="bf16", causal=False, block_m=128, block_n=64, num_warps=4,
                num_stages=2, arch="sm80")
    with pytest.raises(ValueError, match=re.escape(match)):
        KernelSpec(**{**base, **kwargs})


_WS = dict(head_dim=128, dtype="bf16", causal=False, block_m=128, block_n=128, num_warps=12, num_stages=2,
           arch="sm90a", overlap=True, family="wgmma", warp_specialized=True, pingpong=True)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_warps=8), "block_m=128 with num_warps=12"),
    (dict(block_m=64), "block_m=128 with num_warps=12"),
    (dict(block_m=192), "block_m=192 with num_warps=16"),
    (dict(overlap=False), "takes overlap=True"),
    (dict(num_stages=1), "num_stages=1 must be at least 2"),
    (dict(warp_specialized=False, num_warps=8, overlap=False), "pingpong applies to the warp-specialized"),
    (dict(family="mma", block_m=128, num_warps=8, pingpong=False), "warp_specialized applies to the wgmma family"),
    (dict(block_n=176, num_stages=3), "shared memory"),
    (dict(varlen=True, mask_mod="0123456789ab", block_sparse=True),
     "varlen applies to the warp-specialized kernel on fp16 or bf16"),
    (dict(varlen=True, warp_specialized=False, pingpong=False, num_warps=8), "varlen applies"),
])
def test_invalid_warp_specialized_specs_are_named(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        KernelSpec(**{**_WS, **kwargs})


def test_warp_specialized_pads_head_dims_to_whole_swizzle_blocks():
    spec = KernelSpec(**{**_WS, "head_dim": 96})
    assert spec.padded_head_dim == 128 and spec.smem_bytes == KernelSpec(**_WS).smem_bytes
    source = cuflash.generate(spec)
    assert "kHeadDim = 128;" in source and "kHeadDimStored = 96;" in source
    assert KernelSpec(**{**_WS, "head_dim": 160, "block_n": 64}).padded_head_dim == 192
    # any multiple of 8: 8, 16 or 24 mod 32 leave tiles past the 16-byte stores' groups of 32 columns
    assert [KernelSpec(**{**_WS, "head_dim": d, "block_n": 64}).padded_head_dim for d in (8, 80, 200)] == [64, 128, 256]
    with pytest.raises(ValueError, match="multiple of 64 for wgmma without warp specialization"):
        KernelSpec(**{**_WS, "head_dim": 96, "warp_specialized": False, "num_warps": 8, "pingpong": False,
                      "num_stages": 3})


@pytest.mark.parametrize("arch", ARCHS)
def test_every_default_spec_renders_and_fits(arch):
    specs = all_default_specs(arch)
    # every (head_dim, dtype, causal) once, plus the Hopper kernel's short-sequence tiles where they differ
    assert {(s.head_dim, s.dtype, s.causal) for s in specs} == {
        (d, t, c) for d in HEAD_DIMS for t in ("fp16", "bf16", "fp32") for c in (False, True)}
    assert len(specs) == len(set(specs)) and (len(specs) > len(HEAD_DIMS) * 3 * 2) == (arch == "sm90a")
    for spec in specs:
        source = cuflash.generate(spec)
        assert f"{spec.name}(const FwdParams params" in source
        assert f"kHeadDim = {spec.padded_head_dim};" in source
        if spec.warp_specialized:  # the tensor maps travel as by-value parameters (O's with tma_store)
            assert "const __grid_constant__ cuflash::FwdTensorMaps maps" in source
            assert ("const __grid_constant__ cuflash::TensorMap out_map)" in source) == spec.tma_store


#: A representative set: powers of two, head dims that are 8 mod 16, odd multiples of 8, and the
#: largest; both dtypes of each family, causal and not.
OFFLINE = [(d, t, c) for d in (8, 64, 72, 128, 200, 256) for t in ("bf16", "fp16") for c in (False, True)
           if not (t == "fp16" and d in (8, 200))] + [(d, "fp32", c) for d in (64, 136, 256) for c in (False, True)]


@pytest.mark.parametrize("arch", ["sm80", "sm90a"])
@pytest.mark.parametrize("head_dim,dtype,causal", OFFLINE)
def test_nvrtc_compiles_without_spills(head_dim, dtype, causal, arch):
    pytest.importorskip("cupy")
    report = compile_offline(default_spec(head_dim, dtype, causal, arch))
    assert f"for '{arch.replace('sm', 'sm_')}'" in report.log
    assert report.registers <= 255
    assert not report.spills, f"{report.spec.name}: {report.log}"
    assert len(report.cubin) > 0


def assert_wgmma_not_serialized(report) -> None:
    """ptxas serializes every wgmma of a kernel when it cannot prove that an accumulator is left
    alone while a product runs (and says so: "Potential Performance Loss")."""
    assert "Potential Performance Loss" not in report.log, f"{report.spec.name}: {report.log}"


_WGMMA_SPECS = all_default_specs("sm90a", family="wgmma")


@pytest.mark.parametrize("spec", [s for s in _WGMMA_SPECS if s.head_dim in HOPPER_TILES["16bit"]], ids=lambda s: s.name)
def test_wgmma_specs_compile_without_spills(spec):
    pytest.importorskip("cupy")
    report = compile_offline(spec)
    assert not report.spills, f"{spec.name}: {report.log}"
    assert_wgmma_not_serialized(report)


@pytest.mark.parametrize("head_dim,causal,max_seqlen", [(64, False, 4096), (128, True, 700), (256, True, 4096),
                                                       (72, False, 700)])
def test_varlen_specs_compile_without_spills(head_dim, causal, max_seqlen):
    pytest.importorskip("cupy")
    from cuflash.varlen import hopper_spec

    spec = hopper_spec(head_dim, "bf16", causal, max_seqlen, "sm90a")
    assert spec.varlen and not spec.tma_store and not spec.split_keys and spec.name.endswith("_varlen_sm90a")
    report = compile_offline(spec)
    assert not report.spills, f"{spec.name}: {report.log}"
    assert_wgmma_not_serialized(report)
    assert hopper_spec(head_dim, "bf16", causal, max_seqlen, "sm80") is None


def _compile_report(spec):
    report = compile_offline(spec)
    return spec.name, report.spills, "Potential Performance Loss" in report.log


def test_padded_wgmma_specs_compile_without_spills():
    """The Hopper defaults at the head dims that take a wider one's tiles (bf16; fp16's code is
    the same but for the element type), compiled in parallel."""
    pytest.importorskip("cupy")
    specs = [s for s in _WGMMA_SPECS if s.head_dim not in HOPPER_TILES["16bit"] and s.dtype == "bf16"]
    assert {s.head_dim for s in specs} == set(WGMMA_HEAD_DIMS) - set(HOPPER_TILES["16bit"])
    with concurrent.futures.ProcessPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        reports = list(pool.map(_compile_report, specs))
    assert [name for name, spills, serialized in reports if spills or serialized] == []


@pytest.mark.parametrize("spec", __import__("cuflash.core.policy").core.policy.all_fp8_specs("sm90a"), ids=lambda s: s.name)
def test_fp8_specs_compile_without_spills(spec):
    pytest.importorskip("cupy")
    report = compile_offline(spec)
    assert not report.spills, f"{spec.name}: {report.log}"
    assert_wgmma_not_serialized(report)


def test_padded_fp8_specs_compile_without_spills():
    """The Hopper FP8 defaults at the head dims that take a wider one's tiles (e4m3, bf16 output;
    e5m2 and fp16 differ by one conversion each), compiled in parallel."""
    pytest.importorskip("cupy")
    head_dims = [d for d in HEAD_DIMS if d % 16 == 0 and d >= FP8_WGMMA_MIN_HEAD_DIM and d not in HOPPER_TILES["fp8"]]
    specs = [default_spec(d, "e4m3", c, "sm90a") for d in head_dims for c in (False, True)]
    assert all(s.family == "wgmma" for s in specs) and len(head_dims) == 12
    with concurrent.futures.ProcessPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        reports = list(pool.map(_compile_report, specs))
    assert [name for name, spills, serialized in reports if spills or serialized] == []


def test_fp8_local_specs_compile_without_spills():
    """The Hopper FP8 defaults with the window bounded by the kernel (KernelSpec.local), which FP8
    calls with window_size run: head dims 64, 128 and 256, causal and not, both formats at 128, the
    row sums on the tensor cores at 256; compiled in parallel."""
    pytest.importorskip("cupy")
    specs = [default_spec(d, t, c, "sm90a", lse=lse).replace(local=True) for d, t, lse in
             ((64, "e4m3", True), (128, "e4m3", True), (128, "e5m2", True), (256, "e4m3", True), (256, "e4m3", False))
             for c in (False, True)]
    assert all(s.local and not s.split_keys for s in specs)
    with concurrent.futures.ProcessPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        reports = list(pool.map(_compile_report, specs))
    assert [name for name, spills, serialized in reports if spills or serialized] == []


def test_fp8_specs_and_their_limits():
    spec = default_spec(64, "e5m2", False, "sm90a", out_dtype="fp16")
    assert (spec.padded_head_dim, spec.block_m, spec.block_n, spec.out_dtype, spec.elem_bytes) == (64, 192, 128, "fp16", 1)
    assert spec.name.startswith("fwd_e5m2ofp16_hd64_")
    # up to 64 columns, rows of 64 bytes in the 64-byte swizzle; wider ones in 128-column blocks
    assert [default_spec(d, "e4m3", False, "sm90a").col_block_bytes for d in (32, 48, 64, 80, 128)] == [64] * 3 + [128] * 2
    source = cuflash.generate(spec)
    assert "kColBlockBytes = 64;" in source and "kColBlocks = 1;" in source
    # head dims without tiles of their own take the next wider one's, padded to whole column blocks
    assert default_spec(96, "e4m3", True, "sm90a").replace(head_dim=128) == default_spec(128, "e4m3", True, "sm90a")
    assert default_spec(160, "e5m2", False, "sm90a").replace(head_dim=256) == default_spec(256, "e5m2", False, "sm90a")
    assert default_spec(32, "e4m3", False, "sm90a").padded_head_dim == 64
    assert default_spec(80, "e4m3", False, "sm90a").padded_head_dim == 128
    # below FP8_WGMMA_MIN_HEAD_DIM, and at 8 mod 16 (TMA rows of whole 16 bytes), the portable kernel
    assert default_spec(16, "e4m3", False, "sm90a").family == "mma"
    assert default_spec(16, "e4m3", False, "sm90a", family="wgmma").family == "wgmma"
    assert default_spec(72, "e4m3", False, "sm90a").family == "mma"
    with pytest.raises(ValueError, match="FP8 attention has a Hopper kernel"):
        default_spec(72, "e4m3", False, "sm90a", family="wgmma")
    with pytest.raises(ValueError, match="multiple of 16"):
        spec.replace(head_dim=72)
    with pytest.raises(ValueError, match="FP8 attention has a Hopper kernel"):
        default_spec(128, "e4m3", False, "sm80", family="wgmma")
    with pytest.raises(ValueError, match="out_dtype"):
        spec.replace(out_dtype="fp32")
    with pytest.raises(ValueError, match="block_n"):
        spec.replace(block_n=80)
    assert [spec.replace(block_n=n).fp8_v_box_keys for n in (128, 192, 224, 160, 96)] == [128, 64, 32, 32, 32]
    # 224 keys at head dim 128 without a mask (its policy row), 192 with one
    assert default_spec(128, "e4m3", False, "sm90a").block_n == 224
    assert default_spec(112, "e5m2", False, "sm90a").block_n == 224
    assert default_spec(128, "e4m3", True, "sm90a").block_n == 192
    assert default_spec(256, "e4m3", False, "sm90a").block_n == 128
    with pytest.raises(ValueError, match="out_dtype"):
        default_spec(128, "bf16", False, "sm90a").replace(out_dtype="fp16")


def test_fp8_row_sums_on_tensor_cores_only_without_the_lse():
    """lse=False (calls without return_lse) lets the Hopper FP8 kernel sum P on the tensor
    cores: its name says so, its source issues the sums' wgmma, and it reserves the block of
    ones; no other kernel takes lse=False."""
    from cuflash import generate

    exact, fast = (default_spec(256, "e4m3", False, "sm90a", lse=lse) for lse in (True, False))
    assert fast == exact.replace(lse=False) and fast.sums_on_tensor_cores and not exact.sums_on_tensor_cores
    assert fast.name.endswith("_nolse_sm90a") and "nolse" not in exact.name
    assert fast.smem_bytes == exact.smem_bytes + fast.ONES_BYTES
    assert fast.smem_barriers_offset == fast.smem_ones_offset + fast.ONES_BYTES and fast.smem_ones_offset % 512 == 0
    assert "wgmma_rs_fp8_n8" in generate(fast) and "wgmma_rs_fp8_n8" not in generate(exact)
    assert default_spec(160, "e4m3", True, "sm90a", lse=False).sums_on_tensor_cores  # on 256's tiles
    # the other kernels compute the LSE anyway: default_spec ignores lse=False, the spec refuses it;
    # the FP8 kernel on other tiles takes it only when forced (there the float sums ran faster)
    for dtype, arch in (("bf16", "sm90a"), ("e4m3", "sm80"), ("fp32", "sm80"), ("e4m3", "sm90a")):
        assert default_spec(128, dtype, False, arch, lse=False).lse
    with pytest.raises(ValueError, match="lse=False"):
        default_spec(128, "bf16", False, "sm90a").replace(lse=False)
    with pytest.raises(ValueError, match="lse=False"):
        default_spec(128, "e4m3", False, "sm80").replace(lse=False)


def test_hopper_defaults_are_the_policy_table_rows():
    """Every Hopper default (16-bit and FP8, head dims with tiles of their own and padded ones,
    both masks and length classes) takes the shape and switches of the one HOPPER_FORWARD row that
    selects it; half_first_tile at the tiles' own head dim only, the tensor-core row sums only
    without the LSE. Each switch names its kernel."""
    from cuflash.core.policy import fp8_wgmma_tile_head_dim, hopper_rule, length_class, wgmma_tile_head_dim

    for head_dim in (40, 64, 80, 96, 112, 128, 160, 192, 200, 256):
        for causal in (False, True):
            for seqlen in (512, 1024, 2048, None):
                for dtype, dclass, tiles in (("bf16", "16bit", wgmma_tile_head_dim(head_dim)),
                                             ("e4m3", "fp8", fp8_wgmma_tile_head_dim(head_dim))):
                    for lse in (True, False):
                        if dclass == "fp8" and head_dim % 16:
                            continue
                        spec = default_spec(head_dim, dtype, causal, "sm90a", seqlen=seqlen, lse=lse)
                        row = hopper_rule(dclass, tiles, causal, length_class(seqlen)).schedule
                        assert (spec.block_m, spec.block_n, spec.num_stages) == (row.block_m, row.block_n, row.num_stages)
                        assert (spec.pingpong, spec.lazy_rescale, spec.early_rescale) == (
                            row.pingpong, row.lazy_rescale, row.early_rescale)
                        assert spec.half_first_tile == (row.half_first_tile and head_dim == tiles)
                        assert spec.sums_on_tensor_cores == (row.sums_on_tensor_cores and not lse)
                        assert not spec.mask_in_loop and spec.num_warps == 4 + spec.block_m // 16
                        assert ("_wgmmawsp_" in spec.name) == spec.pingpong
                        assert ("_lazy_" in spec.name) == spec.lazy_rescale
                        assert ("_half_" in spec.name) == spec.half_first_tile
                        assert ("_early" in spec.name) == spec.early_rescale


def test_policy_table_rows_are_unambiguous_and_complete():
    """Exactly one row selects each (dtype class, tiles, causal, length class); every row has a
    reason; each row's shape is a tuner candidate (16-bit) and fits sm90a."""
    from cuflash.core import policy

    for dclass, tiles_list in policy.HOPPER_TILES.items():
        for tiles in tiles_list:
            for causal in (False, True):
                for length in ("short", "long"):
                    policy.hopper_rule(dclass, tiles, causal, length)
    for row in policy.HOPPER_FORWARD:
        assert row.reason and len(row.reason) < 100 and "\n" not in row.reason
        shape = (row.schedule.block_m, row.schedule.block_n, row.schedule.num_stages)
        if row.dtype_class == "16bit":
            assert shape in policy.HOPPER_CANDIDATES[row.tiles], row
    assert set(policy.HOPPER_CANDIDATES) == set(policy.HOPPER_TILES["16bit"])
    with pytest.raises(LookupError):
        policy.hopper_rule("16bit", 80, False, "long")


def test_schedule_switches_reach_the_source_and_need_the_warp_specialized_kernel():
    from cuflash import generate

    for s in (default_spec(256, "bf16", True, "sm90a"), default_spec(128, "e4m3", False, "sm90a"),
              default_spec(64, "fp16", True, "sm90a", seqlen=1024), default_spec(128, "bf16", True, "sm90a")):
        source = generate(s)
        for field, constant in (("lazy_rescale", "kLazyRescale"), ("mask_in_loop", "kMaskInLoop"),
                                ("early_rescale", "kEarlyRescale"), ("half_first_tile", "kHalfFirstTile")):
            assert f"{constant} = {str(getattr(s, field)).lower()};" in source
    assert default_spec(256, "bf16", True, "sm90a").lazy_rescale and default_spec(128, "e4m3", False, "sm90a").lazy_rescale
    assert default_spec(128, "e4m3", False, "sm90a").early_rescale
    lazy = default_spec(128, "bf16", False, "sm90a").replace(lazy_rescale=True)
    assert lazy.name.endswith("_lazy_sm90a") and lazy.lazy_slack_log2 == 8.0
    assert 2 ** (8 + default_spec(128, "e4m3", False, "sm90a").lazy_slack_log2) < 448
    masked = default_spec(128, "bf16", True, "sm90a").replace(mask_in_loop=True)
    assert "_maskloop" in masked.name and "kMaskInLoop = true;" in generate(masked)
    half = default_spec(64, "fp16", True, "sm90a", seqlen=1024)
    assert half.half_first_tile and half.block_n == 128 and "wgmma_ss_n64(" in generate(half)
    assert not default_spec(64, "e4m3", True, "sm90a").half_first_tile
    for head_dim in (96, 128):
        assert not default_spec(head_dim, "bf16", False, "sm90a", seqlen=1024).pingpong
        assert not default_spec(head_dim, "bf16", False, "sm90a", seqlen=16384).pingpong
        assert default_spec(head_dim, "bf16", True, "sm90a", seqlen=1024).pingpong
    assert not default_spec(128, "e4m3", True, "sm90a").pingpong and default_spec(256, "e4m3", True, "sm90a").pingpong
    for arch in ("sm80", "sm90a"):
        for field in ("lazy_rescale", "mask_in_loop", "early_rescale", "half_first_tile"):
            with pytest.raises(ValueError, match=field):
                default_spec(128, "bf16", False, arch, family="mma").replace(**{field: True})
    with pytest.raises(ValueError, match="block_n=80"):
        default_spec(256, "bf16", True, "sm90a").replace(half_first_tile=True)


# -- the portable FP8 kernel (family mma: codes converted to fp16 on chip) -------------------------

@pytest.mark.parametrize("spec", [s for arch in ("sm80", "sm90a") for s in
                                  __import__("cuflash.core.policy").core.policy.all_fp8_portable_specs(arch)], ids=lambda s: s.name)
def test_portable_fp8_specs_compile_without_spills(spec):
    pytest.importorskip("cupy")
    report = compile_offline(spec)
    assert f"for '{spec.arch.replace('sm', 'sm_')}'" in report.log
    assert not report.spills, f"{spec.name}: {report.log}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm80", "sm86", "sm90a"])
def test_portable_fp8_defaults_of_every_head_dim_compile_without_spills(arch):
    pytest.importorskip("cupy")
    from cuflash.core.policy import fp8_portable_spec
    for head_dim in HEAD_DIMS:
        for causal in (False, True):
            report = compile_offline(fp8_portable_spec(head_dim, "e4m3", causal, arch))
            assert not report.spills, f"{report.spec.name}: {report.log}"


def test_portable_fp8_defaults_cover_every_head_dim_and_target():
    """Off Hopper's FP8 head dims (and off Hopper) every FP8 problem has a portable kernel that
    fits the target; names carry format and output dtype, so they stay unique."""
    names = set()
    for arch in ARCHS:
        for head_dim in HEAD_DIMS:
            for fmt in ("e4m3", "e5m2"):
                for out_dtype in ("bf16", "fp16"):
                    spec = default_spec(head_dim, fmt, True, arch, out_dtype=out_dtype)
                    hopper = arch == "sm90a" and head_dim % 16 == 0 and head_dim >= FP8_WGMMA_MIN_HEAD_DIM
                    assert spec.family == ("wgmma" if hopper else "mma") and spec.out_dtype == out_dtype
                    assert spec.smem_bytes <= cuflash.core.spec.SMEM_LIMIT[arch]
                    names.add(spec.name)
    assert len(names) == len(ARCHS) * len(HEAD_DIMS) * 2 * 2
    spec = default_spec(88, "e5m2", False, "sm90a", out_dtype="fp16")
    assert spec.name == "fwd_e5m2ofp16_hd88_m128n64w8s2_sm90a" and spec.converts_fp8
    assert default_spec(128, "e4m3", False, "sm90a", family="mma").family == "mma"
    assert default_spec(128, "e4m3", False, "sm86").block_n == 32  # the smaller shared memory
    source = cuflash.generate(default_spec(72, "e4m3", True, "sm80"))
    assert "kFp8CopyBytes = 8;" in source and "kE4M3 = true;" in source and "kOutBF16 = true;" in source
    assert "typedef unsigned char Elem;" in source and "kBF16 = false;" in source  # fp16 products
    assert "typedef unsigned short Elem;" in cuflash.generate(default_spec(72, "bf16", True, "sm80"))


def test_portable_fp8_shared_memory_layout():
    spec = default_spec(128, "e4m3", False, "sm80")
    fp16_tile = spec.block_n * 272  # 128 fp16 columns: 16 chunks, padded to 17
    assert (spec.smem_row_bytes, spec.kv_slots, spec.kv_tile_bytes) == (272, 2, fp16_tile)
    assert spec.smem_v_offset == spec.smem_k_offset + 2 * fp16_tile
    assert spec.smem_q8_offset == spec.smem_k_offset and spec.copy_alignment == 16
    assert spec.smem_stage_offset == spec.q_tile_bytes + 4 * fp16_tile
    assert spec.smem_bytes == spec.smem_stage_offset + spec.num_stages * 2 * spec.block_n * 128
    assert default_spec(72, "e5m2", False, "sm80").copy_alignment == 8


@pytest.mark.parametrize("kwargs,match", [
    (dict(family="simt"), "family='simt'"),
    (dict(out_dtype="fp32"), "out_dtype='fp32'"),
    (dict(out_dtype="e4m3"), "out_dtype='e4m3'"),
    (dict(num_stages=2, overlap=True), "num_stages=2 must be at least 3 with overlap"),
    (dict(block_m=96), "block_m=96"),
    (dict(block_n=24), "block_n=24"),
    (dict(warp_specialized=True), "warp_specialized"),
    (dict(head_dim=256, block_n=128, arch="sm86"), "shared memory"),
])
def test_invalid_portable_fp8_specs_are_named(kwargs, match):
    base = dict(head_dim=128, dtype="e4m3", causal=False, block_m=128, block_n=64, num_warps=8, num_stages=2,
                arch="sm80", family="mma", out_dtype="bf16")
    with pytest.raises(ValueError, match=re.escape(match)):
        KernelSpec(**{**base, **kwargs})
    with pytest.raises(ValueError, match="family='simt'"):
        default_spec(128, "e4m3", False, "sm80", family="simt")


def test_fp8_v_operand_orders_keys_like_the_probability_registers():
    from cuflash import fp8

    v = np.arange(2 * 3 * 37 * 16).reshape(2, 3, 37, 16).astype(np.uint8)
    out = fp8.v_operand(v)
    assert out.shape == (2, 3, 16, 48)
    order = [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    for slot in range(48):
        key = 16 * (slot // 16) + order[slot % 16]
        want = v[:, :, key, :] if key < 37 else 0  # padded keys are zero codes
        assert (out[:, :, :, slot] == want).all()
    assert (fp8.v_operand(v.transpose(0, 2, 1, 3), layout="bshd") == out).all()


def _header_compiles(header: str, arch: str, defines=()) -> None:
    """Compile a kernel header of templates/include/cuflash as it is compiled at run time (NVRTC,
    the same options, no GPU needed); a failure shows NVRTC's log."""
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc

    from cuflash.core.compile import arch_options

    options = [o.replace("-arch=", "--gpu-architecture=") for o in arch_options(arch)] + list(defines)
    prog = nvrtc.createProgram(f'#include "cuflash/{header}"\n', header.replace(".cuh", ".cu"), [], [])
    try:
        nvrtc.compileProgram(prog, options)
    except nvrtc.NVRTCError:
        pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def test_fp8_v_operand_kernel_compiles():
    """The device kernel behind fp8.v_operand."""
    _header_compiles("fp8_v.cuh", "sm90a")


@pytest.mark.parametrize("arch", ["sm90a", "sm80"])
def test_append_kernel_compiles(arch):
    """The kernel of cuflash.append_kv."""
    _header_compiles("append.cuh", arch)


@pytest.mark.parametrize("table", [0, 1, 2])
@pytest.mark.parametrize("arch", ["sm90a", "sm80"])
def test_rotary_kernel_compiles(arch, table):
    """The KV-cache call's rotation kernel for each table dtype, float16 and bfloat16."""
    for bf16 in ((), ("-DCUFLASH_ROTARY_BF16",)):
        _header_compiles("rotary.cuh", arch, (f"-DCUFLASH_ROTARY_TABLE={table}", *bf16))


def test_default_family_per_target():
    assert default_spec(128, "bf16", True, "sm90a").family == "wgmma"
    assert default_spec(96, "bf16", True, "sm90a").family == "wgmma"  # padded to 128 columns
    # other head dims from 24 take the tiles of the next wider one, padded to 64-column blocks
    assert default_spec(80, "bf16", True, "sm90a").replace(head_dim=96) == default_spec(96, "bf16", True, "sm90a")
    assert default_spec(200, "fp16", False, "sm90a", seqlen=1024).replace(head_dim=256) == \
        default_spec(256, "fp16", False, "sm90a", seqlen=1024)
    assert default_spec(16, "bf16", True, "sm90a").family == "mma"
    assert default_spec(24, "bf16", True, "sm90a").family == "wgmma"
    assert default_spec(128, "bf16", True, "sm80").family == "mma"
    assert default_spec(128, "fp32", True, "sm90a").family == "simt"
    with pytest.raises(ValueError, match="wgmma"):
        default_spec(128, "bf16", True, "sm80", family="wgmma")


def test_compile_error_carries_spec_options_log_and_source(monkeypatch, tmp_path):
    pytest.importorskip("cupy")
    from cuflash.core import compile as compile_mod

    spec = default_spec(64, "bf16", False, "sm80")
    monkeypatch.setattr(compile_mod, "generate", lambda s: "this is not CUDA;")
    with pytest.raises(cuflash.CompileError) as info:
        compile_offline(spec)
    err = info.value
    assert err.spec_name == spec.name and "-std=c++17" in err.options and err.log
    assert open(err.source_path).read() == "this is not CUDA;"


class _View:
    """Just what the copy checks read of an array: base address, shape, byte strides."""

    def __init__(self, ptr, shape, strides):
        self.data = type("Memory", (), {"ptr": ptr})()
        self.shape, self.strides = shape, strides


def test_tma_readability_of_views():
    from cuflash.core.validate import aligned_for_async_copy, readable_by_tma
    contiguous = _View(256, (2, 4, 100, 64), (4 * 100 * 128, 100 * 128, 128, 2))
    assert aligned_for_async_copy(contiguous) and readable_by_tma(contiguous)
    shifted = _View(258, (2, 4, 100, 64), contiguous.strides)  # starts 2 bytes into its buffer
    assert not aligned_for_async_copy(shifted) and not readable_by_tma(shifted)
    broadcast = _View(256, (2, 4, 100, 64), (100 * 128, 0, 128, 2))  # one k/v head seen by 4 heads
    assert aligned_for_async_copy(broadcast) and not readable_by_tma(broadcast)
    single = _View(256, (1, 1, 100, 64), (0, 0, 128, 2))  # an extent of 1 may carry any stride
    assert readable_by_tma(single)


def test_tensor_maps_describe_q_k_v_in_kernel_order(monkeypatch):
    """forward_maps hands the driver (head_dim, seqlen, heads, batch) extents, byte strides (any
    value where an extent is 1), boxes of block_m (q) or block_n (k, v) rows, and packs the three
    128-byte maps in the kernel's order; a repeated call reuses them."""
    from cuflash.core import dtypes, tma
    from cuflash.core.validate import Problem

    calls = []

    def encode(ptr, dims, strides, box, dtype_tag, swizzle=128):
        assert swizzle == 128
        calls.append((ptr, dims, strides, box, dtype_tag))
        return bytes([len(calls)]) * tma.MAP_BYTES

    monkeypatch.setattr(tma, "_encode", encode)
    monkeypatch.setattr(tma, "_forward_maps", {})
    spec = KernelSpec(**_WS)
    problem = Problem(dtype=dtypes.from_tag("bf16"), batch=3, heads=8, heads_k=1, seqlen_q=300, seqlen_k=257,
                      head_dim=128, causal=False, scale=0.1, layout="bshd", device_id=0,
                      q_strides=(300 * 8 * 128, 128, 8 * 128), k_strides=(257 * 128, 257 * 128, 128),
                      v_strides=(257 * 128, 257 * 128, 128))
    q, k, v = (_View(ptr, (), ()) for ptr in (4096, 8192, 12288))
    for x in (q, k, v):
        x.itemsize = 2
    maps = tma.forward_maps(spec, problem, q, k, v)
    assert maps.dtype.itemsize == 3 * tma.MAP_BYTES and bytes(maps[0])[::128] == b"\x01\x02\x03"
    assert calls == [
        (4096, (128, 300, 8, 3), (8 * 128 * 2, 128 * 2, 300 * 8 * 128 * 2), (64, 128), "bf16"),
        (8192, (128, 257, 1, 3), (128 * 2, 16, 257 * 128 * 2), (64, 128), "bf16"),  # heads_k == 1: stride unused
        (12288, (128, 257, 1, 3), (128 * 2, 16, 257 * 128 * 2), (64, 128), "bf16"),
    ]
    assert tma.forward_maps(spec, problem, q, k, v) is maps and len(calls) == 3


def test_output_map_describes_o_and_is_reused_for_the_same_buffer(monkeypatch):
    """output_map hands the driver O's (head_dim, seqlen_q, heads, batch) extents and byte
    strides in 64 x 64 boxes of the output dtype; the same buffer and geometry reuse the map, and
    another address or dtype makes a new one."""
    from cuflash.core import dtypes, tma
    from cuflash.core.validate import Problem

    calls = []

    def encode(ptr, dims, strides, box, dtype_tag, swizzle=128):
        calls.append((ptr, dims, strides, box, dtype_tag, swizzle))
        return bytes([len(calls)]) * tma.MAP_BYTES

    monkeypatch.setattr(tma, "_encode", encode)
    monkeypatch.setattr(tma, "_output_maps", {})
    problem = Problem(dtype=dtypes.from_tag("e4m3"), batch=2, heads=4, heads_k=4, seqlen_q=100, seqlen_k=100,
                      head_dim=96, causal=False, scale=0.1, layout="bhsd", device_id=0,
                      q_strides=(4 * 100 * 96, 100 * 96, 96), k_strides=(4 * 100 * 96, 100 * 96, 96),
                      v_strides=(4 * 100 * 96, 100 * 96, 96))
    out = _View(4096, (2, 4, 100, 96), ())
    out.itemsize = 2
    strides = (4 * 100 * 96, 100 * 96, 96)
    first = tma.output_map(problem, out, strides, "bf16")
    assert calls == [(4096, (96, 100, 4, 2), (96 * 2, 100 * 96 * 2, 4 * 100 * 96 * 2), (64, 64), "bf16", 128)]
    assert tma.output_map(problem, out, strides, "bf16") is first and len(calls) == 1
    tma.output_map(problem, out, strides, "fp16")
    moved = _View(8192, out.shape, ())
    moved.itemsize = 2
    tma.output_map(problem, moved, strides, "bf16")
    assert [c[0] for c in calls] == [4096, 4096, 8192] and calls[1][4] == "fp16"
