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


def _problem_fields(head_dim: int, dtype: str, arch: str) -> list[str]:
    """What is wrong with the fields every spec shares (an empty list when nothing is)."""
    problems = []
    if head_dim not in HEAD_DIMS:
        problems.append(f"head_dim={head_dim} (supported: multiples of 8 from 8 to 256)")
    if dtype not in dtypes.DTYPES and dtype not in dtypes.FP8_DTYPES:
        problems.append(f"dtype={dtype!r} (supported: {sorted(dtypes.DTYPES) + sorted(dtypes.FP8_DTYPES)})")
    if arch not in SMEM_LIMIT:
        problems.append(f"arch={arch!r} (supported: {list(SMEM_LIMIT)})")
    return problems


#: KernelSpec's switches of the warp-specialized schedule (bench's --spec-override takes them).
WS_SCHEDULE_FIELDS = ("pingpong", "lazy_rescale", "half_first_tile", "mask_in_loop", "early_rescale")


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
    warp_specialized: bool = False  # wgmma: a TMA producer warpgroup feeds two consumer warpgroups
    pingpong: bool = False    # warp-specialized: the consumers take turns on the tensor cores
    out_dtype: str = ""       # output dtype tag; "" means the input dtype (FP8 inputs: "bf16")
    lse: bool = True          # the LSE is exact; False (Hopper FP8): sums_on_tensor_cores, no LSE for the caller
    lazy_rescale: bool = False  # warp-specialized: the row max moves only by more than lazy_slack_log2
    half_first_tile: bool = False  # warp-specialized: a first key tile whose second half no row sees is computed half wide
    mask_in_loop: bool = False  # warp-specialized: the key loop checks every tile for a mask (else masked tiles loop apart)
    early_rescale: bool = False  # warp-specialized: O is rescaled before its P V product, under the next Q K^T

    def __post_init__(self):
        if not self.family:
            portable = "mma" if self.dtype in dtypes.DTYPES and dtypes.DTYPES[self.dtype].tensor_core else "simt"
            object.__setattr__(self, "family", "wgmma" if self.dtype in dtypes.FP8_DTYPES else portable)
        if not self.out_dtype:
            object.__setattr__(self, "out_dtype", "bf16" if self.dtype in dtypes.FP8_DTYPES else self.dtype)
        problems = _problem_fields(self.head_dim, self.dtype, self.arch)
        if self.dtype in dtypes.FP8_DTYPES:
            if self.out_dtype not in dtypes.FP8_OUT_TAGS:
                problems.append(f"out_dtype={self.out_dtype!r} (FP8 inputs: one of {dtypes.FP8_OUT_TAGS})")
        if self.dtype in dtypes.FP8_DTYPES and self.family != "mma":  # mma: codes converted to fp16 on chip
            if self.family != "wgmma" or not self.warp_specialized:
                problems.append(f"FP8 inputs run on the warp-specialized wgmma kernel or the portable mma kernel "
                                f"(family={self.family!r}, warp_specialized={self.warp_specialized})")
            if self.head_dim % 16:
                problems.append(f"head_dim={self.head_dim} must be a multiple of 16 for the Hopper FP8 kernel "
                                f"(TMA copies rows of whole 16 bytes)")
            if self.block_n % 32 or not 64 <= self.block_n <= 256:
                problems.append(f"block_n={self.block_n} must be a multiple of 32 from 64 to 256 for FP8 "
                                f"(V^T tiles are read in boxes of 32, 64 or 128 keys)")
        if not self.lse and not (self.dtype in dtypes.FP8_DTYPES and self.family == "wgmma"):
            problems.append(f"lse=False applies to the Hopper FP8 kernel only (dtype={self.dtype!r}, "
                            f"family={self.family!r}); every other kernel computes the LSE exactly at no cost")
        if self.dtype not in dtypes.FP8_DTYPES and self.out_dtype != self.dtype:
            problems.append(f"out_dtype={self.out_dtype!r} must equal dtype={self.dtype!r} (only FP8 inputs choose it)")
        if self.num_warps not in (1, 2, 4, 8, 12, 16):
            problems.append(f"num_warps={self.num_warps} (1, 2, 4, 8, 12 or 16)")
        if self.family not in FAMILIES:
            problems.append(f"family={self.family!r} (one of {FAMILIES})")
        if problems:
            raise ValueError("invalid kernel spec: " + "; ".join(problems))
        if self.family == "wgmma":
            if self.arch != "sm90a" or not dtypes.from_tag(self.dtype).tensor_core:
                problems.append(f"the wgmma family needs arch sm90a and fp16/bf16 (got {self.arch}, {self.dtype})")
            if self.head_dim % 64 and not self.warp_specialized:
                problems.append(f"head_dim={self.head_dim} must be a multiple of 64 for wgmma without warp "
                                f"specialization (the warp-specialized schedule pads any head dim to 64 columns)")
            if self.warp_specialized:
                if self.block_m not in (128, 192) or self.num_warps != 4 + self.block_m // 16:
                    problems.append(f"the warp-specialized schedule takes a producer warpgroup and 2 or 3 consumer "
                                    f"warpgroups of 64 rows: block_m=128 with num_warps=12, or block_m=192 with "
                                    f"num_warps=16; got block_m={self.block_m}, num_warps={self.num_warps}")
                if not self.overlap:
                    problems.append("the warp-specialized schedule always issues the next tile's QK^T before the "
                                    "softmax: it takes overlap=True")
                if self.num_stages < 2:
                    problems.append(f"num_stages={self.num_stages} must be at least 2")
            else:
                if self.num_warps not in (4, 8) or self.block_m != 64 * self.compute_warpgroups:
                    problems.append(f"block_m={self.block_m} must be 64 rows per warpgroup of 4 warps "
                                    f"(num_warps={self.num_warps})")
                if self.num_stages < 2 + self.overlap:
                    problems.append(f"num_stages={self.num_stages} must be at least {2 + self.overlap}")
            if self.block_n % 16 or not 16 <= self.block_n <= 256:
                problems.append(f"block_n={self.block_n} must be a multiple of 16 up to 256")
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
        if self.warp_specialized and self.family != "wgmma":
            problems.append(f"warp_specialized applies to the wgmma family only (family={self.family!r})")
        for field in WS_SCHEDULE_FIELDS:
            if getattr(self, field) and not self.warp_specialized:
                problems.append(f"{field} applies to the warp-specialized schedule only")
        if self.half_first_tile and self.block_n % (2 * self.pv_k):
            problems.append(f"half_first_tile needs block_n={self.block_n} to be a multiple of 2 x {self.pv_k} "
                            f"(whole k-steps of P V in each half)")
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
            family += "ws" + ("p" if self.pingpong else "")
        dtype = self.dtype + ("o" + self.out_dtype if self.fp8 else "")
        no_lse = "" if self.lse else "_nolse"
        lazy = "_lazy" if self.lazy_rescale else ""
        half = "_half" if self.half_first_tile else ""
        mask_loop = "_maskloop" if self.mask_in_loop else ""
        early = "_early" if self.early_rescale else ""
        return (f"fwd_{dtype}_hd{self.head_dim}{causal}_m{self.block_m}n{self.block_n}"
                f"w{self.num_warps}s{self.num_stages}{overlap}{family}{lazy}{half}{mask_loop}{early}{no_lse}_{self.arch}")

    def replace(self, **changes) -> "KernelSpec":
        return dataclasses.replace(self, **changes)

    # -- layout constants (the templates read these) ------------------------------------------
    @functools.cached_property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def epilogue_rereads_thread(self) -> bool:
        """The warp-specialized kernel reads its thread index anew for the epilogue, where
        registers are shortest: three consumers without a causal mask, and the early rescale.
        Derived from the index read before the key loop, the epilogue's addresses are computed
        ahead of the loop and held across it, which spilled 8 and 4 bytes there; elsewhere the
        fresh read cost FP8 head dim 128 causal 3-5% on the H200 (README)."""
        return self.warp_specialized and ((self.block_m == 192 and not self.causal) or self.early_rescale)

    @property
    def async_copies(self) -> bool:
        """The kernel loads tiles with 16-byte cp.async copies, which need 16-byte aligned rows."""
        return self.family != "simt"

    @property
    def fp8(self) -> bool:
        """Inputs are FP8 codes (e4m3 / e5m2): native FP8 wgmma with V read as V^T (fp8.v_operand)
        on Hopper, or converted to fp16 in shared memory by the portable kernel (converts_fp8)."""
        return self.dtype in dtypes.FP8_DTYPES

    @property
    def converts_fp8(self) -> bool:
        """The portable kernel on FP8 codes: tiles are copied as bytes into a staging ring and
        converted on chip to the fp16 tiles its mma.sync products read (fp8_tiles.cuh)."""
        return self.fp8 and self.family == "mma"

    @property
    def elem_bytes(self) -> int:
        return dtypes.from_tag(self.dtype).itemsize

    @property
    def tile_elem_bytes(self) -> int:
        """Bytes of one element in the shared-memory tiles that the products read: the input's,
        except fp16 (2) for FP8 codes converted on chip."""
        return 2 if self.converts_fp8 else self.elem_bytes

    @property
    def fp8_copy_bytes(self) -> int:
        """converts_fp8: bytes of one cp.async of codes, 16, or 8 where head_dim is 8 mod 16 (a row
        of codes is then not a whole number of 16-byte chunks)."""
        return 16 if self.head_dim % 16 == 0 else 8

    @property
    def copy_alignment(self) -> int:
        """Byte alignment the kernel's copies need of q, k, v's base and batch/head/row strides."""
        return self.fp8_copy_bytes if self.converts_fp8 else _CHUNK

    @property
    def col_block_bytes(self) -> int:
        """wgmma: bytes of one column block of the Q and K tiles (the span of their swizzle; one
        TMA box wide): 128, or 64 at FP8 head dims up to 64, whose rows of one-byte codes would
        otherwise be computed padded to 128 columns."""
        return 64 if self.fp8 and self.head_dim <= 64 else 128

    @property
    def col_block_elems(self) -> int:
        """wgmma: elements of one column block (:attr:`col_block_bytes`)."""
        return self.col_block_bytes // self.elem_bytes

    @property
    def fp8_v_box_keys(self) -> int:
        """FP8 wgmma: keys per TMA box of V^T: 128 (a 128-byte swizzled row) when block_n is a
        multiple of 128, else 64 (64-byte swizzle) or 32 (32-byte swizzle), so that block_n = 192
        or 224 needs no padding."""
        return next(keys for keys in (128, 64, 32) if self.block_n % keys == 0)

    @property
    def pv_k(self) -> int:
        """wgmma: keys per k-step of O += P V (16 for 16-bit operands, 32 for FP8)."""
        return 32 // self.elem_bytes

    @property
    def chunks_per_row(self) -> int:
        """16-byte chunks in one head_dim row of a tile."""
        return self.head_dim * self.tile_elem_bytes // _CHUNK

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
    def smem_o_offset(self) -> int:
        """wgmma: byte offset of the output staging tile (tma_store), after Q and the K/V ring."""
        return (self.block_m + 2 * self.num_stages * self.block_n) * self.padded_head_dim * self.elem_bytes

    @property
    def o_stage_bytes(self) -> int:
        """Warp-specialized kernel: the 16-bit output tile, block_m rows of 64-column swizzled
        blocks, that the TMA store reads."""
        return self.block_m * ceil_div(self.head_dim, 64) * 64 * 2

    @functools.cached_property
    def tma_store(self) -> bool:
        """The warp-specialized kernel writes O through shared memory with TMA stores where the
        staging tile fits beside Q and the K/V ring, with two consumer warpgroups or three without
        a causal mask (three with one spill 8 bytes in the epilogue) and output rows of at most
        128 columns (head dims 192 and 256 leave no room for the tile at their tuned tiles, and
        wider rows are untested); elsewhere each thread stores its fragments."""
        if not self.warp_specialized or self.arch not in SMEM_LIMIT:
            return False
        if self.compute_warpgroups == 3 and self.causal:
            return False
        if self.compute_warpgroups not in (2, 3) or self.padded_head_dim > 128:
            return False
        return self._smem_bytes(self.o_stage_bytes) <= SMEM_LIMIT[self.arch]

    @property
    def split_keys(self) -> bool:
        """The warp-specialized kernel can deal its last tiles out by keys (launch.split_plan):
        without a causal mask and with two consumer warpgroups. With three (head dim 64), the
        merge made ptxas spill 4 bytes."""
        return self.warp_specialized and not self.causal and self.compute_warpgroups == 2

    @property
    def sums_on_tensor_cores(self) -> bool:
        """The Hopper FP8 kernel without an LSE for the caller (lse=False) sums each row's P on
        the tensor cores, as P (rounded to e4m3 for P V) times a block of ones in shared memory
        (an m64n8k32 wgmma beside each k-step of P V), instead of one float add per probability
        in the softmax. The output is normalized by the sums of the very P it was made of; the
        LSE from those sums is off by P's rounding (about 1e-2), so it is not returned."""
        return not self.lse

    #: sums_on_tensor_cores: bytes of the block of FP8 ones that the row sums' wgmma reads.
    ONES_BYTES = 512

    @property
    def lazy_slack_log2(self) -> float:
        """lazy_rescale: how far (log2 units of P) a tile's max may exceed the row's running max
        before the max moves. Until it moves, alpha is exactly 1 and a warp whose rows all kept
        their max skips the output's rescale; P runs up to 2^slack times its usual top. FP8's P,
        scaled to 2^8 and rounded to e4m3 (largest 448 = 2^8.8), takes 0.75; 16-bit P (at most
        1, then 2^8 = 256) takes 8."""
        return 0.75 if self.fp8 else 8.0

    @property
    def smem_ones_offset(self) -> int:
        """wgmma: byte offset of the block of ones (sums_on_tensor_cores), after Q, the K/V ring
        and the output tile; 512-byte aligned."""
        return self.smem_o_offset + (self.o_stage_bytes if self.tma_store else 0)

    @property
    def smem_barriers_offset(self) -> int:
        """wgmma: byte offset of the mbarriers, after Q, the K/V ring, the output tile and the
        block of ones."""
        return self.smem_ones_offset + self.ONES_BYTES * self.sums_on_tensor_cores

    @property
    def padded_head_dim(self) -> int:
        """wgmma: head_dim rounded up to whole column blocks (64 columns; FP8 128, or 64 up to 64).
        The warp-specialized kernel computes on the padded width: TMA fills the missing columns
        with zeros, which add nothing to QK^T, and the output's extra columns are not stored."""
        if self.family != "wgmma":
            return self.head_dim
        return ceil_div(self.head_dim, self.col_block_elems) * self.col_block_elems

    #: wgmma, warp-specialized: registers each producer thread keeps after setmaxnreg (one
    #: thread issues TMA copies; the rest of the warpgroup only waits).
    producer_registers = 24

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
    def kv_slots(self) -> int:
        """mma: K (and V) tiles the products read from: the cp.async ring's num_stages, or two
        fp16 tiles, converted while the other is read, for FP8 codes."""
        return 2 if self.converts_fp8 else self.num_stages

    @property
    def smem_v_offset(self) -> int:
        return self.q_tile_bytes + self.kv_slots * self.kv_tile_bytes

    @property
    def smem_q8_offset(self) -> int:
        """converts_fp8: Q's codes, staged where the fp16 K/V tiles go (converted before them)."""
        return self.smem_k_offset

    @property
    def smem_stage_offset(self) -> int:
        """converts_fp8: the staging ring of K/V codes, num_stages slots of stage_slot_bytes."""
        return self.q_tile_bytes + max(2 * self.kv_slots * self.kv_tile_bytes, self.block_m * self.head_dim)

    @property
    def stage_slot_bytes(self) -> int:
        """converts_fp8: one slot of the staging ring, K's codes then V's, rows of head_dim bytes."""
        return 2 * self.block_n * self.head_dim

    @functools.cached_property
    def smem_bytes(self) -> int:
        if self.family == "simt":
            d = self.head_dim
            floats = (self.block_m * (d + 1) + self.block_n * (d + 1) + self.block_n * d
                      + self.block_m * (self.block_n + 1))
            return floats * 4
        if self.family == "wgmma":
            return self._smem_bytes(self.o_stage_bytes if self.tma_store else 0)
        if self.converts_fp8:
            return self.smem_stage_offset + self.num_stages * self.stage_slot_bytes
        return self.q_tile_bytes + 2 * self.num_stages * self.kv_tile_bytes

    def _smem_bytes(self, o_stage_bytes: int) -> int:
        """wgmma: unpadded swizzled tiles (Q, the K/V ring, the output tile if staged), then
        (warp-specialized) 2 + 4 * stages mbarriers and two 16-byte slots for the work items, and
        slack to align the base."""
        return (self.smem_o_offset + o_stage_bytes + self.ONES_BYTES * self.sums_on_tensor_cores
                + (8 * (2 + 4 * self.num_stages) + 32) * self.warp_specialized + 1024)

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


