"""``linear_cross_entropy`` with each chunk's rows in one CUDA pass (the softmax family's
cross-entropy kernel, ``jaxfuse/ops/softmax/cuda/softmax.cu``).

The products stay with XLA (cuBLAS). Between them, XLA's row pass reads each chunk's float32
logits twice (the log-sum-exp, then the gradient); the kernel holds a row on chip in a
thread-block cluster and reads it once, adding the bias, leaving out the padding columns and
writing the gradient straight in the products' operand dtype.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap

from jaxfuse.ops.softmax import cuda as softmax_cuda

_OPERANDS = tuple(map(jnp.dtype, (jnp.float16, jnp.bfloat16, jnp.float32)))


def unavailable() -> str | None:
  return softmax_cuda.unavailable()


def unsupported(padded_vocab: int, operand_dtype) -> str | None:
  """Why the kernel cannot take a chunk of ``padded_vocab`` float32 logits per row whose
  gradient feeds products in ``operand_dtype``, or None."""
  if jnp.dtype(operand_dtype) not in _OPERANDS:
    return (f"the 'cuda' implementation takes float16, bfloat16 and float32 operands, not "
            f"{jnp.dtype(operand_dtype).name}")
  if softmax_cuda.cross_entropy_tiling(padded_vocab, jnp.float32) is None:
    return (f"the 'cuda' kernel holds a row of float32 logits on chip in one cluster; "
            f"{padded_vocab} columns are more than it holds")
  return None


def rows(logits, bias, labels, row_scale, lse, *, classes, label_smoothing, z_loss,
         grad_dtype):
  """``reference.xla_rows``'s contract; with a gradient the log-sum-exps are not returned
  (zeros), and a given ``lse`` is recomputed rather than read."""
  del lse  # one pass recomputes it from the row it already holds
  padded = logits.shape[1]
  with_grad = row_scale is not None
  call = _row_call(classes, label_smoothing, z_loss,
                   jnp.dtype(grad_dtype) if with_grad else None)
  loss, second = call(
      logits, labels, row_scale if with_grad else jnp.ones(labels.shape, jnp.float32),
      jnp.zeros((0,), jnp.float32) if bias is None
      else jnp.pad(bias.astype(jnp.float32), (0, padded - classes)))
  if not with_grad:
    return loss, second, None, None
  dbias = None if bias is None else jnp.sum(second[:, :classes], axis=0, dtype=jnp.float32)
  return loss, jnp.zeros_like(loss), second, dbias


@functools.cache
def _row_call(classes, label_smoothing, z_loss, grad_dtype):
  """The kernel on ``(logits (R, P), labels (R,), row_scale (R,), bias (P,) or (0,))`` with a
  batching rule: a mapped axis over the rows is more rows, while a mapped bias (each example
  its own layer) takes the examples one at a time."""
  options = dict(label_smoothing=label_smoothing, z_loss=z_loss, classes=classes)

  def call(logits, labels, row_scale, bias):
    bias = bias if bias.size else None
    if grad_dtype is None:
      return softmax_cuda.cross_entropy(logits, labels, mode="loss", bias=bias, **options)
    return softmax_cuda.cross_entropy(logits, labels, mode="fused", grad_dtype=grad_dtype,
                                      row_scale=row_scale, bias=bias, **options)

  wrapped = custom_vmap(call)

  def rule(axis_size, in_batched, *operands):
    spread = [o if batched else jnp.broadcast_to(o, (axis_size,) + o.shape)
              for o, batched in zip(operands, in_batched)]
    if in_batched[3]:
      outs = lax.map(lambda example: wrapped(*example), spread)
    else:
      folded = [o.reshape((-1,) + o.shape[2:]) for o in spread[:3]] + [operands[3]]
      outs = tuple(o.reshape((axis_size, -1) + o.shape[1:]) for o in wrapped(*folded))
    return outs, (True, True)

  wrapped.def_vmap(rule)
  return wrapped
