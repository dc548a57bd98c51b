"""FP8 encoding, quantization and the outlier rotation, in NumPy (no GPU needed)."""
import math

import ml_dtypes
import numpy as np
import pytest

from cuflash.fp8 import FORMATS, dequantize_fp8, from_fp8_bits, quantize_fp8, random_rotation, to_fp8_bits
from cuflash.reference import attention_reference

ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_code_decodes_like_ml_dtypes_and_encodes_back(name):
    codes = np.arange(256, dtype=np.uint8)
    values = from_fp8_bits(codes, name)
    want = codes.view(ML[name]).astype(np.float32)
    np.testing.assert_array_equal(values, want)  # NaN positions included
    finite = np.isfinite(values)
    np.testing.assert_array_equal(to_fp8_bits(values[finite], name), codes[finite])


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_rounding_is_to_nearest_even_and_saturating(name):
    fmt = FORMATS[name]
    codes = np.arange(0x80, dtype=np.uint8)
    values = from_fp8_bits(codes, name)
    values = values[np.isfinite(values)]
    midpoints = ((values[:-1].astype(np.float64) + values[1:]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    scales = (1e-6, 1e-3, 1.0, 30.0, 1e3, 1e5)
    x = np.concatenate([midpoints, -midpoints] + [rng.standard_normal(20000).astype(np.float32) * s for s in scales])
    want = np.clip(x, -fmt.max, fmt.max).astype(ML[name]).view(np.uint8)
    np.testing.assert_array_equal(to_fp8_bits(x, name), want)
    special = to_fp8_bits(np.array([np.inf, -np.inf, 1e30, -1e30, np.nan, -0.0], dtype=np.float32), name)
    top = to_fp8_bits(np.float32(fmt.max), name)
    assert special.tolist() == [top, top | 0x80, top, top | 0x80, fmt.nan_code, 0x80]


# -- the portable kernel's on-chip conversion (templates/include/cuflash/fp8_tiles.cuh) in NumPy --

def _byte_perm(x, y, selector):
    """CUDA's __byte_perm(x, y, s) on uint32 arrays: byte i of the result is byte (s >> 4i) & 7 of
    the 8 bytes y:x (x's bytes 0-3, then y's)."""
    pool = np.stack([(x >> (8 * b)) & 0xFF for b in range(4)] + [(y >> (8 * b)) & 0xFF for b in range(4)])
    return sum(pool[(selector >> (4 * i)) & 7] << (8 * i) for i in range(4)).astype(np.uint32)


def _fp8x4_to_fp16x4(codes, e4m3):
    """fp8x4_to_fp16x4 step for step: uint32 words of 4 codes -> (lo, hi) words of 2 fp16 each."""
    codes = codes.astype(np.uint32)
    if e4m3:
        magnitude = codes & np.uint32(0x7F7F7F7F)
        flagged = magnitude | ((magnitude + np.uint32(0x01010101)) & np.uint32(0x80808080))
        sign = (codes >> 7) & np.uint32(0x01010101)
        return (_byte_perm(flagged, sign, 0x5140) << 7) & np.uint32(0xFFFFFFFF), \
            (_byte_perm(flagged, sign, 0x7362) << 7) & np.uint32(0xFFFFFFFF)
    zero = np.zeros_like(codes)
    return _byte_perm(codes, zero, 0x1404), _byte_perm(codes, zero, 0x3424)


def test_the_model_uses_the_kernel_constants():
    from cuflash.core.render import include_dir
    source = (include_dir() / "cuflash" / "fp8_tiles.cuh").read_text()
    for constant in ("0x7f7f7f7fu", "0x01010101u", "0x80808080u", "(codes >> 7) & 0x01010101u", "0x5140) << 7",
                     "0x7362) << 7", "__byte_perm(codes, 0u, 0x1404)", "__byte_perm(codes, 0u, 0x3424)"):
        assert constant in source, constant


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_on_chip_conversion_of_every_code(name):
    """Every code, in every byte position of a word: e5m2 gives its value as fp16, e4m3 its value
    times 2^-8 (exactly, subnormals included; the kernel multiplies the 2^8 back in), and every
    NaN code a NaN (e4m3 has no infinities; e5m2's stay infinities)."""
    codes = np.arange(256, dtype=np.uint8)
    words = np.stack([np.roll(codes, shift) for shift in range(4)], axis=-1).copy().view("<u4")[..., 0]
    lo, hi = _fp8x4_to_fp16x4(words, name == "e4m3")
    halves = np.stack([lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16], axis=-1).astype(np.uint16)
    got = halves.view(np.float16).astype(np.float64).reshape(-1)
    want = words.view(np.uint8).view(ML[name]).astype(np.float64).reshape(-1)
    if name == "e4m3":
        want = want * 2.0 ** -8
    np.testing.assert_array_equal(got, want)  # NaN and infinity positions included
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("granularity,descale_shape", [("tensor", ()), ("head", (2, 3)), ("block", (2, 3, 3))])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantize_round_trip_within_half_a_step(name, granularity, descale_shape):
    fmt = FORMATS[name]
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 3, 300, 64)) * rng.uniform(0.1, 10, size=(2, 3, 1, 1))).astype(np.float32)
    bits, descale = quantize_fp8(x, name, granularity, block=128)
    assert bits.dtype == np.uint8 and bits.shape == x.shape
    assert descale.dtype == np.float32 and descale.shape == descale_shape
    back = dequantize_fp8(bits, descale, name, granularity, block=128)
    # Relative rounding error of a normal value is at most 2^-(mantissa bits + 1); the smallest
    # values of a group are subnormal, off by at most half a subnormal step.
    scale = np.broadcast_to(descale.reshape(descale.shape + (1,) * (4 - descale.ndim)) if granularity != "block"
                            else np.repeat(descale, 128, axis=2)[:, :, :300, None], x.shape)
    bound = np.maximum(np.abs(x) * 2.0 ** -(fmt.mantissa_bits + 1), scale * fmt.subnormal_step / 2) * 1.0001
    assert np.all(np.abs(back - x) <= bound)
    assert np.abs(from_fp8_bits(bits, name)).max() == fmt.max  # each group's peak maps to the largest value


