"""XLA implementation of ``linear_cross_entropy``: the vocabulary walked in chunks.

Each chunk's logits ``x @ weight[:, chunk] + bias[chunk]`` live only while they are folded
into a running log-sum-exp (and the label's logit and the logits' sum, for label smoothing);
the backward recomputes them chunk by chunk, adds each chunk's part of ``dx`` and of its own
columns of ``dweight``. The chunks are the iterations of a loop, so temporary memory is
O(tokens x chunk) whatever XLA's scheduler does, never O(tokens x vocabulary). The last chunk
ends at the vocabulary's end and may overlap the one before it; the columns already seen are
masked out of it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# Vocabulary columns per chunk: the (tokens, chunk) logits in float32 are the largest temporary.
CHUNK = 8192


def _chunk(x, weight, bias, index, width, accumulate):
  """Chunk ``index``'s logits, its first column, its global columns, and which are new."""
  vocab = weight.shape[1]
  start = jnp.minimum(index * width, vocab - width)
  columns = start + jnp.arange(width)
  w = lax.dynamic_slice_in_dim(weight, start, width, axis=1).astype(x.dtype)
  logits = lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=accumulate)
  logits = logits + lax.dynamic_slice_in_dim(bias, start, width).astype(accumulate)
  return logits, start, columns, columns >= index * width


def rows(x, weight, bias, labels, *, label_smoothing, z_loss, chunk=CHUNK):
  """Per-row loss (0 where ``labels`` is -1) and log-sum-exp. ``x (N, W)`` in the products'
  operand dtype, ``weight (W, V)``, ``bias (V,)``, ``labels (N,)`` int32."""
  accumulate = jnp.promote_types(jnp.float32, x.dtype)
  vocab = weight.shape[1]
  width = min(chunk, vocab)

  def fold(index, carry):
    high, total_exp, picked, total = carry
    logits, _, columns, new = _chunk(x, weight, bias, index, width, accumulate)
    logits = jnp.where(new, logits, -jnp.inf)
    top = jnp.maximum(high, jnp.max(logits, axis=1))
    # A row whose logits so far are all -inf keeps a zero sum (no inf - inf).
    safe_top = jnp.where(jnp.isfinite(top), top, 0.0)
    total_exp = (total_exp * jnp.exp(high - safe_top)
                 + jnp.sum(jnp.exp(logits - safe_top[:, None]), axis=1))
    hit = new & (columns == labels[:, None])
    picked = picked + jnp.sum(jnp.where(hit, logits, 0.0), axis=1)
    total = total + jnp.sum(jnp.where(new, logits, 0.0), axis=1)
    return top, total_exp, picked, total

  zeros = jnp.zeros(x.shape[:1], accumulate)
  init = (jnp.full(x.shape[:1], -jnp.inf, accumulate), zeros, zeros, zeros)
  high, total_exp, picked, total = lax.fori_loop(0, -(-vocab // width), fold, init)
  lse = jnp.log(total_exp) + jnp.where(jnp.isfinite(high), high, 0.0)
  loss = lse - (1.0 - label_smoothing) * picked
  if label_smoothing:
    loss = loss - label_smoothing * total / vocab
  if z_loss:
    loss = loss + z_loss * lse * lse
  return jnp.where(labels >= 0, loss, 0.0), lse


def grads(x, weight, bias, labels, lse, row_grad, *, label_smoothing, z_loss, chunk=CHUNK):
  """``(dx, dweight, dbias)`` of ``sum(loss * row_grad)``, in float32 (float64 for float64)."""
  accumulate = lse.dtype
  vocab = weight.shape[1]
  width = min(chunk, vocab)
  counted = jnp.where(labels >= 0, row_grad, 0.0)
  scale = counted * (1.0 + 2.0 * z_loss * lse)

  def add(index, carry):
    dx, dweight, dbias = carry
    logits, start, columns, new = _chunk(x, weight, bias, index, width, accumulate)
    d = (jnp.exp(logits - lse[:, None]) * scale[:, None]
         - (1.0 - label_smoothing) * jnp.where(columns == labels[:, None], counted[:, None], 0.0)
         - label_smoothing / vocab * counted[:, None])
    d = jnp.where(new, d, 0.0)
    # The products take d in the operands' dtype, as XLA's gradient of x @ weight would.
    operand = d.astype(x.dtype)
    w = lax.dynamic_slice_in_dim(weight, start, width, axis=1).astype(x.dtype)
    dx = dx + lax.dot_general(operand, w, (((1,), (1,)), ((), ())),
                              preferred_element_type=accumulate)
    dw = lax.dot_general(x, operand, (((0,), (0,)), ((), ())), preferred_element_type=accumulate)
    # The overlapped columns of the last chunk add zeros.
    dweight = lax.dynamic_update_slice_in_dim(
        dweight, lax.dynamic_slice_in_dim(dweight, start, width, axis=1) + dw, start, axis=1)
    dbias = lax.dynamic_update_slice_in_dim(
        dbias, lax.dynamic_slice_in_dim(dbias, start, width) + jnp.sum(d, axis=0), start, 0)
    return dx, dweight, dbias

  init = (jnp.zeros(x.shape, accumulate), jnp.zeros(weight.shape, accumulate),
          jnp.zeros(weight.shape[1:], accumulate))
  return lax.fori_loop(0, -(-vocab // width), add, init)
