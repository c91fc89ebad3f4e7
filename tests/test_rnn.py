"""lstm and gru against a float64 NumPy reference written here, step by step in Python loops,
reading the flat weights by cuDNN's layout as written out here too."""

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import jax.test_util  # noqa: F401  (check_grads)
import numpy as np
import pytest

import jaxfuse
from jaxfuse._core.testing import assert_close, random, x64

CELLS = ["lstm", "gru"]
INPUT, HIDDEN, TIME = 5, 6, 7
WEIGHT_KINDS = ("W_ih", "W_hh", "b_ih", "b_hh")


def _sigmoid(v):
  return 1 / (1 + np.exp(-v))


def cudnn_layout(cell, input_size, hidden_size, num_layers, bidirectional):
  """``[(kind, pseudo_layer, shape)]`` in the order of cuDNN's flat weights, written out from
  the documentation so that the references never read weights through the code under test:
  every pseudo-layer's ``W_ih`` then ``W_hh``, then every pseudo-layer's ``b_ih`` then
  ``b_hh``, each with its gate blocks stacked on the rows (LSTM i, f, g, o; GRU r, z, n)."""
  rows = {"lstm": 4, "gru": 3}[cell] * hidden_size
  directions = 2 if bidirectional else 1
  pseudo_layers = range(num_layers * directions)
  width = lambda p: input_size if p < directions else directions * hidden_size
  matrices = [(kind, p, (rows, width(p) if kind == "W_ih" else hidden_size))
              for p in pseudo_layers for kind in ("W_ih", "W_hh")]
  biases = [(kind, p, (rows,)) for p in pseudo_layers for kind in ("b_ih", "b_hh")]
  return matrices + biases


def weight_count(cell, input_size, hidden_size, num_layers, bidirectional=False):
  return sum(math.prod(shape) for _, _, shape in
             cudnn_layout(cell, input_size, hidden_size, num_layers, bidirectional))


def split_flat(flat, layout):
  """``(W_ih, W_hh, b_ih, b_hh)`` cut from ``flat`` by ``layout``, each a dict from
  pseudo-layer to a float64 array."""
  flat = np.asarray(flat, np.float64)
  assert flat.shape == (sum(math.prod(shape) for _, _, shape in layout),)
  parts = {kind: {} for kind in WEIGHT_KINDS}
  offset = 0
  for kind, p, shape in layout:
    parts[kind][p] = flat[offset:offset + math.prod(shape)].reshape(shape)
    offset += math.prod(shape)
  return tuple(parts[kind] for kind in WEIGHT_KINDS)


def join_flat(parts, layout):
  """Inverse of :func:`split_flat`."""
  by_kind = dict(zip(WEIGHT_KINDS, parts))
  return np.concatenate([np.ravel(by_kind[kind][p]) for kind, p, _ in layout])


def numpy_rnn(cell, x, h_0, c_0, weights, lengths, num_layers, bidirectional):
  """float64 ``(y, h_n, c_n)`` (``c_n`` None for the GRU), one sequence and step at a time."""
  x, h_0, weights = (np.asarray(a, np.float64) for a in (x, h_0, weights))
  c_0 = np.asarray(c_0, np.float64) if cell == "lstm" else None
  W_ih, W_hh, b_ih, b_hh = split_flat(
      weights, cudnn_layout(cell, x.shape[2], h_0.shape[2], num_layers, bidirectional))
  directions = 2 if bidirectional else 1
  batch, time = x.shape[:2]
  hidden = h_0.shape[2]
  h_n, c_n = h_0.copy(), None if c_0 is None else c_0.copy()
  inputs = x
  for layer in range(num_layers):
    y = np.zeros((batch, time, directions * hidden))
    for direction in range(directions):
      p = layer * directions + direction
      for b in range(batch):
        h = h_0[p, b].copy()
        c = None if c_0 is None else c_0[p, b].copy()
        n = int(lengths[b])
        order = range(n - 1, -1, -1) if direction else range(n)
        for t in order:
          a = W_ih[p] @ inputs[b, t] + b_ih[p]
          r = W_hh[p] @ h + b_hh[p]
          if cell == "lstm":
            i, f, g, o = np.split(a + r, 4)
            c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
            h = _sigmoid(o) * np.tanh(c)
          else:
            a_r, a_z, a_n = np.split(a, 3)
            r_r, r_z, r_n = np.split(r, 3)
            reset, update = _sigmoid(a_r + r_r), _sigmoid(a_z + r_z)
            h = (1 - update) * np.tanh(a_n + reset * r_n) + update * h
          y[b, t, direction * hidden:(direction + 1) * hidden] = h
        h_n[p, b] = h
        if c is not None:
          c_n[p, b] = c
    inputs = y
  return inputs, h_n, c_n


def make(rng, cell, num_layers, bidirectional, batch=3, dtype=jnp.float32, lengths=None):
  directions = 2 if bidirectional else 1
  count = (jaxfuse.lstm_weight_count if cell == "lstm" else jaxfuse.gru_weight_count)(
      INPUT, HIDDEN, num_layers, bidirectional)
  x = random(rng, (batch, TIME, INPUT), dtype)
  h_0 = random(rng, (num_layers * directions, batch, HIDDEN), dtype, scale=0.5)
  c_0 = random(rng, (num_layers * directions, batch, HIDDEN), dtype, scale=0.5)
  weights = random(rng, (count,), dtype, scale=0.4)
  if lengths is None:
    lengths = rng.integers(0, TIME + 1, batch)
    lengths[:2] = [0, TIME][:batch]
  return x, h_0, c_0, weights, jnp.asarray(lengths, jnp.int32)


def call(cell, x, h_0, c_0, weights, lengths, num_layers, bidirectional, **kwargs):
  """``(y, h_n, c_n)``, ``c_n`` None for the GRU."""
  sizes = dict(input_size=INPUT, hidden_size=HIDDEN, num_layers=num_layers,
               bidirectional=bidirectional, **kwargs)
  if cell == "lstm":
    return jaxfuse.lstm(x, h_0, c_0, weights, lengths, **sizes)
  return (*jaxfuse.gru(x, h_0, weights, lengths, **sizes), None)


def check(cell, actual, expected, dtype, lengths, factor=1):
  """Compares each output (rows of length 0 are zero: ``floor`` keeps them meaningful)."""
  past_end = np.arange(TIME)[None, :] >= np.asarray(lengths)[:, None]
  assert np.all(np.asarray(actual[0], np.float32)[past_end] == 0)
  for a, e, name in zip(actual, expected, ("y", "h_n", "c_n")):
    if e is not None:
      assert_close(a, e, dtype, factor=factor, name=name, floor=0.1)


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("num_layers", [1, 2, 3])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_numpy(rng, cell, num_layers, bidirectional, dtype):
  args = make(rng, cell, num_layers, bidirectional, batch=4, dtype=dtype)
  out = call(cell, *args, num_layers, bidirectional)
  assert out[0].dtype == dtype and out[1].dtype == dtype
  assert out[0].shape == (4, TIME, (2 if bidirectional else 1) * HIDDEN)
  ref = numpy_rnn(cell, *args, num_layers, bidirectional)
  # bfloat16 rounds the hidden state for each step's matmul, and the errors compound over time.
  check(cell, out, ref, dtype, args[4], factor=1 if dtype == jnp.float32 else 4)


def test_length_zero_keeps_initial_state(rng):
  x, h_0, c_0, weights, _ = make(rng, "lstm", 2, True)
  lengths = jnp.zeros(3, jnp.int32)
  y, h_n, c_n = call("lstm", x, h_0, c_0, weights, lengths, 2, True)
  assert not np.any(np.asarray(y))
  np.testing.assert_array_equal(h_n, h_0)
  np.testing.assert_array_equal(c_n, c_0)


def test_float16(rng):
  args = make(rng, "gru", 2, True, dtype=jnp.float16)
  out = call("gru", *args, 2, True)
  ref = numpy_rnn("gru", *args, 2, True)
  assert_close(out[0], ref[0], jnp.float16, factor=4, floor=1e-2)


@pytest.mark.parametrize("cell", CELLS)
def test_gradients(rng, cell):
  with x64():
    x, h_0, c_0, weights, lengths = make(rng, cell, 2, True, batch=2, dtype=jnp.float64,
                                         lengths=[2, 4])
    x = x[:, :4]  # fewer steps keep the finite differences cheap
    if cell == "lstm":
      f = lambda x, h, c, w: call(cell, x, h, c, w, lengths, 2, True)
      jax.test_util.check_grads(f, (x, h_0, c_0, weights), order=1, modes=["rev"])
    else:
      f = lambda x, h, w: call(cell, x, h, None, w, lengths, 2, True)[:2]
      jax.test_util.check_grads(f, (x, h_0, weights), order=1, modes=["rev"])


