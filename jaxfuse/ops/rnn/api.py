"""``jaxfuse.lstm`` and ``jaxfuse.gru``: validation, dispatch, and the fused kernels' custom VJP,
vmap rules and batch sharding."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._core import op, registry, tuned
from jaxfuse._core.op import resolve_plan, timed_as
from jaxfuse._core.sharding import parallel_call, replicated_sharding
from jaxfuse._core.validation import (check_array, check_lengths_range, describe, static_float,
                                      static_int)
from jaxfuse.ops.rnn import cuda as cuda_kernels
from jaxfuse.ops.rnn import cudnn as cudnn_kernels
from jaxfuse.ops.rnn import reference
from jaxfuse.ops.rnn.weights import unpack, weight_count


# A GPU never measured: the bounds on the work per step (batch x hidden) that the measured GPUs
# share. The fused kernels win while a step's batch is small beside W_hh, which they hold on
# chip, and 16-bit weights leave room for a larger batch; cuDNN's forward (XLA's scan close
# behind it in float32) wins later than its training step.
_UNTUNED_CUDA_MOST_WORK = {("float32", "forward"): 2**15, ("float32", "step"): 2**15,
                           ("bfloat16", "forward"): 2**16, ("bfloat16", "step"): 2**17}
_UNTUNED_CUDNN_LEAST_WORK = {("float32", "forward"): 2**17, ("float32", "step"): 2**16,
                             ("bfloat16", "forward"): 2**16, ("bfloat16", "step"): 2**16}


# The tables' rows: a measured grid per cell, dtype, use and layout, ``fastest/lstm/float32/step``
# for one direction and ``.../bidirectional`` for two (timed at two layers): XLA and the fused
# kernels run a layer's directions side by side, where cuDNN overlaps them and its layers too,
# so the order one direction measured need not hold for two.
_GRID_ROWS = tuple(f"fastest/{cell}/{dtype}/{use}{layout}" for cell in ("lstm", "gru")
                   for dtype in ("float32", "bfloat16") for use in ("forward", "step")
                   for layout in ("", "/bidirectional"))


def _untuned() -> dict:
  # No measured grid: every call takes the work bounds above.
  return dict.fromkeys(_GRID_ROWS)


def _preference(cell: str, dtype, batch: int, hidden: int, directions: int,
                use: str) -> tuple[str, ...]:
  """The order None tries for ``use`` (``'forward'``: a call only evaluated; ``'step'``: one
  differentiated, forward and backward) of layers of ``hidden`` units in ``directions``
  directions over ``batch`` rows: the order measured fastest at the nearest point the GPU's
  grid timed (see :func:`_measured_grid`), those it did not time after it. A bidirectional
  call of any depth looks up a grid of two directions at its own batch; a one-direction grid
  takes it at ``batch * directions`` rows (each direction a recurrence beside the other). On a
  GPU without a grid, the work per step against :data:`_UNTUNED_CUDA_MOST_WORK` and
  :data:`_UNTUNED_CUDNN_LEAST_WORK`. The sizes are the call's, before sharding splits its
  batch or vmap adds to it: the grid was measured on one GPU, unmapped."""
  if registry.platform() != "gpu":
    return ("xla",)
  grid, bidirectional = _measured_grid(tuned.rows("rnn", _untuned), cell, dtype, use,
                                       directions)
  if grid is not None and not bidirectional:
    batch *= directions
  if grid is None:
    width = "bfloat16" if jnp.dtype(dtype).itemsize == 2 else "float32"
    work = batch * directions * hidden
    order = ("cuda", "xla") if work <= _UNTUNED_CUDA_MOST_WORK[width, use] else ("xla", "cuda")
    return ("cudnn",) + order if work >= _UNTUNED_CUDNN_LEAST_WORK[width, use] else order
  # The nearest point the run timed, by the ratios of batch and of hidden size.
  distance = lambda i, j: (abs(np.log(grid["batch"][i] / max(batch, 1)))
                           + abs(np.log(grid["hidden"][j] / hidden)))
  i, j = min(_timed_points(grid), key=lambda point: distance(*point))
  measured = tuple(grid["order"][i][j].split(">"))
  return measured + tuple(name for name in ("cuda", "cudnn", "xla") if name not in measured)


def _measured_grid(rows: dict, cell: str, dtype, use: str,
                   directions: int) -> tuple[dict | None, bool]:
  """The grid the GPU's table measured for this cell, dtype, use and number of directions (one
  with a timed point), and whether it is one of two directions; (None, False) where there is
  none. A set it did not time takes the nearest it did: float16 as bfloat16 (one 16-bit path in
  each library); then the other cell's grid of the same directions (the cells' kernels share
  their tiling, and how each library scales to two directions and layers decides more than the
  cell); the grids of one direction last."""
  name = jnp.dtype(dtype).name
  width = "bfloat16" if name == "float16" else name
  other = "gru" if cell == "lstm" else "lstm"
  layouts = (True, False) if directions == 2 else (False,)
  for bidirectional in layouts:
    for key in (cell, other):
      grid = rows.get(f"fastest/{key}/{width}/{use}{'/bidirectional' * bidirectional}")
      if grid is not None and _timed_points(grid):
        return grid, bidirectional
  return None, False


def _timed_points(grid: dict) -> list[tuple[int, int]]:
  """(batch index, hidden index) of each point a grid timed (``''``: one it did not)."""
  return [(i, j) for i, orders in enumerate(grid["order"]) for j, order in enumerate(orders)
          if order]


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
    seq_lengths: ``(B,)`` integers in ``[0, T]``, checked when concrete, or None: every
      sequence runs all ``T`` steps.
    input_size, hidden_size, num_layers: the network's sizes.
    dropout: probability of zeroing each element between layers (not after the last); needs
      ``dropout_key``.
    bidirectional: also run each layer backwards over each sequence, from its own end.
    precision: passed to the matmuls (``None``: the default).
    dropout_key: a ``jax.random`` key for the dropout masks.
    implementation: ``'xla'`` (``lax.scan``, runs anywhere), ``'cuda'`` (the persistent
      fused kernels: {cuda_limits}), ``'cudnn'`` (cuDNN's RNN: one dtype for x, the states
      and the weights, float32 with TF32 products unless ``precision`` asks for more, float16
      or bfloat16; the whole network in one call where the host holds the lengths (None or a
      NumPy array) and there is no dropout, else a call per layer and direction over whole
      sequences, the final states read at each sequence's end) or ``None``: the fastest
      that takes the call by the GPU's tuned table, measured over batch x hidden for one
      direction and for two; a call only evaluated by the forwards' times, a differentiated
      one by the training steps'.

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
    raise ValueError(f"{op}: weights must be flat with {cell}_weight_count(input_size="
                     f"{input_size}, hidden_size={hidden_size}, num_layers={num_layers}, "
                     f"bidirectional={bidirectional}) = {count} elements, got "
                     f"{describe(weights)}")
  seq_lengths, host_lengths = _check_lengths(op, seq_lengths, batch, time)

  op_dtype = jnp.result_type(x, weights)
  layer = _Layer(cell, batch, time, hidden_size, directions, jnp.dtype(op_dtype))
  backends = {"xla": registry.xla_available,
              "cuda": functools.partial(_cuda_unavailable, layer),
              "cudnn": lambda: (cudnn_kernels.unavailable() or cudnn_kernels.unsupported(
                  (x.dtype, weights.dtype, *(s.dtype for s in initial_state))))}
  sizes = (batch, hidden_size, directions)

  def fastest(use):
    return registry.resolve(op, None, backends,
                            _preference(cell, op_dtype, *sizes, timed_as(use)))

  plan = resolve_plan(op, implementation, backends, _preference(cell, op_dtype, *sizes, "step"),
                      fastest)
  network = _Network(cell, input_size, hidden_size, num_layers, bool(bidirectional), dropout,
                     precision, host_lengths)
  arrays = (x, initial_state, weights, seq_lengths, dropout_key)
  if plan.evaluated == plan.forward:  # each path brings its own derivatives
    return _path(network, plan.forward, *arrays)
  return _by_use(network, plan, *arrays)


@dataclasses.dataclass(frozen=True)
class _Network:
  """A call's static configuration; ``host_lengths``: the lengths where the host holds them."""
  cell: str
  input_size: int
  hidden_size: int
  num_layers: int
  bidirectional: bool
  dropout: float
  precision: object
  host_lengths: tuple[int, ...] | None


