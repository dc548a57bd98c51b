"""Rotary embeddings of the KV-cache call without a GPU: the rotation against RoPE written as complex
multiplication, the positions of queries and new keys, the reference's use of them, and the named
errors."""
import numpy as np
import pytest

import cuflash
from cuflash.core import rotary
from cuflash.serving import attention_with_kvcache_reference

RNG = np.random.default_rng(0)


def _tables(seqlen_ro, rotary_dim, base=10000.0):
    inv_freq = 1.0 / base ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.arange(seqlen_ro)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32), angles


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotation_is_multiplication_by_a_unit_complex_number(interleaved):
    x = RNG.standard_normal((2, 3, 4, 16))
    cos, sin, angles = _tables(64, 12)
    pos = np.array([[5, 6, 7], [40, 41, 42]])
    out = rotary.rotate(np, x, cos, sin, pos, interleaved, np.float64)
    pairs = (x[..., 0:12:2], x[..., 1:12:2]) if interleaved else (x[..., :6], x[..., 6:12])
    turned = (pairs[0] + 1j * pairs[1]) * np.exp(1j * angles[pos])[:, :, None, :]
    got = (out[..., 0:12:2], out[..., 1:12:2]) if interleaved else (out[..., :6], out[..., 6:12])
    assert np.allclose(got[0], turned.real, atol=1e-6) and np.allclose(got[1], turned.imag, atol=1e-6)
    assert np.array_equal(out[..., 12:], x[..., 12:])  # dims past rotary_dim stay


def test_positions_of_queries_and_new_keys():
    lens = np.array([3, 10], np.int32)
    q = np.zeros((2, 2, 1, 8))
    k_new = np.zeros((2, 3, 1, 8))
    cos, sin, _ = _tables(32, 8)
    seen = []
    original = rotary.rotate

    def record(xp, x, cos, sin, pos, *args):
        seen.append(np.asarray(pos).tolist())
        return original(xp, x, cos, sin, pos, *args)

    rotary.rotate = record
    try:
        rotary.apply(np, q, k_new, lens, 32, True, (-1, -1), cos, sin, False)
        rotary.apply(np, q, k_new, lens, 32, False, (-1, -1), cos, sin, False)
        rotary.apply(np, q, k_new, 4, 32, False, (8, 8), cos, sin, False)
    finally:
        rotary.rotate = original
    # causal: the last two of the three new tokens; not causal, no window: all at the old length
    assert seen[0] == [[4, 5], [11, 12]] and seen[1] == [[3, 4, 5], [10, 11, 12]]
    assert seen[2] == [[3, 3], [10, 10]]
    assert seen[4] == [[5, 6], [5, 6]]  # a window: positions matter again


def test_the_reference_with_tables_is_the_reference_on_rotated_inputs():
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    q = RNG.standard_normal((2, 2, 8, 64)).astype(bf16)
    cache = RNG.standard_normal((2, 48, 2, 64)).astype(bf16)
    k_new, v_new = (RNG.standard_normal((2, 2, 2, 64)).astype(bf16) for _ in range(2))
    lens = np.array([5, 30], np.int32)
    cos, sin, _ = _tables(48, 32)
    for interleaved in (False, True):
        out, lse, k_after, _ = attention_with_kvcache_reference(
            q, cache, cache, lens, k_new=k_new, v_new=v_new, rotary_cos=cos, rotary_sin=sin,
            rotary_interleaved=interleaved)
        q_rot, k_rot = rotary.apply(np, q, k_new, lens, 48, True, (-1, -1), cos, sin, interleaved, np.float64,
                                    np.float64)
        k_bits = rotary.apply(np, q, k_new, lens, 48, True, (-1, -1), cos, sin, interleaved)[1]
        want, want_lse, k_want, _ = attention_with_kvcache_reference(q_rot, cache, cache, lens, k_new=k_bits,
                                                                     v_new=v_new)
        assert np.array_equal(out, want) and np.array_equal(lse, want_lse)
        assert np.array_equal(k_after.view(np.uint16), k_want.view(np.uint16))
        assert np.abs(k_bits.astype(np.float64) - k_rot).max() < 1e-2  # float32 then bf16, against float64


def test_bad_tables_are_named():
    q = np.zeros((1, 1, 2, 64), np.float16)
    k_new = np.zeros((1, 1, 1, 64), np.float16)
    cos, sin, _ = _tables(128, 32)

    def apply(**change):
        args = dict(q=q, k_new=k_new, cos=cos, sin=sin, capacity=128, interleaved=False)
        args.update(change)
        return rotary.apply(np, args["q"], args["k_new"], 0, args["capacity"], True, (-1, -1), args["cos"],
                            args["sin"], args["interleaved"])

    with pytest.raises(ValueError, match="pass k_new and v_new"):
        apply(k_new=None)
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin together"):
        apply(sin=None)
    with pytest.raises(ValueError, match="must match"):
        apply(sin=sin[:, :8])
    with pytest.raises(ValueError, match="rotary_dim runs from 2 to head_dim=64"):
        apply(cos=np.zeros((128, 40), np.float32), sin=np.zeros((128, 40), np.float32))
    with pytest.raises(ValueError, match="seqlen_ro must be at least"):
        apply(capacity=129)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        apply(cos=cos.astype(np.float64), sin=sin.astype(np.float64))
    with pytest.raises(TypeError, match="rotary_interleaved must be a bool"):
        apply(interleaved="yes")
    with pytest.raises(TypeError, match="rotary_cos must be a numpy array"):
        apply(cos=list(cos))


def test_the_call_refuses_tables_for_fp8_caches():
    q = np.zeros((1, 1, 2, 64), np.float16)
    with pytest.raises(ValueError, match="16-bit caches"):
        cuflash.attention_with_kvcache(q, q, q, cache_seqlens=0, fp8_format="e4m3", rotary_cos=q, rotary_sin=q)
