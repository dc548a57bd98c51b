"""The backward's specializations: every compile-time parameter of one backward in one frozen dataclass.

A :class:`BwdSpec` names one module of three kernels (preprocess, K/V-outer, dQ); like
:class:`cuflash.core.spec.KernelSpec`, Python computes its layout constants and the templates fill
them in.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from . import dtypes
from .spec import _CHUNK, FAMILIES, SMEM_LIMIT, _problem_fields, ceil_div, tiles_head_dim

#: Head dims the Hopper (wgmma) backward computes. Up to 128, two warpgroups of 64 key rows keep
#: dK and dV in registers; at 256 the warpgroups split the head dim (see split_head_dim) into
#: halves of whole 64-column blocks, which transposed operands need. Other head dims run it
#: padded to the next of these.
BWD_WGMMA_HEAD_DIMS = (64, 128, 256)

#: Rows between packed sequences in the varlen backward's dQ accumulator (one query tile), so
#: that no two sequences' whole tiles overlap.
VARLEN_DQ_GAP = 64


@dataclass(frozen=True)
class BwdSpec:
    """Every compile-time parameter of one backward specialization: the kernels that compute
    (dq, dk, dv) of one (head_dim, dtype, causal) on one target.

    Tensor cores (fp16/bf16, the ``mma`` family): a K/V-outer kernel over key tiles of ``block_n``
    rows, walking query tiles of ``block_m`` rows through a ``num_stages``-deep ring; its
    ``num_warps`` warps split S and dP into :attr:`score_tile` tiles and dK / dV into
    :attr:`keys_per_warp` rows (by :attr:`d_split` column ranges).
    float32 (``simt``): the same loops on CUDA cores. ``deterministic`` fixes the order in which
    dQ is summed: the Hopper kernel adds its dQ tiles in key-tile order (:attr:`ordered_dq`), the
    others compute dQ in a Q-outer kernel of its own (always so for float32).
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
    score_mod: str = ""   # digest of a traced score_mod (mod_codegen.register); "" for none
    mask_mod: str = ""    # digest of a traced mask_mod; "" for none
    block_sparse: bool = False  # wgmma with a mask_mod: each key tile's query tiles from a block mask
    varlen: bool = False  # wgmma, not deterministic, no block mask: packed sequences of their own lengths (cu_seqlens)
    tma_loads: bool = False  # wgmma: K, V and the query tiles by TMA (tensor maps), not cp.async
    local: bool = False  # wgmma, not deterministic, no mask_mod: a window of keys per query (window_left / right)

    def __post_init__(self):
        if self.dtype in dtypes.DTYPES and not self.family:
            object.__setattr__(self, "family", "mma" if dtypes.DTYPES[self.dtype].tensor_core else "simt")
        problems = _problem_fields(self.head_dim, self.dtype, self.arch)
        if problems:
            raise ValueError("invalid backward spec: " + "; ".join(problems))
        if self.family not in FAMILIES or (self.family != "simt") != dtypes.DTYPES[self.dtype].tensor_core:
            problems.append(f"family={self.family!r} does not take dtype={self.dtype} (mma, wgmma: fp16/bf16; simt: fp32)")
        if (self.score_mod or self.mask_mod) and self.family == "simt":
            problems.append("score_mod and mask_mod run on the tensor-core backward kernels (fp16, bf16)")
        if self.block_sparse and not (self.family == "wgmma" and self.mask_mod):
            problems.append("block_sparse applies to the wgmma backward with a mask_mod")
        if self.varlen and (self.family != "wgmma" or self.deterministic or self.block_sparse):
            problems.append("varlen applies to the wgmma backward that is not deterministic, without a block mask")
        if self.local and (self.family != "wgmma" or self.deterministic or self.mask_mod):
            problems.append("local applies to the wgmma backward that is not deterministic, without a mask_mod")
        if self.tma_loads and self.family != "wgmma":
            problems.append("tma_loads applies to the wgmma backward")
        if self.family == "wgmma":
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
        mods = (f"_sm{self.score_mod}" if self.score_mod else "") + (f"_mm{self.mask_mod}" if self.mask_mod else "")
        mods += "_bs" if self.block_sparse else ""
        varlen = "_varlen" if self.varlen else ""
        tma = "_tma" if self.tma_loads else ""
        tma += "_local" if self.local else ""
        return (f"bwd_{self.dtype}_hd{self.head_dim}{causal}_m{self.block_m}n{self.block_n}"
                f"w{self.num_warps}s{self.num_stages}{det}{family}{mods}{varlen}{tma}_{self.arch}")

    def replace(self, **changes) -> "BwdSpec":
        return dataclasses.replace(self, **changes)

    @property
    def kernel_names(self) -> tuple[str, str, str]:
        """(preprocess, K/V-outer, dQ) kernel symbols; the dQ one converts the accumulator
        (:attr:`accum_dq`), or computes dQ itself."""
        return (f"{self.name}_pre", f"{self.name}_dkdv", f"{self.name}_dq")

    @property
    def async_copies(self) -> bool:
        """The kernels load tiles with 16-byte cp.async copies, which need 16-byte aligned rows."""
        return self.family != "simt"

    @property
    def atomic_dq(self) -> bool:
        """dQ added into the float32 accumulator in whatever order the blocks reach it."""
        return self.family != "simt" and not self.deterministic

    @property
    def ordered_dq(self) -> bool:
        """Deterministic wgmma at head dims up to 128, every query tile visited by every key tile
        before it (not block-sparse): the K/V-outer kernel adds each dQ tile in key-tile order, a
        counter per (batch, query head, query tile) saying whose turn it is (``dq_sem``)."""
        return (self.family == "wgmma" and self.deterministic and not self.split_head_dim
                and not self.block_sparse)

    @property
    def accum_dq(self) -> bool:
        """The K/V-outer kernel accumulates dQ (by atomics or in order), which a small kernel
        converts; otherwise a Q-outer kernel computes it."""
        return self.atomic_dq or self.ordered_dq

    @property
    def bulk_dq(self) -> bool:
        """wgmma with dQ accumulated: each warpgroup's dQ partial tile goes to shared memory in its
        fragments' order and into the accumulator by bulk reduce-add; the accumulator keeps that
        order within each query tile (:attr:`dq_chunk_cols`), and the conversion puts the rows
        back. With :attr:`split_head_dim` the tile has no region of its own: each warpgroup's
        chunks overwrite the halves of the step's Q and dO tiles its own dK and dV have read.
        Packed sequences (varlen) start their tiles :data:`VARLEN_DQ_GAP` rows apart in the
        accumulator: sequence s at its first packed row + 64 s."""
        return self.family == "wgmma" and self.accum_dq

    @property
    def double_dq(self) -> bool:
        """:attr:`bulk_dq` over whole query tiles (not packed sequences, not block-sparse, not a
        window, not a split head dim): two partial tiles in shared memory, by the step's parity,
        each added in the next step while dV and dK are computed (:attr:`ordered_dq`: on its key
        tile's turn)."""
        return (self.bulk_dq and not self.varlen and not self.block_sparse and not self.split_head_dim
                and not self.local)

    @property
    def dq_chunk_cols(self) -> int:
        """Columns of one warpgroup's dQ partial tile (its accumulator of dS K)."""
        return min(self.padded_head_dim // 2, 64) if self.padded_head_dim <= 128 else 64

    @property
    def accum_head_dim(self) -> int:
        """Row width of the float32 dQ accumulator: the padded head dim for :attr:`bulk_dq`, whose
        partial tiles are whole, else the head dim."""
        return self.padded_head_dim if self.bulk_dq else self.head_dim

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
        return tiles_head_dim(self.head_dim, BWD_WGMMA_HEAD_DIMS)

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
    def stats_rows(self) -> int:
        """lse2 / delta values per ring slot of the wgmma kernel: a query tile's, and with TMA on
        packed sequences 4 more, since their bulk copy starts at the 16-byte boundary below the
        tile's first row."""
        return self.block_m + (4 if self.varlen and self.tma_loads else 0)

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
                                 ("lse2", self.num_stages * self.stats_rows * 4),
                                 ("delta", self.num_stages * self.stats_rows * 4),
                                 ("dq", self.block_m * self.padded_head_dim * 4 * (2 if self.double_dq else 1)
                                  if self.bulk_dq and not self.split_head_dim else 0),
                                 ("bars", 8 * (1 + self.num_stages) if self.tma_loads else 0)):
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
        if self.accum_dq:
            return 0
        return self._dq_smem(*self.dq_tiles)

    @property
    def dq_warps(self) -> int:
        return self.num_warps if self.family == "simt" else self.dq_tiles[0] // 16
