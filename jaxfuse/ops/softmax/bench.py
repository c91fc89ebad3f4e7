"""Bench cases for ``softmax`` and ``softmax_cross_entropy``, beside ``jax.nn`` and ``optax``.

Bytes counted: softmax forward reads x and writes y (2 passes); its training step adds the
backward's reads of y and dy and write of dx (5 passes). Cross-entropy reads the logits (1 pass)
for the loss; its training step (loss and dlogits) reads the logits and writes dlogits (2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfuse._core import registry
from jaxfuse._core.bench import DEFAULT, Case, implementation_arg
from jaxfuse.ops.softmax.api import softmax, softmax_cross_entropy

GPU_SOFTMAX = [(16384, n) for n in (1024, 4096, 8192, 16384, 32768)] + [(4096, 131072),
                                                                       (4096, 262144)]
GPU_CROSS_ENTROPY = [(8192, 131072), (16384, 32768)]


def _softmax_fn(impl):
  if impl == "jax.nn":
    return jax.nn.softmax
  return functools.partial(softmax, implementation=implementation_arg(impl))


def _softmax_forward(impl):
  f = _softmax_fn(impl)
  return lambda x, dy: f(x)


def _softmax_train(impl):
  f = _softmax_fn(impl)

  def step(x, dy):
    y, vjp = jax.vjp(f, x)
    return y, vjp(dy)[0]
  return step


def _softmax_inputs(key, rows, n, dtype):
  kx, kd = jax.random.split(key)
  return (3.0 * jax.random.normal(kx, (rows, n), dtype), jax.random.normal(kd, (rows, n), dtype))


def _ce_fn(impl):
  if impl == "optax":
    import optax
    return lambda logits, labels: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(logits, labels))
  return functools.partial(softmax_cross_entropy, implementation=implementation_arg(impl))


def _ce_forward(impl):
  return _ce_fn(impl)


def _ce_train(impl):
  return jax.value_and_grad(_ce_fn(impl))


def _ce_inputs(key, rows, vocab, dtype):
  kx, kl = jax.random.split(key)
  return (2.0 * jax.random.normal(kx, (rows, vocab), dtype),
          jax.random.randint(kl, (rows,), 0, vocab, jnp.int32))


def cases(quick: bool = False) -> list[Case]:
  on_gpu = registry.platform() == "gpu"
  if on_gpu:
    softmax_shapes = GPU_SOFTMAX[:2] if quick else GPU_SOFTMAX
    ce_shapes = GPU_CROSS_ENTROPY[:1] if quick else GPU_CROSS_ENTROPY
    impls, check_only = ("jax.nn", "xla", "triton", "cuda", DEFAULT), ()
  else:
    softmax_shapes, ce_shapes = [(64, 1000), (16, 40000)], [(64, 5000)]
    impls, check_only = ("jax.nn", "xla"), ("triton",)
  dtype = jnp.bfloat16
  itemsize = jnp.dtype(dtype).itemsize
  out = []
  for rows, n in softmax_shapes:
    pass_bytes = rows * n * itemsize
    out.append(Case(
        op="softmax", label=f"{rows}x{n} {jnp.dtype(dtype).name}", size=n,
        make_inputs=functools.partial(_softmax_inputs, rows=rows, n=n, dtype=dtype),
        forward=_softmax_forward, train=_softmax_train,
        forward_work=2 * pass_bytes, train_work=5 * pass_bytes, reduction_length=n,
        implementations=impls, check_only=check_only))
  ce_impls = tuple("optax" if i == "jax.nn" else i for i in impls)
  for rows, vocab in ce_shapes:
    pass_bytes = rows * vocab * itemsize
    out.append(Case(
        op="cross_entropy", label=f"{rows}x{vocab} {jnp.dtype(dtype).name}", size=vocab,
        make_inputs=functools.partial(_ce_inputs, rows=rows, vocab=vocab, dtype=dtype),
        forward=_ce_forward, train=_ce_train,
        forward_work=pass_bytes, train_work=2 * pass_bytes, reduction_length=max(rows, vocab),
        implementations=ce_impls, check_only=check_only))
  return out
