"""examples/train_tiny_gpt.py without a GPU: its hand-written gradients against finite differences,
and its loss falling, with NumPy and cuflash's float64 reference standing in for CuPy and the kernels."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from cuflash import reference

_PATH = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_gpt.py"
_spec = importlib.util.spec_from_file_location("train_tiny_gpt", _PATH)
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)


def reference_attention_with_grad(q, k, v, causal, layout):
    out, _ = reference.attention_reference(q, k, v, causal=causal, layout=layout)

    def backward(dout):
        grads = reference.attention_backward_reference(dout, q, k, v, causal=causal, layout=layout)
        return tuple(g.astype(q.dtype) for g in grads)
    return out.astype(q.dtype), backward


def test_gradients_match_finite_differences():
    model = gpt.TinyGPT(np, vocab=20, context=8, width=16, heads=2, layers=2, seed=0)
    model.params = {name: value.astype(np.float64) for name, value in model.params.items()}
    tokens = np.random.default_rng(1).integers(0, 20, size=(2, 8))
    targets = np.roll(tokens, -1, axis=1)
    _, grads = model.loss_and_grads(tokens, targets, reference_attention_with_grad, np.float64)
    for name in ("tokens", "positions", "qkv0", "proj1", "up0", "down1", "head"):
        index = (tokens[0, 0], 3) if name == "tokens" else (1, 3)
        value, eps = model.params[name][index], 1e-5
        model.params[name][index] = value + eps
        plus, _ = model.loss_and_grads(tokens, targets, reference_attention_with_grad, np.float64)
        model.params[name][index] = value - eps
        minus, _ = model.loss_and_grads(tokens, targets, reference_attention_with_grad, np.float64)
        model.params[name][index] = value
        assert grads[name][index] == pytest.approx((plus - minus) / (2 * eps), rel=1e-4, abs=1e-9), name


def test_the_loss_falls():
    config = dict(gpt.CONFIG, batch=4, width=32, context=16)
    losses = gpt.train(np, reference_attention_with_grad, np.float32, 15, config, log=lambda line: None)
    assert losses[-1] < losses[0] - 0.3
