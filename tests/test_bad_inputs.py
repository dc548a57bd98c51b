"""Inputs refused on the host with the error that names them (no GPU): a missing cache length,
launches past the grid's limits, numbers that float32 cannot hold, non-arrays where arrays go;
and NumPy numbers beside traced values in a mod, which are taken as Python numbers."""
import numpy as np
import pytest

import cuflash
import cuflash.mods as mods
from cuflash import reference
from cuflash.core.validate import FLOAT32_MAX, validate_softcap


def test_a_kvcache_call_without_cache_lengths_is_refused():
    q = np.zeros((1, 1, 2, 64), np.float16)
    with pytest.raises(TypeError, match="cache_seqlens must be an int32 CuPy array"):
        cuflash.attention_with_kvcache(q, q, q, cache_seqlens=None)


def test_the_one_launch_varlen_backward_takes_at_most_a_grids_sequences():
    from cuflash import varlen

    assert varlen._too_many(np.zeros(65536, np.int32)) == ""
    assert "at most 65535 sequences, cu_seqlens_q holds 65536" in varlen._too_many(np.zeros(65537, np.int32))


@pytest.mark.parametrize("value", [float("inf"), 1e39, -1.0, 0.0, True, "1"])
def test_softcaps_float32_cannot_hold_are_refused(value):
    with pytest.raises(TypeError if isinstance(value, (bool, str)) else ValueError, match="cap"):
        mods.softcap(value)
    if value not in (0.0,):  # 0 is no cap for validate_softcap
        with pytest.raises(ValueError, match="softcap="):
            validate_softcap(value)
    assert validate_softcap(FLOAT32_MAX) == FLOAT32_MAX


def test_a_numpy_cap_gives_the_python_numbers_graph():
    assert mods.trace_score_mod(mods.softcap(np.float32(2.0))).digest == mods.trace_score_mod(mods.softcap(2.0)).digest


def test_numpy_numbers_beside_traced_values_are_python_numbers():
    left = mods.trace_score_mod(lambda s, b, h, q_idx, kv_idx: np.float32(0.5) * s + np.int32(3) - q_idx)
    right = mods.trace_score_mod(lambda s, b, h, q_idx, kv_idx: 0.5 * s + 3 - q_idx)
    assert left.digest == right.digest
    mask = mods.trace_mask_mod(lambda b, h, q_idx, kv_idx: np.bool_(True) & (np.int32(3) < q_idx))
    assert mask.digest == mods.trace_mask_mod(lambda b, h, q_idx, kv_idx: True & (3 < q_idx)).digest
    with pytest.raises(TypeError, match="numpy.exp got a traced value"):
        mods.trace_score_mod(lambda s, b, h, q_idx, kv_idx: np.exp(s))
    with pytest.raises(TypeError, match="numpy.multiply got a traced value"):
        mods.trace_score_mod(lambda s, b, h, q_idx, kv_idx: np.multiply(np.ones(3), s))


def test_merge_states_names_what_is_not_an_array():
    out = np.zeros((1, 2, 3, 8), np.float32)
    lse = np.zeros((1, 2, 3), np.float32)
    with pytest.raises(TypeError, match=r"outs\[1\] must be a NumPy or CuPy array, got NoneType"):
        cuflash.merge_states([out, None], [lse, lse])
    with pytest.raises(TypeError, match=r"lses\[1\] must be a NumPy or CuPy array"):
        cuflash.merge_states([out, out], [lse, None])
    with pytest.raises(TypeError, match="sequences of arrays"):
        cuflash.merge_states([out, out], "ab")


def test_the_varlen_backward_names_what_is_not_an_array():
    q = np.zeros((10, 2, 8))
    lse = np.zeros((2, 10))
    cu = np.array([0, 4, 10], np.int32)
    with pytest.raises(TypeError, match="dout must be a CuPy or NumPy array, got NoneType"):
        cuflash.attention_varlen_backward(None, q, q, q, q, lse, cu, cu)
    with pytest.raises(TypeError, match="q must be a CuPy or NumPy array, got list"):
        cuflash.attention_varlen_backward(q, [1.0], q, q, q, lse, cu, cu)
    with pytest.raises(ValueError, match="must be 3-d"):
        cuflash.attention_varlen_backward(q, q[0], q, q, q, lse, cu, cu)


