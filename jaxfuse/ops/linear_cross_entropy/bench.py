"""Bench cases for ``linear_cross_entropy``, beside the unfused ``x @ weight`` and ``optax``.

FLOPs counted: the output projection, 2·N·W·V forward; the training step adds dx and dweight,
6·N·W·V (the fused step computes the gradients in its forward walk, as many matmuls). The table's
temporary-memory column is the point: the unfused step holds the (N, V) logits and their
gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxfuse._core import registry, tune
from jaxfuse._core.bench import DEFAULT, TF32_TOLERANCE, Case, implementation_arg
from jaxfuse.ops.linear_cross_entropy.api import linear_cross_entropy

# The CUDA libraries this family's cases run, loaded (built on a cold cache) side by side before
# any is timed.
CUDA_LIBRARIES = ("jaxfuse.ops.softmax.cuda",)

# GPT-2 small's output layer at 8 x 2048 tokens (the shape issue 21 names).
GPU_SHAPES = [(16384, 768, 50257)]


def _loss(impl):
  if impl == "optax":
    import optax
    return lambda x, weight, labels: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(
            jnp.dot(x, weight, preferred_element_type=jnp.float32), labels))
  return functools.partial(linear_cross_entropy, implementation=implementation_arg(impl))


def _forward(impl):
  return _loss(impl)


def _train(impl):
  return jax.value_and_grad(_loss(impl), (0, 1))


def _inputs(key, tokens, width, vocab, dtype):
  kx, kw, kl = jax.random.split(key, 3)
  return (jax.random.normal(kx, (tokens, width), dtype),
          (jax.random.normal(kw, (width, vocab)) * width ** -0.5).astype(dtype),
          jax.random.randint(kl, (tokens,), 0, vocab, jnp.int32))


def _case(tokens, width, vocab, dtype, impls):
  flops = 2 * tokens * width * vocab
  return Case(
      op="linear_cross_entropy", label=f"{tokens}x{width}x{vocab} {jnp.dtype(dtype).name}",
      size=vocab,
      make_inputs=functools.partial(_inputs, tokens=tokens, width=width, vocab=vocab,
                                    dtype=dtype),
      forward=_forward, train=_train, forward_work=flops, train_work=3 * flops,
      reduction_length=max(tokens, width, vocab),
      tolerance=(TF32_TOLERANCE if registry.platform() == "gpu" and dtype == jnp.float32
                 else None),
      notes={"optax": "logits x @ weight in float32 (N x V in memory), then optax's loss"},
      implementations=impls, unit="TFLOP/s")


def cases(quick: bool = False) -> list[Case]:
  shapes = GPU_SHAPES if registry.platform() == "gpu" else [(256, 64, 8192)]
  return [_case(tokens, width, vocab, jnp.bfloat16, ("optax", "xla", "cuda", DEFAULT))
          for tokens, width, vocab in shapes]


# (tokens, width, vocabulary, dtype) of real output layers, few tokens to many.
REGRET_GRID = [(512, 768, 50257, jnp.bfloat16), (4096, 2048, 32000, jnp.bfloat16),
               (8192, 4096, 128256, jnp.bfloat16), (2048, 1024, 50304, jnp.float32)]


def regret_cases() -> list[Case]:
  """``None`` against every implementation over :data:`REGRET_GRID` (one checked case on the
  CPU)."""
  if registry.platform() != "gpu":
    return [_case(512, 64, 32768, jnp.bfloat16, ("xla", DEFAULT))]
  return [_case(*shape, ("xla", "cuda", DEFAULT)) for shape in REGRET_GRID]


def tune_cases() -> list[Case]:
  """The regret grid under the named implementations only."""
  return [dataclasses.replace(c, implementations=tuple(i for i in c.implementations
                                                       if i != DEFAULT))
          for c in regret_cases()]


def tuned_rows(rows) -> dict:
  """The order None tries the kernels in: by the geometric mean of the training step over the
  cases both ran."""
  return {"order": tune.order_by_geometric_mean(rows, "step", ("cuda", "xla"))}
