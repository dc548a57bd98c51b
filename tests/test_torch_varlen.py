"""cuflash.torch.attention_varlen without a GPU: CPU tensors stand in for CUDA ones and the float64
reference, sequence by sequence, for cuflash's varlen kernels; autograd's q, k, v and sinks
gradients must come back in their places, and bad arguments are named."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import cuflash.torch_varlen as tv  # noqa: E402
from cuflash import reference  # noqa: E402

LENGTHS_Q, LENGTHS_K = (5, 0, 9), (7, 3, 9)


def _packed(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _per_sequence(fn, cu_q, cu_k, *arrays_q_k):
    """fn on each sequence's rows: arrays given as (array, 'q' or 'k') pairs, [1, s, h, d] slices."""
    results = []
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        results.append(fn(*(x[qs if side == "q" else ks][None] for x, side in arrays_q_k)))
    return results


class _Calls(list):
    """The stand-in's calls, and (.mods) the mods its backward was given."""


@pytest.fixture
def stand_in(monkeypatch):
    """The bridge on CPU tensors: views are the tensors, the kernels the float64 reference."""
    import contextlib

    from cuflash import varlen

    calls, mods = _Calls(), []
    monkeypatch.setattr(tv, "_to_cupy", lambda x: x)
    monkeypatch.setattr(tv, "_to_torch", lambda x: x)
    monkeypatch.setattr(tv, "_on_torch_stream", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(tv, "_check", lambda *args: None)

    def forward(q, k, v, cu_q, cu_k, *, max_seqlen_q, causal, scale, window_size, softcap, return_lse, sinks,
                score_mod=None, mask_mod=None):
        calls.append(("forward", max_seqlen_q, causal, window_size, softcap))
        cu_q, cu_k = cu_q.numpy(), cu_k.numpy()
        s = None if sinks is None else sinks.detach().numpy().astype(np.float64)
        parts = _per_sequence(lambda q_, k_, v_: reference.attention_reference(
            q_, k_, v_, causal=causal, scale=scale, layout="bshd", sinks=s, window_size=window_size,
            softcap=softcap, score_mod=score_mod, mask_mod=mask_mod), cu_q, cu_k,
            (q.detach().numpy(), "q"), (k.detach().numpy(), "k"), (v.detach().numpy(), "k"))
        out = np.concatenate([o[0] for o, _ in parts])
        lse = np.concatenate([l[0] for _, l in parts], axis=1)
        return torch.tensor(out, dtype=q.dtype), torch.tensor(lse, dtype=torch.float32)

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, *, causal, scale, deterministic, sinks, window_size, softcap,
                 max_seqlen_q=None, max_seqlen_k=None, score_mod=None, mask_mod=None):
        mods.append((score_mod, mask_mod))
        calls.append(("backward", causal, deterministic, tuple(window_size), softcap))
        cu_q, cu_k = cu_q.numpy(), cu_k.numpy()
        s = None if sinks is None else sinks.detach().numpy().astype(np.float64)
        arrays = [(x.detach().numpy(), side) for x, side in ((dout, "q"), (q, "q"), (k, "k"), (v, "k"))]
        parts = _per_sequence(lambda do, q_, k_, v_: reference.attention_backward_reference(
            do, q_, k_, v_, causal=causal, scale=scale, layout="bshd", sinks=s, window_size=window_size,
            softcap=softcap, score_mod=score_mod, mask_mod=mask_mod), cu_q, cu_k, *arrays)
        grads = [torch.tensor(np.concatenate([p[i][0] for p in parts]), dtype=x.dtype)
                 for i, x in enumerate((q, k, v))]
        if s is not None:
            grads.append(torch.tensor(sum(p[3] for p in parts), dtype=sinks.dtype))
        return tuple(grads)

    monkeypatch.setattr(varlen, "attention_varlen", forward)
    monkeypatch.setattr(varlen, "attention_varlen_backward", backward)
    calls.mods = mods
    return calls


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    cu_q, cu_k = _packed(LENGTHS_Q), _packed(LENGTHS_K)
    q = torch.tensor(rng.standard_normal((cu_q[-1], 4, 16)), requires_grad=True)
    k, v = (torch.tensor(rng.standard_normal((cu_k[-1], 2, 16)), requires_grad=True) for _ in range(2))
    return q, k, v, torch.tensor(cu_q), torch.tensor(cu_k)