def _path(net: _Network, impl: str, x, initial_state, weights, seq_lengths, dropout_key):
  """The network's ``(y, final_state)`` by ``impl``."""
  batch, time = x.shape[:2]
  if impl == "cudnn" and batch and time and net.host_lengths is not None and net.dropout == 0:
    call = cudnn_kernels.Call(net.cell, net.input_size, net.hidden_size, net.num_layers,
                              net.bidirectional, batch, time, jnp.dtype(x.dtype),
                              _exact(net.precision, x.dtype),
                              tuple(max(n, 1) for n in net.host_lengths))
    return _cudnn(call, x, initial_state, weights, net.host_lengths)  # cuDNN's own layout
  layers = dict(num_layers=net.num_layers, bidirectional=net.bidirectional)
  unpacked = unpack(net.cell, weights, net.input_size, net.hidden_size, net.num_layers,
                    net.bidirectional)
  dropped = dict(dropout=net.dropout, dropout_key=dropout_key, precision=net.precision)
  if impl == "cudnn" and batch and time:
    return _cudnn_by_layer(net.cell, x, initial_state, unpacked, seq_lengths, **layers,
                           **dropped)
  if impl == "xla" or batch == 0 or time == 0:
    return reference.forward(net.cell, x, initial_state, unpacked, seq_lengths, **layers,
                             **dropped)
  return _fused_forward(net.cell, x, initial_state, unpacked, seq_lengths, **layers, **dropped)


