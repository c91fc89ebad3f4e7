"""linear_cross_entropy against the cross-entropy of float64 logits computed in full, by a
formula written out here and by optax."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse._core.testing import assert_close, random, x64
from jaxfuse.ops.linear_cross_entropy import reference


def make(rng, batch, width, vocab, dtype, *, bias=True):
  x = random(rng, batch + (width,), dtype)
  weight = random(rng, (width, vocab), dtype, scale=width ** -0.5)
  b = random(rng, (vocab,), dtype, scale=0.3) if bias else None
  labels = rng.integers(0, vocab, batch)
  return x, weight, b, jnp.asarray(labels, jnp.int32)


def expected(x, weight, bias, labels, *, cotangent=1.0, ignore_index=None,
             label_smoothing=0.0, z_loss=0.0, reduction="mean"):
  """The loss and the gradients ``(dx, dweight, dbias)`` of ``cotangent * loss`` (summed over
  the rows for 'none'; dbias None without a bias), from the (tokens, vocabulary) logits
  ``x @ weight + bias`` in float64 and softmax_cross_entropy's documented formula, written out
  here rather than taken from code that the op shares."""
  rows = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
  weight = np.asarray(weight, np.float64)
  vocab = weight.shape[1]
  logits = rows @ weight + (0.0 if bias is None else np.asarray(bias, np.float64))
  labels = np.asarray(labels).reshape(-1)
  counted = (labels >= 0) & (labels < vocab)
  if ignore_index is not None:
    counted &= labels != ignore_index
  top = np.max(logits, axis=1)
  lse = np.log(np.sum(np.exp(logits - top[:, None]), axis=1)) + top
  label_column = (np.arange(len(labels)), np.where(counted, labels, 0))
  losses = (lse - (1 - label_smoothing) * logits[label_column]
            - label_smoothing * np.mean(logits, axis=1) + z_loss * lse ** 2)
  losses = np.where(counted, losses, 0.0)
  if reduction == "none":
    value = losses.reshape(np.shape(x)[:-1])
    row_grad = np.broadcast_to(np.asarray(cotangent, np.float64), value.shape).reshape(-1)
  else:
    # 'mean' divides by the counted rows alone (0 when none count).
    per_row = 1.0 / max(counted.sum(), 1) if reduction == "mean" else 1.0
    value = np.sum(losses) * per_row
    row_grad = np.full(len(labels), float(cotangent) * per_row)
  row_grad = np.where(counted, row_grad, 0.0)
  dlogits = (np.exp(logits - lse[:, None]) * ((1 + 2 * z_loss * lse) * row_grad)[:, None]
             - label_smoothing / vocab * row_grad[:, None])
  dlogits[label_column] -= (1 - label_smoothing) * row_grad
  grads = ((dlogits @ weight.T).reshape(np.shape(x)), rows.T @ dlogits,
           None if bias is None else np.sum(dlogits, axis=0))
  return value, grads


@pytest.fixture(params=["xla", pytest.param("cuda", marks=pytest.mark.gpu)])
def impl(request):
  """Every implementation: 'cuda' only where a GPU is (its tests are marked gpu)."""
  from jaxfuse.ops.linear_cross_entropy import cuda
  if request.param == "cuda" and (reason := cuda.unavailable()):
    pytest.skip(reason)
  # A GPU's float32 products default to TF32: compare with float64 at full precision.
  with jax.default_matmul_precision("highest"):
    yield request.param


@pytest.fixture(params=[2000, 1 << 27], ids=["chunked", "one-chunk"])
def chunk(request, monkeypatch):
  """Logits per chunk: 2000 walks 2 rows at a time at vocabulary 1000, every row alone past
  2000."""
  monkeypatch.setattr(reference, "CHUNK_ELEMENTS", request.param)
  return request.param


@pytest.mark.parametrize("batch,width,vocab", [((1,), 3, 1), ((5,), 7, 3), ((37,), 16, 1000),
                                               ((2, 3), 8, 4097), ((13,), 24, 128)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_full_logits(rng, impl, chunk, batch, width, vocab, dtype):
  x, weight, bias, labels = make(rng, batch, width, vocab, dtype)
  loss = lambda x, w, b: jaxfuse.linear_cross_entropy(x, w, labels, bias=b, implementation=impl)
  value, grads = jax.value_and_grad(loss, (0, 1, 2))(x, weight, bias)
  want, want_grads = expected(x, weight, bias, labels)
  assert value.dtype == jnp.float32
  assert_close(value, want, jnp.float32, factor=4, name="loss")
  for g, e, a, name in zip(grads, want_grads, (x, weight, bias), ("dx", "dweight", "dbias")):
    assert g.dtype == a.dtype and g.shape == a.shape
    assert_close(g, e, dtype, factor=4, name=name, axis=0 if name == "dbias" else -1)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", [
    dict(), dict(label_smoothing=0.1), dict(z_loss=1e-2), dict(ignore_index=3),
    dict(label_smoothing=0.2, z_loss=1e-3, ignore_index=3),
], ids=lambda options: "-".join(options) or "defaults")
def test_options(rng, impl, chunk, options, reduction):
  """Every value out of the op: each row's loss or the reduced one, dx, dweight and dbias, for
  a random cotangent, with rows that are not counted."""
  x, weight, bias, labels = make(rng, (29,), 12, 300, jnp.float32)
  labels = labels.at[:4].set(jnp.asarray([3, 3, 299, 0]))  # ignored rows and the edge classes
  cotangent = random(rng, labels.shape if reduction == "none" else (), jnp.float32)
  loss = lambda x, w, b: jaxfuse.linear_cross_entropy(x, w, labels, bias=b, implementation=impl,
                                                      reduction=reduction, **options)
  value, vjp = jax.vjp(loss, x, weight, bias)
  want, want_grads = expected(x, weight, bias, labels, cotangent=cotangent, reduction=reduction,
                              **options)
  assert value.dtype == jnp.float32 and value.shape == np.shape(want)
  # Each row's loss a row of its own, so that one wrong loss cannot hide among the others.
  assert_close(value.reshape(-1, 1), np.reshape(want, (-1, 1)), factor=4, name="loss")
  for g, e, name in zip(vjp(cotangent), want_grads, ("dx", "dweight", "dbias")):
    assert_close(g, e, jnp.float32, factor=4, name=name, axis=0 if name == "dbias" else -1)


def test_equals_optax(rng, impl):
  """optax's integer-label cross-entropy of the float64 logits, and its autodiff gradients, as
  a second reference; the rows not counted are left out of optax's batch, so that its mean
  counts only the others."""
  optax = pytest.importorskip("optax")
  x, weight, bias, labels = make(rng, (23,), 10, 130, jnp.float32)
  labels = np.array(labels)
  labels[[2, 9, 17]] = -100
  counted = labels != -100
  with x64():
    wide = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, weight, bias)]

    def mean(x, w, b):
      rows = optax.softmax_cross_entropy_with_integer_labels(x[counted] @ w + b, labels[counted])
      return jnp.mean(rows), rows

    (want, rows), want_grads = jax.jit(jax.value_and_grad(mean, (0, 1, 2), has_aux=True))(*wide)
  losses = np.zeros(labels.shape)
  losses[counted] = rows
  run = lambda x, w, b, reduction: jaxfuse.linear_cross_entropy(
      x, w, jnp.asarray(labels), bias=b, ignore_index=-100, reduction=reduction,
      implementation=impl)
  assert_close(run(x, weight, bias, "none")[:, None], losses[:, None], factor=4, name="losses")
  value, grads = jax.value_and_grad(run, (0, 1, 2))(x, weight, bias, "mean")
  assert_close(value, float(want), factor=4, name="mean")
  for g, e, name in zip(grads, want_grads, ("dx", "dweight", "dbias")):
    assert_close(g, np.asarray(e), jnp.float32, factor=4, name=name,
                 axis=0 if name == "dbias" else -1)


def test_rows_of_the_last_chunk_overlap(rng, impl, monkeypatch):
  """7 rows in chunks of 3 (300 logits at vocabulary 100): the last chunk is rows 4-6, of
  which 4 and 5 were done by the second."""
  monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 300)
  x, weight, bias, _ = make(rng, (7,), 9, 100, jnp.float32)
  labels = jnp.asarray([0, 36, 50, 63, 64, 80, 99], jnp.int32)
  for reduction in ("none", "sum"):
    loss = lambda x, w, b: jaxfuse.linear_cross_entropy(x, w, labels, bias=b, label_smoothing=0.1,
                                                        reduction=reduction, implementation=impl)
    want, want_grads = expected(x, weight, bias, labels, reduction=reduction,
                                label_smoothing=0.1)
    got = loss(x, weight, bias)
    assert_close(got.reshape(-1, 1), np.reshape(want, (-1, 1)), jnp.float32, factor=4,
                 name="loss")
    grads = jax.grad(lambda *a: jnp.sum(loss(*a)), (0, 1, 2))(x, weight, bias)
    for g, e, name in zip(grads, want_grads, ("dx", "dweight", "dbias")):
      assert_close(g, e, jnp.float32, factor=4, name=name, axis=0 if name == "dbias" else -1)


@pytest.mark.parametrize("tokens,vocab,width,elements", [
    (16384, 50257, 768, 1 << 27), (32768, 50257, 768, 1 << 27), (1000, 50257, 768, 1 << 27),
    (5000, 32000, 4096, 1 << 27), (7, 100, 9, 300), (37, 1000, 16, 2000), (4097, 7, 3, 5000),
    (129, 1, 1000, 8)])
def test_chunks_stay_within_their_logits_and_cover_the_tokens(tokens, vocab, width, elements):
  rows = reference.rows_per_chunk(tokens, vocab, width, elements)
  cap = max(1, elements // vocab)
  tile = 128 if cap >= 128 else 8 if cap >= 8 else 1
  assert 1 <= rows <= min(tokens, cap)
  assert rows == tokens or rows % tile == 0
  chunks = -(-tokens // rows)
  fewest_rows = min(tokens, cap - cap % tile)
  # Never more work than the fewest chunks of the largest rows (the previous walk).
  assert chunks * (rows + width) <= -(-tokens // fewest_rows) * (fewest_rows + width)


def test_gpt2_tokens_are_spread_over_even_chunks():
  """16384 tokens at 2^27 logits per chunk: 7 chunks of 2432 (17024 rows computed), not of
  2560, whose last chunk would compute 1536 rows a second time."""
  assert reference.rows_per_chunk(16384, 50257, 768, 1 << 27) == 2432


def test_without_bias_and_with_a_tied_embedding(rng, impl, chunk):
  x, _, _, labels = make(rng, (11,), 10, 77, jnp.float32, bias=False)
  embedding = random(rng, (77, 10), jnp.float32, scale=0.3)
  loss = lambda x, e: jaxfuse.linear_cross_entropy(x, e.T, labels, implementation=impl)
  grads = jax.grad(loss, (0, 1))(x, embedding)
  want, want_grads = expected(x, embedding.T, None, labels)
  assert_close(loss(x, embedding), want, jnp.float32, factor=4, name="loss")
  assert_close(grads[0], want_grads[0], jnp.float32, factor=4, name="dx")
  assert_close(grads[1], want_grads[1].T, jnp.float32, factor=4, name="dembedding")


def test_nothing_counted_gives_zero_mean(rng, impl):
  x, weight, bias, labels = make(rng, (6,), 4, 9, jnp.float32)
  loss = lambda x: jaxfuse.linear_cross_entropy(x, weight, jnp.full_like(labels, -1), bias=bias,
                                                 ignore_index=-1, implementation=impl)
  assert float(loss(x)) == 0.0
  assert not np.any(np.asarray(jax.grad(loss)(x)))


def test_a_label_of_no_class_makes_its_loss_nan(rng, impl):
  x, weight, bias, labels = make(rng, (7,), 4, 9, jnp.float32)
  labels = labels.at[2:4].set(jnp.asarray([9, -2]))
  stray = np.isin(np.arange(7), [2, 3])
  loss = lambda x, labels, reduction: jaxfuse.linear_cross_entropy(
      x, weight, labels, bias=bias, reduction=reduction, implementation=impl)
  rows = loss(x, labels, "none")
  assert np.array_equal(np.isnan(np.asarray(rows)), stray)
  ignored = jnp.where(jnp.asarray(stray), -1, labels)
  kept = lambda x, reduction: jaxfuse.linear_cross_entropy(
      x, weight, ignored, bias=bias, ignore_index=-1, reduction=reduction, implementation=impl)
  assert_close(np.where(stray, 0.0, rows)[:, None], kept(x, "none")[:, None])
  for reduction in ("mean", "sum"):
    assert np.isnan(float(loss(x, labels, reduction)))
    # The counted rows' gradients stay those of the loss without the stray rows.
    assert_close(jax.grad(loss)(x, labels, reduction), jax.grad(kept)(x, reduction))


def test_uint8_labels_of_256_classes_count_as_int32_ones(rng, impl):
  # In uint8 the class count 256 wraps to 0: compared there, no label would be a class.
  x, weight, bias, labels = make(rng, (5,), 4, 256, jnp.float32)
  loss = lambda x, kind: jaxfuse.linear_cross_entropy(
      x, weight, labels.astype(kind), bias=bias, reduction="none", implementation=impl)
  narrow, vjp = jax.vjp(lambda x: loss(x, jnp.uint8), x)
  wide, wide_vjp = jax.vjp(lambda x: loss(x, jnp.int32), x)
  assert np.array_equal(np.asarray(narrow), np.asarray(wide))
  cotangent = jnp.asarray(rng.random(5), jnp.float32)
  assert np.array_equal(np.asarray(vjp(cotangent)[0]), np.asarray(wide_vjp(cotangent)[0]))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_tokens_give_a_zero_loss(rng, reduction):
  _, weight, bias, _ = make(rng, (6,), 4, 9, jnp.float32)
  x, labels = jnp.zeros((0, 4)), jnp.zeros((0,), jnp.int32)
  loss = lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels, bias=bias, reduction=reduction)
  assert loss(x, weight).shape == ((0,) if reduction == "none" else ())
  if reduction != "none":
    assert float(loss(x, weight)) == 0.0
    assert not np.any(np.asarray(jax.grad(loss, 1)(x, weight)))


def test_nan_propagates_to_its_row(rng, impl):
  x, weight, bias, labels = make(rng, (6,), 4, 9, jnp.float32)
  rows = jaxfuse.linear_cross_entropy(x.at[2, 1].set(jnp.nan), weight, labels, bias=bias,
                                      reduction="none", implementation=impl)
  assert np.isnan(rows[2]) and np.all(np.isfinite(np.delete(np.asarray(rows), 2)))


def test_vmap_and_jit(rng, impl):
  x, weight, bias, labels = make(rng, (3, 8), 6, 50, jnp.float32)
  run = lambda x, l: jaxfuse.linear_cross_entropy(x, weight, l, bias=bias, reduction="sum",
                                                  implementation=impl)
  mapped = jax.jit(jax.vmap(run))(x, labels)
  for i in range(3):
    np.testing.assert_allclose(mapped[i], run(x[i], labels[i]), rtol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_token_sharding_never_gathers(rng, monkeypatch, reduction, axis_type):
  """Data parallelism: each device walks its own tokens (in several chunks here) and the
  weight gradients are summed across devices; the tokens are never gathered."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 4 * 97)
  mesh = jax.make_mesh((8,), ("d",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
  x, weight, bias, labels = make(rng, (8 * 13,), 16, 97, jnp.float32)
  cotangent = random(rng, labels.shape, jnp.float32) if reduction == "none" else 1.0

  def step(x, weight, bias, labels):
    loss, vjp = jax.vjp(lambda x, w, b: jaxfuse.linear_cross_entropy(
        x, w, labels, bias=b, reduction=reduction, implementation="xla"), x, weight, bias)
    return loss, vjp(jnp.asarray(cotangent, loss.dtype))

  single = jax.jit(step)(x, weight, bias, labels)
  put = lambda a, *spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, P(*spec)))
  args = (put(x, "d"), put(weight), put(bias), put(labels, "d"))
  compiled = jax.jit(step).lower(*args).compile()
  sharded = compiled(*args)
  assert not re.search(r"all-gather(-start)?\(", compiled.as_text())
  assert re.search(r"all-reduce(-start)?\(", compiled.as_text())  # dweight, dbias
  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def test_temporary_memory_does_not_grow_with_tokens_times_vocabulary(rng, impl, monkeypatch):
  # A GPU's temporaries include cuBLAS's workspace (tens of MiB): logits of 1 GiB there.
  on_gpu = jax.default_backend() == "gpu"
  monkeypatch.setattr(reference, "CHUNK_ELEMENTS", (1 << 24) if on_gpu else 16 * 16384)
  tokens, width, vocab = (8192, 64, 32768) if on_gpu else (512, 32, 16384)
  x, weight, bias, labels = make(rng, (tokens,), width, vocab, jnp.float32)
  logits_bytes = tokens * vocab * 4

  def temp(fn):
    compiled = jax.jit(jax.value_and_grad(fn, (0, 1, 2))).lower(x, weight, bias).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  fused = temp(lambda x, w, b: jaxfuse.linear_cross_entropy(x, w, labels, bias=b,
                                                            implementation=impl))
  full = temp(lambda x, w, b: jaxfuse.softmax_cross_entropy(x @ w + b, labels,
                                                            implementation="xla"))
  assert full >= logits_bytes  # the check can fail: the unfused loss holds the logits
  assert fused < logits_bytes / 4, (fused, logits_bytes)


