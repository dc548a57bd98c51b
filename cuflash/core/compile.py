"""Compiling and caching: CUDA source -> loaded kernel, through NVRTC.

Three layers, each cheaper than the next:

1. an in-process memo keyed by (spec, device): a repeated call costs one dict lookup;
2. CuPy's disk cache (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``), keyed by CuPy on the
   source, options, arch and NVRTC version; the headers' digest is one of the options, because
   CuPy does not hash files pulled in with ``-I``;
3. NVRTC itself, on a miss. Its failure raises :class:`CompileError`.

:func:`compile_offline` runs NVRTC without a GPU (for checks and ``generate``-style inspection);
:func:`warmup` fills the disk cache in parallel processes.
"""
from __future__ import annotations

import dataclasses
import os
import re
import struct
import sys
import tempfile
import threading
from pathlib import Path

from . import mod_codegen
from .render import generate, headers_digest, include_dir
from .bwd_spec import BwdSpec
from .decode_spec import DecodeSpec
from .spec import KernelSpec, arch_from_capability, nvrtc_arch


class CompileError(RuntimeError):
    """NVRTC rejected a generated kernel. Carries everything needed to reproduce it."""

    def __init__(self, spec_name: str, options, log: str, source_path: str):
        self.spec_name = spec_name
        self.options = tuple(options)
        self.log = log
        self.source_path = source_path
        super().__init__(
            f"compiling {spec_name} failed\n  options: {' '.join(self.options)}\n"
            f"  source: {source_path}\n--- NVRTC log ---\n{log.strip()}"
        )

    def __reduce__(self):  # picklable, so warmup's worker processes can report it
        return (type(self), (self.spec_name, self.options, self.log, self.source_path))


def compile_options(spec) -> tuple[str, ...]:
    return arch_options(spec.arch)


def arch_options(arch: str) -> tuple[str, ...]:
    """NVRTC options of every cuflash kernel for a target tag (``"sm90a"``): C++17, the target,
    the template headers and their digest (a changed header makes a new cache entry)."""
    return (
        "-std=c++17",
        f"-arch={nvrtc_arch(arch)}",
        f"-I{include_dir()}",
        f"-DCUFLASH_HEADERS_DIGEST=0x{headers_digest()}",
    )


def cache_dir() -> Path:
    """CuPy's kernel cache folder, where compiled cuflash kernels persist across processes."""
    return Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))


def _manifest_dir() -> Path:
    return cache_dir() / "cuflash"


def cached_entries() -> list[str]:
    """Names of the specializations this cache holds (``info`` lists them)."""
    folder = _manifest_dir()
    if not folder.is_dir():
        return []
    digest = headers_digest()
    return sorted(p.name.rsplit("-", 1)[0] for p in folder.iterdir() if p.name.endswith(digest))


def _record(spec) -> None:
    try:
        _manifest_dir().mkdir(parents=True, exist_ok=True)
        (_manifest_dir() / f"{spec.name}-{headers_digest()}").touch()
    except OSError:
        pass  # the manifest is informational; a read-only cache must not break a launch


def _write_failed_source(spec, source: str) -> str:
    folder = Path(tempfile.gettempdir()) / "cuflash-failed"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{spec.name}.cu"
    path.write_text(source)
    return str(path)


# -- runtime path (needs a GPU) ---------------------------------------------------------------------

def device_arch(device=None) -> str:
    """Compile target of a CuPy device (the current one by default)."""
    import cupy

    dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
    cc = dev.compute_capability
    return arch_from_capability(int(cc[:-1]), int(cc[-1]))


_memo: dict = {}
_lock = threading.Lock()
#: Counters for tests and ``info``: NVRTC/disk-cache loads versus memo hits.
stats = {"loads": 0}


def get_kernel(spec: KernelSpec | BwdSpec, device_id: int):
    """The loaded kernel of ``spec`` on a device, compiled (or read from disk) once per process;
    for a :class:`BwdSpec` or :class:`DecodeSpec`, the tuple of its kernels in
    ``spec.kernel_names`` order."""
    key = (spec, device_id)
    kernel = _memo.get(key)
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _memo.get(key)
        if kernel is None:
            kernel = _load(spec)
            _memo[key] = kernel
    return kernel


def _load(spec):
    import cupy
    from cupy.cuda.compiler import CompileException

    source = generate(spec)
    options = compile_options(spec)
    module = cupy.RawModule(code=source, options=options)
    backward = isinstance(spec, BwdSpec)
    several = backward or isinstance(spec, DecodeSpec)
    names = spec.kernel_names if several else (spec.name,)
    smem = (0, spec.smem_bytes, spec.dq_smem_bytes) if backward else (spec.smem_bytes, 0, 0)
    try:
        kernels = tuple(module.get_function(name) for name in names)  # RawModule compiles lazily, here
    except CompileException as exc:
        raise CompileError(spec.name, options, exc.get_message(), _write_failed_source(spec, source)) from None
    for kernel, size in zip(kernels, smem):
        if size > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = size
    kernel = kernels if several else kernels[0]
    stats["loads"] += 1
    _record(spec)
    return kernel