# Inference on plan.evaluated's path, training on plan.forward's, where the table parts them.
_by_use = op.by_use(_path, static=1, differentiated=3)


lstm.__doc__ = lstm.__doc__.replace("{cuda_limits}", cuda_kernels.limits())


def _check_lengths(op, seq_lengths, batch, time):
  """The lengths as an array, and as a tuple where the host holds them (None: every sequence
  runs all ``time`` steps; a NumPy array or a list), else None."""
  if seq_lengths is None:
    return jnp.full((batch,), time, jnp.int32), (time,) * batch
  on_host = not isinstance(seq_lengths, jax.Array)
  seq_lengths = check_array(op, "seq_lengths", seq_lengths, floating=False)
  if not jnp.issubdtype(seq_lengths.dtype, jnp.integer):
    raise TypeError(f"{op}: seq_lengths must be integers, got {describe(seq_lengths)}")
  if seq_lengths.shape != (batch,):
    raise ValueError(f"{op}: seq_lengths must have shape (batch,) = ({batch},), got "
                     f"{describe(seq_lengths)}")
  check_lengths_range(op, "seq_lengths", seq_lengths, time, f"T={time}")
  return seq_lengths, tuple(np.asarray(seq_lengths).tolist()) if on_host else None


# ---- The fused kernels ('cuda').


@dataclasses.dataclass(frozen=True)
class _Layer:
  """What decides whether a layer runs on the fused kernels and how."""
  cell: str
  batch: int
  time: int
  hidden: int
  directions: int
  dtype: jnp.dtype


def _cuda_unavailable(layer: _Layer) -> str | None:
  reason = cuda_kernels.unavailable()
  if reason is None and layer.batch and layer.time:
    reason = cuda_kernels.unsupported(layer.cell, layer.batch, layer.hidden, layer.directions,
                                      layer.dtype)
  return reason


# Precisions at which a float32 product must not drop to one TF32 pass.
_EXACT_PRECISIONS = {"HIGHEST", "HIGH", "FLOAT32", "F32_F32_F32", "BF16_BF16_F32_X3",
                     "BF16_BF16_F32_X6", "TF32_TF32_F32_X3"}


def _exact(precision, dtype) -> bool:
  """Whether float32 products run in three TF32 passes (close to float32) rather than one."""
  if jnp.dtype(dtype) != jnp.float32:
    return False
  if precision is None:
    precision = jax.config.jax_default_matmul_precision
  if isinstance(precision, tuple):  # (lhs, rhs): the finer of the two
    return any(_exact(p, dtype) for p in precision)
  return str(getattr(precision, "name", precision)).upper() in _EXACT_PRECISIONS


@functools.partial(jax.jit, static_argnames=("cell", "num_layers", "bidirectional", "dropout",
                                             "precision"))
