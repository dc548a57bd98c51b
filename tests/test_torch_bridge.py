"""cuflash.torch without a GPU: the import guard, what import cuflash leaves out, the operators'
shapes on meta tensors (the functions torch.compile traces with), the argument checks."""
import subprocess
import sys

import pytest


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_cuflash_never_imports_torch():
    result = _python("import sys, cuflash; cuflash.attention; cuflash.attention_backward; cuflash.generate; "
                     "print('torch' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_bridge_without_torch_says_what_is_missing():
    result = _python("import sys; sys.modules['torch'] = None\n"
                     "try:\n    import cuflash.torch\n"
                     "except ImportError as exc:\n    print('ImportError:', exc)\n")
    assert result.returncode == 0, result.stderr
    assert "ImportError: cuflash.torch needs PyTorch" in result.stdout


torch = pytest.importorskip("torch")
import cuflash.torch as ct  # noqa: E402


def _meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(shape, device="meta", dtype=dtype, requires_grad=grad)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_operator_shapes_on_meta_tensors(layout):
    b, h, hk, sq, sk, d = 2, 8, 2, 17, 33, 64
    q = _meta(b, h, sq, d) if layout == "bhsd" else _meta(b, sq, h, d)
    k = _meta(b, hk, sk, d) if layout == "bhsd" else _meta(b, sk, hk, d)
    out, lse = torch.ops.cuflash.attention(q, k, k, True, 0.125, layout, False)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    grads = torch.ops.cuflash.attention_backward(out, q, k, k, out, lse, True, 0.125, layout, False)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


def test_autograd_reaches_the_backward_operator_on_meta_tensors():
    q, k, v = (_meta(1, 4, 16, 64, grad=True), _meta(1, 2, 16, 64, grad=True), _meta(1, 2, 16, 64, grad=True))
    out = ct.attention(q, k, v, causal=True)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_sinks_operators_and_autograd_on_meta_tensors(layout):
    b, h, hk, sq, sk, d = 2, 8, 2, 17, 33, 64
    q = _meta(b, h, sq, d, grad=True) if layout == "bhsd" else _meta(b, sq, h, d, grad=True)
    k = _meta(b, hk, sk, d, grad=True) if layout == "bhsd" else _meta(b, sk, hk, d, grad=True)
    sinks = _meta(h, dtype=torch.float32, grad=True)
    out, lse = ct.attention(q, k, k, causal=True, layout=layout, return_lse=True, sinks=sinks)
    assert out.shape == q.shape and lse.shape == (b, h, sq) and lse.dtype == torch.float32
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert sinks.grad.shape == sinks.shape and sinks.grad.dtype == torch.float32


def test_bad_sinks_are_named():
    m = _meta(1, 4, 8, 64)
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        ct.attention(m, m, m, sinks=[0.0] * 4)
    with pytest.raises(ValueError, match=r"sinks.shape=\(2,\) must be \(heads,\) = \(4,\)"):
        ct.attention(m, m, m, sinks=_meta(2, dtype=torch.float32))
    with pytest.raises(TypeError, match="floating-point"):
        ct.attention(m, m, m, sinks=_meta(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="sinks is on cpu"):
        ct.attention(m, m, m, sinks=torch.zeros(4))


def test_bad_arguments_are_named():
    q = torch.zeros(1, 2, 8, 64)
    with pytest.raises(ValueError, match="cpu"):
        ct.attention(q, q, q)
    with pytest.raises(TypeError, match="torch.int32"):
        m = _meta(1, 2, 8, 64, dtype=torch.int32)
        ct.attention(m, m, m)
    with pytest.raises(TypeError, match="numpy"):
        import numpy as np
        ct.attention(np.zeros((1, 2, 8, 64)), q, q)
    m = _meta(1, 2, 8, 64)
    with pytest.raises(ValueError, match="layout='bsdh'"):
        ct.attention(m, m, m, layout="bsdh")
    with pytest.raises(TypeError, match="causal"):
        ct.attention(m, m, m, causal=1)


def test_the_transformers_name_avoids_flash():
    assert "flash" not in ct.TRANSFORMERS_NAME
    with pytest.raises(ValueError, match="flash"):
        ct.register_transformers("cuflash")


def test_mods_refuse_meta_tensors_and_check_sinks_beside_them():
    q = _meta(1, 4, 16, 64)
    with pytest.raises(ValueError, match="not on meta tensors"):
        ct.attention(q, q, q, score_mod=lambda score, b, h, q_idx, kv_idx: score)
    with pytest.raises(ValueError, match=r"sinks.shape=\(3,\) must be \(heads,\) = \(4,\)"):
        ct.attention(q, q, q, sinks=_meta(3, dtype=torch.float32), mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mods_capture_torch_tensors_as_they_capture_arrays(dtype):
    """A captured CPU tensor is read by the reference as the NumPy array over its memory."""
    import numpy as np

    from cuflash import reference

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 3, 9, 16)) for _ in range(3))
    slopes = torch.tensor([0.5, -0.25, 1.0], dtype=dtype)
    host = slopes.float().numpy()

    def with_tensor(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def with_array(score, b, h, q_idx, kv_idx):
        return score + host[h] * (kv_idx - q_idx)

    got = reference.attention_reference(q, k, v, score_mod=with_tensor)
    want = reference.attention_reference(q, k, v, score_mod=with_array)
    for g, w in zip(got, want):  # out and LSE
        assert np.allclose(g, w, rtol=0, atol=1e-12)


def test_a_kept_trace_follows_a_captured_tensors_memory():
    from cuflash.core import modset

    table = torch.arange(4, dtype=torch.float32)

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[h]

    first = modset.trace_key(mod)
    assert first is not None and modset.trace_key(mod) == first
    table.data = torch.zeros(4)  # the same tensor over new memory: traced again
    assert modset.trace_key(mod) != first


def test_kvcache_operator_shapes_on_meta_tensors_and_under_torch_compile():
    """attention_with_kvcache traced: one operator (which appends to the caches in place), its
    output [batch, seqlen_q, heads, head_dim] and LSE [batch, heads, seqlen_q], or with packed
    queries [total_q, heads, head_dim] and [heads, total_q]; torch.compile(fullgraph=True) takes
    it with no graph break."""
    q, cache = _meta(2, 3, 8, 64), _meta(2, 128, 2, 64)
    lens = _meta(2, dtype=torch.int32)
    out, lse = ct.attention_with_kvcache(q, cache, cache, cache_seqlens=lens, k_new=_meta(2, 3, 2, 64),
                                         v_new=_meta(2, 3, 2, 64), return_lse=True, window_size=(64, 0))
    assert out.shape == q.shape and lse.shape == (2, 8, 3) and lse.dtype == torch.float32
    packed = _meta(7, 8, 64)
    out, lse = ct.attention_with_kvcache(packed, cache, cache, cache_seqlens=lens, return_lse=True,
                                         cu_seqlens_q=_meta(3, dtype=torch.int32), max_seqlen_q=5, k_descale=0.5)
    assert out.shape == packed.shape and lse.shape == (8, 7)

    def step(q, k_cache, v_cache, lens, k, v):
        return ct.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k_new=k, v_new=v, num_splits=2)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    out = compiled(q, cache, cache, lens, _meta(2, 3, 2, 64), _meta(2, 3, 2, 64))
    assert out.shape == q.shape


