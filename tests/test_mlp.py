"""``gelu_mlp`` and ``jaxfuse.nn.GeluMLP``: the plain composition's values and gradients, with
the activation recomputed in the backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxfuse
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxfuse._core.testing import assert_close, random, x64

SHAPES = [(2, 5, 8), (8, 32), (32,), (32, 7), (7,)]


def plain(x, w1, b1, w2, b2, approximate=True):
  return jax.nn.gelu(x @ w1 + b1, approximate=approximate) @ w2 + b2


@pytest.mark.parametrize("approximate", [True, False])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_values_and_gradients_match_the_plain_composition(rng, dtype, approximate):
  with x64():
    args = [random(rng, s, jnp.float64, scale=0.5) for s in SHAPES]
    dy = random(rng, (2, 5, 7), jnp.float64)
    want, plain_vjp = jax.vjp(lambda *a: plain(*a, approximate), *args)
    want_grads = plain_vjp(dy)
    cast = [a.astype(dtype) for a in args]
    fused = lambda *a: jaxfuse.gelu_mlp(*a, approximate=approximate)
    got, vjp = jax.vjp(fused, *cast)
    grads = jax.jit(vjp)(dy.astype(dtype))
    assert got.dtype == jnp.dtype(dtype) and got.shape == want.shape
    assert_close(got, want, factor=4, name="y")
    for g, e, a, name in zip(grads, want_grads, cast, ("dx", "dw1", "db1", "dw2", "db2")):
      assert g.dtype == a.dtype and g.shape == a.shape
      assert_close(g, e, factor=8, name=name, axis=0 if name.startswith("db") else -1)
    if dtype == "float64":
      check_grads(fused, cast, order=1, modes=["rev"])


def test_mixed_dtypes_promote_and_each_gradient_keeps_its_operands_dtype(rng):
  args = [random(rng, s, jnp.bfloat16 if i == 0 else jnp.float32) for i, s in enumerate(SHAPES)]
  out = jaxfuse.gelu_mlp(*args)
  assert out.dtype == jnp.float32
  grads = jax.grad(lambda *a: jnp.sum(jaxfuse.gelu_mlp(*a)), argnums=tuple(range(5)))(*args)
  assert [g.dtype for g in grads] == [a.dtype for a in args]
  # jit and vmap over a leading axis compose with the custom backward.
  batched = jax.jit(jax.vmap(lambda x: jaxfuse.gelu_mlp(x, *args[1:])))(args[0])
  np.testing.assert_allclose(batched, out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_a_batch_sharded_step_never_gathers(rng, axis_type):
  """Rows sharded over two devices: the weight gradients' products over the rows are summed
  across them (with an explicit mesh too, where JAX asks those products for their output's
  sharding), and each gradient is sharded as its operand."""
  if len(jax.devices()) < 2:
    pytest.skip("needs two devices")
  args = [random(rng, s, jnp.float32, scale=0.5) for s in [(4, 6, 8)] + SHAPES[1:]]
  step = jax.jit(jax.grad(lambda *a: jnp.sum(jaxfuse.gelu_mlp(*a) ** 2), tuple(range(5))))
  single = step(*args)
  mesh = jax.make_mesh((2,), ("batch",), axis_types=(axis_type,))
  placed = [jax.device_put(a, NamedSharding(mesh, P("batch") if i == 0 else P()))
            for i, a in enumerate(args)]
  compiled = step.lower(*placed).compile()
  assert "all-gather" not in compiled.as_text()
  grads = compiled(*placed)
  assert grads[0].sharding.spec[:1] == ("batch",)
  for g, e in zip(grads, single):
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,error,match", [
    (dict(w1=(9, 32)), ValueError, "w1"),
    (dict(w2=(31, 7)), ValueError, "w2"),
    (dict(b1=(31,)), ValueError, "b1"),
    (dict(b2=(7, 1)), ValueError, "b2"),
    (dict(x_dtype=jnp.int32), TypeError, "x"),
    (dict(approximate=1), TypeError, "approximate"),
    (dict(implementation="cuda"), NotImplementedError, "gelu_mlp has no 'cuda'"),
    (dict(implementation="nope"), ValueError, "implementation"),
], ids=str)
def test_bad_inputs_are_named(change, error, match):
  change = dict(change)
  shapes = dict(zip(("x", "w1", "b1", "w2", "b2"), SHAPES))
  shapes.update({k: v for k, v in change.items() if k in shapes})
  arrays = {k: jnp.ones(s, change.pop("x_dtype", jnp.float32) if k == "x" else jnp.float32)
            for k, s in shapes.items()}
  options = {k: v for k, v in change.items() if k not in shapes}
  with pytest.raises(error, match=match):
    jaxfuse.gelu_mlp(*arrays.values(), **options)


def test_the_layer_is_flaxs_two_linears(rng):
  nnx = pytest.importorskip("flax.nnx")
  from jaxfuse import nn

  class FlaxMLP(nnx.Module):
    def __init__(self, rngs):
      self.fc = nnx.Linear(8, 32, rngs=rngs)
      self.proj = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
      return self.proj(jax.nn.gelu(self.fc(x)))

  ours, theirs = nn.GeluMLP(8, 32, rngs=nnx.Rngs(3)), FlaxMLP(nnx.Rngs(3))
  # The same parameters under the same names: a checkpoint of one loads into the other.
  assert jax.tree.map(np.shape, nnx.state(ours, nnx.Param)) == jax.tree.map(
      np.shape, nnx.state(theirs, nnx.Param))
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  x = random(rng, (3, 4, 8), jnp.float32)
  np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-6)
  grad = lambda model: nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
  for a, b in zip(jax.tree.leaves(grad(ours)), jax.tree.leaves(grad(theirs))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
