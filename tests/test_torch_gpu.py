"""cuflash.torch on the GPU: forward and backward against the float64 reference, torch.compile,
CUDA graphs (torch's and CuPy's), and a transformers causal LM with cuflash's attention."""
import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash.testing import AttentionProblem, assert_attention_close, assert_gradients_close  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")


def _torch(x):
    import cuflash.torch as ct
    return ct._to_torch(x)


def _cupy(t):
    import cuflash.torch as ct
    return ct._to_cupy(t)


PROBLEMS = [
    AttentionProblem(batch=2, heads=8, heads_k=2, seqlen_q=113, seqlen_k=239, head_dim=64, dtype="bf16", causal=True),
    AttentionProblem(batch=1, heads=4, heads_k=4, seqlen_q=256, seqlen_k=256, head_dim=128, dtype="fp16",
                     layout="bshd"),
    AttentionProblem(batch=2, heads=8, heads_k=1, seqlen_q=239, seqlen_k=17, head_dim=96, dtype="bf16", causal=True,
                     layout="bshd", strided=True),
    AttentionProblem(batch=1, heads=2, heads_k=2, seqlen_q=1, seqlen_k=1023, head_dim=128, dtype="fp16",
                     strided=True),
    AttentionProblem(batch=1, heads=2, heads_k=1, seqlen_q=64, seqlen_k=64, head_dim=64, dtype="fp32", causal=True),
]


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
def test_forward_and_backward_against_the_reference(problem):
    import cuflash.torch as ct
    q, k, v = problem.make_inputs(cupy, seed=3)
    dout = problem.make_dout(cupy, seed=3)
    tq, tk, tv = (_torch(x).requires_grad_() for x in (q, k, v))
    out, lse = ct.attention(tq, tk, tv, causal=problem.causal, layout=problem.layout, return_lse=True)
    assert out.dtype == tq.dtype and out.shape == tq.shape and out.is_contiguous()
    ref, ref_lse = problem.reference(q, k, v)
    naive, naive_lse = problem.naive(q, k, v)
    assert_attention_close(_cupy(out.detach()), ref, problem.dtype, baseline=naive, lse=_cupy(lse), ref_lse=ref_lse,
                           baseline_lse=naive_lse)
    out.backward(_torch(dout))
    grads = tuple(_cupy(t.grad) for t in (tq, tk, tv))
    assert_gradients_close(grads, problem.backward_reference(dout, q, k, v), problem.dtype,
                           baselines=problem.backward_naive(dout, q, k, v))


def test_runs_on_torchs_current_stream_and_device():
    import cuflash.torch as ct
    q = torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = ct.attention(q, q, q, causal=True)
        again = ct.attention(q, q, q, causal=True)
    stream.synchronize()
    assert torch.equal(out, again)
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)
    assert (out.float() - expected).abs().max().item() < 2e-2


