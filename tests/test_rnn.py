"""lstm and gru against a float64 NumPy reference written here, step by step in Python loops."""

import jax
import jax.numpy as jnp
import jax.test_util  # noqa: F401  (check_grads)
import numpy as np
import pytest

import jaxfuse
from jaxfuse._core.testing import assert_close, random, x64

CELLS = ["lstm", "gru"]
INPUT, HIDDEN, TIME = 5, 6, 7


def _sigmoid(v):
  return 1 / (1 + np.exp(-v))


def numpy_rnn(cell, x, h_0, c_0, weights, lengths, num_layers, bidirectional):
  """float64 ``(y, h_n, c_n)`` (``c_n`` None for the GRU), one sequence and step at a time."""
  x, h_0, weights = (np.asarray(a, np.float64) for a in (x, h_0, weights))
  c_0 = np.asarray(c_0, np.float64) if cell == "lstm" else None
  unpack = jaxfuse.unpack_lstm_weights if cell == "lstm" else jaxfuse.unpack_gru_weights
  W_ih, W_hh, b_ih, b_hh = (
      {p: np.asarray(a, np.float64) for p, a in d.items()}
      for d in unpack(jnp.asarray(weights), x.shape[2], h_0.shape[2], num_layers, bidirectional))
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


def test_matches_jax_experimental_rnn(rng):
  """jax.experimental.rnn has an LSTM only."""
  rnn = pytest.importorskip("jax.experimental.rnn")
  x, h_0, c_0, weights, lengths = make(rng, "lstm", 2, True, lengths=[TIME, 4, 1])
  unpacked = jaxfuse.unpack_lstm_weights(weights, INPUT, HIDDEN, 2, True)
  expected = rnn.lstm_ref(x, h_0, c_0, *unpacked, lengths, INPUT, HIDDEN, 2, 0.0, True)
  actual = call("lstm", x, h_0, c_0, weights, lengths, 2, True)
  for a, e, name in zip(actual, expected, ("y", "h_n", "c_n")):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5, err_msg=name)


def test_implementations(rng):
  args = make(rng, "gru", 1, False)
  default = call("gru", *args, 1, False)
  named = call("gru", *args, 1, False, implementation="xla")
  np.testing.assert_array_equal(default[0], named[0])
  for name in ("triton", "cuda", "cudnn"):
    with pytest.raises(NotImplementedError, match=f"gru has no '{name}' implementation"):
      call("gru", *args, 1, False, implementation=name)


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
