"""Launching: a loaded kernel + a validated Problem + device arrays -> one kernel launch.

All run-time values travel in one by-value parameter block whose layout is defined once, by
:data:`cuflash.core.params.PARAM_FIELDS`.
"""
from __future__ import annotations

import ctypes
import functools
import math
import struct
import sys
import threading
from sys import getrefcount
from typing import NamedTuple

import numpy as np

from . import policy
from .bwd_spec import BwdSpec
from .params import BACKWARD_STRUCT as _BWD_STRUCT
from .params import FORWARD_STRUCT as _STRUCT
from .spec import KernelSpec, ceil_div
from .validate import Fp8Scales, Problem

_PARAMS = np.dtype((np.void, _STRUCT.size))
_BWD_PARAMS = np.dtype((np.void, _BWD_STRUCT.size))
_LOG2E = 1.0 / math.log(2.0)


class SplitPlan(NamedTuple):
    """How the warp-specialized kernel's work counter deals out work (block.cuh): values below
    dp_tiles are whole tiles, the next ``shares`` values shares of ``share_units`` key tiles."""
    dp_tiles: int
    shares: int = 0
    share_units: int = 0

    @property
    def shares_end_inside_tiles(self) -> bool:
        """Some share ends inside a tile, which leaves that tile's state to the next share."""
        return self.shares > 0 and self.share_units % self.shares != 0


def split_plan(spec: KernelSpec, problem: Problem) -> SplitPlan:
    """Without a causal mask every tile costs the same, so when the tiles leave the last wave of
    blocks part-empty (e.g. 2048 tiles on 132 multiprocessors: 15 waves and 68 tiles), the last
    full wave and the rest (200 tiles) are dealt out by keys instead, in one equal share per
    multiprocessor. Whole tiles only where the kernel cannot (spec.split_keys: a causal mask,
    whose tiles of unequal work, heaviest first, balance themselves; three consumers), with fewer
    than two waves or a whole number of them, one key tile, or 16-bit inputs with at most
    policy.WHOLE_TILES_MAX_SEQLEN_K_16BIT keys."""
    tiles = ceil_div(problem.seqlen_q, spec.block_m) * problem.heads * problem.batch
    sms = _multiprocessors(problem.device_id)
    key_tiles = ceil_div(problem.seqlen_k, spec.block_n)
    short = not spec.fp8 and problem.seqlen_k <= policy.WHOLE_TILES_MAX_SEQLEN_K_16BIT
    if not spec.split_keys or short or tiles < 2 * sms or tiles % sms == 0 or key_tiles < 2:
        return SplitPlan(tiles)
    shared = tiles % sms + sms
    return SplitPlan(tiles - shared, sms, shared * key_tiles)


def band_heads(spec: KernelSpec, problem: Problem) -> int:
    """(batch, head) pairs per band of the warp-specialized kernel's causal work tiles
    (block.cuh): within a band, blocks take the heaviest query tile of every pair first, then the
    next heaviest, so that a launch ends on its lightest tiles instead of on some pair's
    heaviest. The band is the largest divisor of batch x heads whose K and V fit
    policy.BAND_BYTES (policy.BAND_SHORT_BYTES up to policy.BAND_SHORT_SEQLEN keys); without a
    causal mask (tiles of equal work), one pair."""
    if not (spec.warp_specialized and spec.causal):
        return 1
    kv_bytes = 2 * problem.seqlen_k * problem.head_dim * spec.elem_bytes
    budget = policy.BAND_SHORT_BYTES if problem.seqlen_k <= policy.BAND_SHORT_SEQLEN else policy.BAND_BYTES
    return _largest_divisor(problem.batch * problem.heads, max(1, budget // max(kv_bytes, 1)))


@functools.lru_cache(maxsize=1024)
def _largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of n >= 1 that is at most limit >= 1."""
    if n <= limit:
        return n
    return max(e for d in range(1, math.isqrt(n) + 1) if n % d == 0 for e in (d, n // d) if e <= limit)


def grid(spec: KernelSpec, problem: Problem, plan: SplitPlan | None = None) -> tuple[int, int, int]:
    """(query tiles, heads, batch). Query tiles vary fastest so that the blocks resident at one
    time work on few heads and find their K/V tiles in L2; the kernel walks each head's tiles
    heaviest first.

    The warp-specialized kernel takes a 1-d grid and its blocks take work tiles, numbered the
    same way (with a causal mask, in bands: band_heads), from a counter at run time: one block
    per tile, or (persistent, up to policy.PERSISTENT_MAX_SEQLEN_K keys, with a block mask, whose
    tiles visit few keys, and for packed sequences, whose tiles past a sequence's end are
    skipped) one block per multiprocessor, so that a tile's loads overlap the
    previous tile's epilogue."""
    tiles = (ceil_div(problem.seqlen_q, spec.block_m), problem.heads, problem.batch)
    if spec.warp_specialized:
        plan = plan or split_plan(spec, problem)
        count = plan.dp_tiles + plan.shares
        if problem.seqlen_k <= policy.PERSISTENT_MAX_SEQLEN_K or spec.block_sparse or spec.varlen:
            count = min(count, _multiprocessors(problem.device_id))
        return (count, 1, 1)
    return tiles


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_id: int) -> int:
    import cupy
    return cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]


