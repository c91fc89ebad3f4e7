"""``cross_entropy_loss``: the training loop's loss over logits, in optax's terms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._core.validation import (check_array, comparable_labels, cross_entropy_options,
                                      describe)
from jaxfuse.ops.softmax.api import log_softmax, softmax_cross_entropy


def cross_entropy_loss(logits, labels, *, where=None, ignore_index: int | None = None,
                       label_smoothing: float = 0.0, z_loss: float = 0.0,
                       reduction: str = "mean", implementation: str | None = None):
  """Softmax cross-entropy of ``logits`` against integer labels or target distributions.

  Integer ``labels`` give :func:`jaxfuse.softmax_cross_entropy` (one read of the logits, no
  probabilities in memory); ``reduction='none'`` then equals
  ``optax.softmax_cross_entropy_with_integer_labels``. Floating ``labels`` of ``logits``'s shape
  are target distributions, as in ``optax.softmax_cross_entropy``: the loss is
  ``-sum(labels * log_softmax(logits))`` over the last axis, with :func:`jaxfuse.log_softmax`.

  Args:
    logits: ``(..., V)`` floating point.
    labels: integer ``logits.shape[:-1]``, or floating ``logits.shape``.
    where: optional boolean ``logits.shape[:-1]``: rows where False add no loss, no gradient
      and are not counted by ``'mean'`` (optax's ``where``).
    ignore_index: integer labels only: rows with this label are left out like ``where``.
    label_smoothing: in ``[0, 1)``: the target becomes ``(1 - s) * target + s / V``.
    z_loss: coefficient of ``logsumexp(logits)**2`` added per row (>= 0).
    reduction: ``'mean'`` over the counted rows (0 when none), ``'sum'``, or ``'none'``.
    implementation: passed to the jaxfuse op.

  Returns:
    A float32 scalar (float64 for float64 logits), or the per-row losses for ``'none'``.
  """
  op = "cross_entropy_loss"
  logits = check_array(op, "logits", logits)
  labels = check_array(op, "labels", labels, floating=False)
  ignore_index, label_smoothing, z_loss = cross_entropy_options(
      op, ignore_index, label_smoothing, z_loss, reduction)
  if where is not None:
    where = check_array(op, "where", where, floating=False)
    if where.dtype != jnp.bool_ or where.shape != logits.shape[:-1]:
      raise ValueError(f"{op}: where must be boolean of shape logits.shape[:-1]; got logits "
                       f"{describe(logits)} and where {describe(where)}")
  if jnp.issubdtype(labels.dtype, jnp.integer):
    if where is not None:
      # The masked rows take the ignored label (one no real label is, where none is given):
      # a label of no class would make the loss NaN.
      if ignore_index is None:
        ignore_index = int(np.iinfo(np.int32).min)
      labels = jnp.where(where, comparable_labels(labels), ignore_index)
    return softmax_cross_entropy(logits, labels, ignore_index=ignore_index,
                                 label_smoothing=label_smoothing, z_loss=z_loss,
                                 reduction=reduction, implementation=implementation)
  if not jnp.issubdtype(labels.dtype, jnp.floating):
    raise TypeError(f"{op}: labels must be integers or a floating distribution, got "
                    f"{describe(labels)}")
  if labels.shape != logits.shape:
    raise ValueError(f"{op}: floating labels (target distributions) must have logits' shape; "
                     f"got logits {describe(logits)} and labels {describe(labels)}")
  if ignore_index is not None:
    raise ValueError(f"{op}: ignore_index applies to integer labels; mask distributions with "
                     f"where=")
  accumulate = jnp.promote_types(jnp.float32, logits.dtype)
  target = labels.astype(accumulate)
  if label_smoothing:
    target = (1.0 - label_smoothing) * target + label_smoothing / logits.shape[-1]
  log_p = log_softmax(logits, implementation=implementation).astype(accumulate)
  rows = -jnp.sum(target * log_p, axis=-1)
  if z_loss:
    rows = rows + z_loss * jnp.square(jax.nn.logsumexp(logits.astype(accumulate), axis=-1))
  if where is not None:
    rows = jnp.where(where, rows, 0.0)
  if reduction == "none":
    return rows
  total = jnp.sum(rows)
  if reduction == "sum":
    return total
  counted = rows.size if where is None else jnp.sum(where, dtype=jnp.int32)
  return jnp.where(counted > 0, total / jnp.maximum(counted, 1), 0.0).astype(accumulate)
