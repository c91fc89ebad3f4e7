"""XLA implementation of the multi-layer LSTM and GRU: ``lax.scan`` over time.

Each layer and direction projects its whole input sequence with one matmul before the scan, so
the scan carries only the recurrent matmul; a bidirectional layer runs its two directions in one
scan. Ragged batches: a step past a sequence's end leaves its state unchanged and outputs zero;
the reverse direction reads each sequence backwards from its own last step (positions past the
end stay in place, where they are masked anyway).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxfuse._core import op
from jaxfuse._core.sharding import replicated_sharding
from jaxfuse._core.validation import compute_dtype


def reverse_within_lengths(sequences, seq_lengths):
  """``(B, T, F)`` with each sequence's first ``length`` steps reversed; its own inverse."""
  steps = jnp.arange(sequences.shape[1])[None, :]
  lengths = seq_lengths[:, None]
  source = jnp.where(steps < lengths, lengths - 1 - steps, steps)
  return jnp.take_along_axis(sequences, source[:, :, None], axis=1)


def project(a, w, precision, accumulate, batched=False):
  """``a @ w.T`` over the last axis of ``a``, accumulated in ``accumulate``; ``batched``: one
  product per leading index, ``w`` ``(D, N, K)`` and ``a`` ``(D, ..., K)``."""
  if replicated_sharding(a) is not None:
    return _sharded_project(a, w, precision, accumulate, batched)
  return _product(a, w, precision, accumulate, batched)


def _product(a, w, precision, accumulate, batched):
  batch = ((0,), (0,)) if batched else ((), ())
  return lax.dot_general(a, w, (((a.ndim - 1,), (w.ndim - 1,)), batch), precision=precision,
                         preferred_element_type=accumulate)


def _sharded_project_fwd(a, w, precision, accumulate, batched):
  return _product(a, w, precision, accumulate, batched), (a, w)


def _sharded_project_bwd(precision, accumulate, batched, residuals, grad):
  a, w = residuals
  batch = ((0,), (0,)) if batched else ((), ())
  leading = tuple(range(int(batched), a.ndim - 1))
  da = lax.dot_general(grad, w.astype(grad.dtype), (((a.ndim - 1,), (w.ndim - 2,)), batch),
                       precision=precision)
  dw = lax.dot_general(grad, a.astype(grad.dtype), ((leading, leading), batch),
                       precision=precision, out_sharding=replicated_sharding(a))
  return da.astype(a.dtype), dw.astype(w.dtype)


# Under an explicitly sharded batch the gradient of w contracts the sharded axis, and JAX asks
# for its sharding (the recurrent product's, inside the scan): replicated, like w.
_sharded_project = op.differentiable(_product, _sharded_project_fwd, _sharded_project_bwd,
                                     static=(2, 3, 4))


def _lstm_step(hidden_gates, projected, state):
  h, c = state
  gates = projected + hidden_gates(h)
  i, f, g, o = jnp.split(gates, 4, axis=-1)
  c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
  return jnp.tanh(c) * jax.nn.sigmoid(o), c


def _gru_step(hidden_gates, projected, state):
  (h,) = state
  x_r, x_z, x_n = jnp.split(projected, 3, axis=-1)
  h_r, h_z, h_n = jnp.split(hidden_gates(h), 3, axis=-1)
  r = jax.nn.sigmoid(x_r + h_r)
  z = jax.nn.sigmoid(x_z + h_z)
  # The reset gate scales the hidden projection including its bias (cuDNN's and PyTorch's GRU).
  n = jnp.tanh(x_n + r * h_n)
  return ((1 - z) * n + z * h,)


_STEPS = {"lstm": _lstm_step, "gru": _gru_step}


def drop(inputs, dropout, dropout_key, layer):
  """Inverted dropout of the outputs of ``layer`` before the next layer (every implementation
  draws the same masks from ``dropout_key``)."""
  if dropout == 0:
    return inputs
  keep = jax.random.bernoulli(jax.random.fold_in(dropout_key, layer), 1 - dropout, inputs.shape)
  return jnp.where(keep, inputs / (1 - dropout), 0).astype(inputs.dtype)


def _projected(inputs, W_ih, b_ih, seq_lengths, reverse, precision, accumulate):
  """The input products of one direction over the whole sequence, time-major ``(T, B, G)``."""
  if reverse:
    inputs = reverse_within_lengths(inputs, seq_lengths)
  operand = jnp.result_type(inputs, W_ih)
  projected = project(inputs.astype(operand), W_ih.astype(operand), precision, accumulate)
  return jnp.swapaxes(projected + b_ih.astype(accumulate), 0, 1)


