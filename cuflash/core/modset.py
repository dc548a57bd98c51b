"""A call's mods, ready for a kernel: the traced graphs, their digests (which name the
specialization) and the packed struct of the arrays they capture (which the kernel takes)."""
from __future__ import annotations

from typing import NamedTuple

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


def _traced(mod, kind: str) -> Graph | None:
    if mod is None:
        return None
    if isinstance(mod, Graph):
        if mod.kind != kind:
            raise ValueError(f"a traced {mod.kind}_mod was passed as {kind}_mod")
        return mod
    if not callable(mod):
        raise TypeError(f"{kind}_mod must be a Python function, got {type(mod).__name__}")
    return trace.trace(mod, kind)


def prepare(score_mod, mask_mod, device_id: int) -> ModSet | None:
    """Trace the mods (or take their graphs) and check that the arrays they capture are CuPy arrays
    on the call's device; None when the call has none."""
    if score_mod is None and mask_mod is None:
        return None
    import cupy

    graphs = {"score": _traced(score_mod, "score"), "mask": _traced(mask_mod, "mask")}
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
    return ModSet(graphs["score"], graphs["mask"],
                  mod_codegen.register(graphs["score"]) if graphs["score"] is not None else "",
                  mod_codegen.register(graphs["mask"]) if graphs["mask"] is not None else "")


def block_mask_mod(block_mask, mask_mod, problem):
    """The mask_mod of a call with a block mask: the mask's own, or the call's when it traces to
    the same graph; the mask must have been made for the call's batch, heads and lengths."""
    if block_mask is None:
        return mask_mod
    from ..sparsity import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cuflash.BlockMask (cuflash.block_mask), got {type(block_mask).__name__}")
    shape = (problem.batch, problem.heads, problem.seqlen_q, problem.seqlen_k)
    if tuple(block_mask.shape) != shape:
        raise ValueError(f"block_mask was made for (batch, heads, seqlen_q, seqlen_k)={tuple(block_mask.shape)}; "
                         f"this call has {shape}")
    if mask_mod is None:
        return block_mask.graph
    if _traced(mask_mod, "mask").digest != block_mask.digest:
        raise ValueError("mask_mod differs from the mask_mod block_mask was made from; pass one of them")
    return mask_mod
