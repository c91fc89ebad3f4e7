"""softmax, log_softmax and softmax_cross_entropy against float64 references.

On the CPU the 'triton' implementation runs the Pallas kernels in the interpreter, which fills
outputs with NaN first: an element a kernel does not write fails the comparison.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfuse
from jaxfuse._core.testing import assert_close, random, value_and_vjp, x64

IMPLS = ["xla", "triton"]
FNS = {"softmax": jaxfuse.softmax, "log_softmax": jaxfuse.log_softmax}


def reference(name, x, axis=-1, scale=1.0, keep=None, dy=None):
  """float64 output (NumPy) and, given dy, the gradient from jax.nn on float64 inputs."""
  with x64():
    x64_ = jnp.asarray(np.asarray(x, np.float64))
    fn = jax.nn.log_softmax if name == "log_softmax" else jax.nn.softmax
    keep_ = None if keep is None else jnp.broadcast_to(jnp.asarray(keep), x64_.shape)

    def f(x):
      out = fn(x * scale, axis=axis, where=keep_)
      if keep_ is not None:
        out = jnp.where(keep_, out, -jnp.inf if name == "log_softmax" else 0.0)
      return out

    y, grads = value_and_vjp(f, (x64_,),
                             None if dy is None else jnp.asarray(np.asarray(dy, np.float64)))
    grad = None
    if grads is not None:
      grad = np.asarray(grads[0])
      if keep_ is not None:
        grad = np.where(np.asarray(keep_), grad, 0.0)
    return np.asarray(y), grad


def causal_keep(t, s, offset):
  return np.arange(s)[None, :] <= np.arange(t)[:, None] + offset


def check(y, expected, dtype=None, factor=1.0, floor=0.0, axis=-1):
  """The worst row along ``axis`` within the tolerance; -inf exactly where expected."""
  y = np.asarray(jnp.asarray(y, jnp.float64) if jnp.asarray(y).dtype == jnp.float64
                 else jnp.asarray(y, jnp.float32))
  assert np.array_equal(np.isneginf(y), np.isneginf(expected))
  assert_close(y, expected, dtype or jnp.float32, factor=factor, floor=floor, axis=axis)


def gradient_floor(name, y, dy, scale=1.0, axis=-1):
  """Per row, the size of the terms a gradient is the difference of: scale * y * dy minus
  scale * y * sum(y * dy) for softmax, scale * dy minus scale * exp(y) * sum(dy) for
  log-softmax. Where a short row's gradient nearly cancels (one dominant probability), their
  rounding in float32 bounds the error, not the gradient's own size."""
  dy = np.asarray(dy, np.float64)
  terms = dy if name == "log_softmax" else np.where(np.isfinite(y), y, 0.0) * dy
  return abs(scale) * np.linalg.norm(terms, axis=axis, keepdims=True)


def check_masked(name, x, dy, y, dx, keep, scale=1.0, zero_gradient=False):
  """``y`` and its gradient ``dx`` against float64 where ``keep`` holds: masked keys 0 (-inf for
  log_softmax), fully masked rows included, and (with ``zero_gradient``) exactly zero gradient
  at every key the softmax dropped."""
  full = keep.any(axis=-1, keepdims=True)
  expected, grad = reference(name, x, scale=scale, keep=keep | ~full, dy=dy)
  fill = -np.inf if name == "log_softmax" else 0.0
  expected = np.where(keep & full, expected, fill)
  check(y, expected)
  if zero_gradient:
    assert np.all(np.asarray(dx)[~(keep & full)] == 0)
  check(dx, np.where(keep & full, grad, 0.0), factor=10,
        floor=gradient_floor(name, expected, np.where(keep & full, dy, 0.0), scale=scale))


SHAPES = [((1,), -1), ((3,), 0), ((7, 1000), -1), ((2, 3, 4097), -1), ((2, 65537), -1),
          ((5, 6, 7), 1), ((4, 3, 5), 0), ((2, 9, 4, 3), 1), ((33001, 3), 0)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("shape,axis", SHAPES, ids=str)
def test_matches_float64_any_axis(rng, impl, name, shape, axis):
  x = random(rng, shape, jnp.float32, scale=3.0)
  dy = random(rng, shape, jnp.float32)
  y, (dx,) = value_and_vjp(
      lambda x: FNS[name](x, axis=axis, scale=0.7, implementation=impl), (x,), dy)
  expected, grad = reference(name, x, axis, 0.7, dy=dy)
  check(y, expected, axis=axis)
  check(dx, grad, factor=10, floor=gradient_floor(name, expected, dy, 0.7, axis),
        axis=axis)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64],
                         ids=lambda d: jnp.dtype(d).name)