def test_kvcache_bridge_names_bad_arguments():
    q, cache = _meta(2, 3, 8, 64), _meta(2, 128, 2, 64)
    with pytest.raises(TypeError, match="cache_seqlens must be a torch.int32 tensor"):
        ct.attention_with_kvcache(q, cache, cache, cache_seqlens="7")
    with pytest.raises(TypeError, match="k_descale must be a positive number"):
        ct.attention_with_kvcache(q, cache, cache, cache_seqlens=7, k_descale="x")
    with pytest.raises(TypeError, match="q must be a CUDA torch tensor"):
        ct.attention_with_kvcache(torch.zeros(2, 3, 8, 64), cache, cache, cache_seqlens=7)
    with pytest.raises(ValueError, match="not on meta tensors"):
        ct.attention_with_kvcache(q, cache, cache, cache_seqlens=7, score_mod=lambda s, b, h, i, j: s)


def test_append_kv_operator_on_meta_tensors_and_under_torch_compile():
    """cuflash.torch.append_kv traced: the operator that writes the caches in place, with no graph
    break under torch.compile(fullgraph=True)."""
    def args():
        return (_meta(4, 16, 2, 64), _meta(4, 16, 2, 64), _meta(3, 2, 64), _meta(3, 2, 64), _meta(3, dtype=torch.int32))

    assert ct.append_kv(*args()) is None
    compiled = torch.compile(lambda *a: ct.append_kv(*a), fullgraph=True, backend="eager")
    assert compiled(*args()) is None
    with pytest.raises(TypeError, match="slot_mapping must be a CUDA torch tensor"):
        ct.append_kv(*args()[:4], [0, 1, 2])
