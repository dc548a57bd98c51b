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
