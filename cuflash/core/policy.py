"""Tile policy: which specialization runs for a problem.

:mod:`cuflash.core.spec` says what a kernel is; this module says which one runs, and nothing else
chooses. Every hand-set choice is a row of a table below with a one-line reason; the measurements
behind each row are in ``docs/tuning.md``. The portable family's tiles per target come from
:mod:`cuflash.core.tuned_defaults` (written by ``python -m cuflash tune``), with a user's tuned
file (``CUFLASH_TUNED_DEFAULTS``) on top.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

from . import dtypes
from .bwd_spec import BWD_WGMMA_HEAD_DIMS, BwdSpec
from .decode_spec import QUERY_DTYPES, DecodeSpec
from .spec import FAMILIES, HEAD_DIMS, SMEM_LIMIT, KernelSpec, tiles_head_dim

# -- what selects a row ---------------------------------------------------------------------------

#: A problem whose longer sequence (queries or keys) has at most this many tokens takes the
#: "short" rows of the Hopper table, any other the "long" ones.
SHORT_SEQLEN = 1024

#: One sequence length of each length class (:func:`length_class`).
CLASS_SEQLENS = (SHORT_SEQLEN, None)


def length_class(seqlen: int | None) -> str:
    """``"short"`` for at most :data:`SHORT_SEQLEN` tokens, ``"long"`` beyond or when unknown."""
    return "short" if seqlen is not None and seqlen <= SHORT_SEQLEN else "long"


# -- the Hopper forward: one row per (dtype class, tiles, causal, length class) --------------------

@dataclass(frozen=True)
class Schedule:
    """The tile shape and schedule switches of one warp-specialized Hopper forward
    (:class:`~cuflash.core.spec.KernelSpec` fields of the same names; block_m 192 means three
    consumer warpgroups)."""

    block_m: int
    block_n: int
    num_stages: int
    pingpong: bool = True
    lazy_rescale: bool = False
    half_first_tile: bool = False  # applied at the tiles' own head dim only (padded ones keep whole tiles)
    early_rescale: bool = False
    sums_on_tensor_cores: bool = False  # for calls that take no LSE


@dataclass(frozen=True)
class Rule:
    """One row of :data:`HOPPER_FORWARD`: the schedule of the problems it selects. ``causal`` or
    ``length`` None selects both values."""

    dtype_class: str      # "16bit" (fp16, bf16) or "fp8" (e4m3, e5m2)
    tiles: int            # head dim whose tiles these are (narrower head dims run them padded)
    causal: bool | None
    length: str | None    # "short", "long" (length_class) or None
    schedule: Schedule
    reason: str


HOPPER_FORWARD = (
    Rule("16bit", 64, False, "long", Schedule(192, 128, 2),
         "three consumers: at head dim 64 the softmax outweighs the products"),
    Rule("16bit", 64, False, "short", Schedule(192, 128, 3),
         "a third stage hides the loads of short key loops"),
    Rule("16bit", 64, True, "long", Schedule(192, 128, 2),
         "three consumers, as without a mask; from 2k tokens the long tiles win"),
    Rule("16bit", 64, True, "short", Schedule(128, 128, 4, half_first_tile=True),
         "short causal rows: smaller query tiles, and the half-seen diagonal tile computed half wide"),
    Rule("16bit", 96, False, None, Schedule(128, 128, 2, pingpong=False),
         "without a mask the consumers gain more by issuing freely than by taking turns"),
    Rule("16bit", 96, True, None, Schedule(128, 128, 2),
         "the turns keep the tensor cores busy beside the masked tiles' softmax"),
    Rule("16bit", 128, False, None, Schedule(128, 128, 2, pingpong=False),
         "without a mask the consumers gain more by issuing freely than by taking turns"),
    Rule("16bit", 128, True, None, Schedule(128, 128, 2),
         "the turns keep the tensor cores busy beside the masked tiles' softmax"),
    Rule("16bit", 192, None, None, Schedule(128, 96, 2),
         "the widest key tile whose two stages fit beside Q"),
    Rule("16bit", 256, None, None, Schedule(128, 80, 2, lazy_rescale=True),
         "the output's rescale weighs most at 256 columns: the row max moves lazily"),
    Rule("fp8", 64, None, None, Schedule(192, 128, 2),
         "three consumers on 64-byte rows, as 16-bit head dim 64"),
    Rule("fp8", 128, False, None, Schedule(128, 224, 2, pingpong=False, lazy_rescale=True, early_rescale=True),
         "wide key tiles amortize the softmax; O rescaled under the next Q K^T"),
    Rule("fp8", 128, True, None, Schedule(128, 192, 2, pingpong=False),
         "224 keys lose on the causal diagonal; no turns once the mask loops apart"),
    Rule("fp8", 256, None, None, Schedule(128, 128, 2, sums_on_tensor_cores=True),
         "no registers for wider key tiles; row sums on the tensor cores where no LSE is taken"),
)

#: The shapes ``python -m cuflash tune --family wgmma`` times per 16-bit tiles head dim, (block_m,
#: block_n, num_stages); each table row's own shape is among them.
HOPPER_CANDIDATES = {
    64: [(192, 128, 2), (192, 128, 3), (192, 96, 4), (128, 128, 2), (128, 128, 4), (128, 192, 3)],
    96: [(128, 128, 2), (128, 176, 2), (128, 128, 3), (128, 96, 3)],
    128: [(128, 128, 2), (128, 176, 2), (128, 144, 2), (128, 128, 3), (128, 96, 3)],
    192: [(128, 96, 2), (128, 112, 2), (128, 64, 3)],
    256: [(128, 80, 2), (128, 64, 2), (128, 48, 3)],
}

#: Head dims with Hopper tiles of their own, per dtype class; others take the next wider one's.
HOPPER_TILES = {c: tuple(sorted({r.tiles for r in HOPPER_FORWARD if r.dtype_class == c})) for c in ("16bit", "fp8")}

#: The Hopper forward is the default from these head dims up (fp16/bf16; FP8, multiples of 16):
#: below, the padding to whole column blocks costs what warpgroup MMAs gain.
WGMMA_MIN_HEAD_DIM = 24
FP8_WGMMA_MIN_HEAD_DIM = 32

#: Head dims the Hopper kernel is the default for (fp16/bf16, sm90a).
WGMMA_HEAD_DIMS = tuple(d for d in HEAD_DIMS if d >= WGMMA_MIN_HEAD_DIM)


def hopper_rule(dtype_class: str, tiles: int, causal: bool, length: str) -> Rule:
    """The row of :data:`HOPPER_FORWARD` that selects a problem (exactly one does)."""
    rows = [r for r in HOPPER_FORWARD if (r.dtype_class, r.tiles) == (dtype_class, tiles)
            and r.causal in (None, causal) and r.length in (None, length)]
    if len(rows) != 1:
        raise LookupError(f"{len(rows)} rows of HOPPER_FORWARD select ({dtype_class}, {tiles}, {causal}, {length})")
    return rows[0]


def wgmma_tile_head_dim(head_dim: int) -> int:
    """The head dim whose tiles a 16-bit head dim takes on the Hopper kernel: the smallest one with
    tiles of its own at least as wide (80 runs 96's tiles, computed at 128 columns)."""
    return tiles_head_dim(head_dim, HOPPER_TILES["16bit"])


def fp8_wgmma_tile_head_dim(head_dim: int) -> int:
    """The same for FP8 (96 runs 128's tiles, 160 runs 256's)."""
    return tiles_head_dim(head_dim, HOPPER_TILES["fp8"])


def fp8_wgmma_covers(head_dim: int, arch: str) -> bool:
    """Whether the Hopper FP8 kernel can run a head dim on a target (it need not be the default):
    TMA copies rows of whole 16 bytes."""
    return arch == "sm90a" and head_dim in HEAD_DIMS and head_dim % 16 == 0


# -- the portable family: ladders, best first ------------------------------------------------------

#: Candidate tiles of the portable 16-bit forward, fastest first: (largest head_dim,
#: [(block_m, block_n, num_warps, num_stages, overlap)]). ``tune`` keeps the first spill-free one
#: per target; a target missing from the tuned table takes the first that fits.
MMA_CANDIDATES = (
    (64, [(128, 64, 4, 3, True), (128, 64, 4, 2, False), (128, 32, 4, 3, True), (128, 32, 4, 2, False),
          (64, 64, 4, 2, False), (64, 32, 4, 2, False)]),
    (128, [(128, 64, 4, 2, False), (128, 48, 4, 3, False), (128, 48, 4, 2, False), (128, 32, 4, 3, True),
           (128, 32, 4, 2, False), (64, 64, 4, 2, False), (64, 32, 4, 2, False), (64, 16, 4, 2, False)]),
    (256, [(128, 32, 8, 3, True), (128, 64, 8, 2, False), (128, 48, 8, 2, False), (128, 32, 8, 2, False),
           (64, 32, 4, 2, False), (64, 16, 4, 2, False)]),
)

#: Tiles of the float32 family: (largest head_dim, block_m, block_n, num_warps); block_m shrinks
#: (16, 8) where shared memory is short.
SIMT_DEFAULTS = ((128, 32, 32, 8), (256, 16, 32, 8))

#: Tiles of the portable FP8 kernel, best first: (largest head_dim, block_m, block_n, num_warps,
#: num_stages). 16 query rows per warp leave registers for the on-chip conversion; smaller
#: targets take the later rows.
FP8_PORTABLE_CANDIDATES = ((128, 128, 64, 8, 2), (256, 128, 32, 8, 2), (256, 64, 32, 4, 2), (256, 64, 16, 4, 2))


def mma_candidates(head_dim: int) -> list:
    """The rows of :data:`MMA_CANDIDATES` for a head dim."""
    return next(rows for bound, rows in MMA_CANDIDATES if head_dim <= bound)


# -- the backward ------------------------------------------------------------------------------------

#: Candidate tiles of the portable tensor-core backward, best first: (largest head_dim, block_m,
#: block_n, num_warps, num_stages). Head dims over 128 split the head dim between two warps.
BWD_CANDIDATES = (
    (128, 64, 128, 8, 2), (128, 64, 64, 4, 2), (128, 32, 64, 4, 2), (128, 16, 32, 2, 2),
    (256, 64, 64, 8, 2), (256, 32, 64, 8, 2), (256, 16, 64, 8, 2), (256, 16, 32, 4, 2),
)

#: The Hopper backward per head dim it computes: (block_m, block_n, num_warps, num_stages).
#: A third query tile in flight pays where the tiles are small (64); 256 halves the key tile to
#: keep dK and dV in registers.
HOPPER_BACKWARD = {64: (64, 128, 8, 3), 128: (64, 128, 8, 2), 256: (64, 64, 8, 2)}

#: The narrowest head dim the Hopper backward is the default for, by the width it is padded to:
#: below, the padding costs more than the warpgroup MMAs gain.
BWD_WGMMA_MIN_HEAD_DIM = {64: 40, 128: 72, 256: 176}

#: Tiles of the float32 backward: (block_m, block_n, num_warps).
BWD_SIMT_TILES = (32, 32, 8)


def bwd_wgmma_is_default(head_dim: int) -> bool:
    """Whether the Hopper backward is the default at a head dim (fp16/bf16, sm90a)."""
    return head_dim >= BWD_WGMMA_MIN_HEAD_DIM[tiles_head_dim(head_dim, BWD_WGMMA_HEAD_DIMS)]


# -- launch thresholds (read by cuflash.core.launch) ---------------------------------------------------

#: The warp-specialized kernel runs persistent (one block per multiprocessor) up to this many keys:
#: a tile's loads then overlap the previous tile's epilogue; beyond, one block per tile wins.
PERSISTENT_MAX_SEQLEN_K = 4096

#: Keys up to which 16-bit launches keep whole tiles rather than dealing the last wave out by keys
#: (the merge costs more than the balance gains there; FP8 gains, so it always splits).
WHOLE_TILES_MAX_SEQLEN_K_16BIT = 1024

#: Bytes of K and V one band of causal work tiles may span: a share of the L2 (60 MB on an H200), less
#: up to BAND_SHORT_SEQLEN keys, where more heads per band meant fewer tiles sharing first reads.
BAND_BYTES = 16 << 20
BAND_SHORT_BYTES, BAND_SHORT_SEQLEN = 4 << 20, 512



# -- KV-cache attention (cuflash.kvcache) ----------------------------------------------------------

#: Keys per tile of the KV-cache kernel: 16 per key group when the 4 warps take 16 rows, and 64
#: keys for the 16 rows of each warp when they take 64.
DECODE_BLOCK_N = 64
#: Head dims over 128 with 64 rows per block: half the keys per tile, or the output and the scores
#: of a warp's 16 rows spill.
DECODE_WIDE_BLOCK_N = 32

#: Shared memory one KV-cache block may take, so that two blocks share a multiprocessor (their
#: cp.async rings keep enough bytes in flight for the memory bandwidth); the stages fill it.
DECODE_SMEM_BUDGET = 112 * 1024
DECODE_MAX_STAGES = 4

#: Splits of the key range fill one wave of this many blocks per multiprocessor, and keep at
#: least this many key tiles each (the merge's reads stay small beside the cache's). One block per
#: SM streams a contiguous cache faster with one row group (decode; FP8 where its codes go straight
#: into the fragments); paged caches and more query rows (more work per byte) run faster at two.
DECODE_BLOCKS_PER_SM = 2
DECODE_BLOCKS_PER_SM_STREAMING = 1
DECODE_MIN_TILES_PER_SPLIT = 4
#: Memories of at least this peak bandwidth (GB/s, from the runtime's memory clock and bus width;
#: the H200's HBM3e) feed an FP8 cache faster than one block per multiprocessor dequantizes it:
#: FP8 caches take two blocks there.
DECODE_FP8_FAST_MEMORY_GBS = 3800
#: A row tile whose splits' float32 partials pass this many bytes is merged by the merge kernel
#: (blocks of a few rows over the whole GPU) rather than by its last split (one block).
DECODE_MERGE_APART_BYTES = 256 * 1024


def decode_merge_apart(spec, rows: int, splits: int) -> bool:
    """Whether the splits of a decode launch (``rows`` query rows per kv head) are merged by the
    merge kernel (see DECODE_MERGE_APART_BYTES)."""
    return splits > 1 and splits * min(rows, spec.block_m) * spec.head_dim * 4 > DECODE_MERGE_APART_BYTES


def decode_blocks_per_sm(spec, memory_gbs: float = 0) -> int:
    """Blocks per multiprocessor that a decode spec's splits fill (see DECODE_BLOCKS_PER_SM) on a
    device whose memory's peak bandwidth is `memory_gbs` (see DECODE_FP8_FAST_MEMORY_GBS)."""
    streaming = not spec.paged and spec.warps_m == 1 and (not spec.fp8 or spec.fp8_in_registers)
    if spec.fp8 and memory_gbs >= DECODE_FP8_FAST_MEMORY_GBS:
        streaming = False
    return DECODE_BLOCKS_PER_SM_STREAMING if streaming else DECODE_BLOCKS_PER_SM


def decode_warps_m(rows: int) -> int:
    """Row groups of 16 per block for `rows` query rows per kv head (tokens x grouped heads)."""
    return 1 if rows <= 16 else 2 if rows <= 32 else 4


def decode_spec(head_dim: int, dtype: str, cache_dtype: str, paged: bool, rows: int, arch: str, varlen: bool = False,
                packed_q: bool = False, leftpad: bool = False):
    """The KV-cache (or varlen) specialization for one problem class; stages fill DECODE_SMEM_BUDGET."""
    warps_m = decode_warps_m(rows)
    block_n = DECODE_WIDE_BLOCK_N if head_dim > 128 and warps_m == 4 else DECODE_BLOCK_N
    spec = DecodeSpec(head_dim, dtype, cache_dtype, paged, warps_m, block_n, 2, arch, varlen, packed_q=packed_q,
                      leftpad=leftpad)
    stages = (DECODE_SMEM_BUDGET - spec.smem_stages) // spec.stage_bytes
    return replace(spec, num_stages=max(2, min(DECODE_MAX_STAGES, stages)))


def decode_splits(blocks: int, key_tiles: int, sms: int, per_sm: int = DECODE_BLOCKS_PER_SM) -> int:
    """Splits of the key range for `blocks` blocks without splits over sequences of up to
    `key_tiles` tiles: as many as fit `per_sm` blocks per multiprocessor in a single wave (none
    when the blocks fill them already), with at least DECODE_MIN_TILES_PER_SPLIT tiles each."""
    most = max(1, min(128, key_tiles // DECODE_MIN_TILES_PER_SPLIT))
    return max(1, min(most, per_sm * sms // max(blocks, 1)))

# -- tuned tables ------------------------------------------------------------------------------------

#: Environment variable naming a tuned file (written by ``python -m cuflash tune --output``) whose
#: entries take precedence over the shipped ones.
TUNED_ENV = "CUFLASH_TUNED_DEFAULTS"


def read_tuned_file(path) -> tuple[dict, dict]:
    """(TABLE, WGMMA_TABLE) of a file written by ``tune``: Python literals, never executed."""
    import ast

    tables = {"TABLE": {}, "WGMMA_TABLE": {}}
    tree = ast.parse(open(path).read(), str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", None) in tables:
            tables[node.targets[0].id] = ast.literal_eval(node.value)
    return tables["TABLE"], tables["WGMMA_TABLE"]


@functools.lru_cache(maxsize=1)
def tuned_tables() -> tuple[dict, dict]:
    """The portable family's tiles by (arch, head_dim, causal) and the Hopper shapes by (head_dim,
    causal, length class) that override :data:`HOPPER_FORWARD`'s: the shipped table, then the
    entries of the file named by ``CUFLASH_TUNED_DEFAULTS`` (read once per process)."""
    from .tuned_defaults import TABLE, WGMMA_TABLE

    table, wgmma = dict(TABLE), dict(WGMMA_TABLE)
    path = os.environ.get(TUNED_ENV)
    if path:
        try:
            extra, extra_wgmma = read_tuned_file(path)
        except (OSError, SyntaxError, ValueError) as exc:
            raise ValueError(f"{TUNED_ENV}={path!r} is not a readable tuned file "
                             f"(python -m cuflash tune --output): {exc}") from None
        table.update(extra)
        wgmma.update(extra_wgmma)
    return table, wgmma


# -- lookups -----------------------------------------------------------------------------------------

def _dtype(dtype) -> dtypes.DType:
    return dtypes.lookup(dtype)


def _check_common(head_dim, causal, arch) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim!r} is not supported (multiples of 8 from 8 to 256)")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if arch not in SMEM_LIMIT:
        raise ValueError(f"arch={arch!r} is not supported (one of {list(SMEM_LIMIT)})")


def _check_family(family) -> None:
    if family is not None and family not in FAMILIES:
        raise ValueError(f"family={family!r} is not one of {FAMILIES}")


def default_family(head_dim: int, dtype, arch: str) -> str:
    """The family cuflash runs by default: wgmma on Hopper from head dim
    :data:`WGMMA_MIN_HEAD_DIM` up (FP8: multiples of 16 from :data:`FP8_WGMMA_MIN_HEAD_DIM`),
    else the portable tensor-core kernel (fp16/bf16, FP8 codes) or the exact float32 one."""
    entry = _dtype(dtype)
    if not entry.tensor_core:
        return "simt"
    if entry.tag in dtypes.FP8_DTYPES:
        return "wgmma" if fp8_wgmma_covers(head_dim, arch) and head_dim >= FP8_WGMMA_MIN_HEAD_DIM else "mma"
    if arch == "sm90a" and head_dim >= WGMMA_MIN_HEAD_DIM:
        return "wgmma"
    return "mma"


def _fits(**kwargs) -> KernelSpec | None:
    try:
        return KernelSpec(**kwargs)
    except ValueError:
        return None


def _hopper_spec(head_dim: int, entry: dtypes.DType, causal: bool, arch: str, seqlen, out_dtype, lse: bool) -> KernelSpec:
    fp8 = entry.tag in dtypes.FP8_DTYPES
    tiles = fp8_wgmma_tile_head_dim(head_dim) if fp8 else wgmma_tile_head_dim(head_dim)
    length = length_class(seqlen)
    schedule = hopper_rule("fp8" if fp8 else "16bit", tiles, causal, length).schedule
    shape = None if fp8 else tuned_tables()[1].get((tiles, causal, length))
    if shape is not None:
        schedule = replace(schedule, block_m=shape[0], block_n=shape[1], num_stages=shape[2])
    return KernelSpec(head_dim, entry.tag, causal, schedule.block_m, schedule.block_n, 4 + schedule.block_m // 16,
                      schedule.num_stages, arch, overlap=True, family="wgmma", warp_specialized=True,
                      pingpong=schedule.pingpong, lazy_rescale=schedule.lazy_rescale,
                      half_first_tile=schedule.half_first_tile and head_dim == tiles,
                      early_rescale=schedule.early_rescale,
                      lse=lse or not (fp8 and schedule.sums_on_tensor_cores),
                      **({"out_dtype": out_dtype or "bf16"} if fp8 else {}))


def default_spec(head_dim: int, dtype, causal: bool, arch: str, family: str | None = None,
                 out_dtype=None, seqlen: int | None = None, lse: bool = True) -> KernelSpec:
    """The default specialization for a problem.

    ``dtype``: a tag (``"bf16"``, ``"e4m3"``), an alias (``"float16"``) or a dtype object
    (``numpy.float16``, ``ml_dtypes.bfloat16``). ``family`` (default: :func:`default_family`)
    picks the kernel family. The Hopper family's row comes from :data:`HOPPER_FORWARD` by
    ``seqlen`` (the longer of the problem's query and key lengths; None: long); the portable
    family's tiles from the tuned table, else the first of :data:`MMA_CANDIDATES` that fits. FP8
    inputs (output ``out_dtype``, default bf16) run the Hopper FP8 kernel where it has the head
    dim, else the portable kernel, which converts the codes on chip (:func:`fp8_portable_spec`).
    ``lse=False``: the caller takes no LSE, so the Hopper FP8 kernel may sum P on the tensor
    cores where its row says so."""
    entry = _dtype(dtype)
    _check_common(head_dim, causal, arch)
    _check_family(family)
    if out_dtype is not None and entry.tag not in dtypes.FP8_DTYPES:
        raise ValueError(f"out_dtype={out_dtype!r} applies to FP8 inputs only (dtype={entry.tag})")
    family = family or default_family(head_dim, entry, arch)
    if entry.tag in dtypes.FP8_DTYPES:
        out_tag = _dtype(out_dtype or "bf16").tag
        if out_tag not in dtypes.FP8_OUT_TAGS:
            raise ValueError(f"out_dtype={out_dtype!r} is not an FP8 output dtype (one of {dtypes.FP8_OUT_TAGS})")
        if family == "mma":
            return fp8_portable_spec(head_dim, entry.tag, causal, arch, out_tag)
        if not fp8_wgmma_covers(head_dim, arch) or family != "wgmma":
            raise ValueError(f"FP8 attention has a Hopper kernel (family wgmma) for head dims that are "
                             f"multiples of 16 on sm90a and the portable one (family mma) everywhere; "
                             f"got head_dim={head_dim}, arch={arch!r}, family={family!r}")
        return _hopper_spec(head_dim, entry, causal, arch, seqlen, out_tag, lse)
    if family == "wgmma":
        if arch != "sm90a" or not entry.tensor_core:
            raise ValueError(f"the wgmma family covers fp16/bf16 on sm90a; "
                             f"got head_dim={head_dim}, dtype={entry.tag}, arch={arch}")
        return _hopper_spec(head_dim, entry, causal, arch, seqlen, None, lse)
    if (family == "mma") != entry.tensor_core:
        raise ValueError(f"family={family!r} does not take dtype={entry.tag} (mma, wgmma: fp16/bf16; simt: fp32)")
    if entry.tensor_core:
        chosen = tuned_tables()[0].get((arch, head_dim, causal))
        if chosen is not None:
            bm, bn, w, s, ov = chosen
            return KernelSpec(head_dim, entry.tag, causal, bm, bn, w, s, arch, ov)
        for bm, bn, w, s, ov in mma_candidates(head_dim):
            spec = _fits(head_dim=head_dim, dtype=entry.tag, causal=causal, block_m=bm, block_n=bn,
                         num_warps=w, num_stages=s, arch=arch, overlap=ov)
            if spec:
                return spec
    else:
        _, bm, bn, w = next(row for row in SIMT_DEFAULTS if head_dim <= row[0])
        for bm_try in (bm, 16, 8):
            spec = _fits(head_dim=head_dim, dtype=entry.tag, causal=causal, block_m=bm_try,
                         block_n=bn, num_warps=w, num_stages=1, arch=arch)
            if spec:
                return spec
    raise ValueError(f"no kernel for head_dim={head_dim}, dtype={entry.tag} fits the shared memory of {arch}")


def fp8_portable_spec(head_dim: int, fmt: str, causal: bool, arch: str, out_dtype: str = "bf16") -> KernelSpec:
    """The portable kernel for FP8 codes (family mma), which converts them to fp16 on chip: the
    first row of :data:`FP8_PORTABLE_CANDIDATES` that covers the head dim and fits the target."""
    _check_common(head_dim, causal, arch)
    if fmt not in dtypes.FP8_DTYPES:
        raise ValueError(f"fmt={fmt!r} is not an FP8 format (one of {sorted(dtypes.FP8_DTYPES)})")
    for max_d, bm, bn, w, s in FP8_PORTABLE_CANDIDATES:
        spec = _fits(head_dim=head_dim, dtype=fmt, causal=causal, block_m=bm, block_n=bn, num_warps=w,
                     num_stages=s, arch=arch, family="mma", out_dtype=out_dtype) if head_dim <= max_d else None
        if spec:
            return spec
    raise ValueError(f"no portable FP8 kernel for head_dim={head_dim}, {fmt} fits the shared memory of {arch}")


def default_bwd_spec(head_dim: int, dtype, causal: bool, arch: str, deterministic: bool = False,
                     family: str | None = None) -> BwdSpec:
    """The backward specialization cuflash runs for a problem: wgmma on Hopper where it applies
    (:data:`HOPPER_BACKWARD`), else the first of :data:`BWD_CANDIDATES` whose shared memory fits
    the target (float32: simt, always deterministic). ``family`` forces one."""
    entry = _dtype(dtype)
    _check_common(head_dim, causal, arch)
    _check_family(family)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    if entry.tag in dtypes.FP8_DTYPES:
        raise ValueError(f"dtype={entry.tag!r}: FP8 attention has a forward only; the backward takes fp16, bf16 "
                         f"or fp32")
    if family is None:
        family = "simt" if not entry.tensor_core else \
            "wgmma" if arch == "sm90a" and bwd_wgmma_is_default(head_dim) else "mma"
    if (family == "simt") == entry.tensor_core:
        raise ValueError(f"family={family!r} does not take dtype={entry.tag} (mma, wgmma: fp16/bf16; simt: fp32)")
    if family == "simt":
        bm, bn, w = BWD_SIMT_TILES
        return BwdSpec(head_dim, entry.tag, causal, bm, bn, w, 1, arch, deterministic=True)
    if family == "wgmma":
        if arch != "sm90a":
            raise ValueError(f"the wgmma backward needs arch sm90a (got arch={arch!r})")
        bm, bn, w, s = HOPPER_BACKWARD[tiles_head_dim(head_dim, BWD_WGMMA_HEAD_DIMS)]
        return BwdSpec(head_dim, entry.tag, causal, bm, bn, w, s, arch, deterministic, family="wgmma", tma_loads=True)
    for max_d, bm, bn, w, s in BWD_CANDIDATES:
        if head_dim > max_d:
            continue
        try:
            return BwdSpec(head_dim, entry.tag, causal, bm, bn, w, s, arch, deterministic)
        except ValueError:
            continue
    raise ValueError(f"no backward kernel for head_dim={head_dim}, dtype={entry.tag} fits the shared memory of {arch}")


# -- the sets the tests and warmup compile -------------------------------------------------------------

#: Head dims of the portable FP8 set that the tests compile and run: those of the Hopper FP8
#: kernel, 96 (Hopper has none) and two that are not multiples of 32 or, at 72, of 16.
FP8_PORTABLE_TEST_HEAD_DIMS = (64, 72, 80, 96, 128, 256)


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


def all_fp8_specs(arch: str = "sm90a", causal=(False, True), lse=(True, False)) -> list[KernelSpec]:
    """The Hopper FP8 specializations of a target at the head dims with tiles of their own:
    formats x head dims x causal x output dtypes, with and without the LSE where they differ
    (none off sm90a; the portable ones are :func:`all_fp8_portable_specs`)."""
    if arch != "sm90a":
        return []
    return list(dict.fromkeys(default_spec(d, t, c, arch, out_dtype=o, lse=e) for t in dtypes.FP8_DTYPES
                              for d in HOPPER_TILES["fp8"] for c in causal for o in dtypes.FP8_OUT_TAGS for e in lse))


def all_fp8_portable_specs(arch: str, head_dims=FP8_PORTABLE_TEST_HEAD_DIMS, causal=(False, True)) -> list[KernelSpec]:
    """The portable FP8 specializations (family mma) of a target: formats x head dims x causal x
    output dtypes, the set the tests compile and warm up."""
    return [fp8_portable_spec(d, t, c, arch, o) for t in dtypes.FP8_DTYPES for d in head_dims
            for c in causal for o in dtypes.FP8_OUT_TAGS]


def all_default_bwd_specs(arch: str, dtype_tags=None, causal=(False, True), deterministic=(False, True)) -> list[BwdSpec]:
    """Every default backward specialization of a target (the set the tests warm up)."""
    tags = dtype_tags or list(dtypes.DTYPES)
    return list(dict.fromkeys(default_bwd_spec(d, t, c, arch, det) for t in tags for d in HEAD_DIMS
                              for c in causal for det in deterministic))


def all_decode_specs(arch: str = "sm90a") -> list[DecodeSpec]:
    """The default KV-cache specialization of every head dim, dtype, cache dtype, paging and row
    tile on a target (the set the offline compiles and the pinned sources cover)."""
    return list(dict.fromkeys(
        decode_spec(d, t, c, paged, rows, arch) for d in HEAD_DIMS for t in QUERY_DTYPES for c in (t, "e4m3", "e5m2")
        if not (c in ("e4m3", "e5m2") and d % 16) for paged in (False, True) for rows in (16, 32, 64)))