@pytest.mark.parametrize("change,error,match", [
    (dict(q=np.ones((1, 2, 3, 4), np.int32)), TypeError, "q.dtype=int32 is not a float dtype"),
    (dict(k=np.ones((1, 2, 3, 4), np.uint8)), TypeError, "k.dtype=uint8 is not a float dtype"),
    (dict(scale=float("nan")), ValueError, "scale=nan must be finite"),
    (dict(scale="0.1"), TypeError, "scale must be a real number"),
    (dict(scale=True), TypeError, "scale must be a real number"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(q=np.ones((1, 2, 3, 0)), k=np.ones((1, 2, 3, 0)), v=np.ones((1, 2, 3, 0))), ValueError, "head_dim"),
])
def test_the_reference_refuses_what_the_kernels_refuse(change, error, match):
    args = dict(q=np.ones((1, 2, 3, 4)), k=np.ones((1, 2, 3, 4)), v=np.ones((1, 2, 3, 4)))
    args.update(change)
    with pytest.raises(error, match=match):
        reference.attention_reference(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_plan_keys_leave_loose_flags_and_unhashable_values_to_the_full_path(monkeypatch):
    cupy = pytest.importorskip("cupy")
    import ml_dtypes

    import fake_device
    from cuflash import kvcache, varlen

    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *a: type("S", (), {"ptr": 0x5000})())
    bf16 = np.dtype(ml_dtypes.bfloat16)
    q = fake_device.fake_array(cupy, (2, 1, 8, 128), bf16, 0x1000_0000)
    cache = fake_device.fake_array(cupy, (2, 64, 2, 128), bf16, 0x2000_0000)
    lens = fake_device.fake_array(cupy, (2,), np.int32, 0x900)
    args = dict(k_new=None, v_new=None, page_table=None, causal=True, scale=None, num_splits=None, fp8_format=None,
                k_descale=None, v_descale=None, window_size=(-1, -1), softcap=0.0, sinks=None)

    def key(**change):
        return kvcache._plan_key(cupy, q, cache, cache, lens, **dict(args, **change))

    assert key() is not None and key(causal=1) is None and key(scale=[1.0]) is None and key(num_splits=[2]) is None
    packed = fake_device.fake_array(cupy, (100, 8, 128), bf16, 0x3000_0000)
    cu = fake_device.fake_array(cupy, (3,), np.int32, 0xA00)
    assert varlen._plan_key(cupy, packed, packed, packed, cu, cu, 60, True, None, (-1, -1), 0.0, None) is not None
    assert varlen._plan_key(cupy, packed, packed, packed, cu, cu, 60, 1, None, (-1, -1), 0.0, None) is None


@pytest.mark.parametrize("mod", [lambda s, b, h, q_idx, kv_idx: s + q_idx // 0,
                                 lambda s, b, h, q_idx, kv_idx: s + (kv_idx % 0)])
def test_integer_division_by_a_zero_constant_is_named_where_it_is_written(mod):
    with pytest.raises(ValueError, match="by zero in a mod"):
        mods.trace_score_mod(mod)


def test_empty_caches_are_named_and_empty_queries_launch_nothing(monkeypatch):
    cupy = pytest.importorskip("cupy")
    import fake_device

    kernel, driver = fake_device.install(monkeypatch, cupy)
    try:
        q = fake_device.fake_array(cupy, (2, 1, 8, 128), np.float16, 0x1000_0000)
        cache = fake_device.fake_array(cupy, (2, 16, 2, 128), np.float16, 0x2000_0000)
        lens = fake_device.fake_array(cupy, (2,), np.int32, 0x900)
        call = cuflash.attention_with_kvcache
        with pytest.raises(ValueError, match=r"\(2, 0, 2, 128\) are empty"):
            call(q, cache[:, :0], cache[:, :0], cache_seqlens=lens)
        with pytest.raises(ValueError, match=r"page_table \(2, 0\) holds no pages"):
            call(q, cache, cache, cache_seqlens=lens, page_table=fake_device.fake_array(cupy, (2, 0), np.int32, 0xA00))
        with pytest.raises(ValueError, match="no query rows: k_new and v_new"):
            new = fake_device.fake_array(cupy, (2, 1, 2, 128), np.float16, 0x3000_0000)
            call(q[:, :0], cache, cache, cache_seqlens=lens, k_new=new, v_new=new)
        out, lse = call(q[:, :, :0], cache, cache, cache_seqlens=lens, return_lse=True)
        assert out.shape == (2, 1, 0, 128) and lse.shape == (2, 0, 1)
        assert not kernel.calls and not driver.launches
    finally:
        fake_device.uninstall(cupy)


def test_a_window_may_be_a_numpy_pair_of_integers():
    q = np.random.default_rng(0).standard_normal((1, 2, 8, 16))
    as_array = reference.attention_reference(q, q, q, window_size=np.array([2, 0]))
    as_tuple = reference.attention_reference(q, q, q, window_size=(2, 0))
    assert all(np.array_equal(a, b) for a, b in zip(as_array, as_tuple))
    with pytest.raises(TypeError, match=r"window_size must be a pair of ints .* got array\(\[2\., 0\.\]\)"):
        reference.attention_reference(q, q, q, window_size=np.array([2.0, 0.0]))


def test_cache_batch_idx_is_a_page_table_of_one_page_per_sequence(monkeypatch):
    cupy = pytest.importorskip("cupy")
    import fake_device
    from cuflash import kvcache

    seen = {}
    monkeypatch.setattr(kvcache, "_full_call", lambda cupy, key, q, kc, vc, lens, kn, vn, table, *rest, **kw:
                        seen.setdefault("table", table))
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *a: type("S", (), {"ptr": 0x5000})())
    q = fake_device.fake_array(cupy, (3, 1, 8, 64), np.float16, 0x1000_0000)
    cache = fake_device.fake_array(cupy, (5, 128, 2, 64), np.float16, 0x2000_0000)
    lens = fake_device.fake_array(cupy, (3,), np.int32, 0x900)
    rows = fake_device.fake_array(cupy, (3,), np.int32, 0xA00)
    cuflash.attention_with_kvcache(q, cache, cache, cache_seqlens=lens, cache_batch_idx=rows)
    assert seen["table"].shape == (3, 1) and seen["table"].data.ptr == 0xA00 and seen["table"].strides == (4, 4)
    with pytest.raises(ValueError, match="cache_batch_idx or page_table, not both"):
        cuflash.attention_with_kvcache(q, cache, cache, cache_seqlens=lens, cache_batch_idx=rows,
                                       page_table=rows.reshape(3, 1))
    with pytest.raises(TypeError, match="cache_batch_idx must be an int32 CuPy array"):
        cuflash.attention_with_kvcache(q, cache, cache, cache_seqlens=lens, cache_batch_idx=np.arange(3))
