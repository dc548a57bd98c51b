"""Rendering: KernelSpec -> CUDA source, through Jinja2 templates.

The templates are thin: they declare the parameter block and the compile-time constants that
Python computed in :mod:`cuflash.core.spec`, and call the algorithm, which lives in real CUDA headers
under ``templates/include/cuflash``. Undefined template variables are errors (StrictUndefined).
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from . import dtypes, mod_codegen, mod_grad
from .bwd_spec import BwdSpec
from .decode_spec import MAX_SPLITS, DecodeSpec
from .params import BWD_PARAM_FIELDS, DECODE_PARAM_FIELDS, PARAM_FIELDS
from .spec import KernelSpec, nvrtc_arch


def template_dir() -> Path:
    """Folder of the installed templates (``cuflash/templates`` in a wheel, ``templates/`` in a checkout)."""
    from importlib import resources

    try:
        path = Path(str(resources.files("cuflash.templates")))
        if (path / "fwd.cu.j2").is_file():
            return path
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parents[2] / "templates"


def include_dir() -> Path:
    """Folder passed to the compiler with ``-I`` (holds ``cuflash/*.cuh``)."""
    return template_dir() / "include"


@functools.lru_cache(maxsize=1)
def headers_digest() -> str:
    """Hash of every header the kernels include. CuPy's disk cache does not hash ``-I`` headers,
    so this digest goes into the compile options: editing a header invalidates cached kernels."""
    digest = hashlib.sha256()
    for path in sorted((include_dir() / "cuflash").glob("*.cuh")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2  # only when a kernel is generated: a memo or disk-cache hit never renders

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


_HEADERS = {"mma": "fwd_mma.cuh", "wgmma": "fwd_wgmma.cuh", "simt": "fwd_simt.cuh"}


@functools.lru_cache(maxsize=512)
def generate(spec: KernelSpec | BwdSpec | DecodeSpec) -> str:
    """CUDA source of one specialization: a forward spec's kernel is ``spec.name``; a backward
    or KV-cache spec's kernels are ``spec.kernel_names``."""
    if isinstance(spec, DecodeSpec):
        return _environment().get_template("decode.cu.j2").render(
            spec=spec, name=spec.name, names=spec.kernel_names, param_fields=DECODE_PARAM_FIELDS,
            nvrtc_arch=nvrtc_arch(spec.arch), include_dir=include_dir(), max_splits=MAX_SPLITS,
            mods=mod_sources(spec.score_mod, spec.mask_mod))
    if isinstance(spec, BwdSpec):
        return _environment().get_template("bwd.cu.j2").render(
            spec=spec,
            name=spec.name,
            names=spec.kernel_names,
            param_fields=BWD_PARAM_FIELDS,
            nvrtc_arch=nvrtc_arch(spec.arch),
            include_dir=include_dir(),
            sorted_ns=sorted({spec.block_m, spec.padded_head_dim, spec.padded_head_dim // 2,
                              spec.padded_head_dim // 4} - {0}),
            mods=dict(mod_sources(spec.score_mod, spec.mask_mod, backward=True), block_sparse=spec.block_sparse),
        )
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"generate() takes a cuflash.KernelSpec, BwdSpec or DecodeSpec, got {type(spec).__name__}")
    template = _environment().get_template("fwd.cu.j2")
    return template.render(
        spec=spec,
        name=spec.name,
        header="fwd_wgmma_ws.cuh" if spec.warp_specialized else _HEADERS[spec.family],
        param_fields=PARAM_FIELDS,
        nvrtc_arch=nvrtc_arch(spec.arch),
        include_dir=include_dir(),
        wgmma_ns=sorted({spec.block_n, spec.padded_head_dim} | ({8} if spec.sums_on_tensor_cores else set())
                         | ({spec.block_n // 2} if spec.warp_specialized else set())),
        elem_ctype=dtypes.from_tag(spec.dtype).ctype,
        mods=dict(mod_sources(spec.score_mod, spec.mask_mod, fold=True), block_sparse=spec.block_sparse),
    )


def mod_sources(score_digest: str, mask_digest: str, backward: bool = False, fold: bool = False) -> dict:
    """What a template needs of a spec's mods: the ``__device__`` functions (one source) and each
    mod's function name, or "" where the spec has none; ``backward``: also the score_mod's
    derivative ("dscore"), unless it is the constant 1; ``fold``: the score_mod without its
    constant input and output factors ("score_in", "score_out"; mod_codegen.fold_scales)."""
    names, source = {"score": "", "mask": "", "dscore": ""}, ""
    for kind, digest in (("score", score_digest), ("mask", mask_digest)):
        if digest:
            graph = mod_codegen.registered(digest, kind)
            if fold and kind == "score":
                graph, names["score_in"], names["score_out"] = mod_codegen.fold_scales(graph)
            names[kind] = mod_codegen.function_name(graph)
            source += mod_codegen.generate(graph)
            source += mod_codegen.generate_split(graph)  # per row, column and element (the Hopper kernels)
            if backward and kind == "score":
                derivative = mod_grad.derivative(graph)
                if not mod_grad.is_constant_one(derivative):
                    names["dscore"] = mod_codegen.function_name(derivative)
                    source += mod_codegen.generate(derivative)
    return {"source": source, **names, "split": True}
