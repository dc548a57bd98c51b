"""``python -m cuflash bench --mods``: attention variants (score_mod / mask_mod) beside plain cuflash
and FlexAttention.

One problem per (head dim, seqlen), sized as the grid's (batch = total_tokens // seqlen, heads =
hidden // head_dim), hd128 N=16384 unless ``--head-dims`` / ``--seqlens`` are given. Forward rows:
plain, causal, softcap 30, ALiBi + causal, sliding window 1024 (causal) and 8 packed documents of
random lengths (causal), attention sinks (causal); backward rows (of a retained forward): plain,
causal, softcap, window and sinks. Softcap and the window go through FlashAttention's arguments
(``softcap=``, ``window_size=``), the others through mods.
TFLOP/s count the attended pairs only (4·d per pair forward, 2.5x that backward); ``vs_plain`` is
the variant over its plain cuflash kernel (softcap over non-causal, the others over causal). Where
torch is importable, ``torch.compile``'d flex_attention with the same mods and a block mask is timed
in the same interleaved rounds (:mod:`.timing`), its ``ratio`` cuflash / Flex (sinks: no Flex row).
"""
from __future__ import annotations

import datetime
import json
from functools import partial

from .config import _MODE_FLOPS, DEFAULT_HEAD_DIMS, DEFAULT_SEQLENS, FP8, paper_grid
from .peers import _peer_entry, _raising, _time_interleaved, _torch_output, import_torch, to_torch
from .inputs import _free_device_memory, _record_ours, parse_bench_dtype, random_inputs

MODS_HEAD_DIM, MODS_SEQLEN = 128, 16384
SOFTCAP, WINDOW, DOCUMENTS, DOCUMENT_SEED = 30.0, 1024, 8, 0
#: Variant -> (causal, the plain variant it is compared with), in print order.
VARIANTS = {"plain": (False, "plain"), "causal": (True, "causal"), "softcap": (False, "plain"),
            "alibi": (True, "causal"), "window": (True, "causal"), "document": (True, "causal"),
            "sinks": (True, "causal")}
BACKWARD_VARIANTS = ("plain", "causal", "softcap", "window", "sinks")
LABELS = {"plain": "plain", "causal": "causal", "softcap": f"softcap {SOFTCAP:g}", "alibi": "alibi causal",
          "window": f"window {WINDOW} causal", "document": f"{DOCUMENTS} documents causal",
          "sinks": "sinks causal"}


def document_lengths(seqlen: int, documents: int = DOCUMENTS, seed: int = DOCUMENT_SEED) -> list[int]:
    """``documents`` positive random lengths (fixed seed) that add up to ``seqlen``."""
    import numpy as np
    if seqlen < documents:
        raise ValueError(f"seqlen={seqlen} cannot hold {documents} documents")
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, seqlen), documents - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [seqlen]])).tolist()


