"""One attention case for tests and fuzzing: shapes, dtype, mask, layout and memory layout of the
inputs, their random inputs, and their reference and baseline results
(:class:`AttentionProblem`; :class:`Fp8AttentionProblem` for FP8 inputs). :mod:`cuflash.testing`
draws them and checks results against them."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import fp8, reference
from .core import dtypes
from .core.validate import validate_variants

#: What the FP8 kernels take: formats, descale granularities and output dtypes.
FP8_FORMATS = ("e4m3", "e5m2")
FP8_GRANULARITIES = ("tensor", "head")
FP8_OUT_DTYPES = reference.FP8_OUT_DTYPES


def to_numpy(x) -> np.ndarray:
    """A NumPy array of ``x``, copying CuPy arrays to the host."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy.asnumpy(x)
    return np.asarray(x)


@dataclass(frozen=True)
class _ProblemGeometry:
    """The sizes both AttentionProblem and Fp8AttentionProblem start with, and what they imply
    together with the subclasses' causal, layout and scale fields."""

    batch: int
    heads: int                  # query heads
    heads_k: int                # key/value heads; divides ``heads``
    seqlen_q: int
    seqlen_k: int
    head_dim: int

    def _geometry_problems(self) -> list[str]:
        """What is wrong with the sizes, the head grouping and the layout (empty when nothing)."""
        problems = []
        for name in ("batch", "heads", "heads_k", "head_dim"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("seqlen_q", "seqlen_k"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must be non-negative")
        if self.heads_k >= 1 and self.heads % self.heads_k:
            problems.append(f"heads={self.heads} must be a multiple of heads_k={self.heads_k}")
        if self.layout not in reference.LAYOUTS:
            problems.append(f"layout={self.layout!r} (choose one of {reference.LAYOUTS})")
        return problems

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale

    @property
    def work(self) -> int:
        """``batch * heads * seqlen_q * seqlen_k * head_dim``: the size of the reference's job."""
        return self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.head_dim

    def flops(self) -> int:
        return reference.attention_flops(self.batch, self.heads, self.seqlen_q, self.seqlen_k,
                                         self.head_dim, self.causal)

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(q_shape, kv_shape)`` in this problem's layout."""
        if self.layout == "bhsd":
            return ((self.batch, self.heads, self.seqlen_q, self.head_dim),
                    (self.batch, self.heads_k, self.seqlen_k, self.head_dim))
        return ((self.batch, self.seqlen_q, self.heads, self.head_dim),
                (self.batch, self.seqlen_k, self.heads_k, self.head_dim))


@dataclass(frozen=True)
class AttentionProblem(_ProblemGeometry):
    """One attention problem: shapes, dtype, mask, layout and memory layout of the inputs."""

    dtype: str                  # tag from cuflash.dtypes ("fp16", "bf16", "fp32")
    causal: bool = False
    layout: str = "bhsd"
    strided: bool = False       # inputs are non-contiguous views whose last dim has stride 1
    scale: float | None = None  # None: 1 / sqrt(head_dim)
    window_size: tuple = (-1, -1)  # FlashAttention's sliding window (left, right); -1 unbounded
    softcap: float = 0.0        # logit cap, 0: none

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtypes.from_tag(self.dtype).tag)
        object.__setattr__(self, "window_size", tuple(self.window_size))
        problems = self._geometry_problems()
        try:
            variants = validate_variants(self.window_size, self.softcap, self.causal)
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
        else:
            if variants is not None and self.dtype == "fp32":
                problems.append("window_size and softcap run on fp16 and bf16 inputs, not fp32")
        if problems:
            raise ValueError("invalid attention problem: " + "; ".join(problems))

    @property
    def variants(self) -> dict:
        """The call's ``window_size`` and ``softcap`` keywords (for cuflash and the reference)."""
        return dict(window_size=self.window_size, softcap=self.softcap)

    @property
    def name(self) -> str:
        """A short readable label, e.g. ``bf16 hd128 causal b2 h4/2 sq17 sk113 bshd strided``."""
        parts = [self.dtype, f"hd{self.head_dim}"]
        if self.causal:
            parts.append("causal")
        heads = f"h{self.heads}" if self.heads == self.heads_k else f"h{self.heads}/{self.heads_k}"
        parts += [f"b{self.batch}", heads, f"sq{self.seqlen_q}", f"sk{self.seqlen_k}", self.layout]
        if self.strided:
            parts.append("strided")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        if self.window_size != (-1, -1):
            parts.append("window{},{}".format(*self.window_size))
        if self.softcap:
            parts.append(f"softcap{self.softcap:g}")
        return " ".join(parts)

    @property
    def numpy_dtype(self) -> np.dtype:
        return dtypes.DTYPES[self.dtype].numpy

    def make_inputs(self, xp=np, seed: int | None = None):
        """Random N(0, 1) ``(q, k, v)`` in this problem's dtype and layout, on ``xp`` (numpy or cupy).

        With ``strided`` each tensor is a view of a larger buffer allocated in the other layout's
        axis order with ``head_dim`` padded by 8 elements (keeping every row 16-byte aligned), so
        all strides but the last differ from a contiguous array while the last stays 1 element.
        The padding holds NaN: a kernel that reads past a row shows it in its output. Buffers are
        built in NumPy (ml_dtypes for bfloat16) and moved with ``xp.asarray`` before the view is
        taken, so the view's strides survive the move.
        """
        rng = np.random.default_rng(seed)
        q_shape, kv_shape = self.shapes()
        return tuple(self._make_one(xp, rng, shape) for shape in (q_shape, kv_shape, kv_shape))

    def _make_one(self, xp, rng, shape):
        dtype = self.numpy_dtype
        if not self.strided:
            values = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
            return xp.asarray(values)
        b, s1, s2, d = shape
        buffer = np.full((b, s2, s1, d + 8), np.nan, dtype=np.float32)
        buffer[..., :d] = rng.standard_normal((b, s2, s1, d), dtype=np.float32)
        buffer = xp.asarray(buffer.astype(dtype))
        return buffer[..., :d].transpose(0, 2, 1, 3)

    def reference(self, q, k, v):
        """float64 ``(out, lse)`` of :func:`~cuflash.reference.attention_reference` for these inputs."""
        return reference.attention_reference(to_numpy(q), to_numpy(k), to_numpy(v), causal=self.causal,
                                             scale=self.scale, layout=self.layout, **self.variants)

    def naive(self, q, k, v):
        """``(out, lse)`` of :func:`~cuflash.reference.attention_naive`: the accuracy baseline."""
        return reference.attention_naive(to_numpy(q), to_numpy(k), to_numpy(v), causal=self.causal,
                                         scale=self.scale, layout=self.layout, **self.variants)


    def make_dout(self, xp=np, seed: int | None = None):
        """A random N(0, 1) output gradient shaped like q (contiguous, this problem's layout)."""
        rng = np.random.default_rng(None if seed is None else seed + 1)
        q_shape, _ = self.shapes()
        return xp.asarray(rng.standard_normal(q_shape, dtype=np.float32).astype(self.numpy_dtype))

    def backward_reference(self, dout, q, k, v):
        """float64 ``(dq, dk, dv)`` of :func:`~cuflash.reference.attention_backward_reference`."""
        return reference.attention_backward_reference(to_numpy(dout), to_numpy(q), to_numpy(k), to_numpy(v),
                                                      causal=self.causal, scale=self.scale, layout=self.layout,
                                                      **self.variants)

    def backward_naive(self, dout, q, k, v):
        """``(dq, dk, dv)`` of :func:`~cuflash.reference.attention_backward_naive`: the baseline."""
        return reference.attention_backward_naive(to_numpy(dout), to_numpy(q), to_numpy(k), to_numpy(v),
                                                  causal=self.causal, scale=self.scale, layout=self.layout,
                                                  **self.variants)


@dataclass(frozen=True, eq=False)
class Fp8Inputs:
    """Quantized inputs of an :class:`Fp8AttentionProblem`: FP8 codes and their descales on the
    problem's array module, and the float32 NumPy tensors they were quantized from (before any
    rotation), the ground truth the quantization approximates."""

    q: object
    k: object
    v: object
    q_descale: object
    k_descale: object
    v_descale: object
    originals: tuple


@dataclass(frozen=True)
class Fp8AttentionProblem(_ProblemGeometry):
    """One attention problem on FP8 inputs: shapes, format, descale granularity, output dtype.

    Inputs are drawn N(0, 1) in float32; ``outliers`` head-dim channels of q and k are made
    ``outlier_factor`` times larger (activation outliers); with ``rotate`` q and k are multiplied by
    :func:`cuflash.fp8.random_rotation` before quantizing, which leaves ``q k^T`` unchanged.
    All three are quantized with :func:`cuflash.fp8.quantize_fp8` at ``granularity``.
    """

    fp8_format: str = "e4m3"
    granularity: str = "tensor"  # "tensor" (descale shaped ()) or "head" ((batch, heads))
    out_dtype: str = "bf16"
    causal: bool = False
    layout: str = "bhsd"
    scale: float | None = None
    outliers: int = 0
    outlier_factor: float = 50.0
    rotate: bool = False

    def __post_init__(self):
        problems = self._geometry_problems()
        if self.fp8_format not in FP8_FORMATS:
            problems.append(f"fp8_format={self.fp8_format!r} (choose one of {FP8_FORMATS})")
        if self.granularity not in FP8_GRANULARITIES:
            problems.append(f"granularity={self.granularity!r} (choose one of {FP8_GRANULARITIES})")
        if self.out_dtype not in FP8_OUT_DTYPES:
            problems.append(f"out_dtype={self.out_dtype!r} (choose one of {FP8_OUT_DTYPES})")
        if not 0 <= self.outliers <= self.head_dim:
            problems.append(f"outliers={self.outliers} must be between 0 and head_dim={self.head_dim}")
        if problems:
            raise ValueError("invalid FP8 attention problem: " + "; ".join(problems))

    @property
    def name(self) -> str:
        """e.g. ``e4m3/head->bf16 hd128 causal b2 h4/2 sq17 sk113 bshd outliers4 rotated``."""
        parts = [f"{self.fp8_format}/{self.granularity}->{self.out_dtype}", f"hd{self.head_dim}"]
        if self.causal:
            parts.append("causal")
        heads = f"h{self.heads}" if self.heads == self.heads_k else f"h{self.heads}/{self.heads_k}"
        parts += [f"b{self.batch}", heads, f"sq{self.seqlen_q}", f"sk{self.seqlen_k}", self.layout]
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        if self.outliers:
            parts.append(f"outliers{self.outliers}x{self.outlier_factor:g}")
        if self.rotate:
            parts.append("rotated")
        return " ".join(parts)

    @property
    def out_numpy_dtype(self) -> np.dtype:
        return dtypes.from_tag(self.out_dtype).numpy

    def rotation(self) -> np.ndarray | None:
        """The rotation applied to q and k (None without ``rotate``); the same for every seed."""
        return fp8.random_rotation(self.head_dim, seed=0) if self.rotate else None

    def make_inputs(self, xp=np, seed: int | None = None) -> Fp8Inputs:
        """Fresh random inputs, quantized in NumPy and moved to ``xp`` (numpy or cupy)."""
        rng = np.random.default_rng(seed)
        q_shape, kv_shape = self.shapes()
        q, k, v = (rng.standard_normal(shape, dtype=np.float32) for shape in (q_shape, kv_shape, kv_shape))
        if self.outliers:
            channels = rng.choice(self.head_dim, size=self.outliers, replace=False)
            q[..., channels] *= np.float32(self.outlier_factor)
            k[..., channels] *= np.float32(self.outlier_factor)
        rotation = self.rotation()
        quantized = [fp8.quantize_fp8(x, self.fp8_format, self.granularity, layout=self.layout,
                                      rotation=rotation if x is not v else None) for x in (q, k, v)]
        (qc, qd), (kc, kd), (vc, vd) = ((xp.asarray(c), xp.asarray(d)) for c, d in quantized)
        return Fp8Inputs(qc, kc, vc, qd, kd, vd, (q, k, v))

    def attention_kwargs(self, inputs: Fp8Inputs) -> dict:
        """Keyword arguments of ``cuflash.attention`` (and of the reference functions) for these
        inputs: ``causal``, ``scale``, ``layout``, ``fp8_format``, the descales and ``out_dtype``."""
        return dict(causal=self.causal, scale=self.scale, layout=self.layout, fp8_format=self.fp8_format,
                    q_descale=inputs.q_descale, k_descale=inputs.k_descale, v_descale=inputs.v_descale,
                    out_dtype=self.out_dtype)

    def _numpy_args(self, inputs: Fp8Inputs):
        kwargs = self.attention_kwargs(inputs)
        for name in ("q_descale", "k_descale", "v_descale"):
            kwargs[name] = to_numpy(kwargs[name])
        return (to_numpy(inputs.q), to_numpy(inputs.k), to_numpy(inputs.v)), kwargs

    def reference(self, inputs: Fp8Inputs, sinks=None):
        """float64 ``(out, lse)`` of the dequantized inputs
        (:func:`~cuflash.reference.attention_fp8_reference`), with the call's ``sinks`` if any."""
        args, kwargs = self._numpy_args(inputs)
        kwargs.pop("out_dtype")
        return reference.attention_fp8_reference(*args, sinks=sinks, **kwargs)

    def naive(self, inputs: Fp8Inputs, sinks=None):
        """``(out, lse)`` of :func:`~cuflash.reference.attention_fp8_naive`: the accuracy baseline."""
        args, kwargs = self._numpy_args(inputs)
        return reference.attention_fp8_naive(*args, sinks=sinks, **kwargs)

    def float_reference(self, inputs: Fp8Inputs):
        """float64 ``(out, lse)`` of the float inputs before quantization (and rotation): what
        quantizing costs is the distance to this one."""
        return reference.attention_reference(*inputs.originals, causal=self.causal, scale=self.scale,
                                             layout=self.layout)
