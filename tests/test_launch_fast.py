"""Repeated forward calls on CPU stand-ins (tests/fake_device.py, no GPU): a plan's first launch
goes through CuPy's kernel call, later ones through the driver on argument storage the plan
keeps; the storage holds pack_params' block for each call's pointers and the tensor maps of its
arrays; outputs come from one allocation (or the stream's LSE scratch); anything the plan does
not cover takes the full path."""
import struct
import threading

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")

import cuflash  # noqa: E402
from cuflash import forward  # noqa: E402
from cuflash.core import launch  # noqa: E402
from cuflash.core.params import FORWARD_STRUCT  # noqa: E402

import fake_device  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPE = (2, 4, 100, 64)


@pytest.fixture
def device(monkeypatch, request):
    arch = getattr(request, "param", "sm90a")
    driver = fake_device.FakeDriver(sizes=None)
    kernel, driver = fake_device.install(monkeypatch, cupy, arch=arch, driver=driver)
    forward._default.cache_clear()
    launch._lse_scratch.clear()
    yield kernel, driver
    fake_device.uninstall(cupy)
    forward._default.cache_clear()
    launch._lse_scratch.clear()


def _inputs(base=0x1000_0000, shape=SHAPE, dtype=BF16):
    return tuple(fake_device.fake_array(cupy, shape, dtype, base + i * 0x100_0000) for i in range(3))


def _sizes(plan):
    sizes = [FORWARD_STRUCT.size]
    if plan.spec.warp_specialized:
        sizes.append(384)
        if plan.spec.tma_store:
            sizes.append(128)
    return sizes


def _expected_block(plan, q, k, v, out, lse):
    """pack_params' block for these pointers: the plan's template with the five pointers replaced."""
    return launch._POINTERS.pack(q, k, v, out, lse) + plan.template[launch._POINTERS.size:]


@pytest.mark.parametrize("device", ["sm90a", "sm80"], indirect=True)
def test_the_first_launch_through_cupy_then_the_driver_with_pack_params_block(device):
    kernel, driver = device
    q, k, v = _inputs()
    out0, _ = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert len(kernel.calls) == 1 and not driver.launches
    plan = next(iter(forward._plans.values()))
    driver.sizes = _sizes(plan)
    for base in (0x1000_0000, 0x2000_0000, 0x2000_0000):
        q, k, v = _inputs(base)
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        (f, grid, block, smem, stream), args = driver.launches[-1]
        assert f == kernel.kernel.ptr and stream == 0x5000 and smem == plan.spec.smem_bytes
        assert grid == (tuple(plan.grid) + (1, 1))[:3] and block == (plan.spec.threads, 1, 1)
        assert args[0] == _expected_block(plan, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr)
        # the same block the CuPy launch of the full path passes
        assert args[0] == launch.pack_params(plan.problem, q, k, v, out, lse, plan.out_strides,
                                             *_block_extras(plan)).tobytes()
        if plan.spec.warp_specialized:
            assert args[1] == np.array([q.data.ptr, k.data.ptr, v.data.ptr] * 16, dtype="<u8").tobytes()
            if plan.spec.tma_store:
                assert args[2] == np.array([out.data.ptr] * 16, dtype="<u8").tobytes()
        assert out.shape == out0.shape and out.dtype == BF16 and lse.shape == SHAPE[:3]
    assert len(kernel.calls) == 1 and len(driver.launches) == 3