def test_dtypes(rng, impl, name, dtype):
  with x64():
    x = random(rng, (6, 300), dtype, scale=2.0)
    y = FNS[name](x, implementation=impl)
    assert y.dtype == dtype
    check(y, reference(name, x)[0], dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", FNS)
def test_large_magnitudes_do_not_overflow(rng, impl, name, n=513):
  x = random(rng, (4, n), jnp.float32, scale=1e4)
  y = FNS[name](x, implementation=impl)
  assert np.all(np.isfinite(np.asarray(y)))
  check(y, reference(name, x)[0])


MASKS = [(2, 3, 8, 40), (40,), (8, 1), (2, 1, 1, 40), (3, 8, 40), (1, 1)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("mask_shape", MASKS, ids=str)
def test_masks_of_any_broadcast_shape(rng, impl, name, mask_shape):
  x = random(rng, (2, 3, 8, 40), jnp.float32)
  mask = rng.random(mask_shape) > 0.4
  dy = random(rng, x.shape, jnp.float32)
  y, (dx,) = value_and_vjp(
      lambda x: FNS[name](x, mask=jnp.asarray(mask), implementation=impl), (x,), dy)
  keep = np.broadcast_to(mask, x.shape)
  full = keep.any(axis=-1, keepdims=True)
  expected, grad = reference(name, x, keep=keep | ~full, dy=dy)
  expected = np.where(full, expected, -np.inf if name == "log_softmax" else 0.0)
  expected = np.where(keep, expected, -np.inf if name == "log_softmax" else 0.0)
  grad = np.where(keep & full, grad, 0.0)
  check(y, expected)
  dx = np.asarray(dx)
  assert np.all(dx[~np.broadcast_to(full, x.shape)] == 0)
  check(dx, grad, factor=10, floor=gradient_floor(name, expected, np.where(keep, dy, 0.0)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("t,s,offset", [(6, 6, 0), (4, 9, 5), (4, 9, 0), (7, 3, -2), (5, 5, 2)])
def test_causal_alignments(rng, impl, name, t, s, offset):
  x = random(rng, (2, t, s), jnp.float32)
  dy = random(rng, x.shape, jnp.float32)
  y, (dx,) = value_and_vjp(
      lambda x: FNS[name](x, is_causal=True, causal_offset=offset, implementation=impl), (x,),
      dy)
  check_masked(name, x, dy, y, dx, np.broadcast_to(causal_keep(t, s, offset), x.shape))


@pytest.mark.gpu
@pytest.mark.parametrize("name", FNS)
def test_gpu_none_on_long_causal_rows(rng, name):
  """None's choice for causal scores long enough that a GPU's table may run one
  implementation's forward and another's backward (the H200: Triton's, then CUDA's)."""
  test_causal_alignments(rng, None, name, 40, 2048, 2048 - 40 - 7)


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_are_zero_with_zero_gradient(rng, impl):
  x = random(rng, (3, 16), jnp.float32)
  mask = jnp.asarray(np.array([True, False, True])[:, None] & (rng.random((3, 16)) > 0.5))
  for name, fill in (("softmax", 0.0), ("log_softmax", -np.inf)):
    y, vjp = jax.vjp(lambda x: FNS[name](x, mask=mask, implementation=impl), x)
    assert np.all(np.asarray(y)[1] == fill)
    dx = np.asarray(vjp(jnp.ones_like(x))[0])
    assert np.all(np.isfinite(dx)) and np.all(dx[1] == 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", FNS)
def test_nan_propagates_to_its_row(rng, impl, name):
  x = np.array(random(rng, (3, 24), jnp.float32))
  x[1, 4] = np.nan
  y = np.asarray(FNS[name](jnp.asarray(x), implementation=impl))
  assert np.all(np.isnan(y[1])) and np.all(np.isfinite(y[[0, 2]]))


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_and_jit(rng, impl):
  x = random(rng, (4, 5, 30), jnp.float32)
  mask = jnp.asarray(rng.random((4, 30)) > 0.3)
  f = lambda x, m: jaxfuse.softmax(x, axis=0, mask=m, implementation=impl)
  out = jax.jit(jax.vmap(f, in_axes=(1, None), out_axes=1))(x, mask)
  expected = np.stack([reference("softmax", x[:, i], axis=0, keep=np.asarray(mask))[0]
                       for i in range(5)], axis=1)
  check(out, expected)
  g = jax.vmap(jax.grad(lambda x: jnp.sum(jnp.sin(jaxfuse.log_softmax(x, implementation=impl)))))
  grads = g(x)
  for i in range(4):
    _, ref = reference("log_softmax", x[i], dy=np.cos(reference("log_softmax", x[i])[0]))
    check(grads[i], ref, factor=10)


def _mesh(n, axis_type):
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices")
  return jax.make_mesh((n,), ("d",), axis_types=(axis_type,), devices=jax.devices()[:n])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_row_sharding_never_gathers(rng, impl, axis_type):
  mesh = _mesh(8, axis_type)
  x = random(rng, (16, 4, 64), jnp.float32)
  dy = random(rng, x.shape, jnp.float32)

  def step(x):
    y, vjp = jax.vjp(lambda x: jaxfuse.softmax(x, is_causal=True, implementation=impl), x)
    return y, vjp(dy)[0]

  single = jax.jit(step)(x)
  xs = jax.device_put(x, NamedSharding(mesh, P("d")))
  compiled = jax.jit(step).lower(xs).compile()
  assert "all-gather" not in compiled.as_text()
  # XLA may fuse the per-shard program differently from the single-device one: the results
  # agree to float32 rounding, not bit for bit.
  for a, b in zip(compiled(xs), single):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.triton
def test_sharded_softmax_axis_is_a_clear_error(rng):
  mesh = _mesh(2, AxisType.Auto)
  x = jax.device_put(random(rng, (4, 64), jnp.float32), NamedSharding(mesh, P(None, "d")))
  with pytest.raises(Exception, match="reduced axes"):
    jax.jit(lambda x: jaxfuse.softmax(x, implementation="triton")).lower(x).compile()
  # The XLA implementation reduces across the shards itself.
  np.testing.assert_allclose(jax.jit(lambda x: jaxfuse.softmax(x, implementation="xla"))(x),
                             jax.nn.softmax(np.asarray(x)), rtol=1e-6)


def test_softmax_causal_offsets_past_the_rows_keep_or_mask_everything(rng):
  x = random(rng, (3, 5), jnp.float32)
  np.testing.assert_array_equal(jaxfuse.softmax(x, is_causal=True, causal_offset=2**40),
                                jaxfuse.softmax(x))
  assert np.all(np.asarray(jaxfuse.softmax(x, is_causal=True, causal_offset=-2**40)) == 0)


@pytest.mark.parametrize("args,error,match", [
    (dict(x=jnp.ones((2, 3), jnp.int32)), TypeError, "x.*int32"),
    (dict(axis=2), ValueError, "axis"),
    (dict(axis=1.0), TypeError, "axis"),
    (dict(mask=jnp.ones((2, 3))), TypeError, "mask.*boolean"),
    (dict(mask=jnp.ones((4, 3), bool)), ValueError, r"mask bool\[4,3\]"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(x=jnp.ones((3,)), is_causal=True), ValueError, "is_causal"),
    (dict(causal_offset=3), ValueError, "causal_offset=3 applies to is_causal"),
    (dict(implementation="cudnn"), NotImplementedError, "cudnn"),
    (dict(implementation="nope"), ValueError, "implementation"),
], ids=str)
def test_softmax_bad_input(args, error, match):
  kwargs = dict(x=jnp.ones((2, 3)))
  kwargs.update(args)
  x = kwargs.pop("x")
  with pytest.raises(error, match=match):
    jaxfuse.softmax(x, **kwargs)


# --------------------------------------------------------------------------- cross-entropy


def logsumexp(logits):
  """float64 log-sum-exp over the last axis."""
  x = np.asarray(logits, np.float64)
  top = np.max(x, axis=-1, keepdims=True)
  return np.log(np.sum(np.exp(x - top), axis=-1)) + top[..., 0]


def ce_reference(logits, labels, valid, smoothing=0.0, z_loss=0.0):
  """Per-row float64 losses and their gradient (for a unit cotangent per row), written out from
  the documented formula rather than taken from the code under test: the cross-entropy against
  the target ``(1 - smoothing) * onehot + smoothing / V`` plus ``z_loss * lse**2``. Rows not
  ``valid`` give 0 and a zero gradient."""
  x = np.asarray(logits, np.float64)
  vocab = x.shape[-1]
  lse = logsumexp(x)[..., None]
  onehot = np.arange(vocab) == np.asarray(labels)[..., None]
  target = (1 - smoothing) * onehot + smoothing / vocab
  loss = (lse - np.sum(target * x, axis=-1, keepdims=True) + z_loss * lse ** 2)[..., 0]
  grad = np.exp(x - lse) * (1 + 2 * z_loss * lse) - target
  valid = np.asarray(valid)
  return np.where(valid, loss, 0.0), np.where(valid[..., None], grad, 0.0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(1, 3), (7, 1000), (2, 3, 40000)], ids=str)
@pytest.mark.parametrize("smoothing,z_loss", [(0.0, 0.0), (0.1, 1e-3)])
def test_cross_entropy_matches_float64(rng, impl, shape, smoothing, z_loss):
  vocab = shape[-1]
  logits = random(rng, shape, jnp.float32, scale=3.0)
  labels = np.asarray(rng.integers(0, vocab, shape[:-1]), np.int32)
  if labels.size > 2:
    # Two ignored rows: no loss, no gradient, and not counted by 'mean'.
    labels.flat[[1, labels.size - 1]] = -100
  valid = labels != -100
  loss_ref, grad_ref = ce_reference(logits, labels, valid, smoothing, z_loss)
  kw = dict(ignore_index=-100, label_smoothing=smoothing, z_loss=z_loss, implementation=impl)
  # A loss is lse - picked: when the label dominates the two cancel, so float32 rounding is
  # measured against the magnitude of lse, not of the (small) difference.
  loss_scale = np.where(valid, np.maximum(np.abs(loss_ref), np.abs(logsumexp(logits))), 0.0)
  per_row = jaxfuse.softmax_cross_entropy(logits, labels, reduction="none", **kw)
  assert per_row.shape == shape[:-1] and per_row.dtype == jnp.float32
  # Each example a row of its own, so that one wrong loss cannot hide among the others.
  assert_close(per_row[..., None], loss_ref[..., None], floor=loss_scale[..., None],
               name="losses")
  for reduction, factor in (("mean", 1.0 / valid.sum()), ("sum", 1.0)):
    loss, grad = jax.value_and_grad(
        lambda l: jaxfuse.softmax_cross_entropy(l, labels, reduction=reduction, **kw))(logits)
    assert loss.shape == () and loss.dtype == jnp.float32
    assert_close(loss, factor * loss_ref.sum(), floor=factor * loss_scale.sum(), name=reduction)
    assert np.all(np.asarray(grad)[~valid] == 0)
    # The gradient is softmax minus the one-hot label: where the label dominates a short row
    # the two cancel, and float32 rounding is measured against the one-hot rows' size.
    assert_close(grad, grad_ref * factor, factor=10, floor=factor * valid[..., None],
                 name=f"{reduction} gradient")
  g = random(rng, shape[:-1], jnp.float32)
  _, vjp = jax.vjp(lambda l: jaxfuse.softmax_cross_entropy(l, labels, reduction="none", **kw),
                   logits)
  assert_close(vjp(g)[0], grad_ref * np.asarray(g)[..., None], factor=10,
               floor=np.abs(np.asarray(g, np.float64))[..., None], name="gradient")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_equals_optax(rng, impl, smoothing):
  """optax in float64 as a second reference, losses and autodiff gradients: its integer-label
  loss with the defaults, its loss against smoothed one-hot targets with label smoothing. The
  ignored rows are left out of optax's batch, so that its mean counts only the others."""
  optax = pytest.importorskip("optax")
  vocab = 517
  logits = random(rng, (33, vocab), jnp.float32, scale=4.0)
  labels = np.asarray(rng.integers(0, vocab, (33,)), np.int32)
  labels[[4, 19, 27]] = -100
  valid = labels != -100
  with x64():
    kept = jnp.asarray(np.asarray(logits, np.float64)[valid])

    def mean(kept):
      if smoothing:
        target = optax.smooth_labels(jax.nn.one_hot(labels[valid], vocab, dtype=kept.dtype),
                                     smoothing)
        rows = optax.softmax_cross_entropy(kept, target)
      else:
        rows = optax.softmax_cross_entropy_with_integer_labels(kept, labels[valid])
      return jnp.mean(rows), rows

    (mean_ref, kept_losses), kept_grad = jax.jit(jax.value_and_grad(mean, has_aux=True))(kept)
  loss_ref = np.zeros(labels.shape)
  loss_ref[valid] = kept_losses
  grad_ref = np.zeros(logits.shape)
  grad_ref[valid] = kept_grad
  kw = dict(ignore_index=-100, label_smoothing=smoothing, implementation=impl)
  per_row = jaxfuse.softmax_cross_entropy(logits, jnp.asarray(labels), reduction="none", **kw)
  lse = np.where(valid, logsumexp(logits), 0.0)
  assert_close(per_row[:, None], loss_ref[:, None], floor=lse[:, None], name="losses")
  loss, grad = jax.value_and_grad(
      lambda l: jaxfuse.softmax_cross_entropy(l, jnp.asarray(labels), **kw))(logits)
  assert_close(loss, float(mean_ref), floor=lse.sum() / valid.sum(), name="mean")
  assert_close(grad, grad_ref, factor=10, floor=valid[:, None] / valid.sum(), name="gradient")


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_ignored_and_out_of_range_labels(rng, impl):
  logits = random(rng, (10, 56), jnp.float32)
  labels = np.asarray(rng.integers(0, 56, (10,)), np.int32)
  labels[[1, 4]] = -100
  labels[[7, 8]] = 56, -3  # no class: never read, and the loss says so (NaN, as optax's)
  stray = np.isin(np.arange(10), [7, 8])
  valid = (labels >= 0) & (labels < 56)
  loss_ref, grad_ref = ce_reference(logits, labels, valid)
  ce = lambda l, reduction: jaxfuse.softmax_cross_entropy(
      l, jnp.asarray(labels), ignore_index=-100, reduction=reduction, implementation=impl)
  rows, vjp = jax.vjp(lambda l: ce(l, "none"), logits)
  assert np.array_equal(np.isnan(np.asarray(rows)), stray)
  assert_close(np.where(stray, 0.0, rows)[:, None], loss_ref[:, None])
  assert_close(vjp(jnp.ones_like(rows))[0], grad_ref, factor=10)
  for reduction, scale in (("mean", 1 / valid.sum()), ("sum", 1.0)):
    loss, grad = jax.value_and_grad(lambda l: ce(l, reduction))(logits)
    assert np.isnan(float(loss))
    # The counted rows' gradients stay those of the loss without the stray rows.
    assert np.all(np.asarray(grad)[~valid] == 0)
    assert_close(grad, grad_ref * scale, factor=10)
  # Nothing counted: a zero loss and zero gradient, not NaN.
  none = jnp.full((10,), -100, jnp.int32)
  loss, grad = jax.value_and_grad(lambda l: jaxfuse.softmax_cross_entropy(
      l, none, ignore_index=-100, implementation=impl))(logits)
  assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0)
  # Without ignore_index, -1 is no class either.
  assert np.isnan(float(jaxfuse.softmax_cross_entropy(logits, -jnp.ones((10,), jnp.int32),
                                                      implementation=impl)))


def test_cross_entropy_never_narrows_a_wide_label_into_range(rng):
  logits = random(rng, (3, 8), jnp.float32)
  with x64():
    labels = jnp.asarray([1, 2**32 + 3, 5], jnp.int64)
    rows = jaxfuse.softmax_cross_entropy(logits, labels, reduction="none")
    assert np.array_equal(np.isnan(np.asarray(rows)), [False, True, False])
  rows = jaxfuse.softmax_cross_entropy(logits, jnp.asarray([1, 2**31 + 3, 5], jnp.uint32),
                                       reduction="none")
  assert np.array_equal(np.isnan(np.asarray(rows)), [False, True, False])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int8, jnp.int16, jnp.uint16])
def test_cross_entropy_narrow_labels_count_as_int32_ones(rng, impl, dtype):
  # 256 classes: a uint8 label is always below the class count, which in uint8 wraps to 0;
  # ignore_index -100 would wrap to a class (156) in uint8 too.
  logits = random(rng, (6, 256), jnp.float32)
  labels = np.asarray(rng.integers(0, min(256, jnp.iinfo(dtype).max + 1), (6,)), np.int32)
  labels[2] = 255 if jnp.iinfo(dtype).max >= 255 else -100
  for ignore_index in (None, -100, int(labels[0])):
    ce = lambda l, kind: jaxfuse.softmax_cross_entropy(
        l, jnp.asarray(labels, kind), ignore_index=ignore_index, reduction="none",
        implementation=impl)
    narrow, vjp = jax.vjp(lambda l: ce(l, dtype), logits)
    wide, wide_vjp = jax.vjp(lambda l: ce(l, jnp.int32), logits)
    assert np.array_equal(np.asarray(narrow), np.asarray(wide), equal_nan=True)
    cotangent = jnp.asarray(rng.random(6), jnp.float32)
    assert np.array_equal(np.asarray(vjp(cotangent)[0]), np.asarray(wide_vjp(cotangent)[0]))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vocab", [37, 16421])  # one tile; chunks past the Triton tile
def test_cross_entropy_of_float64_logits_is_float64(rng, impl, vocab):
  logits = np.asarray(rng.normal(size=(3, vocab)) * 3)
  labels = np.asarray(rng.integers(0, vocab, (3,)), np.int32)
  loss_ref, grad_ref = ce_reference(logits, labels, np.ones(3, bool), smoothing=0.1)
  with x64():
    ce = lambda l, reduction: jaxfuse.softmax_cross_entropy(
        l, jnp.asarray(labels), label_smoothing=0.1, reduction=reduction, implementation=impl)
    rows, vjp = jax.vjp(lambda l: ce(l, "none"), jnp.asarray(logits))
    assert rows.dtype == jnp.float64 and ce(jnp.asarray(logits), "mean").dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(rows), loss_ref, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(vjp(jnp.ones(3, jnp.float64))[0]), grad_ref,
                               rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_of_no_rows(impl, reduction):
  # As XLA's empty reductions: a zero loss ('mean' counts no rows) and an empty gradient.
  ce = lambda l: jaxfuse.softmax_cross_entropy(l, jnp.zeros((2, 0), jnp.int32),
                                               reduction=reduction, implementation=impl)
  logits = jnp.ones((2, 0, 7), jnp.float32)
  loss, grad = jax.value_and_grad(lambda l: jnp.sum(ce(l)))(logits)
  assert ce(logits).shape == ((2, 0) if reduction == "none" else ())
  assert float(loss) == 0.0 and grad.shape == logits.shape


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_ignore_index_may_be_a_class(rng, impl, reduction):
  logits = random(rng, (2, 9, 32), jnp.float32)
  labels = np.asarray(rng.integers(0, 32, (2, 9)), np.int32)
  labels[0, [2, 5]] = 7
  labels[1, 0] = 7
  valid = labels != 7
  loss_ref, grad_ref = ce_reference(logits.reshape(-1, 32), labels.reshape(-1), valid.reshape(-1))
  f = lambda l: jaxfuse.softmax_cross_entropy(l, jnp.asarray(labels), ignore_index=7,
                                              reduction=reduction, implementation=impl)
  if reduction == "mean":
    loss, grad = jax.value_and_grad(f)(logits)
    assert_close(loss, loss_ref.sum() / valid.sum())
    assert_close(grad, grad_ref.reshape(2, 9, 32) / valid.sum(), factor=10)
  else:
    loss, vjp = jax.vjp(f, logits)
    assert_close(loss[..., None], loss_ref.reshape(2, 9, 1))
    (grad,) = vjp(jnp.ones_like(loss))
    assert_close(grad, grad_ref.reshape(2, 9, 32), factor=10)
  assert np.all(np.asarray(loss if reduction == "none" else grad)[~valid] == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_vmap_is_per_example_mean(rng, impl):
  logits = random(rng, (3, 5, 24), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 24, (3, 5)), jnp.int32)
  f = lambda l, y: jaxfuse.softmax_cross_entropy(l, y, implementation=impl)
  losses, grads = jax.vmap(jax.value_and_grad(f))(logits, labels)
  for i in range(3):
    loss_ref, grad_ref = ce_reference(logits[i], labels[i], np.ones(5, bool))
    assert_close(losses[i], loss_ref.mean())
    assert_close(grads[i], grad_ref / 5, factor=10)


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_row_sharding_never_gathers(rng, impl):
  mesh = _mesh(8, AxisType.Auto)
  logits = random(rng, (16, 4, 96), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 96, (16, 4)), jnp.int32)
  step = jax.value_and_grad(lambda l, y: jaxfuse.softmax_cross_entropy(l, y, implementation=impl))
  single = jax.jit(step)(logits, labels)
  args = (jax.device_put(logits, NamedSharding(mesh, P("d"))),
          jax.device_put(labels, NamedSharding(mesh, P("d"))))
  compiled = jax.jit(step).lower(*args).compile()
  assert "all-gather" not in compiled.as_text()
  for a, b in zip(jax.tree.leaves(compiled(*args)), jax.tree.leaves(single)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("args,error,match", [
    (dict(labels=jnp.zeros((3,), jnp.float32)), TypeError, "labels"),
    (dict(labels=jnp.zeros((4,), jnp.int32)), ValueError, r"labels.*int32\[4\]"),
    (dict(logits=jnp.zeros((3, 5), jnp.int32)), TypeError, "logits"),
    (dict(label_smoothing=1.0), ValueError, "label_smoothing"),
    (dict(z_loss=-1.0), ValueError, "z_loss"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(ignore_index=1.5), TypeError, "ignore_index"),
    (dict(ignore_index=2 ** 40), ValueError, "ignore_index"),
], ids=str)
def test_cross_entropy_bad_input(args, error, match):
  kwargs = dict(logits=jnp.zeros((3, 5)), labels=jnp.zeros((3,), jnp.int32))
  kwargs.update(args)
  with pytest.raises(error, match=match):
    jaxfuse.softmax_cross_entropy(kwargs.pop("logits"), kwargs.pop("labels"), **kwargs)


@pytest.mark.triton
@pytest.mark.gpu
@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("n", [1, 3, 1000, 4097, 65537, 262144])
def test_gpu_softmax_kernels(rng, name, n):
  from jaxfuse._core.testing import poison_device_memory
  rows = max(1, min(2048, (1 << 23) // n))
  x = random(rng, (rows, n), jnp.bfloat16, scale=3.0)
  dy = random(rng, x.shape, jnp.bfloat16)
  poison_device_memory(8 * rows * n)
  y, vjp = jax.vjp(lambda x: FNS[name](x, implementation="triton"), x)
  expected, grad = reference(name, x, dy=dy)
  check(y, expected, jnp.bfloat16)
  check(vjp(dy)[0], grad, jnp.bfloat16, factor=4, floor=gradient_floor(name, expected, dy))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("vocab", [24576, 131072])
def test_gpu_cross_entropy_large_vocab(rng, impl, vocab):
  """bfloat16 logits: the fused CUDA loss and gradient hold 24576 classes in one CTA (where the
  loss alone takes two) and 131072 in a cluster."""
  from jaxfuse._core.testing import poison_device_memory
  from jaxfuse.ops.softmax import cuda as cuda_kernels
  if impl == "cuda" and (reason := cuda_kernels.unsupported(vocab, jnp.bfloat16)):
    pytest.skip(reason)
  logits = random(rng, (64, vocab), jnp.bfloat16, scale=2.0)
  labels = jnp.asarray(rng.integers(0, vocab, (64,)), jnp.int32)
  loss_ref, grad_ref = ce_reference(logits, labels, np.ones(64, bool))
  poison_device_memory(4 * logits.size)
  loss, grad = jax.value_and_grad(lambda l: jaxfuse.softmax_cross_entropy(
      l, labels, implementation=impl))(logits)
  assert_close(loss, loss_ref.mean())
  assert_close(grad, grad_ref / 64, jnp.bfloat16, factor=4)


def test_cuda_needs_a_gpu(rng):
  if jax.default_backend() == "gpu":
    pytest.skip("CPU refusal")
  x = random(rng, (3, 64), jnp.float32)
  with pytest.raises(NotImplementedError, match="'cuda'.*GPU"):
    jaxfuse.softmax(x, implementation="cuda")
  with pytest.raises(NotImplementedError, match="'cuda'.*GPU"):
    jaxfuse.softmax_cross_entropy(x, jnp.zeros((3,), jnp.int32), implementation="cuda")


# Rows that are a multiple of 8 elements, split over clusters of 1 to 16 CTAs, with partial
# CTAs (4104, 32776) and the longest rows, which each thread holds without a prefetched next.
CUDA_SHAPES = [(5, 8), (7, 1000), (3, 4104), (2, 3, 32776), (64, 65536), (9, 131072),
               (4, 262144)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
def test_gpu_cuda_softmax_against_float64(rng, name, shape, dtype):
  from jaxfuse._core.testing import poison_device_memory
  from jaxfuse.ops.softmax import cuda as cuda_kernels
  if cuda_kernels.unsupported(shape[-1], dtype):
    pytest.skip("row too long for this dtype")
  x = random(rng, shape, dtype, scale=3.0)
  dy = random(rng, shape, dtype)
  scale = 0.7 if name == "softmax" else -0.7  # the row maximum of a negative scale's minimum
  poison_device_memory(16 * x.size)
  y, vjp = jax.vjp(lambda x: FNS[name](x, scale=scale, implementation="cuda"), x)
  expected, grad = reference(name, x, scale=scale, dy=dy)
  check(y, expected, dtype)
  check(vjp(dy)[0], grad, dtype, factor=4, floor=gradient_floor(name, expected, dy, scale))


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n", [4008, 20008])
def test_gpu_cuda_every_built_tiling(rng, stages, dtype, n):
  """Each units-per-thread the forward kernels are built for, through registers (0 stages) or
  1-3 shared-memory stages, at the smallest cluster that holds the row and at twice it: more
  rows than resident clusters, so every stage is refilled, and rows that end inside a CTA; the
  kernels of a CTA alone (4008 columns) and of clusters (20008, where the kernels have
  clusters)."""
  from jaxfuse._core import cuda
  from jaxfuse._core.testing import poison_device_memory
  from jaxfuse.ops.softmax import cuda as cuda_kernels
  if n > 4008 and cuda.cluster_limit() == 1:
    pytest.skip("rows one CTA holds only: no thread-block clusters before sm_90")
  rows = 1500
  x = random(rng, (rows, n), dtype, scale=3.0)
  labels = jnp.asarray(rng.integers(0, n, (rows,)), jnp.int32)
  expected = reference("log_softmax", x, scale=-0.7)[0]
  _, grad_ref = ce_reference(x, labels, np.ones(rows, bool))
  row_scale = jnp.ones((1,), jnp.float32)
  for units in (1, 2, 4, 8)[:4 if jnp.dtype(dtype).itemsize == 2 else 3]:
    smallest = cuda.tiling(n, (units,))
    for cluster in (smallest.cluster, 2 * smallest.cluster):
      t = cuda.tiling(n, (units,), min_cluster=cluster)
      t = dataclasses.replace(t, stages=stages)
      poison_device_memory(8 * x.size)
      y = cuda_kernels.softmax_forward(x, scale=-0.7, log=True, tiling=t)
      check(y, expected, dtype)
      _, grad = cuda_kernels.cross_entropy(x, labels, label_smoothing=0.0, z_loss=0.0,
                                           row_scale=row_scale, mode="fused", tiling=t)
      assert_close(grad, grad_ref, dtype, factor=4)


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [32, 256, 512])
@pytest.mark.parametrize("dtype,grad_dtype", [(jnp.bfloat16, None), (jnp.float16, None),
                                              (jnp.float32, None), (jnp.float32, jnp.bfloat16)],
                         ids=lambda d: "" if d is None else jnp.dtype(d).name)
@pytest.mark.parametrize("n", [8, 4104, 40008])
def test_gpu_cuda_cross_entropy_streamed_rows(rng, threads, dtype, grad_dtype, n):
  """Rows streamed by one CTA each (units=0), of lengths that end inside a thread's loads: the
  loss, log-sum-exp and gradient against float64, with label smoothing, z-loss, ignored and
  out-of-range labels (a zero loss from the kernel) and a scale per row; float32 logits with a
  bfloat16 gradient also take a linear layer's bias and padding columns."""
  from jaxfuse._core.cuda import Tiling
  from jaxfuse._core.testing import poison_device_memory
  from jaxfuse.ops.softmax import cuda as cuda_kernels
  if reason := cuda_kernels.unavailable():
    pytest.skip(reason)
  rows, smoothing, z_loss = 37, 0.1, 1e-3
  layer = grad_dtype is not None
  classes = n - 3 if layer and n > 8 else n
  logits = random(rng, (rows, n), dtype, scale=3.0)
  bias = random(rng, (n,), jnp.float32) if layer else None
  labels = np.asarray(rng.integers(0, classes, rows), np.int32)
  labels[[2, 30]] = -100
  labels[11] = classes  # no class: a zero loss and gradient
  valid = (labels >= 0) & (labels < classes)
  x = np.asarray(logits, np.float64)[:, :classes]
  if layer:
    x = x + np.asarray(bias, np.float64)[:classes]
  loss_ref, grad_ref = ce_reference(x, np.where(valid, labels, 0), valid, smoothing, z_loss)
  row_scale = random(rng, (rows,), jnp.float32)
  grad_ref = np.pad(grad_ref * np.asarray(row_scale, np.float64)[:, None],
                    ((0, 0), (0, n - classes)))
  loss_scale = np.where(valid, np.maximum(np.abs(loss_ref), np.abs(logsumexp(x))), 0.0)
  kw = dict(label_smoothing=smoothing, z_loss=z_loss, ignore_index=-100,
            tiling=Tiling.streaming(threads), bias=bias, classes=classes)
  poison_device_memory(8 * logits.size)
  loss, lse = cuda_kernels.cross_entropy(logits, jnp.asarray(labels), mode="loss", **kw)
  assert_close(loss[:, None], loss_ref[:, None], jnp.float32, floor=loss_scale[:, None],
               name="loss")
  assert_close(lse[:, None], logsumexp(x)[:, None], jnp.float32, name="lse")
  fused_loss, grad = cuda_kernels.cross_entropy(logits, jnp.asarray(labels), mode="fused",
                                                row_scale=row_scale, grad_dtype=grad_dtype, **kw)
  assert grad.dtype == (grad_dtype or dtype)
  assert np.array_equal(np.asarray(fused_loss), np.asarray(loss))
  assert np.all(np.asarray(grad, np.float32)[~valid] == 0)
  assert np.all(np.asarray(grad, np.float32)[:, classes:] == 0)
  assert_close(grad, grad_ref, grad_dtype or dtype, factor=10,
               floor=np.abs(np.asarray(row_scale, np.float64))[:, None])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4008, 20008])
def test_gpu_cuda_bits_do_not_depend_on_the_grid(rng, monkeypatch, n):
  """The softmax forward and backward and the cross-entropy on one wave of clusters, the
  default, eight, and three clusters walking every row: the same bits."""
  from jaxfuse._core import cuda
  from jaxfuse.ops.softmax import cuda as cuda_kernels
  if n > 4008 and cuda.cluster_limit() == 1:
    pytest.skip("rows one CTA holds only: no thread-block clusters before sm_90")
  rows = 997
  x = random(rng, (rows, n), jnp.bfloat16, scale=3.0)
  dy = random(rng, (rows, n), jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, n, (rows,)), jnp.int32)
  row_scale = jnp.full((1,), 1.0 / rows, jnp.float32)

  def run(**kw):
    y = cuda_kernels.softmax_forward(x, scale=1.0, log=False, **kw)
    return (y, cuda_kernels.softmax_backward(y, dy, scale=1.0, log=False, **kw),
            *cuda_kernels.cross_entropy(x, labels, label_smoothing=0.1, z_loss=0.0,
                                        row_scale=row_scale, mode="fused", **kw))

  expected = run()
  check(expected[0], reference("softmax", x)[0], jnp.bfloat16)
  outputs = [run(waves=waves) for waves in (1, 8)]
  monkeypatch.setattr(cuda_kernels, "resident_clusters", lambda *args: 3)
  outputs.append(run(waves=1))
  for got in outputs:
    for a, e in zip(got, expected):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _long_cuda_row() -> int:
  """A float32 row that takes a cluster of several CTAs, or where the kernels have no clusters
  (built for sm_80), most of one CTA."""
  from jaxfuse._core import cuda
  return 40000 if cuda.cluster_limit() > 1 else 4000


