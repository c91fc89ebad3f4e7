"""rms_norm and layer_norm against a float64 reference, under every transformation.

On the CPU the 'triton' implementation runs the Pallas kernels in the interpreter, which fills
kernel outputs with NaN before the kernel runs: an element the kernel forgets to write fails the
comparison. On a GPU the same tests run the compiled kernels.
"""

import functools

import jax
import jax.test_util  # noqa: F401  (check_grads)
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfuse
from jaxfuse._core import registry
from jaxfuse._core.testing import assert_close, random, value_and_vjp, x64

IMPLS = ["xla", "triton"]
KINDS = ["rms", "layer"]
EPS = {"rms": 1e-6, "layer": 1e-5}


def call(kind, x, w=None, b=None, **kwargs):
  if kind == "rms":
    assert b is None
    return jaxfuse.rms_norm(x, w, **kwargs)
  return jaxfuse.layer_norm(x, w, b, **kwargs)


def _plain_norm(kind, x, w, b, eps, nd):
  """The textbook formula, differentiated by JAX: independent of the library's own reference."""
  axes = tuple(range(x.ndim - nd, x.ndim))
  if kind == "layer":
    x = x - jnp.mean(x, axes, keepdims=True)
  y = x / jnp.sqrt(jnp.mean(x * x, axes, keepdims=True) + eps)
  if w is not None:
    y = y * w
  if b is not None:
    y = y + b
  return y


def reference(kind, x, w=None, b=None, dy=None, *, eps=None, nd=None):
  """float64 output and, given ``dy``, float64 gradients (dx, dw, db) as NumPy arrays."""
  eps = EPS[kind] if eps is None else eps
  nd = nd or (w.ndim if w is not None else b.ndim if b is not None else 1)
  with x64():
    up = lambda a: None if a is None else jnp.asarray(np.asarray(a, np.float64))
    args = [up(x), up(w), up(b)]
    y, grads = value_and_vjp(lambda x, w, b: _plain_norm(kind, x, w, b, eps, nd), args,
                             up(dy))
    grads = grads or ()
    to_np = lambda a: None if a is None else np.asarray(a)
    return to_np(y), tuple(map(to_np, grads))


def params(rng, kind, wshape, dtype=jnp.float32, with_weight=True):
  w = random(rng, wshape, dtype, scale=0.5, offset=1.0) if with_weight else None
  b = random(rng, wshape, dtype, scale=0.5) if kind == "layer" and with_weight else None
  return w, b


