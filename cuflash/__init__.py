"""cuflash: FlashAttention for CuPy, from CUDA templates specialized per head dim, dtype and causality.

    out = cuflash.attention(q, k, v, causal=True)
    out, backward = cuflash.attention_with_grad(q, k, v, causal=True); dq, dk, dv = backward(dout)

The call travels validate -> spec -> render -> compile (cached) -> launch; each step is one module.
"""
from . import validate
from .api import attention, select_spec
from .backward import attention_backward, attention_with_grad
from .compile import CompileError, compile_offline, warmup
from .fp8 import PreparedV, dequantize_fp8, prepare_v, quantize_fp8, random_rotation
from .render import generate
from .spec import HEAD_DIMS, BwdSpec, KernelSpec, default_bwd_spec, default_spec

__version__ = "0.1.0"

__all__ = ["attention", "attention_backward", "attention_with_grad", "select_spec", "BwdSpec", "default_bwd_spec", "generate", "KernelSpec", "default_spec", "HEAD_DIMS",
           "CompileError", "compile_offline", "warmup", "quantize_fp8", "dequantize_fp8", "random_rotation",
           "prepare_v", "PreparedV",
           "__version__"]