def _fused_forward(cell, x, initial_state, unpacked, seq_lengths, *, num_layers, bidirectional,
                   dropout, dropout_key, precision):
  W_ih, W_hh, b_ih, b_hh = unpacked
  directions = 2 if bidirectional else 1
  op_dtype = jnp.result_type(x, W_ih[0])
  config = _Config(cell, _exact(precision, op_dtype), precision)
  lengths = seq_lengths.astype(jnp.int32)
  inputs = x
  finals = []
  for layer in range(num_layers):
    pseudo = range(layer * directions, (layer + 1) * directions)
    states = [s[pseudo.start:pseudo.stop].astype(jnp.float32) for s in initial_state]
    if cell == "gru":
      states.append(jnp.zeros_like(states[0]))
    y, h_n, c_n = _fused_layer(config, inputs, *states, [W_ih[p] for p in pseudo],
                               [W_hh[p] for p in pseudo], [b_ih[p] for p in pseudo],
                               [b_hh[p] for p in pseudo], lengths)
    finals.append((h_n, c_n))
    inputs = y.reshape(y.shape[:2] + (-1,))
    if layer < num_layers - 1:
      inputs = reference.drop(inputs, dropout, dropout_key, layer)
  final_state = tuple(jnp.concatenate([f[k] for f in finals]).astype(s.dtype)
                      for k, s in enumerate(initial_state))
  return inputs, final_state


@dataclasses.dataclass(frozen=True)
class _Config:
  cell: str
  exact: bool
  precision: object


def _fused_layer(config, inputs, h0, c0, W_ih, W_hh, b_ih, b_hh, lengths):
  """One layer, all its directions: the input projection of every step in one XLA matmul,
  then the recurrence on the kernels."""
  cell = config.cell
  hidden = W_hh[0].shape[1]
  op_dtype = jnp.result_type(inputs, W_ih[0])
  f32 = jnp.float32
  w_ih = jnp.concatenate([w.astype(op_dtype) for w in W_ih])
  # The hidden biases join the projection, but for GRU's candidate's: the reset gate scales it.
  def joined(bi, bh):
    bh = bh.astype(f32)
    return bi.astype(f32) + (bh if cell == "lstm" else bh.at[2 * hidden:].set(0))

  bias = jnp.concatenate([joined(bi, bh) for bi, bh in zip(b_ih, b_hh)])
  xp = jax.lax.dot_general(inputs.astype(op_dtype), w_ih, (((2,), (1,)), ((), ())),
                           precision=config.precision, preferred_element_type=f32) + bias
  xp = xp.reshape(xp.shape[:2] + (len(W_ih), -1))
  w_hh = jnp.stack([w.astype(op_dtype) for w in W_hh])
  if cell == "gru":
    b_hn = jnp.stack([b[2 * hidden:].astype(f32) for b in b_hh])
  else:
    b_hn = jnp.zeros((len(W_hh), hidden), f32)
  return _recurrence(config, xp, w_hh, b_hn, h0, c0, lengths)


def _recurrence(config, xp, w_hh, b_hn, h0, c0, lengths):
  return _kernels(config, save=False).forward(xp, w_hh, b_hn, h0, c0, lengths)


def _recurrence_fwd(config, xp, w_hh, b_hn, h0, c0, lengths):
  y, h_n, c_n, gates, states = _kernels(config, save=True).forward(xp, w_hh, b_hn, h0, c0,
                                                                   lengths)
  return (y, h_n, c_n), (y, gates, states, w_hh, h0, c0, lengths)


def _recurrence_bwd(config, residuals, cotangents):
  y, gates, states, w_hh, h0, c0, lengths = residuals
  dy, dh_n, dc_n = cotangents
  dxp, dhn, dh0, dc0 = _kernels(config, save=True).backward(
      dy, dh_n.astype(jnp.float32), dc_n.astype(jnp.float32), gates, states, h0, c0, w_hh,
      lengths)
  hidden = w_hh.shape[2]
  # The gradients of W_hh h_{t-1}: the gates' for the LSTM; for the GRU the candidate's passes
  # through the reset gate first.
  hidden_grads = dxp if dhn is None else jnp.concatenate([dxp[..., :2 * hidden], dhn], -1)
  previous = _previous_hidden(y, h0.astype(y.dtype), lengths)
  dw_hh = jax.lax.dot_general(hidden_grads.astype(w_hh.dtype), previous,
                              (((0, 1), (0, 1)), ((2,), (2,))), precision=config.precision,
                              preferred_element_type=jnp.float32,
                              out_sharding=replicated_sharding(previous)).astype(w_hh.dtype)
  db_hn = jnp.zeros((w_hh.shape[0], hidden), jnp.float32) if dhn is None else dhn.sum((0, 1))
  return dxp, dw_hh, db_hn, dh0, dc0, None


