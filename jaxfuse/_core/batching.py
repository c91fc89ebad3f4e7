"""vmap for kernel calls wrapped for sharding.

Pallas calls wrapped for sharding (``custom_partitioning``) have no batching rule of their own.
For an op that is independent across its leading axis, a mapped axis is just more batch: the
rule folds it into the leading axis, calls the op once, and unfolds the results. An op whose
results mix over that axis (a weight gradient summed over the rows) takes the mapped examples
one at a time instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse._core import op


def fold_into_batch(fn):
  """``fn(*operands)`` with a batching rule that merges the mapped axis into axis 0."""
  def rule(axis_size, in_batched, *args):
    def merge(a, batched):
      if not batched:
        a = jnp.broadcast_to(a, (axis_size,) + a.shape)
      return a.reshape((axis_size * a.shape[1],) + a.shape[2:])

    outs = wrapped(*jax.tree.map(merge, list(args), list(in_batched)))
    outs = jax.tree.map(lambda o: o.reshape((axis_size, -1) + o.shape[1:]), outs)
    return outs, jax.tree.map(lambda _: True, outs)

  wrapped = op.vmappable(fn, rule)
  return wrapped


def one_example_at_a_time(fn):
  """``fn(*operands)`` with a batching rule that calls it on each mapped example in a loop."""
  def rule(axis_size, in_batched, *args):
    mapped = [i for i, batched in enumerate(in_batched) if batched]

    def one(example):
      full = list(args)
      for i, a in zip(mapped, example):
        full[i] = a
      return wrapped(*full)

    outs = jax.lax.map(one, [args[i] for i in mapped])
    return outs, jax.tree.map(lambda _: True, outs)

  wrapped = op.vmappable(fn, rule)
  return wrapped


# A vmap rule receives this level's mapped axis first; the call inside it hands the operand on
# to the rules of the levels around it, which move theirs in front of it in turn.
_front = op.vmappable(lambda x: x, lambda axis_size, in_batched, x: (_front(x), in_batched[0]))


def _front_fwd(x):
  return _front(x), None


def _front_bwd(residuals, cotangent):
  del residuals
  return (_front(cotangent),)


# A vmap rule alone has no reverse mode: the VJP moves the cotangent's mapped axis too.
_differentiable_front = op.differentiable(_front, _front_fwd, _front_bwd, static=())


def mapped_axis_first(x):
  """``x`` unchanged; under vmap its mapped axis moves to axis 0, and so does its cotangent's:
  for calls whose batching rules take only a leading mapped axis (JAX's cuDNN attention)."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return _differentiable_front(x)
  return _front(x)
