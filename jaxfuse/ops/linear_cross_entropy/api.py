"""``linear_cross_entropy``: validation, dispatch, VJP."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxfuse._core import op, registry, tuned
from jaxfuse._core.batching import one_example_at_a_time
from jaxfuse._core.op import resolve_plan
from jaxfuse._core.sharding import parallel_call
from jaxfuse._core.validation import (check_array, counted_labels, cross_entropy_options,
                                      describe, int32_labels, poison_stray_rows,
                                      reduction_scale)
from jaxfuse.ops.linear_cross_entropy import cuda, reference

_BACKENDS = {"xla": registry.xla_available, "cuda": cuda.unavailable}


def _untuned() -> dict:
  # The CUDA row pass reads each chunk's logits once where XLA's reads them twice.
  return {"order": ["cuda", "xla"]}


def linear_cross_entropy(x, weight, labels, *, bias=None, ignore_index: int | None = None,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         reduction: str = "mean", implementation: str | None = None):
  """Cross-entropy of ``softmax(x @ weight + bias)`` against integer labels, without the
  ``(tokens, vocabulary)`` logits ever in memory.

  The same loss as ``softmax_cross_entropy(x @ weight + bias, labels, ...)`` (see it for the
  formula, ``ignore_index``, ``label_smoothing``, ``z_loss`` and ``reduction``), with the
  logits accumulated in float32 (float64 for float64 operands) and never rounded to the
  operands' dtype. The tokens are walked in chunks whose logits live only while their rows'
  losses (and, under differentiation, gradients) are taken, so temporary memory is one
  chunk's logits (at most 2^27 floats, 512 MiB), not tokens x vocabulary. A differentiated
  ``'mean'`` or ``'sum'`` computes its gradients in that same walk (three products with the
  weights per training step, as the unfused loss); ``'none'`` recomputes the logits in its
  backward.

  Args:
    x: ``(..., W)`` floating point: the last hidden states.
    weight: ``(W, V)`` floating point, the layout of ``flax.nnx.Linear``'s kernel; a tied
      embedding ``(V, W)`` is passed as ``embedding.T``, which the products read in place
      (a vocabulary that is not a multiple of 128 is padded to one, once per call: one copy
      of the weight in the operands' dtype, where XLA's own products would pad it per chunk).
    labels: integer array of ``x.shape[:-1]``; one outside ``[0, V)`` other than
      ``ignore_index`` makes the loss NaN, as in ``softmax_cross_entropy``.
    bias: optional ``(V,)`` floating point.
    ignore_index, label_smoothing, z_loss, reduction: as in ``softmax_cross_entropy``.
    implementation: ``'xla'``, ``'cuda'`` (the products on cuBLAS through XLA, each chunk's
      rows in one pass of a CUDA kernel; Hopper GPUs, float16, bfloat16 or float32 operands,
      vocabularies up to 262144) or ``None`` (``'cuda'`` where it can run, else ``'xla'``).

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
  operand = jnp.result_type(x, weight, *(() if bias is None else (bias,)))
  if labels.size == 0:
    # No tokens: nothing is counted, so every reduction is 0 (as 'mean' is when none counts).
    return jnp.zeros(labels.shape if reduction == "none" else (),
                     jnp.promote_types(jnp.float32, operand))
  cuda_refusal = lambda: cuda.unsupported(reference.padded_vocab(vocab), operand)
  # None passes over the CUDA row pass where it cannot take these shapes; naming it raises.
  backends = (_BACKENDS if implementation is not None
              else dict(_BACKENDS, cuda=lambda: cuda.unavailable() or cuda_refusal()))
  plan = resolve_plan(op, implementation, backends,
                      tuple(tuned.rows("linear_cross_entropy", _untuned)["order"]))
  if implementation == "cuda" and (reason := cuda_refusal()):
    raise NotImplementedError(f"{op}(implementation='cuda') cannot take x {describe(x)} "
                              f"and weight {describe(weight)}: {reason}")
  st = _Static(label_smoothing, z_loss, reduction, ignore_index, reference.CHUNK_ELEMENTS, plan)
  return _linear_cross_entropy_jit(x, weight, bias, labels, st)


@dataclasses.dataclass(frozen=True)
class _Static:
  label_smoothing: float
  z_loss: float
  reduction: str
  ignore_index: int | None
  chunk_elements: int
  plan: op.Plan  # one implementation for every use: the walk computes the loss and gradients