_recurrence = op.differentiable(_recurrence, _recurrence_fwd, _recurrence_bwd, static=(0,))


def _previous_hidden(y, h0, lengths):
  """``(B, S, D, H)``: the hidden state each position's step started from, as the product read
  it (the output of the step before, or h_0 at each direction's first step)."""
  steps = jnp.arange(y.shape[1])[None, :, None]
  zero = jnp.zeros_like(y[:, :1, 0])
  parts = [jnp.where(steps == 0, h0[0][:, None], jnp.concatenate([zero, y[:, :-1, 0]], 1))]
  if y.shape[2] == 2:  # the reverse direction starts at each sequence's last position
    last = steps == lengths[:, None, None] - 1
    parts.append(jnp.where(last, h0[1][:, None], jnp.concatenate([y[:, 1:, 1], zero], 1)))
  return jnp.stack(parts, axis=2)


class _Kernels:
  """The kernel calls of one configuration, with their vmap rules and batch sharding."""

  # Which axis of each operand and result is the batch (None: shared, like the weights).
  FORWARD_IN = (0, None, None, 1, 1, 0)
  BACKWARD_IN = (0, 1, 1, 0, 0, 1, 1, None, 0)

  def __init__(self, config: _Config, save: bool):
    self.config, self.save = config, save
    forward_out = (0, 1, 1) + ((0, 0) if save else ())
    backward_out = (0, 0, 1, 1) if config.cell == "gru" else (0, 1, 1)
    self.forward = _mapped(self._sharded_forward, self.FORWARD_IN, forward_out)
    self._backward = _mapped(self._sharded_backward, self.BACKWARD_IN, backward_out)

  def backward(self, *args):
    outs = self._backward(*args)
    return outs if self.config.cell == "gru" else (outs[0], None) + tuple(outs[1:])

  def _sharded_forward(self, xp, w_hh, b_hn, h0, c0, lengths):
    c = self.config
    local = lambda *args: cuda_kernels.forward(c.cell, *args, exact=c.exact, save=self.save)
    reserve = [("b", "s", "d", "q"), ("b", "s", "d", "h")] if self.save else []
    return parallel_call(c.cell, local, xp, w_hh, b_hn, h0, c0, lengths,
                         in_dims=[("b", "s", "d", "g"), ("d", "g", "h"), ("d", "h"),
                                  ("d", "b", "h"), ("d", "b", "h"), ("b",)],
                         out_dims=[("b", "s", "d", "h"), ("d", "b", "h"), ("d", "b", "h")]
                         + reserve, parallel={"b"})

  def _sharded_backward(self, dy, dh_n, dc_n, gates, states, h0, c0, w_hh, lengths):
    c = self.config

    def local(*args):
      dxp, dhn, dh0, dc0 = cuda_kernels.backward(c.cell, *args, exact=c.exact)
      return (dxp, dh0, dc0) if dhn is None else (dxp, dhn, dh0, dc0)

    sequence, state = ("b", "s", "d", "h"), ("d", "b", "h")
    out_dims = [("b", "s", "d", "g")] + [sequence] * (c.cell == "gru") + [state, state]
    return parallel_call(c.cell, local, dy, dh_n, dc_n, gates, states, h0, c0, w_hh, lengths,
                         in_dims=[sequence, state, state, ("b", "s", "d", "q"), sequence, state,
                                  state, ("d", "g", "h"), ("b",)],
                         out_dims=out_dims, parallel={"b"})


@functools.cache
def _kernels(config: _Config, save: bool) -> _Kernels:
  return _Kernels(config, save)


def _mapped(fn, in_axes, out_axes):
  """``fn`` with a vmap rule. A mapped axis on the batch-carrying operands only is more batch:
  it is folded into their batch axis and ``fn`` runs once. Mapped shared operands (per-example
  weights) run ``fn`` once per example."""
  def rule(axis_size, in_batched, *args):
    args = [a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape)
            for a, batched in zip(args, in_batched)]
    if any(batched for batched, axis in zip(in_batched, in_axes) if axis is None):
      outs = jax.lax.map(lambda per_example: wrapped(*per_example), tuple(args))
    else:
      folded = [a[0] if axis is None else _fold(a, axis) for a, axis in zip(args, in_axes)]
      outs = tuple(_unfold(o, axis, axis_size) for o, axis in zip(wrapped(*folded), out_axes))
    return tuple(outs), tuple(True for _ in outs)

  wrapped = op.vmappable(fn, rule)
  return wrapped


