"""cuflash.block_mask on the CPU: every tile's class against the dense mask in NumPy, the visit
lists and their transpose, broadcasting over batch and heads, and the mask combinators."""
import numpy as np
import pytest

import cuflash
from cuflash import mods, reference
from cuflash.sparsity import EMPTY, FULL, PARTIAL


def _dense(mask_mod, batch, heads, seqlen_q, seqlen_k):
    allowed = np.ones((batch, heads, seqlen_q, seqlen_k), dtype=bool)
    scores = np.zeros(allowed.shape)
    return mods.apply_to_scores(scores, allowed, mask_mod=mask_mod)[1]


def _expected_kinds(dense, block_m, block_n):
    b, h, sq, sk = dense.shape
    qt, kt = -(-sq // block_m), -(-sk // block_n)
    kinds = np.zeros((b, h, qt, kt), dtype=np.int8)
    for i in range(qt):
        for j in range(kt):
            tile = dense[:, :, i * block_m:(i + 1) * block_m, j * block_n:(j + 1) * block_n]
            anyv, allv = tile.any(axis=(2, 3)), tile.all(axis=(2, 3))
            kinds[:, :, i, j] = np.where(allv, FULL, np.where(anyv, PARTIAL, EMPTY))
    return kinds


RNG = np.random.default_rng(0)
DOC = np.stack([np.repeat(np.arange(8), 60)[:300], np.sort(RNG.integers(0, 4, size=300))]).astype(np.int32)
SLOPES = np.linspace(0.1, 1.0, 4).astype(np.float32)

MASKS = {
    "causal": lambda b, h, q, kv: q >= kv,
    "window": mods.sliding_window(64),
    "two_sided": mods.sliding_window(48, causal=False),
    "chunked": mods.chunked(50),
    "chunked_both_ways": mods.chunked(64, causal=False),
    "document": mods.document_mask(DOC, causal=True),
    "prefix_lm": mods.prefix_lm(np.array([40, 170], dtype=np.int32)),
    "per_head": lambda b, h, q, kv: (q - kv) < 16 * (h + 1),
    "and": mods.and_masks(mods.sliding_window(100), mods.document_mask(DOC)),
    "or": mods.or_masks(lambda b, h, q, kv: kv < 16, mods.sliding_window(32)),
    "none": lambda b, h, q, kv: q < -1,
}


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("tiles", [(64, 64), (128, 64), (32, 128)])
def test_classification_matches_the_dense_mask(name, tiles):
    batch, heads, seqlen_q, seqlen_k = 2, 4, 300, 300
    mask = MASKS[name]
    bm = cuflash.block_mask(mask, batch, heads, seqlen_q, seqlen_k, block_m=tiles[0], block_n=tiles[1])
    dense = _dense(mask, batch, heads, seqlen_q, seqlen_k)
    # a tile's class over its pairs inside the problem (tails past seqlen_q and seqlen_k left out)
    np.testing.assert_array_equal(bm.dense(), _expected_kinds(dense, *tiles))
    # visit lists: ascending non-empty tiles, -1 padded, and the transpose
    kinds = bm.dense()
    for b in range(bm.kind.shape[0]):
        for h in range(bm.kind.shape[1]):
            for i in range(kinds.shape[2]):
                visit = np.flatnonzero(bm.kind[b, h, i] != EMPTY)
                n = bm.kv_counts[b, h, i]
                assert n == visit.size and list(bm.kv_indices[b, h, i, :n]) == list(visit)
                assert np.all(bm.kv_indices[b, h, i, n:] == -1)
            for j in range(kinds.shape[3]):
                visit = np.flatnonzero(bm.kind[b, h, :, j] != EMPTY)
                assert bm.q_counts[b, h, j] == visit.size
                assert list(bm.q_indices[b, h, j, :visit.size]) == list(visit)


def test_masks_that_read_neither_batch_nor_head_are_classified_once():
    bm = cuflash.block_mask(MASKS["window"], 3, 8, 256, 512, block_m=64, block_n=64)
    assert bm.kind.shape == (1, 1, 4, 8) and bm.dense().shape == (3, 8, 4, 8)
    assert cuflash.block_mask(MASKS["per_head"], 3, 8, 64, 64, block_m=64, block_n=64).kind.shape == (1, 8, 1, 1)
    assert cuflash.block_mask(MASKS["document"], 2, 8, 64, 64, block_m=64, block_n=64).kind.shape == (2, 1, 1, 1)
    causal = cuflash.block_mask(MASKS["causal"], 1, 1, 512, 512, block_m=128, block_n=128)
    assert causal.sparsity == pytest.approx(6 / 16)
    assert np.array_equal(np.diag(causal.kind[0, 0]), [PARTIAL] * 4)


def test_invalid_arguments_are_named():
    with pytest.raises(ValueError, match="block_m=24"):
        cuflash.block_mask(MASKS["causal"], 1, 1, 64, 64, block_m=24)
    with pytest.raises(ValueError, match="seqlen_q=-1"):
        cuflash.block_mask(MASKS["causal"], 1, 1, -1, 64)
    with pytest.raises(ValueError, match="a score graph was given"):
        cuflash.block_mask(mods.trace_score_mod(mods.softcap(5.0)), 1, 1, 64, 64)
    with pytest.raises(ValueError, match="at least one"):
        mods.and_masks()


def test_combined_masks_in_the_reference():
    q = RNG.standard_normal((2, 4, 300, 16))
    k, v = RNG.standard_normal((2, 2, 300, 16)), RNG.standard_normal((2, 2, 300, 16))
    combined = mods.and_masks(mods.sliding_window(100), mods.document_mask(DOC))
    out, lse = reference.attention_reference(q, k, v, mask_mod=combined)
    dense = _dense(combined, 2, 4, 300, 300)
    scores = np.einsum("bhqd,bhkd->bhqk", q, np.repeat(k, 2, axis=1)) / 4.0
    scores = np.where(dense, scores, -np.inf)
    want_lse = np.log(np.exp(scores).sum(-1))
    assert np.allclose(lse, want_lse)


def test_combinators_capture_the_arrays_of_the_masks_they_combine():
    graph = mods.trace_mask_mod(mods.and_masks(mods.document_mask(DOC), mods.prefix_lm(np.array([3, 4], np.int32))))
    # the documents' run starts and ends (DOC's ids each fill one run), then the prefix lengths
    assert len(graph.arrays) == 3 and graph.array_signature == (("int32", 2), ("int32", 2), ("int32", 1))
    again = mods.trace_mask_mod(mods.and_masks(mods.document_mask(DOC), mods.prefix_lm(np.array([5, 6], np.int32))))
    assert again.digest == graph.digest  # contents are not part of the specialization
    assert "cuflash_mask_mod_" in mods.cuda_source(graph)


@pytest.mark.parametrize("by_key", [False, True])
@pytest.mark.parametrize("name", ["document", "per_head", "and"])
def test_kernel_tables_list_the_kernel_tiles_in_c_order(name, by_key):
    from cuflash.sparsity import host_tables, kernel_kinds

    bm = cuflash.block_mask(MASKS[name], 2, 4, 300, 300, block_m=64, block_n=32)
    for tiles, causal in (((128, 128), True), ((192, 128), False), ((64, 128), True)):
        kind = kernel_kinds(bm, *tiles, causal)
        if by_key:
            kind = np.swapaxes(kind, 2, 3)
        counts, entries = host_tables(bm, *tiles, causal, by_key)
        # the kernel reads both with C-order strides
        assert counts.flags.c_contiguous and entries.flags.c_contiguous
        assert counts.dtype == entries.dtype == np.int32
        for index in np.ndindex(kind.shape[:3]):
            visit = np.flatnonzero(kind[index] != EMPTY)
            n = counts[index]
            assert n == visit.size
            assert list(entries[index][:n] >> 1) == list(visit)
            assert list(entries[index][:n] & 1) == list((kind[index][visit] == FULL).astype(int))


def test_tiles_are_taken_heaviest_first_the_later_first_among_equals():
    from cuflash.sparsity import heaviest_first
    counts = np.array([[[1, 3, 3, 0, 2], [5, 4, 3, 2, 1]]], np.int32)
    np.testing.assert_array_equal(heaviest_first(counts), [[[2, 1, 4, 0, 3], [0, 1, 2, 3, 4]]])
    causal = np.arange(1, 9, dtype=np.int32)[None, None]  # a causal mask's counts: the plain order, last first
    np.testing.assert_array_equal(heaviest_first(causal)[0, 0], np.arange(8)[::-1])
