"""FP8 encoding, quantization and the outlier rotation, in NumPy (no GPU needed)."""
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
