"""cuDNN's flat RNN weight layout: sizes, initialization, (un)packing and PyTorch conversion.

A bidirectional network has two pseudo-layers per layer, forward then reverse, each with its
own weights; pseudo-layer ``p = layer * directions + direction``. The flat vector holds every
pseudo-layer's ``W_ih`` ``(gates * H, input)`` then ``W_hh`` ``(gates * H, H)``, in pseudo-layer
order, followed by every pseudo-layer's ``b_ih`` then ``b_hh`` ``(gates * H,)`` in the same order.
The input of layers after the first is the previous layer's output, ``directions * H`` wide.
Gate blocks are stacked on the leading axis: LSTM ``i, f, g, o``; GRU ``r, z, n``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

GATES = {"lstm": 4, "gru": 3}
KINDS = ("W_ih", "W_hh", "b_ih", "b_hh")


def _directions(bidirectional: bool) -> int:
  return 2 if bidirectional else 1


def _shapes(cell, input_size, hidden_size, num_layers, bidirectional):
  """``[(kind, pseudo_layer, shape)]`` in the order the flat vector stores them."""
  rows = GATES[cell] * hidden_size
  directions = _directions(bidirectional)
  pseudo_layers = range(num_layers * directions)
  layer_input = lambda p: input_size if p < directions else directions * hidden_size
  matrices = [(kind, p, (rows, layer_input(p) if kind == "W_ih" else hidden_size))
              for p in pseudo_layers for kind in ("W_ih", "W_hh")]
  biases = [(kind, p, (rows,)) for p in pseudo_layers for kind in ("b_ih", "b_hh")]
  return matrices + biases


def weight_count(cell, input_size, hidden_size, num_layers, bidirectional) -> int:
  return sum(math.prod(shape) for _, _, shape in
             _shapes(cell, input_size, hidden_size, num_layers, bidirectional))


def lstm_weight_count(input_size: int, hidden_size: int, num_layers: int,
                      bidirectional: bool = False) -> int:
  """Length of the flat LSTM weight vector."""
  return weight_count("lstm", input_size, hidden_size, num_layers, bidirectional)


def gru_weight_count(input_size: int, hidden_size: int, num_layers: int,
                     bidirectional: bool = False) -> int:
  """Length of the flat GRU weight vector."""
  return weight_count("gru", input_size, hidden_size, num_layers, bidirectional)


def _init(cell, key, input_size, hidden_size, num_layers, bidirectional, dtype):
  bound = 1.0 / math.sqrt(hidden_size)
  count = weight_count(cell, input_size, hidden_size, num_layers, bidirectional)
  return jax.random.uniform(key, (count,), jnp.float32, -bound, bound).astype(dtype)


def init_lstm_weights(key, input_size: int, hidden_size: int, num_layers: int,
                      bidirectional: bool = False, dtype=jnp.float32):
  """Flat LSTM weights drawn from U(-1/sqrt(H), 1/sqrt(H)), as PyTorch initializes them."""
  return _init("lstm", key, input_size, hidden_size, num_layers, bidirectional, dtype)


def init_gru_weights(key, input_size: int, hidden_size: int, num_layers: int,
                     bidirectional: bool = False, dtype=jnp.float32):
  """Flat GRU weights drawn from U(-1/sqrt(H), 1/sqrt(H)), as PyTorch initializes them."""
  return _init("gru", key, input_size, hidden_size, num_layers, bidirectional, dtype)


def unpack(cell, weights, input_size, hidden_size, num_layers, bidirectional):
  shapes = _shapes(cell, input_size, hidden_size, num_layers, bidirectional)
  expected = sum(math.prod(shape) for _, _, shape in shapes)
  if weights.shape != (expected,):
    raise ValueError(f"unpack_{cell}_weights: weights must have shape ({expected},) for "
                     f"input_size={input_size}, hidden_size={hidden_size}, "
                     f"num_layers={num_layers}, bidirectional={bidirectional}; got "
                     f"{weights.shape}")
  unpacked = {kind: {} for kind in KINDS}
  offset = 0
  for kind, p, shape in shapes:
    size = math.prod(shape)
    unpacked[kind][p] = weights[offset:offset + size].reshape(shape)
    offset += size
  return tuple(unpacked[kind] for kind in KINDS)


def unpack_lstm_weights(weights, input_size: int, hidden_size: int, num_layers: int,
                        bidirectional: bool = False):
  """Flat ``(count,)`` weights to ``(W_ih, W_hh, b_ih, b_hh)``, each a dict from pseudo-layer
  to its array: ``W_ih[p]`` ``(4H, input)``, ``W_hh[p]`` ``(4H, H)``, biases ``(4H,)``."""
  return unpack("lstm", weights, input_size, hidden_size, num_layers, bidirectional)


def unpack_gru_weights(weights, input_size: int, hidden_size: int, num_layers: int,
                       bidirectional: bool = False):
  """Like :func:`unpack_lstm_weights` with ``3H`` gate rows (r, z, n)."""
  return unpack("gru", weights, input_size, hidden_size, num_layers, bidirectional)


def _pack(cell, W_ih, W_hh, b_ih, b_hh):
  unpacked = dict(zip(KINDS, (W_ih, W_hh, b_ih, b_hh)))
  for kind, arrays in unpacked.items():
    if not isinstance(arrays, Mapping):
      raise TypeError(f"pack_{cell}_weights: {kind} must map each pseudo-layer (layer x "
                      f"directions + direction) to its array, as unpack_{cell}_weights "
                      f"returns it; got {type(arrays).__name__}")
    for p, array in arrays.items():
      if np.ndim(array) != (2 if kind.startswith("W") else 1):
        raise ValueError(f"pack_{cell}_weights: {kind}[{p}] must be "
                         f"{'a matrix' if kind.startswith('W') else 'a vector'}, got shape "
                         f"{np.shape(array)}")
  pseudo_layers = sorted(W_ih)
  for kind, arrays in unpacked.items():
    if sorted(arrays) != pseudo_layers:
      raise ValueError(f"pack_{cell}_weights: {kind} has pseudo-layers {sorted(arrays)}, "
                       f"W_ih has {pseudo_layers}")
  parts = [unpacked[kind][p].reshape(-1) for p in pseudo_layers for kind in ("W_ih", "W_hh")]
  parts += [unpacked[kind][p].reshape(-1) for p in pseudo_layers for kind in ("b_ih", "b_hh")]
  return jnp.concatenate(parts)


def pack_lstm_weights(W_ih, W_hh, b_ih, b_hh):
  """Inverse of :func:`unpack_lstm_weights`: the flat ``(count,)`` vector."""
  return _pack("lstm", W_ih, W_hh, b_ih, b_hh)


def pack_gru_weights(W_ih, W_hh, b_ih, b_hh):
  """Inverse of :func:`unpack_gru_weights`: the flat ``(count,)`` vector."""
  return _pack("gru", W_ih, W_hh, b_ih, b_hh)


_TORCH_NAMES = {"W_ih": "weight_ih", "W_hh": "weight_hh", "b_ih": "bias_ih", "b_hh": "bias_hh"}


def _torch_key(kind, p, directions):
  layer, direction = divmod(p, directions)
  return f"{_TORCH_NAMES[kind]}_l{layer}{'_reverse' if direction else ''}"


def _from_torch(cell, state_dict, dtype):
  op = f"{cell}_weights_from_torch"
  if "weight_ih_l0" not in state_dict:
    raise ValueError(f"{op}: state_dict has no 'weight_ih_l0'; keys: {sorted(state_dict)}")
  num_layers = sum(1 for key in state_dict if key.startswith("weight_ih_l")
                   and not key.endswith("_reverse"))
  bidirectional = "weight_ih_l0_reverse" in state_dict
  hidden_size = np.shape(state_dict["weight_hh_l0"])[1]
  input_size = np.shape(state_dict["weight_ih_l0"])[1]
  directions = _directions(bidirectional)
  unpacked = {kind: {} for kind in KINDS}
  for kind, p, shape in _shapes(cell, input_size, hidden_size, num_layers, bidirectional):
    key = _torch_key(kind, p, directions)
    if key not in state_dict and kind.startswith("b"):
      array = np.zeros(shape, np.float32)  # a module built with bias=False
    elif key not in state_dict:
      raise ValueError(f"{op}: state_dict has no {key!r}")
    else:
      array = np.asarray(state_dict[key])
    if array.shape != shape:
      raise ValueError(f"{op}: state_dict[{key!r}] must have shape {shape}, got {array.shape}")
    unpacked[kind][p] = jnp.asarray(array, dtype or array.dtype)
  return _pack(cell, *(unpacked[kind] for kind in KINDS))


def lstm_weights_from_torch(state_dict, dtype=None):
  """Flat weights from an ``nn.LSTM`` state_dict of NumPy arrays (``weight_ih_l{k}[_reverse]``,
  ``weight_hh_l{k}[_reverse]``, ``bias_ih_l{k}[_reverse]``, ``bias_hh_l{k}[_reverse]``; missing
  biases, from ``bias=False``, are zeros). Sizes are read from the arrays' shapes."""
  return _from_torch("lstm", state_dict, dtype)


