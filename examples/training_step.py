"""Gradients of attention with CuPy alone: a few steps of gradient descent on q, k and v, with the
gradients checked against cuflash's float64 reference on the first step.

    python examples/training_step.py
"""
import sys


def main() -> int:
    from cuflash.tools.machine import gpu_status

    available, reason = gpu_status()
    if not available:
        print(f"skipped: this example needs a CUDA GPU ({reason})")
        return 0

    import cupy
    import ml_dtypes

    import cuflash
    from cuflash.testing import AttentionProblem, assert_gradients_close

    # Loss = 0.5 * |attention(q, k, v) - target|^2, so dL/dout = out - target.
    problem = AttentionProblem(batch=2, heads=8, heads_k=2, seqlen_q=512, seqlen_k=512, head_dim=64,
                               dtype="bf16", causal=True)
    q, k, v = problem.make_inputs(cupy, seed=0)
    target = cupy.zeros(q.shape, dtype=ml_dtypes.bfloat16)
    lr = 0.02
    for step in range(5):
        out, backward = cuflash.attention_with_grad(q, k, v, causal=True)
        dout = (out.astype(cupy.float32) - target.astype(cupy.float32)).astype(out.dtype)
        dq, dk, dv = backward(dout)
        loss = 0.5 * float(cupy.sum(dout.astype(cupy.float32) ** 2))
        print(f"step {step}: loss {loss:.2f}")
        if step == 0:
            assert_gradients_close((dq, dk, dv), problem.backward_reference(dout, q, k, v), "bf16",
                                   baselines=problem.backward_naive(dout, q, k, v))
            print("        gradients match the float64 reference (accuracy rule of cuflash.testing)")
        q, k, v = (x.astype(cupy.float32) - lr * g.astype(cupy.float32) for x, g in ((q, dq), (k, dk), (v, dv)))
        q, k, v = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