_ATTR_MEMORY_CLOCK_RATE = 36  # cudaDevAttrMemoryClockRate (kHz)
_ATTR_MEMORY_BUS_WIDTH = 37  # cudaDevAttrGlobalMemoryBusWidth (bits)


def _device_attribute(attr: int, device_id: int) -> int:
    """A device attribute from the runtime, 0 where it does not say."""
    import cupy
    try:
        return int(cupy.cuda.runtime.deviceGetAttribute(attr, device_id))
    except Exception:  # a runtime without the attribute
        return 0


@functools.lru_cache(maxsize=None)
def _memory_bandwidth_gbs(device_id: int) -> float:
    """The device memory's peak bandwidth in GB/s: double data rate over the bus, from the
    runtime's memory clock and bus width (0 where the runtime does not say)."""
    clock_khz = _device_attribute(_ATTR_MEMORY_CLOCK_RATE, device_id)
    bus_bits = _device_attribute(_ATTR_MEMORY_BUS_WIDTH, device_id)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def _stream_key(device_id: int) -> tuple:
    """Key of the per-stream buffers (work counter, split workspace): kernels on one stream run
    one after another, so a stream's launches can share them."""
    import cupy
    return device_id, cupy.cuda.get_current_stream().ptr


_tile_counters: dict = {}


def _tile_counter(key: tuple):
    """The warp-specialized kernel's work-tile counter for a stream (key: _stream_key): two
    int32, zero between launches (the kernel's last block resets them)."""
    import cupy
    counter = _tile_counters.get(key)
    if counter is None:
        counter = _tile_counters[key] = cupy.zeros(2, dtype=cupy.int32)
    return counter