def attended_pairs(variant: str, seqlen: int, window: int = WINDOW, lengths=()) -> int:
    """(query, key) pairs one (batch, head) of ``variant`` attends, seqlen_q = seqlen_k = ``seqlen``."""
    if variant in ("plain", "softcap"):
        return seqlen * seqlen
    if variant in ("causal", "alibi", "sinks"):
        return seqlen * (seqlen + 1) // 2
    if variant == "window":   # row i attends min(i + 1, window) keys
        full = min(seqlen, window)
        return full * (full + 1) // 2 + (seqlen - full) * window
    if variant == "document":   # causal inside each document
        return sum(n * (n + 1) // 2 for n in lengths)
    raise ValueError(f"variant={variant!r} is none of {', '.join(VARIANTS)}")


def _cuflash_mods(variant, slopes, document_ids) -> dict:
    """The score_mod / mask_mod (or sinks) keywords of ``variant`` for cuflash (causal comes apart)."""
    from cuflash import mods
    if variant == "sinks":  # one logit per head, as gpt-oss learns them
        import cupy
        return dict(sinks=cupy.ones(slopes.shape, dtype=cupy.float32))
    if variant == "softcap":
        return dict(softcap=SOFTCAP)
    if variant == "alibi":
        return dict(score_mod=mods.alibi(slopes))
    if variant == "window":  # WINDOW keys up to the query's own, as mods.sliding_window(WINDOW)
        return dict(window_size=(WINDOW - 1, 0))
    if variant == "document":
        return dict(mask_mod=mods.document_mask(document_ids))
    return {}


def _flex_mods(torch, variant, slopes, document_ids):
    """(score_mod, mask_mod) of ``variant`` written for FlexAttention, None where it has none."""
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    def document(b, h, q_idx, kv_idx):
        return (document_ids[b, q_idx] == document_ids[b, kv_idx]) & (q_idx >= kv_idx)
    return {"plain": (None, None), "causal": (None, causal), "softcap": (softcap, None), "alibi": (alibi, causal),
            "window": (None, window), "document": (None, document)}[variant]


def _error(exc) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def load_flex(torch, echo=print):
    """(compiled flex_attention, create_block_mask), or None after one line saying why."""
    if torch is None:
        return None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # older torch
        setattr(config, limit, max(getattr(config, limit), 64))   # each mod and shape is one more compile
        flex = torch.compile(flex_attention, dynamic=False)
        probe = torch.randn(1, 1, 256, 64, device="cuda", dtype=torch.bfloat16)
        flex(probe, probe, probe).float().sum().item()
        return flex, create_block_mask
    except Exception as exc:
        echo(f"FlexAttention is not usable, timing cuflash alone: {_error(exc)}")
        return None


def mods_rows(config, torch=None, flex=None, reps=30, flush_l2=True, deterministic=False, echo=print) -> list[dict]:
    """Time every variant on ``config``'s shape (a :class:`BenchConfig`); one dict per row."""
    import numpy as np
    import cupy

    import cuflash

    q, k, v = random_inputs(config.shape, config.dtype)
    dout = random_inputs(config.shape, config.dtype, seed=1)[0]
    lengths = document_lengths(config.seqlen)
    ids = np.repeat(np.arange(DOCUMENTS, dtype=np.int32), lengths)
    document_ids = cupy.asarray(np.broadcast_to(ids, (config.batch, config.seqlen)).copy())
    slopes = cupy.asarray(2.0 ** -(np.arange(config.heads) + 1.0), dtype=cupy.float32)
    if flex is not None:
        qt, kt, vt, dt = (to_torch(x) for x in (q, k, v, dout))
        grad_inputs = tuple(x.detach().clone().requires_grad_() for x in (qt, kt, vt))
        torch_mods = dict(slopes=to_torch(slopes), document_ids=to_torch(document_ids))
    rows, masks = [], {}
    for direction, variants in (("fwd", tuple(VARIANTS)), ("bwd", BACKWARD_VARIANTS)):
        ours, theirs = {}, {}
        for variant in variants:
            causal = VARIANTS[variant][0]
            try:
                kwargs = dict(_cuflash_mods(variant, slopes, document_ids), causal=causal)
                if "mask_mod" in kwargs:  # the block mask is made once per variant, outside the timing
                    masks.setdefault(variant, cuflash.block_mask(kwargs["mask_mod"], config.batch, config.heads,
                                                                 config.seqlen, config.seqlen))
                    kwargs["block_mask"] = masks[variant]
                if direction == "fwd":
                    ours[variant] = partial(cuflash.attention, q, k, v, **kwargs)
                else:
                    out, lse = cuflash.attention(q, k, v, return_lse=True, **kwargs)
                    ours[variant] = partial(cuflash.attention_backward, dout, q, k, v, out, lse,
                                            deterministic=deterministic, **kwargs)
            except Exception as exc:
                ours[variant] = _raising(exc)
            if flex is not None and variant != "sinks":
                theirs["flex " + variant] = _flex_call(torch, flex, config, variant, direction, (qt, kt, vt),
                                                       grad_inputs, dt, torch_mods)
        timed = _time_interleaved(ours, theirs, reps, flush_l2)
        for variant in variants:
            rows.append(_row(config, variant, direction, lengths, timed, ours, theirs))
        for row in rows[-len(variants):]:
            base = next(r for r in rows if r["direction"] == direction and r["variant"] == row["baseline"])
            if row is not base and row["tflops"] and base["tflops"]:
                row["vs_plain"] = row["tflops"] / base["tflops"]
            echo(format_mods_row(row))
        del ours, theirs
        _free_device_memory()
        if torch is not None:
            torch.cuda.empty_cache()   # the retained Flex graphs went with ``theirs``
    return rows


def _flex_call(torch, flex, config, variant, direction, qkv, grad_inputs, dout, torch_mods):
    """FlexAttention's call of ``variant``: the forward, or the backward of a retained forward."""
    try:
        compiled, create_block_mask = flex
        score_mod, mask_mod = _flex_mods(torch, variant, **torch_mods)
        batch = config.batch if variant == "document" else None   # the other masks broadcast over b and h
        block_mask = None if mask_mod is None else create_block_mask(mask_mod, batch, None, config.seqlen,
                                                                     config.seqlen, device="cuda")
        if direction == "fwd":
            return partial(compiled, *qkv, score_mod=score_mod, block_mask=block_mask)
        out = compiled(*grad_inputs, score_mod=score_mod, block_mask=block_mask)
        return partial(torch.autograd.grad, out, grad_inputs, dout, retain_graph=True)
    except Exception as exc:
        return _raising(exc)


def _row(config, variant, direction, lengths, timed, ours, theirs) -> dict:
    pairs = attended_pairs(variant, config.seqlen, lengths=lengths)
    flops = int(_MODE_FLOPS[direction] * 4 * config.head_dim * config.batch * config.heads * pairs)
    row = dict(variant=variant, label=LABELS[variant], direction=direction, causal=VARIANTS[variant][0],
               baseline=VARIANTS[variant][1], dtype=config.dtype, head_dim=config.head_dim, seqlen=config.seqlen,
               batch=config.batch, heads=config.heads, pairs=pairs, flops=flops, ms=None, tflops=None,
               vs_plain=None, error=None, flex=None)
    if variant == "document":
        row["lengths"] = lengths
    output = ours[variant] if direction == "fwd" else (lambda: None)   # the output Flex is checked against
    out = _record_ours(row, timed[variant], output)
    if "flex " + variant in theirs:
        call = theirs["flex " + variant]
        row["flex"] = _peer_entry(timed["flex " + variant], flops, row["tflops"], out, partial(_torch_output, call))
    return row


def format_mods_row(row: dict) -> str:
    head = (f"{row['direction']} {row['dtype']} hd{row['head_dim']} N={row['seqlen']} b={row['batch']} "
            f"h={row['heads']} {row['label']:<20}")
    if row["error"]:
        line = f"{head} error: {row['error'].splitlines()[0]}"
    else:
        line = f"{head} {row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s"
        line += f"  {row['vs_plain']:.2f}x {row['baseline']}" if row["vs_plain"] is not None else ""
    flex = row["flex"]
    if flex is not None:
        if flex["error"]:
            line += f" | flex error: {flex['error']}"
        else:
            line += f" | flex {flex['tflops']:.1f}" + (f" ({flex['ratio']:.2f}x)" if flex["ratio"] else "")
            line += f" max|diff| {flex['max_abs_diff']:.1e}" if flex["max_abs_diff"] is not None else ""
    return line


def run_mods(args) -> int:
    """``python -m cuflash bench --mods``."""
    import sys

    from ..machine import environment
    try:
        dtype = parse_bench_dtype(args.dtype)
        if dtype == FP8:
            raise ValueError("--mods times fp16, bf16 or fp32 (not --dtype fp8)")
        if min(args.seqlens) < DOCUMENTS:
            raise ValueError(f"--mods needs seqlens of at least {DOCUMENTS} (one token per document)")
    except ValueError as exc:
        print(f"cuflash bench: error: {exc}", file=sys.stderr)
        return 2
    head_dims = [MODS_HEAD_DIM] if list(args.head_dims) == list(DEFAULT_HEAD_DIMS) else args.head_dims
    seqlens = [MODS_SEQLEN] if list(args.seqlens) == list(DEFAULT_SEQLENS) else args.seqlens
    torch = None if args.no_torch else import_torch()
    if torch is None and not args.no_torch:
        print("torch with CUDA is not importable: timing cuflash alone")
    flex = load_flex(torch)
    env = environment()
    if torch is not None:
        env["torch"] = torch.__version__
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), environment=env,
                  settings=dict(mode="mods", dtype=dtype, total_tokens=args.total_tokens, hidden=args.hidden,
                                reps=args.reps, flush_l2=not args.no_flush_l2, deterministic=args.deterministic,
                                softcap=SOFTCAP, window=WINDOW, documents=DOCUMENTS, document_seed=DOCUMENT_SEED,
                                flex=flex is not None),
                  mods=[])
    for config in paper_grid(head_dims, seqlens, (True,), dtype, args.total_tokens, args.hidden, "fwd"):
        report["mods"] += mods_rows(config, torch, flex, args.reps, not args.no_flush_l2, args.deterministic)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
        print(f"wrote {args.json}")
    return 1 if any(row["error"] for row in report["mods"]) else 0
