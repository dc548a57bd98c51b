"""The kernel's tiled algorithm, simulated in NumPy, against the float64 reference (CPU only)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash import simulate
from cuflash.reference import attention_reference, causal_mask
from cuflash.simulate import simulate_tiled, tile_schedule
from cuflash.testing import seqlen_pairs

BLOCK_M = st.sampled_from((16, 64, 128))
BLOCK_N = st.sampled_from((16, 32, 64))


def _assert_same(got, want):
    out, lse = got
    ref, ref_lse = want
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-10, atol=1e-12)


@st.composite
def tiled_problems(draw, max_seqlen=300):
    seqlen_q, seqlen_k = draw(seqlen_pairs(max_value=max_seqlen))
    heads_k = draw(st.integers(1, 2))
    heads_q = heads_k * draw(st.integers(1, 2))
    batch = draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from((8, 24, 40)))
    layout = draw(st.sampled_from(("bhsd", "bshd")))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((batch, heads_q, seqlen_q, head_dim))
    k = rng.standard_normal((batch, heads_k, seqlen_k, head_dim))
    v = rng.standard_normal((batch, heads_k, seqlen_k, head_dim))
    if layout == "bshd":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    return q, k, v, layout


@settings(deadline=None, max_examples=40)
@given(problem=tiled_problems(), causal=st.booleans(), block_m=BLOCK_M, block_n=BLOCK_N,
       scale=st.one_of(st.none(), st.floats(0.05, 2.0)))
def test_simulation_matches_reference(problem, causal, block_m, block_n, scale):
    q, k, v, layout = problem
    kwargs = dict(causal=causal, scale=scale, layout=layout)
    _assert_same(simulate_tiled(q, k, v, block_m=block_m, block_n=block_n, **kwargs),
                 attention_reference(q, k, v, **kwargs))


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1023, 1023), (1023, 239), (113, 1023), (1, 1023), (1023, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_simulation_matches_reference_at_default_tiles(seqlen_q, seqlen_k, causal):
    rng = np.random.default_rng(seqlen_q * 7 + seqlen_k)
    q = rng.standard_normal((1, 2, seqlen_q, 16))
    k, v = rng.standard_normal((2, 1, 1, seqlen_k, 16))
    _assert_same(simulate_tiled(q, k, v, causal=causal),
                 attention_reference(q, k, v, causal=causal))


def test_simulation_with_no_keys():
    q = np.ones((1, 1, 20, 8))
    k = v = np.ones((1, 1, 0, 8))
    for causal in (False, True):
        out, lse = simulate_tiled(q, k, v, causal=causal, block_m=16, block_n=16)
        assert (out == 0).all() and np.isneginf(lse).all()


def _brute_force_tiles(seqlen_q, seqlen_k, block_m, block_n, causal, m_block):
    """For one query tile: {n_block: masked} over every key tile that holds an allowed pair."""
    allowed = causal_mask(seqlen_q, seqlen_k) if causal else np.ones((seqlen_q, seqlen_k), bool)
    rows = allowed[m_block * block_m:(m_block + 1) * block_m]
    want = {}
    for n_block in range(-(-seqlen_k // block_n)):
        n0 = n_block * block_n
        tile = np.zeros((rows.shape[0], block_n), bool)   # columns past seqlen_k stay disallowed
        part = rows[:, n0:n0 + block_n]
        tile[:, :part.shape[1]] = part
        if tile.any():
            want[n_block] = not tile.all()
    return want


@settings(deadline=None, max_examples=150)
@given(lengths=seqlen_pairs(min_value=0, max_value=300), causal=st.booleans(),
       block_m=st.sampled_from((16, 32, 64, 128)), block_n=st.sampled_from((16, 32, 64, 128)))
def test_tile_schedule_against_brute_force(lengths, causal, block_m, block_n):
    seqlen_q, seqlen_k = lengths
    schedule = tile_schedule(seqlen_q, seqlen_k, block_m, block_n, causal)
    assert [m for m, _ in schedule] == list(range(-(-seqlen_q // block_m)))
    for m_block, tiles in schedule:
        visited = [n for n, _ in tiles]
        assert visited == sorted(visited, reverse=True), "key tiles run last to first"
        masked_flags = [masked for _, masked in tiles]
        assert masked_flags == sorted(masked_flags, reverse=True), "masked tiles come first"
        # visits exactly the tiles with an allowed pair, and masks exactly those with a disallowed
        # or out-of-range pair
        assert dict(tiles) == _brute_force_tiles(seqlen_q, seqlen_k, block_m, block_n, causal, m_block)


@pytest.mark.parametrize("block_m,block_n", [(4, 4), (4, 8), (8, 4), (8, 8)])
def test_tile_schedule_exhaustive_on_small_tiles(block_m, block_n):
    # every diagonal offset modulo the tile sizes, including a tile whose last key is exactly the
    # last key its first row may attend (allowed everywhere, so it must run unmasked)
    for seqlen_q in range(0, 26):
        for seqlen_k in range(0, 26):
            for causal in (False, True):
                for m_block, tiles in tile_schedule(seqlen_q, seqlen_k, block_m, block_n, causal):
                    assert dict(tiles) == _brute_force_tiles(seqlen_q, seqlen_k, block_m, block_n,
                                                             causal, m_block)


def test_tile_schedule_example():
    # seqlen_q = 40 > seqlen_k = 24: rows 0..15 attend nothing, row i >= 16 attends keys 0..i-16
    assert tile_schedule(40, 24, 16, 8, causal=True) == [
        (0, []),
        (1, [(1, True), (0, True)]),
        (2, [(2, True), (1, False), (0, False)]),
    ]
    assert tile_schedule(20, 20, 16, 16, causal=False) == [(0, [(1, True), (0, False)]),
                                                            (1, [(1, True), (0, False)])]


def test_unmasked_tile_with_masked_pairs_is_reported(monkeypatch):
    def unmasked(*args):
        return [(m, [(n, False) for n, _ in tiles]) for m, tiles in tile_schedule(*args)]

    monkeypatch.setattr(simulate, "tile_schedule", unmasked)
    q = k = v = np.ones((1, 1, 32, 8))
    with pytest.raises(RuntimeError, match="unmasked"):
        simulate_tiled(q, k, v, causal=True, block_m=16, block_n=16)


def test_block_validation():
    q = np.ones((1, 1, 4, 8))
    with pytest.raises(ValueError, match="block_n"):
        simulate_tiled(q, q, q, block_n=0)
    with pytest.raises(ValueError, match="block_m"):
        tile_schedule(4, 4, 16.0, 16, False)


def _window_allowed(seqlen_q, seqlen_k, causal, window):
    left, right = window
    rows = np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    cols = np.arange(seqlen_k)[None, :]
    allowed = np.ones((seqlen_q, seqlen_k), bool)
    if causal:
        allowed &= cols <= rows
    if right >= 0:
        allowed &= cols <= rows + right
    if left >= 0:
        allowed &= cols >= rows - left
    return allowed


WINDOWS = st.tuples(st.integers(-1, 70), st.integers(-1, 70))


@settings(deadline=None, max_examples=200)
@given(lengths=seqlen_pairs(min_value=0, max_value=300), causal=st.booleans(), window=WINDOWS,
       block_m=st.sampled_from((16, 32, 64, 128)), block_n=st.sampled_from((16, 32, 64, 128)))
def test_window_tile_schedule_against_brute_force(lengths, causal, window, block_m, block_n):
    """The window's walk (KernelSpec.local): exactly the key tiles with an allowed pair, last to
    first; masked tiles at both ends only (the kernel's three loops), every tile with a refused
    pair among them."""
    seqlen_q, seqlen_k = lengths
    window = (window[0], 0 if causal and window[1] > 0 else window[1])
    allowed = _window_allowed(seqlen_q, seqlen_k, causal, window)
    for m_block, tiles in tile_schedule(seqlen_q, seqlen_k, block_m, block_n, causal, window):
        rows = allowed[m_block * block_m:(m_block + 1) * block_m]
        want = {}
        for n_block in range(-(-seqlen_k // block_n)):
            tile = np.zeros((rows.shape[0], block_n), bool)
            part = rows[:, n_block * block_n:(n_block + 1) * block_n]
            tile[:, :part.shape[1]] = part
            if tile.any():
                want[n_block] = not tile.all()
        visited = [n for n, _ in tiles]
        assert visited == sorted(visited, reverse=True) and set(visited) == set(want)
        assert all(masked for n, masked in tiles if want[n]), "a tile with a refused pair runs unmasked"
        flags = "".join("m" if masked else "u" for _, masked in tiles)
        assert set(flags.strip("m")) <= {"u"}, flags  # masked, then unmasked, then masked


@settings(deadline=None, max_examples=30)
@given(problem=tiled_problems(max_seqlen=200), causal=st.booleans(), window=WINDOWS, block_m=BLOCK_M,
       block_n=BLOCK_N)
def test_window_simulation_matches_reference(problem, causal, window, block_m, block_n):
    q, k, v, layout = problem
    window = (window[0], 0 if causal and window[1] > 0 else window[1])
    _assert_same(simulate_tiled(q, k, v, causal=causal, layout=layout, block_m=block_m, block_n=block_n,
                                window=window),
                 attention_reference(q, k, v, causal=causal, layout=layout, window_size=window))


@settings(deadline=None, max_examples=200)
@given(lengths=seqlen_pairs(min_value=0, max_value=300), causal=st.booleans(), window=WINDOWS,
       block_n=st.sampled_from((64, 128)))
def test_backward_query_schedule_against_brute_force(lengths, causal, window, block_n):
    """The backward's walk (BwdSpec.local): exactly the query tiles with a pair the window allows."""
    seqlen_q, seqlen_k = lengths
    window = (window[0], 0 if causal and window[1] > 0 else window[1])
    allowed = _window_allowed(seqlen_q, seqlen_k, causal, window)
    for n_block, tiles in simulate.query_schedule(seqlen_q, seqlen_k, 64, block_n, causal, window):
        cols = allowed[:, n_block * block_n:(n_block + 1) * block_n]
        want = [m for m in range(-(-seqlen_q // 64)) if cols[m * 64:(m + 1) * 64].any()]
        assert tiles == want
