"""score_mod and mask_mod in the kernels, on the GPU, against the float64 reference running the
same Python functions: the built-ins and user-written mods (a captured per-head array, a
relative-position table, documents of random lengths, rows left fully masked, compositions),
both tensor-core families, fp16 and bf16, both layouts, GQA, hypothesis-drawn shapes."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import mods, reference
from cuflash.testing import assert_attention_close, assert_gradients_close, to_numpy

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

HEAD_DIMS = (64, 128)
MAX_SEQLEN = 300
FAMILIES = (None, "mma")
DTYPES = ("bf16", "fp16")


def _doc_ids(rng, batch, seqlen, documents):
    """int32 [batch, seqlen]: each row cut into `documents` runs of random lengths."""
    ids = np.zeros((batch, seqlen), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, max(seqlen, 2)), size=min(documents - 1, max(seqlen - 1, 0)),
                                  replace=False)) if seqlen > 1 else []
        ids[b] = np.searchsorted(cuts, np.arange(seqlen), side="right")
    return ids


def _case(name, rng, batch, heads, seqlen_q, seqlen_k):
    """(score_mod, mask_mod, causal) of a named case for one shape; captured arrays on the GPU."""
    longest = max(seqlen_q, seqlen_k)
    if name == "softcap":
        return mods.softcap(30.0), None, False
    if name == "alibi":
        slopes = cupy.asarray([2.0 ** -(i + 1) for i in range(heads)], dtype=cupy.float32)
        return mods.alibi(slopes), None, True
    if name == "window":
        return None, mods.sliding_window(48), True
    if name == "document":
        return None, mods.document_mask(cupy.asarray(_doc_ids(rng, batch, longest, 3))), True
    if name == "relative_bias":
        # one table for every length up to MAX_SEQLEN: a Python number is baked into the kernel,
        # so an offset that followed seqlen_k would compile a kernel per length
        table = cupy.asarray(rng.standard_normal((heads, 2 * MAX_SEQLEN - 1)).astype(np.float16))
        offset = MAX_SEQLEN - 1

        def relative_bias(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + offset]
        return relative_bias, None, False
    if name == "relative_clipped":  # the built-in, its table narrower than the distances
        return mods.relative_bias(cupy.asarray(rng.standard_normal((heads, 31)).astype(np.float32))), None, True
    if name == "holes":
        def holes(b, h, q_idx, kv_idx):  # every fifth query row attends nothing
            return (q_idx % 5 != 2) & (kv_idx % 3 != 1)
        return None, holes, False
    if name == "composed":
        doc = cupy.asarray(_doc_ids(rng, batch, longest, 2))
        return None, mods.and_masks(mods.sliding_window(64, causal=False), mods.document_mask(doc)), False
    if name == "softcap_window":
        return mods.softcap(20.0), mods.sliding_window(32), True
    if name == "per_head":  # a window that widens with the head: a visit list per head
        def per_head(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx) < 24 * (h + 1)
        return None, per_head, True
    if name == "prefix":
        prefix = cupy.asarray(rng.integers(0, seqlen_k + 1, size=batch).astype(np.int32))
        return None, mods.prefix_lm(prefix), False
    raise KeyError(name)


CASES = ("softcap", "alibi", "window", "document", "relative_bias", "relative_clipped", "holes", "composed",
         "softcap_window", "prefix", "per_head")
DETERMINISTIC_CASES = ("softcap_window", "relative_bias", "holes")
# (case, family, dtype): every case on both tensor-core families, the dtypes taken in turn, so
# that each case runs in both dtypes and each family in both (the default family's softcap and
# softcap_window in fp16, document in bf16: the kernels the tests below them call too)
RUNS = [(name, family, DTYPES[(i + j + 1) % 2]) for i, name in enumerate(CASES) for j, family in enumerate(FAMILIES)]


def _problem_stub(head_dim, causal, dtype):
    """What forward._with_mods reads of a problem."""
    return type("P", (), {"head_dim": head_dim, "causal": causal, "dtype": type("D", (), {"tag": dtype})(),
                          "device_id": 0})()


def _prepared_cases(names):
    """(name, prepared mods, causal) of each case at a small shape, its arrays on the GPU."""
    from cuflash.core import modset

    rng = np.random.default_rng(0)
    for name in names:
        score_mod, mask_mod, causal = _case(name, rng, 2, 4, 40, 40)
        yield name, modset.prepare(score_mod, mask_mod, cupy.cuda.Device().id), causal


def _mod_specs(arch):
    """Every (case, family, dtype) of RUNS at each head dim, with the block-sparse and
    deterministic specializations the tests run."""
    from cuflash.core import policy
    from cuflash.forward import _with_mods

    specs = []
    for name, prepared, causal in _prepared_cases(CASES):
        mask_mod = prepared.mask
        for family, dtype in ((f, t) for n, f, t in RUNS if n == name):
            for head_dim in HEAD_DIMS:
                spec = policy.default_spec(head_dim, dtype, causal, arch, family=family, seqlen=512)
                problem = _problem_stub(head_dim, causal, dtype)
                specs.append(_with_mods(spec, prepared, problem, None))
                if family is None and mask_mod is not None and spec.warp_specialized:
                    specs.append(_with_mods(spec, prepared, problem, None).replace(block_sparse=True))
                if family is None and mask_mod is not None:
                    bwd = policy.default_bwd_spec(head_dim, dtype, causal, arch, False)
                    bwd = _bwd_with_mods(bwd, prepared, head_dim, dtype, causal)
                    specs.append(bwd.replace(block_sparse=True) if bwd.family == "wgmma" else bwd)
                for deterministic in (False, True) if name in DETERMINISTIC_CASES and family is None else (False,):
                    bwd = policy.default_bwd_spec(head_dim, dtype, causal, arch, deterministic, family=family)
                    specs.append(_bwd_with_mods(bwd, prepared, head_dim, dtype, causal))
    return list(dict.fromkeys(specs))


@pytest.fixture(scope="module")
def warm_mod_kernels():
    from cuflash.core.compile import device_arch

    cuflash.warmup(_mod_specs(device_arch()), progress=False)


def _bwd_with_mods(spec, prepared, head_dim, dtype, causal):
    from cuflash.backward import _with_mods

    forward = type("P", (), {"head_dim": head_dim, "causal": causal, "dtype": type("D", (), {"tag": dtype})()})()
    return _with_mods(spec, prepared, type("B", (), {"forward": forward})())


def _np_dtype(tag):
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16) if tag == "bf16" else np.dtype(np.float16)


shapes = st.tuples(st.integers(1, 2), st.sampled_from([(4, 4), (4, 2), (4, 1)]), st.integers(1, MAX_SEQLEN),
                   st.integers(1, MAX_SEQLEN), st.sampled_from(["bhsd", "bshd"]), st.sampled_from(HEAD_DIMS))


def _inputs(rng, dtype, batch, heads, heads_k, seqlen_q, seqlen_k, layout, head_dim):
    npd = _np_dtype(dtype)

    def make(h, s):
        shape = (batch, h, s, head_dim) if layout == "bhsd" else (batch, s, h, head_dim)
        return rng.standard_normal(shape).astype(npd)
    return make(heads, seqlen_q), make(heads_k, seqlen_k), make(heads_k, seqlen_k)


def _drawn(name, dtype, shape, seed):
    """(rng, (q, k, v) on the host, score_mod, mask_mod, causal, layout) of a drawn shape and case."""
    batch, (heads, heads_k), seqlen_q, seqlen_k, layout, head_dim = shape
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, dtype, batch, heads, heads_k, seqlen_q, seqlen_k, layout, head_dim)
    return (rng, (q, k, v), *_case(name, rng, batch, heads, seqlen_q, seqlen_k), layout)


@pytest.mark.usefixtures("warm_mod_kernels")
@pytest.mark.parametrize("name,family,dtype", RUNS)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_forward_with_mods_matches_the_reference(name, family, dtype, shape, seed, poison):
    seqlen_q = shape[2]
    rng, (q, k, v), score_mod, mask_mod, causal, layout = _drawn(name, dtype, shape, seed)
    args = dict(causal=causal, layout=layout, score_mod=score_mod, mask_mod=mask_mod)
    poison(q.size * q.itemsize)
    out, lse = cuflash.attention(*(cupy.asarray(x) for x in (q, k, v)), return_lse=True, family=family, **args)
    ref, ref_lse = reference.attention_reference(q, k, v, **args)
    naive, naive_lse = reference.attention_naive(q, k, v, **args)
    assert out.dtype == cupy.asarray(q).dtype and lse.dtype == cupy.float32
    assert_attention_close(out, ref, dtype, baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)
    if name == "holes":  # the rows that attend nothing: O = 0, LSE = -inf
        rows = np.arange(seqlen_q) % 5 == 2
        lse_np = to_numpy(lse)
        assert np.all(np.isneginf(lse_np[:, :, rows]))
        out_np = to_numpy(out).astype(np.float32)
        assert not np.any(out_np[:, :, rows] if layout == "bhsd" else out_np[:, rows])


def test_the_same_mod_traced_twice_reuses_its_kernel(monkeypatch):
    from cuflash.core import compile as _compile

    q = cupy.asarray(np.random.default_rng(1).standard_normal((1, 2, 64, 64)).astype(np.float16))
    first = cuflash.attention(q, q, q, score_mod=mods.softcap(30.0))
    loads = []
    real_load = _compile._load
    monkeypatch.setattr(_compile, "_load", lambda spec: loads.append(spec) or real_load(spec))

    def again(score, b, h, q_idx, kv_idx):  # the same expression, written again
        return 30.0 * mods.tanh(score / 30.0)
    second = cuflash.attention(q, q, q, score_mod=again)
    assert not loads
    assert cupy.array_equal(first, second)


def test_calls_with_the_same_mods_reuse_a_plan_and_other_arrays_do_not():
    from cuflash import forward

    rng = np.random.default_rng(3)
    q, k, v = (cupy.asarray(x) for x in _inputs(rng, "bf16", 2, 4, 2, 200, 200, "bshd", 64))
    doc1, doc2 = (cupy.asarray(_doc_ids(rng, 2, 200, 3)) for _ in range(2))

    def run(doc, block=False):
        def mask_mod(b, h, q_idx, kv_idx):  # a new closure on every call, reading doc when it runs
            return doc[b, q_idx] == doc[b, kv_idx]
        bm = cuflash.block_mask(mask_mod, 2, 4, 200, 200) if block else None
        return cuflash.attention(q, k, v, causal=True, layout="bshd", mask_mod=mask_mod, block_mask=bm)

    first = run(doc1)
    plans = len(forward._plans)
    assert cupy.array_equal(run(doc1), first) and len(forward._plans) == plans  # the same graph: its plan
    second = run(doc2)
    assert len(forward._plans) == plans + 1
    host = [to_numpy(x) for x in (q, k, v)]
    args = dict(causal=True, layout="bshd", mask_mod=mods.document_mask(to_numpy(doc2)))
    assert_attention_close(second, reference.attention_reference(*host, **args)[0], "bf16",
                           baseline=reference.attention_naive(*host, **args)[0])
    doc2[...] = doc1  # contents are read when the kernel runs
    assert cupy.array_equal(run(doc2), first)
    assert cupy.allclose(run(doc1, block=True).astype(cupy.float32), first.astype(cupy.float32), atol=2e-2)


def test_mod_errors_name_the_array():
    q = cupy.zeros((1, 2, 16, 64), dtype=cupy.float16)
    host = np.ones(2, np.float32)
    with pytest.raises(TypeError, match="slopes"):
        cuflash.attention(q, q, q, score_mod=mods.alibi(host))
    with pytest.raises(ValueError, match="float32"):
        q32 = cupy.zeros((1, 2, 16, 64), dtype=cupy.float32)
        cuflash.attention(q32, q32, q32, score_mod=mods.softcap(5.0))


def test_an_index_past_a_captured_array_gives_nan_not_a_fault():
    rng = np.random.default_rng(2)
    q = cupy.asarray(rng.standard_normal((1, 2, 64, 64)).astype(np.float16))
    short = cupy.ones(10, dtype=cupy.float32)

    def past_the_end(score, b, h, q_idx, kv_idx):
        return score + short[kv_idx]
    out = to_numpy(cuflash.attention(q, q, q, score_mod=past_the_end)).astype(np.float32)
    assert np.isnan(out).all()
    cupy.cuda.Device().synchronize()


# the deterministic backward on the default family, in that case's dtype of RUNS
_BACKWARD_RUNS = [(name, family, dtype, False) for name, family, dtype in RUNS] + \
    [(name, None, dtype, True) for name, family, dtype in RUNS if family is None and name in DETERMINISTIC_CASES]


@pytest.mark.usefixtures("warm_mod_kernels")
@pytest.mark.parametrize("name,family,dtype,deterministic", _BACKWARD_RUNS)
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_backward_with_mods_matches_the_reference(name, family, dtype, deterministic, shape, seed, poison):
    from cuflash.core import policy
    from cuflash.core.compile import device_arch

    seqlen_q, head_dim = shape[2], shape[5]
    rng, (q, k, v), score_mod, mask_mod, causal, layout = _drawn(name, dtype, shape, seed)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    args = dict(causal=causal, layout=layout, score_mod=score_mod, mask_mod=mask_mod)
    dq_, dk_, dv_ = (cupy.asarray(x) for x in (q, k, v))
    out, lse = cuflash.attention(dq_, dk_, dv_, return_lse=True, family=family, **args)
    spec = None if family is None else policy.default_bwd_spec(head_dim, dtype, causal, device_arch(), deterministic,
                                                               family=family)
    poison(q.size * q.itemsize, k.size * k.itemsize)
    grads = cuflash.attention_backward(cupy.asarray(dout), dq_, dk_, dv_, out, lse, deterministic=deterministic,
                                       spec=spec, **args)
    ref = reference.attention_backward_reference(dout, q, k, v, **args)
    naive = reference.attention_backward_naive(dout, q, k, v, **args)
    assert_gradients_close(grads, ref, dtype, baselines=naive)
    if name == "holes":  # rows that attend nothing have no gradient
        rows = np.arange(seqlen_q) % 5 == 2
        dq = to_numpy(grads[0]).astype(np.float32)
        assert not np.any(dq[:, :, rows] if layout == "bhsd" else dq[:, rows])


def test_attention_with_grad_takes_mods():
    rng = np.random.default_rng(3)
    q, k, v = (cupy.asarray(rng.standard_normal((1, 2, 96, 64)).astype(np.float16)) for _ in range(3))
    dout = cupy.asarray(rng.standard_normal((1, 2, 96, 64)).astype(np.float16))
    score_mod, mask_mod = mods.softcap(20.0), mods.sliding_window(32)
    out, backward = cuflash.attention_with_grad(q, k, v, causal=True, score_mod=score_mod, mask_mod=mask_mod)
    grads = backward(dout)
    args = dict(causal=True, score_mod=score_mod, mask_mod=mask_mod)
    host = [to_numpy(x) for x in (dout, q, k, v)]
    assert_gradients_close(grads, reference.attention_backward_reference(*host, **args), "fp16",
                           baselines=reference.attention_backward_naive(*host, **args))


MASK_CASES = ("window", "document", "holes", "composed", "softcap_window", "prefix", "per_head")
# each mask case at both tile shapes in its default family's dtype of RUNS (the dtypes alternate
# over the cases): the block-sparse kernels warm_mod_kernels compiled
_BLOCK_MASK_RUNS = [(name, dtype, tiles) for name, family, dtype in RUNS if family is None and name in MASK_CASES
                    for tiles in ((128, 128), (64, 32))]


@pytest.mark.usefixtures("warm_mod_kernels")
@pytest.mark.parametrize("name,dtype,tiles", _BLOCK_MASK_RUNS,
                         ids=[f"{name}-{dtype}-{m}x{n}" for name, dtype, (m, n) in _BLOCK_MASK_RUNS])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_a_block_mask_skips_tiles_and_changes_nothing(name, dtype, tiles, shape, seed, poison):
    batch, (heads, _), seqlen_q, seqlen_k = shape[:4]
    rng, (q, k, v), score_mod, mask_mod, causal, layout = _drawn(name, dtype, shape, seed)
    block = cuflash.block_mask(mask_mod, batch, heads, seqlen_q, seqlen_k, block_m=tiles[0], block_n=tiles[1])
    poison(q.size * q.itemsize)
    out, lse = cuflash.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=causal, layout=layout,
                                 score_mod=score_mod, block_mask=block, return_lse=True)
    args = dict(causal=causal, layout=layout, score_mod=score_mod, mask_mod=mask_mod)
    ref, ref_lse = reference.attention_reference(q, k, v, **args)
    naive, naive_lse = reference.attention_naive(q, k, v, **args)
    assert_attention_close(out, ref, dtype, baseline=naive, lse=lse, ref_lse=ref_lse, baseline_lse=naive_lse)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    grads = cuflash.attention_backward(cupy.asarray(dout), *(cupy.asarray(x) for x in (q, k, v)), out, lse,
                                       causal=causal, layout=layout, score_mod=score_mod, block_mask=block)
    assert_gradients_close(grads, reference.attention_backward_reference(dout, q, k, v, **args), dtype,
                           baselines=reference.attention_backward_naive(dout, q, k, v, **args))


def test_a_block_mask_of_another_shape_is_refused():
    q = cupy.zeros((1, 2, 64, 64), dtype=cupy.float16)
    block = cuflash.block_mask(mods.sliding_window(8), 1, 2, 32, 64)
    with pytest.raises(ValueError, match="seqlen_q"):
        cuflash.attention(q, q, q, block_mask=block)


@pytest.mark.parametrize("name", MASK_CASES)
@pytest.mark.parametrize("tiles", [(128, 128), (64, 32)])
def test_block_masks_on_the_gpu_match_the_host(name, tiles):
    rng = np.random.default_rng(len(name))
    batch, heads, seqlen_q, seqlen_k = 2, 4, 301, 517
    _, mask_mod, _ = _case(name, rng, batch, heads, seqlen_q, seqlen_k)
    on_gpu = cuflash.block_mask(mask_mod, batch, heads, seqlen_q, seqlen_k, block_m=tiles[0], block_n=tiles[1],
                                device="gpu")
    on_host = cuflash.block_mask(mask_mod, batch, heads, seqlen_q, seqlen_k, block_m=tiles[0], block_n=tiles[1],
                                 device="cpu")
    assert np.array_equal(on_gpu.kind, on_host.kind)
    assert np.array_equal(on_gpu.kv_indices, on_host.kv_indices)


FP8_CASES = ("softcap", "alibi", "document", "softcap_window")
# each FP8 case once, the head dims taken in turn (each runs with a score_mod and a mask_mod)
FP8_RUNS = [(name, HEAD_DIMS[i % 2]) for i, name in enumerate(FP8_CASES)]


def _fp8_mod_specs(arch):
    """The FP8 forward with each FP8 case's mods (e4m3, bf16 output, its head dim)."""
    from cuflash.core import policy
    from cuflash.forward import _with_mods

    specs = []
    for (_, prepared, causal), (_, head_dim) in zip(_prepared_cases(FP8_CASES), FP8_RUNS):
        spec = policy.default_spec(head_dim, "e4m3", causal, arch, out_dtype="bf16", seqlen=512)
        specs.append(_with_mods(spec, prepared, _problem_stub(head_dim, causal, "e4m3"), "bf16"))
    return list(dict.fromkeys(specs))