#: Default tiles of the Hopper family: head_dim -> (block_m, block_n, num_stages) of the
#: warp-specialized schedule (a TMA producer warpgroup and block_m/64 ping-pong consumer
#: warpgroups of 64 query rows; 3 consumers at head dim 64, where the softmax outweighs the
#: matrix products). Timed on the H200 (README); ``python -m cuflash tune --family wgmma`` writes
#: measured choices per (head_dim, causal, length class) to tuned_defaults.WGMMA_TABLE, which
#: takes precedence.
WGMMA_DEFAULTS = {64: (192, 128, 2), 96: (128, 128, 2), 128: (128, 128, 2), 192: (128, 96, 2), 256: (128, 80, 2)}

#: The Hopper kernel is the default from this head dim up: below, the padding to 64 columns costs
#: what warpgroup MMAs gain. On the H200 (bf16, 16k tokens, TFLOP/s at 1k / 4k / 16k, non-causal)
#: it ran 181 / 207 / 208 against the portable kernel's 156 / 165 / 167 at head dim 24, 125 / 139
#: / 143 against 130 / 139 / 142 at 16 (README).
WGMMA_MIN_HEAD_DIM = 24

#: Head dims the Hopper kernel is the default for (fp16/bf16, sm90a); each takes the tiles of
#: wgmma_tile_head_dim.
WGMMA_HEAD_DIMS = tuple(d for d in HEAD_DIMS if d >= WGMMA_MIN_HEAD_DIM)


