"""``linear_cross_entropy``: validation, dispatch, VJP."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxfuse._core import registry
from jaxfuse._core.validation import (check_array, counted_labels, cross_entropy_options,
                                      describe, reduction_scale)
from jaxfuse.ops.linear_cross_entropy import reference

_BACKENDS = {"xla": registry.xla_available}


def linear_cross_entropy(x, weight, labels, *, bias=None, ignore_index: int | None = None,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         reduction: str = "mean", implementation: str | None = None):
  """Cross-entropy of ``softmax(x @ weight + bias)`` against integer labels, without the
  ``(tokens, vocabulary)`` logits ever in memory.

  The same loss as ``softmax_cross_entropy(x @ weight + bias, labels, ...)`` (see it for the
  formula, ``ignore_index``, ``label_smoothing``, ``z_loss`` and ``reduction``), with the
  logits accumulated in float32 (float64 for float64 operands) and never rounded to the
  operands' dtype. The vocabulary is walked in chunks with a running log-sum-exp, and the
  backward recomputes each chunk's logits, so temporary memory grows with tokens x chunk, not
  tokens x vocabulary.

  Args:
    x: ``(..., W)`` floating point: the last hidden states.
    weight: ``(W, V)`` floating point, the layout of ``flax.nnx.Linear``'s kernel; a tied
      embedding ``(V, W)`` is passed as ``embedding.T`` (the 'xla' implementation slices
      ``weight`` by columns in a loop, for which XLA lays the transpose out first: one copy
      of the matrix per call).
    labels: integer array of ``x.shape[:-1]``.
    bias: optional ``(V,)`` floating point.
    ignore_index, label_smoothing, z_loss, reduction: as in ``softmax_cross_entropy``.
    implementation: ``'xla'`` or ``None``.

  Returns:
    A float32 scalar (float64 for float64 operands), or per-row losses of ``labels.shape`` for
    ``'none'``.
  """
  op = "linear_cross_entropy"
  x = check_array(op, "x", x)
  weight = check_array(op, "weight", weight)
  labels = check_array(op, "labels", labels, floating=False)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"{op}: labels must be integers, got {describe(labels)}")
  if x.ndim == 0:
    raise ValueError(f"{op}: x must have a feature axis, got {describe(x)}")
  if weight.ndim != 2 or weight.shape[0] != x.shape[-1]:
    raise ValueError(f"{op}: weight must be (x.shape[-1], vocabulary) = ({x.shape[-1]}, V); "
                     f"got weight {describe(weight)} for x {describe(x)}")
  vocab = weight.shape[1]
  if vocab == 0:
    raise ValueError(f"{op}: weight has no vocabulary columns ({describe(weight)})")
  if labels.shape != x.shape[:-1]:
    raise ValueError(f"{op}: labels must have shape x.shape[:-1] = {x.shape[:-1]}; got labels "
                     f"{describe(labels)} for x {describe(x)}")
  if bias is not None:
    bias = check_array(op, "bias", bias)
    if bias.shape != (vocab,):
      raise ValueError(f"{op}: bias must be (vocabulary,) = ({vocab},), got {describe(bias)}")
  ignore_index, label_smoothing, z_loss = cross_entropy_options(
      op, ignore_index, label_smoothing, z_loss, reduction)
  registry.resolve(op, implementation, _BACKENDS, ("xla",))  # 'xla' is the only one so far
  st = _Static(label_smoothing, z_loss, reduction, ignore_index, reference.CHUNK)
  return _linear_cross_entropy_jit(x, weight, bias, labels, st)


@dataclasses.dataclass(frozen=True)
class _Static:
  label_smoothing: float
  z_loss: float
  reduction: str
  ignore_index: int | None
  chunk: int


@functools.partial(jax.jit, static_argnums=(4,))
def _linear_cross_entropy_jit(x, weight, bias, labels, st):
  vocab = weight.shape[1]
  # The products' operand dtype; the casts' own gradients return dx in x's dtype.
  operand = jnp.result_type(x, weight, *(() if bias is None else (bias,)))
  bias = jnp.zeros((vocab,), operand) if bias is None else bias
  labels = labels.astype(jnp.int32)
  valid = counted_labels(labels, vocab, st.ignore_index)
  rows = _rows(x.astype(operand).reshape(-1, x.shape[-1]), weight, bias,
               jnp.where(valid, labels, -1).reshape(-1), st)
  if st.reduction == "none":
    return rows.reshape(labels.shape)
  return jnp.sum(rows) * reduction_scale(valid, st.reduction, rows.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _rows(x, weight, bias, labels, st):
  return _forward(x, weight, bias, labels, st)[0]


def _forward(x, weight, bias, labels, st):
  return reference.rows(x, weight, bias, labels, label_smoothing=st.label_smoothing,
                        z_loss=st.z_loss, chunk=st.chunk)


def _rows_fwd(x, weight, bias, labels, st):
  loss, lse = _forward(x, weight, bias, labels, st)
  return loss, (x, weight, bias, labels, lse)


def _rows_bwd(st, residuals, g):
  x, weight, bias, labels, lse = residuals
  dx, dweight, dbias = reference.grads(
      x, weight, bias, labels, lse, g.astype(lse.dtype),
      label_smoothing=st.label_smoothing, z_loss=st.z_loss, chunk=st.chunk)
  return (dx.astype(x.dtype), dweight.astype(weight.dtype), dbias.astype(bias.dtype), None)


_rows.defvjp(_rows_fwd, _rows_bwd)
