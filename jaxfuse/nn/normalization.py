"""``RMSNorm`` and ``LayerNorm``: ``flax.nnx``'s layers, computed by jaxfuse's kernels."""

from __future__ import annotations

from flax import nnx

from jaxfuse.ops.norm.api import layer_norm, rms_norm


def _last_axis(axes, ndim: int) -> bool:
  axes = axes if isinstance(axes, (tuple, list)) else (axes,)
  return len(axes) == 1 and axes[0] % ndim == ndim - 1


def _fused(layer, x, mask) -> bool:
  """Whether jaxfuse's op computes what flax would: statistics and parameters over the last
  axis, no mask, no cross-device reduction, a positive epsilon. Otherwise flax's own code runs."""
  ndim = getattr(x, "ndim", 0)
  return (ndim >= 1 and mask is None and layer.axis_name is None and layer.epsilon > 0
          and _last_axis(layer.reduction_axes, ndim) and _last_axis(layer.feature_axes, ndim))


class RMSNorm(nnx.RMSNorm):
  """``flax.nnx.RMSNorm`` computed by :func:`jaxfuse.rms_norm` (same arguments, parameters and
  dtypes), plus ``implementation=`` passed to it.

  Normalizing over the last axis without a mask or ``axis_name`` runs jaxfuse's op on
  ``(..., num_features)`` inputs; other configurations run flax's code unchanged.
  """

  def __init__(self, num_features: int, *, implementation: str | None = None, **kwargs):
    super().__init__(num_features, **kwargs)
    self.implementation = implementation

  def __call__(self, x, mask=None):
    if not _fused(self, x, mask):
      return super().__call__(x, mask)
    scale = self.scale[...] if self.scale is not None else None
    x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
    return rms_norm(x, scale, eps=self.epsilon, normalized_ndim=1,
                    implementation=self.implementation)


class LayerNorm(nnx.LayerNorm):
  """``flax.nnx.LayerNorm`` computed by :func:`jaxfuse.layer_norm` (same arguments,
  parameters and dtypes), plus ``implementation=`` passed to it.

  Normalizing over the last axis without a mask or ``axis_name`` runs jaxfuse's op on
  ``(..., num_features)`` inputs (its variance is the exact one, never the fast
  ``E[x²] - E[x]²``); other configurations run flax's code unchanged.
  """

  def __init__(self, num_features: int, *, implementation: str | None = None, **kwargs):
    super().__init__(num_features, **kwargs)
    self.implementation = implementation

  def __call__(self, x, *, mask=None):
    if not _fused(self, x, mask):
      return super().__call__(x, mask=mask)
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
    return layer_norm(x, scale, bias, eps=self.epsilon, normalized_ndim=1,
                      implementation=self.implementation)
