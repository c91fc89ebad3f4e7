"""Every op over more than 2^31 elements, on the GPU: each implementation ``None`` can take and
each one named, forward and gradients.

A kernel that forms an offset in 32 bits reads or writes the wrong elements from element 2^31
on, which a check of the leading rows alone misses: each test checks the leading rows, the rows
on either side of element 2^31 and the last rows, each row against float64 (the worst row's
relative error). Inputs are drawn on the device; the float64 references use the checked rows
only. Parameter gradients, sums over every row, are checked against float32 XLA over the whole
input. Each test holds under ~46 GB of device memory and frees its large arrays as soon as it
has read them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse._core.testing import assert_close

BOUNDARY = 2**31  # the first element whose flat offset no longer fits int32
BF16 = jnp.bfloat16


def _key(rng):
  return jax.random.key(int(rng.integers(2**31)))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _normal(key, shape, dtype=BF16, scale=1.0, offset=0.0):
  return (jax.random.normal(key, shape, jnp.float32) * scale + offset).astype(dtype)


def _rows_past_boundary(n_elements_per_row, fraction=1.0625):
  """The rows of ``fraction`` times 2^31 elements."""
  return int(BOUNDARY // n_elements_per_row * fraction)


def _checked(n_rows, row_elements):
  """Leading rows, two rows on either side of the row holding element 2^31, the last rows."""
  middle = BOUNDARY // row_elements
  return np.array(sorted({*range(4), *range(middle - 2, middle + 2),
                          *range(n_rows - 4, n_rows)}))


def _take(a, rows, axis=0):
  """Rows of a device array, as float64 on the host."""
  picked = jnp.take(a, jnp.asarray(rows), axis=axis)
  return np.asarray(picked.astype(jnp.float32), np.float64)


def _run(impl, call):
  """Runs ``call``; a named implementation that cannot run here skips the test (None must
  always run)."""
  if impl is None:
    return call()
  try:
    return call()
  except NotImplementedError as e:
    pytest.skip(str(e))


# --------------------------------------------------------------------------- norms


EPS = 1e-5


def _norm_reference(kind, x, w, b, dy):
  """float64 y and dx of rows of x (weight and bias broadcast over the rows)."""
  centred = x - x.mean(-1, keepdims=True) if kind == "layer" else x
  rstd = 1.0 / np.sqrt((centred * centred).mean(-1, keepdims=True) + EPS)
  x_hat = centred * rstd
  y = x_hat * w + (0.0 if b is None else b)
  g = dy * w
  dx = g - x_hat * (g * x_hat).mean(-1, keepdims=True)
  if kind == "layer":
    dx = dx - g.mean(-1, keepdims=True)
  return y, dx * rstd


@functools.partial(jax.jit, static_argnums=0)
def _norm_param_grads_f32(kind, x, dy):
  """dweight and dbias over every row, in float32 XLA."""
  x, dy = x.astype(jnp.float32), dy.astype(jnp.float32)
  if kind == "layer":
    x = x - jnp.mean(x, -1, keepdims=True)
  x_hat = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS)
  return jnp.sum(x_hat * dy, 0), jnp.sum(dy, 0)


# (implementation, features): Triton takes rows of up to 16384 features (short rows in small
# programs, 4096 in one tile); CUDA long rows and short rows (a warp's lanes per row). None
# takes Triton at 4096, CUDA at 32768 (Triton and XLA without it) and, for LayerNorm's backward
# at 256, the CUDA short-row kernel.
NORM_CASES = [("triton", 256), ("triton", 4096), ("cuda", 256), ("cuda", 32768), (None, 256),
              (None, 4096), (None, 32768)]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("impl,n", NORM_CASES, ids=str)
def test_norm(rng, kind, impl, n):
  """x, dy, y and dx of 2.28e9 bf16 elements: ~19 GB, ~28 GB with the float32 reference."""
  n_rows = _rows_past_boundary(n)
  keys = jax.random.split(_key(rng), 4)
  x = _normal(keys[0], (n_rows, n))
  w = _normal(keys[1], (n,), BF16, 0.5, 1.0)
  b = _normal(keys[2], (n,), BF16, 0.5) if kind == "layer" else None
  params = (w,) if b is None else (w, b)
  op = jaxfuse.rms_norm if kind == "rms" else jaxfuse.layer_norm
  y, vjp = _run(impl, lambda: jax.vjp(
      lambda x, *p: op(x, *p, eps=EPS, implementation=impl), x, *params))
  dy = _normal(keys[3], x.shape)
  dx, *param_grads = vjp(dy)
  del vjp
  rows = _checked(n_rows, n)
  w64, b64 = (None if p is None else np.asarray(p.astype(jnp.float32), np.float64)
              for p in (w, b))
  y_ref, dx_ref = _norm_reference(kind, _take(x, rows), w64, b64, _take(dy, rows))
  assert_close(_take(y, rows), y_ref, BF16, name="y")
  assert_close(_take(dx, rows), dx_ref, BF16, factor=4, name="dx")
  del y, dx
  expected = _norm_param_grads_f32(kind, x, dy)
  for name, grad, ref in zip(("dweight", "dbias"), param_grads, expected):
    assert_close(np.asarray(grad.astype(jnp.float32))[None], np.asarray(ref)[None], BF16,
                 name=name)


# --------------------------------------------------------------------------- softmax


def _softmax_reference(name, x, keep, dy):
  """float64 output and gradient of rows of x, entries outside ``keep`` masked out."""
  z = np.where(keep, x, -np.inf)
  shifted = z - z.max(-1, keepdims=True)
  total = np.exp(shifted).sum(-1, keepdims=True)
  if name == "softmax":
    y = np.exp(shifted) / total
    return y, y * (dy - (dy * y).sum(-1, keepdims=True))
  y = shifted - np.log(total)
  kept_dy = np.where(keep, dy, 0.0)
  return y, np.where(keep, dy - np.exp(y) * kept_dy.sum(-1, keepdims=True), 0.0)


# (op, implementation, row length, mask): Triton over rows of one tile and rows walked in
# chunks, and with a full boolean mask past 2^31 elements (3.2e9: the int8 mask of 2^31 to 2^32
# bytes that the lowering would offset in 32 bits) and past 2^32 (4.6e9, offset in 64 bits as
# it is); CUDA long rows; None at 4096 (Triton) and 32768 (CUDA, or Triton without it).
# log_softmax, the same kernels with another epilogue, where it adds a kernel instance.
SOFTMAX_CASES = [("softmax", "triton", 4096, None), ("softmax", "triton", 65536, None),
                 ("softmax", "triton", 4096, 1.5), ("softmax", "triton", 4096, 2.125),
                 ("softmax", "cuda", 32768, None), ("softmax", None, 4096, None),
                 ("softmax", None, 32768, None), ("log_softmax", "triton", 65536, None),
                 ("log_softmax", "triton", 4096, 1.5), ("log_softmax", "cuda", 32768, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,impl,n,mask_fraction", SOFTMAX_CASES, ids=str)
def test_softmax(rng, name, impl, n, mask_fraction):
  """Unmasked, 2.28e9 bf16 elements: ~18 GB at most. Masked, 3.2e9 (4.6e9) elements: x, the
  mask, its int16 (int8) copy and y ~23 (~27) GB; x and the mask are freed before dy is drawn,
  after which y, dy and dx hold ~19 (~27) GB, ~36 GB while dy's random bits are drawn."""
  masked = mask_fraction is not None
  n_rows = _rows_past_boundary(n, mask_fraction or 1.0625)
  keys = jax.random.split(_key(rng), 3)
  # The mask first: its random bits (and uniforms, should XLA not fuse them) are the largest
  # temporaries of the test.
  mask = jax.random.bernoulli(keys[1], 0.7, (n_rows, n)) if masked else None
  x = _normal(keys[0], (n_rows, n), BF16, 2.0)
  fn = jaxfuse.softmax if name == "softmax" else jaxfuse.log_softmax
  y, vjp = _run(impl, lambda: jax.vjp(
      lambda x: fn(x, mask=mask, implementation=impl), x))
  rows = _checked(n_rows, n)
  x_rows = _take(x, rows)
  keep = _take(mask, rows) != 0 if masked else np.ones(x_rows.shape, bool)
  y_rows = _take(y, rows)
  del x, mask, y
  dy = _normal(keys[2], (n_rows, n))
  (dx,) = vjp(dy)
  del vjp
  y_ref, dx_ref = _softmax_reference(name, x_rows, keep, _take(dy, rows))
  assert_close(y_rows, y_ref, BF16, name="y")
  assert_close(_take(dx, rows), dx_ref, BF16, factor=4, name="dx")


