"""Kernel specializations: every compile-time parameter in one frozen dataclass.

A :class:`KernelSpec` names exactly one generated kernel. Its :attr:`~KernelSpec.name` (for
example ``fwd_bf16_hd128_causal_m128n64w4s2_sm90a``) is the kernel symbol, the generated file
name, part of the cache key and the first word of every error about it. Python computes every
layout constant here (shared-memory strides and offsets, fragment counts, copy iterations); the
templates only fill them in.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from . import dtypes

#: Head dims the kernels specialize for: every multiple of 8 up to 256.
HEAD_DIMS = tuple(range(8, 257, 8))

#: Largest dynamic shared memory one block may opt into, per target (bytes).
SMEM_LIMIT = {
    "sm80": 166912, "sm86": 101376, "sm87": 166912, "sm89": 101376,
    "sm90a": 232448, "sm100": 232448, "sm120": 101376,
}

#: Targets the generated code compiles for (the portable family needs sm_80's mma.sync, ldmatrix
#: and cp.async; sm90a adds wgmma/setmaxnreg for the Hopper family).
ARCHS = tuple(SMEM_LIMIT)

#: Families of kernels. "mma": tensor-core FlashAttention-2 (fp16/bf16, sm_80 and later).
#: "wgmma": Hopper warpgroup MMAs (fp16/bf16, sm_90a). "simt": exact float32 on CUDA cores.
FAMILIES = ("mma", "wgmma", "simt")

_CHUNK = 16  # bytes moved by one cp.async / one ldmatrix row


def arch_from_capability(major: int, minor: int) -> str:
    """Compile target for a device of compute capability ``major.minor``.

    Hopper (9.0) gets the arch-specific ``sm90a`` target so its wgmma/setmaxnreg code compiles.
    """
    if (major, minor) == (9, 0):
        return "sm90a"
    arch = f"sm{major}{minor}"
    if major < 8:
        raise ValueError(f"compute capability {major}.{minor} is not supported; cuflash needs sm_80 or newer")
    return arch


def nvrtc_arch(arch: str) -> str:
    """The NVRTC ``-arch`` value of a target tag (``"sm90a"`` -> ``"sm_90a"``)."""
    return "sm_" + arch[2:]


@dataclass(frozen=True)
class KernelSpec:
    """Every compile-time parameter of one forward kernel."""

    head_dim: int
    dtype: str                # tag from cuflash.dtypes ("fp16", "bf16", "fp32")
    causal: bool
    block_m: int              # query rows per thread block
    block_n: int              # key rows per pipeline stage
    num_warps: int
    num_stages: int           # K/V tiles in flight in the shared-memory ring
    arch: str                 # compile target tag, e.g. "sm80", "sm90a"
    overlap: bool = False     # issue S = Q K^T of the next tile before the softmax of this one
    family: str = ""          # kernel family; "" picks the portable one for the dtype (see FAMILIES)
    warp_specialized: bool = False  # wgmma: a producer warpgroup feeds the ring through mbarriers

    def __post_init__(self):
        if not self.family:
            portable = "mma" if self.dtype in dtypes.DTYPES and dtypes.DTYPES[self.dtype].tensor_core else "simt"
            object.__setattr__(self, "family", portable)
        problems = []
        if self.head_dim not in HEAD_DIMS:
            problems.append(f"head_dim={self.head_dim} (supported: multiples of 8 from 8 to 256)")
        if self.dtype not in dtypes.DTYPES:
            problems.append(f"dtype={self.dtype!r} (supported: {sorted(dtypes.DTYPES)})")
        if self.arch not in SMEM_LIMIT:
            problems.append(f"arch={self.arch!r} (supported: {list(SMEM_LIMIT)})")
        if self.num_warps not in (1, 2, 4, 8, 12, 16):
            problems.append(f"num_warps={self.num_warps} (1, 2, 4, 8, 12 or 16)")
        if self.family not in FAMILIES:
            problems.append(f"family={self.family!r} (one of {FAMILIES})")
        if problems:
            raise ValueError("invalid kernel spec: " + "; ".join(problems))
        if self.family == "wgmma":
            if self.arch != "sm90a" or not dtypes.DTYPES[self.dtype].tensor_core:
                problems.append(f"the wgmma family needs arch sm90a and fp16/bf16 (got {self.arch}, {self.dtype})")
            if self.head_dim % 64:
                problems.append(f"head_dim={self.head_dim} must be a multiple of 64 for wgmma")
            if self.num_warps not in (4, 8, 12) or self.block_m != 64 * self.compute_warpgroups:
                problems.append(f"block_m={self.block_m} must be 64 rows per compute warpgroup of 4 warps "
                                f"(num_warps={self.num_warps}, warp_specialized={self.warp_specialized})")
            if self.block_n % 16 or not 16 <= self.block_n <= 256:
                problems.append(f"block_n={self.block_n} must be a multiple of 16 up to 256")
            if self.num_stages < 2 + self.overlap:
                problems.append(f"num_stages={self.num_stages} must be at least {2 + self.overlap}")
            if self.warp_specialized and self.overlap:
                problems.append("warp_specialized and overlap are separate schedules; pick one")
        elif self.warp_specialized:
            problems.append(f"warp_specialized applies to the wgmma family only (family={self.family!r})")
        elif self.family == "mma":
            if self.block_m % (16 * self.num_warps):
                problems.append(f"block_m={self.block_m} must be a multiple of 16*num_warps={16 * self.num_warps}")
            if self.block_n % 16 or self.block_n <= 0:
                problems.append(f"block_n={self.block_n} must be a positive multiple of 16")
            if self.num_stages < 2 + self.overlap:
                problems.append(f"num_stages={self.num_stages} must be at least {2 + self.overlap}"
                                + (" with overlap (tiles i and i+1 resident while i+2 lands)" if self.overlap else ""))
        else:
            if self.threads % self.block_m or self.block_n % (self.threads // max(self.block_m, 1)):
                problems.append(f"block_m={self.block_m}, block_n={self.block_n} do not divide {self.threads} threads evenly")
            if self.num_stages != 1 or self.overlap:
                problems.append(f"num_stages={self.num_stages}, overlap={self.overlap}: the float32 kernel takes 1 stage, no overlap")
        if not problems and self.smem_bytes > SMEM_LIMIT[self.arch]:
            problems.append(f"needs {self.smem_bytes} bytes of shared memory, {self.arch} allows {SMEM_LIMIT[self.arch]}")
        if problems:
            raise ValueError(f"invalid kernel spec {self.name}: " + "; ".join(problems))

    # -- identity -----------------------------------------------------------------------------
    @functools.cached_property
    def name(self) -> str:
        causal = "_causal" if self.causal else ""
        overlap = "o" if self.overlap else ""
        family = "_wgmma" if self.family == "wgmma" else ""
        if self.warp_specialized:
            family += "ws"
        return (f"fwd_{self.dtype}_hd{self.head_dim}{causal}_m{self.block_m}n{self.block_n}"
                f"w{self.num_warps}s{self.num_stages}{overlap}{family}_{self.arch}")

    def replace(self, **changes) -> "KernelSpec":
        return dataclasses.replace(self, **changes)

    # -- layout constants (the templates read these) ------------------------------------------
    @functools.cached_property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def elem_bytes(self) -> int:
        return dtypes.DTYPES[self.dtype].itemsize

    @property
    def chunks_per_row(self) -> int:
        """16-byte chunks in one head_dim row of a tile."""
        return self.head_dim * self.elem_bytes // _CHUNK

    @property
    def smem_row_chunks(self) -> int:
        """Shared-memory row pitch in 16-byte chunks. An odd pitch puts the 8 rows that one
        ldmatrix phase reads into 8 distinct bank groups, so padding one chunk onto even rows
        makes every tile access conflict-free without a swizzle. (wgmma tiles are swizzled
        instead, unpadded.)"""
        c = self.chunks_per_row
        if self.family == "wgmma":
            return c
        return c if c % 2 else c + 1

    @property
    def smem_row_bytes(self) -> int:
        return self.smem_row_chunks * _CHUNK

    @property
    def compute_warpgroups(self) -> int:
        """wgmma: warpgroups of 64 query rows (all but the producer when warp-specialized)."""
        return self.num_warps // 4 - self.warp_specialized

    @property
    def smem_barriers_offset(self) -> int:
        """wgmma: byte offset of the mbarriers, after Q and the K/V ring."""
        return (self.block_m + 2 * self.num_stages * self.block_n) * self.head_dim * 2

    #: wgmma, warp-specialized: registers each producer thread keeps after setmaxnreg.
    producer_registers = 56

    @property
    def compute_registers(self) -> int:
        """wgmma, warp-specialized: registers per compute thread after setmaxnreg, so that the
        block's total stays within the 64K register file."""
        return min(240, (65536 - 128 * self.producer_registers) // (128 * self.compute_warpgroups) // 8 * 8)

    @property
    def v_descriptor_offsets(self) -> tuple[int, int]:
        """(leading, stride) byte offsets of the V descriptor (wgmma, read transposed): 64-column
        blocks lie block_n*128 bytes apart, 8-key groups 1024 bytes apart."""
        return (self.block_n * 128, 1024)

    @property
    def m_tiles_per_warp(self) -> int:
        """16-row MMA tiles of queries each warp owns (mma family)."""
        return self.block_m // (16 * self.num_warps)

    @property
    def q_in_registers(self) -> bool:
        """Keep the warp's Q fragments in registers for the whole K/V loop when they cost at most
        32 registers; otherwise re-read them from shared memory with ldmatrix each tile."""
        return self.m_tiles_per_warp * (self.head_dim // 16 + (self.head_dim % 16 != 0)) * 4 <= 32

    @property
    def q_tile_bytes(self) -> int:
        return self.block_m * self.smem_row_bytes

    @property
    def kv_tile_bytes(self) -> int:
        return self.block_n * self.smem_row_bytes

    @property
    def smem_q_offset(self) -> int:
        return 0

    @property
    def smem_k_offset(self) -> int:
        return self.q_tile_bytes

    @property
    def smem_v_offset(self) -> int:
        return self.q_tile_bytes + self.num_stages * self.kv_tile_bytes

    @functools.cached_property
    def smem_bytes(self) -> int:
        if self.family == "simt":
            d = self.head_dim
            floats = (self.block_m * (d + 1) + self.block_n * (d + 1) + self.block_n * d
                      + self.block_m * (self.block_n + 1))
            return floats * 4
        if self.family == "wgmma":  # unpadded swizzled tiles, mbarriers, slack to align the base
            return self.smem_barriers_offset + 8 * (1 + 2 * self.num_stages) + 1024
        return self.q_tile_bytes + 2 * self.num_stages * self.kv_tile_bytes

    @property
    def min_blocks_per_sm(self) -> int:
        return 1


def _fits(spec_kwargs) -> KernelSpec | None:
    try:
        return KernelSpec(**spec_kwargs)
    except ValueError:
        return None


#: Default tiles of the float32 family: (largest head_dim, block_m, block_n, num_warps).
SIMT_DEFAULTS = (
    (128, 32, 32, 8),
    (256, 16, 32, 8),
)


#: Default tiles of the Hopper family: head_dim -> (block_m, block_n, num_warps, num_stages).
#: Two warpgroups of 64 query rows; timed on the H200 (README).
WGMMA_DEFAULTS = {64: (128, 64, 8, 2), 128: (128, 128, 8, 2), 192: (128, 64, 8, 2), 256: (128, 64, 8, 2)}


def default_family(head_dim: int, dtype: str, arch: str) -> str:
    """The family cuflash runs by default: wgmma on Hopper where it has a specialization, else
    the portable tensor-core kernel (fp16/bf16) or the exact float32 one."""
    entry = dtypes.from_tag(dtype)
    if not entry.tensor_core:
        return "simt"
    if arch == "sm90a" and head_dim in WGMMA_DEFAULTS:
        return "wgmma"
    return "mma"


def default_spec(head_dim: int, dtype: str, causal: bool, arch: str, family: str | None = None) -> KernelSpec:
    """The default specialization for a problem. ``family`` (default: :func:`default_family`)
    picks the kernel family; the mma family's tiles come from the tuned table (fastest spill-free
    candidate, see :mod:`cuflash.tune`), else the first candidate that fits the target."""
    entry = dtypes.from_tag(dtype)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported (multiples of 8 from 8 to 256)")
    if arch not in SMEM_LIMIT:
        raise ValueError(f"arch={arch!r} is not supported (one of {list(SMEM_LIMIT)})")
    family = family or default_family(head_dim, entry.tag, arch)
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not one of {FAMILIES}")
    if family == "wgmma":
        if arch != "sm90a" or head_dim not in WGMMA_DEFAULTS or not entry.tensor_core:
            raise ValueError(f"the wgmma family covers fp16/bf16 head dims {sorted(WGMMA_DEFAULTS)} on sm90a; "
                             f"got head_dim={head_dim}, dtype={entry.tag}, arch={arch}")
        bm, bn, w, s = WGMMA_DEFAULTS[head_dim]
        return KernelSpec(head_dim, entry.tag, causal, bm, bn, w, s, arch, family="wgmma")
    if (family == "mma") != entry.tensor_core:
        raise ValueError(f"family={family!r} does not take dtype={entry.tag}")
    if entry.tensor_core:
        from .tuned_defaults import TABLE  # written by ``python -m cuflash tune``

        chosen = TABLE.get((arch, head_dim, causal))
        if chosen is not None:
            bm, bn, w, s, ov = chosen
            return KernelSpec(head_dim, entry.tag, causal, bm, bn, w, s, arch, ov)
        from .tune import candidates  # a target the table does not cover: first candidate that fits

        for bm, bn, w, s, ov in candidates(head_dim):
            spec = _fits(dict(head_dim=head_dim, dtype=entry.tag, causal=causal, block_m=bm,
                              block_n=bn, num_warps=w, num_stages=s, arch=arch, overlap=ov))
            if spec:
                return spec
    else:
        _, bm, bn, w = next(row for row in SIMT_DEFAULTS if head_dim <= row[0])
        for bm_try in (bm, 16, 8):
            spec = _fits(dict(head_dim=head_dim, dtype=entry.tag, causal=causal, block_m=bm_try,
                              block_n=bn, num_warps=w, num_stages=1, arch=arch))
            if spec:
                return spec
    raise ValueError(f"no kernel for head_dim={head_dim}, dtype={dtype} fits the shared memory of {arch}")


def all_default_specs(arch: str, dtype_tags=None, causal=(False, True), family=None) -> list[KernelSpec]:
    """Every default specialization for a target (of one family, or of the default ones): the set
    ``warmup`` and the tests compile."""
    tags = dtype_tags or list(dtypes.DTYPES)
    if family == "wgmma":
        return [default_spec(d, t, c, arch, "wgmma") for t in tags if dtypes.DTYPES[t].tensor_core
                for d in WGMMA_DEFAULTS for c in causal]
    if family is not None:
        return [default_spec(d, t, c, arch, family) for t in tags
                if (family == "mma") == dtypes.DTYPES[t].tensor_core for d in HEAD_DIMS for c in causal]
    return [default_spec(d, t, c, arch) for t in tags for d in HEAD_DIMS for c in causal]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["KernelSpec", "HEAD_DIMS", "ARCHS", "default_spec", "all_default_specs",
           "arch_from_capability", "nvrtc_arch", "ceil_div"]


# -- the kernel's parameter block ------------------------------------------------------------------
# Every forward kernel takes one struct by value. This list is its single definition: the template
# renders the C struct from it and the launcher packs a NumPy record with the same layout. 8-byte
# fields come first so neither side inserts padding.
PARAM_FIELDS = (
    ("q", "const void*", "u8"), ("k", "const void*", "u8"), ("v", "const void*", "u8"),
    ("o", "void*", "u8"), ("lse", "float*", "u8"),
    ("q_batch_stride", "long long", "i8"), ("q_head_stride", "long long", "i8"), ("q_row_stride", "long long", "i8"),
    ("k_batch_stride", "long long", "i8"), ("k_head_stride", "long long", "i8"), ("k_row_stride", "long long", "i8"),
    ("v_batch_stride", "long long", "i8"), ("v_head_stride", "long long", "i8"), ("v_row_stride", "long long", "i8"),
    ("o_batch_stride", "long long", "i8"), ("o_head_stride", "long long", "i8"), ("o_row_stride", "long long", "i8"),
    ("heads", "int", "i4"), ("group", "int", "i4"),          # query heads; query heads per kv head
    ("seqlen_q", "int", "i4"), ("seqlen_k", "int", "i4"),
    ("scale_log2", "float", "f4"), ("_pad", "int", "i4"),     # softmax scale * log2(e)
)
