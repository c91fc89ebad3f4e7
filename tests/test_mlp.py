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


def assert_matches_float64(fused, reference, args, dy, dtype, factor, by_columns=()):
  """``fused`` at float64 ``args`` cast to ``dtype``: its output (within ``factor``) and every
  gradient for ``dy`` (within twice that) against ``reference``'s in float64, by the worst
  row; the gradients named in ``by_columns`` (and the biases') by the worst column. Returns
  ``fused``'s cast arguments."""
  want, reference_vjp = jax.vjp(reference, *args)
  want_grads = reference_vjp(dy)
  cast = [a.astype(dtype) for a in args]
  got, vjp = jax.vjp(fused, *cast)
  grads = jax.jit(vjp)(dy.astype(dtype))
  assert got.dtype == jnp.dtype(dtype) and got.shape == want.shape
  assert_close(got, want, factor=factor, name="y")
  for g, e, a, name in zip(grads, want_grads, cast, ("dx", "dw1", "db1", "dw2", "db2")):
    assert g.dtype == a.dtype and g.shape == a.shape
    column = name.startswith("db") or name in by_columns
    assert_close(g, e, factor=2 * factor, name=name, axis=0 if column else -1)
  return cast


@pytest.mark.parametrize("approximate", [True, False])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_values_and_gradients_match_the_plain_composition(rng, dtype, approximate):
  with x64():
    args = [random(rng, s, jnp.float64, scale=0.5) for s in SHAPES]
    dy = random(rng, (2, 5, 7), jnp.float64)
    fused = lambda *a: jaxfuse.gelu_mlp(*a, approximate=approximate)
    cast = assert_matches_float64(fused, lambda *a: plain(*a, approximate), args, dy, dtype,
                                  factor=4)
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


@pytest.mark.parametrize("implementation", ["xla", "cuda"])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_a_tensor_parallel_step_never_gathers(rng, monkeypatch, axis_type, implementation):
  """Rows over one mesh axis, the hidden features over another (w1's columns, b1, w2's rows):
  no operand or gradient is gathered, each gradient is sharded as its operand, and the values
  are a single device's. 'cuda' runs with XLA stand-ins for its two kernels."""
  if len(jax.devices()) < 4:
    pytest.skip("needs four devices")
  if implementation == "cuda":
    _cuda_with_stand_ins(monkeypatch)
  dtype = jnp.float32 if implementation == "xla" else jnp.bfloat16
  args = [random(rng, s, dtype, scale=0.5) for s in [(4, 6, 8), (8, 16), (16,), (16, 8), (8,)]]
  loss = lambda *a: jnp.sum(jaxfuse.gelu_mlp(*a, implementation=implementation)
                            .astype(jnp.float32) ** 2)
  step = jax.jit(jax.grad(loss, tuple(range(5))))
  single = step(*args)
  mesh = jax.make_mesh((2, 2), ("batch", "model"), axis_types=(axis_type,) * 2)
  specs = [P("batch"), P(None, "model"), P("model"), P("model", None), P()]
  placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  compiled = step.lower(*placed).compile()
  assert "all-gather" not in compiled.as_text()
  whole = lambda spec, ndim: tuple(spec) + (None,) * (ndim - len(spec))
  for g, e, spec in zip(compiled(*placed), single, specs):
    assert whole(g.sharding.spec, g.ndim) == whole(spec, g.ndim)
    assert_close(g, e.astype(jnp.float32), jnp.float32 if dtype == jnp.float32 else dtype,
                 factor=4, axis=0 if g.ndim == 1 else -1)


