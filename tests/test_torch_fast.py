"""cuflash.torch's repeated calls without a GPU: CPU tensors stand in for CUDA ones (their device
index, the current device and stream patched), a recording plan for cuflash's launch plan. A
call the plan covers launches it on the tensors' addresses; a call that needs a gradient, an
address off the 16-byte grid, bad arguments or a first call take the full path."""
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
import cuflash.torch as ct  # noqa: E402

SHAPE = (2, 4, 100, 64)


class RecordingPlan:
    def __init__(self):
        self.launches = []
        self.outputs = (SHAPE, None, 0, SHAPE[:3], 0, None)
        self.lse_scratch = SimpleNamespace(data=SimpleNamespace(ptr=0xABC00))

    def driver_ready(self):
        return True

    def launch_pointers(self, q, k, v, out, lse, stream):
        self.launches.append((q, k, v, out, lse, stream))


@pytest.fixture
def cuda_stand_in(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(ct, "_current_device", lambda: 0)
    monkeypatch.setattr(ct, "_current_stream_ptr", lambda index: 0x77)
    monkeypatch.setattr(ct, "_plans", {})
    full = []

    class Stream:  # gives the current stream's handle, as _on_torch_stream does
        def __init__(self, device):
            self.stream = ct._current_stream_ptr(0)

        def __enter__(self):
            return self.stream

        def __exit__(self, *exc):
            return False

    plan = RecordingPlan()

    def attention(q, k, v, outputs, *, keep, **kwargs):
        full.append(kwargs)
        keep.append(plan)

    monkeypatch.setattr(ct, "_on_torch_stream", Stream)
    monkeypatch.setattr(ct, "_to_cupy", lambda x: x)
    monkeypatch.setattr(ct, "_attention", attention)
    # past the device check of the full path (the tensors are on the CPU)
    monkeypatch.setattr(ct, "_check", lambda q, k, v, layout: None)
    return plan, full


def _inputs(dtype=torch.bfloat16, requires_grad=False):
    return tuple(torch.randn(SHAPE, dtype=dtype, requires_grad=requires_grad) for _ in range(3))


def test_a_repeated_call_launches_its_plan_on_the_tensors_addresses(cuda_stand_in):
    plan, full = cuda_stand_in
    q, k, v = _inputs()
    ct.attention(q, k, v, causal=True)
    assert len(full) == 1 and not plan.launches
    assert full[0]["scale"] == 1.0 / 8 and full[0]["causal"] is True
    out = ct.attention(q, k, v, causal=True)
    assert len(full) == 1 and len(plan.launches) == 1
    assert out.shape == SHAPE and out.dtype == torch.bfloat16 and out.is_contiguous() and not out.requires_grad
    assert plan.launches[-1] == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0xABC00, 0x77)
    out, lse = ct.attention(q, k, v, causal=True, return_lse=True, scale=0.125)  # the same scale, given
    assert lse.shape == SHAPE[:3] and lse.dtype == torch.float32
    assert plan.launches[-1][3:] == (out.data_ptr(), lse.data_ptr(), 0x77)
    # other flags, dtypes, strides or streams: the full path first
    ct.attention(q, k, v, causal=False)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    ct.attention(qt, kt, vt, causal=True, layout="bshd")
    assert len(full) == 3
    out = ct.attention(qt, kt, vt, causal=True, layout="bshd")  # a strided view: a contiguous output
    assert len(full) == 3 and out.shape == qt.shape and out.is_contiguous()


def test_a_call_that_needs_a_gradient_goes_through_autograd(cuda_stand_in):
    plan, full = cuda_stand_in
    q, k, v = _inputs(requires_grad=True)
    out = ct.attention(q, k, v)  # full path, through autograd.Function: its forward keeps the plan
    assert len(full) == 1 and out.requires_grad and out.grad_fn is not None
    out = ct.attention(q, k, v)  # autograd.Function's forward launches the plan
    assert len(full) == 1 and len(plan.launches) == 1 and out.grad_fn is not None
    assert plan.launches[-1][4] != 0xABC00  # the LSE saved for the backward is a tensor of its own
    with torch.no_grad():
        out = ct.attention(q, k, v)
    assert len(plan.launches) == 2 and out.grad_fn is None and plan.launches[-1][4] == 0xABC00


