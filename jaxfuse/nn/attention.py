"""``dot_product_attention`` for ``flax.nnx.MultiHeadAttention`` and a ``CausalSelfAttention``
layer, both computed by :func:`jaxfuse.attention` in the ``(B, T, N, H)`` layout."""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_kernel_init

from jaxfuse.ops.attention.api import attention


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                          precision=None, module=None, promote_dtype=dtypes.promote_dtype,
                          is_causal=False, *, implementation: str | None = None):
  """``flax.nnx.dot_product_attention``'s signature, computed by :func:`jaxfuse.attention`.

  Pass it as ``nnx.MultiHeadAttention(..., attention_fn=jaxfuse.nn.dot_product_attention)``
  (or ``functools.partial(..., implementation='triton')`` to name a kernel).

  Args:
    query: ``(batch..., T, N, H)``.
    key: ``(batch..., S, K, H)``, K dividing N.
    value: ``(batch..., S, K, Hv)``.
    bias, mask: broadcastable to ``(batch..., N, T, S)``; ``mask`` keeps the scores where
      nonzero (flax's ``make_attention_mask`` gives floats).
    is_causal: keep key j for query i only when ``j <= i``.
    dtype, precision, promote_dtype: as in flax: the inputs are promoted to ``dtype`` (default:
      their common dtype) and the products use ``precision``.
    implementation: passed to :func:`jaxfuse.attention`.

  Returns:
    ``(batch..., T, N, Hv)`` in the promoted dtype.

  Attention dropout (``dropout_rate > 0`` and not ``deterministic``) and sowing the weights
  (``module``) need the (T, S) probabilities that a fused kernel never forms: with
  ``implementation=None`` those calls run flax's own function, and with a named
  implementation they raise NotImplementedError.
  """
  dropping = dropout_rate > 0.0 and not deterministic
  if dropping or module is not None:
    if implementation is not None:
      what = "attention dropout" if dropping else "sowing the attention weights (module=)"
      raise NotImplementedError(
          f"jaxfuse.nn.dot_product_attention(implementation={implementation!r}) cannot do "
          f"{what}: the fused kernels never form the attention probabilities")
    return nnx.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
        deterministic, dtype, precision, module, promote_dtype, is_causal=is_causal)
  query, key, value = promote_dtype((query, key, value), dtype=dtype)
  if mask is not None:
    mask = jnp.asarray(mask).astype(jnp.bool_)  # flax's masks are float (1 keeps)
  batch = query.shape[:-3]
  if len(batch) == 1:
    return attention(query, key, value, bias, mask, is_causal=is_causal, precision=precision,
                     implementation=implementation)
  # jaxfuse.attention takes one batch axis (or none): fold the others into it.
  flat = math.prod(batch)
  fold = lambda a: a.reshape((flat,) + a.shape[-3:])
  bias, mask = (None if a is None else fold(_with_batch(a, batch)) for a in (bias, mask))
  out = attention(fold(query), fold(key), fold(value), bias, mask, is_causal=is_causal,
                  precision=precision, implementation=implementation)
  return out.reshape(batch + out.shape[-3:])


def _with_batch(a, batch):
  """``a``, broadcastable to ``(batch..., N, T, S)``, broadcast over the batch axes only."""
  a = jnp.asarray(a)
  a = a.reshape((1,) * (len(batch) + 3 - a.ndim) + a.shape)
  return jnp.broadcast_to(a, batch + a.shape[-3:])


class CausalSelfAttention(nnx.Module):
  """Causal multi-head self-attention over ``(B, T, in_features)`` inputs, computed by
  :func:`jaxfuse.attention`, with packed sequences, grouped-query heads, a sliding window and
  a logits soft-cap.

  The parameters are ``flax.nnx.MultiHeadAttention``'s (``query``, ``key``, ``value``: kernels
  ``(in_features, heads, head_dim)``; ``out``: ``(num_heads, head_dim, out_features)``), so
  its checkpoints load into either layer.

  Args:
    num_heads: N, the query heads.
    in_features: the width of the inputs.
    qkv_features: N x head_dim (default ``in_features``).
    out_features: the width of the outputs (default ``in_features``).
    num_kv_heads: K, dividing N (default N; 1 is multi-query attention).
    local_window_size: each token sees itself and the ``local_window_size`` tokens before it.
    logits_soft_cap: c > 0 replaces each score s by ``c * tanh(s / c)``.
    dtype, param_dtype, precision, kernel_init, out_kernel_init, bias_init, out_bias_init,
      use_bias, rngs: as in ``flax.nnx.MultiHeadAttention``.
    implementation: passed to :func:`jaxfuse.attention`.
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, num_kv_heads: int | None = None, *,
               local_window_size: int | None = None, logits_soft_cap: float | None = None,
               dtype=None, param_dtype=jnp.float32, precision=None,
               kernel_init=default_kernel_init, out_kernel_init=None,
               bias_init=nnx.initializers.zeros_init(), out_bias_init=None,
               use_bias: bool = True, implementation: str | None = None, rngs: nnx.Rngs):
    qkv_features = in_features if qkv_features is None else qkv_features
    out_features = in_features if out_features is None else out_features
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads <= 0 or qkv_features % num_heads:
      raise ValueError(f"CausalSelfAttention: num_heads ({num_heads}) must divide "
                       f"qkv_features ({qkv_features})")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
      raise ValueError(f"CausalSelfAttention: num_kv_heads ({num_kv_heads}) must divide "
                       f"num_heads ({num_heads})")
    head_dim = qkv_features // num_heads
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.in_features, self.out_features = in_features, out_features
    self.local_window_size = local_window_size
    self.logits_soft_cap = logits_soft_cap
    self.precision = precision
    self.implementation = implementation

    def projection(heads):
      return nnx.LinearGeneral(in_features, (heads, head_dim), dtype=dtype,
                               param_dtype=param_dtype, kernel_init=kernel_init,
                               bias_init=bias_init, use_bias=use_bias, precision=precision,
                               rngs=rngs)

    self.query = projection(num_heads)
    self.key = projection(num_kv_heads)
    self.value = projection(num_kv_heads)
    self.out = nnx.LinearGeneral((num_heads, head_dim), out_features, axis=(-2, -1),
                                 dtype=dtype, param_dtype=param_dtype,
                                 kernel_init=out_kernel_init or kernel_init,
                                 bias_init=out_bias_init or bias_init, use_bias=use_bias,
                                 precision=precision, rngs=rngs)

  def __call__(self, x, *, segment_ids=None, seq_lengths=None):
    """Args:
      x: ``(B, T, in_features)`` (or ``(T, in_features)``).
      segment_ids: optional int ``(B, T)``: tokens attend only within their segment (documents
        packed into one row; each segment is causal on its own).
      seq_lengths: optional int ``(B,)``: keys past each row's length are masked.

    Returns:
      ``(B, T, out_features)``.
    """
    if x.shape[-1] != self.in_features:
      raise ValueError(f"CausalSelfAttention: x must end in in_features={self.in_features}, "
                       f"got shape {tuple(x.shape)}")
    query, key, value = self.query(x), self.key(x), self.value(x)
    window = None if self.local_window_size is None else (self.local_window_size, 0)
    out = attention(query, key, value, is_causal=True, segment_ids=segment_ids,
                    key_value_seq_lengths=seq_lengths, local_window_size=window,
                    logits_soft_cap=self.logits_soft_cap, precision=self.precision,
                    implementation=self.implementation)
    return self.out(out)
