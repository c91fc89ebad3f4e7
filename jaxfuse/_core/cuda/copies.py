"""Device-to-device copies through XLA's FFI (``copy.cu``): the driver's ``cudaMemcpyAsync``
and a streaming copy kernel of a chosen shape, which the bench times beside XLA's own copy to
find the best copy this GPU does."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from jaxfuse._core.cuda.build import Library

LIBRARY = Library(Path(__file__).with_name("copy.cu"),
                  {"jaxfuse_memcpy": "JaxfuseMemcpy", "jaxfuse_copy": "JaxfuseCopy"})

# (16-byte vectors in flight per thread, CTAs per SM, evict-first stores): the shapes tried.
KERNEL_SHAPES = tuple((unroll, ctas, streaming) for unroll in (2, 4, 8) for ctas in (4, 8)
                      for streaming in (False, True))


def memcpy(a: jax.Array) -> jax.Array:
  """A copy of ``a`` made by ``cudaMemcpyAsync`` (device to device) on XLA's stream."""
  LIBRARY.load()
  return jax.ffi.ffi_call("jaxfuse_memcpy", jax.ShapeDtypeStruct(a.shape, a.dtype))(a)


def copy(a: jax.Array, unroll: int, ctas_per_sm: int, streaming: bool) -> jax.Array:
  """A copy of ``a`` made by the copy kernel of this shape (see :data:`KERNEL_SHAPES`)."""
  LIBRARY.load()
  return jax.ffi.ffi_call("jaxfuse_copy", jax.ShapeDtypeStruct(a.shape, a.dtype))(
      a, unroll=np.int64(unroll), ctas_per_sm=np.int64(ctas_per_sm),
      streaming=np.int64(streaming))