def _split_workspace(spec: KernelSpec, plan: SplitPlan, key: tuple):
    """(states, flags) for a launch that deals tiles out by keys: one slot per share boundary and
    consumer warpgroup, each holding two states (the two pieces of a tile) of 128 threads x
    (head_dim / 8 + 1) float4 (online_softmax.cuh save_state), and one flag per slot, zero
    between launches. Kept per device and stream, like the work counter, and grown when a launch
    needs more. A replaced pair is kept for the process: a captured graph may still point at it."""
    import cupy
    slots = (plan.shares + 1) * spec.compute_warpgroups
    floats = slots * 2 * 128 * (spec.padded_head_dim // 8 + 1) * 4
    old = _split_workspaces.get(key, (None, None))
    states, flags = old
    if states is None or states.size < floats:
        states = cupy.empty(floats, dtype=cupy.float32)
    if flags is None or flags.size < slots:
        flags = cupy.zeros(slots, dtype=cupy.int32)
    if states is not old[0] or flags is not old[1]:
        if old[0] is not None:
            _retired_workspaces.append(old)
        _split_workspaces[key] = (states, flags)
    return states, flags


_split_workspaces: dict = {}
_retired_workspaces: list = []  # replaced (states, flags), kept alive for graphs captured with them


@functools.lru_cache(maxsize=4096)
def divider(d: int) -> tuple[int, int]:
    """(magic, shifts) with which a kernel divides any unsigned 32-bit n by d >= 1 without a
    divide instruction (ptx.cuh fast_div): t = umulhi(magic, n), n / d = (t + ((n - t) >> s1))
    >> s2, shifts = s1 | s2 << 8. The round-up method for unsigned division by an invariant
    (Granlund and Montgomery); magic fits in 32 bits for every d."""
    if not 1 <= d < 2**31:
        raise ValueError(f"divisor {d} must be in [1, 2**31)")
    log2_up = (d - 1).bit_length()
    magic = ((1 << 32) * ((1 << log2_up) - d)) // d + 1
    return magic, min(log2_up, 1) | max(log2_up - 1, 0) << 8


def pack_params(problem: Problem, q, k, v, out, lse, out_strides, tile_counter: int = 0,
                scales: Fp8Scales | None = None, plan: SplitPlan | None = None, split=(0, 0),
                q_tiles: int = 1, band: int = 1, sinks: int = 0, window=(-1, -1)) -> np.ndarray:
    """The parameter block as a one-element void array, which CuPy passes by value. ``scales``:
    the descales of an FP8 call; ``plan`` and ``split`` (pointers to the states and flags): how
    the warp-specialized kernel deals out its work; ``q_tiles``: its query tiles per head;
    ``band``: (batch, head) pairs per band of causal work tiles (band_heads); ``sinks``: the
    address of the float32 sink logits (KernelSpec.sinks), else 0; ``window``: (left, right) of
    KernelSpec.local."""
    descales = (0, 0, 0) if scales is None else \
        (scales.q_descale.data.ptr, scales.k_descale.data.ptr, scales.v_descale.data.ptr)
    descale_strides = (0, 0, 0, 0) if scales is None else (*scales.q_strides, *scales.kv_strides)
    group = problem.heads // max(problem.heads_k, 1)
    raw = _STRUCT.pack(
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr, tile_counter, *split, *descales, sinks,
        *problem.q_strides, *problem.k_strides, *problem.v_strides, *out_strides,
        problem.heads, group,
        problem.seqlen_q, problem.seqlen_k,
        problem.scale * _LOG2E, problem.batch, *descale_strides,
        *(plan or SplitPlan(0)),
        *divider(max(q_tiles, 1)), *divider(max(problem.heads, 1)), *divider(max(group, 1)),
        band, *divider(band * max(q_tiles, 1)), *divider(band), *window,
    )
    return np.frombuffer(raw, dtype=_PARAMS)


def _window_bounds(window, problem: Problem) -> tuple:
    """A window's (left, right) with a bound no query can reach (seqlen_q + seqlen_k keys or
    more, the kernel's 32-bit index arithmetic would overflow on it) made unbounded."""
    return tuple(-1 if w >= problem.seqlen_q + problem.seqlen_k else int(w) for w in window)


def launch(kernel, spec: KernelSpec, problem: Problem, q, k, v, out, lse, out_strides,
           scales: Fp8Scales | None = None, mods: bytes = b"", sinks=None, window=(-1, -1)) -> None:
    """Launch on the current CuPy stream. FP8 (``spec.fp8``): ``scales`` holds the descales; for
    the Hopper kernel v is V^T as fp8.v_operand lays it out, for the portable one V itself.
    ``mods``: the packed arrays of the spec's mods (modset.ModSet.packed), its last argument;
    ``sinks``: float32 [heads] (spec.sinks); ``window``: (left, right) of spec.local."""
    LaunchPlan(kernel, spec, problem, q, k, v, out, lse, out_strides, scales, mods,
               sinks=sinks, window=window).launch(q, k, v, out, lse)


class LaunchPlan:
    """A forward launch prepared once for calls that agree on everything but the arrays' addresses
    (shapes, strides, dtypes, flags, device and stream; the caller keys plans by those): the
    kernel, its grid, and the parameter block with all but the five array pointers filled in,
    which each call writes. It keeps the per-stream buffers its block points to alive.

    The first launch goes through CuPy's kernel call; later ones (:data:`DRIVER_LAUNCH`) straight
    through the driver's cuLaunchKernel on argument storage the plan keeps (:meth:`launch_pointers`)."""

    __slots__ = ("spec", "problem", "kernel", "grid", "block", "smem", "template", "out_strides", "buffers",
                 "maps", "out_map", "mods", "map_problem", "lse_scratch", "outputs", "spare", "_launched", "_driver")

    def __init__(self, kernel, spec: KernelSpec, problem: Problem, q, k, v, out, lse, out_strides,
                 scales: Fp8Scales | None = None, mods: bytes = b"", map_problem: Problem | None = None,
                 sinks=None, window=(-1, -1)):
        """``map_problem``: the problem the tensor maps describe, when not ``problem`` (packed
        sequences: all rows as one sequence of batch 1; ``mods`` then holds the VarlenArgs, or a
        tuple of them and the mods' bytes);
        ``sinks``: float32 [heads] sink logits (spec.sinks), kept alive with the plan; ``window``:
        (left, right), the keys spec.local lets each query see (negative: unbounded)."""
        self.spec, self.problem, self.kernel, self.out_strides = spec, problem, kernel, out_strides
        self.map_problem = map_problem or problem
        self.block, self.smem = (spec.threads, 1, 1), spec.smem_bytes
        plan, buffers, counter, split = None, (), 0, (0, 0)
        if spec.warp_specialized:
            key = _stream_key(problem.device_id)
            counter_array = _tile_counter(key)
            plan = split_plan(spec, problem)
            buffers = (counter_array,)
            if plan.shares:
                states, flags = _split_workspace(spec, plan, key)
                buffers += (states, flags)
                split = (states.data.ptr, flags.data.ptr)
            counter = counter_array.data.ptr
        self.buffers = buffers + ((scales,) if scales is not None else ()) + ((sinks,) if sinks is not None else ())
        q_tiles, band = (ceil_div(problem.seqlen_q, spec.block_m), band_heads(spec, problem)) \
            if spec.warp_specialized else (1, 1)
        self.template = pack_params(problem, q, k, v, out, lse, out_strides, counter, scales, plan, split,
                                    q_tiles, band, sinks.data.ptr if sinks is not None else 0,
                                    _window_bounds(window, self.map_problem) if spec.local else (-1, -1)).tobytes()
        self.grid = grid(spec, problem, plan)
        # (pointers, encoded maps) of the last call, read and replaced as one object (threads share plans)
        self.maps = self.out_map = (None, None)
        self.mods = tuple(a for raw in (mods if isinstance(mods, tuple) else (mods,)) for a in _struct_args(raw))
        # set by the caller that keeps the plan: the LSE buffer of calls that do not return it, and
        # how their outputs are allocated
        self.lse_scratch = self.outputs = None
        self.spare = []  # the (out, lse) last handed out, for outputs_unused
        self._launched, self._driver = False, None

    def launch(self, q, k, v, out, lse, stream: int | None = None, pointers: tuple | None = None) -> None:
        """Launch on the current CuPy stream with these arrays (shaped and strided as the plan's);
        ``stream``: that stream's handle where the caller has it; ``pointers``: the five arrays'
        addresses where the caller has them."""
        driver = self._driver
        if driver is None and self._launched:
            driver = self._driver = self._prepare_driver()
        if driver:
            if pointers is None:
                pointers = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr)
            self._driver_launch(driver, *pointers, stream)
            return
        self._launched = True
        raw = bytearray(self.template)
        _POINTERS.pack_into(raw, 0, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr)
        args = (np.frombuffer(raw, dtype=_PARAMS),)
        spec = self.spec
        if spec.warp_specialized:
            ptrs, maps = self.maps
            if ptrs != (q.data.ptr, k.data.ptr, v.data.ptr):
                from .tma import forward_maps
                maps = forward_maps(spec, self.map_problem, q, k, v)
                self.maps = ((q.data.ptr, k.data.ptr, v.data.ptr), maps)
            args += (maps,)
            if spec.tma_store:
                ptr, out_map = self.out_map
                if ptr != out.data.ptr:
                    from .tma import output_map
                    out_map = output_map(self.problem, out, self.out_strides, spec.out_dtype)
                    self.out_map = (out.data.ptr, out_map)
                args += (out_map,)
        self.kernel(self.grid, self.block, args + self.mods, shared_mem=self.smem)

    def driver_ready(self) -> bool:
        """Whether :meth:`launch_pointers` may be called: the plan launched once through CuPy (on
        its device: the kernel is loaded and its shared-memory limit set) and launches through the
        driver from now on."""
        if self._driver is None and self._launched:
            self._driver = self._prepare_driver()
        return bool(self._driver)

    def launch_pointers(self, q: int, k: int, v: int, out: int, lse: int, stream: int) -> None:
        """Launch on ``stream`` (a CUDA stream handle) with the arrays at these device addresses
        (16-byte aligned, shaped and strided as the plan's), once :meth:`driver_ready`; on the
        plan's device, which must be current."""
        self._driver_launch(self._driver, q, k, v, out, lse, stream)

    def _prepare_driver(self):
        """(launch function, kernel handle, grid and block, argument storage): the kernel's
        arguments kept in one host buffer, each 64-byte aligned (a tensor map's alignment), and the
        void* array cuLaunchKernel reads them through; False where the driver path does not apply
        (FP8: v's map reads its strides; a kernel that is not a loaded CuPy kernel); None, to try
        again later, off the plan's device (CuPy's kernel is the current device's)."""
        if not DRIVER_LAUNCH or self.spec.fp8:
            return False
        if not hasattr(type(self.kernel), "kernel"):  # not a CuPy kernel (a stand-in)
            return False
        try:
            import cupy
            from cupy.cuda import driver
            if cupy.cuda.runtime.getDevice() != self.problem.device_id:
                return None
            launch_kernel, handle = driver.launchKernel, int(self.kernel.kernel.ptr)
        except (ImportError, AttributeError, TypeError):
            return False
        from . import tma
        spec = self.spec
        sizes = [len(self.template)]
        if spec.warp_specialized:
            sizes.append(3 * tma.MAP_BYTES)
            if spec.tma_store:
                sizes.append(tma.MAP_BYTES)
        trailing = [m.tobytes() for m in self.mods]  # the mods (or VarlenArgs and the mods), in order
        sizes += [len(m) for m in trailing]
        storage = DriverArguments(sizes)
        storage.write(0, self.template)
        for i, raw in enumerate(trailing):
            storage.write(len(sizes) - len(trailing) + i, raw)
        gx, gy, gz = (tuple(self.grid) + (1, 1))[:3]
        maps = (storage.addresses[1], storage.addresses[2] if spec.tma_store else 0) if spec.warp_specialized else None
        # the pointers (q, k, v, out) the maps in storage were encoded for: none yet
        mapped = [(None, None, None, None)]
        return (launch_kernel, handle, max(gx, 1), max(gy, 1), max(gz, 1), self.block[0], self.smem, storage.buffer,
                storage.shift, storage.argv_address, storage, maps, mapped, threading.Lock(), driver.CUDADriverError)

    def _driver_launch(self, driver, q, k, v, out, lse, stream) -> None:
        launch_kernel, handle, gx, gy, gz, threads, smem, storage, shift, argv, _, maps, mapped, lock, error = driver
        if stream is None:
            import cupy
            stream = cupy.cuda.get_current_stream().ptr
        with lock:  # the storage is shared by every thread that launches this plan
            _POINTERS.pack_into(storage, shift, q, k, v, out, lse)
            if maps is not None:
                was = mapped[0]
                if was[0] != q or was[1] != k or was[2] != v or was[3] != out:
                    self._write_maps(maps, mapped, q, k, v, out)
            try:
                launch_kernel(handle, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)
            except error as exc:
                bind_context(exc)
                launch_kernel(handle, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)

    def _write_maps(self, maps, mapped, q, k, v, out) -> None:
        """Encode the tensor maps into the storage where the arrays moved (the caller holds the lock)."""
        from . import tma
        spec = self.spec
        was = mapped[0]
        if was[:3] != (q, k, v):
            size = self.map_problem.dtype.itemsize
            raw = tma.forward_maps(spec, self.map_problem, _Address(q, size), _Address(k, size),
                                   _Address(v, size)).tobytes()
            ctypes.memmove(maps[0], raw, len(raw))
        if maps[1] and was[3] != out:
            raw = tma.output_map(self.problem, _Address(out, self.problem.dtype.itemsize), self.out_strides,
                                 spec.out_dtype).tobytes()
            ctypes.memmove(maps[1], raw, len(raw))
        mapped[0] = (q, k, v, out)


