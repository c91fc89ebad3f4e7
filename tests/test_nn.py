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
from jaxfuse._core.testing import assert_close, random, x64  # noqa: E402

NORMS = [(nn.RMSNorm, nnx.RMSNorm), (nn.LayerNorm, nnx.LayerNorm)]


# A GPU runs float32 matrix products in TF32 by default: 13 fewer mantissa bits than float32.
_FLOAT32_PRODUCTS = 2.0 ** 13 if jax.default_backend() == "gpu" else 1.0


def _factor(dtype, float32, other):
  """``assert_close``'s factor by the result's dtype: the float32 results here are a few
  roundings off their references, far inside its float32 tolerance, so they get their own
  (as many TF32 roundings on a GPU)."""
  return _float32(float32) if jnp.dtype(dtype) == jnp.float32 else other


def _float32(factor):
  return factor * _FLOAT32_PRODUCTS


def _pair(ours, theirs, features, **kwargs):
  return ours(features, rngs=nnx.Rngs(0), **kwargs), theirs(features, rngs=nnx.Rngs(0), **kwargs)


def _randomize(layer, rng, scale=0.5, offset=1.0):
  """Parameters away from their ones/zeros initial values."""
  for _, variable in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
    variable[...] = random(rng, variable.shape, variable.dtype, scale=scale, offset=offset)


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
  assert_close(out, np.asarray(expected, np.float64), factor=_factor(out.dtype, 0.1, 4))

  def grads(layer):
    def loss(layer, x):
      return jnp.sum(jnp.sin(layer(x).astype(jnp.float32)))
    return nnx.grad(loss, argnums=(0, 1))(layer, x)

  # The layer computes in its output's dtype (``dtype=``), whatever the inputs' dtypes.
  (mine_params, mine_x), (flax_params, flax_x) = grads(mine), grads(flax_layer)
  assert_close(mine_x, np.asarray(flax_x, np.float64), out.dtype,
               factor=_factor(out.dtype, 0.4, 8), name="dx")
  for a, e in zip(jax.tree.leaves(mine_params), jax.tree.leaves(flax_params)):
    assert_close(a, np.asarray(e, np.float64), out.dtype, factor=_factor(out.dtype, 0.1, 8),
                 name="dparams", axis=0)


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
  assert_close(flax_layer(x), np.asarray(mine(x), np.float64), factor=_float32(0.05))
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
  np.testing.assert_array_equal(grads.weights[...], expected_grad)


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


def _mha(rng, **kwargs):
  """flax's MultiHeadAttention (4 heads over 16 features) with small random parameters."""
  layer = nnx.MultiHeadAttention(4, 16, decode=False, rngs=nnx.Rngs(0), **kwargs)
  for _, variable in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
    variable[...] = random(rng, variable.shape, variable.dtype, scale=0.3)
  return layer


def _with_attention_fn(flax_layer, attention_fn, **kwargs):
  """A MultiHeadAttention with ``flax_layer``'s parameters (cast to ``param_dtype``)."""
  layer = nnx.MultiHeadAttention(4, 16, num_kv_heads=flax_layer.num_kv_heads, decode=False,
                                 attention_fn=attention_fn, rngs=nnx.Rngs(0), **kwargs)
  dtype = kwargs.get("param_dtype", jnp.float32)
  nnx.update(layer, jax.tree.map(lambda p: p.astype(dtype), nnx.state(flax_layer, nnx.Param)))
  return layer


@pytest.mark.parametrize("batch", [(2,), (2, 3)], ids=["batch", "two-batch-axes"])
@pytest.mark.parametrize("dtype,num_kv_heads", [(jnp.float32, None), (jnp.float32, 2),
                                                (jnp.bfloat16, 1)], ids=["f32", "gqa", "mqa-bf16"])