@pytest.mark.gpu
@pytest.mark.parametrize("name", FNS)
def test_gpu_cuda_softmax_edge_values_and_repeatability(rng, name):
  test_large_magnitudes_do_not_overflow(rng, "cuda", name, n=520)
  test_nan_propagates_to_its_row(rng, "cuda", name)
  # -inf logits take no part: softmax 0 (log-softmax -inf) there, with zero gradient.
  x = np.array(random(rng, (6, _long_cuda_row()), jnp.float32))
  x[:, ::3] = -np.inf
  dy = random(rng, x.shape, jnp.float32)
  keep = np.isfinite(x)
  step = jax.jit(lambda x, dy: (lambda y, vjp: (y, vjp(dy)[0]))(
      *jax.vjp(lambda x: FNS[name](x, implementation="cuda"), x)))
  y, dx = step(jnp.asarray(x), dy)
  expected, grad = reference(name, np.where(keep, x, 0.0), keep=keep, dy=dy)
  check(y, np.where(keep, expected, -np.inf if name == "log_softmax" else 0.0))
  assert np.all(np.asarray(dx)[~keep] == 0)
  check(dx, np.where(keep, grad, 0.0), factor=10)
  y2, dx2 = step(jnp.asarray(x), dy)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
  np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx2))


# Masks of x (2, 3, 8, S): every broadcast pattern, one beyond the kernel's four row groups (read
# materialized), and one value a row.
CUDA_MASKS = [(2, 3, 8, "S"), ("S",), (8, 1), (2, 1, 1, "S"), (3, 8, "S"), (1, 1),
              (2, 1, 8, "S"), (1, 3, 1, "S")]


