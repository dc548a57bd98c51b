"""cuflash: FlashAttention for CuPy, from CUDA templates specialized per head dim, dtype and causality.

    out = cuflash.attention(q, k, v, causal=True)
    out, backward = cuflash.attention_with_grad(q, k, v, causal=True); dq, dk, dv = backward(dout)

The entry points (forward, backward, fp8) call the pipeline in :mod:`cuflash.core`:
validate -> spec (chosen by the policy table) -> render -> compile (cached) -> launch.
Each public name is imported when first used, so ``import cuflash`` itself costs next to nothing.
"""
import importlib

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_PUBLIC = {
    "attention": "cuflash.forward", "select_spec": "cuflash.forward",
    "attention_backward": "cuflash.backward", "attention_with_grad": "cuflash.backward",
    "KernelSpec": "cuflash.core.spec", "HEAD_DIMS": "cuflash.core.spec", "BwdSpec": "cuflash.core.bwd_spec",
    "default_spec": "cuflash.core.policy", "default_bwd_spec": "cuflash.core.policy",
    "generate": "cuflash.core.render",
    "CompileError": "cuflash.core.compile", "compile_offline": "cuflash.core.compile", "warmup": "cuflash.core.compile",
    "quantize_fp8": "cuflash.fp8", "dequantize_fp8": "cuflash.fp8", "random_rotation": "cuflash.fp8",
    "prepare_v": "cuflash.fp8", "PreparedV": "cuflash.fp8",
    "merge_states": "cuflash.serving", "attention_with_kvcache_reference": "cuflash.serving",
    "attention_with_kvcache": "cuflash.kvcache", "append_kv": "cuflash.kvcache", "attention_varlen": "cuflash.varlen",
    "attention_varlen_backward": "cuflash.varlen", "attention_varlen_with_grad": "cuflash.varlen", "DecodeSpec": "cuflash.core.decode_spec",
    "block_mask": "cuflash.sparsity", "BlockMask": "cuflash.sparsity",
}
#: Public submodules.
_SUBMODULES = ("reference", "testing", "mods")

__all__ = [*_PUBLIC, *_SUBMODULES, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"cuflash.{name}")
    else:
        raise AttributeError(f"module 'cuflash' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