def _tiles_head_dim(head_dim: int, tuned) -> int:
    """The smallest head dim of ``tuned`` (a table of tiles by head dim) at least as wide."""
    return min(d for d in tuned if d >= head_dim)


def wgmma_tile_head_dim(head_dim: int) -> int:
    """The head dim of :data:`WGMMA_DEFAULTS` (and of the tuned table) whose tiles a head dim takes
    on the warp-specialized kernel: the smallest one at least as wide. Every head dim is computed
    padded to whole 64-column blocks, so e.g. 80 runs 96's tiles at 128 columns."""
    return _tiles_head_dim(head_dim, WGMMA_DEFAULTS)


#: The Hopper kernel's tiles may differ for short sequences, where the causal diagonal and each
#: tile's fixed costs weigh more: a problem whose longer sequence (queries or keys) has at most
#: SHORT_SEQLEN tokens takes the table's "short" entry, any other the "long" one. At 2048 tokens
#: head dim 64 with a causal mask ran 8% faster on the long tiles (192 x 128) than on the short
#: ones (128 x 128; H200, bf16, README), so 2048 is long.
SHORT_SEQLEN = 1024


def length_class(seqlen: int | None) -> str:
    """``"short"`` for at most :data:`SHORT_SEQLEN` tokens, ``"long"`` beyond or when unknown."""
    return "short" if seqlen is not None and seqlen <= SHORT_SEQLEN else "long"

#: Tiles of the FP8 Hopper kernel: head_dim -> (block_m, block_n, num_stages), same schedule; keys
#: come in multiples of 32 (V^T is read in boxes of 128 keys, or 64 or 32 where block_n needs
#: them). 192 keys per tile beat 128 on the H200 at head dim 128 (README); head dim 256 has no
#: registers for them. Head dim 64 (rows of 64 bytes, KernelSpec.col_block_bytes) runs three
#: consumers on 128 keys, as bf16 does: on the H200 (e4m3, heated rounds, README) 649-651 TFLOP/s
#: against 621-622 for 128 x 192 at 16k without a mask, 607 against 521 with one.
FP8_WGMMA_DEFAULTS = {64: (192, 128, 2), 128: (128, 192, 2), 256: (128, 128, 2)}

#: (tiles, causal) -> block_n, where the FP8 Hopper kernel takes other key tiles than
#: FP8_WGMMA_DEFAULTS'. On the H200 (e4m3, 16k tokens, three interleaved rounds, README) head dim
#: 128 without a mask ran 927-936 TFLOP/s on 224 keys against 899-907 on 192 (842-899 against
#: 831-886 at 4k); with a causal mask 224 lost 6-10%.
FP8_BLOCK_N = {(128, False): 224}

#: (tiles, causal) of the Hopper kernels that move the row max lazily (KernelSpec.lazy_rescale;
#: tiles: a head dim of WGMMA_DEFAULTS or FP8_WGMMA_DEFAULTS). It pays where the output's
#: rescale weighs most beside the softmax. On the H200 (16k tokens, interleaved rounds, README):
#: bf16 head dim 256 gained 2-9% without a causal mask and 1-5% with one; 192 moved within the
#: rounds' spread; 64 and 128 lost up to 10% with a causal mask. FP8 head dim 128 gained 1-3%
#: without a mask and lost up to 6% with one; FP8 256 lost 2-10%.
LAZY_RESCALE_TILES = ((256, False), (256, True))
FP8_LAZY_RESCALE_TILES = ((128, False),)

