"""cuflash.attention on the GPU against the float64 NumPy reference.

Every test draws fresh random inputs, poisons the output memory first and checks every element
with the accuracy rule of :func:`cuflash.testing.assert_attention_close`.
"""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import cuflash
from cuflash.core import compile as compile_mod
from cuflash.core.spec import HEAD_DIMS
from cuflash.testing import AttentionProblem, assert_attention_close, attention_problems

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")


def run_and_check(problem: AttentionProblem, poison, seed=None, spec=None):
    q, k, v = problem.make_inputs(cupy, seed=seed)
    q_shape, _ = problem.shapes()
    out_bytes = math.prod(q_shape) * problem.numpy_dtype.itemsize
    lse_bytes = problem.batch * problem.heads * problem.seqlen_q * 4
    poison(out_bytes, lse_bytes)
    out, lse = cuflash.attention(q, k, v, causal=problem.causal, scale=problem.scale,
                                 return_lse=True, layout=problem.layout, spec=spec)
    assert out.dtype == q.dtype and out.shape == q_shape
    assert lse.dtype == cupy.float32 and lse.shape == (problem.batch, problem.heads, problem.seqlen_q)
    ref, ref_lse = problem.reference(q, k, v)
    base, base_lse = problem.naive(q, k, v)
    assert_attention_close(out, ref, problem.dtype, baseline=base, lse=lse, ref_lse=ref_lse)
    return q, k, v, out, lse


def _every_head_dim_cases():
    """Every head dim x dtype once, the causal mask taken in turn: each head dim and each dtype
    runs with and without it."""
    return [pytest.param(d, t, (i + j) % 2 == 1, id=f"{d}-{t}-{('full', 'causal')[(i + j) % 2]}")
            for i, d in enumerate(HEAD_DIMS) for j, t in enumerate(("fp16", "bf16", "fp32"))]


@pytest.mark.parametrize("head_dim,dtype,causal", _every_head_dim_cases())
def test_every_head_dim(head_dim, dtype, causal, warm_kernels, poison):
    # seqlen_q != seqlen_k, GQA, a sequence tail in both, and alternating layouts.
    layout = "bshd" if head_dim % 16 else "bhsd"
    problem = AttentionProblem(batch=2, heads=4, heads_k=2, seqlen_q=113, seqlen_k=239,
                               head_dim=head_dim, dtype=dtype, causal=causal, layout=layout)
    run_and_check(problem, poison)
    longer_q = AttentionProblem(batch=1, heads=2, heads_k=2, seqlen_q=239, seqlen_k=113,
                                head_dim=head_dim, dtype=dtype, causal=causal, layout="bhsd",
                                strided=True)
    run_and_check(longer_q, poison)


# The fixtures are session-wide or stateless helpers, safe to share between examples.
@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=attention_problems())
def test_property_against_reference(problem, warm_kernels, poison):
    run_and_check(problem, poison)


