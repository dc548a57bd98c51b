"""Tracing attention mods: a Python function of symbolic values -> a canonical expression graph.

A ``score_mod(score, b, h, q_idx, kv_idx)`` or ``mask_mod(b, h, q_idx, kv_idx)`` is called once
with :class:`Expr` stand-ins for its arguments. Operators on them build nodes; arrays the function
captures (closure cells and globals it names) are swapped for :class:`CapturedArray` stand-ins
whose indexing builds nodes too. Nodes are hash-consed and commutative operands ordered, so the
same expression always gives the same graph and the same :attr:`Graph.digest`, which names the
specialization. Python numbers are folded into the graph as constants (a different number is a
different kernel); captured arrays become kernel arguments: their dtype and rank are part of the
graph, their contents and shapes are not.

What cannot be traced (``if``/``and``/``or``/``not``/``bool()`` on a traced value, loops over one,
``math`` or NumPy functions, indexing an array the tracer did not capture) raises TypeError naming
the construct and the line of the user's function.
"""
from __future__ import annotations

import hashlib
import operator
import sys
import types
from dataclasses import dataclass

import numpy as np

from .mod_ops import evaluate_op

#: Result types of nodes.
FLOAT, INT, BOOL = "float", "int", "bool"

#: Operators whose operands commute (ordered by node id in the canonical graph).
_COMMUTATIVE = {"add", "mul", "eq", "ne", "and", "or", "xor", "minimum", "maximum"}
_UNARY = {"neg", "abs", "exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "floor", "not"}
_COMPARE = {"lt", "le", "gt", "ge", "eq", "ne"}


@dataclass(frozen=True)
class Node:
    """One node of a graph: ``op`` with ``args`` (node ids, or a constant's value, a symbol's name,
    a captured array's slot) and its result type."""

    op: str
    args: tuple
    dtype: str


class Graph:
    """The nodes of one traced function, in creation order (each node's arguments before it)."""

    def __init__(self, kind: str, symbols: tuple[str, ...]):
        self.kind = kind                      # "score" or "mask"
        self.symbols = symbols
        self.nodes: list[Node] = []
        self._ids: dict[Node, int] = {}
        self.arrays: list = []                # captured arrays, by slot
        self.array_names: list[str] = []
        self.output: int | None = None

    def add(self, node: Node) -> int:
        found = self._ids.get(node)
        if found is None:
            found = self._ids[node] = len(self.nodes)
            self.nodes.append(node)
        return found

    @property
    def array_signature(self) -> tuple:
        """(dtype name, rank) of each captured array: part of the specialization."""
        return tuple((str(a.dtype), a.ndim) for a in self.arrays)

    @property
    def digest(self) -> str:
        """A short hash of the canonical graph and its arrays' signature (kept once computed for
        the graph as it stands)."""
        state = (len(self.nodes), self.output, len(self.arrays))
        cached = getattr(self, "_digest", None)
        if cached is not None and cached[0] == state:
            return cached[1]
        text = repr((self.kind, self.symbols, [(n.op, n.args, n.dtype) for n in self.nodes], self.output,
                     self.array_signature))
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        self._digest = (state, digest)
        return digest


#: NumPy's ufuncs of Python's binary operators: a NumPy number beside a traced value takes the operator.
_OPERATOR_UFUNCS = {"add": operator.add, "subtract": operator.sub, "multiply": operator.mul, "power": operator.pow,
                    "true_divide": operator.truediv, "divide": operator.truediv, "floor_divide": operator.floordiv,
                    "remainder": operator.mod, "less": operator.lt, "less_equal": operator.le, "greater": operator.gt,
                    "greater_equal": operator.ge, "equal": operator.eq, "not_equal": operator.ne,
                    "bitwise_and": operator.and_, "bitwise_or": operator.or_, "bitwise_xor": operator.xor}


class Expr:
    """A traced value: one node of the graph being built."""

    __slots__ = ("graph", "id")
    __array_priority__ = 1000  # NumPy defers binary operators to Expr

    def __init__(self, graph: Graph, node_id: int):
        self.graph, self.id = graph, node_id

    @property
    def dtype(self) -> str:
        return self.graph.nodes[self.id].dtype

    # -- arithmetic ---------------------------------------------------------------------------
    def __add__(self, other):
        return binary("add", self, other)

    def __radd__(self, other):
        return binary("add", other, self)

    def __sub__(self, other):
        return binary("sub", self, other)

    def __rsub__(self, other):
        return binary("sub", other, self)

    def __mul__(self, other):
        return binary("mul", self, other)

    def __rmul__(self, other):
        return binary("mul", other, self)

    def __truediv__(self, other):
        return binary("div", self, other)

    def __rtruediv__(self, other):
        return binary("div", other, self)

    def __floordiv__(self, other):
        return binary("floordiv", self, other)

    def __rfloordiv__(self, other):
        return binary("floordiv", other, self)

    def __mod__(self, other):
        return binary("mod", self, other)

    def __rmod__(self, other):
        return binary("mod", other, self)

    def __pow__(self, other):
        return binary("pow", self, other)

    def __rpow__(self, other):
        return binary("pow", other, self)

    def __neg__(self):
        return unary("neg", self)

    def __pos__(self):
        return self

    def __abs__(self):
        return unary("abs", self)

    # -- comparisons and booleans -------------------------------------------------------------
    def __lt__(self, other):
        return binary("lt", self, other)

    def __le__(self, other):
        return binary("le", self, other)

    def __gt__(self, other):
        return binary("gt", self, other)

    def __ge__(self, other):
        return binary("ge", self, other)

    def __eq__(self, other):  # noqa: D105 - builds a node, as NumPy's == builds an array
        return binary("eq", self, other)

    def __ne__(self, other):
        return binary("ne", self, other)

    def __and__(self, other):
        return binary("and", self, other)

    def __rand__(self, other):
        return binary("and", other, self)

    def __or__(self, other):
        return binary("or", self, other)

    def __ror__(self, other):
        return binary("or", other, self)

    def __xor__(self, other):
        return binary("xor", self, other)

    def __rxor__(self, other):
        return binary("xor", other, self)

    def __invert__(self):
        if self.dtype != BOOL:
            raise TypeError(_where_in_user_code("~ applies to booleans (a comparison, a mask) only"))
        return unary("not", self)

    __hash__ = None  # unhashable, as == builds a node

    # -- what cannot be traced ----------------------------------------------------------------
    def __bool__(self):
        raise TypeError(_where_in_user_code(
            "Python's if, and, or, not and bool() need a value the tracer does not have; use "
            "cuflash.mods.where(condition, a, b), & for and, | for or, ~ for not"))

    def __iter__(self):
        raise TypeError(_where_in_user_code("a traced value cannot be looped over"))

    def __index__(self):
        raise TypeError(_where_in_user_code(
            "a traced value cannot be a Python index or length (range(), a list, or an array the tracer did "
            "not capture: a mod names the CuPy arrays it reads directly, from its closure or a global)"))

    def __float__(self):
        raise TypeError(_where_in_user_code(
            "a function outside cuflash.mods (math.*, float()) got a traced value; use cuflash.mods' "
            "exp, exp2, log, tanh, sigmoid, sqrt, abs, floor, minimum, maximum, where"))

    __int__ = __complex__ = __float__

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        # a NumPy number on an operator's left (np.float32(0.5) * score) reaches here as a ufunc
        op = _OPERATOR_UFUNCS.get(ufunc.__name__)
        numbers = [x for x in inputs if not isinstance(x, Expr)]
        if op is not None and method == "__call__" and not kwargs and len(inputs) == 2 \
                and all(isinstance(x, (np.generic, np.ndarray)) and x.ndim == 0 for x in numbers):
            return op(*(x if isinstance(x, Expr) else x.item() for x in inputs))
        raise TypeError(_where_in_user_code(f"numpy.{ufunc.__name__} got a traced value; use cuflash.mods' "
                                            f"functions of the same name"))

    def __array_function__(self, func, types_, args, kwargs):
        raise TypeError(_where_in_user_code(f"numpy.{func.__name__} got a traced value; use cuflash.mods' "
                                            f"functions"))

    def __repr__(self):
        return f"<traced {self.dtype} #{self.id}>"


# -- building nodes -------------------------------------------------------------------------------

_current: list[Graph] = []
_user_code: list = []


def _graph_of(*values) -> Graph:
    for value in values:
        if isinstance(value, Expr):
            return value.graph
    return _current[-1]


def _constant(graph: Graph, value) -> Expr:
    if isinstance(value, (bool, np.bool_)):
        return Expr(graph, graph.add(Node("const", (bool(value),), BOOL)))
    if isinstance(value, (int, np.integer)):
        if not -2**31 <= int(value) < 2**31:
            raise ValueError(_where_in_user_code(f"the integer {value} does not fit 32 bits"))
        return Expr(graph, graph.add(Node("const", (int(value),), INT)))
    if isinstance(value, (float, np.floating)):
        return Expr(graph, graph.add(Node("const", (float(value),), FLOAT)))
    raise TypeError(_where_in_user_code(
        f"{type(value).__module__}.{type(value).__name__} is not a number, a traced value or a captured array; "
        f"a mod takes Python numbers, its arguments, cuflash.mods functions and CuPy arrays it captures"))


def as_expr(value, graph: Graph | None = None) -> Expr:
    """A traced value for an Expr, a Python number or a NumPy scalar."""
    if isinstance(value, Expr):
        return value
    return _constant(graph or _graph_of(value), value)


def _promote(a: str, b: str) -> str:
    if FLOAT in (a, b):
        return FLOAT
    return INT


def _fold(op: str, values: tuple):
    """The constant result of an operator on constants (Python semantics, 32-bit where CUDA's are)."""
    return evaluate_op(op, tuple(np.asarray(v) for v in values)).item()


def binary(op: str, a, b) -> Expr:
    graph = _graph_of(a, b)
    a, b = as_expr(a, graph), as_expr(b, graph)
    ta, tb = a.dtype, b.dtype
    if op in ("and", "or", "xor"):
        if ta != BOOL or tb != BOOL:
            raise TypeError(_where_in_user_code(f"&, | and ^ apply to booleans only (got {ta} and {tb}); "
                                                f"compare first, e.g. (q_idx >= kv_idx) & (doc_q == doc_k)"))
        dtype = BOOL
    elif op in _COMPARE:
        if BOOL in (ta, tb) and op not in ("eq", "ne"):
            raise TypeError(_where_in_user_code(f"booleans cannot be ordered ({op})"))
        dtype = BOOL
    else:
        if BOOL in (ta, tb):
            raise TypeError(_where_in_user_code("arithmetic on a boolean: use cuflash.mods.where(mask, a, b)"))
        dtype = FLOAT if op in ("div", "pow") and (op == "div" or FLOAT in (ta, tb)) else _promote(ta, tb)
        if op == "pow" and dtype == INT:
            dtype = FLOAT
        divisor = graph.nodes[b.id]
        if op in ("floordiv", "mod") and dtype == INT and divisor.op == "const" and divisor.args[0] == 0:
            raise ValueError(_where_in_user_code(f"integer {'//' if op == 'floordiv' else '%'} by zero in a mod"))
    nodes = graph.nodes
    if nodes[a.id].op == "const" and nodes[b.id].op == "const":
        return _constant(graph, _fold(op, (nodes[a.id].args[0], nodes[b.id].args[0])))
    ids = (a.id, b.id)
    if op in _COMMUTATIVE:
        ids = tuple(sorted(ids))
    return Expr(graph, graph.add(Node(op, ids, dtype)))


def unary(op: str, x) -> Expr:
    x = as_expr(x)
    graph = x.graph if isinstance(x, Expr) else _current[-1]
    if op == "not":
        dtype = BOOL
    elif x.dtype == BOOL:
        raise TypeError(_where_in_user_code(f"{op} of a boolean: use cuflash.mods.where(mask, a, b)"))
    elif op in ("neg", "abs"):
        dtype = x.dtype
    elif op == "floor":
        dtype = x.dtype
    else:
        dtype = FLOAT
    node = graph.nodes[x.id]
    if node.op == "const":
        return _constant(graph, _fold(op, (node.args[0],)))
    return Expr(graph, graph.add(Node(op, (x.id,), dtype)))


def where(condition, a, b) -> Expr:
    graph = _graph_of(condition, a, b)
    condition, a, b = (as_expr(x, graph) for x in (condition, a, b))
    if condition.dtype != BOOL:
        raise TypeError(_where_in_user_code("where's first argument must be a boolean (a comparison, a mask)"))
    if (a.dtype == BOOL) != (b.dtype == BOOL):
        raise TypeError(_where_in_user_code("where's branches must both be booleans or both numbers"))
    dtype = BOOL if a.dtype == BOOL else _promote(a.dtype, b.dtype)
    if graph.nodes[condition.id].op == "const":
        chosen = a if graph.nodes[condition.id].args[0] else b
        return chosen if chosen.dtype == dtype else binary("add", chosen, 0.0)
    return Expr(graph, graph.add(Node("where", (condition.id, a.id, b.id), dtype)))


def minimum(a, b) -> Expr:
    return binary("minimum", a, b)


def maximum(a, b) -> Expr:
    return binary("maximum", a, b)


# -- captured arrays -----------------------------------------------------------------------------

#: Element types a captured array may have, and the type its values take in the graph.
_ARRAY_DTYPES = {"float16": FLOAT, "bfloat16": FLOAT, "float32": FLOAT, "float64": FLOAT,
                 "int8": INT, "int16": INT, "int32": INT, "uint8": INT, "uint16": INT, "bool": BOOL}


class CapturedArray:
    """Stands in for an array a mod captures: indexing it with traced values builds a node."""

    def __init__(self, graph: Graph, array, name: str):
        dtype = str(array.dtype)
        if dtype not in _ARRAY_DTYPES:
            raise TypeError(f"the captured array {name!r} has dtype {dtype}; a mod reads arrays of "
                            f"{sorted(_ARRAY_DTYPES)} (int64 indices: convert to int32)")
        if array.ndim < 1 or array.ndim > 4:
            raise ValueError(f"the captured array {name!r} has {array.ndim} dims; a mod reads arrays of 1 to 4 dims")
        self.graph, self.array, self.name = graph, array, name
        self.slot = len(graph.arrays)
        graph.arrays.append(array)
        graph.array_names.append(name)

    @property
    def shape(self):
        return self.array.shape

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != self.array.ndim:
            raise IndexError(_where_in_user_code(f"{self.name} has {self.array.ndim} dims and is indexed with "
                                                 f"{len(index)}; index every dim with one value"))
        ids = []
        for position, i in enumerate(index):
            if isinstance(i, (slice, type(Ellipsis))) or i is None:
                raise IndexError(_where_in_user_code(f"{self.name} is indexed with a slice; a mod reads one element"))
            e = as_expr(i, self.graph)
            if e.dtype != INT:
                raise TypeError(_where_in_user_code(f"{self.name}'s index {position} is a {e.dtype}; indices are "
                                                    f"integers (b, h, q_idx, kv_idx and integer arithmetic)"))
            node = self.graph.nodes[e.id]
            if node.op == "const" and not 0 <= node.args[0] < self.array.shape[position]:
                raise IndexError(_where_in_user_code(f"{self.name}[...] index {node.args[0]} is out of bounds for "
                                                     f"dim {position} of size {self.array.shape[position]}"))
            ids.append(e.id)
        dtype = _ARRAY_DTYPES[str(self.array.dtype)]
        return Expr(self.graph, self.graph.add(Node("load", (self.slot, *ids), dtype)))

    def __bool__(self):
        raise TypeError(_where_in_user_code(f"the captured array {self.name} cannot be a truth value"))

    def __iter__(self):
        raise TypeError(_where_in_user_code(f"the captured array {self.name} cannot be looped over in a mod"))


#: Arrays of other libraries a mod may capture, by top-level module (cuflash.torch and cuflash.jax
#: register theirs): (the CuPy or NumPy array over its memory, what tells it apart; None: not kept).
ARRAY_CONVERTERS: dict = {}


def is_array(value) -> bool:
    module = type(value).__module__.split(".")[0]
    return (module in ("cupy", "numpy") or module in ARRAY_CONVERTERS) and hasattr(value, "ndim") \
        and hasattr(value, "dtype") and value.ndim > 0


def array_key(value) -> tuple:
    """A captured array to a kept trace: identity, shape, dtype, strides (another library's: its key)."""
    entry = ARRAY_CONVERTERS.get(type(value).__module__.split(".")[0])
    if entry is None:
        return ("array", id(value), value.shape, value.dtype.str, value.strides)
    key = entry[1](value)
    return None if key is None else ("array", id(value), key)


def _as_array(value):
    entry = ARRAY_CONVERTERS.get(type(value).__module__.split(".")[0])
    return value if entry is None else entry[0](value)


def _with_captured(fn, graph: Graph, _depth: int = 0):
    """fn with the arrays it captures (closure cells, globals it names) swapped for stand-ins; the
    functions it captures (a mod combining mods: and_masks, or_masks) get the same treatment."""
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"a mod must be a Python function (def or lambda), got {type(fn).__name__}")
    code = fn.__code__
    closure = fn.__closure__
    if closure:
        cells = []
        for name, cell in zip(code.co_freevars, closure):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                cells.append(cell)
                continue
            if is_array(value):
                cells.append(types.CellType(CapturedArray(graph, _as_array(value), name)))
            elif _depth < 8 and isinstance(value, types.FunctionType) and value is not fn:
                cells.append(types.CellType(_with_captured(value, graph, _depth + 1)))
            elif _depth < 8 and isinstance(value, tuple) and value and all(
                    isinstance(f, types.FunctionType) for f in value):
                cells.append(types.CellType(tuple(_with_captured(f, graph, _depth + 1) for f in value)))
            else:
                cells.append(cell)
        closure = tuple(cells)
    names = set(code.co_names)
    replaced = {name: CapturedArray(graph, _as_array(value), name) for name, value in fn.__globals__.items()
                if name in names and is_array(value)}
    scope = dict(fn.__globals__, **replaced) if replaced else fn.__globals__
    return types.FunctionType(code, scope, fn.__name__, fn.__defaults__, closure)