def test_dot_product_attention_in_multi_head_attention(rng, batch, dtype, num_kv_heads):
  flax_layer = _mha(rng, num_kv_heads=num_kv_heads)
  mine = _with_attention_fn(flax_layer, nn.dot_product_attention, dtype=dtype)
  x = random(rng, batch + (11, 16), jnp.float32)
  lengths = np.array([11, 6, 1])[np.arange(np.prod(batch)) % 3].reshape(batch + (1,))
  padding = np.arange(11) < lengths
  mask = nnx.combine_masks(nnx.make_causal_mask(x[..., 0]),
                           nnx.make_attention_mask(np.ones(batch + (11,), bool), padding))

  @nnx.jit  # one program per layer and mask, not an op-by-op dispatch
  def outputs_and_grads(layer, x, mask):
    def loss(layer, x):
      return jnp.sum(jnp.sin(layer(x, mask=mask).astype(jnp.float32)))
    return layer(x, mask=mask), nnx.grad(loss, argnums=(0, 1))(layer, x)

  with x64():
    reference = _with_attention_fn(flax_layer, nnx.dot_product_attention, dtype=jnp.float64,
                                   param_dtype=jnp.float64)
    expected = [outputs_and_grads(reference, x.astype(jnp.float64), m) for m in (mask, None)]
  for m, (expected_out, (expected_params, expected_x)) in zip((mask, None), expected):
    out, (params, dx) = outputs_and_grads(mine, x, m)
    assert out.dtype == dtype and out.shape == expected_out.shape
    assert_close(out, expected_out, factor=_factor(dtype, 0.2, 8))
    assert_close(dx, expected_x, dtype, factor=_factor(dtype, 1, 16), name="dx")
    for (path, a), (_, e) in zip(nnx.to_flat_state(params), nnx.to_flat_state(expected_params)):
      if path[:2] == ("key", "bias"):
        continue  # zero but for rounding: the key bias shifts a query's scores all alike
      # Rows of a few heads, summed over 2-6 x 11 bf16 products (flax's own reaches 0.21).
      assert_close(a[...], e[...], dtype, factor=_factor(dtype, 1, 32), name=str(path), axis=0)


def test_dot_product_attention_leaves_dropout_and_sown_weights_to_flax(rng):
  flax_layer = _mha(rng, dropout_rate=0.5)
  mine = _with_attention_fn(flax_layer, nn.dot_product_attention, dropout_rate=0.5)
  x = random(rng, (2, 7, 16), jnp.float32)
  call = lambda layer: layer(x, rngs=nnx.Rngs(dropout=3), deterministic=False)
  np.testing.assert_array_equal(call(mine), call(flax_layer))
  q = random(rng, (2, 7, 4, 4), jnp.float32)
  with pytest.raises(NotImplementedError, match="dropout"):
    nn.dot_product_attention(q, q, q, dropout_rate=0.1, dropout_rng=jax.random.key(0),
                             implementation="xla")
  with pytest.raises(NotImplementedError, match="sowing"):
    nn.dot_product_attention(q, q, q, module=mine, implementation="xla")


def _attention_f64(q, k, v, keep, soft_cap=None):
  """Attention of (B, T, N, H) q and (B, S, K, H) k, v in plain jnp (differentiable; float64
  under ``x64()``); keep: (B, T, S) booleans."""
  groups = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  if soft_cap is not None:
    scores = soft_cap * jnp.tanh(scores / soft_cap)
  scores = jnp.where(keep[:, None], scores, -jnp.inf)
  weights = jnp.exp(scores - scores.max(-1, keepdims=True))
  return jnp.einsum("bnts,bsnh->btnh", weights / weights.sum(-1, keepdims=True), v)


def _causal_self_attention_f64(params, x, keep, soft_cap):
  """CausalSelfAttention from its parameters (``params[projection][kernel or bias]``) in plain
  jnp, for float64 outputs and gradients under ``x64()``."""
  q, k, v = (jnp.einsum("btf,fnh->btnh", x, params[name]["kernel"]) + params[name]["bias"]
             for name in ("query", "key", "value"))
  heads = _attention_f64(q, k, v, keep, soft_cap)
  return jnp.einsum("btnh,nhf->btf", heads, params["out"]["kernel"]) + params["out"]["bias"]