def _fold(a, axis):
  """``(V, ..., B at axis + 1, ...)`` to ``(..., V * B at axis, ...)``."""
  a = jnp.moveaxis(a, 0, axis)
  return a.reshape(a.shape[:axis] + (-1,) + a.shape[axis + 2:])


def _unfold(a, axis, size):
  a = a.reshape(a.shape[:axis] + (size, -1) + a.shape[axis + 1:])
  return jnp.moveaxis(a, axis, 0)


# ---- cuDNN ('cudnn').


def _cudnn(call, x, initial_state, weights, host_lengths):
  h_0 = initial_state[0]
  c_0 = initial_state[1] if call.cell == "lstm" else jnp.zeros((1,), call.dtype)
  y, h_n, c_n = _cudnn_layers(x, h_0, c_0, weights, call)
  # An empty sequence ran one step (cuDNN takes none shorter): its output is zero and its
  # final state the initial one.
  empty = np.asarray(host_lengths) == 0
  if empty.any():
    y = jnp.where(empty[:, None, None], jnp.zeros_like(y), y)
    keep = lambda final, initial: jnp.where(empty[None, :, None], initial, final)
    return y, tuple(keep(f, i) for f, i in zip((h_n, c_n), initial_state))
  return y, (h_n, c_n)[:len(initial_state)]


def _cudnn_by_layer(cell, x, initial_state, unpacked, seq_lengths, *, num_layers,
                    bidirectional, dropout, dropout_key, precision):
  """Lengths on the device (or dropout between layers): each layer and direction one cuDNN
  call over whole sequences, so that cuDNN needs no lengths; what it computes past a sequence's
  end is never read. Outputs there are masked, the reverse direction runs each sequence
  reversed within its length (its padding after it), and the final state is read at each
  sequence's last step: h from the outputs, LSTM's c recomputed from them."""
  W_ih, W_hh, b_ih, b_hh = unpacked
  directions = 2 if bidirectional else 1
  batch, time = x.shape[:2]
  lengths = seq_lengths.astype(jnp.int32)
  running = (jnp.arange(time)[None, :] < lengths[:, None])[:, :, None]
  last = jnp.maximum(lengths - 1, 0)[:, None, None]
  ended = (lengths > 0)[:, None]
  at_last = lambda a: jnp.take_along_axis(a, last, axis=1)[:, 0]
  exact = _exact(precision, x.dtype)
  # Zero past each end: the steps cuDNN runs there, forward and backward, stay finite.
  inputs, finals = jnp.where(running, x, 0), [[] for _ in initial_state]
  for layer in range(num_layers):
    outputs = []
    for direction in range(directions):
      p = layer * directions + direction
      sequence = reference.reverse_within_lengths(inputs, lengths) if direction else inputs
      call = cudnn_kernels.Call(cell, sequence.shape[2], W_hh[p].shape[1], 1, False, batch,
                                time, jnp.dtype(x.dtype), exact, (time,) * batch)
      weights = jnp.concatenate([W_ih[p].ravel(), W_hh[p].ravel(), b_ih[p], b_hh[p]])
      h_0 = initial_state[0][p]
      c_0 = initial_state[1][p][None] if cell == "lstm" else jnp.zeros((1,), x.dtype)
      y = jnp.where(running, _cudnn_layers(sequence, h_0[None], c_0, weights, call)[0], 0)
      finals[0].append(jnp.where(ended, at_last(y), h_0))
      if cell == "lstm":
        cell_states = _cell_states(sequence, y, h_0, c_0[0], W_ih[p], W_hh[p], b_ih[p] + b_hh[p],
                                   precision)
        finals[1].append(jnp.where(ended, at_last(cell_states), c_0[0]))
      outputs.append(reference.reverse_within_lengths(y, lengths) if direction else y)
    inputs = jnp.concatenate(outputs, axis=-1) if directions == 2 else outputs[0]
    if layer < num_layers - 1:
      inputs = reference.drop(inputs, dropout, dropout_key, layer)
  return inputs, tuple(jnp.stack(f).astype(s.dtype) for f, s in zip(finals, initial_state))


