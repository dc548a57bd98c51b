"""Every combination of dtype, family, direction, determinism, target and head dim either gives a
specialization or raises ValueError/TypeError naming what is wrong: never a KeyError, never a bare
AttributeError. dtype objects are taken wherever a dtype tag is."""
import itertools

import ml_dtypes
import numpy as np
import pytest

from cuflash.core import dtypes
from cuflash.core.policy import default_bwd_spec, default_spec
from cuflash.tools import cli

DTYPES = ("fp16", "bf16", "fp32", "e4m3", "e5m2", "float16", "bfloat16", np.float16, np.float32,
          ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.dtype("float16"), "int8", np.int32, np.uint8, 3, None)
FAMILIES = (None, "mma", "wgmma", "simt", "tensor")
ARCHS = ("sm80", "sm90a", "sm120", "sm70", "hopper")
HEAD_DIMS = (64, 72, 7, 0, "64")


def _names(value) -> set:
    """How an error message may spell a value."""
    names = {str(value), repr(value)}
    try:
        names.add(dtypes.lookup(value).tag)
    except (TypeError, ValueError):
        pass
    if value is not None:
        try:
            names.add(np.dtype(value).name)
        except TypeError:
            pass
    return names


def _call(backward, head_dim, dtype, arch, family, deterministic):
    if backward:
        return default_bwd_spec(head_dim, dtype, False, arch, deterministic, family)
    return default_spec(head_dim, dtype, False, arch, family)


def test_every_combination_gives_a_spec_or_a_named_error():
    outcomes = {"spec": 0, "error": 0}
    for backward, head_dim, dtype, arch, family, deterministic in itertools.product(
            (False, True), HEAD_DIMS, DTYPES, ARCHS, FAMILIES, (False, True, "yes")):
        try:
            spec = _call(backward, head_dim, dtype, arch, family, deterministic)
        except (ValueError, TypeError) as exc:
            message = str(exc)
            assert message and any(name in message for v in (head_dim, dtype, arch, family, deterministic)
                                   for name in _names(v)), \
                (backward, head_dim, dtype, arch, family, deterministic, message)
            outcomes["error"] += 1
        else:
            assert spec.head_dim == head_dim and spec.arch == arch
            outcomes["spec"] += 1
    assert outcomes["spec"] > 100 and outcomes["error"] > 100


def test_the_backward_of_fp8_names_the_dtype():
    with pytest.raises(ValueError, match="e4m3.*forward only"):
        default_bwd_spec(64, "e4m3", False, "sm90a")
    assert cli.main(["generate", "--head-dim", "64", "--dtype", "e4m3", "--backward"]) == 2


@pytest.mark.parametrize("dtype, tag", [(np.float16, "fp16"), (ml_dtypes.bfloat16, "bf16"), ("float32", "fp32"),
                                        (np.dtype(np.float32), "fp32"), (ml_dtypes.float8_e5m2, "e5m2"),
                                        (dtypes.DTYPES["bf16"], "bf16")])
def test_dtype_objects_are_taken_wherever_a_tag_is(dtype, tag):
    assert default_spec(64, dtype, True, "sm80").dtype == tag
    assert dtypes.lookup(dtype).tag == tag
    if tag not in dtypes.FP8_DTYPES:
        assert default_bwd_spec(64, dtype, True, "sm90a").dtype == tag


def test_unsupported_dtypes_are_named():
    with pytest.raises(TypeError, match="int32"):
        default_spec(64, np.int32, False, "sm80")
    with pytest.raises(ValueError, match="'int8'"):
        default_spec(64, "int8", False, "sm80")
    with pytest.raises(TypeError, match="dtype=None"):
        default_spec(64, None, False, "sm80")
