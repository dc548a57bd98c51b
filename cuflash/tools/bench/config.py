"""The benchmark's configurations: the FlashAttention papers' grid, the modes, the spec overrides."""
from __future__ import annotations

from dataclasses import dataclass

from cuflash.core.spec import WS_SCHEDULE_FIELDS

DEFAULT_HEAD_DIMS = (64, 128, 256)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
OVERHEAD_PROBLEM = dict(batch=1, heads=1, seqlen=16, head_dim=64, dtype="bf16")

FP8 = "fp8"
BENCH_DTYPES = ("fp16", "bf16", "fp32", FP8)
#: Key and table label of cuflash's bf16 kernel, timed beside FP8 at the same shape.
BF16_PEER = ("cuflash-bf16", "cuflash bf16")
#: Key and table label of cuflash's FP8 call on a V made once by ``prepare_v`` (a KV cache), timed
#: where the kernel takes one (the Hopper FP8 kernel).
PREPARED_V_PEER = ("cuflash-fp8-prepared-v", "cuflash FP8, V from prepare_v")
#: Key and table label of cuflash's default backward, timed beside the deterministic one
#: (``--deterministic``), whose ``ratio`` is deterministic / default.
DEFAULT_BWD_PEER = ("cuflash-default", "cuflash, not deterministic")


_OURS = "cuflash"

_BOOL_OVERRIDES = ("overlap", "warp_specialized") + WS_SCHEDULE_FIELDS
_SPEC_OVERRIDE_KEYS = ("block_m", "block_n", "num_warps", "num_stages") + _BOOL_OVERRIDES
MODES = ("fwd", "bwd", "fwdbwd")
#: FLOPs of a mode in units of the forward's.
_MODE_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}



@dataclass(frozen=True)
class BenchConfig:
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int
    dtype: str
    mode: str = "fwd"

    @property
    def label(self) -> str:
        causal = "causal" if self.causal else "non-causal"
        return f"{self.mode} {self.dtype} hd{self.head_dim} {causal} N={self.seqlen} b={self.batch} h={self.heads}"

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.seqlen, self.head_dim)


def paper_grid(head_dims=DEFAULT_HEAD_DIMS, seqlens=DEFAULT_SEQLENS, causal=(False, True),
               dtype="bf16", total_tokens=16384, hidden=2048, mode="fwd") -> list[BenchConfig]:
    """The FlashAttention papers' configurations, in print order (head_dim, causal, seqlen)."""
    configs = []
    for head_dim in head_dims:
        heads = hidden // head_dim
        if heads < 1:
            raise ValueError(f"hidden={hidden} is smaller than head_dim={head_dim}")
        for is_causal in causal:
            for seqlen in seqlens:
                batch = max(1, total_tokens // seqlen)
                configs.append(BenchConfig(head_dim, seqlen, is_causal, batch, heads, dtype, mode))
    return configs


def parse_spec_override(text: str | None) -> dict:
    """``"block_m=64,block_n=64,num_warps=4,num_stages=3"`` -> dict of ints."""
    if not text:
        return {}
    overrides = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        key = key.strip()
        if not sep or key not in _SPEC_OVERRIDE_KEYS:
            raise ValueError(f"--spec-override item {item.strip()!r} must be KEY=INT with KEY one of "
                             f"{', '.join(_SPEC_OVERRIDE_KEYS)}")
        try:
            overrides[key] = bool(int(value)) if key in _BOOL_OVERRIDES else int(value)
        except ValueError:
            raise ValueError(f"--spec-override {key}={value.strip()!r} is not an integer") from None
    return overrides