#: (tiles, causal) of the FP8 Hopper kernels whose consumers issue their products without taking
#: turns (KernelSpec.pingpong off). On the H200 (e4m3, 16k tokens, three interleaved rounds per
#: call, README), with the masking branch out of the key loop (KernelSpec.mask_in_loop off): head
#: dim 128 with a causal mask ran 938-942 TFLOP/s without the turns against 888-904 with them
#: (with the branch in the loop and no turns, 827-842); without a mask 956-973 against 903-960
#: (and 856-874 against 842-872 at 4k); `bench` gave 987-1004 in three runs against 956-1003 in
#: eight with the turns.
#: Head dim 256 keeps the turns: with a causal mask it moved within the rounds' spread; without
#: one it ran 1334-1347 against 1199-1253 in the rounds, but `bench` then gave 1344 against
#: 1349-1379 in four runs with the turns.
FP8_PINGPONG_OFF_TILES = ((128, False), (128, True))

#: (tiles, causal) of the FP8 Hopper kernels that rescale the output before its P V product,
#: under the next tile's Q K^T (KernelSpec.early_rescale), rather than once that product is
#: done. On the H200 (e4m3, interleaved rounds, README) head dim 128 without a mask gained 3% at
#: 4k and 6-8% at 16k; with one it lost 7-9%, and bf16 lost up to 5%.
FP8_EARLY_RESCALE_TILES = ((128, False),)

#: (tiles, causal, length class) of the Hopper kernels that compute a first key tile half wide
#: where no row of a consumer warpgroup sees its second half (KernelSpec.half_first_tile: the
#: causal diagonal's tile, for the consumer of the upper rows; the keys' tail), at the tiles'
#: own head dim: with it ptxas serializes the wgmmas (C7511, short of registers) at the head
#: dims padded to 64 and at 128, 192, and FP8 128 and 256. On the H200 (bf16, 16k tokens,
#: interleaved with cuDNN, three rounds, README) head dim 64 causal on the short tiles
#: (128 x 128) gained 7% at 512 and 3-4% at 1k; on its long tiles (192 x 128) it gained 0.2% at
#: 2k and lost 1-5% at 4k-16k; head dim 96 causal lost 0.7% at 1k, FP8 head dim 64 causal 4.5%.
HALF_FIRST_TILE_TILES = ((64, True, "short"),)

#: (tiles, causal, length class) of the Hopper kernels whose consumers issue their products
#: without taking turns (KernelSpec.pingpong off). On the H200 (bf16, 16k tokens, interleaved
#: with cuDNN, README) head dim 96 non-causal gained 1-1.4% at 512 and 1-3% at 1k without them,
#: head dim 80 (96's tiles) 2-4% at 1k; head dim 128 non-causal at 1k gained 0.2-0.7% in 10 of
#: 11 rounds over four calls (the other: -1.8%, while the clock fell). Timed again after the
#: causal bands, with the turns timed first and last: head dim 128 non-causal gained 0.6-1.3%
#: at 4k, 0.7-1.1% at 8k and 1.0-1.2% at 16k, head dim 96 2-3% at 2k-16k; head dim 192 lost 3%
#: at 16k, 256 5-9%, head dim 64 causal 3% at 1k, and head dim 128 causal moved both ways.
PINGPONG_OFF_TILES = ((96, False, "short"), (96, False, "long"), (128, False, "short"), (128, False, "long"))

#: The tiles (head dims of FP8_WGMMA_DEFAULTS) on which a call without the LSE sums P on the
#: tensor cores (KernelSpec.sums_on_tensor_cores). On the H200 (e4m3, 16k tokens, two rounds
#: against float sums, README) head dim 256 gained 3% without and 4-14% with a causal mask at
#: 16k; head dim 128 lost 5% with a causal mask (its n=8 products weigh more beside P V's 128
#: columns) and gained nothing without one.
FP8_SUMS_ON_TENSOR_CORES_TILES = (256,)

#: The Hopper FP8 kernel takes head dims that are multiples of 16 (TMA copies rows of whole 16
#: bytes), computed padded to whole column blocks (KernelSpec.col_block_bytes); it is the default
#: on sm_90a from this head dim up, the portable kernel below it and at head dims of 8 mod 16. On
#: the H200 (e4m3, 16k tokens, TFLOP/s at 1k / 4k / 16k, non-causal), with every head dim padded
#: to 128 columns, it ran 179 / 230 / 248 against the portable kernel's 188 / 202 / 203 at head
#: dim 32, 91 / 113 / 121 against 112 / 120 / 123 at 16, and 451 / 618 / 638 against 188 / 203 /
#: 205 at 96 (README); on rows of 64 bytes, 266 / 314 / 328 at 32. Head dim 16 on 64-byte rows
#: has not been timed.
FP8_WGMMA_MIN_HEAD_DIM = 32


def fp8_wgmma_tile_head_dim(head_dim: int) -> int:
    """The head dim of :data:`FP8_WGMMA_DEFAULTS` whose tiles an FP8 head dim takes on the
    Hopper kernel: the smallest one at least as wide (96 runs 128's tiles, 160 runs 256's)."""
    return _tiles_head_dim(head_dim, FP8_WGMMA_DEFAULTS)


def fp8_wgmma_covers(head_dim: int, arch: str) -> bool:
    """Whether the Hopper FP8 kernel can run a head dim on a target (it need not be the default)."""
    return arch == "sm90a" and head_dim in HEAD_DIMS and head_dim % 16 == 0


def default_family(head_dim: int, dtype: str, arch: str) -> str:
    """The family cuflash runs by default: wgmma on Hopper from head dim
    :data:`WGMMA_MIN_HEAD_DIM` up (FP8: multiples of 16 from :data:`FP8_WGMMA_MIN_HEAD_DIM`),
    else the portable tensor-core kernel (fp16/bf16, FP8 codes) or the exact float32 one."""
    entry = dtypes.from_tag(dtype)
    if not entry.tensor_core:
        return "simt"
    if entry.tag in dtypes.FP8_DTYPES:
        return "wgmma" if fp8_wgmma_covers(head_dim, arch) and head_dim >= FP8_WGMMA_MIN_HEAD_DIM else "mma"
    if arch == "sm90a" and head_dim >= WGMMA_MIN_HEAD_DIM:
        return "wgmma"
    return "mma"


