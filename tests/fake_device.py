"""A stand-in CUDA device for CPU tests of the host path: CuPy arrays over fake addresses, a
memory "pool" handing out fake addresses, the device queries, kernel loading, tensor maps and
the driver's launch replaced by recorders. Nothing runs on a GPU."""
from __future__ import annotations

import itertools

import numpy as np

from cuflash.core import compile as _compile
from cuflash.core import launch as _launch
from cuflash.core import tma as _tma


class FakeKernel:
    """A loaded kernel: CuPy's launch (``__call__``) and its driver function (``.kernel.ptr``)."""

    def __init__(self, ptr: int = 0xF00D, record: bool = True):
        self.function = type("Function", (), {"ptr": ptr})()
        self.calls = []
        self.record = record

    @property
    def kernel(self):
        return self.function

    def __call__(self, grid, block, args, shared_mem=0, **kwargs):
        if self.record:
            self.calls.append((grid, block, tuple(a.tobytes() if hasattr(a, "tobytes") else a for a in args),
                               shared_mem))


class FakeDriver:
    """cupy.cuda.driver.launchKernel's stand-in: records each launch with its argument bytes, read
    through the void* array as the driver reads them."""

    def __init__(self, sizes=None, record: bool = True):
        self.launches = []
        self.sizes = sizes  # bytes of each kernel argument, by position (None: not read)
        self.record = record

    def __call__(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        if not self.record:
            return
        args = None
        if self.sizes is not None:
            import ctypes
            argv = (ctypes.c_void_p * len(self.sizes)).from_address(params)
            args = tuple(ctypes.string_at(argv[i], n) for i, n in enumerate(self.sizes))
        self.launches.append(((f, (gx, gy, gz), (bx, by, bz), smem, stream), args))


def fake_array(cupy, shape, dtype, ptr: int, strides=None):
    """A CuPy array over a fake device address (never read)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize if shape else dtype.itemsize
    memory = cupy.cuda.UnownedMemory(ptr, max(size, 1), None, 0)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), strides)


def install(mp, cupy, arch: str = "sm90a", kernel=None, driver=None, stream: int = 0x5000):
    """Patch a device in with ``mp`` (a pytest MonkeyPatch); returns (kernel, driver)."""
    from cuflash import forward

    kernel = kernel or FakeKernel()
    driver = driver or FakeDriver()
    addresses = itertools.count(0x7000_0000, 0x10_0000)
    free: dict = {}

    class Block:  # returns its address to the free list when the last array on it goes, as a pool does
        __slots__ = ("ptr", "size")

        def __init__(self, ptr, size):
            self.ptr, self.size = ptr, size

        def __del__(self):
            free.setdefault(self.size, []).append(self.ptr)

    def malloc(size):
        size = max(size, 1)
        spare = free.get(size)
        ptr = spare.pop() if spare else next(addresses)
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, size, Block(ptr, size), 0), 0)

    stream_obj = type("Stream", (), {"ptr": stream})()
    mp.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    mp.setattr(cupy.cuda, "get_current_stream", lambda *a: stream_obj)
    mp.setattr(cupy.cuda.driver, "launchKernel", driver)
    cupy.cuda.set_allocator(malloc)
    mp.setattr(forward, "_arch_of_device", {0: arch})
    mp.setattr(_compile, "get_kernel", lambda spec, device_id: kernel)
    mp.setattr(_launch, "_multiprocessors", lambda device_id: 132)
    mp.setattr(_launch, "_tile_counter", lambda key: fake_array(cupy, (2,), np.int32, 0x600))
    mp.setattr(_tma, "forward_maps", lambda spec, problem, q, k, v: np.frombuffer(
        np.array([q.data.ptr, k.data.ptr, v.data.ptr] * 16, dtype="<u8").tobytes(), dtype=np.dtype((np.void, 384))))
    mp.setattr(_tma, "output_map", lambda problem, out, strides, tag: np.frombuffer(
        np.array([out.data.ptr] * 16, dtype="<u8").tobytes(), dtype=np.dtype((np.void, 128))))
    forward._plans.clear()
    return kernel, driver


def uninstall(cupy):
    """Back to CuPy's default allocator (the patches themselves go with the MonkeyPatch)."""
    from cuflash import forward

    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    forward._plans.clear()