def _recur(cell, hidden_gates, projected, state, seq_lengths):
  """The recurrence over time-major ``projected`` from ``state``: the final state and the
  time-major outputs, zero past each sequence's end (where the state stays)."""
  step = _STEPS[cell]

  def scan_step(state, inputs_t):
    projected_t, t = inputs_t
    running = (t < seq_lengths)[:, None]
    new_state = step(hidden_gates, projected_t, state)
    state = tuple(jnp.where(running, new, old) for new, old in zip(new_state, state))
    return state, jnp.where(running, new_state[0], 0)

  return lax.scan(scan_step, state, (projected, jnp.arange(projected.shape[0])))


def _direction(cell, inputs, state, W_ih, W_hh, b_ih, b_hh, seq_lengths, precision,
               accumulate):
  """One layer in one direction: outputs ``(B, T, H)`` in ``accumulate`` and final state."""
  operand = jnp.result_type(inputs, W_ih)
  projected = _projected(inputs, W_ih, b_ih, seq_lengths, False, precision, accumulate)
  hidden_bias = b_hh.astype(accumulate)
  W_hh = W_hh.astype(operand)
  hidden_gates = lambda h: project(h.astype(operand), W_hh, precision, accumulate) + hidden_bias
  state, outputs = _recur(cell, hidden_gates, projected, state, seq_lengths)
  return jnp.swapaxes(outputs, 0, 1), state


def _both_directions(cell, inputs, states, params, seq_lengths, precision, accumulate):
  """One layer in both directions, side by side in one scan: each step's two recurrent
  products are one batched matmul (one direction's alone fills few of a GPU's SMs at small
  batches, and the steps halve). Outputs ``(B, T, H)`` in ``accumulate`` and the final state,
  per direction."""
  operand = jnp.result_type(inputs, params[0][0])
  projected = jnp.stack([_projected(inputs, W_ih, b_ih, seq_lengths, direction == 1, precision,
                                    accumulate)
                         for direction, (W_ih, _, b_ih, _) in enumerate(params)], axis=1)
  W_hh = jnp.stack([p[1] for p in params]).astype(operand)
  hidden_bias = jnp.stack([p[3] for p in params]).astype(accumulate)[:, None, :]
  hidden_gates = lambda h: (project(h.astype(operand), W_hh, precision, accumulate, batched=True)
                            + hidden_bias)
  state = tuple(jnp.stack(pair) for pair in zip(*states))
  state, outputs = _recur(cell, hidden_gates, projected, state, seq_lengths)  # (T, 2, B, H)
  forward, backward = (jnp.swapaxes(outputs[:, d], 0, 1) for d in range(2))
  return ([forward, reverse_within_lengths(backward, seq_lengths)],
          [tuple(s[d] for s in state) for d in range(2)])


@functools.partial(jax.jit, static_argnames=("cell", "num_layers", "bidirectional", "dropout",
                                             "precision"))
def forward(cell, x, initial_state, unpacked, seq_lengths, *, num_layers, bidirectional,
            dropout, dropout_key, precision):
  """Runs the network.

  Args:
    cell: ``'lstm'`` or ``'gru'``.
    x: ``(B, T, I)``.
    initial_state: ``(h_0,)`` or ``(h_0, c_0)``, each ``(num_layers * directions, B, H)``.
    unpacked: ``(W_ih, W_hh, b_ih, b_hh)``, dicts from pseudo-layer to array.
    seq_lengths: ``(B,)`` integers in ``[0, T]``.

  Returns:
    ``(y, final_state)``: ``y`` ``(B, T, directions * H)`` of the result dtype of ``x`` and the
    weights; the final state like ``initial_state``, each in its own dtype.
  """
  W_ih, W_hh, b_ih, b_hh = unpacked
  accumulate = compute_dtype(x.dtype, W_ih[0].dtype)
  directions = 2 if bidirectional else 1
  seq_lengths = seq_lengths.astype(jnp.int32)
  inputs = x
  finals = []
  for layer in range(num_layers):
    pseudo = range(layer * directions, (layer + 1) * directions)
    states = [tuple(s[p].astype(accumulate) for s in initial_state) for p in pseudo]
    params = [(W_ih[p], W_hh[p], b_ih[p], b_hh[p]) for p in pseudo]
    if directions == 2:
      outputs, states = _both_directions(cell, inputs, states, params, seq_lengths, precision,
                                         accumulate)
    else:
      out, state = _direction(cell, inputs, *states, *params[0], seq_lengths, precision,
                              accumulate)
      outputs, states = [out], [state]
    finals += states
    inputs = jnp.concatenate(outputs, axis=-1) if directions == 2 else outputs[0]
    inputs = inputs.astype(jnp.result_type(x, W_ih[0]))
    if layer < num_layers - 1:
      inputs = drop(inputs, dropout, dropout_key, layer)
  final_state = tuple(jnp.stack([f[k] for f in finals]).astype(s.dtype)
                      for k, s in enumerate(initial_state))
  return inputs, final_state