def gru_weights_from_torch(state_dict, dtype=None):
  """Flat weights from an ``nn.GRU`` state_dict of NumPy arrays; see
  :func:`lstm_weights_from_torch`."""
  return _from_torch("gru", state_dict, dtype)


def _to_torch(cell, weights, input_size, hidden_size, num_layers, bidirectional, bias):
  if not isinstance(bias, (bool, np.bool_)):
    raise TypeError(f"{cell}_weights_to_torch: bias must be a bool, got {bias!r}")
  unpacked = unpack(cell, jnp.asarray(weights), input_size, hidden_size, num_layers,
                    bidirectional)
  directions = _directions(bidirectional)
  kinds = KINDS if bias else ("W_ih", "W_hh")
  if not bias and any(np.any(np.asarray(a)) for arrays in unpacked[2:] for a in arrays.values()):
    raise ValueError(f"{cell}_weights_to_torch: bias=False, but the weights' biases are not "
                     f"all zero: a module without biases cannot hold them")
  # Copies, writable, as torch's load_state_dict and in-place edits want them.
  return {_torch_key(kind, p, directions): np.array(array)
          for kind, arrays in zip(KINDS, unpacked) if kind in kinds
          for p, array in arrays.items()}


def lstm_weights_to_torch(weights, input_size: int, hidden_size: int, num_layers: int,
                          bidirectional: bool = False, bias: bool = True):
  """An ``nn.LSTM`` state_dict of writable NumPy arrays from flat weights (inverse of
  :func:`lstm_weights_from_torch`); ``bias=False`` leaves out the bias keys, for a module built
  with ``bias=False`` (whose flat biases are zero)."""
  return _to_torch("lstm", weights, input_size, hidden_size, num_layers, bidirectional, bias)


def gru_weights_to_torch(weights, input_size: int, hidden_size: int, num_layers: int,
                         bidirectional: bool = False, bias: bool = True):
  """An ``nn.GRU`` state_dict of writable NumPy arrays from flat weights; ``bias`` as in
  :func:`lstm_weights_to_torch`."""
  return _to_torch("gru", weights, input_size, hidden_size, num_layers, bidirectional, bias)