@pytest.mark.parametrize("change,error,match", [
    (dict(w1=(9, 32)), ValueError, "w1"),
    (dict(w2=(31, 7)), ValueError, "w2"),
    (dict(b1=(31,)), ValueError, "b1"),
    (dict(b2=(7, 1)), ValueError, "b2"),
    (dict(x_dtype=jnp.int32), TypeError, "x"),
    (dict(approximate=1), TypeError, "approximate"),
    (dict(implementation="mosaic"), NotImplementedError, "gelu_mlp has no 'mosaic'"),
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


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU's refusal")
def test_cuda_is_refused_by_name_without_a_gpu():
  arrays = [jnp.ones(s, jnp.bfloat16) for s in SHAPES]
  with pytest.raises(NotImplementedError, match="implementation='cuda'.*cannot run here"):
    jaxfuse.gelu_mlp(*arrays, implementation="cuda")


# (leading axes of x, model width, hidden width): odd row counts, widths that are multiples of
# 8 (16-byte rows, cuBLASLt's epilogues need them), GPT-2's MLP.
CUDA_SHAPES = [((1,), 64, 256), ((3, 7), 72, 200), ((1000,), 128, 512), ((4097,), 768, 3072)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("lead,width,hidden", CUDA_SHAPES, ids=str)
def test_gpu_cuda_epilogues_match_float64(rng, dtype, lead, width, hidden):
  """The GELU in cuBLASLt's epilogues: the output and every gradient against float64 by the
  worst row, through the two epilogue calls."""
  shapes = [(*lead, width), (width, hidden), (hidden,), (hidden, width), (width,)]
  scales = [1.0, width ** -0.5, 0.5, hidden ** -0.5, 0.5]
  with x64():
    args = [random(rng, s, jnp.float64, scale=c) for s, c in zip(shapes, scales)]
    dy = random(rng, (*lead, width), jnp.float64)
    fused = lambda *a: jaxfuse.gelu_mlp(*a, implementation="cuda")
    # dw2's row f is one activation times dy where there is one row: a relative error over
    # the hidden features (its columns) is what the pre-activation's rounding bounds.
    cast = assert_matches_float64(fused, plain, args, dy, dtype, factor=8, by_columns=("dw2",))
  lowered = jax.jit(jax.grad(lambda *a: jnp.sum(fused(*a).astype(jnp.float32)),
                             tuple(range(5)))).lower(*cast).as_text()
  assert "jaxfuse_gelu_gemm_forward" in lowered and "jaxfuse_gelu_gemm_backward" in lowered


@pytest.mark.gpu
@pytest.mark.parametrize("change,match", [
    (dict(approximate=False), "tanh approximation"),
    (dict(dtype=jnp.float32), "float16 and bfloat16"),
    (dict(hidden=36), "multiples of 8"),
    (dict(hidden=0), "positive multiples of 8"),
], ids=str)
def test_gpu_cuda_refusals_are_named_and_none_passes_over_them(rng, change, match):
  hidden, dtype = change.get("hidden", 64), change.get("dtype", jnp.bfloat16)
  arrays = [random(rng, s, dtype, scale=0.5)
            for s in [(4, 32), (32, hidden), (hidden,), (hidden, 32), (32,)]]
  approximate = change.get("approximate", True)
  with pytest.raises(NotImplementedError, match=match):
    jaxfuse.gelu_mlp(*arrays, approximate=approximate, implementation="cuda")
  np.testing.assert_array_equal(
      jaxfuse.gelu_mlp(*arrays, approximate=approximate),
      jaxfuse.gelu_mlp(*arrays, approximate=approximate, implementation="xla"))


@pytest.mark.gpu
def test_gpu_cuda_composes_with_jit_vmap_and_empty_rows(rng):
  args = [random(rng, s, jnp.bfloat16, scale=0.5)
          for s in [(3, 5, 64), (64, 128), (128,), (128, 64), (64,)]]
  fused = lambda x: jaxfuse.gelu_mlp(x, *args[1:], implementation="cuda")
  # One call a mapped example: cuBLASLt may choose another algorithm for fewer rows.
  np.testing.assert_allclose(jax.jit(jax.vmap(fused))(args[0]).astype(np.float32),
                             fused(args[0]).astype(np.float32), rtol=2e-2, atol=2e-2)
  assert fused(args[0][:, :0]).shape == (3, 0, 64)


def _stand_in_forward(x, w1, b1, training):
  pre = (jnp.dot(x, w1, preferred_element_type=jnp.float32) + b1).astype(x.dtype)
  activation = jax.nn.gelu(pre.astype(jnp.float32), approximate=True).astype(x.dtype)
  return (activation, pre) if training else (activation,)


def _stand_in_backward(dy, w2, pre):
  da = jnp.dot(dy, w2.T, preferred_element_type=jnp.float32)
  _, gelu_vjp = jax.vjp(lambda h: jax.nn.gelu(h, approximate=True), pre.astype(jnp.float32))
  (dh,) = gelu_vjp(da)
  return (dh.astype(dy.dtype),)


def _cuda_with_stand_ins(monkeypatch):
  """'cuda' available here, its two cuBLASLt calls replaced by XLA with the same contracts."""
  from jaxfuse.ops.mlp import api, cuda
  monkeypatch.setattr(api, "_BACKENDS", dict(api._BACKENDS, cuda=lambda: None))
  monkeypatch.setattr(cuda, "_forward", _stand_in_forward)
  monkeypatch.setattr(cuda, "_backward", _stand_in_backward)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_the_cuda_path_around_its_kernels_matches_the_plain_composition(rng, monkeypatch,
                                                                        axis_type):
  """The 'cuda' implementation's VJP, sharding and batching with XLA stand-ins for the two
  cuBLASLt calls (same contracts): values and gradients as the plain composition's, rows
  sharded over two devices without a gather, vmap one example at a time."""
  if len(jax.devices()) < 2:
    pytest.skip("needs two devices")
  _cuda_with_stand_ins(monkeypatch)
  shapes = [(4, 6, 16), (16, 40), (40,), (40, 16), (16,)]
  args = [random(rng, s, jnp.bfloat16, scale=0.5) for s in shapes]
  fused = lambda *a: jaxfuse.gelu_mlp(*a, implementation="cuda")
  loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)
  wide = [a.astype(jnp.float32) for a in args]
  want, want_grads = plain(*wide), jax.grad(loss(plain), tuple(range(5)))(*wide)
  step = jax.jit(jax.grad(loss(fused), tuple(range(5))))
  assert_close(fused(*args), want, factor=8, name="y")
  for g, e, name in zip(step(*args), want_grads, ("dx", "dw1", "db1", "dw2", "db2")):
    assert_close(g, e, factor=16, name=name, axis=0 if name.startswith("db") else -1)
  mesh = jax.make_mesh((2,), ("batch",), axis_types=(axis_type,))
  placed = [jax.device_put(a, NamedSharding(mesh, P("batch") if i == 0 else P()))
            for i, a in enumerate(args)]
  assert "all-gather" not in step.lower(*placed).compile().as_text()
  for g, e in zip(step(*placed), step(*args)):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32),
                               rtol=2e-2, atol=2e-2)
  batched = jax.jit(jax.vmap(lambda x: fused(x, *args[1:])))(args[0])
  np.testing.assert_allclose(np.asarray(batched, np.float32),
                             np.asarray(fused(*args), np.float32), rtol=2e-2, atol=2e-2)
