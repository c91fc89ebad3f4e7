"""Argument checks shared by the ops. They run at trace time and name the offending argument."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def describe(x) -> str:
  """``float32[8,128]``-style description of an array or abstract value."""
  shape = ",".join(map(str, np.shape(x)))
  return f"{jnp.result_type(x)}[{shape}]" if hasattr(x, "dtype") else f"{type(x).__name__}"


def check_array(op: str, name: str, x, *, floating: bool = True):
  """Returns ``x`` as a JAX array (or tracer); floating point unless ``floating=False``."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    if isinstance(x, (int, float, np.number, list, tuple)):
      x = jnp.asarray(x)
    else:
      raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
  if floating and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{op}: {name} must have a real floating-point dtype (float16, bfloat16, "
                    f"float32 or float64), got {describe(x)}")
  return x


def static_float(op: str, name: str, value) -> float:
  """A finite Python float known at trace time (a scale, a coefficient)."""
  if isinstance(value, jax.core.Tracer) or hasattr(value, "aval"):
    raise TypeError(f"{op}: {name} must be a Python float known at trace time, got a traced value")
  try:
    value = float(value)
  except (TypeError, ValueError):
    raise TypeError(f"{op}: {name} must be a float, got {type(value).__name__} {value!r}") from None
  if not math.isfinite(value):
    raise ValueError(f"{op}: {name} must be finite, got {value!r}")
  return value


def check_positive_float(op: str, name: str, value) -> float:
  """A static, finite, strictly positive Python float (``eps`` and the like)."""
  value = static_float(op, name, value)
  if value <= 0:
    raise ValueError(f"{op}: {name} must be finite and > 0, got {value!r}")
  return value


def static_bool(op: str, name: str, value) -> bool:
  """A Python bool known at trace time (a string such as ``"False"`` would read as true)."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{op}: {name} must be a bool, got {value!r}")
  return bool(value)


def static_int(op: str, name: str, value) -> int:
  """A Python int (not a bool) known at trace time."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{op}: {name} must be an int, got {value!r}")
  return int(value)


def check_choice(op: str, name: str, value, choices: Sequence):
  if value not in choices:
    raise ValueError(f"{op}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
  return value


def canonical_dtype(op: str, name: str, dtype):
  """``dtype`` as a NumPy dtype, or ``None``; it must be a floating type."""
  if dtype is None:
    return None
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    raise TypeError(f"{op}: {name} must be a dtype, got {dtype!r}") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{op}: {name} must be a floating-point dtype, got {dtype}")
  return dtype


def compute_dtype(*dtypes):
  """Accumulation dtype: float64 when any operand is float64, float32 otherwise."""
  return jnp.float64 if any(d is not None and jnp.dtype(d) == jnp.float64 for d in dtypes) \
      else jnp.float32


def cross_entropy_options(op: str, ignore_index, label_smoothing, z_loss, reduction):
  """The cross-entropy losses' options, checked: ``(ignore_index, label_smoothing, z_loss)``."""
  label_smoothing = static_float(op, "label_smoothing", label_smoothing)
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f"{op}: label_smoothing must be in [0, 1), got {label_smoothing}")
  z_loss = static_float(op, "z_loss", z_loss)
  if z_loss < 0:
    raise ValueError(f"{op}: z_loss must be >= 0, got {z_loss}")
  check_choice(op, "reduction", reduction, ("mean", "sum", "none"))
  if ignore_index is not None:
    ignore_index = static_int(op, "ignore_index", ignore_index)
    info = np.iinfo(np.int32)
    if not info.min <= ignore_index <= info.max:
      raise ValueError(f"{op}: ignore_index must fit int32 (labels are compared as int32), "
                       f"got {ignore_index}")
  return ignore_index, label_smoothing, z_loss


def comparable_labels(labels):
  """Integer ``labels`` in a dtype that holds a class count and ``ignore_index``: compared in
  a narrower one those bounds wrap (uint8 labels are never ``< 256``, and ``-100`` becomes
  ``156``)."""
  return labels.astype(jnp.int32) if jnp.iinfo(labels.dtype).bits < 32 else labels


def counted_labels(labels, classes: int, ignore_index):
  """The rows that count: labels in ``[0, classes)`` other than ``ignore_index``."""
  labels = comparable_labels(labels)
  valid = (labels >= 0) & (labels < classes)
  return valid if ignore_index is None else valid & (labels != ignore_index)


def check_lengths_range(op: str, name: str, lengths, longest: int, bound: str):
  """Raises where concrete ``lengths`` (outside jit) leave ``[0, longest]``; traced ones cannot
  be read at trace time and pass as they are. ``bound`` names ``longest`` in the message."""
  if isinstance(lengths, jax.core.Tracer):
    return
  values = np.asarray(lengths)
  if values.size and (values.min() < 0 or values.max() > longest):
    raise ValueError(f"{op}: {name} must be in [0, {bound}], got {values.tolist()}")


def int32_labels(labels, classes: int, ignore_index):
  """``labels`` as the kernels take them (int32) and the rows whose label is neither a class
  nor ``ignore_index``; a wider label is never narrowed into range (it is flagged first)."""
  labels = comparable_labels(labels)
  stray = ~counted_labels(labels, classes, None)
  if ignore_index is not None:
    stray &= labels != ignore_index
  if jnp.iinfo(labels.dtype).max > np.iinfo(np.int32).max:
    labels = jnp.where(stray, -1, labels)
  return labels.astype(jnp.int32), stray


def poison_stray_rows(loss, stray, reduction: str):
  """``loss`` with NaN for each row whose label is no class (``'none'``), or NaN if any is,
  as optax's loss reads such a label: a label out of range never passes unseen. Those rows'
  gradients are those of ignored rows (zero); the other rows' are kept."""
  if reduction == "none":
    return jnp.where(stray, jnp.nan, loss)
  return loss + jnp.where(jnp.any(stray), jnp.nan, 0.0).astype(loss.dtype)


def reduction_scale(valid, reduction: str, dtype):
  """The factor of the summed loss: 1/count for ``'mean'`` (0 when nothing counts), else 1."""
  if reduction != "mean":
    return jnp.ones((), dtype)
  counted = jnp.sum(valid, dtype=jnp.int32)
  return jnp.where(counted > 0, 1.0 / jnp.maximum(counted, 1), 0.0).astype(dtype)

