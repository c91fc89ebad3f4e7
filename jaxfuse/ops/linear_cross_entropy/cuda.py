"""``linear_cross_entropy`` with each chunk's rows in one CUDA pass (the softmax family's
cross-entropy kernel, ``jaxfuse/ops/softmax/cuda/softmax.cu``).

The products stay with XLA (cuBLAS). Between them, XLA's row pass reads each chunk's float32
logits twice (the log-sum-exp, then the gradient) in separate passes; the kernel takes a row
in one pass (held on chip in a thread-block cluster, or for rows of 16 KiB and more streamed by
one CTA that reads it again from L2), adding the bias, leaving out the padding columns and
writing the gradient straight in the products' operand dtype.
"""

from __future__ import annotations

import jax.numpy as jnp

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
  options = dict(label_smoothing=label_smoothing, z_loss=z_loss, classes=classes,
                 bias=None if bias is None
                 else jnp.pad(bias.astype(jnp.float32), (0, padded - classes)))
  if row_scale is None:
    loss, lse = softmax_cuda.cross_entropy(logits, labels, mode="loss", **options)
    return loss, lse, None, None
  loss, grad = softmax_cuda.cross_entropy(logits, labels, mode="fused", row_scale=row_scale,
                                          grad_dtype=jnp.dtype(grad_dtype), **options)
  dbias = None if bias is None else jnp.sum(grad[:, :classes], axis=0, dtype=jnp.float32)
  return loss, jnp.zeros_like(loss), grad, dbias