# (x shape, weight shape or None, normalized_ndim): odd sizes, 0-3 leading axes, 1-D and 2-D
# weights, rows longer than one register tile (4097, 65537 walk the looped kernels).
FORWARD_CASES = [
    ((1,), (1,), None),
    ((3,), (3,), None),
    ((5, 1000), (1000,), None),
    ((2, 3, 4097), (4097,), None),
    ((2, 65537), (65537,), None),
    ((3, 5, 7, 11), (7, 11), None),
    ((2, 1, 3, 5, 6), None, 3),
    ((13, 257), None, None),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,wshape,nd", FORWARD_CASES, ids=str)
def test_forward_matches_float64(rng, impl, kind, shape, wshape, nd):
  x = random(rng, shape, jnp.float32)
  w, b = params(rng, kind, wshape) if wshape else (None, None)
  y = call(kind, x, w, b, normalized_ndim=nd, implementation=impl)
  assert y.shape == x.shape and y.dtype == jnp.float32
  expected, _ = reference(kind, x, w, b, nd=nd)
  assert_close(y, expected)


DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("w_dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_dtype_pairings(rng, impl, kind, x_dtype, w_dtype):
  with x64():
    x = random(rng, (6, 300), x_dtype, scale=2.0, offset=0.5)
    w, b = params(rng, kind, (300,), w_dtype)
    y = call(kind, x, w, b, implementation=impl)
    expected_dtype = jnp.result_type(x_dtype, w_dtype)
    assert y.dtype == expected_dtype
    expected, _ = reference(kind, x, w, b)
  assert_close(y, expected, expected_dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_out_dtype_follows_request(rng, impl, kind):
  x = random(rng, (4, 96), jnp.float32)
  w, b = params(rng, kind, (96,), jnp.bfloat16)
  y = call(kind, x, w, b, out_dtype=jnp.bfloat16, implementation=impl)
  assert y.dtype == jnp.bfloat16
  assert_close(y, reference(kind, x, w, b)[0], jnp.bfloat16)


GRAD_CASES = [
    ((7,), (7,), jnp.float32),
    ((5, 1000), (1000,), jnp.float32),
    ((3, 17000), (17000,), jnp.float32),  # longer than one backward tile: unrolled chunks
    ((2, 40000), (40000,), jnp.float32),  # too long for register accumulators: split kernels
    ((3, 20000), None, jnp.float32),
    ((2, 3, 4, 5), (4, 5), jnp.float32),
    ((40, 130), None, jnp.float32),
    ((33, 515), (515,), jnp.bfloat16),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,wshape,dtype", GRAD_CASES, ids=str)
def test_gradients_match_float64(rng, impl, kind, shape, wshape, dtype):
  x = random(rng, shape, dtype, scale=1.5, offset=0.3)
  w, b = params(rng, kind, wshape, dtype) if wshape else (None, None)
  dy = random(rng, shape, dtype)
  present = [a for a in (x, w, b) if a is not None]

  def f(*args):
    return call(kind, *args, implementation=impl)

  y, grads = value_and_vjp(f, present, dy)
  y_ref, grads_ref = reference(kind, x, w, b, dy)
  assert_close(y, y_ref, name="y")
  # Weight gradients sum over rows; bf16 inputs round before the sum.
  for name, g, g_ref in zip(["dx", "dweight", "dbias"], grads,
                            [r for r in grads_ref if r is not None]):
    assert g.dtype == dtype
    assert_close(g, g_ref, factor=4 if dtype == jnp.bfloat16 else 10, name=name)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_numerical_gradients(rng, impl, kind):
  with x64():
    x = random(rng, (3, 17), jnp.float64)
    w, b = params(rng, kind, (17,), jnp.float64)
    args = [a for a in (x, w, b) if a is not None]
    jax.test_util.check_grads(lambda *a: call(kind, *a, implementation=impl), args, order=1,
                              modes=["rev"])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_layernorm_large_mean(rng, impl, kind):
  """A large offset must not cancel the variance (rows this long take the looped kernel, which
  keeps per-element Welford statistics and merges them; the last chunk is partial).

  A float32 mean of 40000 values near 1e4 is off by about 1e-3 of the noise in the worst
  row (XLA's own reduction, 1.3e-3), which bounds any float32 algorithm; the one-pass
  E[x^2] - E[x]^2 formula is off by orders of magnitude more.
  """
  x = random(rng, (3, 40000), jnp.float32, scale=1.0, offset=1e4)
  w, b = params(rng, kind, (40000,))
  y = call(kind, x, w, b, implementation=impl)
  assert_close(y, reference(kind, x, w, b)[0], factor=300)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_vmap_any_axis(rng, impl, kind):
  x = random(rng, (4, 6, 50), jnp.float32)
  w, b = params(rng, kind, (50,))
  f = functools.partial(call, kind, implementation=impl)
  expected = np.stack([reference(kind, x[:, i], w, b)[0] for i in range(6)], axis=1)
  out = jax.vmap(lambda x: f(x, w, b), in_axes=1, out_axes=1)(x)
  assert_close(out, expected)
  # A batched weight: every example normalizes with its own parameters.
  ws, bs = params(rng, kind, (6, 50))
  out = jax.vmap(lambda x, w, b: f(x, w, b), in_axes=(1, 0, 0 if b is not None else None),
                 out_axes=1)(x, ws, bs)
  expected = np.stack([reference(kind, x[:, i], ws[i], None if bs is None else bs[i])[0]
                       for i in range(6)], axis=1)
  assert_close(out, expected)
  # Nested vmap, the inner one over the weight only.
  out = jax.vmap(jax.vmap(lambda x, w: f(x, w), in_axes=(None, 0)), in_axes=(0, None))(x, ws)
  expected = np.stack([[reference(kind, x[i], ws[j])[0] for j in range(6)] for i in range(4)])
  assert_close(out, expected)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_vmap_and_grad_compose(rng, impl, kind):
  x = random(rng, (3, 5, 40), jnp.float32)
  w, b = params(rng, kind, (40,))
  dy = random(rng, (3, 5, 40), jnp.float32)

  def loss(x, w):
    return jnp.sum(call(kind, x, w, b, implementation=impl) * dy[0])

  # Per-example gradients: vmap of grad.
  per_example = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None))(x, w)
  for i in range(3):
    _, (dx_ref, dw_ref, *_) = reference(kind, x[i], w, b, dy[0])
    assert_close(per_example[0][i], dx_ref, factor=10)
    assert_close(per_example[1][i], dw_ref, factor=10)

  # grad of vmap: the parameter gradient sums over the mapped axis.
  def batched_loss(x, w):
    return jnp.sum(jax.vmap(lambda x: call(kind, x, w, b, implementation=impl))(x) * dy)

  dx, dw = jax.grad(batched_loss, argnums=(0, 1))(x, w)
  _, (dx_ref, dw_ref, *_) = reference(kind, x, w, b, dy)
  assert_close(dx, dx_ref, factor=10)
  assert_close(dw, dw_ref, factor=10)


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_and_checkpoint(rng, impl):
  x = random(rng, (8, 64), jnp.float32)
  w, b = params(rng, "layer", (64,))

  def loss(x, w, b):
    return jnp.sum(jnp.sin(jaxfuse.layer_norm(x, w, b, implementation=impl)))

  plain = jax.grad(loss, argnums=(0, 1, 2))(x, w, b)
  remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(x, w, b)
  for a, r in zip(plain, remat):
    np.testing.assert_allclose(a, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_deterministic(rng, impl, kind):
  x = random(rng, (300, 700), jnp.float32)
  w, b = params(rng, kind, (700,))
  dy = random(rng, (300, 700), jnp.float32)
  present = [a for a in (x, w, b) if a is not None]

  @jax.jit
  def step(*args):
    y, vjp = jax.vjp(lambda *a: call(kind, *a, implementation=impl), *args)
    return (y,) + vjp(dy)

  first, second = step(*present), step(*present)
  for a, c in zip(first, second):
    assert np.array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_and_inf_propagate_per_row(rng, impl, kind):
  x = np.array(random(rng, (4, 33), jnp.float32))
  x[1, 5] = np.nan
  x[2, 7] = np.inf
  w, b = params(rng, kind, (33,))
  y = np.asarray(call(kind, jnp.asarray(x), w, b, implementation=impl))
  expected, _ = reference(kind, x, w, b)
  np.testing.assert_array_equal(np.isnan(y), np.isnan(expected))
  assert np.all(np.isnan(y[1]))
  finite = np.isfinite(expected)
  assert_close(y[finite], expected[finite])
  assert_close(y[[0, 3]], expected[[0, 3]])


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch(impl):
  x = jnp.zeros((0, 3, 16), jnp.float32)
  y = jaxfuse.rms_norm(x, jnp.ones(16), implementation=impl)
  assert y.shape == x.shape
  dx = jax.grad(lambda x: jnp.sum(jaxfuse.rms_norm(x, implementation=impl)))(x)
  assert dx.shape == x.shape


# --------------------------------------------------------------------------- sharding


def _mesh(shape, names, axis_type):
  n = int(np.prod(shape))
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names),
                       devices=jax.devices()[:n])


SHARDINGS = [
    ((8,), ("d",), P("d"), P()),
    ((4, 2), ("a", "b"), P("a", "b"), P()),
    ((2, 4), ("a", "b"), P(("a", "b")), P()),
    ((2,), ("d",), P(None, "d"), P()),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
@pytest.mark.parametrize("mesh_shape,names,x_spec,w_spec", SHARDINGS, ids=str)
def test_batch_sharding_never_gathers(rng, impl, axis_type, mesh_shape, names, x_spec, w_spec):
  mesh = _mesh(mesh_shape, names, axis_type)
  x = random(rng, (16, 6, 128), jnp.float32)
  w, b = params(rng, "layer", (128,))
  dy = random(rng, (16, 6, 128), jnp.float32)

  def step(x, w, b):
    y, vjp = jax.vjp(lambda *a: jaxfuse.layer_norm(*a, implementation=impl), x, w, b)
    return (y,) + vjp(dy)

  single = jax.jit(step)(x, w, b)
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  args = (put(x, x_spec), put(w, w_spec), put(b, w_spec))
  compiled = jax.jit(step).lower(*args).compile()
  hlo = compiled.as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo
  out = compiled(*args)
  assert out[0].sharding.spec[:len(x_spec)] == tuple(x_spec)
  for a, s in zip(out, single):
    np.testing.assert_allclose(np.asarray(a), np.asarray(s), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_feature_sharding_reduces_across_shards(rng, impl, axis_type):
  mesh = _mesh((2, 4), ("rows", "features"), axis_type)
  x = random(rng, (8, 256), jnp.float32)
  w, _ = params(rng, "rms", (256,))
  dy = random(rng, (8, 256), jnp.float32)

  def step(x, w):
    y, vjp = jax.vjp(lambda *a: jaxfuse.rms_norm(*a, implementation=impl), x, w)
    return (y,) + vjp(dy)

  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  args = (put(x, P("rows", "features")), put(w, P("features")))
  compiled = jax.jit(step).lower(*args).compile()
  assert "all-gather" not in compiled.as_text()
  y, dx, dw = compiled(*args)
  y_ref, (dx_ref, dw_ref, _) = reference("rms", x, w, None, dy)
  assert_close(y, y_ref)
  assert_close(dx, dx_ref, factor=10)
  assert_close(dw, dw_ref, factor=10)


# --------------------------------------------------------------------------- bad input


def _bad(kind, **overrides):
  args = dict(x=jnp.ones((4, 8)), w=jnp.ones(8), b=jnp.ones(8) if kind == "layer" else None)
  args.update(overrides)
  kwargs = {k: v for k, v in args.items() if k not in ("x", "w", "b")}
  return lambda: call(kind, args["x"], args["w"], args["b"], **kwargs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("overrides,error,match", [
    (dict(w=jnp.ones(7)), ValueError, r"weight.*float32\[4,8\].*float32\[7\]"),
    (dict(w=jnp.ones((2, 8))), ValueError, "weight"),
    (dict(x=jnp.ones((4, 8), jnp.int32)), TypeError, r"x.*int32\[4,8\]"),
    (dict(x=jnp.ones((4, 8), jnp.complex64)), TypeError, "x.*complex64"),
    (dict(w=jnp.ones(8, jnp.int32)), TypeError, "weight.*int32"),
    (dict(eps=0.0), ValueError, "eps"),
    (dict(eps=-1e-5), ValueError, "eps"),
    (dict(eps=float("nan")), ValueError, "eps"),
    (dict(eps=float("inf")), ValueError, "eps"),
    (dict(eps="small"), TypeError, "eps"),
    (dict(implementation="fast"), ValueError, "implementation"),
    (dict(implementation=3), TypeError, "implementation"),
    (dict(implementation="cudnn"), NotImplementedError, "cudnn"),
    (dict(w=None, b=None, normalized_ndim=3), ValueError, "normalized_ndim"),
    (dict(normalized_ndim=2), ValueError, "normalized_ndim"),
    (dict(x=jnp.ones((4, 0)), w=None, b=None), ValueError, "zero elements"),
    (dict(out_dtype=jnp.int8), TypeError, "out_dtype"),
], ids=str)
def test_bad_input_raises_naming_argument(kind, overrides, error, match):
  with pytest.raises(error, match=match):
    _bad(kind, **overrides)()


def test_bias_shape_must_match_weight():
  with pytest.raises(ValueError, match=r"bias.*float32\[4\]"):
    jaxfuse.layer_norm(jnp.ones((2, 8)), jnp.ones(8), jnp.ones(4))


def test_traced_eps_is_rejected():
  with pytest.raises(TypeError, match="eps"):
    jax.jit(lambda e: jaxfuse.rms_norm(jnp.ones((2, 4)), eps=e))(1e-6)


def test_errors_raise_at_trace_time():
  with pytest.raises(ValueError, match="weight"):
    jax.eval_shape(lambda x, w: jaxfuse.rms_norm(x, w), jax.ShapeDtypeStruct((2, 8), jnp.float32),
                   jax.ShapeDtypeStruct((9,), jnp.float32))


def test_default_implementation_on_cpu_is_xla(rng):
  if jax.default_backend() != "cpu":
    pytest.skip("CPU selection")
  x = random(rng, (3, 10), jnp.float32)
  jaxpr = str(jax.make_jaxpr(lambda x: jaxfuse.rms_norm(x))(x))
  assert "pallas_call" not in jaxpr


# --------------------------------------------------------------------------- GPU only


def _check_step_on_poisoned_memory(kind, impl, x, w, b, dy):
  """Output and gradients against float64, with device memory poisoned first."""
  from jaxfuse._core.testing import poison_device_memory
  present = [a for a in (x, w, b) if a is not None]
  poison_device_memory(8 * x.size)
  y, vjp = jax.vjp(lambda *a: call(kind, *a, implementation=impl), *present)
  grads = vjp(dy)
  y_ref, grads_ref = reference(kind, x, w, b, dy)
  assert_close(y, y_ref)
  floors = [dx_floor(kind, x, w, dy)] + [0.0] * (len(grads) - 1)
  for g, r, floor in zip(grads, [r for r in grads_ref if r is not None], floors):
    assert_close(g, r, factor=4, floor=floor)


def dx_floor(kind, x, w, dy):
  """Per row, the size of the terms dx is the difference of, ``rstd * dy * w``: where a short
  row's dx nearly cancels (one feature: dx = rstd * g * (1 - x_hat^2) ~ eps), their rounding,
  not dx's own size, bounds the error."""
  x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  centred = x - x.mean(-1, keepdims=True) if kind == "layer" else x
  rstd = 1.0 / np.sqrt((centred ** 2).mean(-1, keepdims=True) + EPS[kind])
  g = dy if w is None else dy * np.asarray(w, np.float64)
  return rstd * np.linalg.norm(g, axis=-1, keepdims=True)


@pytest.mark.triton
@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 3, 1000, 4097, 8192, 65537, 1 << 20])
def test_gpu_kernels_against_float64(rng, kind, n):
  """Compiled kernels, poisoned output memory, odd and huge rows, bf16 like training."""
  rows = max(1, min(4096, (1 << 24) // n))
  x = random(rng, (rows, n), jnp.bfloat16)
  w, b = params(rng, kind, (n,), jnp.bfloat16)
  dy = random(rng, (rows, n), jnp.bfloat16)
  _check_step_on_poisoned_memory(kind, "triton", x, w, b, dy)


@pytest.mark.triton
@pytest.mark.gpu
def test_gpu_default_is_kernel(rng):
  x = random(rng, (64, 1024), jnp.bfloat16)
  text = jax.jit(lambda x: jaxfuse.rms_norm(x)).lower(x).as_text()
  assert "triton" in text.lower() or "__gpu$xla.gpu.triton" in text


def test_cuda_needs_a_gpu(rng):
  if jax.default_backend() == "gpu":
    pytest.skip("CPU refusal")
  x = random(rng, (3, 64), jnp.float32)
  with pytest.raises(NotImplementedError, match="'cuda'.*GPU"):
    jaxfuse.rms_norm(x, implementation="cuda")


# (x shape, weight shape): rows that are a multiple of 8 elements, split over clusters of 1 to
# 16 CTAs, with partial CTAs (4104, 32776) and 2-D weights.
CUDA_CASES = [((5, 8), (8,)), ((7, 1000), (1000,)), ((3, 4104), (4104,)),
              ((2, 3, 32776), (32776,)), ((64, 65536), (65536,)), ((9, 131072), (131072,)),
              ((2, 4, 64, 512), (64, 512))]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,wshape", CUDA_CASES, ids=str)
@pytest.mark.parametrize("x_dtype,w_dtype", [(jnp.bfloat16, jnp.bfloat16),
                                             (jnp.float32, jnp.float32),
                                             (jnp.float16, jnp.float32)], ids=str)
def test_gpu_cuda_against_float64(rng, kind, shape, wshape, x_dtype, w_dtype):
  from jaxfuse.ops.norm import cuda as cuda_kernels
  n = int(np.prod(wshape))
  if cuda_kernels.unsupported(n, x_dtype, jnp.result_type(x_dtype, w_dtype), [w_dtype]):
    pytest.skip("row too long for this dtype")
  x = random(rng, shape, x_dtype, offset=2.0 if kind == "layer" else 0.0)
  w, b = params(rng, kind, wshape, w_dtype)
  dy = random(rng, shape, jnp.result_type(x_dtype, w_dtype))
  _check_step_on_poisoned_memory(kind, "cuda", x, w, b, dy)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [256, 32768])
def test_gpu_cuda_vmapped_weights_deterministic(rng, kind, n):
  """Per-example weights become groups of rows (short rows and long); the gradients repeat
  bit for bit."""
  from jaxfuse.ops.norm import cuda as cuda_kernels
  if reason := cuda_kernels.unsupported(n, jnp.bfloat16, jnp.bfloat16, [jnp.bfloat16]):
    pytest.skip(reason)
  x = random(rng, (3, 17, n), jnp.bfloat16)
  w, b = params(rng, kind, (3, n), jnp.bfloat16)
  dy = random(rng, x.shape, jnp.bfloat16)
  present = [a for a in (x, w, b) if a is not None]

  def step(impl):
    f = jax.vmap(lambda *a: call(kind, *a, implementation=impl))
    y, vjp = jax.vjp(f, *present)
    return (y,) + vjp(dy)

  first, second, expected = step("cuda"), step("cuda"), step("xla")
  for a, c, e in zip(first, second, expected):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert_close(a, np.asarray(e, np.float64), factor=4)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1001, 262144 + 8])
def test_gpu_cuda_refuses_rows_it_cannot_hold(rng, n):
  x = random(rng, (2, n), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="implementation='cuda'"):
    jaxfuse.layer_norm(x, implementation="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [264, 488])
def test_gpu_default_layer_norm_backward_takes_cuda_for_short_rows(rng, n):
  """LayerNorm's default backward of many short rows (past 2^22 elements, where the H200's
  table takes it too) is the CUDA short-row kernel (on every table and without one); RMSNorm's
  stays with Triton where it runs. The step matches float64 on poisoned memory."""
  x = random(rng, (16384, n), jnp.bfloat16)
  w, b = params(rng, "layer", (n,), jnp.bfloat16)
  dy = random(rng, x.shape, jnp.bfloat16)

  def lowered(kind):
    args = [a for a in (x, w, b if kind == "layer" else None) if a is not None]
    step = jax.grad(lambda *a: call(kind, *a).sum(), tuple(range(len(args))))
    return jax.jit(step).lower(*args).as_text()

  layer = lowered("layer")
  assert "jaxfuse_norm_backward" in layer
  if registry.triton_unavailable() is None:
    assert "jaxfuse_norm_backward" not in lowered("rms")
  _check_step_on_poisoned_memory("layer", None, x, w, b, dy)


@pytest.mark.gpu
def test_gpu_default_takes_cuda_for_long_rows(rng):
  from jaxfuse.ops.norm import cuda as cuda_kernels
  if reason := cuda_kernels.unsupported(65536, jnp.bfloat16, jnp.bfloat16, [jnp.bfloat16]):
    pytest.skip(reason)
  x = random(rng, (64, 65536), jnp.bfloat16)
  w = random(rng, (65536,), jnp.bfloat16)
  text = jax.jit(jax.grad(lambda x, w: jaxfuse.rms_norm(x, w).sum(), (0, 1))).lower(x, w)
  text = text.as_text()
  assert "jaxfuse_norm_forward" in text and "jaxfuse_norm_backward" in text


def _built_forward_tilings(n, dtype):
  """Every (units, stages) the 'cuda' forward is built for (norm.cu: through registers up to
  four 16-byte vectors a thread, staged from four to eight in CTAs of at most 256 threads), at
  the smallest cluster that holds the row and at twice it."""
  from jaxfuse._core import cuda
  from jaxfuse.ops.norm import cuda as cuda_kernels
  vectors = jnp.dtype(dtype).itemsize // 2  # 16-byte vectors in one 8-element unit
  for units in (1, 2, 4, 8):
    for stages in (0, 1, 2):
      if units * vectors > (4 if stages == 0 else 8) or (stages and units * vectors < 4):
        continue
      max_threads = cuda_kernels.STAGED_THREADS if stages else cuda.MAX_THREADS
      smallest = cuda.tiling(n, (units,), max_threads=max_threads)
      for cluster in (smallest.cluster, 2 * smallest.cluster):
        yield cuda.tiling(n, (units,), min_cluster=cluster, max_threads=max_threads,
                          stages=stages)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n", [4008, 20008])
def test_gpu_cuda_every_built_tiling(rng, kind, dtype, n):
  """Each forward instantiation (registers or 1-2 shared-memory stages) and each backward
  units-per-thread, on poisoned memory: more rows than resident clusters, so every stage is
  refilled, and a row that ends inside a CTA; the kernels of a CTA alone (4008 features) and of
  clusters (20008, where the kernels have clusters)."""
  from jaxfuse._core import cuda
  from jaxfuse._core.testing import poison_device_memory
  from jaxfuse.ops.norm import cuda as cuda_kernels
  if n > 4008 and cuda.cluster_limit() == 1:
    pytest.skip("rows one CTA holds only: no thread-block clusters before sm_90")
  rows = 1500
  x = random(rng, (1, rows, n), dtype, offset=1.5 if kind == "layer" else 0.0)
  w, b = params(rng, kind, (1, n), dtype)
  dy = random(rng, x.shape, dtype)
  y_ref, grads_ref = reference(kind, x[0], w[0], None if b is None else b[0], dy[0], nd=1)
  stats = None
  for t in _built_forward_tilings(n, dtype):
    poison_device_memory(8 * x.size)
    y, mean, rstd = cuda_kernels.forward(x, w, b, kind=kind, eps=EPS[kind], out_dtype=dtype,
                                         tiling=t)
    assert_close(y[0], y_ref, dtype, name=str(t))
    stats = stats or (mean, rstd)
  for units in (1, 2):
    t = cuda.tiling(n, (units,))
    poison_device_memory(8 * x.size)
    grads = cuda_kernels.backward(dy, x, w, *stats, kind=kind, has_bias=b is not None,
                                  bias_dtype=dtype, tiling=t)
    for g, r in zip([g for g in grads if g is not None], [r for r in grads_ref if r is not None]):
      assert_close(g.reshape(r.shape), r, dtype, factor=4, name=str(t))


def test_persistent_grids_come_in_waves_of_resident_clusters():
  """Host-side rules, no GPU needed: a row tiling's forward launches ``waves`` times the
  resident clusters and never more than the rows (short rows: CTAs shared out over the groups,
  one wave by default); the backward (partial parameter gradients per cluster) keeps one."""
  from jaxfuse._core import cuda
  from jaxfuse.ops.norm import cuda as cuda_kernels
  assert cuda.persistent_clusters(100, 10_000, waves=4) == 400
  assert cuda.persistent_clusters(100, 250, waves=4) == 250
  assert cuda.persistent_clusters(100, 0) == 1
  rows = cuda.Tiling(1, 128, 4)
  assert cuda_kernels._grid(1, 10_000, rows, 100, waves=2) == 200
  assert cuda_kernels._grid(3, 10_000, rows, 100) == 100
  short = cuda.Tiling(1, 256, 4, 0, 8)
  assert cuda_kernels._grid(1, 10_000, short, 100) == 100
  assert cuda_kernels._grid(1, 10_000, short, 100, waves=2) == 200
  assert cuda_kernels._grid(1, 10_000, short, 100, waves=4) == 313  # a CTA per 32 rows
  assert cuda_kernels._grid(4, 10_000, short, 100, waves=2) == 50
  assert cuda_kernels.forward_waves("rms", short) == cuda_kernels.SHORT_FORWARD_WAVES
  assert set(cuda_kernels.FORWARD_WAVES) == set(KINDS)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [4008, 20008])
def test_gpu_cuda_forward_bits_do_not_depend_on_the_grid(rng, monkeypatch, kind, n):
  """One wave of clusters, the default, eight, and three clusters walking every row: the same
  bits, as each row is reduced by the same threads in the same order whichever cluster holds
  it (rows past the resident clusters, prefetched rows, two parameter groups)."""
  from jaxfuse._core import cuda
  from jaxfuse.ops.norm import cuda as cuda_kernels
  if n > 4008 and cuda.cluster_limit() == 1:
    pytest.skip("rows one CTA holds only: no thread-block clusters before sm_90")
  x = random(rng, (2, 997, n), jnp.bfloat16, offset=1.5 if kind == "layer" else 0.0)
  w, b = params(rng, kind, (2, n), jnp.bfloat16)
  run = lambda **kw: cuda_kernels.forward(x, w, b, kind=kind, eps=EPS[kind],
                                          out_dtype=jnp.bfloat16, **kw)
  expected = run()
  y_ref, _ = reference(kind, x[1], w[1], None if b is None else b[1], nd=1)
  assert_close(expected[0][1], y_ref, jnp.bfloat16)
  outputs = [run(waves=waves) for waves in (1, 8)]
  monkeypatch.setattr(cuda_kernels, "resident_clusters", lambda *args: 3)
  outputs.append(run(waves=1))
  for got in outputs:
    for a, e in zip(got, expected):
      if e is not None:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.mark.parametrize("n", [1, 8, 9, 64, 200, 256, 257, 1000, 1024, 1032, 4096])
def test_short_tilings_cover_their_rows(n):
  """Host-side rules, no GPU needed: a short-row tiling holds the row on a power of two of at
  most 32 lanes with the fewest units those lanes need, or there is none and the row goes to
  the cluster kernels."""
  from jaxfuse._core import cuda
  from jaxfuse.ops.norm import cuda as cuda_kernels
  for choices in cuda_kernels.SHORT_FORWARD_UNITS.values():
    t = cuda.short_tiling(n, choices)
    n_units = -(-n // cuda.UNIT)
    if t is None:
      assert n_units > 32 * max(choices)
      continue
    t.check(n)
    assert t.lanes & (t.lanes - 1) == 0 and t.lanes <= 32 and t.cluster == 1
    assert t.units in choices and t.lanes * t.units >= n_units
    assert all(t.lanes * u < n_units for u in choices if u < t.units)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("n", [1024, 2048, 4096, 8192, 32768])
def test_float32_dy_beside_16bit_x_takes_one_unit_while_a_cta_holds_the_row(n, kind):
  """Host-side rule, no GPU needed: the backward's float32 dy (float32 parameters promote the
  output) holds one unit a thread where one CTA holds the row, or for LayerNorm two units where
  a CTA of at most HELD_THREADS holds it; else the tiling of x's dtype."""
  from jaxfuse.ops.norm import cuda as cuda_kernels
  wide = cuda_kernels.backward_tiling(n, jnp.bfloat16, jnp.float32, kind)
  plain = cuda_kernels.backward_tiling(n, jnp.bfloat16, kind=kind)
  assert cuda_kernels.backward_tiling(n, jnp.bfloat16, jnp.bfloat16, kind) == plain
  wide.check(n)
  if kind == "layer" and n <= cuda_kernels.HELD_THREADS * 2 * 8:
    assert (wide.cluster, wide.units) == (1, 2) and wide.threads <= cuda_kernels.HELD_THREADS
  elif n <= 512 * 8:
    assert (wide.cluster, wide.units, wide.lanes) == (1, 1, 0)
  else:
    assert wide == plain


def test_malformed_short_tilings_are_refused():
  from jaxfuse._core.cuda import Tiling
  for bad in (Tiling(2, 256, 2, 0, 16), Tiling(1, 256, 2, 0, 12), Tiling(1, 100, 2, 0, 16),
              Tiling(1, 256, 2, 0, 64)):
    with pytest.raises(ValueError, match="short-row tiling"):
      bad.check(8)
  with pytest.raises(ValueError, match="fewer than"):
    Tiling(1, 256, 1, 0, 8).check(72)


def _short_tilings(n, dtype):
  """Every units-per-thread the short-row kernels are built for that one warp covers n with,
  on the fewest lanes, in CTAs of 256 and of 64 threads."""
  from jaxfuse._core import cuda
  from jaxfuse.ops.norm import cuda as cuda_kernels
  width = jnp.dtype(dtype).itemsize
  for direction, built in (("forward", cuda_kernels.SHORT_FORWARD_UNITS[width]),
                           ("backward", cuda_kernels.SHORT_BACKWARD_UNITS[width])):
    for units in built:
      for threads in (256, 64):
        t = cuda.short_tiling(n, (units,), threads=threads)
        if t is not None:
          yield direction, t


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n", [8, 24, 64, 200, 256, 488, 1000])
@pytest.mark.parametrize("grid", ["resident", "three CTAs"])
def test_gpu_cuda_short_rows(rng, monkeypatch, kind, dtype, n, grid):
  """Each short-row instantiation on poisoned memory, over two parameter groups of a prime
  number of rows: with the resident grid, and with three CTAs a group, each of which then walks
  many rows (prefetch, the last partial pass, the parameter sums over many rows per thread)."""
  from jaxfuse._core.testing import poison_device_memory
  from jaxfuse.ops.norm import cuda as cuda_kernels
  if jnp.dtype(dtype).itemsize == 4 and n > 512:
    pytest.skip("longer than the short-row kernels' float32 rows (512)")
  if grid == "three CTAs":
    # Shared out over the two groups: three CTAs each.
    monkeypatch.setattr(cuda_kernels, "resident_clusters", lambda *args: 6)
  groups, rows = 2, 1009
  x = random(rng, (groups, rows, n), dtype, offset=1.5 if kind == "layer" else 0.0)
  w, b = params(rng, kind, (groups, n), dtype)
  dy = random(rng, x.shape, dtype)
  refs = [reference(kind, x[g], w[g], None if b is None else b[g], dy[g], nd=1)
          for g in range(groups)]
  _, mean, rstd = cuda_kernels.forward(x, w, b, kind=kind, eps=EPS[kind], out_dtype=dtype)
  tested = 0
  for direction, t in _short_tilings(n, dtype):
    poison_device_memory(8 * x.size)
    if direction == "forward":
      y, *_ = cuda_kernels.forward(x, w, b, kind=kind, eps=EPS[kind], out_dtype=dtype, tiling=t)
      for g, (y_ref, _) in enumerate(refs):
        assert_close(y[g], y_ref, dtype, name=f"{t} group {g}")
    else:
      grads = cuda_kernels.backward(dy, x, w, mean, rstd, kind=kind, has_bias=b is not None,
                                    bias_dtype=dtype, tiling=t)
      for g, (_, grads_ref) in enumerate(refs):
        for got, r in zip([a[g] for a in grads if a is not None],
                          [r for r in grads_ref if r is not None]):
          assert_close(got.reshape(r.shape), r, dtype, factor=4, name=f"{t} group {g}")
    tested += 1
  assert tested, f"no short tiling for {n} {jnp.dtype(dtype).name}"