def test_cuda_row_pass_with_a_stand_in_kernel(rng, monkeypatch):
  """The 'cuda' path's plumbing on any machine: padding, bias, counted columns, the operand
  dtype of the gradient and vmap (shared and per-example biases), around an XLA stand-in for
  the kernel."""
  from jaxfuse.ops.linear_cross_entropy import api
  from jaxfuse.ops.softmax import cuda as softmax_cuda

  def stand_in(logits, labels, *, mode, label_smoothing, z_loss, classes, bias=None,
               row_scale=None, grad_dtype=None):
    assert logits.dtype == jnp.float32 and logits.shape[1] % 128 == 0
    loss, lse, grad, _ = reference.xla_rows(
        logits, None if bias is None else bias[:classes], labels,
        row_scale if mode == "fused" else None, None, classes=classes,
        label_smoothing=label_smoothing, z_loss=z_loss, grad_dtype=grad_dtype)
    return (loss, lse) if mode == "loss" else (loss, grad)

  monkeypatch.setattr(softmax_cuda, "cross_entropy", stand_in)
  monkeypatch.setitem(api._BACKENDS, "cuda", lambda: None)
  monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 2000)
  x, weight, bias, labels = make(rng, (3, 9), 8, 300, jnp.bfloat16)
  options = dict(label_smoothing=0.1, z_loss=1e-3, reduction="sum")
  for impl in ("xla", "cuda"):
    run = lambda x, b, l, impl=impl: jaxfuse.linear_cross_entropy(
        x, weight, l, bias=b, implementation=impl, **options)
    got = jax.vmap(jax.value_and_grad(run, (0, 1)))(x, bias * jnp.arange(1, 4)[:, None]
                                                    .astype(bias.dtype), labels)
    shared = jax.vmap(jax.value_and_grad(run, (0, 1)), (0, None, 0))(x, bias, labels)
    if impl == "xla":
      want, want_shared = got, shared
      continue
    for a, b in zip(jax.tree.leaves((got, shared)), jax.tree.leaves((want, want_shared))):
      assert a.dtype == b.dtype
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=2e-2, atol=1e-5)


