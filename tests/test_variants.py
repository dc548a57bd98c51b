"""FlashAttention's ``window_size`` and ``softcap`` arguments on the host: their checks, the mask
and cap they become, and the block mask made once per shape (classified in NumPy here)."""
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import mods, sparsity
from cuflash.core.trace import evaluate
from cuflash.core.validate import validate_variants


@pytest.mark.parametrize("window_size,softcap,causal,expected", [
    ((-1, -1), 0.0, False, None),
    ((-1, -1), 0.0, True, None),
    ((-1, 0), 0, True, None),
    ((-1, 0), 0.0, False, ((-1, 0), 0.0)),
    ((8, -1), 0.0, True, ((8, 0), 0.0)),
    ([3, 4], 0.0, False, ((3, 4), 0.0)),
    ((np.int64(3), 4), None, False, ((3, 4), 0.0)),
    ((-1, -1), 30, True, ((-1, 0), 30.0)),
])
def test_variants_are_checked_into_bounds_and_a_cap(window_size, softcap, causal, expected):
    assert validate_variants(window_size, softcap, causal) == expected


@pytest.mark.parametrize("window_size,softcap,causal,error,match", [
    (8, 0.0, False, TypeError, "pair of ints"),
    ((1, 2, 3), 0.0, False, TypeError, "pair of ints"),
    ((1.0, 2), 0.0, False, TypeError, "pair of ints"),
    ((True, 2), 0.0, False, TypeError, "pair of ints"),
    ((-2, 0), 0.0, False, ValueError, "-1"),
    ((4, 4), 0.0, True, ValueError, "right must be 0"),
    ((-1, -1), -1.0, False, ValueError, "softcap"),
    ((-1, -1), float("inf"), False, ValueError, "softcap"),
    ((-1, -1), "30", False, ValueError, "softcap"),
])
def test_bad_variants_are_refused_by_name(window_size, softcap, causal, error, match):
    with pytest.raises(error, match=match):
        validate_variants(window_size, softcap, causal)


def _dense(left, right, offset, seqlen_q, seqlen_k):
    i = np.arange(seqlen_q)[:, None] + offset
    j = np.arange(seqlen_k)[None, :]
    return (j >= i - left if left >= 0 else True) & (j <= i + right if right >= 0 else True)


@pytest.mark.parametrize("left,right,offset", [(5, 3, 0), (5, -1, 7), (-1, 2, -9), (0, 0, 0)])
def test_the_window_mask_is_the_band_and_one_function_per_bounds(left, right, offset):
    fn = mods._window_size_mask(left, right, offset)
    assert mods._window_size_mask(left, right, offset) is fn
    graph = mods.trace_mask_mod(fn)
    grids = {"b": np.zeros((1, 1, 1, 1), int), "h": np.zeros((1, 1, 1, 1), int),
             "q_idx": np.arange(40)[None, None, :, None], "kv_idx": np.arange(50)[None, None, None, :]}
    got = np.broadcast_to(evaluate(graph, grids), (1, 1, 40, 50))[0, 0]
    assert np.array_equal(got, np.broadcast_to(_dense(left, right, offset, 40, 50), (40, 50)))
    assert mods._window_size_mask(-1, -1, offset) is None


def _problem(causal, seqlen_q, seqlen_k, batch=2, heads=3):
    return SimpleNamespace(causal=causal, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k)


@pytest.mark.parametrize("causal,window,seqlen_q,seqlen_k", [
    (True, (100, 0), 300, 300), (False, (40, 70), 200, 333), (True, (17, 0), 333, 129), (False, (-1, 0), 64, 64)])
