"""Train a tiny GPT with CuPy alone: character embeddings, causal self-attention through
cuflash.attention_with_grad, an MLP, residual connections and Adam, every gradient written out by
hand. The corpus ships below; the loss is printed and falls.

    python examples/train_tiny_gpt.py [steps]
"""
import math
import sys

CORPUS = """\
FlashAttention computes exact attention without writing the score matrix to memory. It walks the
keys tile by tile, keeps a running maximum and a running sum for every query row, and rescales the
partial output whenever the maximum grows. The backward pass recomputes the probabilities from the
saved log-sum-exp instead of storing them. Tiles of queries, keys and values live in shared memory,
the scores live in registers, and only the output and one number per row reach device memory.
"""

CONFIG = dict(context=64, width=128, heads=4, layers=2, batch=16, lr=3e-3, seed=0)


class TinyGPT:
    """Parameters as float32 arrays of ``xp`` (CuPy, or NumPy with a stand-in attention)."""

    def __init__(self, xp, vocab: int, context: int, width: int, heads: int, layers: int, seed: int):
        rng = xp.random.default_rng(seed) if hasattr(xp.random, "default_rng") else xp.random.RandomState(seed)
        normal = (lambda *shape: rng.standard_normal(shape, dtype=xp.float32))
        self.xp, self.heads = xp, heads
        self.params = {"tokens": 0.1 * normal(vocab, width), "positions": 0.1 * normal(context, width),
                       "head": normal(width, vocab) / math.sqrt(width)}
        for i in range(layers):
            self.params[f"qkv{i}"] = normal(width, 3 * width) / math.sqrt(width)
            self.params[f"proj{i}"] = normal(width, width) / math.sqrt(width) / math.sqrt(2 * layers)
            self.params[f"up{i}"] = normal(width, 4 * width) / math.sqrt(width)
            self.params[f"down{i}"] = normal(4 * width, width) / math.sqrt(4 * width) / math.sqrt(2 * layers)
        self.layers = layers

    def loss_and_grads(self, tokens, targets, attention_with_grad, attention_dtype):
        """Mean cross-entropy of the next character, and the gradient of every parameter."""
        xp, p, h = self.xp, self.params, self.heads
        b, t = tokens.shape
        width = p["tokens"].shape[1]
        x = p["tokens"][tokens] + p["positions"][:t]
        saved = []
        for i in range(self.layers):
            qkv = x @ p[f"qkv{i}"]                                     # [b, t, 3 * width]
            q, k, v = (part.reshape(b, t, h, width // h).astype(attention_dtype)
                       for part in xp.split(qkv, 3, axis=-1))          # bshd
            att, att_backward = attention_with_grad(q, k, v, causal=True, layout="bshd")
            att = att.astype(x.dtype).reshape(b, t, width)
            x1 = x + att @ p[f"proj{i}"]
            hidden = x1 @ p[f"up{i}"]
            relu = xp.maximum(hidden, 0)
            x2 = x1 + relu @ p[f"down{i}"]
            saved.append((x, att, att_backward, x1, hidden, relu))
            x = x2
        logits = x @ p["head"]                                         # [b, t, vocab]
        logits = logits - logits.max(axis=-1, keepdims=True)
        probs = xp.exp(logits)
        probs /= probs.sum(axis=-1, keepdims=True)
        picked = xp.take_along_axis(probs, targets[..., None], axis=-1)[..., 0]
        loss = float(-xp.log(picked + 1e-12).mean())

        grads = {}
        dlogits = probs
        dlogits[xp.arange(b)[:, None], xp.arange(t)[None, :], targets] -= 1
        dlogits /= b * t
        grads["head"] = x.reshape(-1, width).T @ dlogits.reshape(-1, dlogits.shape[-1])
        dx = dlogits @ p["head"].T
        for i in reversed(range(self.layers)):
            x_in, att, att_backward, x1, hidden, relu = saved[i]
            grads[f"down{i}"] = relu.reshape(-1, relu.shape[-1]).T @ dx.reshape(-1, width)
            dhidden = (dx @ p[f"down{i}"].T) * (hidden > 0)
            grads[f"up{i}"] = x1.reshape(-1, width).T @ dhidden.reshape(-1, dhidden.shape[-1])
            dx1 = dx + dhidden @ p[f"up{i}"].T
            grads[f"proj{i}"] = att.reshape(-1, width).T @ dx1.reshape(-1, width)
            datt = (dx1 @ p[f"proj{i}"].T).reshape(b, t, h, width // h).astype(attention_dtype)
            dq, dk, dv = (g.astype(x_in.dtype).reshape(b, t, width) for g in att_backward(datt))
            dqkv = xp.concatenate([dq, dk, dv], axis=-1)
            grads[f"qkv{i}"] = x_in.reshape(-1, width).T @ dqkv.reshape(-1, 3 * width)
            dx = dx1 + dqkv @ p[f"qkv{i}"].T
        grads["positions"] = xp.zeros_like(p["positions"])
        grads["positions"][:t] = dx.sum(axis=0)
        grads["tokens"] = xp.zeros_like(p["tokens"])
        _scatter_add(xp, grads["tokens"], tokens.reshape(-1), dx.reshape(-1, width))
        return loss, grads


def _scatter_add(xp, target, index, values) -> None:
    """target[index] += values, repeated indices summed."""
    if xp.__name__ == "cupy":
        import cupyx
        cupyx.scatter_add(target, index, values)
    else:
        xp.add.at(target, index, values)


class Adam:
    def __init__(self, xp, params: dict, lr: float, betas=(0.9, 0.99), eps=1e-8):
        self.xp, self.lr, self.betas, self.eps, self.step_count = xp, lr, betas, eps, 0
        self.m = {n: xp.zeros_like(v) for n, v in params.items()}
        self.v = {n: xp.zeros_like(v) for n, v in params.items()}

    def step(self, params: dict, grads: dict) -> None:
        self.step_count += 1
        b1, b2 = self.betas
        for name, g in grads.items():
            self.m[name] = b1 * self.m[name] + (1 - b1) * g
            self.v[name] = b2 * self.v[name] + (1 - b2) * g * g
            m_hat = self.m[name] / (1 - b1 ** self.step_count)
            v_hat = self.v[name] / (1 - b2 ** self.step_count)
            params[name] -= self.lr * m_hat / (self.xp.sqrt(v_hat) + self.eps)


def train(xp, attention_with_grad, attention_dtype, steps: int, config=CONFIG, log=print) -> list[float]:
    """Train on CORPUS for ``steps`` steps; returns the losses."""
    chars = sorted(set(CORPUS))
    encoded = xp.asarray([chars.index(c) for c in CORPUS], dtype=xp.int32)
    model = TinyGPT(xp, len(chars), config["context"], config["width"], config["heads"], config["layers"],
                    config["seed"])
    optimizer = Adam(xp, model.params, config["lr"])
    rng = xp.random.default_rng(config["seed"] + 1) if hasattr(xp.random, "default_rng") else \
        xp.random.RandomState(config["seed"] + 1)
    context, losses = config["context"], []
    for step in range(steps):
        starts = rng.integers(0, len(CORPUS) - context - 1, size=config["batch"])
        offsets = starts[:, None] + xp.arange(context)[None, :]
        loss, grads = model.loss_and_grads(encoded[offsets], encoded[offsets + 1], attention_with_grad,
                                           attention_dtype)
        optimizer.step(model.params, grads)
        losses.append(loss)
        if step % 10 == 0 or step == steps - 1:
            log(f"step {step:3d}: loss {loss:.3f}")
    return losses


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    from cuflash.tools.machine import gpu_status

    available, reason = gpu_status()
    if not available:
        print(f"skipped: this example needs a CUDA GPU ({reason})")
        return 0
    import cupy
    import ml_dtypes

    import cuflash
    losses = train(cupy, cuflash.attention_with_grad, ml_dtypes.bfloat16, steps)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (a character drawn at random: {math.log(len(set(CORPUS))):.3f})")
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