@pytest.mark.parametrize("options", [
    {}, dict(num_kv_heads=2), dict(local_window_size=3), dict(logits_soft_cap=0.7),
    dict(segments=True, num_kv_heads=1), dict(lengths=True), dict(qkv_features=24),
], ids=["causal", "gqa", "window", "soft-cap", "segments-mqa", "lengths", "head-dim-6"])
def test_causal_self_attention(rng, options):
  """Outputs and the gradients of the inputs and every parameter against float64."""
  options = dict(options)
  segments, lengths = options.pop("segments", False), options.pop("lengths", False)
  layer = nn.CausalSelfAttention(4, 16, rngs=nnx.Rngs(0), **options)
  # Small parameters keep the softmax from saturating, where the gradients would be tiny
  # differences of large terms.
  _randomize(layer, rng, scale=0.3, offset=0.0)
  x = random(rng, (3, 13, 16), jnp.float32, scale=0.5)
  i, j = np.arange(13)[:, None], np.arange(13)
  keep = np.broadcast_to(j <= i, (3, 13, 13))
  kwargs = {}
  if "local_window_size" in options:
    keep = keep & (j >= i - options["local_window_size"])
  if segments:
    ids = np.sort(rng.integers(0, 4, (3, 13)), axis=1)
    keep = keep & (ids[:, :, None] == ids[:, None, :])
    kwargs["segment_ids"] = jnp.asarray(ids, jnp.int32)
  if lengths:
    seq = np.array([13, 5, 1])
    keep = keep & (j < seq[:, None, None])
    kwargs["seq_lengths"] = jnp.asarray(seq, jnp.int32)

  @nnx.jit  # one program, not an op-by-op dispatch
  def outputs_and_grads(layer, x):
    loss = lambda layer, x: jnp.sum(jnp.sin(layer(x, **kwargs)))
    return layer(x, **kwargs), nnx.grad(loss, argnums=(0, 1))(layer, x)

  out, (params, dx) = outputs_and_grads(layer, x)
  soft_cap = options.get("logits_soft_cap")
  with x64():
    wide = {name: {kind: jnp.asarray(np.asarray(getattr(getattr(layer, name), kind)[...]),
                                     jnp.float64) for kind in ("kernel", "bias")}
            for name in ("query", "key", "value", "out")}
    wide_x = jnp.asarray(np.asarray(x), jnp.float64)
    reference = lambda p, x: _causal_self_attention_f64(p, x, keep, soft_cap)
    expected = np.asarray(jax.jit(reference)(wide, wide_x))
    expected_params, expected_x = jax.jit(jax.grad(
        lambda p, x: jnp.sum(jnp.sin(reference(p, x))), argnums=(0, 1)))(wide, wide_x)
  assert_close(out, expected, factor=_float32(0.1))
  assert_close(dx, np.asarray(expected_x), factor=_float32(0.2), name="dx")
  for (name, kind), grad in nnx.to_flat_state(params):
    if (name, kind) == ("key", "bias") and soft_cap is None:
      continue  # zero but for rounding: the key bias shifts a query's scores all alike
    assert_close(grad[...], np.asarray(expected_params[name][kind]), factor=_float32(0.5),
                 name=f"{name}.{kind}", axis=0)


def test_causal_self_attention_shares_multi_head_attention_checkpoints(rng):
  mha = nnx.MultiHeadAttention(4, 16, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0))
  _randomize(mha, rng)
  layer = nn.CausalSelfAttention(4, 16, num_kv_heads=2, rngs=nnx.Rngs(1))
  nnx.update(layer, nnx.state(mha, nnx.Param))
  x = random(rng, (2, 9, 16), jnp.float32)
  expected = mha(x, mask=nnx.make_causal_mask(x[..., 0]))
  assert_close(layer(x), np.asarray(expected, np.float64), factor=_float32(0.05))
  nnx.update(mha, nnx.state(layer, nnx.Param))
  assert (jax.tree.structure(nnx.state(layer, nnx.Param))
          == jax.tree.structure(nnx.state(mha, nnx.Param)))


