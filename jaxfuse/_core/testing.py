"""Helpers for checking ops against float64 references, used by the tests and the bench."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

# Relative-error bounds (‖out − ref‖ / ‖ref‖ against float64) by the dtype of the result.
TOLERANCE = {
    jnp.dtype(jnp.float64): 1e-12,
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.bfloat16): 1e-2,
    jnp.dtype(jnp.float16): 2e-3,
}


@contextlib.contextmanager
def x64():
  """Enables float64 inside the block (for references), restoring the setting after."""
  enable = getattr(jax, "enable_x64", None)
  if enable is not None:
    with enable(True):
      yield
    return
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", previous)


def random(rng: np.random.Generator, shape, dtype, *, scale: float = 1.0, offset: float = 0.0):
  """Normal random values (never zeros or ones) as a JAX array of ``dtype``."""
  values = rng.standard_normal(shape) * scale + offset
  return jnp.asarray(values.astype(np.float64 if jnp.dtype(dtype) == jnp.float64 else np.float32),
                     dtype)


def relative_error(actual, expected, floor: float = 0.0) -> float:
  """``‖actual − expected‖ / max(‖expected‖, floor)`` in float64; NaN anywhere in ``actual``
  gives inf. ``floor``: the size of terms whose difference ``expected`` is, where their
  rounding, not ``expected``'s own size, bounds the error."""
  a = np.asarray(jnp.asarray(actual, jnp.float32) if jnp.asarray(actual).dtype != jnp.float64
                 else actual, np.float64)
  e = np.asarray(expected, np.float64)
  if a.shape != e.shape:
    raise AssertionError(f"shape {a.shape} != reference shape {e.shape}")
  if not np.all(np.isfinite(a) == np.isfinite(e)):
    return float("inf")
  finite = np.isfinite(e)
  a_off, e_off = a[~finite], e[~finite]
  if not np.all((a_off == e_off) | (np.isnan(a_off) & np.isnan(e_off))):
    return float("inf")
  denom = max(np.linalg.norm(e[finite]), floor)
  diff = np.linalg.norm((a - e)[finite])
  return float(diff / denom) if denom > 0 else float(diff)


def assert_close(actual, expected, dtype=None, *, factor: float = 1.0, name: str = "output",
                 floor: float = 0.0):
  """Asserts the relative error of ``actual`` against float64 ``expected`` is within tolerance
  (see :func:`relative_error` for ``floor``)."""
  dtype = jnp.dtype(dtype or jnp.asarray(actual).dtype)
  bound = TOLERANCE[dtype] * factor
  err = relative_error(actual, expected, floor)
  assert err <= bound, f"{name}: relative error {err:.3e} > {bound:.1e} ({dtype})"
  return err


def poison_device_memory(nbytes: int):
  """Fills ``nbytes`` of device memory with 0xFF bytes (NaN in every float type) and frees it.

  The allocator hands the freed block to the next outputs, so elements a kernel fails to write
  read as NaN instead of as stale, plausible values.
  """
  junk = jnp.full((max(int(nbytes), 1),), 0xFF, jnp.uint8)
  junk.block_until_ready()
  junk.delete()