def _check_each_sequence(dout, q, k, v, cu_q, cu_k, **args):
    """q.grad, k.grad and v.grad hold each sequence's own causal gradients (the reference's)."""
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if qs.stop == qs.start:
            continue
        want = reference.attention_backward_reference(dout[qs][None].numpy(), q[qs][None].detach().numpy(),
                                                      k[ks][None].detach().numpy(), v[ks][None].detach().numpy(),
                                                      causal=True, layout="bshd", **args)
        for got, ref, rows in ((q.grad, want[0], qs), (k.grad, want[1], ks), (v.grad, want[2], ks)):
            assert np.allclose(got[rows].numpy(), ref[0])


@pytest.mark.parametrize("variants", [((-1, -1), 0.0), ((3, 0), 5.0)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_gradients_come_back_in_their_places(stand_in, with_sinks, variants):
    q, k, v, cu_q, cu_k = _inputs()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True) if with_sinks else None
    window_size, softcap = variants
    out, lse = tv.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=9, causal=True, return_lse=True,
                                   deterministic=True, sinks=sinks, window_size=window_size, softcap=softcap)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert stand_in == [("forward", 9, True, window_size, softcap), ("backward", True, True, window_size, softcap)]
    assert not lse.requires_grad and lse.shape == (4, q.shape[0])
    s = None if sinks is None else sinks.detach().numpy()
    _check_each_sequence(dout, q, k, v, cu_q, cu_k, sinks=s, window_size=window_size, softcap=softcap)
    assert (sinks is None) or sinks.grad is not None and sinks.grad.shape == (4,)


def test_a_call_without_a_gradient_runs_the_forward_only(stand_in):
    q, k, v, cu_q, cu_k = _inputs()
    with torch.no_grad():
        out = tv.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=9, window_size=(3, 0), softcap=5.0)
    assert out.shape == q.shape and stand_in == [("forward", 9, False, (3, 0), 5.0)]


def test_mods_traced_once_reach_both_passes(stand_in):
    """A score_mod and a mask_mod (neither reads b, so each sequence's reference is its own) give
    each sequence's gradients; the backward gets the graphs the forward traced."""
    q, k, v, cu_q, cu_k = _inputs(1)

    def bias(score, b, h, q_idx, kv_idx):
        return score + 0.25 * h - 0.1 * (q_idx - kv_idx)

    def near(b, h, q_idx, kv_idx):
        return kv_idx >= q_idx - 4

    out = tv.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=9, causal=True, score_mod=bias, mask_mod=near)
    dout = torch.randn_like(out)
    out.backward(dout)
    (score_graph, mask_graph), = stand_in.mods
    assert score_graph is not None and score_graph is not bias and mask_graph is not None
    _check_each_sequence(dout, q, k, v, cu_q, cu_k, score_mod=bias, mask_mod=near)
    with pytest.raises(ValueError, match="not on meta tensors"):
        meta = torch.empty((4, 4, 16), device="meta")
        tv.attention_varlen(meta, meta, meta, torch.empty(2, device="meta", dtype=torch.int32),
                            torch.empty(2, device="meta", dtype=torch.int32), mask_mod=near)


def test_bad_arguments_are_named():
    q, k, v, cu_q, cu_k = _inputs()
    with pytest.raises(ValueError, match="q is on cpu"):
        tv.attention_varlen(q, k, v, cu_q, cu_k)
    with pytest.raises(TypeError, match="cu_seqlens_k must be a torch.Tensor"):
        tv.attention_varlen(q, k, v, cu_q, np.zeros(4, np.int32))


def _meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(shape, device="meta", dtype=dtype, requires_grad=grad)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_traced_calls_take_the_operators_and_autograd_reaches_the_backward_one(with_sinks):
    q, k, v = _meta(40, 8, 64, grad=True), _meta(50, 2, 64, grad=True), _meta(50, 2, 64, grad=True)
    cu_q, cu_k = _meta(4, dtype=torch.int32), _meta(4, dtype=torch.int32)
    sinks = _meta(8, dtype=torch.float32, grad=True) if with_sinks else None
    variants = dict(window_size=(5, 0), softcap=3.0) if with_sinks else {}
    out, lse = tv.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=20, causal=True, return_lse=True, sinks=sinks,
                                   **variants)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (8, 40) and lse.dtype == torch.float32
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert (sinks is None) or sinks.grad.shape == (8,)
    with pytest.raises(ValueError, match="deterministic"):
        tv.attention_varlen(q, k, v, cu_q, cu_k, deterministic=True)