def test_deterministic_backward_is_bit_identical():
    import cuflash.torch as ct
    q, k, v = (torch.randn(1, 8, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grads = []
    for _ in range(2):
        out = ct.attention(q, k, v, causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_torch_compile_fullgraph_matches_eager():
    import cuflash.torch as ct

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(256, 3 * 256, dtype=torch.bfloat16, device="cuda")

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.proj(x).view(b, s, 3, 4, 64).unbind(2)
            return ct.attention(q, k, v, causal=True, layout="bshd").reshape(b, s, 256)

    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager = block(x)
    eager_grad, = torch.autograd.grad(eager.float().square().sum(), x)
    compiled = torch.compile(block, fullgraph=True)
    out = compiled(x)
    out_grad, = torch.autograd.grad(out.float().square().sum(), x)
    assert (out.float() - eager.float()).abs().max().item() <= 2e-2
    assert (out_grad - eager_grad).abs().max().item() <= 1e-2 * eager_grad.abs().max().item()


def test_torch_cuda_graph_capture_and_replay():
    import cuflash.torch as ct
    q, k, v = (torch.randn(2, 8, 384, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 8, 384, 128, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream, as torch asks
        for _ in range(2):
            out = ct.attention(q, k, v, causal=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = ct.attention(q, k, v, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    for step in range(3):
        with torch.no_grad():
            for x in (q, k, v, dout):
                x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        want = ct.attention(q.detach(), k.detach(), v.detach(), causal=True)
        want_grads = torch.autograd.grad(ct.attention(q, k, v, causal=True), (q, k, v), dout)
        assert torch.equal(out, want), step
        assert all(torch.allclose(a, b, atol=2e-2, rtol=2e-2) for a, b in zip(grads, want_grads)), step


def test_cupy_graph_capture_and_replay():
    problem = AttentionProblem(batch=2, heads=8, heads_k=2, seqlen_q=300, seqlen_k=300, head_dim=64, dtype="bf16",
                               causal=True)
    q, k, v = problem.make_inputs(cupy, seed=1)
    dout = problem.make_dout(cupy, seed=1)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(2):  # warm-up on the capture stream: kernels loaded, pool blocks and counters there
            out, backward = cuflash.attention_with_grad(q, k, v, causal=True)
            grads = backward(dout)
        del out, backward, grads  # their blocks go back to the stream's pool, for the capture to reuse
        stream.synchronize()
        stream.begin_capture()
        out, backward = cuflash.attention_with_grad(q, k, v, causal=True)
        grads = backward(dout)
        graph = stream.end_capture()
    for seed in (5, 6, 7):
        with stream:  # the new inputs written on the replay stream, ordered before the replay
            fresh = problem.make_inputs(cupy, seed=seed)
            for x, y in zip((q, k, v), fresh):
                x[...] = y
        graph.launch(stream)
        stream.synchronize()
        ref, _ = problem.reference(q, k, v)
        assert_attention_close(out, ref, "bf16", baseline=problem.naive(q, k, v)[0])
        assert_gradients_close(grads, problem.backward_reference(dout, q, k, v), "bf16",
                               baselines=problem.backward_naive(dout, q, k, v))


def test_a_transformers_causal_lm_matches_sdpa(monkeypatch):
    """A small Llama-style model (GQA, random weights, bf16): cuflash's registered attention against
    SDPA, within the distance between eager and SDPA on the same model (the bf16 noise floor)."""
    transformers = pytest.importorskip("transformers")
    import cuflash.torch as ct

    name = ct.register_transformers()
    calls = []
    real = ct.attention
    monkeypatch.setattr(ct, "attention", lambda *args, **kwargs: calls.append(kwargs["causal"]) or real(*args, **kwargs))
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, 512, (2, 300), device="cuda")

    def run(implementation):
        model.set_attn_implementation(implementation)
        model.zero_grad(set_to_none=True)
        logits = model(tokens).logits
        logits.float().logsumexp(-1).mean().backward()
        return logits.detach().float(), {n: p.grad.detach().float() for n, p in model.named_parameters()}

    sdpa, sdpa_grads = run("sdpa")
    eager, eager_grads = run("eager")
    ours, our_grads = run(name)
    assert calls == [True] * config.num_hidden_layers and not ct._warned  # every layer ran on cuflash

    def grad_error(grads):
        return max(((grads[n] - sdpa_grads[n]).abs().max() / sdpa_grads[n].abs().max().clamp_min(1e-12)).item()
                   for n in sdpa_grads)

    floor_logits = (eager - sdpa).abs().max().item()
    assert (ours - sdpa).abs().max().item() <= 2 * floor_logits + 1e-3
    assert grad_error(our_grads) <= 2 * grad_error(eager_grads) + 1e-3


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sinks_through_the_bridge_match_the_reference(compiled):
    """Attention sinks on torch tensors: the output, the LSE and every gradient, dsinks included,
    against the float64 reference, eagerly and under torch.compile."""
    import numpy as np

    import cuflash.torch as ct
    from cuflash import reference
    from cuflash.testing import to_numpy

    problem = AttentionProblem(batch=2, heads=8, heads_k=2, seqlen_q=113, seqlen_k=239, head_dim=64, dtype="bf16",
                               causal=True, layout="bshd")
    q, k, v = problem.make_inputs(cupy, seed=5)
    dout = problem.make_dout(cupy, seed=6)
    sinks = torch.tensor(np.random.default_rng(7).normal(1.0, 2.0, 8), dtype=torch.float32, device="cuda",
                         requires_grad=True)
    tq, tk, tv = (_torch(x).requires_grad_() for x in (q, k, v))
    fn = torch.compile(ct.attention, fullgraph=True) if compiled else ct.attention
    out, lse = fn(tq, tk, tv, causal=True, layout="bshd", return_lse=True, sinks=sinks)
    out.backward(_torch(dout))
    args = [to_numpy(x) for x in (q, k, v)]
    kw = dict(causal=True, layout="bshd", sinks=sinks.detach().cpu().numpy())
    ref, ref_lse = reference.attention_reference(*args, **kw)
    naive, naive_lse = reference.attention_naive(*args, **kw)
    assert_attention_close(_cupy(out.detach()), ref, "bf16", baseline=naive, lse=_cupy(lse.detach()),
                           ref_lse=ref_lse, baseline_lse=naive_lse)
    ref_grads = reference.attention_backward_reference(to_numpy(dout), *args, **kw)
    base_grads = reference.attention_backward_naive(to_numpy(dout), *args, **kw)
    assert_gradients_close(tuple(_cupy(t.grad) for t in (tq, tk, tv)), ref_grads[:3], "bf16",
                           baselines=base_grads[:3])
    got = sinks.grad.double().cpu().numpy()
    bound = 2 * np.abs(base_grads[3] - ref_grads[3]) + 1e-3 * (1 + np.abs(ref_grads[3]).max())
    assert (np.abs(got - ref_grads[3]) <= bound).all(), (got, ref_grads[3])


def test_a_transformers_model_with_sinks_matches_eager(monkeypatch):
    """A small gpt-oss model (sinks, a sliding layer and a full layer, bf16): cuflash's registered
    attention (both layers on cuflash with the sinks, the sliding one with its window) against the
    model's eager attention, both within twice the eager bf16 model's distance from the float32
    one."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip("this transformers has no gpt-oss")
    import cuflash.torch as ct

    name = ct.register_transformers()
    calls = []
    real = ct.attention
    monkeypatch.setattr(ct, "attention", lambda *a, **kw: calls.append(kw["sinks"] is not None) or real(*a, **kw))
    config = transformers.GptOssConfig(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                       num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                                       layer_types=["sliding_attention", "full_attention"],
                                       max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(device="cuda")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    tokens = torch.randint(0, 512, (2, 200), device="cuda")

    def run(implementation, dtype):
        model.to(dtype=dtype).set_attn_implementation(implementation)
        with torch.no_grad():
            return model(tokens).logits.float()

    truth = run("eager", torch.float32)
    eager = run("eager", torch.bfloat16)
    ours = run(name, torch.bfloat16)
    assert calls == [True, True] and not ct._warned  # both layers ran on cuflash, with their sinks
    floor = (eager - truth).abs().max().item()
    assert (ours - truth).abs().max().item() <= 2 * floor + 1e-3


def test_a_transformers_model_with_softcap_and_windows_matches_eager(monkeypatch):
    """A small Gemma 2 model (logit softcap, sliding and full layers, bf16): every layer on cuflash,
    within twice the eager bf16 model's distance from the float32 one, prefill and decode steps on
    the cache."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma2ForCausalLM"):
        pytest.skip("this transformers has no Gemma 2")
    import cuflash.torch as ct

    name = ct.register_transformers()
    calls = []
    real = ct.attention
    monkeypatch.setattr(ct, "attention", lambda *a, **kw: calls.append(kw["window_size"]) or real(*a, **kw))
    config = transformers.Gemma2Config(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2, head_dim=64, sliding_window=48,
                                       attn_logit_softcapping=20.0, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).to(device="cuda").eval()
    tokens = torch.randint(0, 512, (2, 200), device="cuda")

    def run(implementation, dtype):
        model.to(dtype=dtype).set_attn_implementation(implementation)
        with torch.no_grad():
            return model(tokens).logits.float()

    truth = run("eager", torch.float32)
    eager = run("eager", torch.bfloat16)
    ours = run(name, torch.bfloat16)
    assert sorted(calls) == [(-1, -1), (47, 0)] and not ct._warned
    assert (ours - truth).abs().max().item() <= 2 * (eager - truth).abs().max().item() + 1e-3

    def decode(implementation, dtype):  # 150 tokens of prefill, then ten one at a time on the cache
        model.to(dtype=dtype).set_attn_implementation(implementation)
        with torch.no_grad():
            out = model(tokens[:, :150], use_cache=True)
            logits = [out.logits[:, -1]]
            for t in range(150, 160):
                out = model(tokens[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
                logits.append(out.logits[:, -1])
        return torch.stack(logits).float()

    truth, eager, ours = decode("eager", torch.float32), decode("eager", torch.bfloat16), decode(name, torch.bfloat16)
    assert not ct._warned and (-1, 0) not in calls
    assert (ours - truth).abs().max().item() <= 2 * (eager - truth).abs().max().item() + 1e-3


def test_kvcache_decode_through_the_bridge_matches_cupy():
    """cuflash.torch.attention_with_kvcache on torch tensors (a paged bf16 cache and an FP8 one, with
    an append) gives what the CuPy call gives on the same memory, on torch's stream."""
    import cuflash.torch as ct

    torch.manual_seed(0)
    batch, heads, heads_k, head_dim, page = 3, 16, 4, 128, 16
    q = torch.randn(batch, 2, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    pages = torch.randperm(batch * 8, device="cuda", dtype=torch.int32).reshape(batch, 8)
    lens = torch.tensor([0, 40, 100], device="cuda", dtype=torch.int32)
    for fp8 in (None, "e4m3"):
        if fp8:
            cache = [torch.randint(0, 0x7E, (batch * 8, page, heads_k, head_dim), device="cuda", dtype=torch.uint8)
                     for _ in range(2)]
            new = [torch.randint(0, 0x7E, (batch, 2, heads_k, head_dim), device="cuda", dtype=torch.uint8)
                   for _ in range(2)]
        else:
            cache = [torch.randn(batch * 8, page, heads_k, head_dim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(2)]
            new = [torch.randn(batch, 2, heads_k, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        before = [c.clone() for c in cache]
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            out, lse = ct.attention_with_kvcache(q, *cache, cache_seqlens=lens, k_new=new[0], v_new=new[1],
                                                 page_table=pages, return_lse=True, fp8_format=fp8,
                                                 k_descale=0.5 if fp8 else None)
        stream.synchronize()
        appended = [c.clone() for c in cache]
        for c, b in zip(cache, before):
            c.copy_(b)
        torch.cuda.synchronize()
        want, want_lse = cuflash.attention_with_kvcache(
            _cupy(q), *(_cupy(c) for c in cache), cache_seqlens=_cupy(lens), k_new=_cupy(new[0]),
            v_new=_cupy(new[1]), page_table=_cupy(pages), return_lse=True, fp8_format=fp8,
            k_descale=0.5 if fp8 else None)
        cupy.cuda.Device().synchronize()
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        assert torch.equal(out, _torch(want)) and torch.equal(lse, _torch(want_lse))
        assert all(torch.equal(a, c) for a, c in zip(appended, cache))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_varlen_through_the_bridge_matches_cupy(with_sinks, compiled):
    """cuflash.torch.attention_varlen (packed sequences, GQA, causal, one empty sequence; with the
    sinks, a window, softcap and max_seqlen_k too), eagerly and under torch.compile: the output and every
    gradient, dsinks included, match the CuPy calls' on the same memory."""
    import numpy as np

    import cuflash.torch as ct

    torch.manual_seed(0)
    cu_q = torch.tensor(np.cumsum([0, 37, 0, 200, 5]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.cumsum([0, 50, 12, 200, 130]), dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu_q[-1]), 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(int(cu_k[-1]), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    sinks = torch.randn(8, device="cuda", requires_grad=True) if with_sinks else None
    variants = dict(window_size=(31, 0), softcap=8.0) if with_sinks else {}
    fn = torch.compile(ct.attention_varlen, fullgraph=True) if compiled else ct.attention_varlen
    maxima = dict(max_seqlen_k=200) if with_sinks else {}  # with both maxima no host read in the backward
    out = fn(q, k, v, cu_q, cu_k, max_seqlen_q=200, causal=True, sinks=sinks, **variants, **maxima)
    dout = torch.randn_like(out)
    out.backward(dout)
    torch.cuda.synchronize()
    views = [_cupy(x.detach()) for x in (q, k, v, cu_q, cu_k)]
    s = None if sinks is None else _cupy(sinks.detach())
    want, lse = cuflash.attention_varlen(*views, max_seqlen_q=200, causal=True, return_lse=True, sinks=s, **variants)
    grads = cuflash.attention_varlen_backward(_cupy(dout), *views[:3], want, lse, *views[3:], causal=True, sinks=s,
                                              **variants)
    cupy.cuda.Device().synchronize()
    assert torch.equal(out.detach(), _torch(want))
    got = [q.grad, k.grad, v.grad] + ([sinks.grad] if with_sinks else [])
    for g, w in zip(got, grads):
        assert torch.allclose(g.float(), _torch(w).float(), atol=1e-2, rtol=1e-2)


def _alibi_pair(heads):
    """The same ALiBi score_mod twice: reading its slopes from a torch tensor, and from a CuPy array."""
    slopes = torch.linspace(0.01, 0.5, heads, device="cuda")
    slopes_cupy = cupy.asarray(slopes.cpu().numpy())

    def with_tensor(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def with_array(score, b, h, q_idx, kv_idx):
        return score - slopes_cupy[h] * (q_idx - kv_idx)

    return with_tensor, with_array


def _holes(keys, seed=2):
    """A mask_mod reading an int32 torch tensor: key 0 and a random half of the others attend."""
    import numpy as np

    kept = torch.tensor(np.random.default_rng(seed).integers(0, 2, keys), device="cuda", dtype=torch.int32)

    def holes(b, h, q_idx, kv_idx):
        return (kept[kv_idx] == 1) | (kv_idx == 0)

    return holes


def _torch_mod_specs(arch):
    """The kernels of the mods tests below (their digests name them), for the session's pool."""
    import cuflash.torch  # noqa: F401 - captured torch tensors are read through it
    from cuflash.backward import _with_mods as _bwd_with_mods
    from cuflash.core import modset, policy
    from cuflash.forward import _with_mods
    from cuflash.varlen import hopper_spec

    if not torch.cuda.is_available():
        return []
    stub = type("P", (), {"head_dim": 64, "causal": True, "dtype": type("D", (), {"tag": "bf16"})(), "device_id": 0})()
    bwd = type("B", (), {"forward": stub})()
    specs = []
    for mods, sinks in ((modset.prepare(_alibi_pair(4)[0], _holes(239), 0), False),
                        (modset.prepare(_alibi_pair(4)[0], None, 0), True)):
        forward = _with_mods(policy.default_spec(64, "bf16", True, arch, seqlen=300), mods, stub, None)
        specs.append(forward.replace(sinks=True, lse=True) if sinks else forward)
        specs.append(_bwd_with_mods(policy.default_bwd_spec(64, "bf16", True, arch, False), mods, bwd))
    if arch == "sm90a":  # the varlen test's
        mods = modset.prepare(_alibi_pair(8)[0], None, 0)
        names = dict(score_mod=mods.score_digest, mask_mod=mods.mask_digest)
        specs.append(hopper_spec(128, "bf16", True, 130, arch).replace(**names))
        specs.append(policy.default_bwd_spec(128, "bf16", True, arch, False, family="wgmma").replace(varlen=True,
                                                                                                     **names))
    return specs


#: The warm fixtures' kernels by fixture name: the session compiles them in its first pool.
WARM = {"warm_torch_mod_kernels": _torch_mod_specs}


@pytest.fixture(scope="module")
def warm_torch_mod_kernels():
    from cuflash.core.compile import device_arch

    cuflash.warmup(_torch_mod_specs(device_arch()), progress=False)


@pytest.mark.usefixtures("warm_torch_mod_kernels")
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_mods_capturing_tensors_against_the_reference(layout):
    """A score_mod reading a float tensor and a mask_mod reading an int32 one (both torch, CUDA),
    forward and backward through the bridge, against the float64 reference."""
    import cuflash.torch as ct
    from cuflash import reference

    problem = AttentionProblem(batch=2, heads=4, heads_k=2, seqlen_q=113, seqlen_k=239, head_dim=64, dtype="bf16",
                               causal=True, layout=layout)
    q, k, v = problem.make_inputs(cupy, seed=11)
    dout = problem.make_dout(cupy, seed=11)
    alibi, holes = _alibi_pair(4)[0], _holes(239)

    tq, tk, tv = (_torch(x).requires_grad_() for x in (q, k, v))
    out, lse = ct.attention(tq, tk, tv, causal=True, layout=layout, return_lse=True, score_mod=alibi, mask_mod=holes)
    out.backward(_torch(dout))
    host = [cupy.asnumpy(x) for x in (q, k, v, dout)]
    args = dict(causal=True, layout=layout, score_mod=alibi, mask_mod=holes)
    ref, ref_lse = reference.attention_reference(*host[:3], **args)
    naive, naive_lse = reference.attention_naive(*host[:3], **args)
    assert_attention_close(_cupy(out.detach()), ref, "bf16", baseline=naive, lse=_cupy(lse), ref_lse=ref_lse,
                           baseline_lse=naive_lse)
    grads = tuple(_cupy(t.grad) for t in (tq, tk, tv))
    assert_gradients_close(grads, reference.attention_backward_reference(host[3], *host[:3], **args), "bf16",
                           baselines=reference.attention_backward_naive(host[3], *host[:3], **args))


def test_kvcache_mods_through_the_bridge_match_cupy():
    """attention_with_kvcache's mods through the bridge, capturing a torch tensor, give what the
    CuPy call gives with the same values in a CuPy array."""
    import cuflash.torch as ct

    torch.manual_seed(1)
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    cache = [torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    lens = torch.tensor([300, 17], device="cuda", dtype=torch.int32)
    with_tensor, with_array = _alibi_pair(8)

    out = ct.attention_with_kvcache(q, *cache, cache_seqlens=lens, score_mod=with_tensor)
    want = cuflash.attention_with_kvcache(_cupy(q), *(_cupy(c) for c in cache), cache_seqlens=_cupy(lens),
                                          score_mod=with_array)
    torch.cuda.synchronize()
    assert torch.equal(out, _torch(want))


def test_kvcache_rotary_through_the_bridge_matches_cupy():
    """The bridge's rotary tables give the CuPy call's output and cache bits."""
    import cuflash.torch as ct

    torch.manual_seed(3)
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    caches = [torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    new = [torch.randn(2, 1, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    lens = torch.tensor([250, 17], device="cuda", dtype=torch.int32)
    angles = torch.arange(300, device="cuda")[:, None] / 10000.0 ** (torch.arange(0, 64, 2, device="cuda") / 64)
    cos, sin = angles.cos().float(), angles.sin().float()
    copies = [_cupy(c.clone()) for c in caches]
    out = ct.attention_with_kvcache(q, *caches, cache_seqlens=lens, k_new=new[0], v_new=new[1], rotary_cos=cos,
                                    rotary_sin=sin, rotary_interleaved=True)
    want = cuflash.attention_with_kvcache(_cupy(q), *copies, cache_seqlens=_cupy(lens), k_new=_cupy(new[0]),
                                          v_new=_cupy(new[1]), rotary_cos=_cupy(cos), rotary_sin=_cupy(sin),
                                          rotary_interleaved=True)
    torch.cuda.synchronize()
    assert torch.equal(out, _torch(want)) and torch.equal(caches[0], _torch(copies[0]))


def test_kvcache_under_torch_compile_appends_in_place_and_matches_eager():
    """A decode step compiled with fullgraph=True: the operator's output equals the eager call's,
    and the compiled step appends to the caches in place (the next step sees its keys)."""
    import cuflash.torch as ct

    torch.manual_seed(5)
    q = torch.randn(3, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    caches = [torch.randn(3, 256, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    new = [torch.randn(3, 2, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    lens = torch.tensor([0, 100, 200], device="cuda", dtype=torch.int32)

    def step(q, k_cache, v_cache, lens, k, v):
        return ct.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k_new=k, v_new=v)

    copies = [c.clone() for c in caches]
    want = step(q, *copies, lens, *new)
    got = torch.compile(step, fullgraph=True)(q, *caches, lens, *new)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert torch.equal(caches[0], copies[0]) and torch.equal(caches[1], copies[1])
    assert torch.equal(caches[0][1, 100:102], new[0][1])


def test_append_kv_through_the_bridge_matches_cupy():
    """cuflash.torch.append_kv writes the bits cuflash.append_kv writes, eagerly and compiled."""
    import cuflash.torch as ct

    torch.manual_seed(6)
    caches = [torch.randn(8, 16, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    k, v = (torch.randn(5, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = torch.tensor([3, 40, -1, 127, 128], device="cuda", dtype=torch.int32)  # padding, past the cache
    copies = [_cupy(c.clone()) for c in caches]
    cuflash.append_kv(*copies, _cupy(k), _cupy(v), _cupy(slots))
    eager = [c.clone() for c in caches]
    ct.append_kv(*eager, k, v, slots)
    torch.compile(lambda *a: ct.append_kv(*a), fullgraph=True)(*caches, k, v, slots)
    torch.cuda.synchronize()
    for got in (eager, caches):
        assert torch.equal(got[0], _torch(copies[0])) and torch.equal(got[1], _torch(copies[1]))
    assert torch.equal(caches[0].view(-1, 2, 128)[127], k[3])


def test_kvcache_packed_queries_through_the_bridge_match_cupy():
    """cu_seqlens_q through the bridge: the CuPy call's bits, NaN rows included."""
    import cuflash.torch as ct

    torch.manual_seed(4)
    q = torch.randn(9, 8, 128, device="cuda", dtype=torch.bfloat16)
    caches = [torch.randn(16, 16, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    table = torch.randperm(16, device="cuda", dtype=torch.int32)[:12].reshape(3, 4)
    lens = torch.tensor([40, 3, 64], device="cuda", dtype=torch.int32)
    cu = torch.tensor([0, 1, 6, 8], device="cuda", dtype=torch.int32)  # the last row no sequence's
    out, lse = ct.attention_with_kvcache(q, *caches, cache_seqlens=lens, page_table=table, cu_seqlens_q=cu,
                                         max_seqlen_q=5, return_lse=True)
    want, want_lse = cuflash.attention_with_kvcache(_cupy(q), *(_cupy(c) for c in caches), cache_seqlens=_cupy(lens),
                                                    page_table=_cupy(table), cu_seqlens_q=_cupy(cu), max_seqlen_q=5,
                                                    return_lse=True)
    torch.cuda.synchronize()
    assert out.shape == q.shape and lse.shape == (8, 9)
    assert torch.equal(out.view(torch.int16), _torch(want).view(torch.int16))
    assert torch.equal(lse.isnan(), _torch(want_lse).isnan()) and out[-1].isnan().all()


@pytest.mark.usefixtures("warm_torch_mod_kernels")
def test_varlen_mods_through_the_bridge_match_cupy():
    """attention_varlen with a score_mod capturing a torch tensor gives the bits of the CuPy calls
    with the same values in a CuPy array (dQ: its rounding, summed in any order)."""
    import cuflash.torch as ct

    torch.manual_seed(2)
    lengths = [70, 0, 130, 33]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    total = int(cu[-1])
    q = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(total, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    with_tensor, with_array = _alibi_pair(8)

    out, lse = ct.attention_varlen(q, k, v, cu, cu, max_seqlen_q=130, max_seqlen_k=130, causal=True,
                                   return_lse=True, score_mod=with_tensor)
    dout = torch.randn_like(out)
    out.backward(dout)
    args = dict(causal=True, score_mod=with_array)
    want, want_lse = cuflash.attention_varlen(*(_cupy(x.detach()) for x in (q, k, v)), _cupy(cu), _cupy(cu),
                                              max_seqlen_q=130, return_lse=True, **args)
    grads = cuflash.attention_varlen_backward(_cupy(dout), *(_cupy(x.detach()) for x in (q, k, v)), want, want_lse,
                                              _cupy(cu), _cupy(cu), max_seqlen_q=130, max_seqlen_k=130, **args)
    torch.cuda.synchronize()
    assert torch.equal(out.detach(), _torch(want)) and torch.equal(lse, _torch(want_lse))
    assert torch.equal(k.grad, _torch(grads[1])) and torch.equal(v.grad, _torch(grads[2]))
    # dQ's float32 partial sums are added in whatever order the blocks finish: rounding may differ
    assert torch.allclose(q.grad.float(), _torch(grads[0]).float(), rtol=2e-2, atol=2e-3)


@pytest.mark.usefixtures("warm_torch_mod_kernels")
def test_mods_with_sinks_through_the_bridge_match_cupy():
    """Sinks beside a score_mod: the bridge's output, LSE and gradients (dsinks included) are the
    CuPy calls' (dQ: its rounding, summed in any order)."""
    import cuflash.torch as ct

    torch.manual_seed(3)
    q = torch.randn(1, 4, 200, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, device="cuda", requires_grad=True)
    with_tensor, with_array = _alibi_pair(4)
    out, lse = ct.attention(q, k, v, causal=True, return_lse=True, sinks=sinks, score_mod=with_tensor)
    dout = torch.randn_like(out)
    out.backward(dout)
    plain = [_cupy(x.detach()) for x in (q, k, v)]
    want, want_lse = cuflash.attention(*plain, causal=True, return_lse=True, sinks=_cupy(sinks.detach()),
                                       score_mod=with_array)
    grads = cuflash.attention_backward(_cupy(dout), *plain, want, want_lse, causal=True, sinks=_cupy(sinks.detach()),
                                       score_mod=with_array)
    torch.cuda.synchronize()
    assert torch.equal(out.detach(), _torch(want)) and torch.equal(lse, _torch(want_lse))
    assert torch.equal(k.grad, _torch(grads[1])) and torch.equal(v.grad, _torch(grads[2]))
    assert torch.allclose(sinks.grad, _torch(grads[3]), rtol=1e-5, atol=1e-6)
    assert torch.allclose(q.grad.float(), _torch(grads[0]).float(), rtol=2e-2, atol=2e-3)