@pytest.mark.gpu
@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("mask_shape", CUDA_MASKS, ids=str)
@pytest.mark.parametrize("s", [40, "long"])
def test_gpu_cuda_masks(rng, name, mask_shape, s):
  """Boolean masks on the CUDA kernels read in place through their broadcast strides, with a
  causal mask on top for the rows of the last case, against float64: masked keys 0 (-inf for
  log_softmax) with zero gradient, fully masked rows included."""
  s = _long_cuda_row() if s == "long" else s
  mask_shape = tuple(s if d == "S" else d for d in mask_shape)
  x = random(rng, (2, 3, 8, s), jnp.float32)
  mask = rng.random(mask_shape) > 0.4
  dy = random(rng, x.shape, jnp.float32)
  causal = mask_shape == (1, 3, 1, s)
  y, (dx,) = value_and_vjp(
      lambda x: FNS[name](x, mask=jnp.asarray(mask), is_causal=causal,
                          causal_offset=-2 if causal else 0, implementation="cuda"), (x,), dy)
  keep = np.broadcast_to(mask, x.shape)
  if causal:
    keep = keep & causal_keep(8, s, -2)
  check_masked(name, x, dy, y, dx, keep, zero_gradient=True)


@pytest.mark.parametrize("vocab", [4096, 8192, 16384, 16392, 32768, 32776, 131072])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_cuda_cross_entropy_tiling_rule(vocab, dtype):
  """Host-side rule, no GPU needed: rows of 16 KiB and more are streamed by one CTA each (the
  loss alone in CTAs of 128 threads, the fused loss and gradient in the widest CTA that walks
  its row in two steps or more); shorter rows are held, and where the loss alone would take a
  cluster of two CTAs for 16-bit logits, the fused loss and gradient take one CTA of the
  widest slices."""
  from jaxfuse._core.cuda import Tiling
  from jaxfuse.ops.softmax import cuda as cuda_kernels
  loss = cuda_kernels.cross_entropy_tiling(vocab, dtype)
  fused = cuda_kernels.cross_entropy_tiling(vocab, dtype, fused=True)
  fused.check(vocab)
  loss.check(vocab)
  row_bytes = vocab * jnp.dtype(dtype).itemsize
  if row_bytes >= cuda_kernels.STREAMED_FROM_BYTES:
    assert loss == Tiling.streaming(128)
    steps = row_bytes / (fused.threads * cuda_kernels.STREAM_STEP_BYTES)
    assert fused.is_streaming and steps >= 2
    assert fused.threads == 512 or steps < 4
  elif dtype == jnp.bfloat16 and loss.cluster == 2 and loss.units < cuda_kernels.STAGED_UNITS[2]:
    assert not loss.is_streaming
    assert (fused.cluster, fused.units) == (1, cuda_kernels.STAGED_UNITS[2])
  else:
    assert not loss.is_streaming
    assert fused == loss


