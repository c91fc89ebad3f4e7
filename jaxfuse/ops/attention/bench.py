"""Bench cases for ``attention``: TFLOP/s of the forward and of the training step.

FLOPs: ``4 * B * T * S * N * H`` for the two matrix products of the forward (halved when
causal, T == S); the training step counts 3.5 times that (forward plus a backward of 2.5x).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfuse._core import registry
from jaxfuse._core.bench import Case
from jaxfuse.ops.attention import reference
from jaxfuse.ops.attention.api import attention

GPU_SHAPES = [(4, 4096, 16, 128), (1, 16384, 16, 128), (8, 2048, 16, 64), (2, 8192, 8, 256)]


def _inputs(key, b, t, n, h, dtype):
  kq, kk, kv, kd = jax.random.split(key, 4)
  shape = (b, t, n, h)
  return tuple(jax.random.normal(k_, shape, dtype) for k_ in (kq, kk, kv, kd))


def _forward(causal, impl):
  return lambda q, k, v, do: attention(q, k, v, is_causal=causal, implementation=impl)


def _train(causal, impl):
  def step(q, k, v, do):
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, is_causal=causal,
                                                 implementation=impl), q, k, v)
    return (out,) + vjp(do)
  return step


def _train_floors(causal, q, k, v, do):
  dq, dk = reference.gradient_floors(q, k, v, do, causal=causal)
  return 0.0, dq, dk, 0.0


def cases(quick: bool = False) -> list[Case]:
  if registry.platform() == "gpu":
    shapes = GPU_SHAPES[:1] if quick else GPU_SHAPES
    check_only = ()
  else:
    shapes, check_only = [(1, 256, 2, 64)], ("triton",)
  out = []
  for b, t, n, h in shapes:
    for causal in (False, True):
      flops = 4 * b * t * t * n * h / (2 if causal else 1)
      impls = ("cudnn", "triton", "mosaic") if registry.platform() == "gpu" else ("xla",)
      if registry.platform() == "gpu" and t <= 2048:
        impls = ("xla",) + impls
      out.append(Case(
          op="attention", label=f"{b}x{t}x{n}x{h} {'causal' if causal else 'full'}", size=t,
          make_inputs=functools.partial(_inputs, b=b, t=t, n=n, h=h, dtype=jnp.bfloat16),
          forward=functools.partial(_forward, causal), train=functools.partial(_train, causal),
          forward_work=flops, train_work=3.5 * flops, implementations=impls,
          unit="TFLOP/s", check_only=check_only,
          train_floors=functools.partial(_train_floors, causal)))
  return out
