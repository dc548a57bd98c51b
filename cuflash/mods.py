"""Attention variants written in Python: score_mod and mask_mod functions, traced to graphs.

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)          # slopes: a CuPy array captured from the scope

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 1024)

    graph = cuflash.mods.trace_score_mod(alibi)              # canonical graph; graph.digest names it

A mod uses arithmetic and comparison operators, the functions of this module (``where``, ``exp``,
``exp2``, ``log``, ``tanh``, ``sigmoid``, ``abs``, ``minimum``, ``maximum``, ``sqrt``, ``floor``),
``&``, ``|`` and ``~`` on booleans, Python numbers (folded into the graph: a different number is a
different specialization) and arrays it captures (their contents are read when the mod runs; their
dtype and rank are part of the specialization). ``cuflash.reference`` evaluates a mod's graph in
float64 (``score_mod=`` / ``mask_mod=``), so any mod is testable against the reference. Anything
the tracer cannot translate raises TypeError naming the construct and the line of the mod.
"""
from __future__ import annotations

import functools

import numpy as np

from .core import mod_codegen
from .core import mod_grad
from .core import modset as _modset
from .core import trace as _trace
from .core.trace import Graph


def where(condition, a, b):
    """``a`` where ``condition`` holds, else ``b`` (elementwise, like numpy.where)."""
    return _trace.where(condition, a, b)


def minimum(a, b):
    return _trace.minimum(a, b)


def maximum(a, b):
    return _trace.maximum(a, b)


def _unary(op: str):
    def function(x):
        return _trace.unary(op, x)
    function.__name__ = op
    function.__doc__ = f"{op} of a traced value (or a number, folded)."
    return function


exp = _unary("exp")
exp2 = _unary("exp2")
log = _unary("log")
log2 = _unary("log2")
tanh = _unary("tanh")
sigmoid = _unary("sigmoid")
sqrt = _unary("sqrt")
floor = _unary("floor")
abs = _unary("abs")  # noqa: A001 - the name users write, as numpy.abs


def trace_score_mod(fn) -> Graph:
    """The canonical graph of ``fn(score, b, h, q_idx, kv_idx) -> score``."""
    return _trace.trace(fn, "score")


def trace_mask_mod(fn) -> Graph:
    """The canonical graph of ``fn(b, h, q_idx, kv_idx) -> bool``."""
    return _trace.trace(fn, "mask")


def cuda_source(graph: Graph) -> str:
    """The ``__device__`` function of a traced mod (see :mod:`cuflash.core.mod_codegen`)."""
    return mod_codegen.generate(graph)


# -- built-in mods ---------------------------------------------------------------------------------

def softcap(cap: float):
    """The score_mod ``cap * tanh(score / cap)`` (Gemma 2's logit cap)."""
    from .core.validate import float32_number

    cap = float32_number("cap", cap, positive=True)

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * tanh(score / cap)
    return softcap_mod


def alibi(slopes):
    """The score_mod ``score - slopes[h] * (q_idx - kv_idx)`` (BLOOM, MPT): ``slopes`` one float per
    query head."""
    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)
    return alibi_mod


def relative_bias(table):
    """The score_mod ``score + table[h, d + m - 1]`` of a relative-position bias table [heads,
    2m - 1] (float; T5-style buckets expanded to distances), d = q_idx - kv_idx clipped to
    [-(m - 1), m - 1]: distances beyond the table take its end columns. The table is a constant of
    the kernels (no gradient)."""
    shape = getattr(table, "shape", None)
    if shape is None or len(shape) != 2 or shape[1] % 2 == 0:
        raise ValueError(f"table.shape={shape} must be (heads, 2 m - 1): one column per distance from "
                         f"-(m - 1) to m - 1")
    reach = (shape[1] - 1) // 2

    def relative_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, maximum(minimum(q_idx - kv_idx, reach), -reach) + reach]
    return relative_mod