def default_spec(head_dim: int, dtype: str, causal: bool, arch: str, family: str | None = None,
                 out_dtype: str | None = None, seqlen: int | None = None, lse: bool = True) -> KernelSpec:
    """The default specialization for a problem. ``family`` (default: :func:`default_family`)
    picks the kernel family; the mma family's tiles come from the tuned table (fastest spill-free
    candidate, see :mod:`cuflash.tune`), else the first candidate that fits the target; the
    Hopper family's from its timed table, by ``seqlen`` (the longer of the problem's query and key
    lengths; None: long) through :func:`length_class`. FP8
    inputs (``dtype`` "e4m3"/"e5m2", output ``out_dtype``) run the Hopper FP8 kernel where it
    has the head dim (family wgmma), else the portable kernel, which converts the codes on chip
    (family mma, :func:`fp8_portable_spec`). ``lse=False``: the caller does not need the LSE, so
    that the Hopper FP8 kernel may sum P on the tensor cores (:attr:`KernelSpec.sums_on_tensor_cores`)
    where that pays (:data:`FP8_SUMS_ON_TENSOR_CORES_TILES`); every other kernel computes the LSE
    anyway and ignores it."""
    entry = dtypes.from_tag(dtype)
    if entry.tag in dtypes.FP8_DTYPES:
        family = family or default_family(head_dim, entry.tag, arch)
        if family == "mma":
            return fp8_portable_spec(head_dim, entry.tag, causal, arch, out_dtype or "bf16")
        if not fp8_wgmma_covers(head_dim, arch) or family != "wgmma":
            raise ValueError(f"FP8 attention has a Hopper kernel (family wgmma) for head dims that are "
                             f"multiples of 16 on sm90a and the portable one (family mma) everywhere; "
                             f"got head_dim={head_dim}, arch={arch!r}, family={family!r}")
        tiles = fp8_wgmma_tile_head_dim(head_dim)
        bm, bn, stages = FP8_WGMMA_DEFAULTS[tiles]
        bn = FP8_BLOCK_N.get((tiles, causal), bn)
        return KernelSpec(head_dim, entry.tag, causal, bm, bn, 4 + bm // 16, stages, arch, overlap=True,
                          family="wgmma", warp_specialized=True, out_dtype=out_dtype or "bf16",
                          pingpong=(tiles, causal) not in FP8_PINGPONG_OFF_TILES,
                          lse=lse or tiles not in FP8_SUMS_ON_TENSOR_CORES_TILES,
                          lazy_rescale=(tiles, causal) in FP8_LAZY_RESCALE_TILES,
                          early_rescale=(tiles, causal) in FP8_EARLY_RESCALE_TILES)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported (multiples of 8 from 8 to 256)")
    if arch not in SMEM_LIMIT:
        raise ValueError(f"arch={arch!r} is not supported (one of {list(SMEM_LIMIT)})")
    family = family or default_family(head_dim, entry.tag, arch)
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not one of {FAMILIES}")
    if family == "wgmma":
        if arch != "sm90a" or not entry.tensor_core:
            raise ValueError(f"the wgmma family covers fp16/bf16 on sm90a; "
                             f"got head_dim={head_dim}, dtype={entry.tag}, arch={arch}")
        from .tuned_defaults import WGMMA_TABLE  # written by ``python -m cuflash tune --family wgmma``

        tiles = wgmma_tile_head_dim(head_dim)
        classed = (tiles, causal, length_class(seqlen))  # the key of the per-class tables
        bm, bn, stages = WGMMA_TABLE.get(classed, WGMMA_DEFAULTS[tiles])
        return KernelSpec(head_dim, entry.tag, causal, bm, bn, 4 + bm // 16, stages, arch, overlap=True,
                          family="wgmma", warp_specialized=True, pingpong=classed not in PINGPONG_OFF_TILES,
                          lazy_rescale=(tiles, causal) in LAZY_RESCALE_TILES,
                          half_first_tile=head_dim == tiles and classed in HALF_FIRST_TILE_TILES)
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


#: Tiles of the portable FP8 kernel, best first: (largest head_dim, block_m, block_n, num_warps,
#: num_stages). 16 query rows per warp: the 16-bit defaults' 32 rows per warp hold 128
#: accumulator registers at head dim 128 and sit at 250-255 registers from head dim 96 on, which
#: leaves no room for the conversion (offline compiles spill); with 16 rows the FP8 kernels stay
#: under about 250 at every head dim, and 8 warps share each tile's conversion. Shared memory
#: holds Q and two K/V tiles in fp16 plus the staging ring of codes; smaller targets take the
#: later rows.
FP8_PORTABLE_CANDIDATES = (
    (128, 128, 64, 8, 2), (256, 128, 32, 8, 2), (256, 64, 32, 4, 2), (256, 64, 16, 4, 2),
)


