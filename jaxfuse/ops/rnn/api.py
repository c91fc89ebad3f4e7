"""``jaxfuse.lstm`` and ``jaxfuse.gru``: validation and dispatch for the multi-layer RNNs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._core import registry
from jaxfuse._core.validation import check_array, describe, static_float, static_int
from jaxfuse.ops.rnn import reference
from jaxfuse.ops.rnn.weights import unpack, weight_count

_BACKENDS = {"xla": registry.xla_available}
_PREFERENCE = ("xla",)


def lstm(x, h_0, c_0, weights, seq_lengths, *, input_size: int, hidden_size: int,
         num_layers: int, dropout: float = 0.0, bidirectional: bool = False, precision=None,
         dropout_key=None, implementation: str | None = None):
  """A multi-layer (optionally bidirectional) LSTM over a ragged batch, as cuDNN computes it.

  Args:
    x: ``(B, T, input_size)`` float16, bfloat16 or float32, batch first.
    h_0, c_0: ``(num_layers * directions, B, hidden_size)`` initial states, pseudo-layer
      ``layer * directions + direction`` first.
    weights: ``(lstm_weight_count(...),)`` in cuDNN's flat layout (see
      :mod:`jaxfuse.ops.rnn.weights`), gates ``i, f, g, o``.
    seq_lengths: ``(B,)`` integers in ``[0, T]``; checked when concrete.
    input_size, hidden_size, num_layers: the network's sizes.
    dropout: probability of zeroing each element between layers (not after the last); needs
      ``dropout_key``.
    bidirectional: also run each layer backwards over each sequence, from its own end.
    precision: passed to the matmuls (``None``: the default).
    dropout_key: a ``jax.random`` key for the dropout masks.
    implementation: ``'xla'`` or ``None`` (the only one for now).

  Returns:
    ``(y, h_n, c_n)``: ``y`` ``(B, T, directions * hidden_size)``, zero past each sequence's
    end, both directions concatenated on the last axis; ``h_n``, ``c_n`` like ``h_0``, ``c_0``:
    each sequence's state after its own last step (the initial state for length 0). The cell
    state and all accumulation are float32. Differentiable with respect to ``x``, ``h_0``,
    ``c_0`` and ``weights``.
  """
  y, (h_n, c_n) = _run("lstm", x, (h_0, c_0), weights, seq_lengths, input_size, hidden_size,
                       num_layers, dropout, bidirectional, precision, dropout_key,
                       implementation)
  return y, h_n, c_n


def gru(x, h_0, weights, seq_lengths, *, input_size: int, hidden_size: int, num_layers: int,
        dropout: float = 0.0, bidirectional: bool = False, precision=None, dropout_key=None,
        implementation: str | None = None):
  """A multi-layer (optionally bidirectional) GRU over a ragged batch, as cuDNN computes it.

  Arguments as for :func:`lstm`, without ``c_0``; gates ``r, z, n``, the reset gate applied to
  ``W_hn h + b_hn`` (cuDNN's and PyTorch's GRU).

  Returns:
    ``(y, h_n)``, as for :func:`lstm`.
  """
  y, (h_n,) = _run("gru", x, (h_0,), weights, seq_lengths, input_size, hidden_size, num_layers,
                   dropout, bidirectional, precision, dropout_key, implementation)
  return y, h_n


def _run(cell, x, initial_state, weights, seq_lengths, input_size, hidden_size, num_layers,
         dropout, bidirectional, precision, dropout_key, implementation):
  op = cell
  input_size = static_int(op, "input_size", input_size)
  hidden_size = static_int(op, "hidden_size", hidden_size)
  num_layers = static_int(op, "num_layers", num_layers)
  if input_size < 1:
    raise ValueError(f"{op}: input_size must be >= 1, got {input_size}")
  if hidden_size < 1:
    raise ValueError(f"{op}: hidden_size must be >= 1, got {hidden_size}")
  if num_layers < 1:
    raise ValueError(f"{op}: num_layers must be >= 1, got {num_layers}")
  if not isinstance(bidirectional, (bool, np.bool_)):
    raise TypeError(f"{op}: bidirectional must be a bool, got {bidirectional!r}")
  dropout = static_float(op, "dropout", dropout)
  if not 0 <= dropout < 1:
    raise ValueError(f"{op}: dropout must be in [0, 1), got {dropout!r}")
  if dropout > 0 and dropout_key is None:
    raise ValueError(f"{op}: dropout={dropout} needs a dropout_key (a jax.random key)")
  if dropout > 0 and num_layers == 1:
    dropout = 0.0  # there is no layer boundary to drop at

  x = check_array(op, "x", x)
  if x.ndim != 3 or x.shape[2] != input_size:
    raise ValueError(f"{op}: x must be (batch, time, input_size={input_size}), got "
                     f"{describe(x)}")
  batch, time = x.shape[:2]
  directions = 2 if bidirectional else 1
  state_shape = (num_layers * directions, batch, hidden_size)
  names = ("h_0", "c_0")
  initial_state = tuple(check_array(op, name, s) for name, s in zip(names, initial_state))
  for name, s in zip(names, initial_state):
    if s.shape != state_shape:
      raise ValueError(f"{op}: {name} must have shape (num_layers * directions, batch, "
                       f"hidden_size) = {state_shape}, got {describe(s)}")
  weights = check_array(op, "weights", weights)
  count = weight_count(cell, input_size, hidden_size, num_layers, bidirectional)
  if weights.shape != (count,):
    raise ValueError(f"{op}: weights must be flat with {cell}weight_count(input_size="
                     f"{input_size}, hidden_size={hidden_size}, num_layers={num_layers}, "
                     f"bidirectional={bidirectional}) = {count} elements, got "
                     f"{describe(weights)}")
  seq_lengths = _check_lengths(op, seq_lengths, batch, time)

  registry.resolve(op, implementation, _BACKENDS, _PREFERENCE)
  unpacked = unpack(cell, weights, input_size, hidden_size, num_layers, bidirectional)
  return reference.forward(cell, x, initial_state, unpacked, seq_lengths, num_layers=num_layers,
                           bidirectional=bidirectional, dropout=dropout,
                           dropout_key=dropout_key, precision=precision)


def _check_lengths(op, seq_lengths, batch, time):
  seq_lengths = check_array(op, "seq_lengths", seq_lengths, floating=False)
  if not jnp.issubdtype(seq_lengths.dtype, jnp.integer):
    raise TypeError(f"{op}: seq_lengths must be integers, got {describe(seq_lengths)}")
  if seq_lengths.shape != (batch,):
    raise ValueError(f"{op}: seq_lengths must have shape (batch,) = ({batch},), got "
                     f"{describe(seq_lengths)}")
  if not isinstance(seq_lengths, jax.core.Tracer):
    lengths = np.asarray(seq_lengths)
    if lengths.size and (lengths.min() < 0 or lengths.max() > time):
      raise ValueError(f"{op}: seq_lengths must be in [0, T={time}], got "
                       f"{lengths.tolist()}")
  return seq_lengths