@pytest.mark.parametrize("seqlens", [(1, 1), (1, 1023), (1023, 1), (17, 17), (1023, 1023), (128, 64), (64, 128)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_awkward_lengths(seqlens, causal, warm_kernels, poison):
    sq, sk = seqlens
    problem = AttentionProblem(batch=1, heads=2, heads_k=1, seqlen_q=sq, seqlen_k=sk,
                               head_dim=128, dtype="bf16", causal=causal)
    run_and_check(problem, poison)


def test_fully_masked_rows_give_zero_and_minus_inf(warm_kernels, poison):
    # Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key.
    problem = AttentionProblem(batch=1, heads=2, heads_k=2, seqlen_q=300, seqlen_k=100,
                               head_dim=64, dtype="fp16", causal=True)
    _, _, _, out, lse = run_and_check(problem, poison)
    out, lse = cupy.asnumpy(out).astype(np.float32), cupy.asnumpy(lse)
    assert np.all(out[:, :, :200] == 0) and not np.isnan(out).any()
    assert np.all(lse[:, :, :200] == -np.inf) and np.all(np.isfinite(lse[:, :, 200:]))


def test_empty_key_sequence_gives_zero_and_minus_inf():
    q = cupy.random.standard_normal((1, 2, 5, 64), dtype=cupy.float32).astype(cupy.float16)
    k = cupy.empty((1, 2, 0, 64), dtype=cupy.float16)
    out, lse = cuflash.attention(q, k, k, return_lse=True)
    assert out.shape == q.shape and bool((out == 0).all()) and bool((lse == -cupy.inf).all())


@pytest.mark.parametrize("shape", [(0, 2, 16, 64), (2, 0, 16, 64), (2, 2, 0, 64)])
def test_empty_outputs_without_launch(shape):
    q = cupy.empty(shape, dtype=cupy.float16)
    k = cupy.random.standard_normal((shape[0], shape[1] or 1, 16, 64), dtype=cupy.float32).astype(cupy.float16)
    if shape[1] == 0:
        k = cupy.empty((shape[0], 0, 16, 64), dtype=cupy.float16)
    loads = compile_mod.stats["loads"]
    out, lse = cuflash.attention(q, k, k, return_lse=True)
    assert out.shape == shape and lse.shape == shape[:3]
    assert compile_mod.stats["loads"] == loads


def test_nan_stays_in_the_rows_that_depend_on_it(warm_kernels, poison):
    problem = AttentionProblem(batch=1, heads=1, heads_k=1, seqlen_q=200, seqlen_k=200,
                               head_dim=64, dtype="bf16", causal=True)
    q, k, v = problem.make_inputs(cupy)
    q[0, 0, 7, 3] = cupy.nan      # only query row 7 depends on it
    k[0, 0, 150, 0] = cupy.nan    # only rows >= 150 may attend key 150
    out = cupy.asnumpy(cuflash.attention(q, k, v, causal=True)).astype(np.float32)
    bad_rows = np.isnan(out[0, 0]).any(axis=-1)
    expected = np.zeros(200, dtype=bool)
    expected[7] = True
    expected[150:] = True
    np.testing.assert_array_equal(bad_rows, expected)


def test_second_call_compiles_nothing(warm_kernels):
    q = cupy.random.standard_normal((1, 2, 64, 96), dtype=cupy.float32).astype(cupy.float16)
    cuflash.attention(q, q, q)
    loads = compile_mod.stats["loads"]
    for _ in range(3):
        cuflash.attention(q, q, q)
    assert compile_mod.stats["loads"] == loads


def test_disk_cache_serves_a_new_process(tmp_path):
    """A second process with the same CUPY_CACHE_DIR compiles nothing: CuPy's cache gains no file."""
    import os
    import subprocess
    import sys

    script = (
        "import cupy, cuflash\n"
        "q = cupy.random.standard_normal((1, 1, 32, 40), dtype=cupy.float32).astype(cupy.float16)\n"
        "cuflash.attention(q, q, q, causal=True)\n"
        "cupy.cuda.Device().synchronize()\n"
    )
    env = dict(os.environ, CUPY_CACHE_DIR=str(tmp_path))

    def cached_files():
        return {(p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if p.is_file() and "cuflash" not in p.parts}

    subprocess.run([sys.executable, "-c", script], env=env, check=True)
    first = cached_files()
    assert first, "the first process left nothing in the disk cache"
    subprocess.run([sys.executable, "-c", script], env=env, check=True)
    assert cached_files() == first
    assert any(name.startswith("fwd_fp16_hd40_causal") for name in os.listdir(tmp_path / "cuflash"))


def test_runs_on_the_current_stream(warm_kernels):
    q = cupy.random.standard_normal((2, 4, 300, 64), dtype=cupy.float32).astype(cupy.float16)
    expected = cuflash.attention(q, q, q, causal=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        got = cuflash.attention(q, q, q, causal=True)
    stream.synchronize()
    assert bool((got == expected).all())


def test_offsets_beyond_32_bits(warm_kernels):
    """The second batch starts more than 2**31 elements after the first."""
    rows = 2**31 // 128 + 64
    views = []
    for _ in range(3):
        big = cupy.empty((2, rows, 128), dtype=cupy.float16)
        part = big[:, -64:, :]
        part[...] = cupy.random.standard_normal(part.shape, dtype=cupy.float32).astype(cupy.float16)
        views.append(part.reshape(2, 1, 64, 128))
    q, k, v = views
    assert q.strides[0] // q.itemsize > 2**31
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    problem = AttentionProblem(batch=2, heads=1, heads_k=1, seqlen_q=64, seqlen_k=64, head_dim=128, dtype="fp16")
    ref, ref_lse = problem.reference(q, k, v)
    assert_attention_close(out, ref, "fp16", baseline=problem.naive(q, k, v)[0], lse=lse, ref_lse=ref_lse)
    del views, q, k, v, big, part
    cupy.get_default_memory_pool().free_all_blocks()


def test_forced_spec_and_mismatch(warm_kernels):
    q = cupy.random.standard_normal((1, 2, 100, 64), dtype=cupy.float32).astype(cupy.float16)
    spec = cuflash.select_spec(cuflash.core.validate.validate(q, q, q, causal=False, scale=None, layout="bhsd"))
    forced = spec.replace(block_n=32)
    assert bool(cupy.allclose(cuflash.attention(q, q, q, spec=forced), cuflash.attention(q, q, q), atol=2e-3))
    with pytest.raises(ValueError, match="does not match"):
        cuflash.attention(q, q, q, causal=True, spec=forced)


# -- bad input ----------------------------------------------------------------------------------

def _half(shape):
    return cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)


def test_rejects_numpy_arrays():
    x = np.zeros((1, 1, 8, 64), np.float16)
    with pytest.raises(TypeError, match="q must be a cupy.ndarray"):
        cuflash.attention(x, _half((1, 1, 8, 64)), _half((1, 1, 8, 64)))


@pytest.mark.parametrize("q_shape,k_shape,v_shape,match", [
    ((1, 2, 8, 64), (1, 2, 8, 32), (1, 2, 8, 32), "head_dim"),
    ((1, 2, 8, 64), (2, 2, 8, 64), (2, 2, 8, 64), "batch"),
    ((1, 3, 8, 64), (1, 2, 8, 64), (1, 2, 8, 64), "multiple"),
    ((1, 2, 8, 64), (1, 2, 8, 64), (1, 2, 9, 64), "must be equal"),
    ((1, 2, 8, 12), (1, 2, 8, 12), (1, 2, 8, 12), "head_dim=12"),
    ((1, 2, 8, 264), (1, 2, 8, 264), (1, 2, 8, 264), "head_dim=264"),
    ((2, 8, 64), (2, 8, 64), (2, 8, 64), "4-d"),
])
def test_rejects_bad_shapes(q_shape, k_shape, v_shape, match):
    with pytest.raises(ValueError, match=match):
        cuflash.attention(_half(q_shape), _half(k_shape), _half(v_shape))


def test_rejects_dtype_mismatch_and_unsupported_dtype():
    with pytest.raises(TypeError, match="share a dtype"):
        cuflash.attention(_half((1, 1, 8, 64)), _half((1, 1, 8, 64)).astype(cupy.float32), _half((1, 1, 8, 64)))
    x = cupy.zeros((1, 1, 8, 64), cupy.float64)
    with pytest.raises(TypeError, match="float64"):
        cuflash.attention(x, x, x)


def test_rejects_strided_last_dim_layout_and_scale():
    x = _half((1, 1, 8, 128))
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        cuflash.attention(x[..., ::2], x[..., ::2], x[..., ::2])
    y = _half((1, 1, 8, 64))
    with pytest.raises(ValueError, match="layout='sbhd'"):
        cuflash.attention(y, y, y, layout="sbhd")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            cuflash.attention(y, y, y, scale=bad)
    with pytest.raises(TypeError, match="scale"):
        cuflash.attention(y, y, y, scale="0.1")


def test_rejects_a_family_that_does_not_apply():
    x = _half((1, 1, 8, 80))
    x32 = cupy.ones((1, 1, 8, 80), dtype=cupy.float32)
    with pytest.raises(ValueError, match="family"):
        cuflash.attention(x32, x32, x32, family="wgmma")  # Hopper's kernel takes fp16/bf16 only
    with pytest.raises(ValueError, match="family"):
        cuflash.attention(x, x, x, family="simt")
    with pytest.raises(ValueError, match="family"):
        cuflash.attention(x, x, x, family="fast")


def test_rejects_arrays_on_different_devices():
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with cupy.cuda.Device(1):
        k = _half((1, 1, 8, 64))
    with pytest.raises(ValueError, match="one device"):
        cuflash.attention(_half((1, 1, 8, 64)), k, k)


# -- the Hopper family -------------------------------------------------------------------------

def _hopper() -> bool:
    return compile_mod.device_arch() == "sm90a"


def _warm_hopper(specs) -> None:
    """Compile a test's Hopper kernels at once, in parallel processes (skips off sm_90a)."""
    if not _hopper():
        pytest.skip("the wgmma family needs sm_90a")
    cuflash.warmup(specs, progress=False)


def _both_families_cases():
    """Each family at each head dim with and without the causal mask, the dtypes taken in turn:
    every (family, head dim) runs in both dtypes."""
    return [pytest.param(f, d, ("fp16", "bf16")[(i + j + c) % 2], bool(c),
                         id=f"{f}-{d}-{('fp16', 'bf16')[(i + j + c) % 2]}-{('full', 'causal')[c]}")
            for i, f in enumerate(("wgmma", "mma")) for j, d in enumerate((64, 128, 192, 256)) for c in (0, 1)]


@pytest.mark.parametrize("family,head_dim,dtype,causal", _both_families_cases())
def test_both_tensor_core_families(family, head_dim, dtype, causal, warm_kernels, poison):
    """Where the Hopper family is the default, the portable one must stay right too."""
    if family == "wgmma" and not _hopper():
        pytest.skip("the wgmma family needs sm_90a")
    for sq, sk, layout, strided in ((113, 239, "bhsd", False), (239, 113, "bshd", True), (1, 1, "bhsd", False),
                                    (300, 300, "bshd", False)):
        problem = AttentionProblem(batch=2, heads=4, heads_k=2, seqlen_q=sq, seqlen_k=sk, head_dim=head_dim,
                                   dtype=dtype, causal=causal, layout=layout, strided=strided)
        q, k, v = problem.make_inputs(cupy)
        poison(math.prod(problem.shapes()[0]) * 2, problem.batch * problem.heads * sq * 4)
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, layout=layout, family=family)
        ref, ref_lse = problem.reference(q, k, v)
        base, _ = problem.naive(q, k, v)
        assert_attention_close(out, ref, dtype, baseline=base, lse=lse, ref_lse=ref_lse)


def _keys_rising_in_steps(k, tiles_of: int, step: float):
    """k with each run of ``tiles_of`` keys scaled up by ``step`` more than the run after it: the
    kernels visit key tiles from the last to the first, so each row's max rises tile after tile,
    by more than the lazy slack on some tiles and by less on others."""
    seqlen_k = k.shape[2]
    factors = 1 + step * ((seqlen_k - 1 - cupy.arange(seqlen_k)) // tiles_of)
    return (k.astype(cupy.float32) * factors[:, None]).astype(k.dtype)


LAZY_SEQLEN_K = 1700  # 14 to 22 key tiles


def _lazy_specs(head_dim, dtype, causal):
    """The Hopper kernel of a problem with LAZY_SEQLEN_K keys, with and without lazy_rescale."""
    from cuflash.core.policy import default_spec

    spec = default_spec(head_dim, dtype, causal, "sm90a", seqlen=LAZY_SEQLEN_K)
    return [spec.replace(lazy_rescale=lazy) for lazy in (True, False)]


def _other_schedule_spec(schedule, head_dim, block_n, causal):
    from cuflash.core.spec import KernelSpec

    ws = schedule != "overlap"
    return KernelSpec(head_dim, "bf16", causal, 128, block_n, 12 if ws else 8, 3, "sm90a",
                      overlap=True, family="wgmma", warp_specialized=ws, pingpong=schedule == "pingpong")


# (schedule, head_dim, block_n, causal): every schedule at every head dim once, the causal mask
# taken in turn, so each schedule and each head dim runs with and without it
OTHER_SCHEDULES = [(schedule, head_dim, block_n, (i + j) % 2 == 1)
                   for i, schedule in enumerate(("overlap", "warp_specialized", "pingpong"))
                   for j, (head_dim, block_n) in enumerate(((64, 64), (128, 96), (256, 48)))]

# (head_dim, dtype, causal): each head dim with and without the causal mask, the dtypes taken in
# turn (each head dim and each mask in both)
LAZY_CASES = [(hd, ("fp16", "bf16")[(i + c) % 2], bool(c)) for i, hd in enumerate((64, 128, 256)) for c in (0, 1)]


def _other_schedule_specs():
    return [_other_schedule_spec(*case) for case in OTHER_SCHEDULES]


def _all_lazy_specs():
    return [s for case in LAZY_CASES for s in _lazy_specs(*case)]


@pytest.fixture(scope="module")
def warm_other_schedule_kernels():
    _warm_hopper(_other_schedule_specs())


@pytest.fixture(scope="module")
def warm_lazy_kernels():
    _warm_hopper(_all_lazy_specs())


@pytest.mark.parametrize("head_dim,dtype,causal", LAZY_CASES,
                         ids=[f"{hd}-{dt}-{('full', 'causal')[c]}" for hd, dt, c in LAZY_CASES])
def test_hopper_lazy_row_max(head_dim, dtype, causal, warm_lazy_kernels, poison):
    """The Hopper kernel with and without lazy_rescale (the row max moves only by more than a
    slack, the output's rescale skipped while no row of a warp moves) on maxima that rise over
    many key tiles: the same accuracy rule."""
    sq, sk = (200, LAZY_SEQLEN_K) if not causal else (LAZY_SEQLEN_K, LAZY_SEQLEN_K)
    problem = AttentionProblem(batch=1, heads=2, heads_k=1, seqlen_q=sq, seqlen_k=sk, head_dim=head_dim,
                               dtype=dtype, causal=causal)
    specs = _lazy_specs(head_dim, dtype, causal)
    for step in (0.02, 0.15):
        q, k, v = problem.make_inputs(cupy)
        k = _keys_rising_in_steps(k, 100, step)
        ref, ref_lse = problem.reference(q, k, v)
        base, base_lse = problem.naive(q, k, v)
        for spec in specs:
            poison(math.prod(problem.shapes()[0]) * 2, sq * 2 * 4)
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, spec=spec)
            assert_attention_close(out, ref, dtype, baseline=base, lse=lse, ref_lse=ref_lse)


def _half_first_tile_specs():
    """Hopper kernels that compute a first key tile half wide where no row of a warpgroup sees
    its second half: head dim 64's tiles of both length classes (two and three consumers), and
    the tiles of 128 (128 keys) and 192 (96 keys)."""
    from cuflash.core.policy import default_spec

    return [default_spec(hd, dtype, causal, "sm90a", seqlen=seqlen).replace(half_first_tile=True)
            for hd, dtype, seqlen in ((64, "bf16", 1024), (64, "fp16", 4096), (128, "bf16", None), (192, "fp16", None))
            for causal in (False, True)]


@pytest.fixture(scope="module")
def warm_half_first_tile_kernels():
    _warm_hopper(_half_first_tile_specs())


@pytest.mark.parametrize("spec", _half_first_tile_specs(), ids=lambda s: s.name)
def test_hopper_half_first_tile(spec, warm_half_first_tile_kernels, poison):
    """half_first_tile: the causal diagonal (queries and keys aligned, more keys than queries,
    more queries than keys: rows that see nothing) and key tails shorter and longer than half a
    tile, against the float64 reference."""
    shapes = ((300, 300), (130, 400), (400, 130), (77, 1000)) if spec.causal else ((150, 300), (150, 200))
    for sq, sk in shapes:
        problem = AttentionProblem(batch=1, heads=3, heads_k=1, seqlen_q=sq, seqlen_k=sk, head_dim=spec.head_dim,
                                   dtype=spec.dtype, causal=spec.causal)
        run_and_check(problem, poison, spec=spec)


def _key_loop_specs():
    """Hopper kernels with each choice of mask_in_loop (every key tile checked for a mask, or
    the masked ones in a loop of their own) and early_rescale (the output rescaled before its
    P V or after): head dim 64's long tiles (three consumers), 128 (ping-pong off without a
    mask) and 256 (lazy row max)."""
    from cuflash.core.policy import default_spec

    return [default_spec(hd, dtype, causal, "sm90a").replace(mask_in_loop=mask, early_rescale=early)
            for hd, dtype in ((64, "fp16"), (128, "bf16"), (256, "bf16")) for causal in (False, True)
            for mask in (False, True) for early in (False, True)]


@pytest.fixture(scope="module")
def warm_key_loop_kernels():
    _warm_hopper(_key_loop_specs())


#: The warm fixtures' kernels on sm_90a, by fixture name: the session compiles them in its first pool.
WARM_HOPPER = {"warm_other_schedule_kernels": _other_schedule_specs, "warm_lazy_kernels": _all_lazy_specs,
               "warm_half_first_tile_kernels": _half_first_tile_specs, "warm_key_loop_kernels": _key_loop_specs}


@pytest.mark.parametrize("spec", _key_loop_specs(), ids=lambda s: s.name)
def test_hopper_key_loop_variants(spec, warm_key_loop_kernels, poison):
    """mask_in_loop and early_rescale: causal diagonals that span one, two or more key tiles
    (queries and keys aligned, more keys than queries, more queries than keys), key tails, and
    keys whose scale rises tile after tile (so that the rescale matters), against the float64
    reference."""
    shapes = ((300, 300), (130, 700), (700, 130), (77, 1000)) if spec.causal else ((150, 300), (150, 1000))
    for sq, sk in shapes:
        problem = AttentionProblem(batch=1, heads=2, heads_k=1, seqlen_q=sq, seqlen_k=sk, head_dim=spec.head_dim,
                                   dtype=spec.dtype, causal=spec.causal)
        q, k, v = problem.make_inputs(cupy)
        k = _keys_rising_in_steps(k, 100, 0.1)
        ref, ref_lse = problem.reference(q, k, v)
        base, _ = problem.naive(q, k, v)
        poison(math.prod(problem.shapes()[0]) * 2, sq * 2 * 4)
        out, lse = cuflash.attention(q, k, v, causal=spec.causal, return_lse=True, spec=spec)
        assert_attention_close(out, ref, spec.dtype, baseline=base, lse=lse, ref_lse=ref_lse)


def test_hopper_defaults_of_both_length_classes(poison):
    """Every default Hopper kernel, short and long sequences' tiles alike, on small problems
    (forced), and the dispatch: a problem past SHORT_SEQLEN runs the long class's kernel. With
    60 queries, the consumers of rows 64.. have no row to compute. Each kernel runs that problem
    and one of seqlen_q < seqlen_k (bhsd) and seqlen_q > seqlen_k (bshd), taken in turn so that
    each head dim, dtype, mask and length class meets both."""
    if not _hopper():
        pytest.skip("the wgmma family needs sm_90a")
    from cuflash.core.policy import SHORT_SEQLEN, all_default_specs, default_spec

    specs = all_default_specs("sm90a", ["fp16", "bf16"], family="wgmma")
    cuflash.warmup(specs, progress=False)
    for i, spec in enumerate(specs):
        tails = ((113, 239, "bhsd"), (239, 113, "bshd"))[(i + i // 4) % 2]
        for sq, sk, layout in (tails, (60, 300, "bhsd")):
            problem = AttentionProblem(batch=2, heads=4, heads_k=2, seqlen_q=sq, seqlen_k=sk, head_dim=spec.head_dim,
                                       dtype=spec.dtype, causal=spec.causal, layout=layout)
            run_and_check(problem, poison, spec=spec)
    problem = AttentionProblem(batch=1, heads=2, heads_k=1, seqlen_q=100, seqlen_k=SHORT_SEQLEN + 50, head_dim=64,
                               dtype="bf16", causal=True)
    q, k, v = problem.make_inputs(cupy)
    chosen = cuflash.select_spec(cuflash.core.validate.validate(q, k, v, causal=True, scale=None, layout="bhsd"))
    assert chosen == default_spec(64, "bf16", True, "sm90a", seqlen=SHORT_SEQLEN + 1)
    run_and_check(problem, poison)


def test_hopper_work_tiles_counted_per_stream():
    """The warp-specialized kernel's blocks take work tiles from a counter that each launch
    leaves at zero; two streams running at once each have their own. Repeated launches on both
    must all give the reference."""
    if not _hopper():
        pytest.skip("the warp-specialized kernel needs sm_90a")
    # 4 x 16 x 7 = 448 work tiles of 128 rows on 132 multiprocessors; kept short for the float64
    # reference's sake
    problem = AttentionProblem(batch=4, heads=16, heads_k=4, seqlen_q=800, seqlen_k=800, head_dim=128,
                               dtype="bf16", causal=True)
    inputs = [problem.make_inputs(cupy) for _ in range(2)]
    refs = [problem.reference(*x)[0] for x in inputs]
    bases = [problem.naive(*x)[0] for x in inputs]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    for _ in range(3):
        outs = []
        for x, stream in zip(inputs, streams):
            with stream:
                outs.append(cuflash.attention(*x, causal=True))
        for stream in streams:
            stream.synchronize()
        for out, ref, base in zip(outs, refs, bases):
            assert_attention_close(out, ref, "bf16", baseline=base)


# each head dim once, the causal mask taken in turn
@pytest.mark.parametrize("head_dim,causal", [(64, False), (96, True), (128, False), (256, True)],
                         ids=["64-full", "96-causal", "128-full", "256-causal"])
def test_hopper_blocks_walking_many_tiles(head_dim, causal, poison):
    """More work tiles than multiprocessors: persistent blocks (non-causal) take several tiles
    each, the ring and the turn-taking run on across tiles; causal rows of the first query tiles
    attend nothing (seqlen_q > seqlen_k)."""
    if not _hopper():
        pytest.skip("the warp-specialized kernel needs sm_90a")
    # 2 x 40 heads: 160 to 240 work tiles at 300 queries, 320 to 400 at 600, on 132 multiprocessors
    for sq, sk in ((300, 257), (600, 300)):
        problem = AttentionProblem(batch=2, heads=40, heads_k=8, seqlen_q=sq, seqlen_k=sk, head_dim=head_dim,
                                   dtype="bf16", causal=causal)
        q, k, v = problem.make_inputs(cupy)
        poison(math.prod(problem.shapes()[0]) * 2, problem.batch * problem.heads * sq * 4)
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        ref, ref_lse = problem.reference(q, k, v)
        assert_attention_close(out, ref, "bf16", baseline=problem.naive(q, k, v)[0], lse=lse, ref_lse=ref_lse)


@pytest.mark.parametrize("band_bytes,band", [(0, 1), (2 * 300 * 64 * 2 * 3, 3), (1 << 30, 6)])
def test_hopper_causal_tiles_in_bands(band_bytes, band, monkeypatch, poison):
    """Causal work tiles go heaviest first across bands of (batch, head) pairs (launch.band_heads):
    one pair per band, three (a divisor of the six pairs) and all six. Persistent blocks (300
    keys) and one block per tile (4100 keys), query tiles that see no key (seqlen_q > seqlen_k)."""
    if not _hopper():
        pytest.skip("the warp-specialized kernel needs sm_90a")
    from cuflash.core import launch, policy
    from cuflash.core.policy import default_spec
    from cuflash.core.validate import validate
    for sq, sk in ((700, 300), (300, 4100)):
        for name in ("BAND_BYTES", "BAND_SHORT_BYTES"):
            monkeypatch.setattr(policy, name, band_bytes * sk // 300)
        problem = AttentionProblem(batch=2, heads=3, heads_k=1, seqlen_q=sq, seqlen_k=sk, head_dim=64, dtype="bf16",
                                   causal=True)
        q, k, v = problem.make_inputs(cupy)
        spec = default_spec(64, "bf16", True, "sm90a", seqlen=sk)
        assert launch.band_heads(spec, validate(q, k, v, causal=True, scale=None, layout="bhsd")) == band
        ref, ref_lse = problem.reference(q, k, v)
        base = problem.naive(q, k, v)[0]
        for _ in range(2):
            poison(math.prod(problem.shapes()[0]) * 2, problem.batch * problem.heads * sq * 4)
            out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
            assert_attention_close(out, ref, "bf16", baseline=base, lse=lse, ref_lse=ref_lse)


@pytest.mark.parametrize("head_dim,dtype,layout", [(96, "fp16", "bshd"), (128, "bf16", "bhsd"), (192, "bf16", "bshd"),
                                                      (256, "bf16", "bhsd")])
def test_hopper_last_tiles_dealt_out_by_keys(head_dim, dtype, layout, poison):
    """Without a causal mask, tiles that would leave the last wave of blocks part-empty are dealt
    out by keys (launch.split_plan): shares that end inside a tile leave its state in the
    workspace, the next share merges it. Every tile, split or not, must match the reference, in
    two launches one after the other (the flags must be back at zero)."""
    if not _hopper():
        pytest.skip("the warp-specialized kernel needs sm_90a")
    from cuflash.core.launch import split_plan
    from cuflash.core.policy import default_spec
    from cuflash.core.validate import validate
    # 280 query tiles (1 x 140 heads x 2) on 132 multiprocessors; small, for the float64 reference's sake
    problem = AttentionProblem(batch=1, heads=140, heads_k=20, seqlen_q=129, seqlen_k=1100, head_dim=head_dim,
                               dtype=dtype, causal=False, layout=layout)
    q, k, v = problem.make_inputs(cupy)
    spec = default_spec(head_dim, dtype, False, "sm90a", seqlen=problem.seqlen_k)
    plan = split_plan(spec, validate(q, k, v, causal=False, scale=None, layout=layout))
    assert plan.shares_end_inside_tiles
    ref, ref_lse = problem.reference(q, k, v)
    base = problem.naive(q, k, v)[0]
    for _ in range(2):
        poison(math.prod(problem.shapes()[0]) * 2, problem.batch * problem.heads * problem.seqlen_q * 4)
        out, lse = cuflash.attention(q, k, v, return_lse=True, layout=layout)
        assert_attention_close(out, ref, dtype, baseline=base, lse=lse, ref_lse=ref_lse)


@pytest.mark.parametrize("schedule,head_dim,block_n,causal", OTHER_SCHEDULES,
                         ids=[f"{s}-{d}-{n}-{('full', 'causal')[c]}" for s, d, n, c in OTHER_SCHEDULES])
def test_wgmma_other_schedules(schedule, head_dim, block_n, causal, warm_other_schedule_kernels, poison):
    """overlap: the next tile's QK^T is issued before this tile's softmax. warp_specialized: a
    TMA producer feeds two consumer warpgroups through mbarriers; pingpong: the consumers take
    turns on the tensor cores."""
    if not _hopper():
        pytest.skip("the wgmma family needs sm_90a")
    spec = _other_schedule_spec(schedule, head_dim, block_n, causal)
    for sq, sk in ((239, 113), (113, 239), (300, 300), (1, 1)):
        problem = AttentionProblem(batch=2, heads=2, heads_k=1, seqlen_q=sq, seqlen_k=sk, head_dim=head_dim,
                                   dtype="bf16", causal=causal)
        q, k, v = problem.make_inputs(cupy)
        poison(math.prod(problem.shapes()[0]) * 2, problem.batch * problem.heads * sq * 4)
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, spec=spec)
        ref, ref_lse = problem.reference(q, k, v)
        assert_attention_close(out, ref, "bf16", baseline=problem.naive(q, k, v)[0], lse=lse, ref_lse=ref_lse)