def fp8_portable_spec(head_dim: int, fmt: str, causal: bool, arch: str, out_dtype: str = "bf16") -> KernelSpec:
    """The portable kernel for FP8 codes (family mma), which converts them to fp16 on chip: the
    first row of :data:`FP8_PORTABLE_CANDIDATES` that covers the head dim and fits the target."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported (multiples of 8 from 8 to 256)")
    if arch not in SMEM_LIMIT:
        raise ValueError(f"arch={arch!r} is not supported (one of {list(SMEM_LIMIT)})")
    if fmt not in dtypes.FP8_DTYPES:
        raise ValueError(f"fmt={fmt!r} is not an FP8 format (one of {sorted(dtypes.FP8_DTYPES)})")
    for max_d, bm, bn, w, s in FP8_PORTABLE_CANDIDATES:
        spec = _fits(dict(head_dim=head_dim, dtype=fmt, causal=causal, block_m=bm, block_n=bn, num_warps=w,
                          num_stages=s, arch=arch, family="mma", out_dtype=out_dtype)) if head_dim <= max_d else None
        if spec:
            return spec
    raise ValueError(f"no portable FP8 kernel for head_dim={head_dim}, {fmt} fits the shared memory of {arch}")


#: Head dims of the portable FP8 set that the tests compile and run (every head dim has a kernel):
#: those of the Hopper FP8 kernel, 96 (Hopper has none) and two that are not multiples of 32 or,
#: at 72, of 16 (8-byte copies).
FP8_PORTABLE_TEST_HEAD_DIMS = (64, 72, 80, 96, 128, 256)


def all_fp8_specs(arch: str = "sm90a", causal=(False, True), lse=(True, False)) -> list[KernelSpec]:
    """The Hopper FP8 specializations of a target at the head dims with tiles of their own (64,
    128, 256): formats x head dims x causal x output dtypes, with and without the LSE where they
    differ (none off sm90a; the portable ones are :func:`all_fp8_portable_specs`). Other
    multiples of 16 run the same code padded."""
    if arch != "sm90a":
        return []
    return list(dict.fromkeys(default_spec(d, t, c, arch, out_dtype=o, lse=e) for t in dtypes.FP8_DTYPES
                              for d in FP8_WGMMA_DEFAULTS for c in causal for o in dtypes.FP8_OUT_TAGS for e in lse))


def all_fp8_portable_specs(arch: str, head_dims=FP8_PORTABLE_TEST_HEAD_DIMS, causal=(False, True)) -> list[KernelSpec]:
    """The portable FP8 specializations (family mma) of a target: formats x head dims x causal x
    output dtypes, the set the tests compile and warm up."""
    return [fp8_portable_spec(d, t, c, arch, o) for t in dtypes.FP8_DTYPES for d in head_dims
            for c in causal for o in dtypes.FP8_OUT_TAGS]


#: One sequence length of each length class (:func:`length_class`).
CLASS_SEQLENS = (SHORT_SEQLEN, None)


def all_default_specs(arch: str, dtype_tags=None, causal=(False, True), family=None) -> list[KernelSpec]:
    """Every default specialization for a target (of one family, or of the default ones), both
    length classes: the set ``warmup`` and the tests compile."""
    tags = dtype_tags or list(dtypes.DTYPES)
    if family == "wgmma":
        specs = [default_spec(d, t, c, arch, "wgmma", seqlen=n) for t in tags if dtypes.DTYPES[t].tensor_core
                 for d in WGMMA_HEAD_DIMS for c in causal for n in CLASS_SEQLENS]
    elif family is not None:
        specs = [default_spec(d, t, c, arch, family) for t in tags
                 if (family == "mma") == dtypes.DTYPES[t].tensor_core for d in HEAD_DIMS for c in causal]
    else:
        specs = [default_spec(d, t, c, arch, seqlen=n) for t in tags for d in HEAD_DIMS for c in causal
                 for n in CLASS_SEQLENS]
    return list(dict.fromkeys(specs))


# -- backward ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BwdSpec:
    """Every compile-time parameter of one backward specialization: the kernels that compute
    (dq, dk, dv) of one (head_dim, dtype, causal) on one target.

    Tensor cores (fp16/bf16, the ``mma`` family): a K/V-outer kernel over key tiles of ``block_n``
    rows, walking query tiles of ``block_m`` rows through a ``num_stages``-deep ring; its
    ``num_warps`` warps split S and dP into :attr:`score_tile` tiles and dK / dV into
    :attr:`keys_per_warp` rows (by :attr:`d_split` column ranges).
    float32 (``simt``): the same loops on CUDA cores. ``deterministic`` computes dQ in its own
    Q-outer kernel instead of by atomics (always so for float32).
    """

    head_dim: int
    dtype: str
    causal: bool
    block_m: int          # query rows per step of the K/V-outer kernel
    block_n: int          # key rows per block of the K/V-outer kernel
    num_warps: int
    num_stages: int       # query tiles (Q, dO, lse, delta) in flight
    arch: str
    deterministic: bool = False
    family: str = ""      # "mma" (fp16/bf16) or "simt" (fp32); "" picks by dtype

    def __post_init__(self):
        if self.dtype in dtypes.DTYPES and not self.family:
            object.__setattr__(self, "family", "mma" if dtypes.DTYPES[self.dtype].tensor_core else "simt")
        problems = _problem_fields(self.head_dim, self.dtype, self.arch)
        if problems:
            raise ValueError("invalid backward spec: " + "; ".join(problems))
        if self.family not in FAMILIES or (self.family != "simt") != dtypes.DTYPES[self.dtype].tensor_core:
            problems.append(f"family={self.family!r} does not take dtype={self.dtype} (mma, wgmma: fp16/bf16; simt: fp32)")
        elif self.family == "wgmma":
            if self.arch != "sm90a":
                problems.append(f"the wgmma backward needs sm90a (got arch={self.arch})")
            block_n = 64 if self.padded_head_dim > 128 else 128
            if (self.block_m, self.block_n, self.num_warps) != (64, block_n, 8) or self.num_stages < 2:
                problems.append(f"the wgmma backward at head_dim={self.head_dim} takes block_m=64, block_n={block_n}, "
                                f"num_warps=8 and at least 2 stages (got {self.block_m}, {self.block_n}, "
                                f"{self.num_warps}, {self.num_stages})")
        elif self.family == "mma":
            if self.block_m % 16 or not 16 <= self.block_m <= 128:
                problems.append(f"block_m={self.block_m} must be a multiple of 16 up to 128")
            if self.num_warps not in (2, 4, 8) or self.block_n % 16 or not 16 <= self.block_n <= 256:
                problems.append(f"num_warps={self.num_warps} (2, 4 or 8) and block_n={self.block_n} "
                                "(a multiple of 16 up to 256)")
            elif self.score_tile is None:
                problems.append(f"block_m={self.block_m} x block_n={self.block_n} does not split into "
                                f"{self.num_warps} warp tiles of 16 or 32 rows and a multiple of 16 columns")
            elif self.keys_per_warp % 16:
                problems.append(f"block_n={self.block_n} gives {self.keys_per_warp} key rows per warp "
                                f"(num_warps={self.num_warps}, d_split={self.d_split}); it must be a multiple of 16")
            if not self.deterministic and self.num_warps % max(self.block_m // 16, 1):
                problems.append(f"num_warps={self.num_warps} must be a multiple of block_m/16={self.block_m // 16} "
                                "(warps share the dq tile by rows)")
            if self.num_stages < 2:
                problems.append(f"num_stages={self.num_stages} must be at least 2")
        else:
            if self.num_warps * 32 % self.block_n or self.num_warps * 32 % self.block_m:
                problems.append(f"block_m={self.block_m}, block_n={self.block_n} must divide {self.num_warps * 32} threads")
            elif not (self.head_dim % (self.num_warps * 32 // self.block_n) == 0
                      and self.head_dim % (self.num_warps * 32 // self.block_m) == 0
                      and self.num_warps * 32 // min(self.block_m, self.block_n) <= 32):
                problems.append(f"block_m={self.block_m}, block_n={self.block_n}, num_warps={self.num_warps} "
                                f"do not split head_dim={self.head_dim} into whole lanes")
            if not self.deterministic:
                problems.append("the float32 backward is always deterministic (deterministic=True)")
        if not problems:
            limit = SMEM_LIMIT[self.arch]
            for what, size in (("K/V-outer kernel", self.smem_bytes), ("dq kernel", self.dq_smem_bytes)):
                if size > limit:
                    problems.append(f"the {what} needs {size} bytes of shared memory, {self.arch} allows {limit}")
        if problems:
            raise ValueError(f"invalid backward spec {self.name}: " + "; ".join(problems))

    @functools.cached_property
    def name(self) -> str:
        causal = "_causal" if self.causal else ""
        det = "_det" if self.deterministic and self.family != "simt" else ""
        family = "_wgmma" if self.family == "wgmma" else ""
        return (f"bwd_{self.dtype}_hd{self.head_dim}{causal}_m{self.block_m}n{self.block_n}"
                f"w{self.num_warps}s{self.num_stages}{det}{family}_{self.arch}")

    def replace(self, **changes) -> "BwdSpec":
        return dataclasses.replace(self, **changes)

    @property
    def kernel_names(self) -> tuple[str, str, str]:
        """(preprocess, K/V-outer, dQ) kernel symbols; the dQ one converts the atomic accumulator,
        or (deterministic) computes dQ itself."""
        return (f"{self.name}_pre", f"{self.name}_dkdv", f"{self.name}_dq")

    @property
    def async_copies(self) -> bool:
        """The kernels load tiles with 16-byte cp.async copies, which need 16-byte aligned rows."""
        return self.family != "simt"

    @property
    def atomic_dq(self) -> bool:
        return self.family != "simt" and not self.deterministic

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def split_head_dim(self) -> bool:
        """wgmma, head dims over 128: both warpgroups share the key rows, each with half of the
        head dim of dK and dV."""
        return self.family == "wgmma" and self.padded_head_dim > 128

    @property
    def padded_head_dim(self) -> int:
        """wgmma: the head dim computed, the smallest of :data:`BWD_WGMMA_HEAD_DIMS` at least as
        wide (copies fill the missing columns with zeros; the extra gradient columns are not
        stored); other families compute the head dim itself."""
        if self.family != "wgmma":
            return self.head_dim
        return _tiles_head_dim(self.head_dim, BWD_WGMMA_HEAD_DIMS)

    @property
    def d_split(self) -> int:
        """mma: warps of the dK/dV phase sharing key rows, each taking part of the head dim: two when
        the halves are whole 16-column blocks or the head dim is too wide for one warp's registers."""
        if self.family != "mma":
            return 1
        if self.head_dim > 128 and self.head_dim % 32 == 0 and self.num_warps >= 4:
            return 4
        return 2 if self.head_dim % 32 == 0 or self.head_dim > 128 else 1

    @property
    def split_col(self) -> int:
        """Head-dim columns of the first warp of a pair when the head dim does not split into
        equal whole n=8 tiles (8 mod 16): [0, split_col) and the rest."""
        return 16 * ceil_div(self.head_dim, 32) if self.d_split == 2 else self.head_dim // self.d_split

    @property
    def keys_per_warp(self) -> int:
        """Key rows of dK/dV each warp accumulates."""
        return self.block_n * self.d_split // self.num_warps

    @functools.cached_property
    def score_tile(self) -> tuple[int, int] | None:
        """(rows, columns) of each warp's tile of S and dP: 32 query rows where that leaves
        columns in multiples of 16, else 16 rows (columns in multiples of 8); None when the block
        does not split."""
        for rows, unit in ((32, 16), (16, 16), (16, 8)):
            warps_m = self.block_m // rows
            if self.block_m % rows or warps_m == 0 or self.num_warps % warps_m:
                continue
            cols = self.block_n // (self.num_warps // warps_m)
            if self.block_n % (self.num_warps // warps_m) == 0 and cols and cols % unit == 0:
                return rows, cols
        return None

    @property
    def warps_n(self) -> int:
        return self.block_n // self.score_tile[1]

    @property
    def smem_row_bytes(self) -> int:
        """Padded row pitch of the Q, dO, K and V tiles: an odd number of 16-byte chunks."""
        chunks = self.head_dim * 2 // _CHUNK
        return (chunks if chunks % 2 else chunks + 1) * _CHUNK

    @property
    def chunks_per_row(self) -> int:
        return self.head_dim * 2 // _CHUNK

    @property
    def score_pitch(self) -> int:
        """Padded row pitch of the P and dS tiles ([query][key], 16-bit)."""
        chunks = self.block_n * 2 // _CHUNK
        return (chunks if chunks % 2 else chunks + 1) * _CHUNK

    @functools.cached_property
    def smem_layout(self) -> dict[str, int]:
        """Byte offsets of the K/V-outer kernel's shared-memory regions, and its total."""
        if self.family == "simt":
            return {"total": (2 * self.block_m * self.head_dim + 2 * self.block_m) * 4}
        if self.family == "wgmma":  # swizzled tiles (padded head dim) at 1024-byte boundaries, slack to align the base
            kv = self.block_n * self.padded_head_dim * 2
            q = self.block_m * self.padded_head_dim * 2
            layout, offset = {}, 0
            scores = self.block_n * self.block_m * 2
            for region, size in (("k", kv), ("v", kv), ("q", self.num_stages * q), ("do", self.num_stages * q),
                                 ("ds", scores), ("p", scores if self.split_head_dim else 0),
                                 ("lse2", self.num_stages * self.block_m * 4),
                                 ("delta", self.num_stages * self.block_m * 4)):
                layout[region] = offset
                offset += size
            layout["total"] = offset + 1024
            return layout
        kv = self.block_n * self.smem_row_bytes
        q = self.block_m * self.smem_row_bytes
        layout, offset = {}, 0
        scores = self.block_m * self.score_pitch
        for region, size in (("k", kv), ("v", kv), ("q", self.num_stages * q), ("do", self.num_stages * q),
                             ("lse2", self.num_stages * self.block_m * 4), ("delta", self.num_stages * self.block_m * 4),
                             ("p", scores), ("ds", scores)):
            layout[region] = offset
            offset += size
        layout["total"] = offset
        return layout

    @property
    def smem_bytes(self) -> int:
        return self.smem_layout["total"]

    # The deterministic dQ kernel (Q-outer): dq_block_m query rows (16 per warp), key tiles of
    # dq_block_n rows through a 2-deep ring.
    @property
    def dq_tiles(self) -> tuple[int, int]:
        """(query rows per block, key rows per step) of the dQ kernel."""
        if self.family == "simt":
            return (self.block_n, self.block_m)
        options = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16)) if self.head_dim <= 128 else \
            ((64, 32), (32, 32), (32, 16), (16, 16))
        for bm, bn in options:
            if self._dq_smem(bm, bn) <= SMEM_LIMIT[self.arch]:
                return (bm, bn)
        return options[-1]

    dq_stages = 2

    def _dq_smem(self, bm: int, bn: int) -> int:
        if self.family == "simt":
            return 2 * bn * self.head_dim * 4
        return 2 * bm * self.smem_row_bytes + 2 * bm * 4 + 2 * self.dq_stages * bn * self.smem_row_bytes

    @property
    def dq_smem_bytes(self) -> int:
        if self.atomic_dq:
            return 0
        return self._dq_smem(*self.dq_tiles)

    @property
    def dq_warps(self) -> int:
        return self.num_warps if self.family == "simt" else self.dq_tiles[0] // 16


