"""The machine code of the generated kernels uses the instructions each family is built on.

Compiled offline with NVRTC and disassembled with cuobjdump (from the nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels of the ``test`` extra); no GPU needed.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cuflash.core.compile import compile_offline
from cuflash.core.policy import all_default_specs, default_spec
from cuflash.core.spec import KernelSpec


def _tool_dir():
    if shutil.which("cuobjdump") and shutil.which("nvdisasm"):
        return None
    try:
        import nvidia
    except ImportError:
        return False
    for root in nvidia.__path__:
        for bin_dir in sorted(Path(root).glob("cu*/bin")):
            if (bin_dir / "cuobjdump").exists() and (bin_dir / "nvdisasm").exists():
                return bin_dir
    return False


TOOLS = _tool_dir()
pytestmark = pytest.mark.skipif(TOOLS is False, reason="cuobjdump/nvdisasm not installed (test extra)")


def sass(spec, tmp_path) -> str:
    pytest.importorskip("cupy")
    cubin = tmp_path / f"{spec.name}.cubin"
    cubin.write_bytes(compile_offline(spec).cubin)
    env = dict(os.environ)
    if TOOLS:
        env["PATH"] = f"{TOOLS}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(["cuobjdump", "-sass", str(cubin)], env=env, check=True,
                          capture_output=True, text=True).stdout


@pytest.mark.parametrize("spec", [s for s in all_default_specs("sm90a", dtype_tags=["bf16"], causal=(True,), family="wgmma")
                                  if s.head_dim in (64, 80, 96, 128, 192, 200, 256)], ids=lambda s: s.name)
def test_hopper_kernels_use_warpgroup_mma(spec, tmp_path):
    code = sass(spec, tmp_path)
    assert re.search(r"HGMMA\.64x\d+x16\.F32\.BF16", code)
    assert "HMMA" not in code
    if spec.warp_specialized:  # TMA copies, registers moved from the producer to the consumers
        assert "UTMALDG.4D" in code and "LDGSTS" not in code
        assert ("UTMASTG.4D" in code) == spec.tma_store  # the output through TMA stores where it fits
        if not spec.tma_store:  # elsewhere 16 bytes per store (store_output_wide)
            assert "STG.E.128" in code and "SHFL.BFLY" in code
        assert "USETMAXREG.DEALLOC" in code and "USETMAXREG.TRY_ALLOC" in code
    else:
        assert "LDGSTS" in code


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_kernel_uses_fp8_warpgroup_mma(fmt, tmp_path):
    """Both products on FP8 tensor cores (QGMMA, k=32; P as e4m3), V^T by TMA, P packed by F2FP."""
    spec = default_spec(128, fmt, True, "sm90a", out_dtype="bf16")
    code = sass(spec, tmp_path)
    kind = fmt.upper()
    assert re.search(rf"QGMMA\.64x{spec.block_n}x32\.F32\.{kind}\.{kind}", code)
    assert re.search(rf"QGMMA\.64x128x32\.F32\.E4M3\.{kind}", code)
    assert "UTMALDG.4D" in code and "F2FP" in code and "HMMA" not in code
    # without the LSE, P's row sums as P times ones: an n=8 product beside each k-step of P V,
    # where P V is issued: the loops over the diagonal's key tiles and over the others, and the
    # last tile's product after them
    assert spec.causal and not spec.mask_in_loop
    sums = sass(spec.replace(lse=False), tmp_path)
    assert len(re.findall(rf"QGMMA\.64x8x32\.F32\.E4M3\.{kind}", sums)) == 3 * spec.block_n // 32
    assert len(re.findall(r"QGMMA\.64x8x32", code)) == 0


def test_hopper_forward_without_warp_specialization(tmp_path):
    """The cp.async wgmma schedule (no TMA) stays available through an explicit spec."""
    spec = KernelSpec(128, "bf16", True, 128, 128, 8, 2, "sm90a", family="wgmma")
    code = sass(spec, tmp_path)
    assert re.search(r"HGMMA\.64x128x16\.F32\.BF16", code) and "LDGSTS" in code and "UTMALDG" not in code


@pytest.mark.parametrize("arch", ["sm80", "sm90a"])
@pytest.mark.parametrize("head_dim", [64, 72, 128])
def test_portable_kernels_use_mma_sync_ldmatrix_and_cp_async(head_dim, arch, tmp_path):
    code = sass(default_spec(head_dim, "fp16", True, arch, family="mma"), tmp_path)
    assert "HMMA.16816.F32" in code and "LDSM.16.M88.4" in code and "LDSM.16.MT88" in code
    assert "LDGSTS" in code and "HGMMA" not in code


@pytest.mark.parametrize("arch", ["sm80", "sm90a"])
@pytest.mark.parametrize("head_dim,deterministic", [(64, False), (128, True), (256, False)])
def test_backward_kernels_use_mma_sync_ldmatrix_and_cp_async(head_dim, deterministic, arch, tmp_path):
    from cuflash.core.policy import default_bwd_spec
    code = sass(default_bwd_spec(head_dim, "bf16", True, arch, deterministic, family="mma"), tmp_path)
    assert "HMMA.16816.F32.BF16" in code and "LDSM.16.M88.4" in code and "LDSM.16.MT88.4" in code
    assert "LDGSTS" in code
    assert ("RED" in code) != deterministic  # dQ by atomics unless deterministic


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hopper_backward_uses_warpgroup_mma(head_dim, tmp_path):
    from cuflash.core.policy import default_bwd_spec
    spec = default_bwd_spec(head_dim, "bf16", True, "sm90a")
    code = sass(spec, tmp_path)
    # K, V and the query tiles by TMA, lse2 and delta by bulk copies; no cp.async
    assert re.search(r"HGMMA\.64x\d+x16\.F32\.BF16", code) and "UTMALDG.4D" in code and "UBLKCP" in code
    assert spec.tma_loads and "LDGSTS" not in code
    # dQ's partial tiles by bulk reduce-add (above 128 columns from the step's Q and dO tiles)
    assert spec.bulk_dq and spec.double_dq == (head_dim <= 128)
    assert "UBLKRED.G.S.ADD.F32" in code and "REDG.E.ADD.F32" not in code
    # the wgmma descriptors stay on the uniform datapath (fewer moves into it than wgmmas), and
    # the P and dS tiles go to shared memory by stmatrix
    assert code.count("R2UR") < code.count("HGMMA") and "STSM" in code
    if head_dim in (128, 256):  # packed sequences take the bulk add and TMA too (cp.async for views it cannot read)
        varlen = sass(spec.replace(varlen=True), tmp_path)
        assert "UBLKRED.G.S.ADD.F32" in varlen and "UTMALDG.4D" in varlen and "LDGSTS" not in varlen
        varlen = sass(spec.replace(varlen=True, tma_loads=False), tmp_path)
        assert "UBLKRED.G.S.ADD.F32" in varlen and "LDGSTS" in varlen
    # deterministic: the same bulk adds, in turns (an acquire load of the turn counter, a
    # relaxed add to raise it), up to head dim 128
    det = default_bwd_spec(head_dim, "bf16", True, "sm90a", True)
    code = sass(det, tmp_path)
    assert det.ordered_dq == (head_dim <= 128)
    if det.ordered_dq:
        assert re.search(r"HGMMA\.64x\d+x16\.F32\.BF16", code) and "UTMALDG.4D" in code
        assert "UBLKRED.G.S.ADD.F32" in code and "REDG.E.ADD.F32" not in code
        assert "LDG.E.STRONG.GPU" in code and "REDG.E.ADD.S32.STRONG.GPU" in code


@pytest.mark.parametrize("head_dim, dtype", [(64, "fp16"), (96, "bf16"), (128, "bf16"), (256, "fp16")])
def test_backward_preprocess_and_dq_conversion_move_16_byte_words(head_dim, dtype, tmp_path):
    from cuflash.core.policy import default_bwd_spec
    code = sass(default_bwd_spec(head_dim, dtype, False, "sm90a"), tmp_path)
    kernels = dict(re.findall(r"Function : (\S+)\n(.*?)(?=\n\s+Function : |\Z)", code, re.S))
    pre = next(c for name, c in kernels.items() if name.endswith("_pre"))
    conv = next(c for name, c in kernels.items() if name.endswith("_dq"))
    assert "LDG.E.128" in pre and "STG.E.128" in pre  # O and dO read, the accumulator zeroed, in words
    assert "LDG.E.128" in conv and "STG.E.128" in conv  # the accumulator read, dQ written, in words


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_tiles_of_64_rows_use_warpgroup_mma_on_hopper(paged, tmp_path):
    """KV-cache tiles of 64 query rows at head dim 128: wgmma on sm90a (S and P V), mma.sync on sm80."""
    from cuflash.core.policy import decode_spec
    code = sass(decode_spec(128, "bf16", "bf16", paged, 64, "sm90a"), tmp_path)
    assert re.search(r"HGMMA\.64x64x16\.F32\.BF16", code) and re.search(r"HGMMA\.64x128x16\.F32\.BF16", code)
    assert "LDGSTS" in code
    assert "HGMMA" not in sass(decode_spec(128, "bf16", "bf16", paged, 64, "sm80"), tmp_path)
