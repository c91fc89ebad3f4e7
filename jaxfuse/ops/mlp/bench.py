"""Bench cases for ``gelu_mlp``: XLA's products and fusions against the GELU in cuBLASLt's
epilogues.

FLOPs counted: the two products, 2·M·F·(D + E) forward; the training step adds the four
products of the gradients, three times the forward's in all. The elementwise passes over the
hidden layer (M x F) that 'xla' adds are what 'cuda' takes into the products.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxfuse._core import registry, tune
from jaxfuse._core.bench import DEFAULT, Case, implementation_arg
from jaxfuse.ops.mlp.api import gelu_mlp

CUDA_LIBRARIES = ("jaxfuse.ops.mlp.cuda",)

# (rows, model width, hidden width): GPT-2 small's MLP in a training batch, and a wider model's.
GPU_SHAPES = [(16384, 768, 3072), (8192, 2048, 8192)]
# The regret grid adds few rows (a decoding batch), a mid-sized model and a wide one.
REGRET_SHAPES = GPU_SHAPES + [(512, 768, 3072), (4096, 1024, 4096), (4096, 4096, 16384)]


def _forward(impl):
  mlp = functools.partial(gelu_mlp, implementation=implementation_arg(impl))
  return lambda *params_and_dy: mlp(*params_and_dy[:-1])


def _train(impl):
  """The output and every gradient for a cotangent ``dy``, all in the operands' dtype (a
  float32 loss would be checked against float32's bound)."""
  mlp = functools.partial(gelu_mlp, implementation=implementation_arg(impl))

  def step(*params_and_dy):
    *params, dy = params_and_dy
    y, vjp = jax.vjp(mlp, *params)
    # The backward begins once the output is out, as in a model: one program holding both would
    # let XLA compute the forward's GELU in the backward's pass over the hidden layer, which no
    # model's step can.
    y, dy = jax.lax.optimization_barrier((y, dy))
    return (y,) + vjp(dy)
  return step


def _inputs(key, rows, width, hidden, dtype):
  keys = jax.random.split(key, 6)
  normal = lambda k, shape, scale=1.0: (jax.random.normal(k, shape) * scale).astype(dtype)
  return (normal(keys[0], (rows, width)), normal(keys[1], (width, hidden), width ** -0.5),
          normal(keys[2], (hidden,), 0.1), normal(keys[3], (hidden, width), hidden ** -0.5),
          normal(keys[4], (width,), 0.1), normal(keys[5], (rows, width)))


def _case(rows, width, hidden, dtype, impls):
  flops = 2 * rows * hidden * 2 * width
  return Case(
      op="gelu_mlp", label=f"{rows}x{width}x{hidden} {jnp.dtype(dtype).name}", size=hidden,
      make_inputs=functools.partial(_inputs, rows=rows, width=width, hidden=hidden, dtype=dtype),
      forward=_forward, train=_train, forward_work=flops, train_work=3 * flops,
      reduction_length=max(rows, width, hidden), roundings=4, implementations=impls,
      unit="TFLOP/s")


def cases(quick: bool = False) -> list[Case]:
  if registry.platform() != "gpu":
    return [_case(256, 64, 256, jnp.bfloat16, ("xla", DEFAULT))]
  shapes = GPU_SHAPES[:1] if quick else GPU_SHAPES
  return [_case(*shape, jnp.bfloat16, ("xla", "cuda", DEFAULT)) for shape in shapes]


def regret_cases() -> list[Case]:
  """``None`` against every implementation, at the bench's shapes in both 16-bit dtypes."""
  if registry.platform() != "gpu":
    return cases()
  return [_case(*shape, dtype, ("xla", "cuda", DEFAULT))
          for shape in REGRET_SHAPES for dtype in (jnp.bfloat16, jnp.float16)]


def tune_cases() -> list[Case]:
  """The regret grid under the named implementations only."""
  return [dataclasses.replace(c, implementations=tuple(i for i in c.implementations
                                                       if i != DEFAULT))
          for c in regret_cases()]


def tuned_rows(rows) -> dict:
  """The orders None tries the implementations in, for an evaluated call and a differentiated
  one: by the geometric mean of the forward's and of the training step's times over the cases
  both ran."""
  return {f"{use}_order": tune.order_by_geometric_mean(rows, use, ("cuda", "xla"))
          for use in ("forward", "step")}
