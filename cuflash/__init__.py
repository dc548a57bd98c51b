"""cuflash: FlashAttention for CuPy, from CUDA templates specialized per head dim, dtype and causality.

    out = cuflash.attention(q, k, v, causal=True)

The call travels validate -> spec -> render -> compile (cached) -> launch; each step is one module.
"""
from . import validate
from .api import attention, select_spec
from .compile import CompileError, compile_offline, warmup
from .render import generate
from .spec import HEAD_DIMS, KernelSpec, default_spec

__version__ = "0.1.0"

__all__ = ["attention", "select_spec", "generate", "KernelSpec", "default_spec", "HEAD_DIMS",
           "CompileError", "compile_offline", "warmup", "__version__"]
