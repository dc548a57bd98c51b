"""score_mod and mask_mod on packed sequences (attention_varlen and its backward) against the float64
reference, sequence by sequence: b is the sequence's index, q_idx and kv_idx positions within it."""
import numpy as np
import pytest

import cuflash
from cuflash import reference
from cuflash.testing import assert_attention_close, assert_gradients_close, to_numpy

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

LENS_Q = np.array([0, 1, 17, 113, 239, 300, 64])
LENS_K = np.array([5, 1, 40, 113, 100, 300, 0])


def _np_dtype(tag):
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16) if tag == "bf16" else np.dtype(np.float16)


def _packed(rng, heads, heads_k, head_dim, dtype):
    npd = _np_dtype(dtype)
    q = rng.standard_normal((int(LENS_Q.sum()), heads, head_dim)).astype(npd)
    k, v = (rng.standard_normal((int(LENS_K.sum()), heads_k, head_dim)).astype(npd) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(npd)
    cu = [np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (LENS_Q, LENS_K)]
    return q, k, v, dout, cu[0], cu[1]


def _mods(kind, heads, rng):
    """(score_mod, mask_mod) reading b, h, q_idx, kv_idx and arrays captured per head and sequence."""
    slopes = cupy.asarray(rng.uniform(0.01, 0.2, heads).astype(np.float32))
    weight = cupy.asarray(rng.uniform(0.5, 2.0, len(LENS_Q)).astype(np.float32))
    prefix = cupy.asarray(np.array([0, 0, 5, 0, 30, 7, 3], dtype=np.int32))

    def bias(score, b, h, q_idx, kv_idx):  # derivative 1: runs at every head dim
        return score - slopes[h] * weight[b] * cuflash.mods.abs(q_idx - kv_idx)

    def scaled(score, b, h, q_idx, kv_idx):  # derivative weight[b] * (1 - tanh^2)
        return 20.0 * cuflash.mods.tanh(score * weight[b] / 20.0)

    def prefix_lm(b, h, q_idx, kv_idx):  # row 0 of a sequence with no prefix sees no key
        return (kv_idx < prefix[b]) | (kv_idx < q_idx)

    return {"bias": (bias, None), "tanh": (scaled, None), "mask": (None, prefix_lm),
            "both": (bias, prefix_lm)}[kind]


def _shifted(mod, b0, score=True):
    """The mod of sequence b0 for a reference call of batch 1."""
    if mod is None:
        return None
    if score:
        return lambda s, b, h, q_idx, kv_idx: mod(s, b + b0, h, q_idx, kv_idx)
    return lambda b, h, q_idx, kv_idx: mod(b + b0, h, q_idx, kv_idx)


CASES = [(64, "both", True), (64, "tanh", False), (128, "mask", False), (128, "tanh", True), (128, "both", False),
         (256, "bias", True), (96, "both", True)]


def _varlen_mod_specs(arch):
    """The forward and backward specializations of these tests."""
    from cuflash.core import modset
    from cuflash.core.policy import default_bwd_spec
    from cuflash.varlen import hopper_spec

    if arch != "sm90a":
        return []
    rng = np.random.default_rng(0)
    specs = []
    for head_dim, kind, causal in CASES + [(128, "softcap", True)]:
        mods = modset.prepare(cuflash.mods.softcap(15.0) if kind == "softcap" else _mods(kind, 8, rng)[0],
                              None if kind == "softcap" else _mods(kind, 8, rng)[1], 0)
        names = dict(score_mod=mods.score_digest, mask_mod=mods.mask_digest)
        specs.append(hopper_spec(head_dim, "bf16", causal, 300, arch).replace(local=kind == "softcap", **names))
        specs.append(default_bwd_spec(head_dim, "bf16", causal, arch, False, family="wgmma").replace(
            varlen=True, local=kind == "softcap", **names))
    return specs


@pytest.fixture(scope="module", autouse=True)
def warm_varlen_mod_kernels():
    from cuflash.core.compile import device_arch

    cuflash.warmup(_varlen_mod_specs(device_arch()), progress=False)


#: The warm fixtures' kernels by fixture name: the session compiles them in its first pool.
WARM = {"warm_varlen_mod_kernels": _varlen_mod_specs}


@pytest.mark.parametrize("head_dim,kind,causal", CASES)
def test_varlen_mods_forward_and_backward(head_dim, kind, causal, poison):
    rng = np.random.default_rng(head_dim + 7 * causal + len(kind))
    q, k, v, dout, cu_q, cu_k = _packed(rng, 8, 2, head_dim, "bf16")
    score_mod, mask_mod = _mods(kind, 8, rng)
    dev = [cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)]
    poison(q.nbytes, 8 * q.shape[0] * 4)
    out, backward = cuflash.attention_varlen_with_grad(*dev, causal=causal, score_mod=score_mod, mask_mod=mask_mod)
    _, lse = cuflash.attention_varlen(*dev, causal=causal, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    poison(q.nbytes, k.nbytes, k.nbytes)
    dq, dk, dv = (to_numpy(g) for g in backward(cupy.asarray(dout)))
    out, lse = to_numpy(out), to_numpy(lse)
    assert not np.isnan(out.astype(np.float32)).any() and not np.isnan(dq.astype(np.float32)).any()
    for b in range(len(LENS_Q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if LENS_Q[b] == 0:
            assert np.all(dk[ks].astype(np.float32) == 0) and np.all(dv[ks].astype(np.float32) == 0)
            continue
        kwargs = dict(causal=causal, layout="bshd", score_mod=_shifted(score_mod, b),
                      mask_mod=_shifted(mask_mod, b, score=False))
        args = (q[None, qs], k[None, ks], v[None, ks])
        ref, ref_lse = reference.attention_reference(*args, **kwargs)
        naive, naive_lse = reference.attention_naive(*args, **kwargs)
        assert_attention_close(out[None, qs], ref, "bf16", baseline=naive, lse=lse[None, :, qs], ref_lse=ref_lse,
                               baseline_lse=naive_lse)
        if LENS_K[b] == 0:
            assert np.all(dq[qs].astype(np.float32) == 0)
            continue
        want = reference.attention_backward_reference(dout[None, qs], *args, **kwargs)
        base = reference.attention_backward_naive(dout[None, qs], *args, **kwargs)
        assert_gradients_close((dq[None, qs], dk[None, ks], dv[None, ks]), want, "bf16", baselines=base)


def test_varlen_softcap_backward_runs_in_one_launch(poison):
    """A softcap on the one-launch backward (family='wgmma'), with a window, as its score_mod."""
    rng = np.random.default_rng(5)
    q, k, v, dout, cu_q, cu_k = _packed(rng, 8, 2, 128, "bf16")
    dev = [cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)]
    kwargs = dict(causal=True, window_size=(50, 0), softcap=15.0)
    out, lse = cuflash.attention_varlen(*dev, return_lse=True, **kwargs)
    poison(q.nbytes, k.nbytes, k.nbytes)
    grads = cuflash.attention_varlen_backward(cupy.asarray(dout), *dev[:3], out, lse, *dev[3:], family="wgmma",
                                              **kwargs)
    dq, dk, dv = (to_numpy(g) for g in grads)
    for b in range(len(LENS_Q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if LENS_Q[b] == 0 or LENS_K[b] == 0:
            continue
        args = (dout[None, qs], q[None, qs], k[None, ks], v[None, ks])
        want = reference.attention_backward_reference(*args, layout="bshd", **kwargs)
        base = reference.attention_backward_naive(*args, layout="bshd", **kwargs)
        assert_gradients_close((dq[None, qs], dk[None, ks], dv[None, ks]), want, "bf16", baselines=base)


def test_varlen_mods_refusals_name_the_reason():
    rng = np.random.default_rng(0)
    q, k, v, dout, cu_q, cu_k = _packed(rng, 4, 2, 256, "bf16")
    dev = [cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)]
    score_mod, mask_mod = _mods("tanh", 4, rng)[0], _mods("mask", 4, rng)[1]
    with pytest.raises(ValueError, match="softcap=10.0 and score_mod"):
        cuflash.attention_varlen(*dev, softcap=10.0, score_mod=score_mod)
    with pytest.raises(ValueError, match="window_size"):
        cuflash.attention_varlen(*dev, window_size=(10, 0), causal=True, mask_mod=mask_mod)
    out, lse = cuflash.attention_varlen(*dev, score_mod=score_mod, return_lse=True)
    g = cupy.asarray(dout)
    with pytest.raises(ValueError, match="derivative is 1"):  # head dim 256 splits the head dim
        cuflash.attention_varlen_backward(g, *dev[:3], out, lse, *dev[3:], score_mod=score_mod)
    with pytest.raises(ValueError, match="not deterministic"):
        cuflash.attention_varlen_backward(g, *dev[:3], out, lse, *dev[3:], mask_mod=mask_mod, deterministic=True)
    with pytest.raises(ValueError, match="family='sequences'"):
        cuflash.attention_varlen_backward(g, *dev[:3], out, lse, *dev[3:], mask_mod=mask_mod, family="sequences")
