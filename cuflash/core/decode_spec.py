"""The KV-cache attention's specializations (decode, speculative verification, chunked prefill).

A :class:`DecodeSpec` names one module of three kernels (decode.cuh): the attention over the
cache (one block per batch, kv head, tile of query rows and split of the keys; the last split of
a row tile to finish merges the splits' partial results), the append of new keys and values
into the cache, and the merge of the splits as a kernel of its own, for row tiles whose partials
are too many for one block. Python computes the shared-memory layout; the template fills it in.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .spec import _CHUNK, ARCHS, HEAD_DIMS, SMEM_LIMIT, ceil_div

#: Query dtypes (the mma operands) and cache dtypes (the same, or FP8 codes converted on chip).
QUERY_DTYPES = ("fp16", "bf16")
CACHE_DTYPES = ("fp16", "bf16", "e4m3", "e5m2")
#: Warps of the attention kernel; they split into row groups of 16 rows and key groups.
WARPS = 4
#: Most splits of the key range one merge takes.
MAX_SPLITS = 128


@dataclass(frozen=True)
class DecodeSpec:
    """Every compile-time parameter of one KV-cache attention module.

    ``warps_m`` row groups of 16 query rows (rows: the query tokens times the query heads of one
    kv head) share each key tile of ``block_n`` keys with ``4 / warps_m`` key groups; the tiles
    stream through ``num_stages`` cp.async stages. ``cache_dtype`` is the query dtype or an FP8
    format; ``paged`` reads keys through a page table; ``packed_q`` takes queries packed
    [total_q, heads, head_dim] by offsets, each sequence its own count (its splits' partials
    [heads, total_q]). ``score_mod`` / ``mask_mod`` name traced
    mods (their digests), evaluated per score element; the kernels then take the mods' arrays."""

    head_dim: int
    dtype: str
    cache_dtype: str
    paged: bool
    warps_m: int
    block_n: int
    num_stages: int
    arch: str
    varlen: bool = False  # packed sequences of their own lengths (attention_varlen)
    score_mod: str = ""   # digest of a traced score_mod (mod_codegen.register); "" for none
    mask_mod: str = ""    # digest of a traced mask_mod; "" for none
    packed_q: bool = False  # packed queries of their own counts over a cache (cu_seqlens_q)
    leftpad: bool = False   # each sequence's keys start at its cache_leftpad row (contiguous caches)

    def __post_init__(self):
        problems = []
        if self.varlen and (self.paged or self.fp8 or self.packed_q):
            problems.append("varlen specs read packed 16-bit keys (no page table, no FP8; packed queries already)")
        if self.leftpad and (self.paged or self.varlen):
            problems.append("leftpad specs read a contiguous cache (no page table, no packed keys)")
        if self.head_dim not in HEAD_DIMS:
            problems.append(f"head_dim={self.head_dim} (supported: multiples of 8 from 8 to 256)")
        if self.dtype not in QUERY_DTYPES:
            problems.append(f"dtype={self.dtype!r} (supported: {', '.join(QUERY_DTYPES)})")
        if self.cache_dtype not in CACHE_DTYPES or (self.cache_dtype in QUERY_DTYPES and self.cache_dtype != self.dtype):
            problems.append(f"cache_dtype={self.cache_dtype!r} with dtype={self.dtype!r} (the cache holds the "
                            f"queries' dtype or FP8 codes, e4m3 or e5m2)")
        elif self.fp8 and self.head_dim % 16:
            problems.append(f"head_dim={self.head_dim}: an FP8 cache takes head dims that are multiples of 16")
        if self.arch not in ARCHS:
            problems.append(f"arch={self.arch!r} (supported: {', '.join(ARCHS)})")
        if self.warps_m not in (1, 2, 4):
            problems.append(f"warps_m={self.warps_m} (1, 2 or 4)")
        elif self.block_n % (16 * (WARPS // self.warps_m)) or not 16 <= self.block_n <= 128:
            problems.append(f"block_n={self.block_n} must be a multiple of {16 * (WARPS // self.warps_m)} "
                            f"up to 128 (16 keys per key group)")
        if self.num_stages < 2 or self.num_stages > 8:
            problems.append(f"num_stages={self.num_stages} (2 to 8)")
        if not problems and self.arch in SMEM_LIMIT and self.smem_bytes > SMEM_LIMIT[self.arch]:
            problems.append(f"{self.smem_bytes} bytes of shared memory exceed {self.arch}'s "
                            f"{SMEM_LIMIT[self.arch]}")
        if problems:
            raise ValueError("invalid decode spec: " + "; ".join(problems))

    def replace(self, **changes) -> "DecodeSpec":
        return replace(self, **changes)

    @property
    def has_mods(self) -> bool:
        """Whether the kernels take the Mods struct (the captured arrays) as a second argument."""
        return bool(self.score_mod or self.mask_mod)

    @property
    def fp8(self) -> bool:
        return self.cache_dtype in ("e4m3", "e5m2")

    @property
    def name(self) -> str:
        paged = ("_paged" if self.paged else "") + ("_packed" if self.packed_q else "") + ("_leftpad" if self.leftpad else "")
        kind = "varlen" if self.varlen else "kvcache"
        mods = (f"_sm{self.score_mod}" if self.score_mod else "") + (f"_mm{self.mask_mod}" if self.mask_mod else "")
        return (f"{kind}_{self.dtype}_{self.cache_dtype}{paged}_hd{self.head_dim}_m{16 * self.warps_m}"
                f"n{self.block_n}s{self.num_stages}_{self.arch}{mods}")

    @property
    def kernel_names(self) -> tuple[str, str, str]:
        return (f"{self.name}_attend", f"{self.name}_append", f"{self.name}_merge")

    @property
    def threads(self) -> int:
        return 32 * WARPS

    @property
    def merge_rows(self) -> int:
        """Query rows per block of the merge kernel: one (row, 4 dims) item per thread."""
        return max(1, self.threads // (self.head_dim // 4))

    @property
    def block_m(self) -> int:
        """Query rows (tokens x heads of one kv head) per block."""
        return 16 * self.warps_m

    @property
    def padded_head_dim(self) -> int:
        return ceil_div(self.head_dim, 16) * 16

    @property
    def chunks(self) -> int:
        """16-byte chunks of a 16-bit shared-memory row."""
        return self.padded_head_dim * 2 // _CHUNK

    @property
    def smem_row_bytes(self) -> int:
        """Row pitch of the 16-bit tiles: an odd number of chunks (conflict-free ldmatrix)."""
        return (self.chunks | 1) * _CHUNK

    @property
    def cache_elem_bytes(self) -> int:
        return 1 if self.fp8 else 2

    @property
    def src_chunks(self) -> int:
        """16-byte chunks of a cache row."""
        return self.head_dim * self.cache_elem_bytes // _CHUNK

    @property
    def src_row_bytes(self) -> int:
        """Row pitch of a staged FP8 tile (unpadded: each thread reads back its own copies)."""
        return self.head_dim

    @property
    def swizzled(self) -> bool:
        """16-bit ring stages of unpadded rows, each row's chunks permuted by XOR with row % 8
        (warp_mma.cuh's chunk_offset), at head dims 64 and 128: a padded pitch splits the copies
        of a warp into more L2 requests than whole rows do. Beyond 128 the swizzled addresses of
        the key tile's products spill registers."""
        return not self.fp8 and self.head_dim in (64, 128)

    @property
    def wgmma(self) -> bool:
        """Hopper, 16-bit caches at head dim 128, 64 rows: the block is one warpgroup whose
        products are wgmma, reading each K and V tile from shared memory once for all its rows
        (mma.sync reads it once per warp); its stages take wgmma's 128-byte swizzled layout."""
        return (self.arch == "sm90a" and not self.fp8 and self.head_dim == 128 and self.warps_m == WARPS
                and self.block_n == 64)

    @property
    def fp8_in_registers(self) -> bool:
        """An FP8 cache at head dim 128 goes from its staged codes straight into the products'
        fragments (no fp16 tiles in shared memory); its stages are swizzled for those reads."""
        return self.fp8 and self.head_dim == 128

    @property
    def src_pitch(self) -> int:
        if self.fp8:
            return self.src_row_bytes
        return self.chunks * _CHUNK if self.swizzled else self.smem_row_bytes

    @property
    def stage_bytes(self) -> int:
        """One stage of the ring: a K tile and a V tile."""
        return 2 * self.block_n * self.src_pitch

    @property
    def smem_k16(self) -> int:
        return self.block_m * self.smem_row_bytes

    @property
    def smem_v16(self) -> int:
        return self.smem_k16 + self.block_n * self.smem_row_bytes

    @property
    def smem_stages(self) -> int:
        """Offset of the ring: after Q (and, FP8 through shared memory, the converted K and V tiles)."""
        fp16_tiles = self.fp8 and not self.fp8_in_registers
        return self.smem_v16 + self.block_n * self.smem_row_bytes if fp16_tiles else self.smem_k16

    @property
    def padded_rows(self) -> int:
        """16-bit rows from the start of shared memory (their padding chunk is zeroed once)."""
        if self.fp8:
            return self.block_m + (0 if self.fp8_in_registers else 2 * self.block_n)
        return self.block_m + 2 * self.block_n * self.num_stages

    @property
    def smem_row_shift(self) -> int:
        """Offset of the per-row powers of two of bf16 queries converted to fp16 (FP8 caches)."""
        key_groups = WARPS // self.warps_m
        merge = 4 * (2 * key_groups * self.block_m + (key_groups - 1) * self.block_m * self.padded_head_dim)
        splits = 4 * (self.block_m * MAX_SPLITS + 1)  # the splits' merge: weights per row and split
        return self.smem_stages + max(self.num_stages * self.stage_bytes, merge, splits)

    @property
    def smem_bytes(self) -> int:
        """With room to align the start to 1024 bytes (wgmma's swizzle atoms) where wgmma reads it."""
        return (self.smem_row_shift + (4 * self.block_m if self.fp8 and self.dtype == "bf16" else 0)
                + (1024 if self.wgmma else 0))

    @property
    def q_in_registers(self) -> bool:
        """Q's fragments stay in registers up to head dim 128 (beyond, they would spill)."""
        return self.padded_head_dim <= 128

    @property
    def fp8_exact_convert(self) -> bool:
        """e4m3 codes convert by the cvt instruction (sm_89 and newer), to their exact value."""
        return self.cache_dtype == "e4m3" and self.arch not in ("sm80", "sm86", "sm87")