# --------------------------------------------------------------------------- cross-entropy


def _cross_entropy_reference(logits, labels, cotangent):
  """float64 per-row losses and their gradient for per-row cotangents."""
  shifted = logits - logits.max(-1, keepdims=True)
  log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  picked = np.arange(len(labels))
  loss = -log_p[picked, labels]
  grad = np.exp(log_p)
  grad[picked, labels] -= 1.0
  return loss, grad * cotangent[:, None]


@jax.jit
def _mean_cross_entropy_f32(logits, labels):
  logits = logits.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
  return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


# (implementation, classes): Triton over rows of one tile and rows walked in chunks, CUDA, and
# None at 4096 (Triton) and 32768 (CUDA where it runs).
CROSS_ENTROPY_CASES = [("triton", 4096), ("triton", 32768), ("cuda", 32768), (None, 4096),
                       (None, 32768)]


@pytest.mark.gpu
@pytest.mark.parametrize("impl,vocab", CROSS_ENTROPY_CASES, ids=str)
def test_softmax_cross_entropy(rng, impl, vocab):
  """Per-row losses with the gradient of a random cotangent (the loss and gradient kernels),
  then the mean with its gradient (the fused kernel): 2.28e9 bf16 logits and one gradient,
  ~10 GB."""
  n_rows = _rows_past_boundary(vocab)
  keys = jax.random.split(_key(rng), 3)
  logits = _normal(keys[0], (n_rows, vocab), BF16, 2.0)
  labels = jax.random.randint(keys[1], (n_rows,), 0, vocab, jnp.int32)
  cotangent = _normal(keys[2], (n_rows,), jnp.float32)
  rows = _checked(n_rows, vocab)
  logit_rows, label_rows = _take(logits, rows), np.asarray(labels)[rows]
  loss_ref, grad_ref = _cross_entropy_reference(logit_rows, label_rows,
                                                np.asarray(cotangent, np.float64)[rows])

  loss, vjp = _run(impl, lambda: jax.vjp(lambda l: jaxfuse.softmax_cross_entropy(
      l, labels, reduction="none", implementation=impl), logits))
  (grad,) = vjp(cotangent)
  del vjp
  assert_close(np.asarray(loss)[rows][:, None], loss_ref[:, None], jnp.float32, name="loss")
  assert_close(_take(grad, rows), grad_ref, BF16, factor=4, name="gradient")
  del grad

  mean, grad = jax.value_and_grad(lambda l: jaxfuse.softmax_cross_entropy(
      l, labels, implementation=impl))(logits)
  assert_close(np.asarray(mean).reshape(1, 1),
               np.asarray(_mean_cross_entropy_f32(logits, labels)).reshape(1, 1),
               jnp.float32, factor=4, name="mean loss")
  ones = np.full(len(rows), 1.0 / n_rows)
  assert_close(_take(grad, rows), _cross_entropy_reference(logit_rows, label_rows, ones)[1],
               BF16, factor=4, name="gradient of the mean")


