"""A call's mods, ready for a kernel: the traced graphs, their digests (which name the
specialization) and the packed struct of the arrays they capture (which the kernel takes)."""
from __future__ import annotations

import functools
import types
from typing import NamedTuple

import numpy as np

from . import mod_codegen, trace
from .trace import Graph


class ModSet(NamedTuple):
    score: Graph | None
    mask: Graph | None
    score_digest: str
    mask_digest: str

    def packed(self) -> bytes:
        """The kernel's Mods struct: the score_mod's arrays, then the mask_mod's."""
        return b"".join(mod_codegen.pack_arrays(g) for g in (self.score, self.mask) if g is not None)


def kernel_argument(mods: ModSet | None, sparse: bytes = b"") -> bytes:
    """The kernel's last argument: the mods' packed arrays, then a block mask's visit lists."""
    return (mods.packed() if mods is not None else b"") + sparse


def traced(mod, kind: str) -> Graph | None:
    if mod is None:
        return None
    if isinstance(mod, Graph):
        if mod.kind != kind:
            raise ValueError(f"a traced {mod.kind}_mod was passed as {kind}_mod")
        return mod
    if not callable(mod):
        raise TypeError(f"{kind}_mod must be a Python function, got {type(mod).__name__}")
    return trace_cached(mod, kind)


def prepare(score_mod, mask_mod, device_id: int, extents: dict | None = None) -> ModSet | None:
    """Trace the mods (or take their graphs) and check that the arrays they capture are CuPy arrays
    on the call's device, read within their bounds where ``extents`` (each symbol's count of values
    in this call, None where unknown) tells; None when the call has none."""
    if score_mod is None and mask_mod is None:
        return None
    import cupy

    graphs = {"score": traced(score_mod, "score"), "mask": traced(mask_mod, "mask")}
    for kind, graph in graphs.items():
        if graph is None:
            continue
        for name, array in zip(graph.array_names, graph.arrays):
            if not isinstance(array, cupy.ndarray):
                raise TypeError(f"the {kind}_mod captures {name!r}, a {type(array).__module__}.{type(array).__name__};"
                                f" the kernels read CuPy arrays (cupy.asarray({name}))")
            if array.data.device_id != device_id:
                raise ValueError(f"the {kind}_mod captures {name!r} on device {array.data.device_id}; the "
                                 f"attention runs on device {device_id}")
            if array.size and max(array.shape) >= 2**31:
                raise ValueError(f"the {kind}_mod captures {name!r} with shape {array.shape}; dims must stay "
                                 f"below 2**31")
        if extents is not None:
            check_bounds(graph, extents)
    return ModSet(graphs["score"], graphs["mask"],
                  mod_codegen.register(graphs["score"]) if graphs["score"] is not None else "",
                  mod_codegen.register(graphs["mask"]) if graphs["mask"] is not None else "")


def extents_of(problem) -> dict:
    """Each symbol's count of values in an attention call (validate.Problem)."""
    return {"b": problem.batch, "h": problem.heads, "q_idx": problem.seqlen_q, "kv_idx": problem.seqlen_k}


def check_bounds(graph: Graph, extents: dict) -> None:
    """Refuse a load whose index, over the symbols' values in this call (``extents``: symbol ->
    count, or None where unknown), leaves its array's bounds: the kernels would read NaN there and
    the reference raises. Indices are bounded by interval arithmetic where exact (each symbol once
    per index; +, -, *, neg, abs, minimum, maximum, and // or % by a positive constant), and
    integer arithmetic that leaves 32 bits (the reference computes in 64) is refused too."""
    if any(n == 0 for n in extents.values()):
        return  # nothing is evaluated
    spans: list = []
    for node in graph.nodes:
        spans.append(_span(node, spans, extents))
        if spans[-1] is not None and not -2**31 <= spans[-1][0] <= spans[-1][1] < 2**31:
            raise ValueError(f"the {graph.kind}_mod's integer arithmetic reaches {spans[-1][0]}..{spans[-1][1]} in "
                             f"this call ({_counts(extents)}): the kernels compute integers in 32 bits")
        if node.op != "load":
            continue
        slot, *index = node.args
        array = graph.arrays[slot]
        for position, i in enumerate(index):
            if spans[i] is None:
                continue
            low, high, _ = spans[i]
            if low < 0 or high >= array.shape[position]:
                raise ValueError(f"the {graph.kind}_mod reads {graph.array_names[slot]}[...] at index {low}..{high} "
                                 f"of dim {position} in this call ({_counts(extents)}), whose size is "
                                 f"{array.shape[position]}: indices run from 0 to size - 1")


def _counts(extents: dict) -> str:
    return ", ".join(f"{name} < {n}" for name, n in extents.items() if n is not None)


def _span(node, spans, extents):
    """(low, high, symbols) of an integer node's values, or None where not bounded exactly."""
    if node.op == "const":
        value = node.args[0]
        return (value, value, frozenset()) if isinstance(value, int) and not isinstance(value, bool) else None
    if node.op == "sym":
        n = extents.get(node.args[0])
        return None if n is None else (0, n - 1, frozenset((node.args[0],)))
    args = [spans[i] for i in node.args]
    if node.op not in _SPAN_OPS or any(a is None for a in args):
        return None
    if len(args) == 2 and args[0][2] & args[1][2]:
        return None  # a symbol on both sides: intervals would over-reach
    symbols = frozenset().union(*(a[2] for a in args))
    bounds = _SPAN_OPS[node.op](*((a[0], a[1]) for a in args))
    return None if bounds is None else (*bounds, symbols)


