"""XLA implementation of RMSNorm and LayerNorm: the reference every kernel is checked against.

Layout: ``x`` is ``(*groups, *rows, *features)``; ``weight`` and ``bias`` are
``(*groups, *features)``. Statistics are taken over the ``norm_ndim`` feature axes. Group axes
(``group_ndim`` of them, usually none) exist only under ``vmap`` with a batched weight: each group
of rows has its own weight. When the feature axes are sharded, ``axis_names`` names the mesh axes
to sum the statistics over, so the same code computes one shard of a feature-sharded norm.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jaxfuse._core.validation import compute_dtype


def _feature_axes(ndim, norm_ndim):
  return tuple(range(ndim - norm_ndim, ndim))


def _feature_sum(v, norm_ndim, axis_names):
  s = jnp.sum(v, axis=_feature_axes(v.ndim, norm_ndim), keepdims=True)
  return lax.psum(s, axis_names) if axis_names else s


def _feature_size(x, norm_ndim, axis_names):
  n = math.prod(x.shape[x.ndim - norm_ndim:])
  return n * lax.psum(1, axis_names) if axis_names else n


def _per_group(param, x_ndim, group_ndim, norm_ndim):
  """Reshapes a ``(*groups, *features)`` parameter to broadcast against ``x``."""
  rows = x_ndim - group_ndim - norm_ndim
  return param.reshape(param.shape[:group_ndim] + (1,) * rows + param.shape[group_ndim:])


def forward(x, weight, bias, *, kind, eps, norm_ndim, group_ndim=0, out_dtype,
            axis_names=()):
  """Returns ``(y, mean, rstd)``; ``mean`` is None for RMSNorm. Statistics drop the features."""
  cdt = compute_dtype(x.dtype, None if weight is None else weight.dtype)
  xf = x.astype(cdt)
  n = _feature_size(x, norm_ndim, axis_names)
  if kind == "layer":
    mean = _feature_sum(xf, norm_ndim, axis_names) / n
    xf = xf - mean
  else:
    mean = None
  rstd = lax.rsqrt(_feature_sum(xf * xf, norm_ndim, axis_names) / n + eps)
  y = xf * rstd
  if weight is not None:
    y = y * _per_group(weight, x.ndim, group_ndim, norm_ndim).astype(cdt)
  if bias is not None:
    y = y + _per_group(bias, x.ndim, group_ndim, norm_ndim).astype(cdt)
  squeeze = _feature_axes(x.ndim, norm_ndim)
  return (y.astype(out_dtype), None if mean is None else jnp.squeeze(mean, squeeze),
          jnp.squeeze(rstd, squeeze))


def backward(dy, x, weight, mean, rstd, *, kind, has_bias, norm_ndim, group_ndim=0,
             bias_dtype=None, axis_names=()):
  """Returns ``(dx, dweight, dbias)`` given the statistics saved by :func:`forward`."""
  cdt = rstd.dtype
  expand = lambda s: jnp.expand_dims(s, _feature_axes(x.ndim, norm_ndim))
  rstd = expand(rstd)
  x_hat = x.astype(cdt)
  if mean is not None:
    x_hat = x_hat - expand(mean)
  x_hat = x_hat * rstd
  dyf = dy.astype(cdt)
  g = dyf if weight is None else dyf * _per_group(weight, x.ndim, group_ndim, norm_ndim).astype(cdt)
  n = _feature_size(x, norm_ndim, axis_names)
  correction = x_hat * (_feature_sum(x_hat * g, norm_ndim, axis_names) / n)
  if kind == "layer":
    correction = correction + _feature_sum(g, norm_ndim, axis_names) / n
  dx = ((g - correction) * rstd).astype(x.dtype)
  row_axes = tuple(range(group_ndim, x.ndim - norm_ndim))
  dweight = None if weight is None else \
      jnp.sum(dyf * x_hat, axis=row_axes).astype(weight.dtype)
  dbias = jnp.sum(dyf, axis=row_axes).astype(bias_dtype) if has_bias else None
  return dx, dweight, dbias
