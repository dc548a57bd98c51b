"""cuflash: FlashAttention for CuPy, from CUDA templates specialized per head dim, dtype and causality.

    out = cuflash.attention(q, k, v, causal=True)
    out, backward = cuflash.attention_with_grad(q, k, v, causal=True); dq, dk, dv = backward(dout)

The entry points (forward, backward, fp8) call the pipeline in :mod:`cuflash.core`:
validate -> spec (chosen by the policy table) -> render -> compile (cached) -> launch.
"""
from . import reference, testing
from .backward import attention_backward, attention_with_grad
from .core.bwd_spec import BwdSpec
from .core.compile import CompileError, compile_offline, warmup
from .core.policy import default_bwd_spec, default_spec
from .core.render import generate
from .core.spec import HEAD_DIMS, KernelSpec
from .forward import attention, select_spec
from .fp8 import PreparedV, dequantize_fp8, prepare_v, quantize_fp8, random_rotation

__version__ = "0.1.0"

__all__ = ["attention", "attention_backward", "attention_with_grad", "select_spec",
           "KernelSpec", "BwdSpec", "default_spec", "default_bwd_spec", "HEAD_DIMS", "generate",
           "CompileError", "compile_offline", "warmup",
           "quantize_fp8", "dequantize_fp8", "random_rotation", "prepare_v", "PreparedV",
           "reference", "testing", "__version__"]