def _corners(f):
    """A binary op monotone in each argument: its extremes lie at the corners."""
    def span(a, b):
        values = [f(x, y) for x in a for y in b]
        return min(values), max(values)
    return span


def _floordiv_span(a, b):
    return None if b[0] != b[1] or b[0] <= 0 else (a[0] // b[0], a[1] // b[0])


def _mod_span(a, b):
    """x % n over [low, high] by a positive constant n: the residues' least and greatest."""
    if b[0] != b[1] or b[0] <= 0:
        return None
    n = b[0]
    if a[1] - a[0] + 1 >= n or a[0] % n > a[1] % n:  # every residue, or a wrap past n - 1 to 0
        return 0, n - 1
    return a[0] % n, a[1] % n


_SPAN_OPS = {
    "add": _corners(lambda x, y: x + y), "sub": _corners(lambda x, y: x - y), "mul": _corners(lambda x, y: x * y),
    "minimum": _corners(min), "maximum": _corners(max), "neg": lambda a: (-a[1], -a[0]),
    "abs": lambda a: (0 if a[0] <= 0 <= a[1] else min(abs(a[0]), abs(a[1])), max(abs(a[0]), abs(a[1]))),
    "floordiv": _floordiv_span, "mod": _mod_span,
}


#: Graphs of functions traced before, by trace_key; a graph holds the arrays its function captures,
#: so the cache keeps at most this many.
TRACE_CACHE_SIZE = 32
_traced: dict = {}

# Modules whose attributes a mod may read without stopping its trace from being reused.
_STABLE_MODULES = ("cuflash", "math", "numpy")


def trace_key(fn, _depth: int = 0):
    """A key under which ``fn`` always traces to the same graph, or None when that cannot be told:
    its code and, by value, everything the trace reads besides the symbols (the numbers, strings
    and functions in its closure, defaults and the globals its code names; arrays by identity,
    shape, dtype and strides, since the graph holds the arrays themselves). A closure or global
    of any other kind (a list, an object) gives None: such a mod is traced on every call."""
    if not isinstance(fn, types.FunctionType) or _depth > 8:
        return None
    parts = [fn.__code__]
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            parts.append(("empty",))
            continue
        part = ("self",) if value is fn else _value_key(value, _depth)
        if part is None:
            return None
        parts.append(part)
    for value in (fn.__defaults__ or ()) + tuple((fn.__kwdefaults__ or {}).items()):
        part = _value_key(value, _depth)
        if part is None:
            return None
        parts.append(part)
    scope = fn.__globals__
    for name in _code_names(fn.__code__):
        if name in scope:
            value = scope[name]
            part = ("self",) if value is fn else _value_key(value, _depth)
            if part is None:
                return None
            parts.append((name, part))
    return tuple(parts)


@functools.lru_cache(maxsize=1024)
def _code_names(code) -> tuple:
    """The names a code object (and the code objects nested in it) reads as globals or
    attributes, sorted."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= set(_code_names(const))
    return tuple(sorted(names))


def _value_key(value, depth: int):
    """trace_key's part for one value a mod reads, or None where it cannot tell."""
    if value is None or isinstance(value, (bool, int, str)):
        return (type(value), value)
    if isinstance(value, (float, complex, np.generic)):
        return (type(value), repr(value))  # repr: -0.0 and 0.0 differ
    if trace.is_array(value):
        return trace.array_key(value)
    if isinstance(value, types.FunctionType):
        if value.__closure__ is None and value.__module__.split(".")[0] in _STABLE_MODULES:
            return ("function", id(value))  # a module-level function of cuflash, math or numpy
        inner = trace_key(value, depth + 1)
        return None if inner is None else ("function", inner)
    if isinstance(value, types.BuiltinFunctionType):
        return ("builtin", id(value))
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__) if value.__name__.split(".")[0] in _STABLE_MODULES else None
    if isinstance(value, tuple):
        parts = tuple(_value_key(v, depth) for v in value)
        return None if any(p is None for p in parts) else ("tuple", parts)
    return None


def traced_kept(mod, kind: str):
    """(graph or None, kept): the mod's graph, and whether the same graph object comes back for
    the same function and captured values (a graph passed in, or one kept under its trace_key),
    so that a launch plan may key on it."""
    if mod is None or isinstance(mod, Graph) or not callable(mod):
        return traced(mod, kind), True
    return _trace_kept(mod, kind)


def trace_cached(fn, kind: str) -> Graph:
    """The graph of a mod: traced once per trace_key (the same function with the same captured
    values), anew where it has none."""
    return _trace_kept(fn, kind)[0]


def _trace_kept(fn, kind: str):
    key = trace_key(fn)
    if key is not None:
        found = _traced.get((kind, key))
        if found is not None:
            return found, True
    graph = trace.trace(fn, kind)
    if key is None:
        return graph, False
    if len(_traced) >= TRACE_CACHE_SIZE:
        _traced.pop(next(iter(_traced)))
    _traced[(kind, key)] = graph
    return graph, True
