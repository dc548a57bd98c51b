"""Mods without a GPU: tracing to canonical graphs, the named errors of what cannot be traced, the
float64 reference of modded attention and its gradients, and the generated CUDA compiling."""
import math

import numpy as np
import pytest

from cuflash import mods, reference
from cuflash.core import mod_codegen, mod_grad, trace

RNG = np.random.default_rng(0)


def _qkv(batch=2, heads=4, heads_k=2, seqlen_q=33, seqlen_k=47, head_dim=16):
    return (RNG.standard_normal((batch, heads, seqlen_q, head_dim)), RNG.standard_normal((batch, heads_k, seqlen_k, head_dim)),
            RNG.standard_normal((batch, heads_k, seqlen_k, head_dim)))


def _plain(q, k, v, scores_fn=None, allowed_fn=None, scale=None):
    """Attention written out with explicit NumPy arrays: the reference the mods must match."""
    heads = q.shape[1]
    k, v = (np.repeat(x, heads // x.shape[1], axis=1) for x in (k, v))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.swapaxes(-1, -2) * scale
    if scores_fn is not None:
        s = scores_fn(s)
    allowed = np.ones(s.shape, bool) if allowed_fn is None else np.broadcast_to(allowed_fn(s.shape), s.shape)
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    total = p.sum(-1, keepdims=True)
    out = np.where(total > 0, p / np.where(total > 0, total, 1) @ v, 0)
    lse = np.where(total[..., 0] > 0, np.log(np.where(total[..., 0] > 0, total[..., 0], 1)) + m[..., 0], -np.inf)
    return out, lse


def _grids(shape):
    b, h, sq, sk = shape
    return (np.arange(b)[:, None, None, None], np.arange(h)[None, :, None, None], np.arange(sq)[None, None, :, None],
            np.arange(sk)[None, None, None, :])


# -- tracing ----------------------------------------------------------------------------------------

def test_the_same_expression_gives_the_same_graph():
    def a(score, b, h, q_idx, kv_idx):
        return score * 2.0 + (q_idx - kv_idx)

    def b_(score, b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) + 2.0 * score

    assert mods.trace_score_mod(a).digest == mods.trace_score_mod(a).digest == mods.trace_score_mod(b_).digest
    assert mods.trace_score_mod(mods.softcap(30.0)).digest != mods.trace_score_mod(mods.softcap(20.0)).digest
    # a captured array's dtype and rank are part of the graph, its contents are not
    one, two = (mods.trace_score_mod(mods.alibi(np.full(4, x, np.float32))) for x in (0.5, 0.25))
    wide = mods.trace_score_mod(mods.alibi(np.full(4, 0.5, np.float16)))
    assert one.digest == two.digest != wide.digest
    assert one.array_signature == (("float32", 1),)


SHIFT = 3
TABLE = np.arange(8, dtype=np.float32)


def test_a_mod_is_traced_once_per_function_and_captured_values():
    global SHIFT, TABLE
    from cuflash.core import modset
    traced = modset.trace_cached
    cap = mods.softcap(30.0)
    graph = traced(cap, "score")
    assert traced(cap, "score") is graph
    assert traced(mods.softcap(30.0), "score") is graph          # a new closure of the same values
    assert traced(mods.softcap(20.0), "score") is not graph      # a number is baked in

    def scaled(x):
        return lambda score, b, h, q_idx, kv_idx: score + x * q_idx

    assert traced(scaled(-0.0), "score") is not traced(scaled(0.0), "score")  # -0.0 == 0.0 in Python

    def shifted(score, b, h, q_idx, kv_idx):
        return score + TABLE[q_idx % 8] * SHIFT

    first = traced(shifted, "score")
    assert traced(shifted, "score") is first and first.arrays[0] is TABLE
    SHIFT = 4                                  # a global number the mod reads: traced anew
    second = traced(shifted, "score")
    assert second is not first and second.digest != first.digest
    TABLE = np.arange(8, dtype=np.float32)     # a global array rebound: traced anew, with the new array
    third = traced(shifted, "score")
    assert third is not second and third.arrays[0] is TABLE and third.digest == second.digest

    box = [2.0]                                # a closure of a kind the key cannot read: traced every time

    def boxed(score, b, h, q_idx, kv_idx):
        return score * box[0]

    assert modset.trace_key(boxed) is None
    assert traced(boxed, "score") is not traced(boxed, "score")
    box[0] = 3.0
    assert traced(boxed, "score").digest != traced(mods.softcap(30.0), "score").digest
    # errors are raised on every call, never cached
    for _ in range(2):
        with pytest.raises(TypeError, match="Python.s if"):
            traced(lambda score, b, h, q_idx, kv_idx: score if q_idx > 0 else 0.0, "score")


def test_numbers_fold_and_types_follow_python():
    graph = mods.trace_score_mod(lambda s, b, h, q, k: s * (2 * 3 - 1.5))
    assert [n.args for n in graph.nodes if n.op == "const"] == [(4.5,)]
    graph = mods.trace_mask_mod(lambda b, h, q, k: (q // 2) % 3 == k / 2)
    ops = {n.op: n.dtype for n in graph.nodes}
    assert ops["floordiv"] == "int" and ops["mod"] == "int" and ops["div"] == "float" and ops["eq"] == "bool"


def _line_of(fn, text):
    import inspect
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_python_control_flow_is_named_with_its_line():
    def with_if(score, b, h, q_idx, kv_idx):
        if score > 0:
            return score
        return -score

    with pytest.raises(TypeError, match=r"if, and, or, not and bool\(\).*where") as exc:
        mods.trace_score_mod(with_if)
    assert f":{_line_of(with_if, 'if score > 0')}:" in str(exc.value) and "if score > 0" in str(exc.value)

    def with_and(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx and kv_idx > 3

    with pytest.raises(TypeError, match="if, and, or") as exc:
        mods.trace_mask_mod(with_and)
    assert "with_and" in str(exc.value)

    def with_loop(score, b, h, q_idx, kv_idx):
        for i in range(q_idx):
            score = score + i
        return score

    with pytest.raises(TypeError, match="Python index or length"):
        mods.trace_score_mod(with_loop)


def test_functions_from_outside_the_mods_are_named():
    with pytest.raises(TypeError, match="math.*cuflash.mods"):
        mods.trace_score_mod(lambda s, b, h, q, k: math.tanh(s))
    with pytest.raises(TypeError, match="numpy.exp"):
        mods.trace_score_mod(lambda s, b, h, q, k: np.exp(s))

    class Holder:
        bias = np.zeros(8, np.float32)

    holder = Holder()
    with pytest.raises(TypeError, match="did not capture"):
        mods.trace_score_mod(lambda s, b, h, q, k: s + holder.bias[h])


def test_bad_arrays_indices_and_results_are_named():
    table = np.zeros((4, 8), np.float32)
    with pytest.raises(IndexError, match="table has 2 dims and is indexed with 1"):
        mods.trace_score_mod(lambda s, b, h, q, k: s + table[h])
    with pytest.raises(IndexError, match="index 9 is out of bounds for dim 1 of size 8"):
        mods.trace_score_mod(lambda s, b, h, q, k: s + table[h, 9])
    with pytest.raises(TypeError, match="index 1 is a float"):
        mods.trace_score_mod(lambda s, b, h, q, k: s + table[h, s])
    wide = np.zeros(8, np.int64)
    with pytest.raises(TypeError, match="'wide' has dtype int64"):
        mods.trace_score_mod(lambda s, b, h, q, k: s + wide[q])
    with pytest.raises(TypeError, match="returns a boolean"):
        mods.trace_mask_mod(lambda b, h, q, k: q - k)
    with pytest.raises(TypeError, match="returned a boolean"):
        mods.trace_score_mod(lambda s, b, h, q, k: q > k)
    with pytest.raises(TypeError, match=r"takes \(b, h, q_idx, kv_idx\)"):
        mods.trace_mask_mod(lambda q, k: q > k)
    with pytest.raises(TypeError, match="booleans only"):
        mods.trace_mask_mod(lambda b, h, q, k: (q > k) & 3)
    reads_far = mods.trace_score_mod(lambda s, b, h, q, k: s + table[h, q])  # in bounds only for q < 8
    with pytest.raises(IndexError, match="table.*dim 1, whose size is 8"):
        reference.attention_reference(*_qkv(heads=4, heads_k=4, seqlen_q=12, seqlen_k=12), score_mod=reads_far)


def test_indices_run_from_zero_and_their_range_in_a_call_is_checked():
    from cuflash.core import modset

    table = np.zeros((4, 8), np.float32)
    with pytest.raises(IndexError, match="index -1 is out of bounds"):  # no wrap-around, as in the kernels
        mods.trace_score_mod(lambda s, b, h, q, k: s + table[h, -1])
    back = mods.trace_score_mod(lambda s, b, h, q, k: s + table[h, q - k])
    with pytest.raises(IndexError, match=r"index -\d+\.\.\d+ of dim 1"):
        reference.attention_reference(*_qkv(heads=4, heads_k=4, seqlen_q=6, seqlen_k=6), score_mod=back)
    sizes = {"b": 2, "h": 4, "q_idx": 8, "kv_idx": 8}
    modset.check_bounds(mods.trace_score_mod(lambda s, b, h, q, k: s + table[h, q]), sizes)
    head_row = mods.trace_score_mod(lambda s, b, h, q, k: s + table[h, 0])
    with pytest.raises(ValueError, match=r"reads table\[\.\.\.\] at index 0\.\.4 of dim 0 .*whose size is 4"):
        modset.check_bounds(head_row, dict(sizes, h=5))
    with pytest.raises(ValueError, match=r"at index -7\.\.7 of dim 1"):
        modset.check_bounds(back, sizes)
    # ranges the check bounds exactly: clipped distances, floor division, modulo, products, abs
    fine = [lambda s, b, h, q, k: s + table[h, mods.maximum(mods.minimum(q - k, 3), -3) + 3],
            lambda s, b, h, q, k: s + table[h // 2 + 2, (q * 3 + k) // 4 % 8],
            lambda s, b, h, q, k: s + table[b * 2 + 1, abs(q - k) // 2]]
    for fn in fine:
        modset.check_bounds(mods.trace_score_mod(fn), sizes)
    with pytest.raises(ValueError, match=r"at index 0\.\.16 of dim 1"):
        modset.check_bounds(mods.trace_score_mod(lambda s, b, h, q, k: s + table[h, q * 2 + k // 4]),
                            dict(sizes, kv_idx=12))
    with pytest.raises(ValueError, match=r"integer arithmetic reaches 0\.\.4294836225 .* 32 bits"):
        modset.check_bounds(mods.trace_mask_mod(lambda b, h, q, k: q * k % 7 == 0),
                            dict(sizes, q_idx=65536, kv_idx=65536))
    pair = np.zeros((4, 2), np.float32)  # q % 4 for q in 4..5 is 0..1: within a table of 2
    modset.check_bounds(mods.trace_score_mod(lambda s, b, h, q, k: s + pair[h, (q + 4) % 4]), dict(sizes, q_idx=2))
    # ranges it cannot bound exactly are left to the reference: a symbol twice, a where, unknown counts
    modset.check_bounds(mods.trace_score_mod(lambda s, b, h, q, k: s + table[h, q - q + 9]), sizes)
    modset.check_bounds(mods.trace_score_mod(lambda s, b, h, q, k: s + table[h, mods.where(q < 8, q, 0)]), sizes)
    modset.check_bounds(back, dict(sizes, kv_idx=None))
    modset.check_bounds(back, dict(sizes, q_idx=0))


def test_combined_masks_take_traced_graphs_as_functions():
    doc = np.array([[0, 0, 1, 1, 1, 2, 2, 2]] * 2, np.int32)
    same_doc = lambda b, h, q, k: doc[b, q] == doc[b, k]  # noqa: E731
    prefix = mods.prefix_lm(np.array([3, 5], np.int32))
    plain = mods.trace_mask_mod(mods.and_masks(same_doc, prefix))
    replayed = mods.trace_mask_mod(mods.and_masks(mods.trace_mask_mod(same_doc), mods.trace_mask_mod(prefix)))
    assert replayed.digest == plain.digest and len(replayed.arrays) == 2
    nested = mods.trace_mask_mod(lambda b, h, q, k: mods.where(q > 2, abs(q - k) < 3, ~(q < k)))
    assert mods.trace_mask_mod(mods.or_masks(nested)).digest == nested.digest
    with pytest.raises(TypeError, match="and_masks takes mask_mods .* got int"):
        mods.and_masks(same_doc, 3)


# -- the reference ----------------------------------------------------------------------------------

def test_builtin_and_user_mods_against_plain_numpy():
    q, k, v = _qkv()
    slopes = RNG.uniform(0.1, 1.0, 4).astype(np.float32)
    cases = [
        (dict(score_mod=mods.softcap(3.0)), lambda s: 3.0 * np.tanh(s / 3.0), None),
        (dict(score_mod=mods.alibi(slopes)),
         lambda s: s - slopes.astype(np.float64)[None, :, None, None] * (np.arange(33)[:, None] - np.arange(47)),
         None),
        (dict(mask_mod=mods.sliding_window(8)), None,
         lambda shape: (lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 8))(*_grids(shape))),
    ]
    for kwargs, scores_fn, allowed_fn in cases:
        out, lse = reference.attention_reference(q, k, v, **kwargs)
        want_out, want_lse = _plain(q, k, v, scores_fn, allowed_fn)
        assert np.allclose(out, want_out, atol=1e-12) and np.allclose(lse, want_lse, atol=1e-12), kwargs


def test_a_relative_position_table_and_a_document_mask():
    q, k, v = _qkv(batch=2, heads=4, heads_k=4, seqlen_q=40, seqlen_k=40)
    bias = RNG.standard_normal((4, 2 * 40 - 1)).astype(np.float32)

    def relative(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + 39]

    lengths = [[7, 20, 13], [40]]
    doc = np.stack([np.repeat(np.arange(len(ls)), ls) for ls in lengths]).astype(np.int32)
    out, lse = reference.attention_reference(q, k, v, score_mod=relative, mask_mod=mods.document_mask(doc, causal=True))
    b, h, qi, ki = _grids((2, 4, 40, 40))
    want = _plain(q, k, v, lambda s: s + bias.astype(np.float64)[h, qi - ki + 39],
                  lambda shape: (doc[b, qi] == doc[b, ki]) & (qi >= ki))
    assert np.allclose(out, want[0], atol=1e-12) and np.allclose(lse, want[1], atol=1e-12)


def test_relative_bias_clips_distances_to_its_table():
    q, k, v = _qkv(batch=1, heads=3, heads_k=3, seqlen_q=20, seqlen_k=26)
    table = RNG.standard_normal((3, 9)).astype(np.float32)  # distances -4 .. 4
    out, lse = reference.attention_reference(q, k, v, score_mod=mods.relative_bias(table))
    b, h, qi, ki = _grids((1, 3, 20, 26))
    want = _plain(q, k, v, lambda s: s + table.astype(np.float64)[h, np.clip(qi - ki, -4, 4) + 4],
                  lambda shape: np.ones(shape, bool))
    assert np.allclose(out, want[0], atol=1e-12) and np.allclose(lse, want[1], atol=1e-12)
    with pytest.raises(ValueError, match=r"table.shape=\(3, 8\) must be \(heads, 2 m - 1\)"):
        mods.relative_bias(np.zeros((3, 8), np.float32))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("doc", [
    np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3], [4, 4, 4, 4, 4, 4, 9, 9, 9, 9, 9, 9]], np.int32),  # runs
    np.array([[0, 0, 1, 1, 0, 0, 2, 2, 1, 1, 1, 1], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]], np.int32),  # ids come back
], ids=["runs", "returning"])
def test_document_masks_compare_ids_whichever_form_they_take(doc, causal):
    q, k, v = _qkv(batch=2, heads=2, heads_k=2, seqlen_q=12, seqlen_k=12)
    mask_mod = mods.document_mask(doc, causal=causal)
    runs = doc[0, 4] != 0
    assert len(mods.trace_mask_mod(mask_mod).arrays) == ((1 if causal else 2) if runs else 1)
    out, lse = reference.attention_reference(q, k, v, mask_mod=mask_mod)
    b, h, qi, ki = _grids((2, 2, 12, 12))
    want = _plain(q, k, v, lambda s: s, lambda shape: (doc[b, qi] == doc[b, ki]) & ((qi >= ki) | (not causal)))
    assert np.allclose(out, want[0], atol=1e-12) and np.allclose(lse, want[1], atol=1e-12)


def test_fully_masked_rows_give_zero_and_minus_infinity():
    q, k, v = _qkv(heads=2, heads_k=2, seqlen_q=20, seqlen_k=20)

    def late_keys(b, h, q_idx, kv_idx):  # rows 0..4 see nothing, the others a window, composed with &
        return (kv_idx >= 5) & (q_idx >= 5) & mods.sliding_window(4)(b, h, q_idx, kv_idx)

    out, lse = reference.attention_reference(q, k, v, mask_mod=late_keys)
    assert np.all(out[:, :, :5] == 0) and np.all(lse[:, :, :5] == -np.inf) and np.isfinite(lse[:, :, 5:]).all()
    grads = reference.attention_backward_reference(RNG.standard_normal(q.shape), q, k, v, mask_mod=late_keys)
    assert np.all(grads[0][:, :, :5] == 0) and all(np.isfinite(g).all() for g in grads)


def test_gradients_of_modded_attention_against_finite_differences():
    q, k, v = _qkv(batch=1, heads=2, heads_k=1, seqlen_q=9, seqlen_k=11, head_dim=8)
    dout = RNG.standard_normal(q.shape)
    slopes = np.array([0.3, 0.7], np.float32)

    def softcap_alibi(score, b, h, q_idx, kv_idx):
        return 2.0 * mods.tanh(score / 2.0) - slopes[h] * mods.abs(q_idx - kv_idx)

    options = dict(score_mod=softcap_alibi, mask_mod=mods.sliding_window(6))
    grads = reference.attention_backward_reference(dout, q, k, v, **options)
    for which, x in enumerate((q, k, v)):
        for index in ((0, 0, 3, 2), (0, 0, 7, 5)):
            saved, eps = x[index], 1e-6
            x[index] = saved + eps
            plus = (reference.attention_reference(q, k, v, **options)[0] * dout).sum()
            x[index] = saved - eps
            minus = (reference.attention_reference(q, k, v, **options)[0] * dout).sum()
            x[index] = saved
            assert grads[which][index] == pytest.approx((plus - minus) / (2 * eps), rel=1e-5, abs=1e-8)


def test_the_naive_baseline_takes_mods_too():
    q, k, v = (x.astype(np.float16) for x in _qkv(heads=2, heads_k=2))
    out, lse = reference.attention_naive(q, k, v, score_mod=mods.softcap(5.0), mask_mod=mods.sliding_window(10))
    ref, ref_lse = reference.attention_reference(q, k, v, score_mod=mods.softcap(5.0), mask_mod=mods.sliding_window(10))
    assert out.dtype == np.float16 and np.abs(out.astype(np.float64) - ref).max() < 1e-2
    grads = reference.attention_backward_naive(q, q, k, v, score_mod=mods.softcap(5.0))
    assert all(g.dtype == np.float16 for g in grads)


def test_derivative_graphs_against_finite_differences():
    scores = np.linspace(-3.9, 3.9, 14) + 0.013  # away from the branch points

    def mod(score, b, h, q_idx, kv_idx):
        x = mods.where(score > 1.0, mods.exp(score / 4.0), mods.sigmoid(score) * 3.0)
        return mods.maximum(x, -1.0) + mods.sqrt(score * score + 1.0) - score ** 2 / 7.0

    graph = mods.trace_score_mod(mod)
    inputs = dict(b=0, h=0, q_idx=0, kv_idx=0)
    d = trace.evaluate(mod_grad.derivative(graph), dict(inputs, score=scores))
    eps = 1e-6
    numeric = (trace.evaluate(graph, dict(inputs, score=scores + eps))
               - trace.evaluate(graph, dict(inputs, score=scores - eps))) / (2 * eps)
    assert np.allclose(d, numeric, rtol=1e-5, atol=1e-7)


def test_constant_factors_are_taken_out_of_a_score_mod_for_the_forward():
    """fold_scales: f(score) = out * g(score * in) with in and out constants, out > 0; where a
    factor does not apply the graph keeps it (a negative output factor would turn the max to a
    min, a score used twice has no single input factor)."""
    scores = np.linspace(-40.0, 40.0, 33)
    inputs = dict(b=0, h=1, q_idx=2, kv_idx=3)
    cases = {mods.softcap(30.0): ("0.03333333507180214f", "30.0f"),
             (lambda s, b, h, q, k: s * 2): ("1.0f", "2.0f"),
             (lambda s, b, h, q, k: -3.0 * mods.tanh(s / 5.0)): ("0.20000000298023224f", "1.0f"),
             (lambda s, b, h, q, k: (s * 0.5 + h) / 4): ("0.5f", "0.25f"),
             (lambda s, b, h, q, k: s * s): ("1.0f", "1.0f"),
             (lambda s, b, h, q, k: 2.0 / s): ("1.0f", "1.0f"),
             (lambda s, b, h, q, k: s * 0.0 + 1.0): ("1.0f", "1.0f")}
    for fn, expected in cases.items():
        graph = mods.trace_score_mod(fn)
        core, in_scale, out_scale = mod_codegen.fold_scales(graph)
        assert (in_scale, out_scale) == expected
        folded = trace.evaluate(core, dict(inputs, score=scores * float(in_scale[:-1]))) * float(out_scale[:-1])
        assert np.allclose(folded, trace.evaluate(graph, dict(inputs, score=scores)), rtol=1e-6, atol=1e-6)
    assert mod_codegen.fold_scales(mods.trace_score_mod(mods.alibi(np.zeros(4, np.float32))))[1:] == ("1.0f", "1.0f")


# -- the generated CUDA ---------------------------------------------------------------------------------

def test_mod_parts_by_the_indices_they_read():
    """The kernels evaluate a mod in parts: nodes of b and h alone, of the query, of the key, and
    of both; a load's class follows its indices."""
    lengths, doc = np.zeros(2, np.int32), np.zeros((2, 64), np.int32)

    def padded(b, h, q_idx, kv_idx):
        return (kv_idx < lengths[b]) & (q_idx < lengths[b] + h) & (doc[b, q_idx] == doc[b, kv_idx])

    graph = mods.trace_mask_mod(padded)
    classes = mod_codegen.node_classes(graph)
    by_op = {}
    for node, kind in zip(graph.nodes, classes):
        by_op.setdefault(node.op, []).append(kind)
    assert by_op["load"].count("bh") == 1 and by_op["load"].count("row") == 1 and by_op["load"].count("col") == 1
    assert by_op["lt"] == ["col", "row"]
    assert by_op["eq"] == ["pair"] and classes[graph.output] == "pair"
    assert set(by_op["sym"]) == {"free"}


def test_the_generated_functions_compile():
    """Every mod above, and one of each operator, as __device__ functions called by a kernel,
    compiled by NVRTC for sm_90a (no GPU needed)."""
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc

    table = np.zeros((4, 8), np.float16)
    doc = np.zeros((2, 64), np.int32)
    flags = np.zeros(64, np.bool_)

    def everything(score, b, h, q_idx, kv_idx):
        x = mods.exp2(score) + mods.log(mods.abs(score) + 1) - mods.floor(score) * mods.tanh(score)
        y = mods.minimum(q_idx // 3, kv_idx % 5) + mods.maximum(-q_idx, kv_idx) - abs(h - 1)
        z = mods.where(flags[kv_idx] | ~(doc[b, q_idx] == doc[b, kv_idx]), x, score / (1 + y))
        return z + table[h, kv_idx % 8] + float("-inf") * 0 + mods.sqrt(score * score) ** 0.5

    lengths = np.zeros(2, np.int32)

    def padded(b, h, q_idx, kv_idx):  # nodes of b alone feed both the query's and the key's parts
        return (kv_idx < lengths[b]) & (q_idx < lengths[b] + h) & (doc[b, q_idx] == doc[b, kv_idx])

    graphs = [mods.trace_score_mod(f) for f in (everything, mods.softcap(30.0), mods.alibi(np.zeros(4, np.float32)))]
    graphs += [mods.trace_mask_mod(f) for f in (mods.sliding_window(128), mods.document_mask(doc, causal=True),
                                                padded, mods.chunked(8192))]
    graphs.append(mod_grad.derivative(graphs[0]))
    source = "".join(mods.cuda_source(g) + mod_codegen.generate_split(g) for g in graphs)
    calls = []
    for g in graphs:
        name = f"cuflash_{g.kind}_mod_{g.digest}"
        arguments = "1.5f, 1, 2, 3, 4" if g.kind != "mask" else "1, 2, 3, 4"
        calls.append(f"{{ {name}_arrays a{len(calls)} = {{}}; out[{len(calls)}] = (float){name}({arguments}, a{len(calls)}); }}")
        split = f"{name}_pair({arguments}, {name}_row_part(1, 2, 3, a{len(calls)}), {name}_col_part(1, 2, 4, a{len(calls)}), a{len(calls)})"
        calls.append(f"{{ {name}_arrays a{len(calls)} = {{}}; out[{len(calls)}] = (float){split}; }}")
    source += "extern \"C\" __global__ void probe(float* out) {\n" + "\n".join(calls) + "\n}\n"
    program = nvrtc.createProgram(source, "mods.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, ["--gpu-architecture=sm_90a", "-std=c++17",
                                           "--device-as-default-execution-space"])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(program) + "\n" + source)
    finally:
        nvrtc.destroyProgram(program)


def test_the_fp8_reference_and_baseline_take_mods():
    from cuflash.fp8 import quantize_fp8

    x = [RNG.standard_normal((1, 2, 33, 16)).astype(np.float32) for _ in range(3)]
    (q, qd), (k, kd), (v, vd) = (quantize_fp8(a, "e4m3", "head") for a in x)
    args = dict(fp8_format="e4m3", q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    plain = reference.attention_fp8_reference(q, k, v, **args)
    assert np.array_equal(reference.attention_fp8_reference(q, k, v, **args, mask_mod=lambda b, h, i, j: j >= 0)[0],
                          plain[0])
    capped, capped_lse = reference.attention_fp8_reference(q, k, v, **args, score_mod=mods.softcap(5.0))
    naive, naive_lse = reference.attention_fp8_naive(q, k, v, **args, score_mod=mods.softcap(5.0))
    assert np.abs(capped - plain[0]).max() > 0.1                    # the cap changes the result
    assert np.abs(naive.astype(np.float64) - capped).max() < 0.05   # within the baseline's roundings
    assert np.allclose(naive_lse, capped_lse, atol=1e-3)


def test_varlen_backward_runs_mods_only_in_its_one_launch():
    """Per-sequence calls would see b = 0, so mods on packed sequences refuse every other path."""
    import cuflash

    q = np.ones((10, 2, 64), dtype=np.float16)
    lse = np.zeros((2, 10), dtype=np.float32)
    cu = np.array([0, 4, 10], dtype=np.int32)

    def bias(score, b, h, q_idx, kv_idx):
        return score + 0.5 * b

    with pytest.raises(ValueError, match="one launch of the Hopper backward.*CuPy"):
        cuflash.attention_varlen_backward(q, q, q, q, q, lse, cu, cu, score_mod=bias)
    with pytest.raises(ValueError, match="softcap=5.0 and score_mod"):
        cuflash.attention_varlen_backward(q, q, q, q, q, lse, cu, cu, score_mod=bias, softcap=5.0)
    with pytest.raises(ValueError, match="window_size"):
        cuflash.attention_varlen_backward(q, q, q, q, q, lse, cu, cu, causal=True, window_size=(3, 0),
                                          mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)


def test_chunked_attention_stays_in_its_block():
    """mods.chunked: pairs in the same block of `chunk` positions (and causal), as Llama 4's
    chunked local attention; bad chunk sizes are named."""
    q_idx, kv_idx = np.meshgrid(np.arange(20), np.arange(20), indexing="ij")
    allowed = mods.chunked(8)(0, 0, q_idx, kv_idx)
    assert np.array_equal(allowed, (q_idx // 8 == kv_idx // 8) & (q_idx >= kv_idx))
    assert np.array_equal(mods.chunked(8, causal=False)(0, 0, q_idx, kv_idx), q_idx // 8 == kv_idx // 8)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 20, 16)) for _ in range(3))
    out, _ = reference.attention_reference(q, k, v, mask_mod=mods.chunked(8))
    for start in (0, 8, 16):
        rows = slice(start, min(start + 8, 20))
        want, _ = reference.attention_reference(q[:, :, rows], k[:, :, rows], v[:, :, rows], causal=True)
        assert np.allclose(out[:, :, rows], want)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="chunk="):
            mods.chunked(bad)