def test_cuda_cross_entropy_streams_few_rows_in_wider_ctas(monkeypatch):
  """Host-side rule, no GPU needed: long rows are streamed at any number of rows; the loss
  alone widens its CTAs while its rows would fill fewer than half the threads the SMs hold, no
  wider than one step of the row, and the fused loss and gradient keep theirs."""
  from jaxfuse._core import registry
  from jaxfuse._core.cuda import Tiling
  from jaxfuse.ops.softmax import cuda as cuda_kernels
  monkeypatch.setattr(registry, "num_multiprocessors", lambda: 132)
  half = 132 * cuda_kernels.STREAM_THREADS_PER_SM // 2
  loss = lambda vocab, n_rows: cuda_kernels.cross_entropy_tiling(vocab, jnp.bfloat16,
                                                                 n_rows=n_rows)
  for n_rows, threads in ((1, 512), (half // 256 - 1, 512), (half // 256, 256),
                          (half // 128 - 1, 256), (half // 128, 128), (16384, 128)):
    assert loss(131072, n_rows) == Tiling.streaming(threads), n_rows
  # A row of 16 KiB is one step of a 256-thread CTA.
  assert loss(8192, 1) == Tiling.streaming(256)
  for vocab in (8192, 32768, 131072):
    fused = cuda_kernels.cross_entropy_tiling(vocab, jnp.bfloat16, fused=True)
    for n_rows in (1, 64, 1000, 16384):
      assert cuda_kernels.cross_entropy_tiling(vocab, jnp.bfloat16, fused=True,
                                               n_rows=n_rows) == fused


def test_cuda_mask_groups_read_every_row_once():
  """Host-side rule, no GPU needed: the (size, stride) groups give each row of x the offset of
  its row in the dense mask, in the fewest groups."""
  from jaxfuse.ops.softmax import cuda as cuda_kernels
  x_shape = (2, 3, 8, 40)
  for mask_shape in [(2, 3, 8, 40), (1, 1, 1, 40), (2, 1, 1, 40), (1, 3, 8, 40), (2, 1, 8, 1),
                     (1, 3, 1, 40), (2, 3, 1, 1)]:
    groups = cuda_kernels._mask_groups(x_shape, mask_shape)
    assert np.prod([g[0] for g in groups]) == np.prod(x_shape[:-1])
    dense = np.arange(np.prod(mask_shape)).reshape(mask_shape)
    expected = np.broadcast_to(dense, x_shape[:-1] + mask_shape[-1:])[..., 0].reshape(-1)
    offsets = []
    for r in range(np.prod(x_shape[:-1])):
      offset, rest = 0, r
      for size, stride in reversed(groups):
        offset, rest = offset + rest % size * stride, rest // size
      offsets.append(offset)
    np.testing.assert_array_equal(offsets, expected, err_msg=str(mask_shape))
  assert cuda_kernels._mask_groups(x_shape, (1, 1, 1, 40)) == [(48, 0)]
  assert cuda_kernels._mask_groups(x_shape, (2, 3, 8, 40)) == [(48, 40)]
  assert len(cuda_kernels._mask_groups((2, 2, 2, 2, 2, 8), (2, 1, 2, 1, 2, 8))) == 5


@pytest.mark.gpu
@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("b,t,s,offset", [(3, 8, 8, 0), (3, 16, 40, 24), (3, 16, 40, 0),
                                          (3, 24, 16, -8), (3, 8, 8, 3), (3, 5, "long", 0),
                                          (3, 5, "long", "bottom"), (64, 48, 40, 5),
                                          (16, 40, "long", -3)])
def test_gpu_cuda_causal(rng, name, b, t, s, offset):
  """Causal rows on the CUDA kernels, against float64: keys past each query (plus the offset)
  are 0 (-inf for log_softmax) with zero gradient, fully masked rows included, under a negative
  scale (the mask applies to the scaled logits), over a cluster's long rows, and with more rows
  than clusters (each walks many, its loads stopping at each row's last key)."""
  s = _long_cuda_row() if s == "long" else s
  offset = s - t if offset == "bottom" else offset
  x = random(rng, (b, t, s), jnp.float32)
  dy = random(rng, x.shape, jnp.float32)
  y, (dx,) = value_and_vjp(
      lambda x: FNS[name](x, scale=-0.7, is_causal=True, causal_offset=offset,
                          implementation="cuda"), (x,), dy)
  check_masked(name, x, dy, y, dx, np.broadcast_to(causal_keep(t, s, offset), x.shape),
               scale=-0.7, zero_gradient=True)


@pytest.mark.gpu
def test_gpu_cuda_softmax_vmap_and_refusals(rng):
  n = _long_cuda_row()
  x = random(rng, (3, 4, n), jnp.bfloat16)
  out = jax.vmap(lambda x: jaxfuse.log_softmax(x, implementation="cuda"))(x)
  check(out, reference("log_softmax", x)[0], jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="implementation='cuda'"):
    jaxfuse.softmax(x, implementation="cuda", axis=0)
  with pytest.raises(NotImplementedError, match="multiple of 8"):
    jaxfuse.softmax(x[..., :-1], implementation="cuda")


@pytest.mark.gpu
def test_gpu_default_takes_cuda_for_long_rows(rng):
  from jaxfuse.ops.softmax import cuda as cuda_kernels
  if reason := cuda_kernels.unsupported(65536, jnp.bfloat16):
    pytest.skip(reason)
  x = random(rng, (64, 65536), jnp.bfloat16)
  text = jax.jit(jax.grad(lambda x: jnp.sum(jaxfuse.softmax(x) ** 2))).lower(x).as_text()
  assert "jaxfuse_softmax_forward" in text and "jaxfuse_softmax_backward" in text
  labels = jnp.zeros((64,), jnp.int32)
  text = jax.jit(jax.grad(lambda x: jaxfuse.softmax_cross_entropy(x, labels))).lower(x)
  assert "jaxfuse_cross_entropy" in text.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 8), (7, 1000), (2, 3, 40000), (5, 131072)], ids=str)
