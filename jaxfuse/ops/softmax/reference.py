"""XLA implementations of softmax, log-softmax and softmax cross-entropy.

Forward and backward are written out rather than differentiated, so a fully masked row has
output 0 (softmax) or -inf (log-softmax) and a gradient of exactly zero, where autodiff through
``where`` would produce NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxfuse._core.validation import compute_dtype


def keep_mask(shape, axis, mask, is_causal, causal_offset):
  """Boolean array broadcastable to ``shape``, True where a logit takes part (None: all)."""
  keep = None if mask is None else mask
  if is_causal:
    q = lax.broadcasted_iota(jnp.int32, shape[-2:], 0)
    k = lax.broadcasted_iota(jnp.int32, shape[-2:], 1)
    causal = k <= q + causal_offset
    keep = causal if keep is None else jnp.logical_and(keep, causal)
  return keep


def softmax_forward(x, keep, *, axis, scale, log):
  cdt = compute_dtype(x.dtype)
  z = x.astype(cdt) * scale
  if keep is None:
    # Nothing can be fully masked: jax.nn's formulation, which XLA fuses into fewer passes.
    fn = jax.nn.log_softmax if log else jax.nn.softmax
    return fn(z, axis=axis).astype(x.dtype)
  if keep is not None:
    z = jnp.where(keep, z, -jnp.inf)
  m = jnp.max(z, axis=axis, keepdims=True)
  m = jnp.where(m == -jnp.inf, 0.0, m)
  e = jnp.exp(z - m)
  s = jnp.sum(e, axis=axis, keepdims=True)
  if log:
    y = z - m - jnp.log(s)
    if keep is not None:
      y = jnp.where(keep, y, -jnp.inf)
  else:
    y = jnp.where(s == 0, 0.0, e / s)
  return y.astype(x.dtype)


def softmax_backward(y, dy, *, axis, scale, log):
  """Gradient of the scaled logits from the output: masked entries (y = 0 or -inf) get 0."""
  cdt = compute_dtype(y.dtype)
  yf, dyf = y.astype(cdt), dy.astype(cdt)
  if log:
    kept = yf > -jnp.inf
    c = jnp.sum(jnp.where(kept, dyf, 0.0), axis=axis, keepdims=True)
    dx = jnp.where(kept, dyf - jnp.exp(yf) * c, 0.0)
  else:
    c = jnp.sum(dyf * yf, axis=axis, keepdims=True)
    dx = yf * (dyf - c)
  return (dx * scale).astype(y.dtype)


def cross_entropy_rows(logits, labels, valid, *, label_smoothing, z_loss):
  """Per-row loss and log-sum-exp over the last axis; rows with ``valid`` False give 0."""
  cdt = compute_dtype(logits.dtype)
  x = logits.astype(cdt)
  lse = jax_logsumexp(x)
  safe = jnp.where(valid, labels, 0)
  picked = jnp.take_along_axis(x, safe[..., None], axis=-1)[..., 0]
  loss = lse - (1.0 - label_smoothing) * picked
  if label_smoothing:
    loss = loss - label_smoothing * jnp.mean(x, axis=-1)
  if z_loss:
    loss = loss + z_loss * lse * lse
  return jnp.where(valid, loss, 0.0), lse


def cross_entropy_grad(logits, labels, valid, lse, row_scale, *, label_smoothing, z_loss):
  """d(loss_r * row_scale_r)/d logits for every row."""
  cdt = compute_dtype(logits.dtype)
  x = logits.astype(cdt)
  p = jnp.exp(x - lse[..., None])
  if z_loss:
    p = p * (1.0 + 2.0 * z_loss * lse[..., None])
  vocab = x.shape[-1]
  onehot = jnp.arange(vocab) == jnp.where(valid, labels, -1)[..., None]
  d = p - (1.0 - label_smoothing) * onehot - label_smoothing / vocab
  return (d * jnp.where(valid, row_scale, 0.0)[..., None]).astype(logits.dtype)


def jax_logsumexp(x):
  m = jnp.max(x, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  return (jnp.log(jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)) + m)[..., 0]
