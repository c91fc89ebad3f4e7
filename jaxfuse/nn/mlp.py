"""``GeluMLP``: a transformer's MLP over :func:`jaxfuse.gelu_mlp`."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxfuse.ops.mlp.api import gelu_mlp


class GeluMLP(nnx.Module):
  """``proj(gelu(fc(x)))`` with two ``flax.nnx.Linear`` layers, ``fc`` and ``proj``, so a
  checkpoint of a flax MLP with those two layers loads either way; the call runs
  :func:`jaxfuse.gelu_mlp`, whose backward recomputes the activation instead of holding it.

  ``dtype`` is the computation's (None: promoted from the input and the parameters, as
  ``nnx.Linear`` does); the other keyword arguments go to both ``nnx.Linear``s.
  """

  def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None,
               *, approximate: bool = True, dtype=None, param_dtype=jnp.float32,
               implementation: str | None = None, rngs: nnx.Rngs, **linear_kwargs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, **linear_kwargs)
    self.fc = nnx.Linear(in_features, hidden_features, **kw)
    self.proj = nnx.Linear(hidden_features, out_features or in_features, **kw)
    self.approximate, self.dtype, self.implementation = approximate, dtype, implementation

  def __call__(self, x):
    params = [p[...] for p in (self.fc.kernel, self.fc.bias, self.proj.kernel, self.proj.bias)]
    dtype = self.dtype or jnp.result_type(x, *params)
    return gelu_mlp(jnp.asarray(x, dtype), *(p.astype(dtype) for p in params),
                    approximate=self.approximate, implementation=self.implementation)