def _block_extras(plan):
    """pack_params' arguments past the arrays, read back from the plan's template."""
    fields = np.frombuffer(plan.template, dtype=np.dtype([(n, "<" + f) for n, _, f in
                                                           __import__("cuflash.core.params", fromlist=["x"])
                                                           .PARAM_FIELDS]))[0]
    spec, problem = plan.spec, plan.problem
    if not spec.warp_specialized:
        return ()
    split = launch.split_plan(spec, problem)
    return (int(fields["tile_counter"]), None, split, (int(fields["split_ws"]), int(fields["split_flags"])),
            -(-problem.seqlen_q // spec.block_m), launch.band_heads(spec, problem))


def test_maps_are_encoded_again_only_when_the_arrays_move(device, monkeypatch):
    from cuflash.core import tma
    kernel, driver = device
    encoded = []
    forward_maps, output_map = tma.forward_maps, tma.output_map
    monkeypatch.setattr(tma, "forward_maps", lambda spec, p, q, k, v: encoded.append("qkv") or
                        forward_maps(spec, p, q, k, v))
    monkeypatch.setattr(tma, "output_map", lambda p, out, s, t: encoded.append("o") or output_map(p, out, s, t))
    q, k, v = _inputs()
    cuflash.attention(q, k, v)
    plan = next(iter(forward._plans.values()))
    assert plan.spec.warp_specialized and plan.spec.tma_store
    encoded.clear()
    for _ in range(3):
        cuflash.attention(q, k, v)  # the pool hands the output the same address each time
    assert encoded == ["qkv", "o"]  # the storage's first fill
    cuflash.attention(*_inputs(0x3000_0000))
    assert encoded == ["qkv", "o", "qkv"]
    held = cuflash.attention(q, k, v)
    other = cuflash.attention(q, k, v)  # a new output address: its map only
    assert held.data.ptr != other.data.ptr
    assert encoded == ["qkv", "o", "qkv", "qkv", "o"]


def test_outputs_share_one_allocation_and_an_unreturned_lse_is_the_streams_scratch(device):
    kernel, driver = device
    q, k, v = _inputs()
    cuflash.attention(q, k, v)
    plan = next(iter(forward._plans.values()))
    driver.sizes = _sizes(plan)
    out = cuflash.attention(q, k, v)
    scratch = plan.lse_scratch
    assert scratch is launch._lse_scratch[(0, 0x5000)] and scratch.size >= 2 * 4 * 100
    assert driver.launches[-1][1][0][32:40] == np.uint64(scratch.data.ptr).tobytes()
    assert driver.launches[-1][1][0][24:32] == np.uint64(out.data.ptr).tobytes()
    cuflash.attention(q, k, v, return_lse=True)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    assert out.data.mem is lse.data.mem
    assert lse.data.ptr - out.data.ptr == -(-out.nbytes // 256) * 256
    assert lse.dtype == np.float32 and lse.shape == (2, 4, 100) and lse.flags.c_contiguous
    assert out.flags.c_contiguous and out.shape == SHAPE
    assert driver.launches[-1][1][0][32:40] == np.uint64(lse.data.ptr).tobytes()


def test_a_bigger_problem_takes_a_bigger_scratch_and_keeps_the_old():
    from types import SimpleNamespace

    calls = []
    with pytest.MonkeyPatch.context() as mp:
        fake_device.install(mp, cupy)
        launch._lse_scratch.clear()
        launch._retired_scratch.clear()
        small = SimpleNamespace(batch=1, heads=2, seqlen_q=100, device_id=0)
        big = SimpleNamespace(batch=1, heads=2, seqlen_q=1000, device_id=0)
        a = launch.lse_scratch(small, 7)
        assert launch.lse_scratch(small, 7) is a and a.size == 256
        b = launch.lse_scratch(big, 7)
        assert b.size == 2048 and launch._retired_scratch == [a] and launch.lse_scratch(small, 7) is b
        assert launch.lse_scratch(small, 8) is not b  # another stream
        calls.append(1)
        launch._lse_scratch.clear()
        launch._retired_scratch.clear()
        fake_device.uninstall(cupy)
    assert calls


def test_misses_take_the_full_path(device, monkeypatch):
    kernel, driver = device
    q, k, v = _inputs()
    cuflash.attention(q, k, v)
    cuflash.attention(q, k, v)
    assert len(forward._plans) == 1 and len(kernel.calls) == 1 and len(driver.launches) == 1
    # another shape: a plan of its own, launched through CuPy first
    q2, k2, v2 = _inputs(shape=(1, 4, 64, 64))
    cuflash.attention(q2, k2, v2)
    assert len(forward._plans) == 2 and len(kernel.calls) == 2
    # an address off the 16-byte grid: not the plan (the full path copies it)
    copies = []
    monkeypatch.setattr(forward, "aligned_copy", lambda x: copies.append(x) or _inputs(0x5000_0000)[0])
    shifted = fake_device.fake_array(cupy, SHAPE, BF16, 0x1000_0002)
    cuflash.attention(shifted, k, v)
    assert len(copies) == 1 and len(kernel.calls) == 3 and len(driver.launches) == 1
    # bad input still raises
    with pytest.raises(ValueError, match="head_dim"):
        cuflash.attention(q, k[..., :32], v[..., :32])
    with pytest.raises(TypeError, match="scale"):
        cuflash.attention(q, k, v, scale="0.1")
    # another stream: another plan
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *a: type("S", (), {"ptr": 0x6000})())
    cuflash.attention(q, k, v)
    assert len(forward._plans) == 3 and len(kernel.calls) == 4


def test_a_call_computes_its_plan_key_once(device, monkeypatch):
    kernel, driver = device
    keys = []
    plan_key = forward._plan_key
    monkeypatch.setattr(forward, "_plan_key", lambda *args: keys.append(args) or plan_key(*args))
    q, k, v = _inputs()
    cuflash.attention(q, k, v)  # a miss: the plain call's key goes on to the full path
    assert len(keys) == 1 and len(forward._plans) == 1 and len(kernel.calls) == 1
    cuflash.attention(q, k, v)  # a hit
    assert len(keys) == 2 and len(driver.launches) == 1
    out, lse = (cupy.ndarray(SHAPE, BF16), cupy.ndarray(SHAPE[:3], cupy.float32))
    forward._attention(q, k, v, (out, lse), causal=False, scale=None, return_lse=True, layout="bhsd", family=None,
                       spec=None, fp8_format=None, q_descale=None, k_descale=None, v_descale=None, out_dtype=None)
    assert len(keys) == 3  # a caller without the key: the full path computes it


def test_without_driver_launch_every_call_goes_through_cupy(device, monkeypatch):
    kernel, driver = device
    monkeypatch.setattr(launch, "DRIVER_LAUNCH", False)
    q, k, v = _inputs()
    for _ in range(3):
        cuflash.attention(q, k, v)
    assert len(kernel.calls) == 3 and not driver.launches


def test_off_its_device_a_plan_does_not_take_the_driver_yet(device, monkeypatch):
    kernel, driver = device
    q, k, v = _inputs()
    cuflash.attention(q, k, v)
    plan = next(iter(forward._plans.values()))
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 1)
    assert not plan.driver_ready() and plan._driver is None
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    assert plan.driver_ready()


def test_a_thread_without_a_context_binds_one_and_launches_again(device, monkeypatch):
    kernel, driver = device

    class DriverError(Exception):
        def __init__(self, status):
            self.status = status

    monkeypatch.setattr(cupy.cuda.driver, "CUDADriverError", DriverError)
    failures = [201]
    bound = []

    def launch_kernel(*args):
        if failures:
            raise DriverError(failures.pop())
        driver(*args)

    monkeypatch.setattr(cupy.cuda.driver, "launchKernel", launch_kernel)
    monkeypatch.setattr(cupy.cuda.runtime, "memGetInfo", lambda: bound.append(1) or (0, 0))
    q, k, v = _inputs()
    cuflash.attention(q, k, v)
    cuflash.attention(q, k, v)
    assert bound == [1] and len(driver.launches) == 1
    failures.append(700)  # any other error is raised
    with pytest.raises(DriverError):
        cuflash.attention(q, k, v)


def test_threads_sharing_a_plan_each_launch_their_own_pointers(device):
    kernel, _ = device
    q, k, v = _inputs()
    cuflash.attention(q, k, v)
    plan = next(iter(forward._plans.values()))
    assert plan.driver_ready()
    import ctypes
    import time
    seen, bad = [], []

    def launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        block = ctypes.string_at(ctypes.c_void_p.from_address(params).value, 40)
        time.sleep(0)  # let another thread run while this one is inside the launch
        again = ctypes.string_at(ctypes.c_void_p.from_address(params).value, 40)
        ptrs = np.frombuffer(block, dtype="<u8")
        if block != again or not (ptrs == ptrs[0] + np.arange(5) * 16).all():
            bad.append(ptrs)
        seen.append(int(ptrs[0]))

    plan._driver = plan._driver[:0] + (launch_kernel,) + plan._driver[1:]

    def run(base):
        for i in range(200):
            p = base + i * 0x1000
            plan.launch_pointers(p, p + 16, p + 32, p + 48, p + 64, 0)

    threads = [threading.Thread(target=run, args=(0x10_0000_0000 * (t + 1),)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and len(seen) == 800


def test_fp8_and_stand_in_kernels_keep_cupys_launch():
    from types import SimpleNamespace

    from cuflash.core import dtypes
    from cuflash.core.policy import default_spec
    from cuflash.core.validate import Problem

    problem = Problem(dtypes.from_tag("fp16"), batch=1, heads=2, heads_k=2, seqlen_q=64, seqlen_k=64, head_dim=64,
                      causal=False, scale=0.125, layout="bhsd", device_id=0, q_strides=(1, 2, 3),
                      k_strides=(1, 2, 3), v_strides=(1, 2, 3))
    launched = []
    spec = default_spec(64, "fp16", False, "sm80")

    def array(ptr):
        return SimpleNamespace(data=SimpleNamespace(ptr=ptr))

    plan = launch.LaunchPlan(lambda *a, **kw: launched.append(a), spec, problem, *(array(16 * i) for i in range(5)),
                             (1, 2, 3))
    for _ in range(3):
        plan.launch(*(array(16 * i) for i in range(5)))
    assert len(launched) == 3 and plan._driver is False and not plan.driver_ready()


def test_kvcache_plans_launch_their_kernels_on_one_kept_block(monkeypatch):
    from types import SimpleNamespace

    from cuflash.core import kvcache
    from cuflash.core.params import DECODE_STRUCT

    driver = fake_device.FakeDriver(sizes=[DECODE_STRUCT.size])
    monkeypatch.setattr(cupy.cuda.driver, "launchKernel", driver)
    kernels = tuple(fake_device.FakeKernel(ptr) for ptr in (0xA, 0xB, 0xC))  # attend, append, merge
    template = bytes(range(256)) * (DECODE_STRUCT.size // 256) + bytes(DECODE_STRUCT.size % 256)
    run = kvcache._driver_launcher(kernels, 0x99, template)
    plan = SimpleNamespace(problem=SimpleNamespace(seqlen_new=3, heads_k=2, batch=4), grid=(8, 1, 5),
                           spec=SimpleNamespace(threads=256, smem_bytes=70000), splits=5, merge_grid=None)
    pointers = tuple(0x1000 * (i + 1) for i in range(7))
    run(plan, pointers, True)
    want = kvcache._POINTERS.pack(*pointers) + template[kvcache._POINTERS.size:]
    assert [launch_[0] for launch_ in driver.launches] == [
        (0xB, (3, 2, 4), (128, 1, 1), 0, 0x99), (0xA, (8, 1, 5), (256, 1, 1), 70000, 0x99)]
    assert all(args == (want,) for _, args in driver.launches)
    run(plan, pointers, True)  # the launches are made once per plan: the same two again
    assert [launch_[0] for launch_ in driver.launches[2:]] == [launch_[0] for launch_ in driver.launches[:2]]
    del driver.launches[2:]
    plan.problem.seqlen_new, plan.splits = 0, 1  # another plan: no new keys, no splits
    run = kvcache._driver_launcher(kernels, 0x99, template)
    run(plan, pointers[::-1], False)  # no new keys, no rows: nothing to launch
    run(plan, pointers[::-1], True)
    assert len(driver.launches) == 3 and driver.launches[-1][0][0] == 0xA
    assert driver.launches[-1][1][0][:56] == kvcache._POINTERS.pack(*pointers[::-1])
    plan.splits, plan.merge_grid = 5, (8, 12, 1)  # splits merged by the merge kernel, after the attention
    run = kvcache._driver_launcher(kernels, 0x99, template)
    run(plan, pointers, True)
    assert [launch_[0] for launch_ in driver.launches[3:]] == [
        (0xA, (8, 1, 5), (256, 1, 1), 70000, 0x99), (0xC, (8, 12, 1), (256, 1, 1), 0, 0x99)]


@pytest.mark.parametrize("device", ["sm90a"], indirect=True)
def test_an_unhashable_family_is_named_by_the_full_path(device):
    q, k, v = _inputs()
    assert forward._plan_key(cupy, q, k, v, False, None, False, "bhsd", ["wgmma"], None) is None
    with pytest.raises((TypeError, ValueError), match="family"):
        cuflash.attention(q, k, v, family=["wgmma"])


def test_a_grown_split_workspace_keeps_the_one_it_replaces(monkeypatch):
    from types import SimpleNamespace
    made = []
    monkeypatch.setattr(cupy, "empty", lambda n, dtype=None: made.append(SimpleNamespace(size=n)) or made[-1])
    monkeypatch.setattr(cupy, "zeros", lambda n, dtype=None: made.append(SimpleNamespace(size=n)) or made[-1])
    monkeypatch.setattr(launch, "_split_workspaces", {})
    monkeypatch.setattr(launch, "_retired_workspaces", [])
    spec = SimpleNamespace(compute_warpgroups=2, padded_head_dim=128)
    first = launch._split_workspace(spec, SimpleNamespace(shares=3), ("dev", 0))
    assert launch._split_workspace(spec, SimpleNamespace(shares=2), ("dev", 0)) == first  # fits: kept
    grown = launch._split_workspace(spec, SimpleNamespace(shares=9), ("dev", 0))
    assert grown[0] is not first[0] and launch._retired_workspaces == [first]


def test_an_output_nothing_refers_to_any_more_is_handed_out_again(device):
    """A planned call returns its plan's last output again when the caller has dropped it, as
    CuPy's pool would hand out the same memory on the same stream; never while anything (the
    array, a view, a memory pointer, the LSE sharing its allocation) still refers to it."""
    q, k, v = _inputs()
    cuflash.attention(q, k, v)
    first = cuflash.attention(q, k, v)
    ptr, ident = first.data.ptr, id(first)
    del first
    again = cuflash.attention(q, k, v)
    assert id(again) == ident and again.data.ptr == ptr and again.shape == SHAPE
    for hold in (lambda a: a, lambda a: a[0], lambda a: a[:, :, 1:], lambda a: a.reshape(-1), lambda a: a.data,
                 lambda a: a.data + 0, lambda a: a.data.mem, lambda a: a.T):
        kept = hold(again)
        held_ptr = again.data.ptr
        del again
        again = cuflash.attention(q, k, v)
        assert again.data.ptr != held_ptr
        del kept
    # a dropped output whose shape was set in place is not handed out as the plan's shape
    again.shape = (SHAPE[0] * SHAPE[1], SHAPE[2], SHAPE[3])
    del again
    assert cuflash.attention(q, k, v).shape == SHAPE

    cuflash.attention(q, k, v, return_lse=True)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    ptrs = (out.data.ptr, lse.data.ptr)
    del out
    out2, lse2 = cuflash.attention(q, k, v, return_lse=True)  # the LSE still held: a new allocation
    assert out2.data.ptr not in ptrs and out2.data.mem is lse2.data.mem
    ptrs2 = (out2.data.ptr, lse2.data.ptr)
    del out2, lse2, lse
    out3, lse3 = cuflash.attention(q, k, v, return_lse=True)
    assert (out3.data.ptr, lse3.data.ptr) == ptrs2 and lse3.shape == (2, 4, 100)


def test_concurrent_calls_on_one_plan_never_share_an_output(device):
    q, k, v = _inputs()
    cuflash.attention(q, k, v)
    outputs, barrier = [[] for _ in range(4)], threading.Barrier(4)

    def work(mine):
        barrier.wait()
        for _ in range(200):
            mine.append(cuflash.attention(q, k, v))

    threads = [threading.Thread(target=work, args=(mine,)) for mine in outputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ptrs = [o.data.ptr for mine in outputs for o in mine]
    assert len(set(ptrs)) == len(ptrs)


def test_calls_with_sinks_keep_a_plan_per_sinks_array(device):
    """The same float32 sinks array: one plan, its address in every block; another array, another
    plan; a call without sinks, a plan of its own."""
    kernel, driver = device
    q, k, v = _inputs()
    sinks = fake_device.fake_array(cupy, (SHAPE[1],), np.float32, 0x4000_0000)
    cuflash.attention(q, k, v, causal=True, sinks=sinks)
    plan = next(iter(forward._plans.values()))
    assert plan.spec.sinks and len(kernel.calls) == 1
    driver.sizes = _sizes(plan)
    fields = np.dtype([(n, "<" + f) for n, _, f in __import__("cuflash.core.params", fromlist=["x"]).PARAM_FIELDS])
    for _ in range(2):
        out = cuflash.attention(q, k, v, causal=True, sinks=sinks)
        block = np.frombuffer(driver.launches[-1][1][0][:fields.itemsize], dtype=fields)[0]
        assert int(block["sinks"]) == 0x4000_0000 and int(block["o"]) == out.data.ptr
    assert len(kernel.calls) == 1 and len(driver.launches) == 2
    other = fake_device.fake_array(cupy, (SHAPE[1],), np.float32, 0x4100_0000)
    cuflash.attention(q, k, v, causal=True, sinks=other)
    assert len(forward._plans) == 2
    plain = cuflash.attention(q, k, v, causal=True)
    assert plain.shape == q.shape and len(forward._plans) == 3


@pytest.mark.parametrize("device", ["sm90a"], indirect=True)
def test_repeated_varlen_calls_launch_from_their_plan(device, monkeypatch):
    from cuflash import varlen
    from cuflash.core import kvcache as _kv

    kernel, driver = device
    varlen._plans.clear()
    addresses = iter(range(0x3000_0000, 0x4000_0000, 0x10_0000))
    monkeypatch.setattr(_kv, "poisoned_outputs", lambda cupy_, q: (
        fake_device.fake_array(cupy, q.shape, q.dtype, next(addresses)),
        fake_device.fake_array(cupy, (q.shape[1], q.shape[0]), np.float32, next(addresses))))
    q, k, v = _inputs(shape=(300, 4, 64))
    cu, other = (fake_device.fake_array(cupy, (4,), np.int32, base) for base in (0x900, 0xA00))
    call = dict(max_seqlen_q=200, causal=True)
    cuflash.attention_varlen(q, k, v, cu, cu, **call)
    assert len(varlen._plans) == 1 and len(kernel.calls) == 1 and not driver.launches
    out = cuflash.attention_varlen(q, k, v, cu, cu, **call)  # the plan's launch, through the driver
    assert len(varlen._plans) == 1 and len(kernel.calls) == 1 and len(driver.launches) == 1
    assert out.shape == q.shape
    assert struct.unpack("<QQiiii", kernel.calls[0][2][-1]) == (0x900, 0x900, 300, 300, 200, 300)  # VarlenArgs
    for kwargs in (dict(call, max_seqlen_q=150), dict(call, window_size=(64, 0)), dict(call, causal=False)):
        cuflash.attention_varlen(q, k, v, cu, cu, **kwargs)
    cuflash.attention_varlen(q, k, v, other, cu, **call)
    assert len(varlen._plans) == 5 and len(kernel.calls) == 5
    assert varlen._plan_key(cupy, q, k, v, cu, cu, None, True, None, (-1, -1), 0.0, None) is None
    assert varlen._plan_key(cupy, q, k, v, cu, cu, 200, True, None, [-1, -1], 0.0, None) is None

    def bias(score, b, h, q_idx, kv_idx):  # traced once: its graph is kept, and so is the plan
        return score + 0.5 * h

    for _ in range(3):
        cuflash.attention_varlen(q, k, v, cu, cu, score_mod=bias, **call)
    assert len(varlen._plans) == 6 and len(kernel.calls) == 6 and len(driver.launches) == 3
    cuflash.attention_varlen(q, k, v, cu, cu, score_mod=lambda score, b, h, q_idx, kv_idx: score * 2.0, **call)
    assert len(varlen._plans) == 7 and len(kernel.calls) == 7
    varlen._plans.clear()