def outputs_unused(entry: tuple, out_shape: tuple, lse_shape: tuple | None) -> bool:
    """Whether a plan's last (out, lse) = ``entry`` can be handed out again: nothing but ``entry``
    refers to the arrays, their memory pointers or the allocation (no view, pointer or exported
    handle), so the memory is as free as CuPy's pool would make it on the same stream, and the
    shapes are as allocated. ``lse_shape``: the LSE is part of the entry (else the stream's
    scratch). The caller holds ``entry`` in one local name."""
    if _GIL and getrefcount(entry[0]) == 2 and getrefcount(entry[0].data) == 2 and entry[0].shape == out_shape:
        if lse_shape is None:
            return getrefcount(entry[0].data.mem) == 2
        return (getrefcount(entry[0].data.mem) == 3 and getrefcount(entry[1]) == 2
                and getrefcount(entry[1].data) == 2 and entry[1].shape == lse_shape)
    return False


# Reference counts tell whether an output is still used only where the interpreter has a GIL.
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()


#: Launch a plan's repeated calls straight through the driver (cuLaunchKernel on argument storage
#: the plan keeps); False: every launch through CuPy's kernel call (for comparisons).
DRIVER_LAUNCH = True
_CUDA_ERROR_INVALID_CONTEXT = 201


