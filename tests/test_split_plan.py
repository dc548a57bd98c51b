"""launch.split_plan: which launches deal their last tiles out by keys (the multiprocessor count
is set by hand); launch.band_heads, the bands of causal work tiles; launch.divider; and
launch.pack_params, the forward's parameter block (CPU only)."""
import pytest

from cuflash.core import dtypes, launch
from cuflash.core.policy import default_spec
from cuflash.core.validate import Problem


def _problem(head_dim, seqlen, causal=False, tokens=16384, hidden=2048):
    return Problem(dtypes.from_tag("bf16"), tokens // seqlen, hidden // head_dim, hidden // head_dim, seqlen, seqlen,
                   head_dim, causal, 1.0, "bhsd", 0, (0, 0, 0), (0, 0, 0), (0, 0, 0))


@pytest.fixture(autouse=True)
def h200(monkeypatch):
    monkeypatch.setattr(launch, "_multiprocessors", lambda device_id: 132)


def test_the_last_wave_and_the_rest_are_shared_out():
    problem = _problem(128, 2048)
    spec = default_spec(128, "bf16", False, "sm90a", seqlen=2048)
    plan = launch.split_plan(spec, problem)
    # 2048 tiles of 128 rows: 15 waves of 132 and 68 more; the last full wave and those 68 go by keys
    assert plan == launch.SplitPlan(2048 - 200, 132, 200 * 16)
    assert launch.grid(spec, problem) == (132, 1, 1)  # persistent up to 4k keys
    long = _problem(128, 16384)
    plan = launch.split_plan(default_spec(128, "bf16", False, "sm90a", seqlen=16384), long)
    assert plan == launch.SplitPlan(2048 - 200, 132, 200 * 128)
    assert launch.grid(default_spec(128, "bf16", False, "sm90a", seqlen=16384), long) == (2048 - 200 + 132, 1, 1)


@pytest.mark.parametrize("head_dim,seqlen,band", [
    (64, 1024, 64),    # 16 x 32 pairs, 256 KB of K and V each: 64 fill the 16 MB
    (128, 1024, 32),   # 16 x 16 pairs, 512 KB each
    (64, 4096, 16),    # 4 x 32 pairs, 1 MB each
    (64, 16384, 4),    # 1 x 32 pairs, 4 MB each
    (256, 16384, 1),   # 16 MB each: one pair per band
    (64, 512, 32),     # 32 x 32 pairs, 128 KB each: up to 512 keys, 32 fill the 4 MB
    (256, 512, 8),     # 32 x 8 pairs, 512 KB each
])
def test_causal_bands(head_dim, seqlen, band):
    problem = _problem(head_dim, seqlen, causal=True)
    assert launch.band_heads(default_spec(head_dim, "bf16", True, "sm90a", seqlen=seqlen), problem) == band
    # without a mask every tile costs the same: no bands
    assert launch.band_heads(default_spec(head_dim, "bf16", False, "sm90a", seqlen=seqlen), problem) == 1


def test_bands_divide_the_pairs():
    assert [launch._largest_divisor(n, limit) for n, limit in ((512, 64), (509, 64), (6, 4), (120, 7), (5, 5), (1, 1))] \
        == [64, 1, 3, 6, 5, 1]


