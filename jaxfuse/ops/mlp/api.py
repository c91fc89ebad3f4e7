"""``gelu_mlp``: ``gelu(x @ w1 + b1) @ w2 + b2`` holding only ``x`` and the first product for
the backward.

A training step of the plain expression keeps the GELU's output (as wide as the hidden layer,
four times the model's width in a transformer) from the forward to the backward. This one
recomputes it in the pass of the backward that takes the GELU's gradient, where XLA fuses the
two, so it is never held between the passes: less temporary memory for one more elementwise
pass over the product. With ``implementation='cuda'`` the bias, the GELU and its derivative run
in cuBLASLt's product epilogues instead (:mod:`jaxfuse.ops.mlp.cuda`), which hold the GELU's
input in place of the product.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxfuse._core import op, registry, tuned
from jaxfuse._core.sharding import explicit_sharding, replicated_sharding
from jaxfuse._core.validation import check_array, describe
from jaxfuse.ops.mlp import cuda

OP = "gelu_mlp"
_BACKENDS = {"xla": registry.xla_available, "cuda": cuda.unavailable}


def _untuned() -> dict:
  """The order None tries the implementations in, for an evaluated call (by the forward's
  time) and a differentiated one (by the training step's). A GPU without a table keeps XLA
  first: the epilogues win only where a run measured it."""
  return {"forward_order": ("xla", "cuda"), "step_order": ("xla", "cuda")}


def gelu_mlp(x, w1, b1, w2, b2, *, approximate: bool = True,
             implementation: str | None = None):
  """``gelu(x @ w1 + b1) @ w2 + b2`` over the last axis, ``jax.nn.gelu``'s GELU, with a
  backward that recomputes the activation instead of holding it.

  Args:
    x: ``(..., D)`` floating point.
    w1: ``(D, F)`` (``flax.nnx.Linear``'s kernel layout); ``b1``: ``(F,)``.
    w2: ``(F, E)``; ``b2``: ``(E,)``.
    approximate: the tanh approximation (``jax.nn.gelu``'s default) or the exact erf GELU.
    implementation: ``'xla'`` (XLA's products and fusions), ``'cuda'`` (the GELU, its bias and
      its derivative inside cuBLASLt's products: float16 and bfloat16, the tanh GELU, widths
      that are positive multiples of 8) or ``None``: the fastest this GPU's tuned table
      measured, for an evaluated call and for a training step apart (``'xla'`` where
      untuned).

  Returns:
    ``(..., E)`` in the operands' promoted dtype (as ``jnp`` promotes them); gradients come
    back in each operand's own dtype.
  """
  arrays = {name: check_array(OP, name, a)
            for name, a in dict(x=x, w1=w1, b1=b1, w2=w2, b2=b2).items()}
  x, w1, b1, w2, b2 = arrays.values()
  if x.ndim == 0 or w1.ndim != 2 or w1.shape[0] != x.shape[-1]:
    raise ValueError(f"{OP}: w1 must be (x.shape[-1], F); got x {describe(x)} and w1 "
                     f"{describe(w1)}")
  if w2.ndim != 2 or w2.shape[0] != w1.shape[1]:
    raise ValueError(f"{OP}: w2 must be (F, E) for w1 {describe(w1)}; got {describe(w2)}")
  for name, bias, width in (("b1", b1, w1.shape[1]), ("b2", b2, w2.shape[1])):
    if bias.shape != (width,):
      raise ValueError(f"{OP}: {name} must be ({width},), got {describe(bias)}")
  if not isinstance(approximate, bool):
    raise TypeError(f"{OP}: approximate must be a bool, got {approximate!r}")
  dtype = jnp.result_type(*arrays.values())
  refusal = lambda: cuda.unsupported(dtype, x.shape[-1], w1.shape[1], w2.shape[1], approximate)
  # None passes over the cuBLASLt products where they cannot take this call (dtype, GELU form,
  # widths); naming them raises.
  backends = (_BACKENDS if implementation is not None
              else dict(_BACKENDS, cuda=lambda: cuda.unavailable() or refusal()))
  table = tuned.rows("mlp", _untuned)
  order = lambda use: tuple(table[f"{op.timed_as(use)}_order"])
  plan = op.resolve_plan(
      OP, implementation, backends, order("forward"),
      lambda use: registry.resolve(OP, None, backends, order(use)), empty=x.size == 0)
  if implementation == "cuda" and x.size and (reason := refusal()):
    raise NotImplementedError(f"{OP}(implementation='cuda') cannot take x {describe(x)}, w1 "
                              f"{describe(w1)} and w2 {describe(w2)}: {reason}")
  # The casts' own gradients return each operand's gradient in its dtype.
  return _gelu_mlp_jit(*(a.astype(dtype) for a in arrays.values()),
                       _Static(approximate, plan))


@dataclasses.dataclass(frozen=True)
class _Static:
  approximate: bool
  plan: op.Plan


@functools.partial(jax.jit, static_argnums=(5,))
def _gelu_mlp_jit(x, w1, b1, w2, b2, st):
  return _mlp(x, w1, b1, w2, b2, st)


def _rows(a):
  return a.reshape(-1, a.shape[-1])


# Products that contract the hidden features, which tensor parallelism shards: on an explicit
# mesh they name their output's sharding (the rows' as they come, the last axis whole), as JAX
# asks there; weight gradients come out sharded as their weights.

def _contracting_last(a, b):
  """``a @ b`` over ``a``'s last axis, its output laid out as ``a``'s leading axes; where that
  axis is explicitly sharded, the shards' partial products are summed in float32 and rounded
  once."""
  sharded = explicit_sharding(a, lambda spec: spec)
  if sharded is None or sharded.spec[-1] is None:
    return a @ b
  sharding = explicit_sharding(a, lambda spec: spec[:-1] + (None,))
  dtype = jnp.result_type(a, b)
  return jnp.matmul(a, b, preferred_element_type=jnp.promote_types(jnp.float32, dtype),
                    out_sharding=sharding).astype(dtype)


def _weight_gradient_sharding(weight, rows):
  return explicit_sharding(weight, lambda spec: spec) or replicated_sharding(rows)


def _mlp(x, w1, b1, w2, b2, st):
  if st.plan.evaluated == "cuda":
    (activation,) = cuda.forward(_rows(x), w1, b1, training=False)
    return (_contracting_last(activation, w2) + b2).reshape(*x.shape[:-1], w2.shape[1])
  return _contracting_last(jax.nn.gelu(x @ w1 + b1, approximate=st.approximate), w2) + b2


def _mlp_fwd(x, w1, b1, w2, b2, st):
  if st.plan.forward == "cuda":
    # The pre-activation is held (the epilogue's derivative reads it), the activation not.
    activation, pre = cuda.forward(_rows(x), w1, b1, training=True)
    out = (_contracting_last(activation, w2) + b2).reshape(*x.shape[:-1], w2.shape[1])
    return out, (x, pre, w1, b1, w2)
  product = x @ w1  # held without the bias: the forward then writes the activation alone
  out = _contracting_last(jax.nn.gelu(product + b1, approximate=st.approximate), w2) + b2
  return out, (x, product, w1, b1, w2)


def _mlp_bwd(st, residuals, dy):
  # The residuals are the forward's (the pre-activation, or the product without its bias):
  # the two directions of a plan run one implementation here, the step's choice.
  if st.plan.forward == "cuda":
    return _cuda_bwd(residuals, dy)
  x, product, w1, b1, w2 = residuals
  # The barrier keeps XLA from merging this GELU with the forward's (common subexpression
  # elimination), which would hold the forward's activation instead of recomputing it.
  activation, gelu_vjp = jax.vjp(functools.partial(jax.nn.gelu, approximate=st.approximate),
                                 jax.lax.optimization_barrier(product) + b1)
  (dh,) = gelu_vjp(dy @ w2.T)
  # dh's bias gradient as a product with ones, not a sum: with no reduction in it, XLA computes
  # the activation and dh in one elementwise pass over the product.
  accumulate = jnp.promote_types(jnp.float32, dh.dtype)
  ones = jnp.ones((1, _rows(dh).shape[0]), dh.dtype)
  db1 = jnp.dot(ones, _rows(dh), preferred_element_type=accumulate,
                out_sharding=explicit_sharding(b1, lambda spec: (None,) + spec)
                or replicated_sharding(x))[0]
  db2 = jnp.sum(_rows(dy), axis=0, dtype=accumulate)
  dw1 = _product_over_rows(_rows(x), _rows(dh), _weight_gradient_sharding(w1, x))
  dw2 = _product_over_rows(_rows(activation), _rows(dy), _weight_gradient_sharding(w2, x))
  return (_contracting_last(dh, w1.T), dw1, db1.astype(b1.dtype), dw2,
          db2.astype(dy.dtype))


_mlp = op.differentiable(_mlp, _mlp_fwd, _mlp_bwd, static=(5,))


def _product_over_rows(a, b, sharding):
  """``a.T @ b`` for rows ``a`` (M, K) and ``b`` (M, N), summed in float32 (float64 for
  float64) across row shards too and rounded once to the operands' dtype: a batch-sharded
  step gives a single device's gradient to within that one rounding."""
  accumulate = jnp.promote_types(jnp.float32, a.dtype)
  return jnp.matmul(a.T, b, preferred_element_type=accumulate,
                    out_sharding=sharding).astype(a.dtype)


def _cuda_bwd(residuals, dy):
  x, pre, w1, b1, w2 = residuals
  dy = _rows(dy)
  dh = cuda.backward(dy, w2, pre)
  # The activation again, for w2's gradient: one pass over the pre-activation.
  activation = jax.nn.gelu(pre.astype(jnp.float32), approximate=True).astype(pre.dtype)
  accumulate = jnp.promote_types(jnp.float32, dy.dtype)
  db1 = jnp.sum(dh, axis=0, dtype=accumulate)
  db2 = jnp.sum(dy, axis=0, dtype=accumulate)
  dx = _contracting_last(dh, w1.T).reshape(x.shape)
  dw1 = _product_over_rows(_rows(x), dh, _weight_gradient_sharding(w1, x))
  dw2 = _product_over_rows(activation, dy, _weight_gradient_sharding(w2, x))
  return dx, dw1, db1.astype(b1.dtype), dw2, db2.astype(dy.dtype)
