"""The one table that spells dtypes: NumPy dtype <-> CUDA C type <-> name tag.

Nothing else in cuflash names a dtype by string; everything goes through :data:`DTYPES`.
CuPy represents bfloat16 with ml_dtypes' type, whose ``kind`` is not ``"f"``, so dtypes are
compared by identity, never by kind.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    tag: str            # short name used in spec names, CLI flags and file names
    numpy: np.dtype     # element type on the NumPy / CuPy side
    ctype: str          # element type the kernel reads (a raw integer type for 16-bit floats)
    itemsize: int
    tensor_core: bool   # True: mma.sync path; False: exact float32 SIMT path
    mma_suffix: str     # operand type in the mma / cvt PTX mnemonics ("" when not on tensor cores)


DTYPES: dict[str, DType] = {
    "fp16": DType("fp16", np.dtype(np.float16), "unsigned short", 2, True, "f16"),
    "bf16": DType("bf16", np.dtype(ml_dtypes.bfloat16), "unsigned short", 2, True, "bf16"),
    "fp32": DType("fp32", np.dtype(np.float32), "float", 4, False, ""),
}

#: FP8 inputs (Hopper kernel): 1-byte codes of float8 e4m3 / e5m2 (see cuflash.fp8), held in
#: uint8 arrays. A uint8 array does not say which format it holds, so these are chosen by tag
#: (``fp8_format=``), never from an array's dtype.
FP8_DTYPES: dict[str, DType] = {
    "e4m3": DType("e4m3", np.dtype(np.uint8), "unsigned char", 1, True, "e4m3"),
    "e5m2": DType("e5m2", np.dtype(np.uint8), "unsigned char", 1, True, "e5m2"),
}

#: Output dtypes of FP8 attention.
FP8_OUT_TAGS = ("bf16", "fp16")

_BY_NUMPY = {d.numpy: d for d in DTYPES.values()}
_ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}


def from_tag(tag: str) -> DType:
    """Look up a dtype by tag (``"bf16"``) or a common alias (``"bfloat16"``)."""
    key = _ALIASES.get(tag, tag)
    if key in FP8_DTYPES:
        return FP8_DTYPES[key]
    if key not in DTYPES:
        raise ValueError(f"dtype {tag!r} is not supported; choose one of {sorted(DTYPES) + sorted(FP8_DTYPES)}")
    return DTYPES[key]


def from_numpy(dtype) -> DType:
    """Look up the entry of a NumPy/CuPy dtype; raises TypeError for unsupported ones."""
    entry = _BY_NUMPY.get(np.dtype(dtype))
    if entry is None and np.dtype(dtype).itemsize == 1:
        raise TypeError(f"dtype {np.dtype(dtype)}: 1-byte arrays are taken as FP8 codes only with "
                        f"fp8_format='e4m3' or 'e5m2'")
    if entry is None:
        names = ", ".join(str(d.numpy) for d in DTYPES.values())
        raise TypeError(f"dtype {np.dtype(dtype)} is not supported; use one of {names}")
    return entry