def test_float32_gradient_matches_float64(rng):
  args = make(rng, "lstm", 2, True, batch=2)
  loss = lambda x, h, c, w: sum(jnp.sum(jnp.sin(o.astype(jnp.float32)))
                                for o in call("lstm", x, h, c, w, args[4], 2, True))
  grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*args[:4])
  with x64():
    wide = [jnp.asarray(np.asarray(a, np.float64)) for a in args[:4]]
    expected = jax.grad(loss, argnums=(0, 1, 2, 3))(*wide)
  for g, e, name in zip(grads, expected, ("x", "h_0", "c_0", "weights")):
    assert_close(g, np.asarray(e), jnp.float32, factor=10, name=name, floor=1e-3)


@pytest.mark.parametrize("cell", CELLS)
def test_jit_and_vmap(rng, cell):
  args = make(rng, cell, 2, True)
  expected = call(cell, *args, 2, True)
  jitted = jax.jit(lambda *a: call(cell, *a, 2, True))(*args)
  for a, e in zip(jitted, expected):
    if e is not None:
      np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)
  # vmap over a leading axis of separate batches, lengths traced per batch.
  stacked = [jnp.stack([a, a * 0.5]) if a.dtype != jnp.int32 else jnp.stack([a, a // 2])
             for a in args]
  mapped = jax.vmap(lambda *a: call(cell, *a, 2, True))(*stacked)
  second = call(cell, *(a[1] for a in stacked), 2, True)
  for a, e in zip(mapped, second):
    if e is not None:
      np.testing.assert_allclose(a[1], e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_pack_unpack_and_torch_round_trips(rng, cell, bidirectional):
  prefix = {"lstm": "lstm", "gru": "gru"}[cell]
  ns = jaxfuse.__dict__
  weights = ns[f"init_{prefix}_weights"](jax.random.key(1), INPUT, HIDDEN, 2, bidirectional)
  bound = 1 / np.sqrt(HIDDEN)
  assert np.all(np.abs(np.asarray(weights)) <= bound)
  unpacked = ns[f"unpack_{prefix}_weights"](weights, INPUT, HIDDEN, 2, bidirectional)
  gates = 4 if cell == "lstm" else 3
  directions = 2 if bidirectional else 1
  assert unpacked[0][0].shape == (gates * HIDDEN, INPUT)
  assert unpacked[0][directions].shape == (gates * HIDDEN, directions * HIDDEN)
  np.testing.assert_array_equal(ns[f"pack_{prefix}_weights"](*unpacked), weights)
  state_dict = ns[f"{prefix}_weights_to_torch"](weights, INPUT, HIDDEN, 2, bidirectional)
  expected_keys = {f"{kind}_l{layer}{suffix}" for kind in
                   ("weight_ih", "weight_hh", "bias_ih", "bias_hh") for layer in range(2)
                   for suffix in ("", "_reverse")[:directions]}
  assert set(state_dict) == expected_keys
  assert state_dict["weight_hh_l1"].shape == (gates * HIDDEN, HIDDEN)
  np.testing.assert_array_equal(ns[f"{prefix}_weights_from_torch"](state_dict), weights)


def test_torch_layout_is_pytorch_semantics(rng):
  """A state_dict drives the NumPy reference through PyTorch's formulas directly."""
  state_dict = {"weight_ih_l0": rng.standard_normal((3 * HIDDEN, INPUT)) * 0.4,
                "weight_hh_l0": rng.standard_normal((3 * HIDDEN, HIDDEN)) * 0.4,
                "bias_ih_l0": rng.standard_normal(3 * HIDDEN) * 0.4,
                "bias_hh_l0": rng.standard_normal(3 * HIDDEN) * 0.4}
  weights = jaxfuse.gru_weights_from_torch(state_dict, dtype=jnp.float32)
  x = rng.standard_normal((1, TIME, INPUT))
  y, _ = jaxfuse.gru(jnp.asarray(x, jnp.float32), jnp.zeros((1, 1, HIDDEN)), weights,
                     jnp.array([TIME]), input_size=INPUT, hidden_size=HIDDEN, num_layers=1)
  W_ir, W_iz, W_in = np.split(state_dict["weight_ih_l0"], 3)
  W_hr, W_hz, W_hn = np.split(state_dict["weight_hh_l0"], 3)
  b_ir, b_iz, b_in = np.split(state_dict["bias_ih_l0"], 3)
  b_hr, b_hz, b_hn = np.split(state_dict["bias_hh_l0"], 3)
  h, expected = np.zeros(HIDDEN), []
  for t in range(TIME):
    r = _sigmoid(W_ir @ x[0, t] + b_ir + W_hr @ h + b_hr)
    z = _sigmoid(W_iz @ x[0, t] + b_iz + W_hz @ h + b_hz)
    n = np.tanh(W_in @ x[0, t] + b_in + r * (W_hn @ h + b_hn))
    h = (1 - z) * n + z * h
    expected.append(h)
  assert_close(y[0], np.stack(expected), jnp.float32, floor=1e-3)


def test_dropout(rng):
  args = make(rng, "lstm", 3, True)
  run = lambda key, p=0.5: call("lstm", *args, 3, True, dropout=p, dropout_key=key)
  first, again = run(jax.random.key(0)), run(jax.random.key(0))
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
  other = run(jax.random.key(1))
  assert not np.array_equal(first[0], other[0])
  plain = call("lstm", *args, 3, True)
  assert not np.array_equal(first[0], plain[0])
  # Only between layers: the first layer's final states do not see the masks.
  np.testing.assert_array_equal(first[1][:2], plain[1][:2])
  with pytest.raises(ValueError, match="dropout_key"):
    call("lstm", *args, 3, True, dropout=0.5)


def probe_layer(cell, hidden_size, gain):
  """``(W_ih, W_hh, b_ih, b_hh)`` of a layer that reads each input element alone, without
  recurrence: its forget (LSTM) or update (GRU) gate shut, the others open, the candidate
  ``gain`` times the input. Its output is :func:`probe_output` of its input, zero exactly where
  the input is zero."""
  identity, zero = gain * np.eye(hidden_size), np.zeros((hidden_size, hidden_size))
  shut, opened = np.full(hidden_size, -200.0), np.full(hidden_size, 200.0)
  unbiased = np.zeros(hidden_size)
  if cell == "lstm":  # gates i, f, g, o
    W_ih, b_ih = [zero, zero, identity, zero], [opened, shut, unbiased, opened]
  else:  # gates r, z, n
    W_ih, b_ih = [zero, zero, identity], [unbiased, shut, unbiased]
  gates = len(W_ih)
  return (np.concatenate(W_ih), np.zeros((gates * hidden_size, hidden_size)),
          np.concatenate(b_ih), np.zeros(gates * hidden_size))


def probe_output(cell, inputs, gain):
  candidate = np.tanh(gain * inputs)
  return np.tanh(candidate) if cell == "lstm" else candidate  # LSTM: c = tanh(g), h = tanh(c)


@pytest.mark.parametrize("cell", CELLS)
def test_dropout_rate_and_scale(rng, cell):
  """Dropout between layers zeroes a fraction ``rate`` of the first layer's outputs and scales
  the others by exactly 1 / (1 - rate): the second layer is a probe whose outputs show each of
  its inputs, compared with the first layer's outputs from a run of that layer alone."""
  batch, time, hidden, rate, gain = 16, 32, 64, 0.3, 0.5
  first = split_flat(random(rng, (weight_count(cell, INPUT, hidden, 1),), jnp.float32,
                            scale=hidden ** -0.5), cudnn_layout(cell, INPUT, hidden, 1, False))
  probe = probe_layer(cell, hidden, gain)
  both = [{0: blocks[0], 1: probe_block} for blocks, probe_block in zip(first, probe)]
  x = random(rng, (batch, time, INPUT), jnp.float32)
  # The probe's gates make its own initial state irrelevant.
  states = [random(rng, (2, batch, hidden), jnp.float32, scale=0.5) for _ in range(2)]
  lengths = jnp.full((batch,), time, jnp.int32)

  def run(parts, num_layers, **kwargs):
    weights = jnp.asarray(join_flat(parts, cudnn_layout(cell, INPUT, hidden, num_layers, False)),
                          jnp.float32)
    initial = [s[:num_layers] for s in states]
    sizes = dict(input_size=INPUT, hidden_size=hidden, num_layers=num_layers,
                 implementation="xla", **kwargs)
    if cell == "lstm":
      return np.asarray(jaxfuse.lstm(x, *initial, weights, lengths, **sizes)[0], np.float64)
    return np.asarray(jaxfuse.gru(x, initial[0], weights, lengths, **sizes)[0], np.float64)

  layer_output = run(first, 1)
  assert np.all(layer_output != 0)  # so that a zero out of the probe is a dropped element
  out = run(both, 2, dropout=rate, dropout_key=jax.random.key(0))
  dropped = out == 0
  # Six standard deviations of the binomial fraction: no plausible key fails a correct rate.
  assert abs(dropped.mean() - rate) < 6 * np.sqrt(rate * (1 - rate) / dropped.size), (
      f"dropped {dropped.mean():.4f} of the elements at rate {rate}")
  expected = probe_output(cell, layer_output / (1 - rate), gain)
  # A few float32 roundings per element: any other scale is far outside.
  np.testing.assert_allclose(out[~dropped], expected[~dropped], rtol=4e-6)


# (input_size, hidden_size, num_layers, bidirectional): inputs wider and narrower than the
# hidden state, so that a matrix read with the other's width shows.
LAYOUT_SIZES = [(INPUT, HIDDEN, 1, False), (INPUT, HIDDEN, 2, True), (7, 3, 3, True),
                (2, 5, 3, False)]


@pytest.mark.parametrize("sizes", LAYOUT_SIZES, ids=str)
def test_lstm_layout_is_jax_experimental_rnns(sizes):
  """Weight count, unpacking and packing agree with jax.experimental.rnn, which reads the flat
  vector as cuDNN does, and with the layout written out here."""
  rnn = pytest.importorskip("jax.experimental.rnn")
  count = rnn.get_num_params_in_lstm(*sizes)
  assert jaxfuse.lstm_weight_count(*sizes) == count
  flat = jnp.arange(count, dtype=jnp.float32)  # distinct values: a misplaced block shows
  theirs = rnn.unpack_lstm_weights(flat, *sizes)
  ours = jaxfuse.unpack_lstm_weights(flat, *sizes)
  written_here = split_flat(flat, cudnn_layout("lstm", *sizes))
  pseudo_layers = list(range(sizes[2] * (2 if sizes[3] else 1)))
  for kind, mine, reference, documented in zip(WEIGHT_KINDS, ours, theirs, written_here):
    assert sorted(mine) == sorted(reference) == sorted(documented) == pseudo_layers, kind
    for p in pseudo_layers:
      np.testing.assert_array_equal(mine[p], reference[p], err_msg=f"{kind}[{p}]")
      np.testing.assert_array_equal(documented[p], reference[p], err_msg=f"{kind}[{p}]")
  np.testing.assert_array_equal(jaxfuse.pack_lstm_weights(*theirs), flat)


@pytest.mark.parametrize("num_layers,bidirectional", [(1, False), (2, True)])
def test_matches_jax_experimental_rnn(rng, num_layers, bidirectional):
  """On weights that jax.experimental.rnn draws and unpacks, the LSTM is its scan reference's
  (jax.experimental.rnn has an LSTM only)."""
  rnn = pytest.importorskip("jax.experimental.rnn")
  x, h_0, c_0, _, lengths = make(rng, "lstm", num_layers, bidirectional, lengths=[TIME, 4, 1])
  weights = rnn.init_lstm_weight(jax.random.key(2), INPUT, HIDDEN, num_layers, bidirectional)
  unpacked = rnn.unpack_lstm_weights(weights, INPUT, HIDDEN, num_layers, bidirectional)
  expected = rnn.lstm_ref(x, h_0, c_0, *unpacked, lengths, INPUT, HIDDEN, num_layers, 0.0,
                          bidirectional)
  actual = call("lstm", x, h_0, c_0, weights, lengths, num_layers, bidirectional,
                implementation="xla")
  for a, e, name in zip(actual, expected, ("y", "h_n", "c_n")):
    assert_close(a, np.asarray(e), jnp.float32, name=name)


def named_gru_gates(rng, input_size, hidden_size, num_layers, bidirectional):
  """Per pseudo-layer, each gate's own random blocks: ``W_ir, W_iz, W_in`` (input),
  ``W_hr, W_hz, W_hn`` (hidden) and their biases ``b_ir`` ... ``b_hn``."""
  directions = 2 if bidirectional else 1
  gates = []
  for p in range(num_layers * directions):
    width = {"i": input_size if p < directions else directions * hidden_size, "h": hidden_size}
    gates.append({f"{w}_{side}{gate}": rng.standard_normal(
        (hidden_size, width[side]) if w == "W" else hidden_size) * 0.4
        for w in "Wb" for side in "ih" for gate in "rzn"})
  return gates


def stacked_gates(gates, kind):
  """``kind``'s (``'W_ih'``, ... ``'b_hh'``) gate blocks stacked r, z, n on the rows."""
  return np.concatenate([gates[kind[:3] + gate] for gate in "rzn"])


def hand_built_gru_flat(gates):
  """cuDNN's flat GRU vector of named gate blocks, by hand: each pseudo-layer's W_ih then W_hh,
  then each pseudo-layer's b_ih then b_hh."""
  matrices = [stacked_gates(g, kind).ravel() for g in gates for kind in ("W_ih", "W_hh")]
  biases = [stacked_gates(g, kind) for g in gates for kind in ("b_ih", "b_hh")]
  return np.concatenate(matrices + biases).astype(np.float32)


@pytest.mark.parametrize("sizes", LAYOUT_SIZES, ids=str)
def test_gru_layout_is_documented(rng, sizes):
  """jax.experimental.rnn has no GRU: unpacking a flat vector built by hand puts each known
  block where cuDNN's layout has it, and packing the blocks builds the same vector."""
  gates = named_gru_gates(rng, *sizes)
  flat = hand_built_gru_flat(gates)
  assert jaxfuse.gru_weight_count(*sizes) == flat.size
  unpacked = jaxfuse.unpack_gru_weights(jnp.asarray(flat), *sizes)
  blocks = [{p: stacked_gates(g, kind).astype(np.float32) for p, g in enumerate(gates)}
            for kind in WEIGHT_KINDS]
  for kind, mine, expected in zip(WEIGHT_KINDS, unpacked, blocks):
    assert sorted(mine) == sorted(expected), kind
    for p in expected:
      np.testing.assert_array_equal(mine[p], expected[p], err_msg=f"{kind}[{p}]")
  np.testing.assert_array_equal(jaxfuse.pack_gru_weights(*blocks), flat)


def numpy_gru_cell(x, h, g):
  """One float64 GRU step of a batch from named gate blocks, cuDNN's (and PyTorch's)
  equations: the reset gate scales ``W_hn h + b_hn``."""
  r = _sigmoid(x @ g["W_ir"].T + g["b_ir"] + h @ g["W_hr"].T + g["b_hr"])
  z = _sigmoid(x @ g["W_iz"].T + g["b_iz"] + h @ g["W_hz"].T + g["b_hz"])
  n = np.tanh(x @ g["W_in"].T + g["b_in"] + r * (h @ g["W_hn"].T + g["b_hn"]))
  return (1 - z) * n + z * h


def test_gru_step_matches_numpy_cell(rng):
  """One step of a 2-layer bidirectional GRU, on a flat vector built by hand, against the cell
  above gate by gate."""
  gates = named_gru_gates(rng, INPUT, HIDDEN, 2, True)
  x = rng.standard_normal((3, INPUT))
  h_0 = rng.standard_normal((4, 3, HIDDEN)) * 0.5
  inputs, h_n = x, []
  for layer in range(2):
    outputs = [numpy_gru_cell(inputs, h_0[p], gates[p]) for p in (2 * layer, 2 * layer + 1)]
    h_n += outputs
    inputs = np.concatenate(outputs, axis=-1)
  y, h = jaxfuse.gru(jnp.asarray(x[:, None], jnp.float32), jnp.asarray(h_0, jnp.float32),
                     jnp.asarray(hand_built_gru_flat(gates)), jnp.ones(3, jnp.int32),
                     input_size=INPUT, hidden_size=HIDDEN, num_layers=2, bidirectional=True,
                     implementation="xla")
  assert_close(y[:, 0], inputs, jnp.float32, name="y")
  assert_close(h, np.stack(h_n), jnp.float32, name="h_n")


def test_implementations(rng):
  args = make(rng, "gru", 1, False)
  named = call("gru", *args, 1, False, implementation="xla")
  assert named[0].shape == (3, TIME, HIDDEN)
  with pytest.raises(NotImplementedError, match="gru has no 'triton' implementation"):
    call("gru", *args, 1, False, implementation="triton")
  if jax.default_backend() != "gpu":
    with pytest.raises(NotImplementedError, match="implementation='cuda'.* cannot run here"):
      call("gru", *args, 1, False, implementation="cuda")
    default = call("gru", *args, 1, False)
    np.testing.assert_array_equal(default[0], named[0])
    with pytest.raises(NotImplementedError, match="needs an NVIDIA GPU"):
      call("gru", *args, 1, False, implementation="cudnn")


@pytest.mark.parametrize("change, error, match", [
    (dict(weights=jnp.zeros(10)), ValueError, "weights"),
    (dict(h_0=jnp.zeros((1, 3, HIDDEN))), ValueError, "h_0"),
    (dict(c_0=jnp.zeros((2, 3, HIDDEN + 1))), ValueError, "c_0"),
    (dict(lengths=jnp.array([1.0, 2.0, 3.0])), TypeError, "seq_lengths"),
    (dict(lengths=jnp.array([1, 2, TIME + 1])), ValueError, "seq_lengths"),
    (dict(lengths=jnp.array([-1, 2, 3])), ValueError, "seq_lengths"),
    (dict(lengths=jnp.array([1, 2])), ValueError, "seq_lengths"),
    (dict(input_size=INPUT + 1), ValueError, "input_size"),
    (dict(hidden_size=0), ValueError, "hidden_size"),
    (dict(num_layers=0), ValueError, "num_layers"),
    (dict(num_layers=1.0), TypeError, "num_layers"),
    (dict(dropout=1.0), ValueError, "dropout"),
    (dict(dropout=-0.1), ValueError, "dropout"),
    (dict(x=jnp.zeros((3, TIME, INPUT), jnp.int32)), TypeError, "x"),
])
def test_bad_inputs(rng, change, error, match):
  x, h_0, c_0, weights, lengths = make(rng, "lstm", 1, True)
  arrays = dict(x=x, h_0=h_0, c_0=c_0, weights=weights, lengths=lengths)
  sizes = dict(input_size=INPUT, hidden_size=HIDDEN, num_layers=1, bidirectional=True)
  for key, value in change.items():
    (arrays if key in arrays else sizes)[key] = value
  with pytest.raises(error, match=match):
    jaxfuse.lstm(arrays["x"], arrays["h_0"], arrays["c_0"], arrays["weights"], arrays["lengths"],
                 **sizes)


def test_traced_lengths_are_not_checked(rng):
  args = make(rng, "lstm", 1, False)
  y, _, _ = jax.jit(lambda *a: call("lstm", *a, 1, False))(*args[:4], jnp.array([0, 2, 3]))
  assert y.shape == (3, TIME, HIDDEN)


# ------------------------------------------------------------------- GPU: every implementation

# Odd sizes: hidden 37 leaves a CTA's last units and the k-tiles partly empty.
GPU_SIZES = dict(input_size=13, hidden_size=37, time=29, batch=5)


def _training_step(cell, num_layers, bidirectional, **kwargs):
  """A jitted training step's gradients of every input, from a loss over y and the state."""
  def loss(x, h_0, c_0, weights, lengths):
    y, h_n, c_n = gpu_call(cell, (x, h_0, c_0, weights, lengths), num_layers, bidirectional,
                           **kwargs)
    total = jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(h_n.astype(jnp.float32))
    return total + (0.0 if c_n is None else jnp.sum(c_n.astype(jnp.float32)))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def _run_without_host_transfers(step, args):
  """``step(*args)`` compiled first, then run again with JAX's implicit transfers between
  host and device an error (the check issue 44 names for a training step)."""
  jax.block_until_ready(step(*args))
  with jax.transfer_guard("disallow"):
    jax.block_until_ready(step(*args))


@pytest.mark.parametrize("impl", ["xla", None])
@pytest.mark.parametrize("cell", CELLS)
def test_a_training_step_makes_no_host_transfer(rng, impl, cell):
  args = gpu_make(rng, cell, 2, True, jnp.float32, batch=3, input_size=4, hidden_size=5,
                  time=6)
  _run_without_host_transfers(_training_step(cell, 2, True, implementation=impl), args)


def gpu_make(rng, cell, num_layers, bidirectional, dtype, *, batch=5, input_size=13,
             hidden_size=37, time=29, full=False):
  directions = 2 if bidirectional else 1
  count = (jaxfuse.lstm_weight_count if cell == "lstm" else jaxfuse.gru_weight_count)(
      input_size, hidden_size, num_layers, bidirectional)
  state = (num_layers * directions, batch, hidden_size)
  lengths = np.full(batch, time) if full else rng.integers(0, time + 1, batch)
  if not full:
    lengths[:2] = [0, time][:batch]
  return (random(rng, (batch, time, input_size), dtype), random(rng, state, dtype, scale=0.5),
          random(rng, state, dtype, scale=0.5),
          random(rng, (count,), dtype, scale=hidden_size ** -0.5),
          jnp.asarray(lengths, jnp.int32))


def gpu_call(cell, args, num_layers, bidirectional, **kwargs):
  x, h_0, c_0, weights, lengths = args
  sizes = dict(input_size=x.shape[2], hidden_size=h_0.shape[2], num_layers=num_layers,
               bidirectional=bidirectional, **kwargs)
  if cell == "lstm":
    return jaxfuse.lstm(x, h_0, c_0, weights, lengths, **sizes)
  return (*jaxfuse.gru(x, h_0, weights, lengths, **sizes), None)


def _cuda_or_skip():
  from jaxfuse.ops.rnn import cuda as rnn_cuda
  reason = rnn_cuda.unavailable()
  if reason:
    pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", None])
@pytest.mark.parametrize("cell", CELLS)
def test_gpu_training_step_makes_no_host_transfer(rng, impl, cell):
  if impl == "cuda":
    _cuda_or_skip()
  args = gpu_make(rng, cell, 2, True, jnp.bfloat16)
  _run_without_host_transfers(_training_step(cell, 2, True, implementation=impl), args)


# float32 at HIGHEST runs three TF32 products a step, close to float32 FMA; the default, one.
GPU_TOLERANCE = {jnp.float32: 4, jnp.bfloat16: 4, jnp.float16: 4}


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", None])
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("num_layers,bidirectional", [(1, False), (1, True), (2, True),
                                                      (3, False)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_gpu_matches_numpy(rng, impl, cell, num_layers, bidirectional, dtype):
  _cuda_or_skip()
  args = gpu_make(rng, cell, num_layers, bidirectional, dtype)
  out = gpu_call(cell, args, num_layers, bidirectional, implementation=impl,
                 precision=jax.lax.Precision.HIGHEST)
  ref = numpy_rnn(cell, *args, num_layers, bidirectional)
  assert out[0].dtype == dtype
  past_end = np.arange(args[0].shape[1])[None, :] >= np.asarray(args[4])[:, None]
  assert np.all(np.asarray(out[0], np.float32)[past_end] == 0)
  factor = 10 if dtype == jnp.float32 else 4
  for a, e, name in zip(out, ref, ("y", "h_n", "c_n")):
    if e is not None:
      assert_close(a, e, dtype, factor=factor, name=name, floor=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", CELLS)
def test_gpu_tf32_default(rng, cell):
  _cuda_or_skip()
  args = gpu_make(rng, cell, 2, True, jnp.float32)
  out = gpu_call(cell, args, 2, True, implementation="cuda")
  ref = numpy_rnn(cell, *args, 2, True)
  for a, e, name in zip(out, ref, ("y", "h_n", "c_n")):
    if e is not None:  # TF32 keeps 10 bits of mantissa: a bfloat16-like bound
      assert_close(a, e, jnp.bfloat16, name=name, floor=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("cell,batch,hidden,bidirectional,dtype", [
    ("lstm", 70, 200, False, jnp.bfloat16),   # two batch chunks
    ("gru", 133, 64, True, jnp.float32),      # three batch chunks, both directions at once
    ("lstm", 16, 1024, True, jnp.float32),    # a direction at a time, K staged in chunks
    ("gru", 3, 1024, True, jnp.bfloat16),
    ("lstm", 1, 1, False, jnp.float32),
])
def test_gpu_large_layers(rng, cell, batch, hidden, bidirectional, dtype):
  _cuda_or_skip()
  args = gpu_make(rng, cell, 1, bidirectional, dtype, batch=batch, hidden_size=hidden,
                  input_size=24, time=9)
  out = gpu_call(cell, args, 1, bidirectional, implementation="cuda",
                 precision=jax.lax.Precision.HIGHEST)
  ref = numpy_rnn(cell, *args, 1, bidirectional)
  for a, e, name in zip(out, ref, ("y", "h_n", "c_n")):
    if e is not None:
      assert_close(a, e, dtype, factor=10 if dtype == jnp.float32 else 4, name=name, floor=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", CELLS)
def test_gpu_every_plan_agrees(rng, cell):
  """Every way of spreading a layer (batch groups, several chunks in a group, staging buffers
  cycled, warps over N, directions together or apart) gives the default plan's results."""
  _cuda_or_skip()
  from jaxfuse.ops.rnn import cuda as rnn_cuda
  batch, steps, hidden, directions, f32 = 40, 11, 96, 2, jnp.dtype(jnp.float32)
  gates = 4 if cell == "lstm" else 3
  sms, shared = rnn_cuda._device()
  state = (directions, batch, hidden)
  xp = random(rng, (batch, steps, directions, gates * hidden), f32)
  w_hh = random(rng, (directions, gates * hidden, hidden), f32, scale=hidden ** -0.5)
  b_hn, h0, c0 = (random(rng, s, f32, scale=0.5) for s in ((directions, hidden), state, state))
  lengths = rng.integers(0, steps + 1, batch)
  lengths[:2] = [0, steps]
  lengths = jnp.asarray(lengths, jnp.int32)
  dy = random(rng, (batch, steps, directions, hidden), f32)

  def plans(direction_pass):
    inner = hidden if direction_pass == "forward" else gates * hidden
    k_tiles = rnn_cuda.padded_inner(inner, f32) // 8
    fits = lambda p: rnn_cuda._shared_bytes(
        p.units * (gates if direction_pass == "forward" else 1), k_tiles, p.batch_chunk,
        p.chunk_words, p.stages, p.n_split) <= shared
    found = []
    for rows, budget, together, cycled in itertools.product(
        (16, 32, 48), (sms, sms // 4), ((True,), (False,)), (2, 4)):
      p = rnn_cuda._try_plan(gates, direction_pass, batch, hidden, directions, f32, budget,
                             shared, together, rows, cycled)
      if p is not None:
        found += [p, dataclasses.replace(p, batch_chunk=16), dataclasses.replace(p, n_split=1),
                  dataclasses.replace(p, chunk_words=min(p.chunk_words, 32), stages=2)]
    return [p for p in dict.fromkeys(found) if fits(p)]

  lstm = cell == "lstm"  # the GRU leaves c_n and the gradient of c_0 unwritten

  running = np.arange(steps)[None, :] < np.asarray(lengths)[:, None]

  def forward(p):
    y, h_n, c_n, *reserve = rnn_cuda.forward(cell, xp, w_hh, b_hn, h0, c0, lengths, exact=True,
                                             save=True, launch=p)
    # The reserve past a sequence's end is never read, and left unwritten.
    return [y, h_n, c_n if lstm else h_n, *(np.asarray(r)[running] for r in reserve)]

  def backward(p):
    dxp, dhn, dh0, dc0 = rnn_cuda.backward(cell, dy, h_n, c_n, saved_gates, saved_states, h0,
                                           c0, w_hh, lengths, exact=True, launch=p)
    return [dxp, dh0, dc0] if lstm else [dxp, dhn, dh0]

  y, h_n, c_n, saved_gates, saved_states = rnn_cuda.forward(
      cell, xp, w_hh, b_hn, h0, c0, lengths, exact=True, save=True)
  expected, expected_grads = forward(None), backward(None)
  forward_plans, backward_plans = plans("forward"), plans("backward")
  assert len(forward_plans) > 4 and len(backward_plans) > 4
  for p in forward_plans:
    for a, e in zip(forward(p), expected):
      np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5, err_msg=str(p))
  for p in backward_plans:
    for a, e in zip(backward(p), expected_grads):
      np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5, err_msg=str(p))


@pytest.mark.gpu
@pytest.mark.parametrize("cell", CELLS)
def test_gpu_dropout_matches_xla(rng, cell):
  """The same key draws the same inter-layer masks on every implementation."""
  _cuda_or_skip()
  args = gpu_make(rng, cell, 3, True, jnp.float32)
  kwargs = dict(dropout=0.3, dropout_key=jax.random.key(3),
                precision=jax.lax.Precision.HIGHEST)
  out = gpu_call(cell, args, 3, True, implementation="cuda", **kwargs)
  expected = gpu_call(cell, args, 3, True, implementation="xla", **kwargs)
  for a, e, name in zip(out, expected, ("y", "h_n", "c_n")):
    if e is not None:
      assert_close(a, np.asarray(e), jnp.float32, factor=10, name=name, floor=0.1)


def _loss(cell, num_layers, bidirectional, lengths, cotangents, impl, precision):
  def loss(x, h_0, c_0, weights):
    out = gpu_call(cell, (x, h_0, c_0, weights, lengths), num_layers, bidirectional,
                   implementation=impl, precision=precision)
    return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(out, cotangents)
               if o is not None)
  return loss


@pytest.mark.gpu
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("num_layers,bidirectional", [(1, False), (2, True)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_gradients(rng, cell, num_layers, bidirectional, dtype):
  """Gradients of every input against the XLA reference's in float64."""
  _cuda_or_skip()
  args = gpu_make(rng, cell, num_layers, bidirectional, dtype)
  _check_gradients(rng, cell, args, num_layers, bidirectional, "cuda", dtype)


def _check_gradients(rng, cell, args, num_layers, bidirectional, impl, dtype):
  """``impl``'s gradients of every input, at HIGHEST precision, against XLA's in float64."""
  directions = 2 if bidirectional else 1
  x, h_0, lengths = args[0], args[1], args[4]
  cotangents = [random(rng, (x.shape[0], x.shape[1], directions * h_0.shape[2]), jnp.float32),
                random(rng, h_0.shape, jnp.float32), random(rng, h_0.shape, jnp.float32)]
  argnums = (0, 1, 2, 3) if cell == "lstm" else (0, 1, 3)
  highest = jax.lax.Precision.HIGHEST
  grads = jax.grad(_loss(cell, num_layers, bidirectional, lengths, cotangents, impl, highest),
                   argnums)(*args[:4])
  with x64():
    wide = [jnp.asarray(np.asarray(a, np.float64)) for a in args[:4]]
    expected = jax.grad(_loss(cell, num_layers, bidirectional, jnp.asarray(np.asarray(lengths)),
                              cotangents, "xla", highest), argnums)(*wide)
  names = ("x", "h_0", "c_0", "weights") if cell == "lstm" else ("x", "h_0", "weights")
  for g, e, name in zip(grads, expected, names):
    assert g.dtype == dtype
    assert_close(g, np.asarray(e), dtype, factor=20 if dtype == jnp.float32 else 4, name=name,
                 floor=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", CELLS)
def test_gpu_deterministic(rng, cell):
  _cuda_or_skip()
  args = gpu_make(rng, cell, 2, True, jnp.bfloat16, batch=40, hidden_size=96)
  cotangents = [random(rng, (40, 29, 192), jnp.float32)] + [random(rng, (4, 40, 96),
                                                                   jnp.float32)] * 2
  step = jax.jit(jax.value_and_grad(_loss(cell, 2, True, args[4], cotangents, "cuda", None),
                                    (0, 1, 3)))
  first, again = step(*args[:4]), step(*args[:4])
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("cell", CELLS)
def test_gpu_vmap(rng, cell):
  """vmap over the batch-carrying inputs folds into the batch; over the weights, per example."""
  _cuda_or_skip()
  args = gpu_make(rng, cell, 2, True, jnp.float32)
  second = [a * 0.5 if a.dtype != jnp.int32 else a // 2 for a in args]
  kwargs = dict(implementation="cuda", precision=jax.lax.Precision.HIGHEST)
  for mapped in ((0, 1, 2, 4), (3,), (0, 1, 2, 3, 4)):
    stacked = [jnp.stack([a, b]) if k in mapped else a
               for k, (a, b) in enumerate(zip(args, second))]
    axes = [0 if k in mapped else None for k in range(5)]
    run = lambda *a: gpu_call(cell, a, 2, True, **kwargs)
    out = jax.vmap(run, in_axes=axes)(*stacked)
    alone = run(*(b if k in mapped else a for k, (a, b) in enumerate(zip(args, second))))
    for o, e in zip(out, alone):
      if e is not None:
        np.testing.assert_allclose(o[1], e, rtol=2e-5, atol=2e-5)
    grads = jax.vmap(jax.grad(lambda *a: jnp.sum(run(*a)[0] ** 2), 3), in_axes=axes)(*stacked)
    expected = jax.grad(lambda *a: jnp.sum(run(*a)[0] ** 2), 3)(
        *(b if k in mapped else a for k, (a, b) in enumerate(zip(args, second))))
    np.testing.assert_allclose(grads[1], expected, rtol=1e-4, atol=1e-5)


def _cudnn_or_skip():
  from jaxfuse.ops.rnn import cudnn as rnn_cudnn
  reason = rnn_cudnn.unavailable()
  if reason:
    pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("num_layers,bidirectional", [(1, False), (2, True)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("on_host", [True, False], ids=["host lengths", "device lengths"])
def test_gpu_cudnn_against_float64(rng, cell, num_layers, bidirectional, dtype, on_host):
  """cuDNN's outputs and gradients against float64, over ragged lengths with an empty
  sequence (on the host: one call; on the device: a call per layer and direction), on
  poisoned memory."""
  from jaxfuse._core.testing import poison_device_memory
  _cudnn_or_skip()
  args = gpu_make(rng, cell, num_layers, bidirectional, dtype, batch=7, hidden_size=40)
  lengths = np.asarray(args[4]) if on_host else args[4]
  args = args[:4] + (lengths,)
  highest = jax.lax.Precision.HIGHEST
  poison_device_memory(1 << 24)
  out = gpu_call(cell, args, num_layers, bidirectional, implementation="cudnn",
                 precision=highest)
  expected = numpy_rnn(cell, *args, num_layers, bidirectional)
  for a, e, name in zip(out, expected, ("y", "h_n", "c_n")):
    if e is not None:
      assert a.dtype == dtype
      assert_close(a, e, dtype, factor=10, name=name, floor=0.1)
  _check_gradients(rng, cell, args, num_layers, bidirectional, "cudnn", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("num_layers,bidirectional", [(1, False), (2, True)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_gpu_cudnn_persistent_small_hidden_against_float64(rng, cell, num_layers,
                                                           bidirectional, dtype):
  """Whole sequences of a small hidden size at the default precision, where cuDNN runs its
  persistent algorithm (evaluated and trained): outputs and gradients against float64, at a
  bound for TF32's 10 bits of mantissa in float32."""
  from jaxfuse.ops.rnn import cudnn as rnn_cudnn
  _cudnn_or_skip()
  args = gpu_make(rng, cell, num_layers, bidirectional, dtype, batch=24, hidden_size=40,
                  full=True)
  call = rnn_cudnn.Call(cell, 13, 40, num_layers, bidirectional, 24, 29, jnp.dtype(dtype),
                        False, (29,) * 24)
  if dtype == jnp.float32:
    assert rnn_cudnn.algorithm(call, False) == rnn_cudnn.algorithm(call, True) == 1, (
        "cuDNN refused its persistent algorithm: the test no longer reaches it")
  bound = jnp.bfloat16 if dtype == jnp.float32 else dtype
  whole = dict(num_layers=num_layers, bidirectional=bidirectional, implementation="cudnn")
  out = gpu_call(cell, args[:4] + (None,), **whole)
  expected = numpy_rnn(cell, *args, num_layers, bidirectional)
  for a, e, name in zip(out, expected, ("y", "h_n", "c_n")):
    if e is not None:
      assert_close(a, e, bound, factor=4, name=name, floor=0.1)
  directions = 2 if bidirectional else 1
  cotangents = [random(rng, (24, 29, directions * 40), jnp.float32),
                random(rng, args[1].shape, jnp.float32), random(rng, args[1].shape, jnp.float32)]
  argnums = (0, 1, 2, 3) if cell == "lstm" else (0, 1, 3)
  grads = jax.grad(_loss(cell, num_layers, bidirectional, None, cotangents, "cudnn", None),
                   argnums)(*args[:4])
  with x64():
    wide = [jnp.asarray(np.asarray(a, np.float64)) for a in args[:4]]
    reference = jax.grad(_loss(cell, num_layers, bidirectional, None, cotangents, "xla",
                               jax.lax.Precision.HIGHEST), argnums)(*wide)
  names = ("x", "h_0", "c_0", "weights") if cell == "lstm" else ("x", "h_0", "weights")
  for g, e, name in zip(grads, reference, names):
    assert_close(g, np.asarray(e), bound, factor=8, name=name, floor=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", CELLS)
def test_gpu_cudnn_deterministic(rng, cell):
  _cudnn_or_skip()
  args = gpu_make(rng, cell, 2, True, jnp.bfloat16, batch=40, hidden_size=96)
  lengths = np.asarray(args[4])
  cotangents = [random(rng, (40, 29, 192), jnp.float32)] + [random(rng, (4, 40, 96),
                                                                   jnp.float32)] * 2
  step = jax.jit(jax.value_and_grad(_loss(cell, 2, True, lengths, cotangents, "cudnn", None),
                                    (0, 1, 3)))
  first, again = step(*args[:4]), step(*args[:4])
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", ["none", "device"])
def test_gpu_cudnn_training_step_never_waits_for_the_host(rng, lengths):
  """Whole sequences without lengths, and ragged lengths on the device, in a jitted training
  step under jax.transfer_guard('disallow')."""
  _cudnn_or_skip()
  args = gpu_make(rng, "lstm", 2, True, jnp.float32, full=lengths == "none")

  def step(x, h_0, c_0, weights, seq_lengths):
    run = lambda x, weights: gpu_call("lstm", (x, h_0, c_0, weights, seq_lengths), 2, True,
                                      implementation="cudnn")
    out, vjp = jax.vjp(lambda x, w: run(x, w)[0], x, weights)
    return (out,) + vjp(jnp.ones_like(out))

  given = None if lengths == "none" else args[4]
  with jax.transfer_guard("disallow"):
    out = jax.jit(step)(*args[:4], given)
  expected = gpu_call("lstm", args, 2, True, implementation="xla")[0]
  np.testing.assert_allclose(out[0], expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("impl", ["cuda", "cudnn", None])
def test_gpu_matches_torch(rng, cell, impl):
  """PyTorch's RNN (float64 on the CPU) on weights converted from ours."""
  torch = pytest.importorskip("torch")
  args = gpu_make(rng, cell, 2, True, jnp.float32, full=True)
  x, h_0, c_0, weights, lengths = args
  if impl == "cudnn":
    args = args[:4] + (np.asarray(lengths),)
  sizes = (x.shape[2], h_0.shape[2], 2, True)
  to_torch = jaxfuse.lstm_weights_to_torch if cell == "lstm" else jaxfuse.gru_weights_to_torch
  module = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(
      *sizes[:3], batch_first=True, bidirectional=True).double()
  module.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float64))
                          for k, v in to_torch(weights, *sizes).items()})
  as_torch = lambda a: torch.from_numpy(np.asarray(a, np.float64))
  with torch.no_grad():
    if cell == "lstm":
      y, (h_n, c_n) = module(as_torch(x), (as_torch(h_0), as_torch(c_0)))
      expected = (y, h_n, c_n)
    else:
      y, h_n = module(as_torch(x), as_torch(h_0))
      expected = (y, h_n, None)
  out = gpu_call(cell, args, 2, True, implementation=impl, precision=jax.lax.Precision.HIGHEST)
  for a, e, name in zip(out, expected, ("y", "h_n", "c_n")):
    if e is not None:
      assert_close(a, e.numpy(), jnp.float32, factor=10, name=name, floor=0.1)


# --------------------------------------------------------------------------- the kernels' glue


def _stand_in_kernels(monkeypatch):
  """Replaces the CUDA calls by XLA functions of the same contract, so that the custom VJP, the
  vmap rules and the sharding around them run on the CPU."""
  from jaxfuse.ops.rnn import cuda as rnn_cuda

  def forward(cell, xp, w_hh, b_hn, h0, c0, lengths, *, exact, save, launch=None):
    hidden = w_hh.shape[2]
    y = jnp.tanh(xp[..., :hidden] + jnp.swapaxes(h0, 0, 1)[:, None]).astype(w_hh.dtype)
    reserve = (jnp.zeros(y.shape[:3] + (4 * hidden,)), jnp.zeros(y.shape, jnp.float32))
    return (y, h0 + b_hn[:, None], c0 * 2) + (reserve if save else ())

  def backward(cell, dy, dh_n, dc_n, gates, states, h0, c0, w_hh, lengths, *, exact,
               launch=None):
    gates_count = w_hh.shape[1] // w_hh.shape[2]
    dxp = jnp.concatenate([dy.astype(jnp.float32)] * gates_count, -1)
    return dxp, (dy.astype(jnp.float32) if cell == "gru" else None), dh_n, dc_n * 2

  monkeypatch.setattr(rnn_cuda, "unavailable", lambda: None)
  monkeypatch.setattr(rnn_cuda, "unsupported", lambda *args: None)
  monkeypatch.setattr(rnn_cuda, "forward", forward)
  monkeypatch.setattr(rnn_cuda, "backward", backward)


def _stand_in_cudnn(monkeypatch):
  """Replaces cuDNN's calls by the XLA reference under the same contract (the reserve sized
  by the binding from a size query that, as cuDNN's, is not linear in the batch), so that the
  custom VJP, empty sequences and sharding around them run on the CPU."""
  from jaxfuse.ops.rnn import cudnn as rnn_cudnn

  def run(call, x, h0, c0, w):
    sizes = dict(input_size=call.input_size, hidden_size=call.hidden_size,
                 num_layers=call.num_layers, bidirectional=call.bidirectional,
                 implementation="xla")
    # Whole sequences run shard by shard, where a function may hold no constant arrays.
    lengths = (jnp.full(call.batch, call.time, jnp.int32) if set(call.lengths) == {call.time}
               else jnp.asarray(call.lengths, jnp.int32))
    if call.cell == "lstm":
      return jaxfuse.lstm(x, h0, c0, w, lengths, **sizes)
    return (*jaxfuse.gru(x, h0, w, lengths, **sizes), None)

  def forward(call, x, h0, c0, w, *, training):
    rows = rnn_cudnn.reserve_row_bytes(call, training)
    return (*run(call, x, h0, c0, w), jnp.zeros((call.batch, rows), jnp.uint8))

  def backward(call, dy, dh_n, dc_n, x, h0, c0, w, y, reserve):
    if call.cell == "lstm":
      _, vjp = jax.vjp(lambda x, h0, c0, w: run(call, x, h0, c0, w), x, h0, c0, w)
      return vjp((dy, dh_n, dc_n))
    _, vjp = jax.vjp(lambda x, h0, w: run(call, x, h0, None, w)[:2], x, h0, w)
    dx, dh0, dw = vjp((dy, dh_n))
    return dx, dh0, None, dw

  monkeypatch.setattr(rnn_cudnn, "unavailable", lambda: None)
  monkeypatch.setattr(rnn_cudnn, "_sizes", lambda call, training, algo: (
      16, 8 * call.batch + 64 // call.batch))
  monkeypatch.setattr(rnn_cudnn, "algorithm", functools.cache(rnn_cudnn.algorithm.__wrapped__))
  monkeypatch.setattr(rnn_cudnn, "forward", forward)
  monkeypatch.setattr(rnn_cudnn, "backward", backward)


def test_cudnn_calls_take_time_major_data_and_one_algorithm_for_training(monkeypatch):
  """The binding's calls as cuDNN would see them (the size query and the FFI call faked): x,
  y, dy and dx time-major; cuDNN's persistent algorithm for whole sequences of small hidden
  sizes at the default math, the training forward's also the backward's, and the standard
  one where cuDNN refuses it, for ragged lengths and for FMA math."""
  from jaxfuse.ops.rnn import cudnn as rnn_cudnn
  refused, calls = set(), []

  def sizes(call, training, algo):
    if (call.hidden_size, algo) in refused:
      raise NotImplementedError("refused")
    return 16, 8 * call.batch

  def ffi_call(name, outputs, **options):
    def run(*args, **attributes):
      calls.append((name, [a.shape for a in args], outputs[0].shape, attributes["algo"]))
      return tuple(jnp.zeros(o.shape, o.dtype) for o in outputs)
    return run

  monkeypatch.setattr(rnn_cudnn, "_sizes", sizes)
  monkeypatch.setattr(jax.ffi, "ffi_call", ffi_call)
  rnn_cudnn.algorithm.cache_clear()
  try:
    def call(hidden, lengths=(5, 5), exact=False):
      return rnn_cudnn.Call("lstm", 3, hidden, 1, False, 2, 5, jnp.dtype(jnp.float32), exact,
                            lengths)

    whole = call(16)
    x, states = jnp.ones((2, 5, 3)), jnp.ones((1, 2, 16))
    w = jnp.ones((jaxfuse.lstm_weight_count(3, 16, 1, False),))
    y, h_n, c_n, reserve = rnn_cudnn.forward(whole, x, states, states, w, training=True)
    assert y.shape == (2, 5, 16) and reserve.shape == (2, 8)
    dx, *_ = rnn_cudnn.backward(whole, y, h_n, c_n, x, states, states, w, y, reserve)
    assert dx.shape == x.shape
    (_, forward_args, y_shape, forward_algo), (_, backward_args, dx_shape, backward_algo) = calls
    assert forward_args[0] == (5, 2, 3) and y_shape == (5, 2, 16)
    assert [backward_args[i] for i in (0, 3, 7)] == [(5, 2, 16), (5, 2, 3), (5, 2, 16)]
    assert dx_shape == (5, 2, 3) and forward_algo == backward_algo == 1
    # Evaluated calls take it to a larger hidden size than trained ones.
    assert [rnn_cudnn.algorithm(call(h), training) for h in (128, 160, 192, 200)
            for training in (False, True)] == [1, 1, 1, 0, 1, 0, 0, 0]
    assert rnn_cudnn.algorithm(call(16, lengths=(5, 3)), True) == 0
    assert rnn_cudnn.algorithm(call(16, exact=True), False) == 0
    refused.add((24, 1))
    assert rnn_cudnn.algorithm(call(24), False) == 0
  finally:
    rnn_cudnn.algorithm.cache_clear()


@pytest.mark.parametrize("cell", CELLS)
def test_cudnn_glue_keeps_empty_sequences_and_differentiates(rng, monkeypatch, cell):
  """cuDNN's paths (cuDNN stood in for on the CPU): ragged lengths with empty sequences, on the
  host or the device, give XLA's outputs and gradients."""
  _stand_in_cudnn(monkeypatch)
  x, h_0, c_0, weights, lengths = make(rng, cell, 2, True, batch=4)
  host = np.asarray(lengths)
  assert (host == 0).any()

  def loss(impl, lengths):
    # One program each (host lengths stay constants), not an op-by-op dispatch.
    def f(x, h_0, c_0, weights):
      out = call(cell, x, h_0, c_0, weights, lengths, 2, True, implementation=impl)
      return sum(jnp.sum(jnp.sin(o)) for o in out if o is not None)
    return jax.jit(jax.value_and_grad(f, (0, 1, 2, 3)))(x, h_0, c_0, weights)

  expected = jax.tree.leaves(loss("xla", lengths))
  # Lengths on the host: one call; on the device: a call per layer and direction over whole
  # sequences, the final states read (c recomputed) at each sequence's end.
  for lengths_given in (host, lengths):
    for a, e in zip(jax.tree.leaves(loss("cudnn", lengths_given)), expected):
      np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)
  whole = call(cell, x, h_0, c_0, weights, None, 2, True, implementation="cudnn")
  full = call(cell, x, h_0, c_0, weights, jnp.full(4, TIME), 2, True, implementation="xla")
  for a, e in zip(whole, full):
    if e is not None:
      np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6)
  # Dropout runs per layer too, with every implementation's masks.
  drop = dict(dropout=0.3, dropout_key=jax.random.key(1))
  dropped = call(cell, x, h_0, c_0, weights, host, 2, True, implementation="cudnn", **drop)
  for a, e in zip(dropped, call(cell, x, h_0, c_0, weights, lengths, 2, True,
                                implementation="xla", **drop)):
    if e is not None:
      np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "cuda", "cudnn", "cudnn per layer"])
# The LSTM (whose cell states the GRU lacks) under both kinds of mesh, the GRU under one.
@pytest.mark.parametrize("cell,explicit", [("lstm", False), ("lstm", True), ("gru", False)])
def test_batch_sharding_never_gathers(rng, monkeypatch, cell, impl, explicit):
  """The scan, and the kernels' calls (stood in for on the CPU), run shard by shard: on 8 CPU
  devices, or on every GPU of a machine with several (2, 4 or 8); under a mesh of automatic
  axes and one of explicit axes (jax.make_mesh's default since JAX 0.11)."""
  devices = min(8, jax.device_count())
  if devices < 2 or 16 % devices:
    pytest.skip("needs 2, 4 or 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  if impl == "cuda" and jax.default_backend() != "gpu":
    _stand_in_kernels(monkeypatch)
  if impl.startswith("cudnn") and jax.default_backend() != "gpu":
    _stand_in_cudnn(monkeypatch)
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  axis_type = AxisType.Explicit if explicit else AxisType.Auto
  mesh = jax.make_mesh((devices,), ("d",), devices=jax.devices()[:devices],
                       axis_types=(axis_type,))
  x, h_0, c_0, weights, _ = make(rng, cell, 2, True, batch=16)
  lengths = jnp.asarray(rng.integers(0, TIME + 1, 16), jnp.int32)
  if impl == "cudnn":  # the whole network in one call: whole sequences, which need no lengths
    lengths = jnp.full(16, TIME, jnp.int32)

  def step(x, h_0, c_0, weights, lengths):
    def loss(x, h_0, c_0, weights):
      out = call(cell, x, h_0, c_0, weights, None if impl == "cudnn" else lengths, 2, True,
                 implementation=impl.split()[0])
      return sum(jnp.sum(jnp.sin(o)) for o in out if o is not None)
    return jax.value_and_grad(loss, (0, 1, 2, 3))(x, h_0, c_0, weights)

  single = jax.jit(step)(x, h_0, c_0, weights, lengths)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = (put(x, P("d")), put(h_0, P(None, "d")), put(c_0, P(None, "d")), put(weights, P()),
          put(lengths, P("d")))
  compiled = jax.jit(step).lower(*args).compile()
  assert "all-gather" not in compiled.as_text()
  # A shard's kernels may be planned differently from the whole batch's: another order of
  # float32 sums (TF32 products on a GPU).
  tolerance = 1e-4 if jax.default_backend() == "gpu" else 1e-5
  for a, s in zip(jax.tree.leaves(compiled(*args)), jax.tree.leaves(single)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(s), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("cell", CELLS)
def test_kernel_path_vmap_folds_or_maps(rng, monkeypatch, cell):
  """vmap of the kernel path equals calls one example at a time, mapping the batch-carrying
  inputs (folded into the batch), the weights (one call each), or both."""
  _stand_in_kernels(monkeypatch)
  args = make(rng, cell, 2, True)
  second = [a * 0.5 if a.dtype != jnp.int32 else a // 2 for a in args]
  run = lambda *a: call(cell, *a, 2, True, implementation="cuda")
  loss = lambda *a: sum(jnp.sum(jnp.sin(o)) for o in run(*a) if o is not None)
  for mapped in ((0, 1, 2, 4), (3,), (0, 1, 2, 3, 4)):
    stacked = [jnp.stack([a, b]) if k in mapped else a
               for k, (a, b) in enumerate(zip(args, second))]
    axes = [0 if k in mapped else None for k in range(5)]
    alone_args = [b if k in mapped else a for k, (a, b) in enumerate(zip(args, second))]
    for o, e in zip(jax.jit(jax.vmap(run, in_axes=axes))(*stacked),
                    jax.jit(run)(*alone_args)):
      if e is not None:
        np.testing.assert_allclose(o[1], e, rtol=1e-6, atol=1e-6)
    grads = jax.jit(jax.vmap(jax.grad(loss, (0, 3)), in_axes=axes))(*stacked)
    for g, e in zip(grads, jax.jit(jax.grad(loss, (0, 3)))(*alone_args)):
      np.testing.assert_allclose(g[1], e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lengths", ["none", "device"])
def test_cudnn_path_under_vmap_and_checkpoint(rng, monkeypatch, lengths):
  """vmap of cuDNN's paths (stood in for on the CPU) equals calls one example at a time,
  mapping the batch-carrying inputs, the weights, or both; jax.checkpoint changes nothing."""
  _stand_in_cudnn(monkeypatch)
  args = list(make(rng, "lstm", 1, True))
  if lengths == "none":
    args[4] = None
  second = [None if a is None else a * 0.5 if a.dtype != jnp.int32 else a // 2 for a in args]
  run = lambda *a: call("lstm", *a, 1, True, implementation="cudnn")
  loss = lambda *a: sum(jnp.sum(jnp.sin(o)) for o in run(*a))
  for mapped in ((0, 1, 2), (3,)):
    mapped += (4,) if lengths == "device" else ()
    stacked = [jnp.stack([a, b]) if k in mapped else a
               for k, (a, b) in enumerate(zip(args, second))]
    axes = [0 if k in mapped else None for k in range(5)]
    alone_args = [b if k in mapped else a for k, (a, b) in enumerate(zip(args, second))]
    for o, e in zip(jax.jit(jax.vmap(run, in_axes=axes))(*stacked),
                    jax.jit(run)(*alone_args)):
      np.testing.assert_allclose(o[1], e, rtol=1e-6, atol=1e-6)
    grads = jax.jit(jax.vmap(jax.grad(loss, (0, 3)), in_axes=axes))(*stacked)
    for g, e in zip(grads, jax.jit(jax.grad(loss, (0, 3)))(*alone_args)):
      np.testing.assert_allclose(g[1], e, rtol=1e-5, atol=1e-6)
  plain = jax.jit(jax.grad(loss, (0, 3)))(*args)
  remat = jax.jit(jax.grad(jax.checkpoint(loss), (0, 3)))(*args)
  for a, b in zip(plain, remat):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_kernel_path_under_checkpoint(rng, monkeypatch):
  _stand_in_kernels(monkeypatch)
  args = make(rng, "lstm", 2, True)
  loss = lambda x, w: jnp.sum(jnp.sin(call("lstm", x, *args[1:3], w, args[4], 2, True,
                                           implementation="cuda")[0]))
  plain = jax.grad(loss, (0, 1))(args[0], args[3])
  remat = jax.grad(jax.checkpoint(loss), (0, 1))(args[0], args[3])
  for a, b in zip(plain, remat):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_the_grid_keeps_each_points_saved_activations_within_its_budget():
  from jaxfuse.ops.rnn import bench as rnn_bench
  assert rnn_bench.grid_steps("lstm", 4, 512, 1, False) == rnn_bench.GRID_STEPS
  for cell in ("lstm", "gru"):
    for b in rnn_bench.GRID_BATCHES:
      for h in rnn_bench.GRID_HIDDEN:
        for layers, bidirectional in rnn_bench.GRID_LAYOUTS:
          t = rnn_bench.grid_steps(cell, b, h, layers, bidirectional)
          saved = t * b * h * (rnn_bench.GATES[cell] + 2) * 4 * layers * (1 + bidirectional)
          assert t >= 16 and (saved <= rnn_bench.GRID_SAVED_BYTES or t == 16)


@pytest.mark.parametrize("cell", CELLS)
def test_the_bench_times_none_with_the_lengths_on_the_device(monkeypatch, cell):
  """The GPU bench's cases time None with device lengths beside the comparators; the grid,
  which weighs None against the comparators alone, does not."""
  from jaxfuse._core import registry
  from jaxfuse.ops.rnn import bench as rnn_bench
  with monkeypatch.context() as gpu:
    gpu.setattr(registry, "platform", lambda: "gpu")
    assert all(rnn_bench.DEVICE_LENGTHS in case.external for case in rnn_bench.cases())
    assert not any(rnn_bench.DEVICE_LENGTHS in case.external
                   for case in rnn_bench.grid_cases())
  inputs = rnn_bench._inputs(jax.random.key(0), cell, 3, TIME, INPUT, HIDDEN, 2, True,
                             jnp.float32)
  forward, train = rnn_bench._device_lengths_timer(cell, INPUT, HIDDEN, 2, True, inputs)
  assert forward.span_ms > 0 and train.span_ms > 0


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_packing_names_what_is_not_an_unpacked_layout(cell):
  init, unpack, pack = (getattr(jaxfuse, f"{name}_{cell}_weights")
                        for name in ("init", "unpack", "pack"))
  parts = unpack(init(jax.random.key(0), 4, 8, 1), 4, 8, 1)
  with pytest.raises(TypeError, match=f"pack_{cell}_weights: W_ih must map each pseudo-layer"):
    pack(*[list(p.values()) for p in parts])
  with pytest.raises(ValueError, match=r"b_hh\[0\] must be a vector"):
    pack(*parts[:3], {0: parts[3][0][None]})


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_to_torch_gives_writable_arrays_and_leaves_out_biases_on_request(cell):
  init, to_torch, from_torch = (getattr(jaxfuse, name.format(cell)) for name in (
      "init_{}_weights", "{}_weights_to_torch", "{}_weights_from_torch"))
  weights = init(jax.random.key(1), 4, 8, 2)
  state = to_torch(weights, 4, 8, 2)
  assert all(a.flags.writeable for a in state.values())
  assert any(key.startswith("bias_") for key in state)
  with pytest.raises(ValueError, match="bias=False, but the weights' biases are not all zero"):
    to_torch(weights, 4, 8, 2, bias=False)
  # A module without biases: its flat weights carry zero biases, and come back without them.
  no_bias = {k: v for k, v in state.items() if not k.startswith("bias_")}
  flat = from_torch(no_bias)
  back = to_torch(flat, 4, 8, 2, bias=False)
  assert sorted(back) == sorted(no_bias)
  assert all(np.array_equal(back[k], no_bias[k]) for k in back)


@pytest.mark.parametrize("cell", CELLS)
def test_inference_and_training_take_their_own_paths(rng, monkeypatch, cell):
  """A plan whose evaluated and differentiated implementations differ runs the first when only
  evaluated and the second's forward and backward (cuDNN's, stood in for on the CPU) when
  differentiated; both give XLA's outputs and gradients."""
  from jaxfuse._core.op import Plan
  from jaxfuse.ops.rnn import api as rnn_api
  from jaxfuse.ops.rnn import cudnn as rnn_cudnn
  _stand_in_cudnn(monkeypatch)
  ran = []
  for name in ("forward", "backward"):
    stand_in = getattr(rnn_cudnn, name)
    monkeypatch.setattr(rnn_cudnn, name, lambda *a, name=name, stand_in=stand_in, **k:
                        ran.append(name) or stand_in(*a, **k))
  x, h_0, c_0, weights, _ = make(rng, cell, 2, True, batch=4)
  state = (h_0, c_0) if cell == "lstm" else (h_0,)
  lengths = jnp.full(4, TIME, jnp.int32)
  network = rnn_api._Network(cell, INPUT, HIDDEN, 2, True, 0.0, None, (TIME,) * 4)
  by_use = lambda *a: rnn_api._by_use(network, Plan("xla", "cudnn", "cudnn"), *a, lengths, None)
  xla = lambda *a: rnn_api._path(network, "xla", *a, lengths, None)
  loss = lambda f: lambda *a: sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(f(*a)))
  for a, e in zip(jax.tree.leaves(by_use(x, state, weights)),
                  jax.tree.leaves(xla(x, state, weights))):
    np.testing.assert_array_equal(a, e)
  assert ran == []
  grads = jax.grad(loss(by_use), (0, 1, 2))(x, state, weights)
  assert ran == ["forward", "backward"]
  for a, e in zip(jax.tree.leaves(grads),
                  jax.tree.leaves(jax.grad(loss(xla), (0, 1, 2))(x, state, weights))):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
