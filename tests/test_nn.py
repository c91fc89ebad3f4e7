"""jaxfuse.nn's Flax NNX layers against flax's own and against jaxfuse's functional ops."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import jaxfuse  # noqa: E402
from jaxfuse import nn  # noqa: E402
from jaxfuse._core.testing import assert_close, random  # noqa: E402

NORMS = [(nn.RMSNorm, nnx.RMSNorm), (nn.LayerNorm, nnx.LayerNorm)]


def _pair(ours, theirs, features, **kwargs):
  return ours(features, rngs=nnx.Rngs(0), **kwargs), theirs(features, rngs=nnx.Rngs(0), **kwargs)


def _randomize(layer, rng):
  """Parameters away from their ones/zeros initial values."""
  for _, variable in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
    variable[...] = random(rng, variable.shape, variable.dtype, scale=0.5, offset=1.0)


@pytest.mark.parametrize("ours,theirs", NORMS, ids=["rms", "layer"])
@pytest.mark.parametrize("x_dtype,kwargs", [
    (jnp.float32, {}),
    (jnp.bfloat16, {}),
    (jnp.bfloat16, dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)),
    (jnp.float32, dict(dtype=jnp.bfloat16)),
    (jnp.float32, dict(use_scale=False, epsilon=1e-3)),
])
def test_norm_matches_flax(rng, ours, theirs, x_dtype, kwargs):
  mine, flax_layer = _pair(ours, theirs, 37, **kwargs)
  _randomize(flax_layer, rng)
  nnx.update(mine, nnx.state(flax_layer))
  x = random(rng, (3, 5, 37), x_dtype, scale=2.0, offset=0.5)
  out, expected = mine(x), flax_layer(x)
  assert out.dtype == expected.dtype and out.shape == expected.shape
  assert_close(out, np.asarray(expected, np.float64), factor=4)

  def grads(layer):
    def loss(layer, x):
      return jnp.sum(jnp.sin(layer(x).astype(jnp.float32)))
    return nnx.grad(loss, argnums=(0, 1))(layer, x)

  # The layer computes in its output's dtype (``dtype=``), whatever the inputs' dtypes.
  (mine_params, mine_x), (flax_params, flax_x) = grads(mine), grads(flax_layer)
  assert_close(mine_x, np.asarray(flax_x, np.float64), out.dtype, factor=8, name="dx")
  for a, e in zip(jax.tree.leaves(mine_params), jax.tree.leaves(flax_params)):
    assert_close(a, np.asarray(e, np.float64), out.dtype, factor=8, name="dparams", axis=0)


@pytest.mark.parametrize("ours,theirs", NORMS, ids=["rms", "layer"])
def test_norm_configurations_flax_handles_itself(rng, ours, theirs):
  x = random(rng, (4, 6, 8), jnp.float32)
  mine, flax_layer = _pair(ours, theirs, 8, reduction_axes=(1, 2))
  np.testing.assert_array_equal(mine(x), flax_layer(x))
  mine, flax_layer = _pair(ours, theirs, 8)
  mask = jnp.asarray(rng.random((4, 6, 8)) > 0.3)
  call = (lambda layer: layer(x, mask)) if ours is nn.RMSNorm else (
      lambda layer: layer(x, mask=mask))
  np.testing.assert_array_equal(call(mine), call(flax_layer))


@pytest.mark.parametrize("ours,theirs", NORMS, ids=["rms", "layer"])
def test_checkpoints_load_either_way(rng, ours, theirs):
  mine, flax_layer = _pair(ours, theirs, 16)
  _randomize(mine, rng)
  x = random(rng, (2, 16), jnp.float32)
  nnx.update(flax_layer, nnx.state(mine))
  np.testing.assert_allclose(flax_layer(x), mine(x), rtol=1e-5, atol=1e-6)
  assert jax.tree.structure(nnx.state(mine)) == jax.tree.structure(nnx.state(flax_layer))


@pytest.mark.parametrize("layer,op", [(nn.LSTM, jaxfuse.lstm), (nn.GRU, jaxfuse.gru)],
                         ids=["lstm", "gru"])
def test_recurrent_layers_are_the_functional_ops(rng, layer, op):
  model = layer(5, 7, num_layers=2, bidirectional=True, rngs=nnx.Rngs(1))
  x = random(rng, (3, 6, 5), jnp.float32)
  lengths = jnp.asarray([6, 2, 0], jnp.int32)
  states = 2 if layer is nn.LSTM else 1
  initial = [random(rng, (4, 3, 7), jnp.float32) for _ in range(states)]
  y, state = model(x, lengths, tuple(initial) if states == 2 else initial[0])
  sizes = dict(input_size=5, hidden_size=7, num_layers=2, bidirectional=True)
  expected = op(x, *initial, model.weights[...], lengths, **sizes)
  np.testing.assert_array_equal(y, expected[0])
  for a, e in zip(jax.tree.leaves(state), expected[1:]):
    np.testing.assert_array_equal(a, e)
  # Defaults: every sequence full length, zero initial state.
  zeros = [jnp.zeros((4, 3, 7))] * states
  np.testing.assert_array_equal(model(x)[0], op(x, *zeros, model.weights[...],
                                                jnp.full((3,), 6), **sizes)[0])

  def loss(model):
    return jnp.sum(model(x, lengths)[0] ** 2)

  grads = nnx.grad(loss)(model)
  expected_grad = jax.grad(lambda w: jnp.sum(op(x, *zeros, w, lengths, **sizes)[0] ** 2))(
      model.weights[...])
  np.testing.assert_allclose(grads.weights[...], expected_grad, rtol=1e-5, atol=1e-6)


def test_recurrent_dropout_follows_the_mode(rng):
  model = nn.LSTM(4, 6, num_layers=3, dropout=0.5, rngs=nnx.Rngs(0, dropout=1))
  x = random(rng, (2, 5, 4), jnp.float32)
  first, second = model(x)[0], model(x)[0]
  assert not np.array_equal(first, second)  # each call draws new masks
  model.eval()
  np.testing.assert_array_equal(model(x)[0], model(x)[0])
  np.testing.assert_array_equal(model(x)[0], model(x, deterministic=True)[0])
  model.train()
  keyed = lambda: model(x, rngs=nnx.Rngs(dropout=7))[0]
  np.testing.assert_array_equal(keyed(), keyed())


def test_jaxfuse_imports_without_flax():
  code = "import sys, jaxfuse; sys.exit('flax' in sys.modules)"
  assert subprocess.run([sys.executable, "-c", code]).returncode == 0