def test_misaligned_addresses_and_bad_arguments_take_the_full_path(cuda_stand_in, monkeypatch):
    plan, full = cuda_stand_in
    q, k, v = _inputs()
    ct.attention(q, k, v)
    base = torch.empty(q.numel() + 8, dtype=q.dtype)
    shifted = base[1:1 + q.numel()].view(SHAPE)
    assert shifted.data_ptr() % 16 and shifted.stride() == q.stride()
    ct.attention(shifted, k, v)
    assert len(full) == 2 and not plan.launches
    with pytest.raises(TypeError, match="deterministic"):
        ct.attention(q, k, v, deterministic="yes")
    with pytest.raises(TypeError, match="scale"):
        ct.attention(q, k, v, scale=True)
    with pytest.raises(TypeError, match="causal"):
        ct.attention(q, k, v, causal=1)
    assert not plan.launches
    monkeypatch.setattr(ct, "_current_stream_ptr", lambda index: 0x88)  # another stream
    ct.attention(q, k, v)
    assert len(full) == 3 and not plan.launches


def test_plans_are_kept_only_on_the_current_device(cuda_stand_in, monkeypatch):
    plan, full = cuda_stand_in
    monkeypatch.setattr(ct, "_current_device", lambda: 1)  # the tensors on device 0, device 1 current
    q, k, v = _inputs()
    ct.attention(q, k, v)
    ct.attention(q, k, v)
    assert len(full) == 2 and not plan.launches and not ct._plans
    assert ct._plan_key(q, k, v, False, 0.125, "bhsd") is None


def test_subclasses_and_cpu_tensors_have_no_key():
    q, k, v = _inputs()
    assert ct._plan_key(q, k, v, False, 0.125, "bhsd") is None  # CPU
    p = torch.nn.Parameter(q)
    assert ct._plan_key(p, k, v, False, 0.125, "bhsd") is None


def test_calls_with_mods_never_take_a_plan_and_keep_their_traced_mods_for_the_backward(cuda_stand_in,
                                                                                      monkeypatch):
    import cuflash.torch_mods as tm

    plan, full = cuda_stand_in
    backward = []
    monkeypatch.setattr(tm, "_attention_backward", lambda *args, **kwargs: backward.append(kwargs))
    q, k, v = _inputs()
    ct.attention(q, k, v, causal=True)
    ct.attention(q, k, v, causal=True)  # planned
    assert len(full) == 1 and len(plan.launches) == 1

    monkeypatch.setattr(tm, "_attention", lambda q, k, v, outputs, **kwargs: full.append(kwargs))
    monkeypatch.setattr(tm, "_on_torch_stream", ct._on_torch_stream)
    monkeypatch.setattr(tm, "_to_cupy", lambda x: x)

    def bias(score, b, h, q_idx, kv_idx):
        return score + 0.5 * h

    out = ct.attention(q, k, v, causal=True, score_mod=bias)
    assert len(full) == 2 and len(plan.launches) == 1
    graph = full[-1]["score_mod"]
    assert graph is not None and full[-1]["mask_mod"] is None and full[-1]["block_mask"] is None
    assert out.shape == SHAPE and not out.requires_grad
    q, k, v = _inputs(requires_grad=True)
    out = ct.attention(q, k, v, causal=True, score_mod=bias, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx < 50)
    assert out.requires_grad and len(full) == 3 and full[-1]["score_mod"] is graph  # traced once, kept
    out.float().sum().backward()
    assert len(backward) == 1 and backward[0]["score_mod"] is graph
    assert backward[0]["mask_mod"] is full[-1]["mask_mod"] and backward[0]["causal"] is True
    assert q.grad is not None and k.grad is not None and v.grad is not None
    # with sinks: given to both passes, their gradient from the backward's fourth result
    sinks = torch.randn(SHAPE[1], requires_grad=True)
    monkeypatch.setattr(tm, "_attention_backward", lambda *args, **kwargs: backward.append(kwargs) or (
        None, None, None, torch.full((SHAPE[1],), 3.0)))
    ct.attention(q, k, v, causal=True, score_mod=bias, sinks=sinks).float().sum().backward()
    assert full[-1]["sinks"] is sinks and full[-1]["key"] is None and backward[-1]["sinks"] is sinks
    assert torch.equal(sinks.grad, torch.full((SHAPE[1],), 3.0))