def clear_memo() -> None:
    """Forget the in-process kernels (the disk cache stays)."""
    with _lock:
        _memo.clear()


# -- offline path (no GPU needed) -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OfflineReport:
    """What ptxas said about one specialization."""

    spec: object              # KernelSpec or BwdSpec
    registers: int            # the most of any kernel in the module, as are the spill figures
    spill_stores: int
    spill_loads: int
    stack_frame: int
    smem_bytes: int
    log: str
    cubin: bytes = dataclasses.field(repr=False)

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads or self.stack_frame)


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def _whole_elf(cubin: bytes) -> bytes:
    """CuPy's ``getCUBIN`` returns one byte less than NVRTC reports (it treats the size as that of
    a NUL-terminated string), cutting the last program header short so disassemblers reject the
    file. That byte is the top byte of the header's 64-bit alignment field, always 0: put it back
    when the ELF's own tables say exactly one byte is missing."""
    if len(cubin) < 64 or cubin[:4] != b"\x7fELF":
        return cubin
    ph_offset, sh_offset = struct.unpack_from("<QQ", cubin, 0x20)
    ph_size, ph_count, sh_size, sh_count = struct.unpack_from("<HHHH", cubin, 0x36)
    end = max(ph_offset + ph_size * ph_count, sh_offset + sh_size * sh_count)
    return cubin + b"\0" if end == len(cubin) + 1 else cubin


def compile_offline(spec) -> OfflineReport:
    """Compile with NVRTC directly (no device needed) and parse the ptxas resource report."""
    from cupy.cuda import nvrtc

    source = generate(spec)
    options = compile_options(spec)
    # CuPy's RawModule adds --device-as-default-execution-space; without it older NVRTC (13.0)
    # rejects the kernels' unannotated lambdas as host functions.
    nvrtc_options = ([o.replace("-arch=", "--gpu-architecture=") for o in options]
                     + ["--device-as-default-execution-space", "-Xptxas=-v"])
    prog = nvrtc.createProgram(source, f"{spec.name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, nvrtc_options)
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(spec.name, nvrtc_options, log, _write_failed_source(spec, source)) from None
        log = nvrtc.getProgramLog(prog)
        cubin = _whole_elf(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)
    # One section per entry function; the report keeps the worst of them (backward specs have three).
    sections = re.split(r"Compiling entry function", log)[1:] or [log]
    per_kernel = [{key: int(m.group(1)) if (m := rx.search(sec)) else 0 for key, rx in _PTXAS.items()}
                  for sec in sections]
    found = {key: max(k[key] for k in per_kernel) for key in _PTXAS}
    return OfflineReport(spec=spec, smem_bytes=spec.smem_bytes, log=log, cubin=cubin, **found)


# -- warmup: fill the disk cache in parallel ----------------------------------------------------------

def _warm_one(spec, mod_graphs=()) -> str:
    import cupy

    mod_codegen.adopt(mod_graphs)
    get_kernel(spec, cupy.cuda.Device().id)
    return spec.name


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:60]:<60}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


#: (cache folder, spec) an earlier warmup of this process compiled: a later one skips them, as it
#: skips the specs loaded here.
_warmed: set = set()


def _compile_weight(spec) -> tuple:
    """A sort key that puts the kernels that compile longest first: backward sets, then Hopper
    kernels, then wider head dims."""
    return (isinstance(spec, BwdSpec), getattr(spec, "family", "") == "wgmma", getattr(spec, "head_dim", 0))


def warmup(specs, processes: int | None = None, progress: bool = True) -> list[str]:
    """Compile ``specs`` ahead of time in parallel processes so later calls find them on disk.

    Specs this process has loaded, or compiled by an earlier warmup, are not compiled again (no
    process is started when none is left). Returns the names of all ``specs``; raises the first
    :class:`CompileError` after all have run.
    """
    import concurrent.futures
    import multiprocessing

    specs = list(dict.fromkeys(specs))
    folder = str(cache_dir())
    done_here = {spec for spec, _ in list(_memo)} | {spec for f, spec in _warmed if f == folder}
    names = [s.name for s in specs if s in done_here]
    # the larger kernels first, so that the pool does not end waiting on one of them
    specs = sorted((s for s in specs if s not in done_here), key=_compile_weight, reverse=True)
    if not specs:
        return names
    processes = processes or min(len(specs), os.cpu_count() or 1) or 1
    done, errors = 0, []
    ctx = multiprocessing.get_context("spawn")  # a forked CUDA context is unusable
    with concurrent.futures.ProcessPoolExecutor(max_workers=processes, mp_context=ctx) as pool:
        mod_graphs = mod_codegen.graphs_of(specs)  # the mods specs name, for the worker processes
        futures = {pool.submit(_warm_one, s, mod_graphs): s for s in specs}
        for future in concurrent.futures.as_completed(futures):
            done += 1
            try:
                names.append(future.result())
                _warmed.add((folder, futures[future]))
            except Exception as exc:  # noqa: BLE001 - reported after the others finish
                errors.append(exc)
            if progress:
                _progress(done, len(specs), futures[future].name)
    if errors:
        raise errors[0]
    return names