# -- tracing -------------------------------------------------------------------------------------

SCORE_SYMBOLS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_SYMBOLS = ("b", "h", "q_idx", "kv_idx")


def _where_in_user_code(message: str) -> str:
    """message, with the file, line and source of the user's mod that is being traced."""
    if not _user_code:
        return message
    code = _user_code[-1]
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    line = frame.f_lineno if frame is not None else code.co_firstlineno
    try:
        import linecache
        source = linecache.getline(code.co_filename, line).strip()
    except Exception:
        source = ""
    where = f"{code.co_name} at {code.co_filename}:{line}" + (f": {source}" if source else "")
    return f"{message} (in {where})"


def _at_traceback_line(message: str, tb, code) -> str:
    """message, with the line of ``code`` (the user's mod) that a traceback passed through."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code is code:
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None:
        return message
    import linecache
    return f"{message} (in {code.co_name} at {code.co_filename}:{line}: {linecache.getline(code.co_filename, line).strip()})"


def trace(fn, kind: str) -> Graph:
    """The graph of a score_mod (``kind="score"``) or mask_mod (``kind="mask"``), traced anew
    (modset.traced reuses graphs)."""
    symbols = SCORE_SYMBOLS if kind == "score" else MASK_SYMBOLS
    graph = Graph(kind, symbols)
    traced = _with_captured(fn, graph)
    inputs = [Expr(graph, graph.add(Node("sym", (name,), FLOAT if name == "score" else INT))) for name in symbols]
    _current.append(graph)
    _user_code.append(fn.__code__)
    try:
        try:
            result = traced(*inputs)
        except TypeError as exc:
            if "positional argument" in str(exc) and " in " not in str(exc):
                raise TypeError(f"a {kind}_mod takes ({', '.join(symbols)}): {exc}") from None
            raise
        except IndexError as exc:
            if "(in " in str(exc):  # the tracer's own
                raise
            raise TypeError(_at_traceback_line(
                f"an array the tracer did not capture was indexed with a traced value ({exc}); a mod names the "
                f"CuPy arrays it reads directly, from its closure or a global", exc.__traceback__, fn.__code__)) \
                from None
        out = as_expr(result, graph)
    finally:
        _current.pop()
        _user_code.pop()
    if kind == "mask" and out.dtype != BOOL:
        raise TypeError(f"a mask_mod returns a boolean (a comparison, & | ~ of comparisons); "
                        f"{fn.__name__} returned a {out.dtype}")
    if kind == "score" and out.dtype == BOOL:
        raise TypeError(f"a score_mod returns a number; {fn.__name__} returned a boolean (a mask_mod?)")
    graph.output = out.id
    return canonical(graph)


def canonical(graph: Graph) -> Graph:
    """The graph rebuilt in a canonical order: the symbols first, then the nodes the output
    needs, depth first, the operands of commutative operators ordered by their structure (so
    ``a + b`` and ``b + a`` give the same nodes); nodes the output does not need are dropped."""
    keys: list[str] = []
    for node in graph.nodes:
        if node.op in ("const", "sym"):
            text = repr((node.op, node.dtype, node.args))
        elif node.op == "load":
            text = repr(("load", node.dtype, node.args[0], tuple(keys[i] for i in node.args[1:])))
        else:
            children = [keys[i] for i in node.args]
            if node.op in _COMMUTATIVE:
                children.sort()
            text = repr((node.op, node.dtype, tuple(children)))
        keys.append(hashlib.sha1(text.encode()).hexdigest())
    out = Graph(graph.kind, graph.symbols)
    out.arrays, out.array_names = graph.arrays, graph.array_names
    new_id: dict[int, int] = {}
    for name in graph.symbols:
        for i, node in enumerate(graph.nodes):
            if node.op == "sym" and node.args[0] == name:
                new_id[i] = out.add(node)

    def visit(i: int) -> int:
        if i in new_id:
            return new_id[i]
        node = graph.nodes[i]
        if node.op == "const":
            new_id[i] = out.add(node)
            return new_id[i]
        if node.op == "load":
            args = (node.args[0], *(visit(j) for j in node.args[1:]))
        else:
            order = sorted(node.args, key=lambda j: keys[j]) if node.op in _COMMUTATIVE else node.args
            args = tuple(visit(j) for j in order)
        new_id[i] = out.add(Node(node.op, args, node.dtype))
        return new_id[i]

    out.output = visit(graph.output)
    return out


# -- evaluating (the reference) ------------------------------------------------------------------------

def evaluate(graph: Graph, inputs: dict, arrays=None, float_dtype=np.float64):
    """The graph's output on NumPy values (broadcast together): ``inputs`` maps each symbol to an
    array or number; ``arrays`` (default: the captured ones, copied to the host) by slot. Floats
    compute in ``float_dtype``; integers in int64; an index out of its array's bounds raises."""
    if arrays is None:
        arrays = [np.asarray(a.get() if hasattr(a, "get") else a) for a in graph.arrays]
    values: list = []
    for node in graph.nodes:
        if node.op == "const":
            value = node.args[0]
            value = np.asarray(value, dtype=float_dtype if node.dtype == FLOAT else None)
        elif node.op == "sym":
            value = np.asarray(inputs[node.args[0]])
            value = value.astype(float_dtype if node.dtype == FLOAT else np.int64)
        elif node.op == "load":
            array = arrays[node.args[0]]
            index = tuple(np.asarray(values[i], dtype=np.int64) for i in node.args[1:])
            for position, (i, n) in enumerate(zip(index, array.shape)):
                if i.size and (i.min() < 0 or i.max() >= n):  # no wrap-around: the kernels read NaN there
                    name = graph.array_names[node.args[0]]
                    raise IndexError(f"the mod reads {name}[...] at index {int(i.min())}..{int(i.max())} of dim "
                                     f"{position}, whose size is {n}")
            value = array[index]
            value = value.astype(float_dtype if node.dtype == FLOAT else bool if node.dtype == BOOL else np.int64)
        elif node.op == "where":
            c, a, b = (values[i] for i in node.args)
            value = np.where(c, a, b)
        else:
            value = evaluate_op(node.op, tuple(values[i] for i in node.args))
            if node.dtype == FLOAT:
                value = np.asarray(value).astype(float_dtype, copy=False)
        values.append(value)
    return values[graph.output]
