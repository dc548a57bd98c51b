"""The operators of traced mods on NumPy values, with Python's semantics (true division gives a
float, floor division and modulo round toward minus infinity): the reference's arithmetic."""
from __future__ import annotations

import numpy as np


def _floordiv(a, b):
    return np.floor_divide(a, b) if np.issubdtype(np.result_type(a, b), np.integer) else np.floor(a / b)


_NUMPY_OPS = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide, "floordiv": _floordiv,
    "mod": np.mod, "pow": np.power, "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "eq": np.equal, "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor,
    "minimum": np.minimum, "maximum": np.maximum, "neg": np.negative, "abs": np.abs, "exp": np.exp,
    "exp2": np.exp2, "log": np.log, "log2": np.log2, "tanh": np.tanh, "sqrt": np.sqrt, "floor": np.floor,
    "not": np.logical_not, "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
}


def evaluate_op(op: str, values: tuple):
    with np.errstate(all="ignore"):
        if op in ("div", "pow"):
            values = tuple(np.asarray(v, dtype=np.float64) if np.issubdtype(np.asarray(v).dtype, np.integer)
                           else v for v in values)
        return _NUMPY_OPS[op](*values)