#: Candidate tiles of the tensor-core backward, best first: (largest head_dim, block_m, block_n,
#: num_warps, num_stages). Head dims over 128 split the head dim between two warps.
BWD_CANDIDATES = (
    (128, 64, 128, 8, 2), (128, 64, 64, 4, 2), (128, 32, 64, 4, 2), (128, 16, 32, 2, 2),
    (256, 64, 64, 8, 2), (256, 32, 64, 8, 2), (256, 16, 64, 8, 2), (256, 16, 32, 4, 2),
)

#: Head dims the Hopper (wgmma) backward computes. Up to 128, two warpgroups of 64 key rows keep
#: dK and dV in registers; at 256 the warpgroups split the head dim (see split_head_dim) into
#: halves of whole 64-column blocks, which transposed operands need. Other head dims run it
#: padded to the next of these.
BWD_WGMMA_HEAD_DIMS = (64, 128, 256)

#: The narrowest head dim the Hopper backward is the default for, by the width it is padded to
#: (fp16/bf16, sm90a). On the H200 (bf16, 16k tokens, TFLOP/s at 1k / 4k / 16k, non-causal) the
#: padded kernel ran 163 / 193 / 202 against the portable kernel's 142 / 165 / 171 at head dim 40
#: but 141 / 160 / 166 against 144 / 166 / 172 at 32; 164 / 185 / 190 against 159 / 178 / 184 at
#: 176 but 157 / 176 / 181 against 161 / 180 / 186 at 168 (README).
BWD_WGMMA_MIN_HEAD_DIM = {64: 40, 128: 72, 256: 176}


def bwd_wgmma_is_default(head_dim: int) -> bool:
    """Whether the Hopper backward is the default at a head dim (fp16/bf16, sm90a)."""
    return head_dim >= BWD_WGMMA_MIN_HEAD_DIM[_tiles_head_dim(head_dim, BWD_WGMMA_HEAD_DIMS)]

#: Tiles of the float32 backward: (block_m, block_n, num_warps).
BWD_SIMT_TILES = (32, 32, 8)