@pytest.fixture(scope="module")
def warm_fp8_mod_kernels():
    from cuflash.core.compile import device_arch

    cuflash.warmup(_fp8_mod_specs(device_arch()), progress=False)


#: The warm fixtures' kernels by fixture name: the session compiles them in its first pool.
WARM = {"warm_mod_kernels": _mod_specs, "warm_fp8_mod_kernels": _fp8_mod_specs}


@pytest.mark.parametrize("name,head_dim", FP8_RUNS)
def test_fp8_forward_with_mods_matches_the_reference(name, head_dim, warm_fp8_mod_kernels, poison):
    rng = np.random.default_rng(len(name) + head_dim)
    batch, heads, heads_k, seqlen_q, seqlen_k = 2, 4, 2, 177, 250
    score_mod, mask_mod, causal = _case(name, rng, batch, heads, seqlen_q, seqlen_k)
    floats = [rng.standard_normal((batch, h, s, head_dim)).astype(np.float32)
              for h, s in ((heads, seqlen_q), (heads_k, seqlen_k), (heads_k, seqlen_k))]
    (q8, qd), (k8, kd), (v8, vd) = (cuflash.quantize_fp8(cupy.asarray(x), "e4m3", "head") for x in floats)
    poison(batch * heads * seqlen_q * head_dim * 2, batch * heads * seqlen_q * 4)
    out, lse = cuflash.attention(q8, k8, v8, causal=causal, fp8_format="e4m3", q_descale=qd, k_descale=kd,
                                 v_descale=vd, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    codes = [to_numpy(x) for x in (q8, k8, v8)]
    args = dict(causal=causal, fp8_format="e4m3", q_descale=to_numpy(qd), k_descale=to_numpy(kd),
                v_descale=to_numpy(vd), score_mod=score_mod, mask_mod=mask_mod)
    ref, ref_lse = reference.attention_fp8_reference(*codes, **args)
    naive, _ = reference.attention_fp8_naive(*codes, **args)
    assert_attention_close(out, ref, "e4m3", baseline=naive, lse=lse, ref_lse=ref_lse)