def test_layouts_and_zero_groups():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 50, 16)).astype(np.float32)
    x[0, 1] = 0
    bits, descale = quantize_fp8(x, "e4m3", "head")
    assert descale[0, 1] == 1 and not bits[0, 1].any()
    bits_s, descale_s = quantize_fp8(x.transpose(0, 2, 1, 3), "e4m3", "head", layout="bshd")
    np.testing.assert_array_equal(bits_s, bits.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(descale_s, descale)
    with pytest.raises(ValueError, match="granularity='row'"):
        quantize_fp8(x, "e4m3", "row")
    with pytest.raises(ValueError, match="fp8_format='e3m4'"):
        quantize_fp8(x, "e3m4")


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_rotation_is_orthogonal_and_keeps_scores(head_dim):
    r = random_rotation(head_dim, seed=3)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-5)
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((2, 10, head_dim)), rng.standard_normal((2, 12, head_dim))
    np.testing.assert_allclose((q @ r) @ (k @ r).swapaxes(-1, -2), q @ k.swapaxes(-1, -2), atol=1e-4)


def outlier_inputs(head_dim=128, seqlen=256, seed=5):
    """q, k, v drawn N(0, 1) with a few head-dim channels of q and k 50x larger (activation outliers)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 2, seqlen, head_dim)).astype(np.float32) for _ in range(3))
    channels = rng.choice(head_dim, size=4, replace=False)
    q[..., channels] *= 50
    k[..., channels] *= 50
    return q, k, v


def fp8_attention_error(q, k, v, name, granularity, rotation=None):
    """max |attention of the dequantized inputs - float64 attention of the originals|."""
    scale = 1 / np.sqrt(q.shape[-1]) / 50  # keep the outlier scores in a softmax-friendly range
    ref, _ = attention_reference(q, k, v, scale=scale)
    deq = [dequantize_fp8(*quantize_fp8(x, name, granularity, rotation=rotation if x is not v else None),
                          name, granularity) for x in (q, k, v)]
    out, _ = attention_reference(*deq, scale=scale)
    return float(np.abs(out - ref).max())


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_rotation_lowers_the_error_on_outliers(name):
    q, k, v = outlier_inputs()
    plain = fp8_attention_error(q, k, v, name, "head")
    rotated = fp8_attention_error(q, k, v, name, "head", random_rotation(q.shape[-1], seed=0))
    assert rotated < plain


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_cupy_arrays_quantize_like_numpy(name, granularity):
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(6)
    clean = (rng.standard_normal((2, 3, 200, 64)) * 20).astype(np.float32)
    x = clean.copy()
    x[0, 0, 0, :3] = [np.nan, np.inf, -1e30]
    plain, plain_descale = quantize_fp8(x, name, granularity)
    plain_gpu, plain_descale_gpu = quantize_fp8(cupy.asarray(x), name, granularity)
    assert isinstance(plain_gpu, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(plain_gpu), plain)
    np.testing.assert_array_equal(cupy.asnumpy(plain_descale_gpu), plain_descale)
    # The rotation's matrix product may round differently on the GPU: within one code there.
    r = random_rotation(64, seed=1)
    bits, descale = quantize_fp8(clean, name, granularity, rotation=r)
    bits_gpu, descale_gpu = quantize_fp8(cupy.asarray(clean), name, granularity, rotation=cupy.asarray(r))
    assert np.abs(cupy.asnumpy(bits_gpu).astype(int) - bits.astype(int)).max() <= 1
    np.testing.assert_allclose(cupy.asnumpy(descale_gpu), descale, rtol=1e-5)


# -- FP8 attention problems, the naive model's error, the bench helpers (CPU) --------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cuflash.tools import bench, cli, machine  # noqa: E402
from cuflash.testing import (MAX_PROBLEM_WORK, TOLERANCES, Fp8AttentionProblem,  # noqa: E402
                             assert_attention_close, fp8_attention_problems)


def test_fp8_problem_inputs_match_the_problem():
    problem = Fp8AttentionProblem(2, 4, 2, 17, 113, 64, "e5m2", "head", "fp16", causal=True, layout="bshd")
    inputs = problem.make_inputs(seed=1)
    q_shape, kv_shape = problem.shapes()
    assert (q_shape, kv_shape) == ((2, 17, 4, 64), (2, 113, 2, 64))
    assert inputs.q.shape == q_shape and inputs.k.shape == inputs.v.shape == kv_shape
    assert inputs.q.dtype == inputs.k.dtype == inputs.v.dtype == np.uint8
    assert inputs.q_descale.shape == (2, 4) and inputs.k_descale.shape == inputs.v_descale.shape == (2, 2)
    assert problem.name == "e5m2/head->fp16 hd64 causal b2 h4/2 sq17 sk113 bshd"
    again = problem.make_inputs(seed=1)
    np.testing.assert_array_equal(again.q, inputs.q)
    assert not np.array_equal(problem.make_inputs(seed=2).q, inputs.q)
    back = dequantize_fp8(inputs.k, inputs.k_descale, "e5m2", "head", layout="bshd")
    assert np.abs(back - inputs.originals[1]).max() < 0.25 * np.abs(inputs.originals[1]).max()
    tensor = Fp8AttentionProblem(1, 2, 2, 5, 5, 128).make_inputs(seed=0)
    assert tensor.q_descale.shape == () and tensor.v_descale.dtype == np.float32
    kwargs = problem.attention_kwargs(inputs)
    assert kwargs["fp8_format"] == "e5m2" and kwargs["out_dtype"] == "fp16" and kwargs["layout"] == "bshd"
    out, lse = problem.naive(inputs)
    ref, ref_lse = problem.reference(inputs)
    assert out.dtype == np.float16 and out.shape == ref.shape == q_shape and lse.shape == ref_lse.shape == (2, 4, 17)
    assert_attention_close(out, ref, "e5m2", baseline=out, lse=lse, ref_lse=ref_lse)


def test_fp8_problem_validation_and_rotation():
    with pytest.raises(ValueError, match="fp8_format='e3m4'"):
        Fp8AttentionProblem(1, 1, 1, 4, 4, 64, "e3m4")
    with pytest.raises(ValueError, match="granularity='block'"):
        Fp8AttentionProblem(1, 1, 1, 4, 4, 64, granularity="block")
    with pytest.raises(ValueError, match="out_dtype='fp32'"):
        Fp8AttentionProblem(1, 1, 1, 4, 4, 64, out_dtype="fp32")
    with pytest.raises(ValueError, match="heads=3 must be a multiple"):
        Fp8AttentionProblem(1, 3, 2, 4, 4, 64)
    plain = Fp8AttentionProblem(1, 2, 2, 64, 64, 64, outliers=4)
    rotated = Fp8AttentionProblem(1, 2, 2, 64, 64, 64, outliers=4, rotate=True)
    a, b = plain.make_inputs(seed=3), rotated.make_inputs(seed=3)
    for x, y in zip(a.originals, b.originals):   # the same float inputs, quantized apart
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.q, b.q) and np.array_equal(a.v, b.v)
    assert "outliers4x50 rotated" in rotated.name


def test_fp8_tolerance_rows():
    assert TOLERANCES["e4m3"].lse_atol >= TOLERANCES["bf16"].lse_atol
    ref = np.zeros((1, 1, 2, 8))
    out = ref + 0.01
    assert_attention_close(out, ref, "e4m3")                 # within the fallback's atol
    with pytest.raises(AssertionError, match="e5m2"):
        assert_attention_close(out + 0.1, ref, "e5m2", baseline=ref)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=fp8_attention_problems(max_seqlen=300, max_work=1 << 22, outliers=True), seed=st.integers(0, 2**16))
def test_fp8_naive_error_stays_within_its_bound(problem, seed):
    """The naive model's error against the float64 attention of the dequantized inputs comes from
    P rounded to e4m3 (at most 2^-4 P, or 2^-18 where 256 P is subnormal) and the output's
    rounding: |out - ref| <= max|v| (2^-4 + seqlen_k 2^-18) + u_out |ref|, whatever the format."""
    inputs = problem.make_inputs(seed=seed)
    out, lse = problem.naive(inputs)
    ref, ref_lse = problem.reference(inputs)
    assert out.dtype == problem.out_numpy_dtype and lse.dtype == np.float32
    v = dequantize_fp8(inputs.v, inputs.v_descale, problem.fp8_format, problem.granularity, layout=problem.layout)
    v_max = float(np.abs(v).max()) if v.size else 0.0
    unit = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}[problem.out_dtype]
    bound = v_max * (2.0 ** -4 + problem.seqlen_k * 2.0 ** -18) * 1.001 + unit * np.abs(ref) + 1e-6
    error = np.abs(out.astype(np.float64) - ref)
    assert np.all(error <= bound), problem.name
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-4)
    assert_attention_close(out, ref, problem.fp8_format, baseline=out, lse=lse, ref_lse=ref_lse)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_naive_rotation_lowers_the_error_on_outliers(head_dim, fmt):
    errors = {}
    for rotate in (False, True):
        problem = Fp8AttentionProblem(1, 2, 2, 256, 256, head_dim, fmt, "head", scale=1 / (50 * np.sqrt(head_dim)),
                                      outliers=4, rotate=rotate)
        inputs = problem.make_inputs(seed=5)
        out, _ = problem.naive(inputs)
        errors[rotate] = np.abs(out.astype(np.float64) - problem.float_reference(inputs)[0]).max()
    assert errors[True] < errors[False]


def test_fp8_strategy_respects_its_arguments():
    @settings(max_examples=20, deadline=None)
    @given(problem=fp8_attention_problems(head_dims=(128,), formats=("e5m2",), granularities=("head",),
                                          out_dtypes=("fp16",), causal=True, layouts=("bshd",), allow_gqa=False))
    def check(problem):
        assert (problem.head_dim, problem.fp8_format, problem.granularity, problem.out_dtype) == (128, "e5m2", "head",
                                                                                                  "fp16")
        assert problem.causal and problem.layout == "bshd" and problem.heads == problem.heads_k
        assert problem.work <= MAX_PROBLEM_WORK and problem.outliers == 0
    check()


# -- bench --dtype fp8 and --fp8-errors without a GPU ---------------------------------------------------

class _FakePreparedV:
    def __init__(self, v):
        self.v = v


def _fake_fp8_attention(calls):
    def attention(q, k, v, *, causal=False, fp8_format=None, out_dtype=None, **kwargs):
        calls.append("prepared" if isinstance(v, _FakePreparedV) else fp8_format)
        shape = q.shape
        return np.full(shape, 0.5 if fp8_format else 0.25, dtype=np.float32).astype(ml_dtypes.bfloat16)
    return attention


def test_bench_fp8_config_times_fp8_beside_bf16(monkeypatch):
    import cuflash
    calls = []
    monkeypatch.setattr(cuflash, "attention", _fake_fp8_attention(calls))
    monkeypatch.setattr(cuflash, "prepare_v", _FakePreparedV)
    monkeypatch.setattr(bench.runner, "random_inputs", lambda shape, tag, seed=0: tuple(
        np.random.default_rng(seed + i).standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
        for i in range(3)))
    timed = []
    ms = {"e4m3": 1.0, None: 1.5, "prepared": 0.75}   # the FP8 call, the bf16 one, FP8 on a prepared V

    def fake_times(fn, reps=30, warmup=3, flush_l2=True):
        fn()
        timed.append((calls[-1], reps, warmup))
        return [ms[calls[-1]]] * reps

    monkeypatch.setattr(bench.timing, "cuda_event_times_ms", fake_times)
    monkeypatch.setattr(bench.runner, "_free_device_memory", lambda: None)
    config = bench.paper_grid(head_dims=(128,), seqlens=(1024,), causal=(True,), dtype="fp8")[0]
    result = bench.bench_config(config, arch="sm90a", reps=2, fp8_format="e4m3")
    assert result["error"] is None and result["spec"].startswith("fwd_e4m3obf16_hd128_causal")
    assert result["fp8_format"] == "e4m3"
    from cuflash.reference import attention_flops
    flops = attention_flops(config.batch, config.heads, 1024, 1024, 128, True)
    assert result["flops"] == flops and result["tflops"] == pytest.approx(flops / 1.0 / 1e9)
    peer = result["peers"]["cuflash-bf16"]
    assert peer["tflops"] == pytest.approx(flops / 1.5 / 1e9) and peer["ratio"] == pytest.approx(1.5)
    assert peer["max_abs_diff"] == pytest.approx(0.25)
    prepared = result["peers"]["cuflash-fp8-prepared-v"]
    assert prepared["tflops"] == pytest.approx(flops / 0.75 / 1e9) and prepared["ratio"] == pytest.approx(2.0)
    assert prepared["max_abs_diff"] == 0 and prepared["error"] is None
    # Interleaved: 2 repetitions over 2 rounds of 1, the second round starting one further on. Each
    # first times one call after 3 warm-up calls, then heats every share with BENCH_HEAT_MS of calls.
    heat = {tag: math.ceil(bench.BENCH_HEAT_MS / t) for tag, t in ms.items()}
    assert timed == [("e4m3", 1, 3), ("e4m3", 1, heat["e4m3"]), (None, 1, 3), (None, 1, heat[None]),
                     ("prepared", 1, 3), ("prepared", 1, heat["prepared"]),
                     (None, 1, heat[None]), ("prepared", 1, heat["prepared"]), ("e4m3", 1, heat["e4m3"])]
    line = bench.format_line(result)
    assert line.startswith("fwd fp8 e4m3 hd128 causal N=1024 b=16 h=16: 1.000 ms")
    assert "| cuflash-bf16 " in line and "(1.50x)" in line
    report = dict(environment=dict(gpu="Test GPU"), results=[result], overhead=None)
    tables = bench.markdown_tables(report)
    assert "**fwd fp8 head_dim=128 causal** (TFLOP/s, Test GPU; FP8 e4m3 inputs quantized per tensor" in tables
    assert "| cuflash FP8 e4m3 |" in tables and "| cuflash bf16 |" in tables
    assert "| FP8 / bf16 (cuflash) | 1.50x |" in tables
    assert "| FP8, V from prepare_v / bf16 (cuflash) | 2.00x |" in tables
    import json
    json.dumps(report)
    bwd = bench.bench_config(bench.BenchConfig(128, 1024, True, 16, 16, "fp8", "bwd"), arch="sm90a")
    assert "forward only" in bwd["error"]


def test_bench_dtype_parsing_and_cli_flags(monkeypatch, capsys):
    assert bench.parse_bench_dtype("fp8") == "fp8" and bench.parse_bench_dtype("bfloat16") == "bf16"
    with pytest.raises(ValueError, match="forward only"):
        bench.parse_bench_dtype("fp8", "bwd")
    with pytest.raises(ValueError, match="--dtype fp8 --fp8-format"):
        bench.parse_bench_dtype("e4m3")
    seen = {}
    monkeypatch.setattr(machine, "gpu_status", lambda: (True, ""))
    monkeypatch.setattr(bench.runner, "run_benchmark", lambda **kwargs: seen.update(kwargs) or dict(
        environment={}, results=[], overhead=None))
    assert cli.main(["bench", "--dtype", "fp8", "--fp8-format", "e5m2", "--head-dims", "64"]) == 0
    assert seen["dtype"] == "fp8" and seen["fp8_format"] == "e5m2" and seen["head_dims"] == [64]
    assert cli.main(["bench", "--dtype", "fp8", "--mode", "bwd"]) == 2
    assert "forward only" in capsys.readouterr().err
    assert cli.main(["bench", "--dtype", "bf16"]) == 0 and seen["dtype"] == "bf16"


def test_fp8_error_table_with_the_naive_model(monkeypatch, tmp_path, capsys):
    from cuflash.reference import attention_fp8_naive
    rows = bench.fp8_error_table(attention_fp8_naive, xp=np, head_dims=(64,), seqlen=128)
    assert len(rows) == 2 * 2 * 2
    for row in rows:
        assert row["max_error"] == row["naive_max_error"] and 0 < row["mean_error"] <= row["max_error"]
    by_key = {(r["fp8_format"], r["inputs"], r["rotated"]): r for r in rows}
    assert by_key[("e4m3", "outliers", True)]["max_error"] < by_key[("e4m3", "outliers", False)]["max_error"]
    table = bench.fp8_error_markdown(rows, "CPU")
    assert "| head dim | format | inputs | rotation | max error | mean error |" in table
    assert table.count("\n| 64 | e") == 8
    # The command line, with the kernel replaced by the model.
    monkeypatch.setattr(machine, "gpu_status", lambda: (True, ""))
    monkeypatch.setattr(machine, "environment", lambda: dict(gpu="Test GPU"))
    real = bench.fp8_error_table
    monkeypatch.setattr(bench.fp8_errors, "fp8_error_table", lambda **kwargs: real(
        attention_fp8_naive, xp=np, seqlen=64, **kwargs))
    md = tmp_path / "errors.md"
    assert cli.main(["bench", "--fp8-errors", "--head-dims", "64", "--md", str(md)]) == 0
    out = capsys.readouterr().out
    assert "fp8 e5m2 hd64 outliers rotated: max error" in out
    assert "| 64 | e5m2 | outliers | yes |" in md.read_text() and "(Test GPU;" in md.read_text()
