"""CUDA for a traced mod: a graph (:mod:`cuflash.core.trace`) -> one ``__device__`` function.

The function takes the mod's symbols (``float score`` for a score_mod, then ``int b, h, q_idx,
kv_idx``) and a struct of the captured arrays (a pointer, four element strides and four extents
each), and computes the graph's nodes in order, one ``const`` each, in float32 and int32 with
Python's floor division and modulo. A load whose index lies outside the array reads nothing and
gives NaN (float arrays), INT_MIN (integer arrays) or false (boolean arrays). Its name carries the
graph's digest, so one source holds the functions of several mods.

The kernels name mods by digest (``KernelSpec.score_mod``, ``mask_mod``): :func:`register` keeps
each traced graph's structure (not its arrays) under its digest for the renderer.
"""
from __future__ import annotations

import math

from .trace import BOOL, FLOAT, INT, Graph, Node

_CTYPES = {FLOAT: "float", INT: "int", BOOL: "bool"}

#: What a load outside its array gives, by the node's type.
_OUTSIDE = {FLOAT: "__int_as_float(0x7fc00000)", INT: "(-2147483647 - 1)", BOOL: "false"}

#: How each captured element type is read (through the read-only data cache: the arrays are
#: constants of the kernel) and turned into the node's type.
_LOADS = {
    "float32": "__ldg(static_cast<const float*>(p) + i)",
    "float64": "static_cast<float>(__ldg(static_cast<const double*>(p) + i))",
    "float16": "cuflash_mod_half(__ldg(static_cast<const unsigned short*>(p) + i))",
    "bfloat16": "__uint_as_float(static_cast<unsigned>(__ldg(static_cast<const unsigned short*>(p) + i)) << 16)",
    "int8": "static_cast<int>(__ldg(static_cast<const signed char*>(p) + i))",
    "int16": "static_cast<int>(__ldg(static_cast<const short*>(p) + i))",
    "int32": "__ldg(static_cast<const int*>(p) + i)",
    "uint8": "static_cast<int>(__ldg(static_cast<const unsigned char*>(p) + i))",
    "uint16": "static_cast<int>(__ldg(static_cast<const unsigned short*>(p) + i))",
    "bool": "(__ldg(static_cast<const unsigned char*>(p) + i) != 0)",
}

