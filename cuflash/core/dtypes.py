"""The one table that spells dtypes: NumPy dtype <-> CUDA C type <-> name tag.

Nothing else in cuflash names a dtype by string; everything goes through :data:`DTYPES`.
CuPy represents bfloat16 with ml_dtypes' type (imported only when bfloat16 is first needed),
whose ``kind`` is not ``"f"``, so dtypes are compared by identity, never by kind.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    tag: str            # short name used in spec names, CLI flags and file names
    numpy_name: str     # element type on the NumPy / CuPy side (bfloat16: ml_dtypes', imported when first needed)
    ctype: str          # element type the kernel reads (a raw integer type for 16-bit floats)
    itemsize: int
    tensor_core: bool   # True: mma.sync path; False: exact float32 SIMT path
    mma_suffix: str     # operand type in the mma / cvt PTX mnemonics ("" when not on tensor cores)

    @property
    def numpy(self) -> np.dtype:
        """The NumPy dtype of the elements."""
        return _numpy_dtype(self.numpy_name)


@functools.lru_cache(maxsize=None)
def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # about half a second: only when bfloat16 is first needed
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


DTYPES: dict[str, DType] = {
    "fp16": DType("fp16", "float16", "unsigned short", 2, True, "f16"),
    "bf16": DType("bf16", "bfloat16", "unsigned short", 2, True, "bf16"),
    "fp32": DType("fp32", "float32", "float", 4, False, ""),
}

#: FP8 inputs (Hopper kernel): 1-byte codes of float8 e4m3 / e5m2 (see cuflash.fp8), held in
#: uint8 arrays. A uint8 array does not say which format it holds, so these are chosen by tag
#: (``fp8_format=``), never from an array's dtype.
FP8_DTYPES: dict[str, DType] = {
    "e4m3": DType("e4m3", "uint8", "unsigned char", 1, True, "e4m3"),
    "e5m2": DType("e5m2", "uint8", "unsigned char", 1, True, "e5m2"),
}

#: Output dtypes of FP8 attention.
FP8_OUT_TAGS = ("bf16", "fp16")

_ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32",
            "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
#: NumPy dtypes by name, so that float16 and float32 arrays are looked up without ml_dtypes.
_BY_NAME = {"float16": DTYPES["fp16"], "float32": DTYPES["fp32"], "bfloat16": DTYPES["bf16"]}


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
    dtype = np.dtype(dtype)
    entry = _BY_NAME.get(dtype.name)
    if entry is not None and (entry.tag != "bf16" or dtype == entry.numpy):
        return entry
    if dtype.itemsize == 1:
        raise TypeError(f"dtype {dtype}: 1-byte arrays are taken as FP8 codes only with "
                        f"fp8_format='e4m3' or 'e5m2'")
    names = ", ".join(d.numpy_name for d in DTYPES.values())
    raise TypeError(f"dtype {dtype} is not supported; use one of {names}")


def lookup(dtype) -> DType:
    """The entry of anything that names a dtype: a :class:`DType`, a tag or alias (``"bf16"``,
    ``"float16"``, ``"e4m3"``), or a dtype object (``numpy.float16``, ``ml_dtypes.bfloat16``,
    ``ml_dtypes.float8_e4m3fn``). Raises ValueError/TypeError naming it otherwise."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, str):
        return from_tag(dtype)
    if dtype is None:  # np.dtype(None) would be float64
        raise TypeError("dtype=None is neither a dtype tag nor a dtype")
    try:
        numpy_dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype={dtype!r} is neither a dtype tag nor a dtype") from None
    if numpy_dtype.name in ("float8_e4m3fn", "float8_e5m2"):
        return FP8_DTYPES[_ALIASES[numpy_dtype.name]]
    return from_numpy(numpy_dtype)
