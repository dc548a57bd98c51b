"""torch tensors as CuPy arrays and back without a copy, and CuPy on torch's device, stream and
(while torch captures a CUDA graph) caching allocator: the ground :mod:`cuflash.torch` stands on."""
from __future__ import annotations

import functools

import torch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_NUMPY_DTYPES: dict = {}


def _numpy_dtype(dtype: torch.dtype):
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    if numpy_dtype is None:
        from .core.dtypes import from_tag
        tag = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype)
        if tag is None:
            raise TypeError(f"dtype={dtype} is not supported; use torch.float16, torch.bfloat16 or torch.float32")
        numpy_dtype = _NUMPY_DTYPES[dtype] = from_tag(tag).numpy
    return numpy_dtype


def _to_cupy(tensor):
    """A CuPy view of a CUDA tensor (no copy): the tensor's memory, shape and strides, kept alive by
    the view; autograd's flags stay on the torch side."""
    import cupy

    dtype = tensor.dtype
    if dtype not in _DTYPES:  # int and bool tensors (masks, indices) go through DLPack
        return cupy.from_dlpack(tensor.detach())
    itemsize = tensor.element_size()
    shape, strides = tuple(tensor.shape), tensor.stride()
    extent = 1
    for n, st in zip(shape, strides):
        if n == 0:
            extent = 0
            break
        extent += (n - 1) * st
    memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), extent * itemsize, tensor, tensor.get_device())
    return cupy.ndarray(shape, _NUMPY_DTYPES.get(dtype) or _numpy_dtype(dtype), cupy.cuda.MemoryPointer(memory, 0),
                        tuple(st * itemsize for st in strides))


def _rows(q: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(batch, heads, seqlen_q) of q in its layout."""
    return (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhsd" else (q.shape[0], q.shape[2], q.shape[1])


def _readable(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim is contiguous (cuflash reads any other strides), else a copy."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _captured(tensor):
    """A tensor a mod captures, as the array cuflash reads: a CuPy view of a CUDA tensor (the
    kernels), a NumPy view of a CPU one (the reference); no copy either way."""
    if tensor.device.type == "cuda":
        return _to_cupy(tensor)
    host = tensor.detach()
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(_numpy_dtype(torch.bfloat16))
    return host.numpy()


def _register_captured_tensors() -> None:
    from .core import trace

    trace.ARRAY_CONVERTERS["torch"] = (_captured, lambda t: (tuple(t.shape), str(t.dtype), tuple(t.stride()),
                                                            t.data_ptr()))


_register_captured_tensors()


def _to_torch(array):
    """A torch view of a CuPy array (DLPack, no copy)."""
    try:
        return torch.from_dlpack(array)
    except Exception:
        import cupy
        if array.dtype.itemsize != 2 or array.dtype.kind in "fiu":
            raise
        return torch.from_dlpack(array.view(cupy.int16)).view(torch.bfloat16)


def _torch_malloc(size: int, device_id: int) -> int:
    return torch.cuda.caching_allocator_alloc(size, device_id, torch.cuda.current_stream(device_id)) if size else 0


def _torch_free(ptr: int, device_id: int) -> None:
    if not ptr:
        return
    try:
        torch.cuda.caching_allocator_delete(ptr)
    except (AttributeError, TypeError):  # at interpreter exit torch may be torn down before CuPy's last frees
        pass


@functools.lru_cache(maxsize=1)
def _allocator():
    """CuPy's allocations through torch's caching allocator (made once)."""
    import cupy
    return cupy.cuda.memory.PythonFunctionAllocator(_torch_malloc, _torch_free).malloc


_streams: dict = {}


def _current_stream_ptr(index: int) -> int:
    try:
        return torch._C._cuda_getCurrentRawStream(index)  # the cheap form of current_stream().cuda_stream
    except AttributeError:
        return torch.cuda.current_stream(index).cuda_stream


class _on_torch_stream:  # noqa: N801 - used as a context manager, like a function
    """CuPy on torch's device and current stream, whose handle ``with`` gives; while torch
    captures a CUDA graph, also on its caching allocator, so that the graph's own memory pool
    holds cuflash's buffers."""

    __slots__ = ("contexts", "stream")

    def __init__(self, device: torch.device):
        import cupy

        index = device.index if device.index is not None else torch.cuda.current_device()
        ptr = _current_stream_ptr(index)
        stream = _streams.get((ptr, index))
        if stream is None:
            if ptr == 0:
                stream = cupy.cuda.Stream.null
            elif hasattr(cupy.cuda.Stream, "from_external"):
                stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream(index))
            else:
                stream = cupy.cuda.ExternalStream(ptr, index)
            if len(_streams) >= 64:
                _streams.clear()
            _streams[(ptr, index)] = stream
        contexts = [stream]
        if cupy.cuda.runtime.getDevice() != index:
            contexts.insert(0, cupy.cuda.Device(index))
        if torch.cuda.is_current_stream_capturing():
            contexts.append(cupy.cuda.using_allocator(_allocator()))
        self.contexts, self.stream = contexts, ptr

    def __enter__(self):
        for context in self.contexts:
            context.__enter__()
        return self.stream

    def __exit__(self, *exc):
        for context in reversed(self.contexts):
            context.__exit__(*exc)
        return False