def test_flash_mods_give_the_window_and_its_block_mask_once_per_shape(causal, window, seqlen_q, seqlen_k):
    problem = _problem(causal, seqlen_q, seqlen_k)
    score_mod, mask_mod, block = sparsity.flash_mods(problem, window, 0.0, None, None, None)
    assert score_mod is None
    left, right = window
    allowed = _dense(left, -1 if causal else right, seqlen_k - seqlen_q, seqlen_q, seqlen_k)
    tiles = -(-seqlen_q // 128), -(-seqlen_k // 128)
    kind = np.zeros(tiles, np.int8)
    for r in range(tiles[0]):
        for c in range(tiles[1]):
            part = allowed[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]
            kind[r, c] = sparsity.FULL if part.all() else sparsity.PARTIAL if part.any() else sparsity.EMPTY
    assert block.shape == (2, 3, seqlen_q, seqlen_k)
    assert np.array_equal(block.kind[0, 0], kind)
    again = sparsity.flash_mods(problem, window, 0.0, None, None, None)
    assert again[1] is mask_mod and again[2] is block


def test_flash_mods_give_the_cap_and_refuse_a_second_mod():
    problem = _problem(False, 64, 64)
    score_mod, mask_mod, block = sparsity.flash_mods(problem, (-1, -1), 30.0, None, None, None)
    assert mask_mod is None and block is None
    assert mods.trace_score_mod(score_mod).digest == mods.trace_score_mod(mods.softcap(30.0)).digest
    assert sparsity.flash_mods(problem, (-1, -1), 30.0, None, None, None)[0] is score_mod
    with pytest.raises(ValueError, match="score_mod"):
        sparsity.flash_mods(problem, (-1, -1), 30.0, mods.alibi(np.ones(3, np.float32)), None, None)
    with pytest.raises(ValueError, match="mask_mod or block_mask"):
        sparsity.flash_mods(problem, (4, 4), 0.0, None, mods.sliding_window(8), None)


@pytest.mark.parametrize("causal,window", [(False, (5, 3)), (True, (5, 0)), (False, (-1, 3)), (True, (-1, -1))])
def test_the_reference_takes_window_and_softcap_as_the_mods_they_are(causal, window):
    from cuflash import reference

    rng = np.random.default_rng(1)
    q, dout = rng.standard_normal((2, 1, 2, 37, 16))
    k, v = rng.standard_normal((2, 1, 2, 50, 16))
    left, right = window
    d = 50 - 37

    def band(b, h, q_idx, kv_idx):  # written out here, not taken from cuflash
        lo = kv_idx >= q_idx + d - left if left >= 0 else kv_idx >= 0
        hi = kv_idx <= q_idx + d + right if right >= 0 and not causal else kv_idx >= 0
        return lo & hi
    mods_args = dict(causal=causal, mask_mod=band, score_mod=mods.softcap(4.0))
    args = dict(causal=causal, window_size=window, softcap=4.0)
    halves = [x.astype(np.float16) for x in (q, k, v)]
    for got, want in ((reference.attention_reference(q, k, v, **args),
                       reference.attention_reference(q, k, v, **mods_args)),
                      (reference.attention_naive(*halves, **args), reference.attention_naive(*halves, **mods_args)),
                      (reference.attention_backward_reference(dout, q, k, v, **args),
                       reference.attention_backward_reference(dout, q, k, v, **mods_args))):
        for a, b in zip(got, want):
            assert np.array_equal(a, b)


def test_the_reference_refuses_what_the_kernels_refuse():
    from cuflash import reference

    x = np.ones((1, 1, 8, 16))
    with pytest.raises(ValueError, match="score_mod"):
        reference.attention_reference(x, x, x, softcap=2.0, score_mod=mods.softcap(2.0))
    with pytest.raises(ValueError, match="mask_mod"):
        reference.attention_reference(x, x, x, window_size=(2, 2), mask_mod=mods.sliding_window(2))
    with pytest.raises(ValueError, match="right must be 0"):
        reference.attention_reference(x, x, x, causal=True, window_size=(2, 2))


def test_problems_carry_window_and_softcap_to_the_reference():
    from cuflash import reference
    from cuflash.testing import AttentionProblem

    p = AttentionProblem(1, 2, 1, 30, 45, 16, "bf16", causal=True, window_size=(7, 0), softcap=5.0)
    assert p.name.endswith("window7,0 softcap5") and p.variants == dict(window_size=(7, 0), softcap=5.0)
    q, k, v = p.make_inputs(seed=3)
    got = p.reference(q, k, v)
    want = reference.attention_reference(q, k, v, causal=True, window_size=(7, 0), softcap=5.0)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="right must be 0"):
        AttentionProblem(1, 2, 1, 30, 45, 16, "bf16", causal=True, window_size=(7, 3))
    with pytest.raises(ValueError, match="fp32"):
        AttentionProblem(1, 2, 1, 30, 45, 16, "fp32", softcap=5.0)


def test_the_strategy_draws_windows_and_caps_for_16_bit_problems_only():
    from hypothesis import HealthCheck, given, settings

    from cuflash.testing import attention_problems

    seen = []

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(problem=attention_problems(max_seqlen=64, variants=True))
    def draw(problem):
        seen.append(problem)
        if problem.dtype == "fp32":
            assert problem.window_size == (-1, -1) and not problem.softcap
        if problem.causal:
            assert problem.window_size[1] in (-1, 0)
    draw()
    assert any(p.window_size != (-1, -1) for p in seen) and any(p.softcap for p in seen)


