"""The derivative of a traced score_mod with respect to its score: the graph the backward's score
stage multiplies dS by (dS_raw = dS * d(score_mod)/d(score))."""
from __future__ import annotations

import math

from .trace import FLOAT, Expr, Graph, Node, _current, as_expr, canonical, unary, where


def derivative(graph: Graph) -> Graph:
    """The graph of d(score_mod)/d(score), with the same symbols and captured arrays."""
    if graph.kind != "score":
        raise ValueError("only a score_mod has a derivative")
    out = Graph("dscore", graph.symbols)
    out.arrays, out.array_names = graph.arrays, graph.array_names
    copied: list[int] = []
    _current.append(out)
    try:
        for node in graph.nodes:  # the primal values, in the derivative's graph
            if node.op in ("const", "sym"):
                copied.append(out.add(node))
            elif node.op == "load":
                copied.append(out.add(Node("load", (node.args[0], *(copied[i] for i in node.args[1:])), node.dtype)))
            else:
                copied.append(out.add(Node(node.op, tuple(copied[i] for i in node.args), node.dtype)))
        x = {i: Expr(out, c) for i, c in enumerate(copied)}
        zero = as_expr(0.0, out)
        grads: list = []
        for i, node in enumerate(graph.nodes):
            g = lambda j: grads[j]  # noqa: E731
            if node.op == "sym":
                d = as_expr(1.0 if node.args[0] == "score" else 0.0, out)
            elif node.op in ("const", "load") or node.dtype != FLOAT and node.op not in ("where",):
                d = zero
            else:
                a = node.args
                op = node.op
                if op == "add":
                    d = g(a[0]) + g(a[1])
                elif op == "sub":
                    d = g(a[0]) - g(a[1])
                elif op == "mul":
                    d = g(a[0]) * x[a[1]] + x[a[0]] * g(a[1])
                elif op == "div":
                    d = (g(a[0]) * x[a[1]] - x[a[0]] * g(a[1])) / (x[a[1]] * x[a[1]])
                elif op == "pow":
                    base, exponent = x[a[0]], x[a[1]]
                    d = g(a[0]) * exponent * base ** (exponent - 1.0)
                    if graph.nodes[a[1]].op != "const":
                        d = d + g(a[1]) * Expr(out, copied[i]) * unary("log", base)
                elif op == "neg":
                    d = -g(a[0])
                elif op == "abs":
                    d = where(x[a[0]] < 0, -g(a[0]), g(a[0]))
                elif op == "exp":
                    d = g(a[0]) * Expr(out, copied[i])
                elif op == "exp2":
                    d = g(a[0]) * Expr(out, copied[i]) * math.log(2.0)
                elif op == "log":
                    d = g(a[0]) / x[a[0]]
                elif op == "log2":
                    d = g(a[0]) / (x[a[0]] * math.log(2.0))
                elif op == "tanh":
                    t = Expr(out, copied[i])
                    d = g(a[0]) * (1.0 - t * t)
                elif op == "sigmoid":
                    s = Expr(out, copied[i])
                    d = g(a[0]) * s * (1.0 - s)
                elif op == "sqrt":
                    d = g(a[0]) * 0.5 / Expr(out, copied[i])
                elif op in ("floor", "floordiv", "mod"):
                    d = zero if op != "mod" else g(a[0])
                elif op in ("minimum", "maximum"):
                    pick = (x[a[0]] <= x[a[1]]) if op == "minimum" else (x[a[0]] >= x[a[1]])
                    d = where(pick, g(a[0]), g(a[1]))
                elif op == "where":
                    d = where(x[a[0]], g(a[1]), g(a[2])) if node.dtype == FLOAT else zero
                else:
                    d = zero
            grads.append(as_expr(d, out) if not isinstance(d, Expr) else d)
        out.output = grads[graph.output].id
    finally:
        _current.pop()
    return canonical(_simplified(out))


def is_constant_one(graph: Graph) -> bool:
    """Whether a derivative graph is the constant 1 (the score_mod adds to the score only)."""
    node = graph.nodes[graph.output]
    return node.op == "const" and node.args[0] == 1.0


_adds_only: dict[str, bool] = {}


def adds_only(graph: Graph) -> bool:
    """Whether a score_mod's derivative is the constant 1, derived once per digest."""
    found = _adds_only.get(graph.digest)
    if found is None:
        found = _adds_only[graph.digest] = is_constant_one(derivative(graph))
    return found


def _simplified(graph: Graph) -> Graph:
    """The graph with the chain rule's zeros and ones taken out (x * 0, x * 1, x + 0, x - 0, 0 / x,
    x / 1, -0, where(c, a, a)), so that a score_mod that only adds to the score has the constant 1
    as its derivative."""
    out = Graph(graph.kind, graph.symbols)
    out.arrays, out.array_names = graph.arrays, graph.array_names
    zero = None
    ids: list[int] = []

    def constant(i):
        node = out.nodes[i]
        return node.args[0] if node.op == "const" and node.dtype == FLOAT else None

    for node in graph.nodes:
        if node.op in ("const", "sym"):
            ids.append(out.add(node))
            continue
        if node.op == "load":
            ids.append(out.add(Node("load", (node.args[0], *(ids[j] for j in node.args[1:])), node.dtype)))
            continue
        args = tuple(ids[j] for j in node.args)
        c = [constant(i) for i in args]
        keep = None  # the argument that is the result, or "zero"
        if node.dtype == FLOAT:
            if node.op == "mul":
                keep = "zero" if 0.0 in c else args[1] if c[0] == 1.0 else args[0] if c[1] == 1.0 else None
            elif node.op == "add":
                keep = args[1] if c[0] == 0.0 else args[0] if c[1] == 0.0 else None
            elif node.op == "sub":
                keep = args[0] if c[1] == 0.0 else None
            elif node.op == "div":
                keep = "zero" if c[0] == 0.0 else args[0] if c[1] == 1.0 else None
            elif node.op == "neg":
                keep = "zero" if c[0] == 0.0 else None
            elif node.op == "where" and args[1] == args[2]:
                keep = args[1]
        if keep == "zero":
            if zero is None:
                zero = out.add(Node("const", (0.0,), FLOAT))
            ids.append(zero)
        elif keep is not None and out.nodes[keep].dtype == node.dtype:
            ids.append(keep)
        else:
            ids.append(out.add(Node(node.op, args, node.dtype)))
    out.output = ids[graph.output]
    return out