@functools.partial(jax.jit, static_argnums=(4,))
def _linear_cross_entropy_jit(x, weight, bias, labels, st):
  vocab = weight.shape[1]
  # The products' operand dtype; the casts' own gradients return dx in x's dtype.
  operand = jnp.result_type(x, weight, *(() if bias is None else (bias,)))
  labels, stray = int32_labels(labels, vocab, st.ignore_index)
  valid = counted_labels(labels, vocab, st.ignore_index)
  args = (x.astype(operand).reshape(-1, x.shape[-1]), weight, bias,
          jnp.where(valid, labels, -1).reshape(-1))
  if st.reduction == "none":
    loss = _rows(*args, st).reshape(labels.shape)
  else:
    accumulate = jnp.promote_types(jnp.float32, operand)
    row_weight = jnp.broadcast_to(reduction_scale(valid, st.reduction, accumulate),
                                  args[3].shape)
    loss = _reduced(*args, row_weight, st)
  return poison_stray_rows(loss, stray, st.reduction)


def _walk(x, weight, bias, labels, st, row_grad=None, lse=None):
  """``reference.walk`` on each shard of the tokens: a token-sharded ``x`` (data parallelism)
  stays sharded, each device walking its own rows, and the weight gradients are summed over
  the shards, where XLA alone would gather the tokens to slice them into chunks."""
  optional = {"bias": (bias, ("v",)), "row_grad": (row_grad, ("t",)), "lse": (lse, ("t",))}
  present = [name for name, (a, _) in optional.items() if a is not None]
  with_grads = row_grad is not None

  def local(x, weight, labels, *rest):
    given = dict(zip(present, rest))
    loss, lse, grads = reference.walk(
        x, weight, given.get("bias"), labels, label_smoothing=st.label_smoothing,
        z_loss=st.z_loss, row_grad=given.get("row_grad"), lse=given.get("lse"),
        chunk_elements=st.chunk_elements,
        row_pass=cuda.rows if st.plan.forward == "cuda" else None)
    return (loss, lse) + (tuple(g for g in grads if g is not None) if with_grads else ())

  out_dims = [("t",), ("t",)]
  if with_grads:
    out_dims += [("t", "w"), ("w", "v")] + ([("v",)] if bias is not None else [])
  in_dims = [("t", "w"), ("w", "v"), ("t",)] + [optional[name][1] for name in present]
  # Under vmap each example has its own weight gradient: the examples are walked in turn.
  sharded = one_example_at_a_time(lambda *args: parallel_call(
      "linear_cross_entropy", local, *args, in_dims=in_dims, out_dims=out_dims,
      parallel={"t"}))
  outs = sharded(x, weight, labels, *(optional[name][0] for name in present))
  if not with_grads:
    return outs[0], outs[1], None
  return outs[0], outs[1], (outs[2], outs[3], outs[4] if bias is not None else None)


def _cast_like(grads, g, x, weight, bias):
  return tuple(None if a is None else (g * d).astype(a.dtype)
               for d, a in zip(grads, (x, weight, bias)))


# Per-row losses ('none'): the backward needs each row's cotangent, so it walks the chunks
# again, recomputing the logits.
def _rows(x, weight, bias, labels, st):
  return _walk(x, weight, bias, labels, st)[0]


def _rows_fwd(x, weight, bias, labels, st):
  loss, lse, _ = _walk(x, weight, bias, labels, st)
  return loss, (x, weight, bias, labels, lse)


def _rows_bwd(st, residuals, g):
  x, weight, bias, labels, lse = residuals
  _, _, grads = _walk(x, weight, bias, labels, st, row_grad=g.astype(lse.dtype), lse=lse)
  return _cast_like(grads, 1.0, x, weight, bias) + (None,)


_rows = op.differentiable(_rows, _rows_fwd, _rows_bwd, static=(4,))


# A reduced loss ('mean', 'sum') is linear in one scalar cotangent: the forward walk computes
# the gradients for a cotangent of one while it has each chunk's logits, and the backward only
# scales them, so a training step multiplies by the weights three times, as the unfused loss.
def _reduced(x, weight, bias, labels, row_weight, st):
  return jnp.sum(_walk(x, weight, bias, labels, st)[0] * row_weight)


def _reduced_fwd(x, weight, bias, labels, row_weight, st):
  loss, _, grads = _walk(x, weight, bias, labels, st, row_grad=row_weight)
  return jnp.sum(loss * row_weight), (grads, x, weight, bias)


def _reduced_bwd(st, residuals, g):
  grads, x, weight, bias = residuals
  return _cast_like(grads, g, x, weight, bias) + (None, None)


_reduced = op.differentiable(_reduced, _reduced_fwd, _reduced_bwd, static=(5,))