def test_windows_the_hopper_kernels_bound_themselves():
    """Which calls take the window as kernel arguments (KernelSpec.local, BwdSpec.local), and the
    bounds they pass: a bound no query can reach is passed as none."""
    from cuflash.backward import _local_window
    from cuflash.core.launch import _window_bounds
    from cuflash.core.policy import default_bwd_spec, default_spec

    fwd = default_spec(128, "bf16", True, "sm90a", seqlen=4096)
    assert fwd.replace(local=True).name.endswith("_local_sm90a") and not fwd.replace(local=True).split_keys
    with pytest.raises(ValueError, match="local applies"):
        default_spec(128, "bf16", True, "sm80").replace(local=True)
    bwd = default_bwd_spec(128, "bf16", True, "sm90a", False)
    assert not bwd.replace(local=True).double_dq and not bwd.replace(local=True).ordered_dq
    with pytest.raises(ValueError, match="local applies"):
        default_bwd_spec(128, "bf16", True, "sm90a", True).replace(local=True)
    window = validate_variants((100, -1), 0.0, True)
    assert _local_window(bwd, window, True, None, None, None) == (100, -1)  # causal keeps the right bound
    assert _local_window(bwd, validate_variants((-1, -1), 5.0, True), True, None, None, None) == (-1, -1)
    assert _local_window(default_bwd_spec(128, "bf16", True, "sm90a", True), window, True, None, None, None) \
        == (-1, -1)
    wide = default_bwd_spec(256, "bf16", True, "sm90a", False)
    assert _local_window(wide, window, True, None, None, None) == (100, -1)
    assert _local_window(wide, validate_variants((100, -1), 5.0, True), True, None, None, None) == (-1, -1)
    with pytest.raises(ValueError, match="a mask_mod or block_mask"):
        _local_window(bwd, window, True, None, lambda b, h, q, k: q >= k, None)
    problem = SimpleNamespace(seqlen_q=300, seqlen_k=200)
    assert _window_bounds((499, 7), problem) == (499, 7)
    assert _window_bounds((500, 2**31 - 2**20 - 1), problem) == (-1, -1)


@pytest.mark.parametrize("head_dim,causal,window,out_dtype,return_lse", [
    (64, True, (300, 0), "bf16", True), (128, False, (200, 130), "fp16", False), (256, False, (-1, 70), "bf16", False),
    (128, True, (0, 0), "bf16", True)])
def test_fp8_windows_the_hopper_kernel_bounds_itself(monkeypatch, head_dim, causal, window, out_dtype, return_lse):
    """An FP8 call with a window runs the warp-specialized kernel with local=True, no mask_mod or
    block mask, for the call's output dtype, with the bounds in its parameter block (CPU stand-ins
    for the device, tests/fake_device.py); a forced spec keeps the window as a mask_mod."""
    cupy = pytest.importorskip("cupy")
    import cuflash
    import fake_device
    from cuflash import forward
    from cuflash.core import compile as _compile
    from cuflash.core.params import FORWARD_STRUCT
    from cuflash.core.policy import default_spec
    from cuflash.fp8 import PreparedV

    kernel, _ = fake_device.install(monkeypatch, cupy)
    monkeypatch.setattr(sparsity, "_window_masks", {})  # the forced call's block mask stays with this test
    specs = []
    monkeypatch.setattr(_compile, "get_kernel", lambda spec, device_id: specs.append(spec) or kernel)
    forward._default.cache_clear()
    try:
        seqlen_q, seqlen_k = 1100, 700
        q = fake_device.fake_array(cupy, (1, 4, seqlen_q, head_dim), np.uint8, 0x1000_0000)
        k = fake_device.fake_array(cupy, (1, 2, seqlen_k, head_dim), np.uint8, 0x2000_0000)
        v = PreparedV(fake_device.fake_array(cupy, (1, 2, head_dim, 704), np.uint8, 0x3000_0000),
                      (1, 2, seqlen_k, head_dim), "bhsd")
        descale = fake_device.fake_array(cupy, (), np.float32, 0x4000_0000)
        call = dict(causal=causal, window_size=window, fp8_format="e4m3", q_descale=descale, k_descale=descale,
                    v_descale=descale, out_dtype=out_dtype, return_lse=return_lse)
        cuflash.attention(q, k, v, **call)
        spec = specs[-1]
        assert spec == default_spec(head_dim, "e4m3", causal, "sm90a", out_dtype=out_dtype, seqlen=seqlen_q,
                                    lse=return_lse).replace(local=True)
        assert spec.local and spec.warp_specialized and not spec.mask_mod and not spec.block_sparse
        # causal bounds the right edge itself: no right bound is passed
        assert FORWARD_STRUCT.unpack(kernel.calls[-1][2][0])[-2:] == (window[0], -1 if causal else window[1])
        forced = default_spec(head_dim, "e4m3", causal, "sm90a", out_dtype=out_dtype, lse=True)
        monkeypatch.setattr(sparsity, "kernel_tables", lambda *args: (None, None, b""))  # tables live on the device
        cuflash.attention(q, k, v, spec=forced, **call)
        assert not specs[-1].local and specs[-1].mask_mod and specs[-1].block_sparse
        assert FORWARD_STRUCT.unpack(kernel.calls[-1][2][0])[-2:] == (-1, -1)
    finally:
        fake_device.uninstall(cupy)
        forward._default.cache_clear()