def _cell_states(sequence, y, h_0, c_0, W_ih, W_hh, bias, precision):
  """LSTM's cell state at every step (float32), from the step's input and the hidden state it
  started from: the gates of all steps in two products, then ``c_t = f_t c_{t-1} + i_t g_t``,
  a linear recurrence, as a parallel prefix over time."""
  previous = jnp.concatenate([h_0[:, None].astype(y.dtype), y[:, :-1]], axis=1)
  project = lambda a, w: reference.project(a, w, precision, jnp.float32)
  gates = project(sequence, W_ih) + project(previous, W_hh) + bias.astype(jnp.float32)
  i, f, g, _ = jnp.split(gates, 4, axis=-1)
  decay, gain = jax.nn.sigmoid(f), jax.nn.sigmoid(i) * jnp.tanh(g)
  # (decay, gain) maps c to decay * c + gain; composing two such maps gives another.
  compose = lambda early, late: (early[0] * late[0], late[0] * early[1] + late[1])
  decays, gains = jax.lax.associative_scan(compose, (decay, gain), axis=1)
  return decays * c_0[:, None].astype(jnp.float32) + gains


def _cudnn_sharded(call, kernel, *args, in_dims, out_dims):
  """``kernel(call, *args)`` on each shard of the batch where every sequence runs all steps
  (each shard's call then differs only in its batch); ragged host lengths name every
  sequence of the whole batch and run unsharded. Under vmap, one example at a time: a call
  is compiled for its configuration, and each example has its own weight gradient."""
  if call.whole:
    local = lambda *local_args: kernel(call.uniform(local_args[0].shape[0]), *local_args)
    run = lambda *args: parallel_call(call.cell, local, *args, in_dims=in_dims,
                                      out_dims=out_dims, parallel={"b"})
  else:
    run = lambda *args: kernel(call, *args)

  def rule(axis_size, in_batched, *args):
    def one(mapped):
      examples = iter(mapped)
      return wrapped(*(next(examples) if batched else a
                       for a, batched in zip(args, in_batched)))
    outs = jax.lax.map(one, tuple(a for a, batched in zip(args, in_batched) if batched))
    return tuple(outs), tuple(True for _ in outs)

  wrapped = op.vmappable(run, rule)
  return wrapped(*args)


_STATE = ("p", "b", "h")


def _cell_dims(call):
  return _STATE if call.cell == "lstm" else ("one",)


def _cudnn_primal(x, h_0, c_0, weights, call):
  return _cudnn_forward(call, x, h_0, c_0, weights, training=False)[0]


def _cudnn_forward(call, x, h_0, c_0, weights, *, training):
  def kernel(call, x, h_0, c_0, weights):
    y, h_n, c_n, reserve = cudnn_kernels.forward(call, x, h_0, c_0, weights, training=training)
    return y, h_n, c_0 if c_n is None else c_n, reserve

  y, h_n, c_n, reserve = _cudnn_sharded(
      call, kernel, x, h_0, c_0, weights,
      in_dims=[("b", "s", "i"), _STATE, _cell_dims(call), ("w",)],
      out_dims=[("b", "s", "o"), _STATE, _cell_dims(call), ("b", "r")])
  return (y, h_n, c_n), reserve


def _cudnn_fwd(x, h_0, c_0, weights, call):
  outputs, reserve = _cudnn_forward(call, x, h_0, c_0, weights, training=True)
  return outputs, (x, h_0, c_0, weights, outputs[0], reserve)


def _cudnn_bwd(call, residuals, cotangents):
  dy, dh_n, dc_n = cotangents

  def kernel(call, dy, dh_n, dc_n, x, h_0, c_0, weights, y, reserve):
    dx, dh_0, dc_0, dw = cudnn_kernels.backward(call, dy, dh_n, dc_n, x, h_0, c_0, weights, y,
                                                reserve)
    return dx, dh_0, jnp.zeros_like(c_0) if dc_0 is None else dc_0, dw

  sequence = ("b", "s", "o")
  return _cudnn_sharded(
      call, kernel, dy, dh_n, dc_n, *residuals,
      in_dims=[sequence, _STATE, _cell_dims(call), ("b", "s", "i"), _STATE, _cell_dims(call),
               ("w",), sequence, ("b", "r")],
      out_dims=[("b", "s", "i"), _STATE, _cell_dims(call), ("w",)])


_cudnn_layers = op.differentiable(_cudnn_primal, _cudnn_fwd, _cudnn_bwd, static=(4,))