@pytest.mark.parametrize("change,error,match", [
    (dict(weight=np.ones((5, 9), np.float32)), ValueError, "weight"),
    (dict(weight=np.ones((4,), np.float32)), ValueError, "weight"),
    (dict(labels=np.ones((7,), np.int32)), ValueError, "labels"),
    (dict(labels=np.ones((6,), np.float32)), TypeError, "labels"),
    (dict(bias=np.ones((8,), np.float32)), ValueError, "bias"),
    (dict(x=np.ones((6, 4), np.int32)), TypeError, "x"),
    (dict(label_smoothing=1.0), ValueError, "label_smoothing"),
    (dict(z_loss=-1.0), ValueError, "z_loss"),
    (dict(reduction="max"), ValueError, "reduction"),
    (dict(implementation="mosaic"), NotImplementedError, "mosaic"),
    (dict(implementation="bogus"), ValueError, "implementation"),
])
def test_bad_inputs(rng, change, error, match):
  x, weight, bias, labels = make(rng, (6,), 4, 9, jnp.float32)
  args = dict(x=x, weight=weight, labels=labels, bias=bias) | change
  options = {k: args.pop(k) for k in list(args) if k not in ("x", "weight", "labels")}
  with pytest.raises(error, match=match):
    jaxfuse.linear_cross_entropy(args["x"], args["weight"], args["labels"], **options)


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpt2_vocabulary_on_the_gpu(rng, impl, reduction):
  """An odd vocabulary (padded to whole tiles inside), several chunks, a tied embedding in
  bfloat16: the shape class of the GPT example, on the device's matmuls."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  x = random(rng, (4097, 256), jnp.bfloat16)
  embedding = random(rng, (50257, 256), jnp.bfloat16, scale=256 ** -0.5)
  labels = jnp.asarray(rng.integers(0, 50257, (4097,)), jnp.int32)
  loss = lambda x, e: jaxfuse.linear_cross_entropy(x, e.T, labels, reduction=reduction,
                                                    implementation=impl)
  if reduction == "none":
    value = loss(x, embedding)
    want, _ = expected(x, embedding.T, None, labels, reduction="none")
    assert_close(value[:, None], want[:, None], jnp.float32, factor=4, name="losses")
    return
  value, (dx, dembedding) = jax.value_and_grad(loss, (0, 1))(x, embedding)
  want, (want_dx, want_dweight, _) = expected(x, embedding.T, None, labels)
  assert_close(value, want, jnp.float32, factor=4, name="loss")
  assert_close(dx, want_dx, jnp.bfloat16, factor=4, name="dx")
  assert_close(dembedding, want_dweight.T, jnp.bfloat16, factor=4, name="dembedding")
