"""``LSTM`` and ``GRU`` layers over :func:`jaxfuse.lstm` and :func:`jaxfuse.gru`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfuse.ops.rnn.api import gru, lstm
from jaxfuse.ops.rnn.weights import (init_gru_weights, init_lstm_weights, pack_gru_weights,
                                     pack_lstm_weights)


class _Recurrent(nnx.Module):
  """A multi-layer, optionally bidirectional recurrent layer over a ragged batch.

  The parameter is ``weights``, the flat cuDNN layout of the functional op (the ``unpack_*`` /
  ``pack_*`` and PyTorch ``state_dict`` helpers read and write it), drawn as PyTorch draws
  them. Inter-layer dropout takes its key from ``rngs``' ``dropout`` stream, unless
  ``deterministic`` (``model.eval()`` sets it).
  """

  _states = 1  # h only; the LSTM also carries c

  def __init__(self, input_size: int, hidden_size: int, *, num_layers: int = 1,
               bidirectional: bool = False, dropout: float = 0.0, deterministic: bool = False,
               precision=None, param_dtype=jnp.float32, implementation: str | None = None,
               rngs: nnx.Rngs):
    self.weights = nnx.Param(self._init(rngs.params(), input_size, hidden_size, num_layers,
                                        bidirectional, dtype=param_dtype))
    self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
    self.bidirectional, self.dropout, self.deterministic = bidirectional, dropout, deterministic
    self.precision, self.implementation = precision, implementation
    self.rngs = rngs.dropout if dropout > 0 else None

  def __call__(self, x, seq_lengths=None, initial_state=None, *, deterministic=None,
               rngs: nnx.Rngs | None = None):
    """``x (B, T, input_size)``; ``seq_lengths (B,)`` (default: all ``T``);
    ``initial_state`` like the returned state (default: zeros). Returns ``(y, state)``, ``y``
    ``(B, T, directions * hidden_size)``, the state ``(h_n, c_n)`` for the LSTM and ``h_n``
    for the GRU, each ``(num_layers * directions, B, hidden_size)``."""
    batch, steps = x.shape[:2]
    if seq_lengths is None:
      seq_lengths = jnp.full((batch,), steps, jnp.int32)
    if initial_state is None:
      shape = ((2 if self.bidirectional else 1) * self.num_layers, batch, self.hidden_size)
      zeros = jnp.zeros(shape, x.dtype)
      initial_state = (zeros, zeros) if self._states == 2 else zeros
    states = initial_state if self._states == 2 else (initial_state,)
    deterministic = self.deterministic if deterministic is None else deterministic
    dropout, key = 0.0, None
    if self.dropout > 0 and not deterministic:
      stream = rngs.dropout if rngs is not None else self.rngs
      dropout, key = self.dropout, stream()
    out = self._op(x, *states, self.weights[...], seq_lengths,
                   input_size=self.input_size, hidden_size=self.hidden_size,
                   num_layers=self.num_layers, dropout=dropout,
                   bidirectional=self.bidirectional, precision=self.precision,
                   dropout_key=key, implementation=self.implementation)
    return out[0], (tuple(out[1:]) if self._states == 2 else out[1])


class LSTM(_Recurrent):
  """An LSTM layer over :func:`jaxfuse.lstm`; see ``_Recurrent`` for the arguments."""
  _op = staticmethod(lstm)
  _init = staticmethod(init_lstm_weights)
  _states = 2


class GRU(_Recurrent):
  """A GRU layer (cuDNN's and PyTorch's) over :func:`jaxfuse.gru`; see ``_Recurrent``."""
  _op = staticmethod(gru)
  _init = staticmethod(init_gru_weights)


def _from_flax(layers, cell_weights, pack) -> jax.Array:
  """``pack`` of each layer's ``(W_ih, W_hh, b_ih, b_hh)`` by ``cell_weights(cell)``, first
  layer first (an ``nnx.RNN`` or its cell)."""
  parts = [cell_weights(getattr(layer, "cell", layer)) for layer in layers]
  return pack(*({p: part[k] for p, part in enumerate(parts)} for k in range(4)))


def _lstm_cell_weights(cell):
  if hasattr(cell, "dense_i"):  # OptimizedLSTMCell: one Linear per product, gates stacked
    w_ih, w_hh = cell.dense_i.kernel[...].T, cell.dense_h.kernel[...].T
    b_hh = cell.dense_h.bias[...]
  else:  # LSTMCell: one Linear per gate and product (ii, if_, ig, io; hi, hf, hg, ho)
    inputs = [cell.ii, cell.if_, cell.ig, cell.io]
    hidden = [cell.hi, cell.hf, cell.hg, cell.ho]
    w_ih = jnp.concatenate([linear.kernel[...].T for linear in inputs])
    w_hh = jnp.concatenate([linear.kernel[...].T for linear in hidden])
    b_hh = jnp.concatenate([linear.bias[...] for linear in hidden])
  return w_ih, w_hh, jnp.zeros_like(b_hh), b_hh


def _gru_cell_weights(cell):
  b_ih = cell.dense_i.bias[...]
  return cell.dense_i.kernel[...].T, cell.dense_h.kernel[...].T, b_ih, jnp.zeros_like(b_ih)


def lstm_weights_from_flax(layers) -> jax.Array:
  """The flat weights of :func:`jaxfuse.lstm` (and :class:`LSTM`) from a stack of
  ``nnx.RNN(nnx.OptimizedLSTMCell(...))`` or ``nnx.RNN(nnx.LSTMCell(...))`` layers, one
  direction each, first layer first.

  The gates are in the same order (input, forget, cell, output). flax's cell has one bias per
  gate, on the hidden product, where cuDNN's layout has two: it goes to ``b_hh`` and ``b_ih``
  is zero, so the fused layer computes the same function (keep ``b_ih`` at zero while training
  to keep it so).
  """
  return _from_flax(layers, _lstm_cell_weights, pack_lstm_weights)


def gru_weights_from_flax(layers) -> jax.Array:
  """The flat weights of :func:`jaxfuse.gru` (and :class:`GRU`) from a stack of
  ``nnx.RNN(nnx.GRUCell(...))`` layers, one direction each, first layer first.

  The gates are in the same order (reset, update, new) and flax's new gate is cuDNN's,
  ``tanh(W_in x + b_in + r * (W_hn h + b_hn))``, with the only bias on the input product: it
  goes to ``b_ih`` and ``b_hh`` is zero (keep it so while training to compute flax's function).
  """
  return _from_flax(layers, _gru_cell_weights, pack_gru_weights)