class DriverArguments:
    """Kernel arguments kept in host memory for cuLaunchKernel: one buffer holding each argument
    64-byte aligned (a tensor map's alignment), and the void* array of their addresses."""

    __slots__ = ("buffer", "shift", "addresses", "argv", "argv_address")

    def __init__(self, sizes):
        offsets, end = [], 0
        for size in sizes:
            offsets.append(end)
            end += -(-size // 64) * 64
        self.buffer = ctypes.create_string_buffer(end + 64)
        base = -(-ctypes.addressof(self.buffer) // 64) * 64
        self.shift = base - ctypes.addressof(self.buffer)  # where the first argument starts in the buffer
        self.addresses = tuple(base + off for off in offsets)
        self.argv = (ctypes.c_void_p * len(sizes))(*self.addresses)
        self.argv_address = ctypes.addressof(self.argv)

    def write(self, index: int, raw: bytes) -> None:
        ctypes.memmove(self.addresses[index], raw, len(raw))


def bind_context(exc) -> None:
    """After a failed driver launch: where the thread had no CUDA context (its first CUDA call),
    let the runtime bind the current device's, for the launch to be tried again; else raise."""
    if getattr(exc, "status", None) != _CUDA_ERROR_INVALID_CONTEXT:
        raise exc
    import cupy
    cupy.cuda.runtime.memGetInfo()


class _Address:
    """An array as the tensor maps' encoders read one: its address (``x.data.ptr``) and element size."""

    __slots__ = ("data", "ptr", "itemsize")

    def __init__(self, ptr: int, itemsize: int):
        self.data, self.ptr, self.itemsize = self, ptr, itemsize


_lse_scratch: dict = {}
_retired_scratch: list = []


def lse_scratch(problem: Problem, stream: int):
    """A float32 buffer for the LSE of ``problem``'s calls that do not return it (the forward
    kernels only write it), per device and stream, kept for the process: a CUDA graph that
    captured a launch keeps pointing at it. A bigger need takes a new one and keeps the old."""
    import cupy

    floats = max(problem.batch * problem.heads * problem.seqlen_q, 1)
    key = (problem.device_id, stream)
    buf = _lse_scratch.get(key)
    if buf is None or buf.size < floats:
        if buf is not None:
            _retired_scratch.append(buf)
        buf = _lse_scratch[key] = cupy.empty(1 << (floats - 1).bit_length(), dtype=cupy.float32)
    return buf


def _struct_args(raw: bytes) -> tuple:
    """A kernel's trailing struct argument (mods, VarlenArgs) as CuPy passes one by value: a
    one-element void array; none for no bytes."""
    return (np.frombuffer(raw, dtype=np.dtype((np.void, len(raw)))),) if raw else ()


#: The five array pointers that open the forward's parameter block (q, k, v, o, lse).
_POINTERS = struct.Struct("<5Q")


# -- backward -----------------------------------------------------------------------------------------
_AUX_THREADS = 256  # kRowsPerAuxBlock warps (bwd_common.cuh)
_AUX_ROWS = 32  # query rows per block of the preprocess and the dQ conversion: kAuxRowsPerWarp per warp


def rows_padded(spec: BwdSpec, seqlen_q: int) -> int:
    """seqlen_q rounded up to whole query tiles of both main kernels (lse2/delta/dq_accum rows)."""
    unit = max(spec.block_m, spec.dq_tiles[0])
    return ceil_div(max(seqlen_q, 1), unit) * unit


def launch_backward(kernels, spec: BwdSpec, bp, tensors: dict, strides: dict, mods: bytes = b"", padded: int = 0,
                    varlen: tuple | None = None, window=(-1, -1)) -> None:
    """Preprocess, the K/V-outer kernel, then the dQ kernel (or the accumulator's conversion), on
    the current CuPy stream. ``tensors`` maps each pointer field of BWD_PARAM_FIELDS to an array
    (dq_accum may be a placeholder when dQ is not accumulated; dq_sem, int32, one per query tile of
    each (batch, head), is needed for spec.ordered_dq only); ``strides`` maps q, k, v, o, do,
    dq, dk, dv to (batch, head, row) element strides; ``mods``: the packed arrays of the spec's
    mods, the last argument of the kernels that recompute the scores. ``padded``: the rows per head
    of lse2, delta and dq_accum when not rows_padded. ``varlen`` (spec.varlen): (VarlenArgs bytes,
    sequences, longest sequence's keys, longest sequence's queries): bp describes all packed rows
    as one sequence, which the preprocess walks; the K/V-outer grid is (key tiles, kv heads,
    sequences) and the dQ conversion's (rows of the longest sequence, heads, sequences).
    ``window``: (left, right) of spec.local."""
    problem = bp.forward
    padded = padded or rows_padded(spec, problem.seqlen_q)
    pointers = [tensors[name].data.ptr for name in
                ("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv", "dq_accum", "lse2", "delta")]
    pointers.append(tensors["dq_sem"].data.ptr if "dq_sem" in tensors else 0)  # spec.ordered_dq only
    raw = _BWD_STRUCT.pack(
        *pointers,
        *(s for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv") for s in strides[t]),
        problem.heads, problem.heads // max(problem.heads_k, 1), problem.seqlen_q, problem.seqlen_k,
        padded, problem.scale, problem.scale * _LOG2E,
        *(_window_bounds(window, problem) if spec.local else (-1, -1)), 0,
    )
    params = (np.frombuffer(raw, dtype=_BWD_PARAMS),)
    pre, dkdv, dq = kernels
    mods_args = _struct_args(mods)
    scored = params + mods_args
    pre((ceil_div(padded, _AUX_ROWS), problem.heads, problem.batch), (_AUX_THREADS, 1, 1), params)
    keys, blocks_z, dkdv_args, dq_args = problem.seqlen_k, problem.batch, scored, params
    maps = ()
    if spec.tma_loads:  # the tensor maps between the parameters and the mods (or the offsets)
        from .tma import backward_maps
        maps = (backward_maps(spec, bp, tensors["q"], tensors["k"], tensors["v"], tensors["dout"]),)
        dkdv_args = params + maps + mods_args
    rows = problem.seqlen_q
    if varlen is not None:  # (key tiles of the longest sequence, kv heads, sequences), the offsets last
        tail, blocks_z, keys, rows = varlen
        dkdv_args = params + maps + _struct_args(tail) + mods_args
        dq_args = params + _struct_args(tail)
    dkdv((ceil_div(keys, spec.block_n), problem.heads_k, blocks_z), (spec.threads, 1, 1), dkdv_args,
         shared_mem=spec.smem_bytes)
    if spec.accum_dq:
        dq((ceil_div(max(rows, 1), _AUX_ROWS), problem.heads, blocks_z), (_AUX_THREADS, 1, 1), dq_args)
    else:
        dq((ceil_div(problem.seqlen_q, spec.dq_tiles[0]), problem.heads, problem.batch),
           (32 * spec.dq_warps, 1, 1), scored, shared_mem=spec.dq_smem_bytes)
