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
    score_mod: str = ""       # digest of a traced score_mod (mod_codegen.register); "" for none
    mask_mod: str = ""        # digest of a traced mask_mod; "" for none
    block_sparse: bool = False  # warp-specialized with a mask_mod: key tiles from a block mask's visit lists
    varlen: bool = False      # warp-specialized: packed sequences of their own lengths (cu_seqlens offsets)
    sinks: bool = False       # one logit per query head added to each row's softmax sum (Params::sinks)
    local: bool = False       # warp-specialized: a window of keys per query (Params window_left / window_right)

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
        if (self.score_mod or self.mask_mod) and not (self.family == "mma" or self.warp_specialized):
            problems.append(f"score_mod and mask_mod run on the portable mma kernel and the warp-specialized wgmma "
                            f"kernel (family={self.family!r}, warp_specialized={self.warp_specialized})")
        if self.block_sparse and not (self.warp_specialized and self.mask_mod):
            problems.append("block_sparse applies to the warp-specialized kernel with a mask_mod")
        if self.varlen and (not self.warp_specialized or self.fp8 or self.block_sparse):
            problems.append("varlen applies to the warp-specialized kernel on fp16 or bf16, without a block mask")
        if self.sinks and not self.lse:
            problems.append("sinks need the kernel's exact LSE (lse=True)")
        if self.local and (not self.warp_specialized or self.block_sparse):
            problems.append("local applies to the warp-specialized kernel without a block mask")
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
        mods = (f"_sm{self.score_mod}" if self.score_mod else "") + (f"_mm{self.mask_mod}" if self.mask_mod else "")
        mods += "_bs" if self.block_sparse else ""
        varlen = "_varlen" if self.varlen else ""
        sinks = "_sinks" if self.sinks else ""
        sinks += "_local" if self.local else ""
        return (f"fwd_{dtype}_hd{self.head_dim}{causal}_m{self.block_m}n{self.block_n}"
                f"w{self.num_warps}s{self.num_stages}{overlap}{family}{lazy}{half}{mask_loop}{early}{no_lse}{mods}"
                f"{varlen}{sinks}_{self.arch}")

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
        ahead of the loop and held across it, which spilled there; elsewhere the fresh read is
        slower (docs/tuning.md)."""
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
        if self.compute_warpgroups == 3 and self.causal or self.varlen:  # varlen: a box would cross sequences
            return False
        if self.compute_warpgroups not in (2, 3) or self.padded_head_dim > 128:
            return False
        return self._smem_bytes(self.o_stage_bytes) <= SMEM_LIMIT[self.arch]

    @property
    def split_keys(self) -> bool:
        """The warp-specialized kernel can deal its last tiles out by keys (launch.split_plan):
        without a causal mask and with two consumer warpgroups. With three (head dim 64), the
        merge made ptxas spill 4 bytes."""
        return (self.warp_specialized and not self.causal and self.compute_warpgroups == 2 and not self.block_sparse
                and not self.varlen and not self.local)

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


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def tiles_head_dim(head_dim: int, tuned) -> int:
    """The smallest head dim of ``tuned`` (head dims with tiles of their own) at least as wide."""
    return min(d for d in tuned if d >= head_dim)