@pytest.mark.parametrize("smoothing,z_loss", [(0.0, 0.0), (0.1, 1e-3)])
def test_gpu_cuda_cross_entropy_matches_float64(rng, shape, smoothing, z_loss):
  from jaxfuse.ops.softmax import cuda as cuda_kernels
  if cuda_kernels.unsupported(shape[-1], jnp.float32):
    pytest.skip("row too long for this GPU's kernels")
  test_cross_entropy_matches_float64(rng, "cuda", shape, smoothing, z_loss)


@pytest.mark.gpu
def test_gpu_cuda_cross_entropy_labels_and_vmap(rng):
  test_cross_entropy_ignored_and_out_of_range_labels(rng, "cuda")
  for reduction in ("mean", "none"):
    test_cross_entropy_ignore_index_may_be_a_class(rng, "cuda", reduction)
  test_cross_entropy_vmap_is_per_example_mean(rng, "cuda")


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("step,loss", [("xla", "triton"), ("triton", "xla")])
def test_cross_entropy_evaluated_and_differentiated_may_take_different_kernels(
    rng, step, loss, reduction):
  """None may pick one implementation for the loss alone and another for the training step;
  each use gives what XLA gives, ignored labels included."""
  from jaxfuse._core import op
  from jaxfuse.ops.softmax import api

  logits = jnp.asarray(rng.normal(size=(13, 301)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 301, 13), jnp.int32).at[4].set(7)
  static = lambda impl, loss_impl: api._CrossEntropyStatic(
      0.1, 1e-3, reduction, 7, op.Plan(loss_impl, impl, impl))
  run = lambda st: lambda x: jnp.sum(api._cross_entropy_jit(x, labels, st))
  mixed, xla = static(step, loss), static("xla", "xla")
  np.testing.assert_allclose(run(mixed)(logits), run(xla)(logits), rtol=1e-5)
  np.testing.assert_allclose(jax.grad(run(mixed))(logits), jax.grad(run(xla))(logits),
                             rtol=1e-5, atol=1e-7)