# --------------------------------------------------------------------------- attention


def _attention_reference(q, k, v, do, positions, window):
  """float64 (out, dq, dk, dv) of q ``(T, N, H)`` against k, v ``(T, K, H)`` at the same
  absolute ``positions``: causal with ``window`` keys back, or unmasked (None)."""
  scale = 1.0 / np.sqrt(q.shape[-1])
  group = q.shape[1] // k.shape[1]
  # Head-major (N, T, H), so that every product is a batched matrix product.
  q, do = q.transpose(1, 0, 2), do.transpose(1, 0, 2)
  k, v = (np.repeat(a, group, axis=1).transpose(1, 0, 2) for a in (k, v))
  scores = q @ k.transpose(0, 2, 1) * scale
  if window is not None:
    behind = positions[:, None] - positions[None, :]
    scores = np.where((behind >= 0) & (behind <= window), scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = p @ v
  dp, delta = do @ v.transpose(0, 2, 1), (do * out).sum(-1)[..., None]
  ds = p * (dp - delta)
  dq = ds @ k * scale
  dk = ds.transpose(0, 2, 1) @ q * scale
  dv = p.transpose(0, 2, 1) @ do
  per_kv_head = lambda g: g.reshape(-1, group, *g.shape[1:]).sum(1)
  # Per row of dq and dk, the size of the terms each sums, their rounding adding in quadrature:
  # where a query sees one key (the window's first position) dq cancels to ~0, and the
  # rounding of dP and D, not its own size, bounds the error.
  terms = (p * (np.abs(dp) + np.abs(delta))) ** 2
  norms = lambda a: (a * a).sum(-1, keepdims=True)
  dq_floor = scale * np.sqrt(terms @ norms(k))
  dk_floor = scale * np.sqrt(per_kv_head(terms.transpose(0, 2, 1) @ norms(q)))
  return (tuple(a.transpose(1, 0, 2) for a in (out, dq, per_kv_head(dk), per_kv_head(dv))),
          tuple(a.transpose(1, 0, 2) for a in (dq_floor, dk_floor)))


# Large batch: (B, T, N, K, H) of 2176 x 256 x 32 x 32 x 128, 2.28e9 elements in each of q, k,
# v and the output, unmasked; element 2^31 opens batch 2048. Long sequence: 69632 positions x
# 256 query heads (64 key/value heads) x 128, causal with a window of 255 keys back; element
# 2^31 opens position 65536. cuDNN without tile skipping for the window would spend ~3e14
# FLOPs on it, under 3 s.
ATTENTION_CASES = {"large_batch": ((2176, 256, 32, 32, 128), None),
                   "long_sequence": ((1, 69632, 256, 64, 128), 255)}


def _attention_checks(case, b, t, n, kv_heads, h):
  """``(batch, positions, query heads, key/value heads)`` to check: whole batches at both ends
  and on either side of element 2^31 for the large batch; for the long sequence, positions at
  both ends and on either side of element 2^31, in the first and last groups of heads."""
  if case == "large_batch":
    middle = BOUNDARY // (t * n * h)
    return [(i, np.arange(t), np.arange(n), np.arange(kv_heads))
            for i in (0, 1, middle - 1, middle, b - 2, b - 1)]
  group = n // kv_heads
  heads = np.r_[0:group, n - group:n]
  middle = BOUNDARY // (n * h)
  return [(0, np.arange(start, start + 4), heads, heads[::group] // group)
          for start in (0, middle - 2, t - 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cudnn", None], ids=str)
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention(rng, impl, case):
  """q, k, v, the output, its cotangent and the three gradients: ~37 GB for the large batch
  (plus any workspace of cuDNN's), ~23 GB for the long sequence."""
  (b, t, n, kv_heads, h), window = ATTENTION_CASES[case]
  keys = jax.random.split(_key(rng), 4)
  q = _normal(keys[0], (b, t, n, h))
  k, v = (_normal(key, (b, t, kv_heads, h)) for key in keys[1:3])
  kwargs = {} if window is None else dict(is_causal=True, local_window_size=(window, 0))
  out, vjp = _run(impl, lambda: jax.vjp(
      lambda q, k, v: jaxfuse.attention(q, k, v, implementation=impl, **kwargs), q, k, v))
  do = _normal(keys[3], out.shape)
  dq, dk, dv = vjp(do)
  del vjp
  for batch, positions, heads, kv_picked in _attention_checks(case, b, t, n, kv_heads, h):
    # The span holds every key the checked queries see, and every query that sees the checked
    # keys with every key that query sees: two windows either side (whole sequences unmasked).
    reach = t if window is None else 2 * window
    lo, hi = max(0, positions[0] - reach), min(t, positions[-1] + 1 + reach)
    span = lambda a, picked: _take(a[batch, lo:hi], picked, axis=1)
    expected, (dq_floor, dk_floor) = _attention_reference(
        span(q, heads), span(k, kv_picked), span(v, kv_picked), span(do, heads),
        np.arange(lo, hi), window)
    floors = (0.0, dq_floor, dk_floor, 0.0)
    for name, value, ref, picked, floor in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv),
                                               expected, (heads, heads, kv_picked, kv_picked),
                                               floors):
      got = span(value, picked)[positions - lo]
      floor = floor if np.ndim(floor) == 0 else floor[positions - lo].reshape(-1, 1)
      assert_close(got.reshape(-1, h), ref[positions - lo].reshape(-1, h), BF16,
                   factor=1 if name == "out" else 4, name=f"{name} of batch {batch}",
                   floor=floor)


# --------------------------------------------------------------------------- MLP


def _gelu_mlp_reference(x, w1, b1, w2, b2, dy):
  """float64 y and dx of rows of x, tanh GELU."""
  c, a = np.sqrt(2 / np.pi), 0.044715
  z = x @ w1 + b1
  t = np.tanh(c * (z + a * z**3))
  y = (0.5 * z * (1 + t)) @ w2 + b2
  gelu_grad = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * a * z * z)
  return y, ((dy @ w2.T) * gelu_grad) @ w1.T


@jax.jit
def _gelu_mlp_param_grads_f32(x, w1, b1, w2, b2, dy):
  """The four parameters' gradients over every row, in float32 XLA."""
  up = lambda a: a.astype(jnp.float32)
  dot = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
  loss = lambda w1, b1, w2, b2: jnp.sum(
      (dot(jax.nn.gelu(dot(up(x), w1) + b1), w2) + b2) * up(dy))
  return jax.grad(loss, argnums=(0, 1, 2, 3))(*map(up, (w1, b1, w2, b2)))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", None], ids=str)
def test_gelu_mlp(rng, impl):
  """A hidden layer of 2.28e9 bf16 elements (1.1e6 rows of 2048; x and y 64 wide): ~9 GB for
  the kernels' held and gradient hidden layers, ~30 GB with the float32 reference."""
  d, f = 64, 2048
  n_rows = _rows_past_boundary(f)
  keys = jax.random.split(_key(rng), 6)
  x = _normal(keys[0], (n_rows, d))
  w1, w2 = _normal(keys[1], (d, f), BF16, d**-0.5), _normal(keys[2], (f, d), BF16, f**-0.5)
  b1, b2 = _normal(keys[3], (f,), BF16, 0.5), _normal(keys[4], (d,), BF16, 0.5)
  params = (w1, b1, w2, b2)
  y, vjp = _run(impl, lambda: jax.vjp(
      lambda x, *p: jaxfuse.gelu_mlp(x, *p, implementation=impl), x, *params))
  dy = _normal(keys[5], y.shape)
  dx, *param_grads = vjp(dy)
  del vjp
  rows = _checked(n_rows, f)
  as64 = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
  y_ref, dx_ref = _gelu_mlp_reference(_take(x, rows), *map(as64, params), _take(dy, rows))
  assert_close(_take(y, rows), y_ref, BF16, name="y")
  assert_close(_take(dx, rows), dx_ref, BF16, factor=4, name="dx")
  del y, dx
  expected = _gelu_mlp_param_grads_f32(x, *params, dy)
  for name, grad, ref in zip(("dw1", "db1", "dw2", "db2"), param_grads, expected):
    assert_close(np.atleast_2d(np.asarray(grad.astype(jnp.float32))),
                 np.atleast_2d(np.asarray(ref)), BF16, factor=2, name=name)