def test_causal_self_attention_rejects_bad_heads():
  with pytest.raises(ValueError, match="num_kv_heads"):
    nn.CausalSelfAttention(4, 16, num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_heads"):
    nn.CausalSelfAttention(5, 16, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="in_features"):
    nn.CausalSelfAttention(4, 16, rngs=nnx.Rngs(0))(jnp.ones((2, 3, 8)))


def test_cross_entropy_loss_is_optax(rng):
  optax = pytest.importorskip("optax")

  def each_loss_close(actual, expected):
    # Each loss its own row: a wrong small loss cannot hide beside larger ones.
    assert_close(jnp.reshape(actual, (-1, 1)), np.reshape(expected, (-1, 1)), factor=_float32(0.05))

  logits = random(rng, (4, 5, 37), jnp.float32, scale=3.0)
  labels = jnp.asarray(rng.integers(0, 37, (4, 5)), jnp.int32)
  where = jnp.asarray(rng.random((4, 5)) > 0.3)
  expected = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  each_loss_close(nn.cross_entropy_loss(logits, labels, reduction="none"), expected)
  masked = nn.cross_entropy_loss(logits, labels, where=where)
  each_loss_close(masked, jnp.sum(jnp.where(where, expected, 0)) / jnp.sum(where))
  targets = jax.nn.softmax(random(rng, (4, 5, 37), jnp.float32))
  expected = optax.softmax_cross_entropy(logits, targets)
  each_loss_close(nn.cross_entropy_loss(logits, targets, reduction="none"), expected)
  loss = lambda f: lambda logits: jnp.sum(jnp.where(where, f(logits), 0))
  assert_close(jax.grad(loss(lambda z: nn.cross_entropy_loss(z, targets, reduction="none")))(
      logits), jax.grad(loss(lambda z: optax.softmax_cross_entropy(z, targets)))(logits),
      factor=_float32(0.05))
  smoothed = 0.9 * targets + 0.1 / 37
  each_loss_close(nn.cross_entropy_loss(logits, targets, label_smoothing=0.1, where=where),
                  jnp.sum(jnp.where(where, optax.softmax_cross_entropy(logits, smoothed), 0))
                  / jnp.sum(where))
  onehot = jax.nn.one_hot(labels, 37)
  each_loss_close(nn.cross_entropy_loss(logits, onehot, z_loss=0.01, reduction="sum"),
                  nn.cross_entropy_loss(logits, labels, z_loss=0.01, reduction="sum"))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int16])
@pytest.mark.parametrize("ignore_index", [None, -100])
def test_cross_entropy_loss_masks_rows_of_narrow_labels(rng, dtype, ignore_index):
  # A masked row takes ignore_index (or int32's least) as its label, which wraps in a narrow
  # dtype: it must stay out of the loss and the count all the same.
  logits = random(rng, (4, 5), jnp.float32)
  labels = np.asarray(rng.integers(0, 5, (4,)), np.int32)
  where = jnp.asarray([True, False, True, True])
  loss = lambda kind, reduction: nn.cross_entropy_loss(
      logits, jnp.asarray(labels, kind), where=where, ignore_index=ignore_index,
      reduction=reduction)
  for reduction in ("none", "mean"):
    assert np.array_equal(np.asarray(loss(dtype, reduction)), np.asarray(loss(jnp.int32, reduction)))


def test_cross_entropy_loss_rejects_bad_inputs():
  logits = jnp.ones((4, 5))
  with pytest.raises(ValueError, match="where"):
    nn.cross_entropy_loss(logits, jnp.zeros((4,), jnp.int32), where=jnp.ones((5,), bool))
  with pytest.raises(ValueError, match="ignore_index"):
    nn.cross_entropy_loss(logits, jnp.ones((4, 5)) / 5, ignore_index=0)
  with pytest.raises(ValueError, match="labels"):
    nn.cross_entropy_loss(logits, jnp.ones((4, 3)) / 3)
  with pytest.raises(ValueError, match="label_smoothing"):
    nn.cross_entropy_loss(logits, jnp.ones((4, 5)) / 5, label_smoothing=1.5)


def test_jaxfuse_imports_without_flax():
  code = "import sys, jaxfuse; sys.exit('flax' in sys.modules)"
  assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("cell", ["OptimizedLSTMCell", "LSTMCell", "GRUCell"])
def test_weights_from_flax_compute_flaxs_function(rng, cell):
  layers = [nnx.RNN(getattr(nnx, cell)(n, 16, rngs=nnx.Rngs(i)), rngs=nnx.Rngs(i))
            for i, n in enumerate((8, 16))]
  # flax starts its biases at zero: nonzero ones check where the bias goes.
  for layer in layers:
    for path, param in nnx.iter_graph(layer):
      if isinstance(param, nnx.Param) and path[-1] == "bias":
        param[...] = random(rng, param[...].shape, jnp.float32)
  x = random(rng, (3, 7, 8), jnp.float32)
  want = x
  for layer in layers:
    want = layer(want)
  zeros = jnp.zeros((2, 3, 16))
  kw = dict(input_size=8, hidden_size=16, num_layers=2, dropout=0.0, precision="highest",
            implementation="xla")
  lengths = jnp.full((3,), 7, jnp.int32)
  if cell == "GRUCell":
    got, _ = jaxfuse.gru(x, zeros, nn.gru_weights_from_flax(layers), lengths, **kw)
  else:
    got, _, _ = jaxfuse.lstm(x, zeros, zeros, nn.lstm_weights_from_flax(layers), lengths, **kw)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
