"""Helpers for checking ops against float64 references, used by the tests and the bench."""

from __future__ import annotations

import contextlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np

# Relative-error bounds (‖out − ref‖ / ‖ref‖ of the worst row, against float64) by the dtype
# of the result.
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


def rows_of(a, axis: int = -1) -> np.ndarray:
  """``a`` as 2-D float64 rows: its 1-D slices along ``axis`` (a scalar is one row of one)."""
  return _rows(np.asarray(a, np.float64), axis)


def _rows(a: np.ndarray, axis: int) -> np.ndarray:
  if a.ndim == 0:
    return a.reshape(1, 1)
  a = np.moveaxis(a, axis, -1)
  return a.reshape(-1, a.shape[-1])


def relative_error(actual, expected, floor=0.0, *, axis: int = -1) -> float:
  """The worst row's ``‖actual − expected‖ / max(‖expected‖, floor)`` in float64, rows being
  the 1-D slices along ``axis``, so that one wrong row among many cannot hide in an
  array-wide norm. Non-finite values must match the reference's exactly (NaN for NaN, the
  same infinities), else the error is inf. ``floor``: the size of terms whose difference
  ``expected`` is, where their rounding, not ``expected``'s own size, bounds the error; a
  scalar, or one per row (shaped like ``expected`` with ``axis`` of size 1, as
  ``np.linalg.norm(terms, axis=axis, keepdims=True)`` gives)."""
  actual = jnp.asarray(actual)
  # Half-precision values widen exactly to float32 on the device: the difference is the one
  # float64 array the size of the output (the bench checks RNN weight gradients whole).
  a = np.asarray(actual if actual.dtype == jnp.float64 else actual.astype(jnp.float32))
  e = np.asarray(expected, np.float64)
  if a.shape != e.shape:
    raise AssertionError(f"shape {a.shape} != reference shape {e.shape}")
  if e.size == 0:
    return 0.0
  floor = np.asarray(floor, np.float64)
  if floor.ndim:
    one_per_row = list(e.shape)
    one_per_row[axis] = 1
    floor = rows_of(np.broadcast_to(floor, one_per_row), axis)[:, 0]
  a, e = _rows(a, axis), _rows(e, axis)
  finite = np.isfinite(e)
  if not np.array_equal(np.isfinite(a), finite):
    return float("inf")
  if not finite.all():
    a_off, e_off = a[~finite], e[~finite]
    if not np.all((a_off == e_off) | (np.isnan(a_off) & np.isnan(e_off))):
      return float("inf")
    a, e = np.where(finite, a, 0.0), np.where(finite, e, 0.0)
  diff = np.subtract(a, e, dtype=np.float64)
  diff = np.sqrt(np.square(diff, out=diff).sum(axis=1))
  denom = np.maximum(np.linalg.norm(e, axis=1), floor)
  per_row = np.where(denom > 0, diff / np.where(denom > 0, denom, 1.0), diff)
  return float(per_row.max())


def assert_close(actual, expected, dtype=None, *, factor: float = 1.0, name: str = "output",
                 floor=0.0, axis: int = -1):
  """Asserts the worst row's relative error of ``actual`` against float64 ``expected`` is
  within the tolerance of ``dtype`` (default: ``actual``'s); see :func:`relative_error`."""
  dtype = jnp.dtype(dtype or jnp.asarray(actual).dtype)
  bound = TOLERANCE[dtype] * factor
  err = relative_error(actual, expected, floor, axis=axis)
  assert err <= bound, f"{name}: worst row's relative error {err:.3e} > {bound:.1e} ({dtype})"
  return err


def value_and_vjp(f, args, cotangent=None):
  """``f(*args)`` and, given ``cotangent``, the gradients of ``args`` (else None), as one jitted
  program: an op-by-op dispatch compiles every primitive anew for each shape."""
  def run(args, cotangent):
    out, pullback = jax.vjp(f, *args)
    return out, (None if cotangent is None else pullback(cotangent))
  return jax.jit(run)(tuple(args), cotangent)


def seed_for(test_id: str) -> int:
  """A 32-bit seed from a test's id: the same inputs every run, different ones per test."""
  return zlib.crc32(test_id.encode())


def poison_device_memory(nbytes: int):
  """Fills ``nbytes`` of device memory with 0xFF bytes (NaN in every float type) and frees it.

  The allocator hands the freed block to the next outputs, so elements a kernel fails to write
  read as NaN instead of as stale, plausible values.
  """
  junk = jnp.full((max(int(nbytes), 1),), 0xFF, jnp.uint8)
  junk.block_until_ready()
  junk.delete()