def default_bwd_spec(head_dim: int, dtype: str, causal: bool, arch: str, deterministic: bool = False,
                     family: str | None = None) -> BwdSpec:
    """The backward specialization cuflash runs for a problem: wgmma on Hopper where it applies,
    else the first mma candidate whose shared memory fits the target (float32: simt, always
    deterministic). ``family`` forces one."""
    entry = dtypes.from_tag(dtype)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported (multiples of 8 from 8 to 256)")
    if arch not in SMEM_LIMIT:
        raise ValueError(f"arch={arch!r} is not supported (one of {list(SMEM_LIMIT)})")
    if family is None:
        family = "simt" if not entry.tensor_core else \
            "wgmma" if arch == "sm90a" and bwd_wgmma_is_default(head_dim) else "mma"
    if family not in FAMILIES or (family == "simt") == entry.tensor_core:
        raise ValueError(f"family={family!r} does not take dtype={entry.tag} (mma, wgmma: fp16/bf16; simt: fp32)")
    if family == "simt":
        bm, bn, w = BWD_SIMT_TILES
        return BwdSpec(head_dim, entry.tag, causal, bm, bn, w, 1, arch, deterministic=True)
    if family == "wgmma":  # a third query tile in flight pays off where the tiles are small (H200)
        padded = _tiles_head_dim(head_dim, BWD_WGMMA_HEAD_DIMS)
        return BwdSpec(head_dim, entry.tag, causal, 64, 64 if padded > 128 else 128, 8,
                       3 if padded == 64 else 2, arch, deterministic, family="wgmma")
    for max_d, bm, bn, w, s in BWD_CANDIDATES:
        if head_dim > max_d:
            continue
        spec = _fits_bwd(dict(head_dim=head_dim, dtype=entry.tag, causal=causal, block_m=bm, block_n=bn,
                              num_warps=w, num_stages=s, arch=arch, deterministic=deterministic))
        if spec:
            return spec
    raise ValueError(f"no backward kernel for head_dim={head_dim}, dtype={dtype} fits the shared memory of {arch}")


def _fits_bwd(kwargs) -> BwdSpec | None:
    try:
        return BwdSpec(**kwargs)
    except ValueError:
        return None


def all_default_bwd_specs(arch: str, dtype_tags=None, causal=(False, True), deterministic=(False, True)) -> list[BwdSpec]:
    """Every default backward specialization of a target (the set the tests warm up)."""
    tags = dtype_tags or list(dtypes.DTYPES)
    return list(dict.fromkeys(default_bwd_spec(d, t, c, arch, det) for t in tags for d in HEAD_DIMS
                              for c in causal for det in deterministic))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["KernelSpec", "BwdSpec", "default_bwd_spec", "all_default_bwd_specs", "HEAD_DIMS", "ARCHS", "default_spec", "all_default_specs",
           "arch_from_capability", "nvrtc_arch", "ceil_div"]


# -- the kernel's parameter block ------------------------------------------------------------------
# Every forward kernel takes one struct by value. This list is its single definition: the template
# renders the C struct from it and the launcher packs a NumPy record with the same layout. 8-byte
# fields come first so neither side inserts padding.
PARAM_FIELDS = (
    ("q", "const void*", "u8"), ("k", "const void*", "u8"), ("v", "const void*", "u8"),
    ("o", "void*", "u8"), ("lse", "float*", "u8"),
    ("tile_counter", "int*", "u8"),  # warp-specialized kernel: [next work tile, blocks done], zero between launches
    # warp-specialized kernel, tiles dealt out by keys (launch.split_plan): the pieces' states
    # and their flags (zero between launches)
    ("split_ws", "float*", "u8"), ("split_flags", "int*", "u8"),
    # FP8 inputs: descale factors, per tensor (strides 0) or per (batch, head); q's over query
    # heads, k's and v's over key/value heads
    ("q_descale", "const float*", "u8"), ("k_descale", "const float*", "u8"), ("v_descale", "const float*", "u8"),
    ("q_batch_stride", "long long", "i8"), ("q_head_stride", "long long", "i8"), ("q_row_stride", "long long", "i8"),
    ("k_batch_stride", "long long", "i8"), ("k_head_stride", "long long", "i8"), ("k_row_stride", "long long", "i8"),
    ("v_batch_stride", "long long", "i8"), ("v_head_stride", "long long", "i8"), ("v_row_stride", "long long", "i8"),
    ("o_batch_stride", "long long", "i8"), ("o_head_stride", "long long", "i8"), ("o_row_stride", "long long", "i8"),
    ("heads", "int", "i4"), ("group", "int", "i4"),          # query heads; query heads per kv head
    ("seqlen_q", "int", "i4"), ("seqlen_k", "int", "i4"),
    ("scale_log2", "float", "f4"), ("batch", "int", "i4"),   # softmax scale * log2(e)
    ("q_descale_batch_stride", "int", "i4"), ("q_descale_head_stride", "int", "i4"),
    ("kv_descale_batch_stride", "int", "i4"), ("kv_descale_head_stride", "int", "i4"),
    # warp-specialized kernel: work counter values below dp_tiles are whole tiles, the next
    # `shares` values shares of the share_units key tiles of the remaining tiles (block.cuh)
    ("dp_tiles", "int", "i4"), ("shares", "int", "i4"), ("share_units", "int", "i4"),
    # Division without a divide instruction (launch.divider, ptx.cuh fast_div) by the query tiles
    # per head (warp-specialized kernel), the query heads and the query heads per kv head
    ("q_tiles_magic", "unsigned", "u4"), ("q_tiles_shifts", "int", "i4"),
    ("heads_magic", "unsigned", "u4"), ("heads_shifts", "int", "i4"),
    ("group_magic", "unsigned", "u4"), ("group_shifts", "int", "i4"),
    # warp-specialized kernel with a causal mask: (batch, head) pairs per band of work tiles
    # (launch.band_heads), and division by the band's tiles and by its pairs
    ("band_heads", "int", "i4"), ("band_tiles_magic", "unsigned", "u4"), ("band_tiles_shifts", "int", "i4"),
    ("band_heads_magic", "unsigned", "u4"), ("band_heads_shifts", "int", "i4"),
)


#: The backward kernels' parameter block (same conventions as PARAM_FIELDS). lse2 and delta hold
#: ``rows_padded`` rows per head (seqlen_q rounded up to whole query tiles); so does the float32
#: dq accumulator, [batch, heads, rows_padded, head_dim].
BWD_PARAM_FIELDS = (
    ("q", "const void*", "u8"), ("k", "const void*", "u8"), ("v", "const void*", "u8"),
    ("o", "const void*", "u8"), ("dout", "const void*", "u8"), ("lse", "const float*", "u8"),
    ("dq", "void*", "u8"), ("dk", "void*", "u8"), ("dv", "void*", "u8"),
    ("dq_accum", "float*", "u8"), ("lse2", "float*", "u8"), ("delta", "float*", "u8"),
) + tuple(
    (f"{t}_{s}_stride", "long long", "i8") for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")
    for s in ("batch", "head", "row")
) + (
    ("heads", "int", "i4"), ("group", "int", "i4"), ("seqlen_q", "int", "i4"), ("seqlen_k", "int", "i4"),
    ("rows_padded", "int", "i4"), ("scale", "float", "f4"), ("scale_log2", "float", "f4"), ("_pad", "int", "i4"),
)
