"""CUDA for a traced mod: a graph (:mod:`cuflash.core.trace`) -> one ``__device__`` function.

The function takes the mod's symbols (``float score`` for a score_mod, then ``int b, h, q_idx,
kv_idx``) and a struct of the captured arrays (a pointer and four element strides each), and
computes the graph's nodes in order, one ``const`` each, in float32 and int32 with Python's
floor division and modulo. Its name carries the graph's digest, so one source holds the functions
of several mods.
"""
from __future__ import annotations

import math

from .trace import BOOL, FLOAT, INT, Graph

_CTYPES = {FLOAT: "float", INT: "int", BOOL: "bool"}

#: How each captured element type is read and turned into the node's type.
_LOADS = {
    "float32": "static_cast<const float*>(p)[i]",
    "float64": "static_cast<float>(static_cast<const double*>(p)[i])",
    "float16": "cuflash_mod_half(static_cast<const unsigned short*>(p)[i])",
    "bfloat16": "__uint_as_float(static_cast<unsigned>(static_cast<const unsigned short*>(p)[i]) << 16)",
    "int8": "static_cast<int>(static_cast<const signed char*>(p)[i])",
    "int16": "static_cast<int>(static_cast<const short*>(p)[i])",
    "int32": "static_cast<const int*>(p)[i]",
    "uint8": "static_cast<int>(static_cast<const unsigned char*>(p)[i])",
    "uint16": "static_cast<int>(static_cast<const unsigned short*>(p)[i])",
    "bool": "(static_cast<const unsigned char*>(p)[i] != 0)",
}

#: Helpers every generated source starts with (once; guarded).
PRELUDE = r"""#ifndef CUFLASH_MOD_PRELUDE
#define CUFLASH_MOD_PRELUDE
struct CuflashModArray { const void* ptr; long long stride[4]; };
__device__ __forceinline__ int cuflash_mod_floordiv(int a, int b) {
    int q = a / b;
    return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ int cuflash_mod_mod(int a, int b) {
    int r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ float cuflash_mod_fmod(float a, float b) { return a - floorf(a / b) * b; }
__device__ __forceinline__ float cuflash_mod_half(unsigned short h) {
    unsigned sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0u) {
        float value = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
        return sign ? -value : value;
    }
    return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}
#endif
"""


def _literal(value, dtype: str) -> str:
    if dtype == BOOL:
        return "true" if value else "false"
    if dtype == INT:
        # -2147483648 is no int literal in C++ (the minus applies to a value int cannot hold)
        return "(-2147483647 - 1)" if value == -2**31 else f"({int(value)})"
    if math.isnan(value):
        return "__int_as_float(0x7fc00000)"
    if math.isinf(value):
        return "__int_as_float(0x7f800000)" if value > 0 else "__int_as_float(0xff800000)"
    return f"{float(value)!r}f"


def _as(dtype: str, name: str, want: str) -> str:
    return f"static_cast<{_CTYPES[want]}>({name})" if dtype != want else name


def function_name(graph: Graph) -> str:
    return f"cuflash_{graph.kind}_mod_{graph.digest}"


def args_struct(graph: Graph) -> str:
    """The struct of the captured arrays the function takes (one CuflashModArray per slot)."""
    return f"CuflashModArray arrays[{max(len(graph.arrays), 1)}]"


def generate(graph: Graph) -> str:
    """The prelude and the ``__device__`` function of one traced mod."""
    nodes = graph.nodes
    symbols = ", ".join(f"{'float' if s == 'score' else 'int'} {s}" for s in graph.symbols)
    lines = [PRELUDE,
             f"struct {function_name(graph)}_arrays {{ {args_struct(graph)}; }};",
             f"__device__ __forceinline__ {_CTYPES[nodes[graph.output].dtype]} {function_name(graph)}("
             f"{symbols}, const {function_name(graph)}_arrays& mod) {{"]
    names = []
    for i, node in enumerate(nodes):
        name = f"t{i}"
        a = [names[j] for j in node.args] if node.op not in ("const", "sym", "load") else []
        t = [nodes[j].dtype for j in node.args] if a else []
        op, out = node.op, node.dtype
        if op == "const":
            expr = _literal(node.args[0], out)
        elif op == "sym":
            expr = node.args[0]
        elif op == "load":
            slot, *index = node.args
            offset = " + ".join(f"static_cast<long long>({names[j]}) * mod.arrays[{slot}].stride[{d}]"
                                for d, j in enumerate(index))
            load = _LOADS[str(graph.arrays[slot].dtype)]
            expr = f"[&]() {{ const void* p = mod.arrays[{slot}].ptr; const long long i = {offset}; return {load}; }}()"
        elif op in ("add", "sub", "mul"):
            symbol = {"add": "+", "sub": "-", "mul": "*"}[op]
            expr = f"{_as(t[0], a[0], out)} {symbol} {_as(t[1], a[1], out)}"
        elif op == "div":
            expr = f"{_as(t[0], a[0], FLOAT)} / {_as(t[1], a[1], FLOAT)}"
        elif op == "floordiv":
            expr = f"cuflash_mod_floordiv({a[0]}, {a[1]})" if out == INT else \
                f"floorf({_as(t[0], a[0], FLOAT)} / {_as(t[1], a[1], FLOAT)})"
        elif op == "mod":
            expr = f"cuflash_mod_mod({a[0]}, {a[1]})" if out == INT else \
                f"cuflash_mod_fmod({_as(t[0], a[0], FLOAT)}, {_as(t[1], a[1], FLOAT)})"
        elif op == "pow":
            expr = f"powf({_as(t[0], a[0], FLOAT)}, {_as(t[1], a[1], FLOAT)})"
        elif op in ("lt", "le", "gt", "ge", "eq", "ne"):
            symbol = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}[op]
            common = FLOAT if FLOAT in t else t[0]
            expr = f"{_as(t[0], a[0], common)} {symbol} {_as(t[1], a[1], common)}"
        elif op in ("and", "or", "xor"):
            expr = f"{a[0]} {'&&' if op == 'and' else '||' if op == 'or' else '!='} {a[1]}"
        elif op in ("minimum", "maximum"):
            if out == FLOAT:
                expr = f"{'fminf' if op == 'minimum' else 'fmaxf'}({_as(t[0], a[0], FLOAT)}, {_as(t[1], a[1], FLOAT)})"
            else:
                expr = f"{'min' if op == 'minimum' else 'max'}({a[0]}, {a[1]})"
        elif op == "where":
            expr = f"{a[0]} ? {_as(t[1], a[1], out)} : {_as(t[2], a[2], out)}"
        elif op == "neg":
            expr = f"-{a[0]}"
        elif op == "abs":
            expr = f"fabsf({a[0]})" if out == FLOAT else f"abs({a[0]})"
        elif op == "not":
            expr = f"!{a[0]}"
        elif op == "floor":
            expr = f"floorf({a[0]})" if out == FLOAT else a[0]
        elif op == "sigmoid":
            expr = f"1.0f / (1.0f + expf(-{_as(t[0], a[0], FLOAT)}))"
        else:
            function = {"exp": "expf", "exp2": "exp2f", "log": "logf", "log2": "log2f", "tanh": "tanhf",
                        "sqrt": "sqrtf"}[op]
            expr = f"{function}({_as(t[0], a[0], FLOAT)})"
        lines.append(f"    const {_CTYPES[out]} {name} = {expr};")
        names.append(name)
    lines.append(f"    return {names[graph.output]};")
    lines.append("}")
    return "\n".join(lines) + "\n"