@pytest.mark.parametrize("head_dim,seqlen,causal,why", [
    (128, 2048, True, "causal tiles balance themselves"),
    (64, 2048, False, "three consumers do not split"),
    (128, 1024, False, "16-bit inputs keep whole tiles up to 1024 keys"),
])
def test_whole_tiles(head_dim, seqlen, causal, why):
    problem = _problem(head_dim, seqlen, causal)
    spec = default_spec(head_dim, "bf16", causal, "sm90a", seqlen=seqlen)
    tiles = -(-problem.seqlen_q // spec.block_m) * problem.heads * problem.batch
    assert launch.split_plan(spec, problem) == launch.SplitPlan(tiles), why


def test_head_dim_256_splits():
    # 16k tokens at head dim 256: 8 heads of 128-row tiles, always 1024 tiles (7 waves and 100)
    problem = _problem(256, 4096)
    spec = default_spec(256, "bf16", False, "sm90a", seqlen=4096)
    assert launch.split_plan(spec, problem) == launch.SplitPlan(1024 - 232, 132, 232 * 52)  # 80-key tiles


def _heads(heads, seqlen_q, seqlen_k):
    return Problem(dtypes.from_tag("bf16"), 1, heads, heads, seqlen_q, seqlen_k, 128, False, 1.0, "bhsd", 0,
                   (0, 0, 0), (0, 0, 0), (0, 0, 0))


def test_whole_waves_fewer_than_two_waves_or_one_key_tile_stay_whole():
    spec = default_spec(128, "bf16", False, "sm90a", seqlen=2048)
    assert launch.split_plan(spec, _heads(264, 128, 2048)) == launch.SplitPlan(264)  # two whole waves
    assert launch.split_plan(spec, _heads(200, 128, 2048)) == launch.SplitPlan(200)  # fewer than two
    assert launch.split_plan(spec, _heads(300, 128, 2048)) == launch.SplitPlan(300 - 168, 132, 168 * 16)


def test_shares_end_inside_tiles():
    assert not launch.SplitPlan(300).shares_end_inside_tiles                    # whole tiles
    assert not launch.SplitPlan(300 - 168, 132, 168 * 11).shares_end_inside_tiles  # 14 key tiles each
    assert launch.SplitPlan(300 - 168, 132, 168 * 16).shares_end_inside_tiles   # 20.4 each


def test_fp8_splits_short_sequences_too():
    spec = default_spec(128, "e4m3", False, "sm90a", out_dtype="bf16")
    fp8 = Problem(dtypes.from_tag("e4m3"), 1, 300, 300, 128, 1024, 128, False, 1.0, "bhsd", 0,
                  (0, 0, 0), (0, 0, 0), (0, 0, 0))
    assert spec.block_n == 224
    assert launch.split_plan(spec, fp8) == launch.SplitPlan(300 - 168, 132, 168 * 5)  # 224-key tiles
    one_key_tile = Problem(dtypes.from_tag("e4m3"), 1, 300, 300, 128, 100, 128, False, 1.0, "bhsd", 0,
                           (0, 0, 0), (0, 0, 0), (0, 0, 0))
    assert launch.split_plan(spec, one_key_tile) == launch.SplitPlan(300)
    wide = default_spec(256, "e4m3", False, "sm90a", out_dtype="bf16")
    assert launch.split_plan(wide, fp8) == launch.SplitPlan(300 - 168, 132, 168 * 8)  # 128-key tiles


def _fast_div(n: int, magic: int, shifts: int) -> int:
    """ptx.cuh fast_div, in unsigned 32-bit arithmetic."""
    t = (magic * n) >> 32
    return (t + (((n - t) & 0xFFFFFFFF) >> (shifts & 0xFF))) >> (shifts >> 8)


@pytest.mark.parametrize("d", [1, 2, 3, 5, 7, 8, 9, 16, 17, 31, 32, 33, 100, 127, 128, 129, 641, 1000, 65535,
                               65536, 65537, 2**20 + 1, 2**30 - 1, 2**30, 2**30 + 1, 2**31 - 1])
def test_divider_divides_every_32_bit_int(d):
    """The kernels' division by a launch-time divisor (work tiles into query tile, head and batch;
    heads into kv heads) matches integer division wherever a numerator can lie."""
    magic, shifts = launch.divider(d)
    assert 0 < magic < 2**32
    numerators = {0, 1, d - 1, d, d + 1, 2**31 - 1, 2**31 - 2, (2**31 - 1) // d * d, (2**31 - 1) // d * d - 1}
    numerators |= set(range(0, 5000)) | {k * d + r for k in (1, 2, 3, 1000, 65535) for r in (-1, 0, 1)}
    for n in sorted(x for x in numerators if 0 <= x < 2**31):
        assert _fast_div(n, magic, shifts) == n // d, (n, d)


def test_divider_rejects_what_it_cannot_divide_by():
    for d in (0, -3, 2**31):
        with pytest.raises(ValueError, match="divisor"):
            launch.divider(d)


def test_pack_params_fills_every_field():
    """launch.pack_params on stand-ins for the arrays: each field of the forward's parameter block
    (params.PARAM_FIELDS) holds what the problem, the FP8 descales and the split plan say."""
    from types import SimpleNamespace

    import numpy as np

    from cuflash.core.params import PARAM_FIELDS
    from cuflash.core.validate import Fp8Scales

    def array(ptr):
        return SimpleNamespace(data=SimpleNamespace(ptr=ptr))

    problem = Problem(dtypes.from_tag("bf16"), batch=3, heads=12, heads_k=4, seqlen_q=300, seqlen_k=500, head_dim=64,
                      causal=False, scale=0.125, layout="bhsd", device_id=0, q_strides=(1, 2, 3),
                      k_strides=(4, 5, 6), v_strides=(7, 8, 9))
    scales = Fp8Scales(dtypes.from_tag("bf16"), array(0xA0), array(0xB0), array(0xC0), (12, 1), (4, 1))
    block = launch.pack_params(problem, array(0x10), array(0x20), array(0x30), array(0x40), array(0x50), (10, 11, 12),
                               tile_counter=0x60, scales=scales, plan=launch.SplitPlan(7, 5, 3), split=(0x70, 0x80),
                               q_tiles=3)
    fields = np.dtype([(name, "<" + fmt) for name, _, fmt in PARAM_FIELDS])
    assert block.nbytes == fields.itemsize
    p = np.frombuffer(block.tobytes(), dtype=fields)[0]
    pointers = ("q", "k", "v", "o", "lse", "tile_counter", "split_ws", "split_flags", "q_descale", "k_descale", "v_descale")
    assert [int(p[name]) for name in pointers] == [0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0xA0, 0xB0, 0xC0]
    for t, want in zip("qkvo", ((1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12))):
        assert tuple(int(p[f"{t}_{s}_stride"]) for s in ("batch", "head", "row")) == want
    assert (p["heads"], p["group"], p["seqlen_q"], p["seqlen_k"], p["batch"]) == (12, 3, 300, 500, 3)
    assert p["scale_log2"] == np.float32(0.125 * 1.4426950408889634)
    assert (p["q_descale_batch_stride"], p["q_descale_head_stride"]) == (12, 1)
    assert (p["kv_descale_batch_stride"], p["kv_descale_head_stride"]) == (4, 1)
    assert (p["dp_tiles"], p["shares"], p["share_units"]) == (7, 5, 3)
    for name, d in (("q_tiles", 3), ("heads", 12), ("group", 3)):
        assert (p[f"{name}_magic"], p[f"{name}_shifts"]) == launch.divider(d)


def test_launch_plans_write_the_five_pointers_and_reencode_maps_only_for_new_ones(monkeypatch):
    """launch.LaunchPlan on stand-ins (no GPU): each launch's parameter block is pack_params' for
    that call's arrays; the tensor maps are encoded again only when q, k, v or o move."""
    from types import SimpleNamespace

    from cuflash.core import tma

    def array(ptr):
        return SimpleNamespace(data=SimpleNamespace(ptr=ptr))

    encoded = []
    monkeypatch.setattr(tma, "forward_maps", lambda spec, problem, q, k, v: encoded.append(("qkv", q.data.ptr)) or
                        f"maps{q.data.ptr:x}")
    monkeypatch.setattr(tma, "output_map", lambda problem, out, strides, tag: encoded.append(("o", out.data.ptr)) or
                        f"omap{out.data.ptr:x}")
    monkeypatch.setattr(launch, "_tile_counter", lambda key: array(0x600))
    monkeypatch.setattr(launch, "_stream_key", lambda device_id: (0, 0))
    launched = []
    kernel = lambda grid, block, args, shared_mem: launched.append((grid, block, args, shared_mem))  # noqa: E731
    problem = _problem(128, 2048, causal=True)
    spec = default_spec(128, "bf16", True, "sm90a", seqlen=2048)
    assert spec.warp_specialized and spec.tma_store
    strides = (1, 2, 3)
    plan = launch.LaunchPlan(kernel, spec, problem, array(0x10), array(0x20), array(0x30), array(0x40), array(0x50),
                             strides)
    for q, o in ((0x10, 0x40), (0x10, 0x40), (0x1000, 0x40), (0x1000, 0x4000)):
        plan.launch(array(q), array(0x20), array(0x30), array(o), array(0x50))
        block = launch.pack_params(problem, array(q), array(0x20), array(0x30), array(o), array(0x50), strides,
                                   0x600, None, launch.split_plan(spec, problem), (0, 0),
                                   -(-problem.seqlen_q // spec.block_m), launch.band_heads(spec, problem))
        grid, threads, args, smem = launched[-1]
        assert args[0].tobytes() == block.tobytes() and args[1:] == (f"maps{q:x}", f"omap{o:x}")
        assert (grid, threads, smem) == (launch.grid(spec, problem), (spec.threads, 1, 1), spec.smem_bytes)
    assert encoded == [("qkv", 0x10), ("o", 0x40), ("qkv", 0x1000), ("o", 0x4000)]
    # the portable family: no maps, the block of launch()'s full path
    portable = default_spec(64, "fp16", False, "sm80")
    small = _problem(64, 1024)
    plan = launch.LaunchPlan(kernel, portable, small, *(array(p) for p in (1, 2, 3, 4, 5)), strides)
    plan.launch(*(array(p) for p in (16, 32, 48, 64, 80)))
    assert launched[-1][2][0].tobytes() == launch.pack_params(small, *(array(p) for p in (16, 32, 48, 64, 80)),
                                                              strides).tobytes()
    assert len(launched[-1][2]) == 1
