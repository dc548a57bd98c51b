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


def traced(mod, kind: str) -> Graph | None:
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
    return ModSet(graphs["score"], graphs["mask"],
                  mod_codegen.register(graphs["score"]) if graphs["score"] is not None else "",
                  mod_codegen.register(graphs["mask"]) if graphs["mask"] is not None else "")