#: Helpers every generated source starts with (once; guarded).
PRELUDE = r"""#ifndef CUFLASH_MOD_PRELUDE
#define CUFLASH_MOD_PRELUDE
struct CuflashModArray { const void* ptr; long long stride[4]; int extent[4]; };
__device__ __forceinline__ int cuflash_mod_floordiv(int a, int b) {
    int q = a / b;
    return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ int cuflash_mod_mod(int a, int b) {
    int r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ float cuflash_mod_fmod(float a, float b) { return a - floorf(a / b) * b; }
// tanh on the special-function unit: one instruction (relative error about 2^-11).
__device__ __forceinline__ float cuflash_mod_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
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
    if dtype == want:
        return name
    return f"static_cast<{_CTYPES[want]}>({name})"


def function_name(graph: Graph) -> str:
    return f"cuflash_{graph.kind}_mod_{graph.digest}"


def args_struct(graph: Graph) -> str:
    """The struct of the captured arrays the function takes (one CuflashModArray per slot)."""
    return f"CuflashModArray arrays[{max(len(graph.arrays), 1)}]"


def _node_expr(graph: Graph, node, names: list) -> str:
    """The C++ expression of one node, its arguments named by ``names`` (node id -> name)."""
    nodes = graph.nodes
    a = [names[j] for j in node.args] if node.op not in ("const", "sym", "load") else []
    t = [nodes[j].dtype for j in node.args] if a else []
    op, out = node.op, node.dtype
    if op == "const":
        return _literal(node.args[0], out)
    if op == "sym":
        return node.args[0]
    if op == "load":
        slot, *index = node.args
        a_ = f"mod.arrays[{slot}]"
        offset = " + ".join(f"static_cast<long long>({names[j]}) * {a_}.stride[{d}]" for d, j in enumerate(index))
        inside = " && ".join(f"static_cast<unsigned>({names[j]}) < static_cast<unsigned>({a_}.extent[{d}])"
                             for d, j in enumerate(index))
        load = _LOADS[str(graph.arrays[slot].dtype)]
        # branch-free: an index outside reads element 0 and the value is replaced, so that the
        # compiler may hoist and share loads that do not depend on the element
        return (f"[&]() -> {_CTYPES[out]} {{ const bool inside = {inside}; const void* p = {a_}.ptr; "
                f"const long long i = inside ? {offset} : 0; const {_CTYPES[out]} value = {load}; "
                f"return inside ? value : {_OUTSIDE[out]}; }}()")
    if op in ("add", "sub", "mul"):
        symbol = {"add": "+", "sub": "-", "mul": "*"}[op]
        return f"{_as(t[0], a[0], out)} {symbol} {_as(t[1], a[1], out)}"
    if op == "div":
        return f"__fdividef({_as(t[0], a[0], FLOAT)}, {_as(t[1], a[1], FLOAT)})"
    if op == "floordiv":
        return f"cuflash_mod_floordiv({a[0]}, {a[1]})" if out == INT else \
            f"floorf({_as(t[0], a[0], FLOAT)} / {_as(t[1], a[1], FLOAT)})"
    if op == "mod":
        return f"cuflash_mod_mod({a[0]}, {a[1]})" if out == INT else \
            f"cuflash_mod_fmod({_as(t[0], a[0], FLOAT)}, {_as(t[1], a[1], FLOAT)})"
    if op == "pow":
        return f"powf({_as(t[0], a[0], FLOAT)}, {_as(t[1], a[1], FLOAT)})"
    if op in ("lt", "le", "gt", "ge", "eq", "ne"):
        symbol = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}[op]
        common = FLOAT if FLOAT in t else t[0]
        return f"{_as(t[0], a[0], common)} {symbol} {_as(t[1], a[1], common)}"
    if op in ("and", "or", "xor"):
        return f"{a[0]} {'&&' if op == 'and' else '||' if op == 'or' else '!='} {a[1]}"
    if op in ("minimum", "maximum"):
        if out == FLOAT:
            return f"{'fminf' if op == 'minimum' else 'fmaxf'}({_as(t[0], a[0], FLOAT)}, {_as(t[1], a[1], FLOAT)})"
        return f"{'min' if op == 'minimum' else 'max'}({a[0]}, {a[1]})"
    if op == "where":
        return f"{a[0]} ? {_as(t[1], a[1], out)} : {_as(t[2], a[2], out)}"
    if op == "neg":
        return f"-{a[0]}"
    if op == "abs":
        return f"fabsf({a[0]})" if out == FLOAT else f"abs({a[0]})"
    if op == "not":
        return f"!{a[0]}"
    if op == "floor":
        return f"floorf({a[0]})" if out == FLOAT else a[0]
    if op == "sigmoid":
        return f"__fdividef(1.0f, 1.0f + __expf(-{_as(t[0], a[0], FLOAT)}))"
    function = {"exp": "__expf", "exp2": "exp2f", "log": "__logf", "log2": "__log2f",
                "tanh": "cuflash_mod_tanh", "sqrt": "sqrtf"}[op]
    return f"{function}({_as(t[0], a[0], FLOAT)})"


def _symbols(graph: Graph) -> str:
    return ", ".join(f"{'float' if s == 'score' else 'int'} {s}" for s in graph.symbols)


def generate(graph: Graph) -> str:
    """The prelude and the ``__device__`` function of one traced mod."""
    nodes = graph.nodes
    lines = [PRELUDE,
             f"struct {function_name(graph)}_arrays {{ {args_struct(graph)}; }};",
             f"__device__ __forceinline__ {_CTYPES[nodes[graph.output].dtype]} {function_name(graph)}("
             f"{_symbols(graph)}, const {function_name(graph)}_arrays& mod) {{"]
    names = []
    for i, node in enumerate(nodes):
        lines.append(f"    const {_CTYPES[node.dtype]} t{i} = {_node_expr(graph, node, names)};")
        names.append(f"t{i}")
    lines.append(f"    return {names[graph.output]};")
    lines.append("}")
    return "\n".join(lines) + "\n"


_ROW, _COL, _PAIR, _FREE, _BH = "row", "col", "pair", "free", "bh"


def _node_args(node) -> tuple:
    """The node ids a node reads (a load's index nodes; none for constants and symbols)."""
    return () if node.op in ("const", "sym") else node.args[1:] if node.op == "load" else node.args


def node_classes(graph: Graph) -> list[str]:
    """Each node's class by the symbols it depends on: "free" (constants and symbols), "bh" (b and h
    at most), "row" (q_idx with b or h), "col" (kv_idx with b or h) or "pair" (the rest)."""
    deps: list[frozenset] = []
    classes = []
    for node in graph.nodes:
        if node.op == "const":
            d = frozenset()
        elif node.op == "sym":
            d = frozenset((node.args[0],))
        else:
            d = frozenset().union(*(deps[j] for j in _node_args(node)))
        deps.append(d)
        if node.op in ("const", "sym"):
            classes.append(_FREE)
        elif d <= {"b", "h"}:
            classes.append(_BH)
        elif d <= {"b", "h", "q_idx"}:
            classes.append(_ROW)
        elif d <= {"b", "h", "kv_idx"}:
            classes.append(_COL)
        else:
            classes.append(_PAIR)
    return classes


def generate_split(graph: Graph) -> str:
    """The mod as three ``__device__`` functions for a tile of rows by columns: NAME_row(b, h,
    q_idx) and NAME_col(b, h, kv_idx) compute the nodes that depend on one of the two (loads of
    ``doc[b, q_idx]``, ``slopes[h]``) once per row or column, NAME_pair the rest per element from
    their results. Follows :func:`generate`'s source (the arrays' struct)."""
    nodes, fn = graph.nodes, function_name(graph)
    classes = node_classes(graph)
    uses = {j for i, node in enumerate(nodes) if classes[i] == _PAIR for j in _node_args(node)}
    uses.add(graph.output)
    # The nodes of b and h alone are computed in both parts (where they need them) and passed on
    # by the row's.
    exported = {_ROW: [i for i in range(len(nodes)) if classes[i] in (_ROW, _BH) and i in uses],
                _COL: [i for i in range(len(nodes)) if classes[i] == _COL and i in uses]}
    lines = []
    for kind, index in ((_ROW, "q_idx"), (_COL, "kv_idx")):
        fields = " ".join(f"{_CTYPES[nodes[i].dtype]} t{i};" for i in exported[kind])
        lines.append(f"struct {fn}_{kind} {{ {fields} }};")
        lines.append(f"__device__ __forceinline__ {fn}_{kind} {fn}_{kind}_part(int b, int h, int {index}, "
                     f"const {fn}_arrays& mod) {{")
        names: list = []
        for i, node in enumerate(nodes):
            wanted = classes[i] in (kind, _BH) or (classes[i] == _FREE and (node.op == "const" or node.args[0] in
                                                                             ("b", "h", index)))
            if wanted:
                lines.append(f"    const {_CTYPES[node.dtype]} t{i} = {_node_expr(graph, node, names)};")
            names.append(f"t{i}")
        lines.append(f"    return {{{', '.join(f't{i}' for i in exported[kind])}}};")
        lines.append("}")
    lines.append(f"__device__ __forceinline__ {_CTYPES[nodes[graph.output].dtype]} {fn}_pair({_symbols(graph)}, "
                 f"const {fn}_row& row, const {fn}_col& col, const {fn}_arrays& mod) {{")
    names = []
    for i, node in enumerate(nodes):
        if classes[i] in (_FREE, _PAIR):
            lines.append(f"    const {_CTYPES[node.dtype]} t{i} = {_node_expr(graph, node, names)};")
        elif i in exported[_COL if classes[i] == _COL else _ROW]:
            lines.append(f"    const {_CTYPES[node.dtype]} t{i} = {'col' if classes[i] == _COL else 'row'}.t{i};")
        names.append(f"t{i}")
    lines.append(f"    return {names[graph.output]};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _rebuilt(graph: Graph, output: int, replace: dict) -> Graph:
    """The nodes ``output`` depends on, each id in ``replace`` read as the id it maps to."""
    nodes = graph.nodes
    live, stack = set(), [replace.get(output, output)]
    while stack:
        i = stack.pop()
        if i not in live:
            live.add(i)
            stack.extend(replace.get(j, j) for j in _node_args(nodes[i]))
    out = Graph(graph.kind, graph.symbols)
    out.arrays, out.array_names = list(graph.arrays), list(graph.array_names)
    ids: dict = {}
    for i in sorted(live):
        node = nodes[i]
        if node.op not in ("const", "sym"):
            args = tuple(ids[replace.get(j, j)] for j in _node_args(node))
            node = Node(node.op, (node.args[0], *args) if node.op == "load" else args, node.dtype)
        ids[i] = out.add(node)
    out.output = ids[replace.get(output, output)]
    return out


def _constant_factor(graph: Graph, node, operand: int):
    """c where ``node`` is operand * c, c * operand or operand / c with a constant c, as the factor
    of ``operand`` (1 / c for a division); None otherwise."""
    nodes = graph.nodes
    if node.op not in ("mul", "div") or list(node.args).count(operand) != 1:
        return None
    other = node.args[1] if node.args[0] == operand else node.args[0]
    if nodes[other].op != "const" or nodes[other].dtype == BOOL or (node.op == "div" and other == node.args[0]):
        return None
    c = float(nodes[other].args[0])
    return 1.0 / c if node.op == "div" and c != 0.0 else c if node.op == "mul" else None


def _float32_literal(value: float):
    """value as a float32 literal, or None where it is not a finite normal float32."""
    import numpy as np

    v = float(np.float32(value))
    return f"{v!r}f" if math.isfinite(v) and abs(v) >= 2.0 ** -126 else None


def fold_scales(graph: Graph) -> tuple:
    """A score_mod f(score) = out * g(score * in) with constant factors in and out (out > 0) taken
    apart: (g, in, out) as float32 literals, so that a forward kernel multiplies the raw scores by
    its scale and ``in`` at once and takes ``out`` into the softmax's scale (Gemma's softcap
    cap * tanh(score / cap) becomes tanh(score) between two factors the kernel had already);
    (graph, "1.0f", "1.0f") where it has neither factor."""
    nodes, out_scale, core = graph.nodes, "1.0f", graph
    root = nodes[graph.output]
    if root.op in ("mul", "div"):
        for operand in root.args:
            c = _constant_factor(graph, root, operand)
            literal = _float32_literal(c) if c is not None and c > 0 else None
            if literal is not None and nodes[operand].dtype == FLOAT:
                core, out_scale = _rebuilt(graph, operand, {}), literal
                break
    in_scale = "1.0f"
    score = next((i for i, n in enumerate(core.nodes) if n.op == "sym" and n.args[0] == "score"), None)
    users = [i for i, n in enumerate(core.nodes) if score is not None and score in _node_args(n)]
    if len(users) == 1:
        c = _constant_factor(core, core.nodes[users[0]], score)
        literal = _float32_literal(c) if c is not None else None
        if literal is not None:
            core, in_scale = _rebuilt(core, core.output, {users[0]: score}), literal
    return core, in_scale, out_scale


class _ArrayStub:
    """What the code of a captured array depends on: its element type and rank."""

    def __init__(self, dtype, ndim):
        self.dtype, self.ndim = dtype, ndim


_registry: dict = {}


def register(graph: Graph) -> str:
    """Keep a traced graph's structure (its arrays' dtypes and ranks, not the arrays) under its
    digest, which kernel specs name; returns the digest."""
    digest = graph.digest
    if digest not in _registry:
        stub = Graph(graph.kind, graph.symbols)
        stub.nodes, stub.output, stub.array_names = list(graph.nodes), graph.output, list(graph.array_names)
        stub.arrays = [_ArrayStub(str(a.dtype), a.ndim) for a in graph.arrays]
        _registry[digest] = stub
    return digest


def registered(digest: str, kind: str) -> Graph:
    """The graph registered under ``digest``; ValueError when none was (a spec naming a mod must
    be made after that mod was traced in this process)."""
    graph = _registry.get(digest)
    if graph is None or graph.kind != kind:
        raise ValueError(f"no {kind}_mod with digest {digest!r} was traced in this process; trace it first "
                         f"(cuflash.mods.trace_{kind}_mod) or call cuflash.attention with it")
    return graph


def graphs_of(specs) -> tuple:
    """The registered graphs the specs name (score_mod, mask_mod digests), to hand to
    :func:`adopt` in another process."""
    digests = {d for s in specs for d in (getattr(s, "score_mod", ""), getattr(s, "mask_mod", "")) if d}
    return tuple(_registry[d] for d in sorted(digests) if d in _registry)


def adopt(graphs) -> None:
    """Register graphs made by :func:`register` in another process."""
    for graph in graphs:
        _registry.setdefault(graph.digest, graph)


#: Bytes of one CuflashModArray (pointer, four int64 strides, four int32 extents).
ARRAY_BYTES = 56


def pack_arrays(graph: Graph) -> bytes:
    """The struct of a traced graph's captured arrays as the generated function reads it (at least
    one slot, as the struct declares)."""
    import struct

    out = b""
    for array in graph.arrays:
        strides = [s // array.itemsize for s in array.strides] + [0] * (4 - array.ndim)
        extents = list(array.shape) + [1] * (4 - array.ndim)
        out += struct.pack("<Q4q4i", array.data.ptr, *strides, *extents)
    return out or bytes(ARRAY_BYTES)


def block_mask_source(graph: Graph) -> tuple[str, str]:
    """(source, kernel name) of the kernel that classifies a mask_mod's tiles on the GPU: one block
    of 256 threads per (key tile, query tile, batch x head), writing EMPTY (0), PARTIAL (1) or
    FULL (2) as cuflash.sparsity defines them (positions past the lengths count as allowed for
    "full" and not for "any")."""
    name = f"cuflash_block_mask_{graph.digest}"
    fn = function_name(graph)
    source = generate(graph) + f"""
extern "C" __global__ void __launch_bounds__(256) {name}(const {fn}_arrays mod, signed char* kind, int heads,
        int seqlen_q, int seqlen_k, int block_m, int block_n) {{
    const int kt = blockIdx.x, qt = blockIdx.y, bh = blockIdx.z;
    const int b = bh / heads, h = bh % heads;
    bool any = false, all = true;
    for (int i = threadIdx.x; i < block_m * block_n; i += blockDim.x) {{
        const int q_idx = qt * block_m + i / block_n, kv_idx = kt * block_n + i % block_n;
        if (q_idx >= seqlen_q || kv_idx >= seqlen_k) continue;
        const bool allowed = {fn}(b, h, q_idx, kv_idx, mod);
        any |= allowed;
        all &= allowed;
    }}
    any = __syncthreads_or(any);
    all = __syncthreads_and(all);
    if (threadIdx.x == 0)
        kind[(static_cast<long long>(bh) * gridDim.y + qt) * gridDim.x + kt] = all && any ? 2 : any ? 1 : 0;
}}
"""
    return source, name