def sliding_window(window: int, causal: bool = True):
    """The mask_mod of a window of ``window`` keys ending at each query (and, without ``causal``,
    as many after it)."""
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} must be a positive integer")
    if causal:
        def window_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    else:
        def window_mod(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx < window) & (kv_idx - q_idx < window)
    return window_mod


def chunked(chunk: int, causal: bool = True):
    """The mask_mod of chunked local attention (Llama 4): queries and keys attend within the same
    block of ``chunk`` positions (``q_idx // chunk == kv_idx // chunk``), and with ``causal``
    q_idx >= kv_idx."""
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or not 1 <= chunk < 2**31:
        raise ValueError(f"chunk={chunk!r} must be a positive integer below 2**31")
    chunk = int(chunk)
    if causal:
        def chunked_mod(b, h, q_idx, kv_idx):
            return (q_idx // chunk == kv_idx // chunk) & (q_idx >= kv_idx)
    else:
        def chunked_mod(b, h, q_idx, kv_idx):
            return q_idx // chunk == kv_idx // chunk
    return chunked_mod


@functools.lru_cache(maxsize=256)
def _window_size_mask(left: int, right: int, offset: int = 0):
    """The mask_mod of FlashAttention's ``window_size=(left, right)``: a query at q_idx sees the keys
    q_idx + offset - left to q_idx + offset + right (-1: no bound on that side; offset seqlen_k -
    seqlen_q aligns the window bottom-right, as causal is), or None when neither is bounded. The
    same bounds give the same function, so calls with them share the traced graph and plans."""
    if left >= 0 and right >= 0:
        def window(b, h, q_idx, kv_idx):
            return (kv_idx >= q_idx + (offset - left)) & (kv_idx <= q_idx + (offset + right))
    elif left >= 0:
        def window(b, h, q_idx, kv_idx):
            return kv_idx >= q_idx + (offset - left)
    elif right >= 0:
        def window(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + (offset + right)
    else:
        return None
    return window


_softcap_mod = functools.lru_cache(maxsize=64)(softcap)  # one function per cap, as above


def document_mask(document_ids, causal: bool = False):
    """The mask_mod of packed documents: query and key attend when ``document_ids[b, q_idx] ==
    document_ids[b, kv_idx]`` (integers [batch, seqlen]; one sequence for queries and keys), and
    with ``causal`` also q_idx >= kv_idx.

    When every id of a row fills one run of consecutive positions (packed documents), the mod
    reads the bounds of the query's run instead (``kv_idx`` in ``[start, end)``): one or two loads
    per query row rather than one per key. The ids are then read once, here: after changing them,
    make a new mask_mod. Other ids are compared as they are when the kernel runs."""
    bounds = _run_bounds(document_ids)
    if bounds is not None:
        starts, ends = bounds
        if causal:
            def document_mod(b, h, q_idx, kv_idx):
                return (kv_idx >= starts[b, q_idx]) & (q_idx >= kv_idx)
        else:
            def document_mod(b, h, q_idx, kv_idx):
                return (kv_idx >= starts[b, q_idx]) & (kv_idx < ends[b, q_idx])
    elif causal:
        def document_mod(b, h, q_idx, kv_idx):
            return (document_ids[b, q_idx] == document_ids[b, kv_idx]) & (q_idx >= kv_idx)
    else:
        def document_mod(b, h, q_idx, kv_idx):
            return document_ids[b, q_idx] == document_ids[b, kv_idx]
    return document_mod


def _run_bounds(ids):
    """(starts, ends): int32 [batch, seqlen], the first and one past the last position of each
    position's run of equal ids, on the ids' device (or NumPy for NumPy ids); None unless ids is a
    2-d integer array whose every id fills a single run in its row."""
    try:
        import cupy
    except ImportError:
        cupy = None
    on_device = cupy is not None and isinstance(ids, cupy.ndarray)
    if not (on_device or isinstance(ids, np.ndarray)) or ids.ndim != 2 or ids.dtype.kind not in "iu" \
            or 0 in ids.shape or ids.shape[1] >= 2**31:
        return None
    host = cupy.asnumpy(ids) if on_device else ids
    batch, n = host.shape
    starts_run = np.ones(host.shape, bool)
    starts_run[:, 1:] = host[:, 1:] != host[:, :-1]
    ordered = np.sort(host, axis=1)
    distinct = 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(axis=1)
    if (starts_run.sum(axis=1) != distinct).any():
        return None
    index = np.arange(n, dtype=np.int64)
    starts = np.maximum.accumulate(np.where(starts_run, index, 0), axis=1)
    ends_run = np.ones(host.shape, bool)
    ends_run[:, :-1] = starts_run[:, 1:]
    ends = np.minimum.accumulate(np.where(ends_run, index + 1, n)[:, ::-1], axis=1)[:, ::-1]
    starts, ends = (np.ascontiguousarray(x, dtype=np.int32) for x in (starts, ends))
    if not on_device:
        return starts, ends
    with cupy.cuda.Device(ids.device.id):
        return cupy.asarray(starts), cupy.asarray(ends)


def _replayed(graph: Graph):
    """A traced mod as a function again: calling it inside another trace adds the graph's nodes
    (its captured arrays too) to that trace."""
    def replay(*symbols):
        values, arrays = [], {}
        for node in graph.nodes:
            args = [values[i] for i in node.args] if node.op not in ("const", "sym", "load") else None
            if node.op == "const":
                value = node.args[0]
            elif node.op == "sym":
                value = symbols[graph.symbols.index(node.args[0])]
            elif node.op == "load":
                slot = node.args[0]
                if slot not in arrays:
                    arrays[slot] = _trace.CapturedArray(_trace._graph_of(*symbols), graph.arrays[slot],
                                                        graph.array_names[slot])
                value = arrays[slot][tuple(values[i] for i in node.args[1:])]
            elif node.op == "where":
                value = _trace.where(*args)
            else:
                value = _trace.binary(node.op, *args) if len(args) == 2 else _trace.unary(node.op, *args)
            values.append(value)
        return values[graph.output]
    return replay


def _combined(masks, op, name):
    if not masks:
        raise ValueError(f"{name} takes at least one mask_mod")
    masks = tuple(_replayed(m) if isinstance(m, Graph) and m.kind == "mask" else m for m in masks)
    for mask in masks:
        if not callable(mask):
            raise TypeError(f"{name} takes mask_mods (functions or traced mask graphs), got {type(mask).__name__}")

    def combined(b, h, q_idx, kv_idx):
        result = masks[0](b, h, q_idx, kv_idx)
        for mask in masks[1:]:
            result = op(result, mask(b, h, q_idx, kv_idx))
        return result
    return combined


def and_masks(*masks):
    """The mask_mod that allows a pair where every one of ``masks`` does."""
    return _combined(masks, lambda a, b: a & b, "and_masks")


def or_masks(*masks):
    """The mask_mod that allows a pair where any one of ``masks`` does."""
    return _combined(masks, lambda a, b: a | b, "or_masks")


def prefix_lm(prefix_lengths):
    """The mask_mod of a prefix LM: causal, and bidirectional inside the first
    ``prefix_lengths[b]`` tokens of sequence b (an int32 array [batch])."""
    def prefix_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | (kv_idx < prefix_lengths[b])
    return prefix_mod


__all__ = ["where", "minimum", "maximum", "exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "floor", "abs",
           "trace_score_mod", "trace_mask_mod", "cuda_source", "softcap", "alibi", "sliding_window", "chunked",
           "document_mask", "and_masks", "or_masks", "prefix_lm", "Graph"]


# -- the reference's use ----------------------------------------------------------------------------

def _graph(mod, kind: str) -> Graph:
    if isinstance(mod, Graph):
        if mod.kind != kind:
            raise ValueError(f"a {mod.kind} graph was given as the {kind}_mod")
        return mod
    return _modset.trace_cached(mod, kind)


def _grids(shape) -> dict:
    """The index symbols as NumPy grids broadcasting to [batch, heads, seqlen_q, seqlen_k]."""
    batch, heads, seqlen_q, seqlen_k = shape
    return {"b": np.arange(batch)[:, None, None, None], "h": np.arange(heads)[None, :, None, None],
            "q_idx": np.arange(seqlen_q)[None, None, :, None], "kv_idx": np.arange(seqlen_k)[None, None, None, :]}


def apply_to_scores(scores, allowed, score_mod=None, mask_mod=None):
    """``(scores, allowed)`` with the mods evaluated on index grids in the scores' precision:
    ``scores`` [batch, heads, seqlen_q, seqlen_k] (floating), ``allowed`` a boolean mask that
    broadcasts to it; the mask_mod's mask is and-ed in."""
    grids = _grids(scores.shape)
    if score_mod is not None:
        graph = _graph(score_mod, "score")
        scores = np.broadcast_to(_trace.evaluate(graph, dict(grids, score=scores), float_dtype=scores.dtype),
                                 scores.shape).astype(scores.dtype)
    if mask_mod is not None:
        graph = _graph(mask_mod, "mask")
        allowed = np.logical_and(allowed, np.broadcast_to(_trace.evaluate(graph, grids), scores.shape))
    return scores, allowed


def score_derivative(scores, score_mod):
    """d(score_mod)/d(score) at ``scores`` [batch, heads, seqlen_q, seqlen_k], in their precision."""
    graph = mod_grad.derivative(_graph(score_mod, "score"))
    value = _trace.evaluate(graph, dict(_grids(scores.shape), score=scores), float_dtype=scores.dtype)
    return np.broadcast_to(value, scores.shape).astype(scores.dtype)


def _rebased(mod, kind: str, b: int = 0, q_idx: int = 0, also=None) -> Graph:
    """The graph of ``mod`` (a function or its graph) read at ``b + b`` and ``q_idx + q_idx``: the
    reference of one sequence of a batch (``b``) whose queries sit after its cached keys
    (``q_idx``), as attention_with_kvcache sees them; and-ed with the mask_mod ``also`` (which
    captures no arrays), read at the positions as they are."""
    from .core.trace import BOOL, INT, Node

    graph = _graph(mod, kind)
    out = Graph(kind, graph.symbols)
    out.arrays, out.array_names = list(graph.arrays), list(graph.array_names)
    shifted = {}
    for name, shift in (("b", b), ("q_idx", q_idx)):
        sym = out.add(Node("sym", (name,), INT))
        shifted[name] = out.add(Node("add", (sym, out.add(Node("const", (int(shift),), INT))), INT)) if shift else sym
    out.output = _copy_nodes(graph, out, shifted)
    if also is not None:
        extra = _graph(also, "mask")
        if extra.arrays:
            raise ValueError("_rebased: the mask and-ed in must capture no arrays")
        out.output = out.add(Node("and", (out.output, _copy_nodes(extra, out, {})), BOOL))
    return out


def _copy_nodes(graph: Graph, out: Graph, symbols: dict) -> int:
    """Add ``graph``'s nodes to ``out`` (its symbols as the node ids ``symbols`` gives, where it
    gives one); returns the id of graph's output in ``out``."""
    from .core.trace import Node

    ids = []
    for node in graph.nodes:
        if node.op == "sym":
            ids.append(symbols[node.args[0]] if node.args[0] in symbols else out.add(node))
        elif node.op == "const":
            ids.append(out.add(node))
        elif node.op == "load":
            ids.append(out.add(Node("load", (node.args[0], *(ids[i] for i in node.args[1:])), node.dtype)))
        else:
            ids.append(out.add(Node(node.op, tuple(ids[i] for i in node.args), node.dtype)))
    return ids[graph.output]
