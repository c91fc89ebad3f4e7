"""The CUDA kernels' FFI targets called directly, as any caller could: each handler checks every
operand's size and dtype against the others and every attribute against what the kernels are
built for, before it launches, so a mismatch raises an error naming it (never a crash, a hang
or an out-of-bounds write), and well-formed calls are right. The norm backward's parameter
gradients (summed per cluster, then over the clusters in a fixed order, norm.cu) repeat bit
for bit.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse._core.testing import assert_close, random

GROUPS, ROWS, N = 2, 37, 4096
CLUSTERS = 3  # fewer than the rows: each cluster walks several
EPS = 1e-5


def _attrs(**attrs):
  """Attributes typed as the handlers bind them: float32 for floats, int64 for the rest."""
  return {k: np.float32(v) if isinstance(v, float) else np.int64(v) for k, v in attrs.items()}


def _tiling_attrs(t):
  return _attrs(cluster=t.cluster, threads=t.threads, units=t.units, stages=t.stages)


@dataclasses.dataclass
class Call:
  """One FFI call: operands and results by name, in the handler's order."""
  target: str
  args: dict
  outs: dict
  attrs: dict

  def run(self):
    call = jax.ffi.ffi_call(self.target, tuple(self.outs.values()))
    return jax.block_until_ready(call(*self.args.values(), **self.attrs))


def attrs(**changes):
  return lambda call: call.attrs.update(_attrs(**changes))


def arg(name, change):
  return lambda call: call.args.update({name: change(call.args[name])})


def out(name, shape=None, dtype=None):
  def change(call):
    old = call.outs[name]
    call.outs[name] = jax.ShapeDtypeStruct(old.shape if shape is None else shape,
                                           old.dtype if dtype is None else dtype)
  return change


def shorter_rows(*args, outs=()):
  """Rows of N - 4 elements in every operand and result that holds rows."""
  return [arg(a, lambda v: v[..., :-4]) for a in args] + [
      lambda call, o=o: call.outs.update(
          {o: jax.ShapeDtypeStruct(call.outs[o].shape[:-1] + (N - 4,), call.outs[o].dtype)})
      for o in outs]


def _norm_cuda():
  from jaxfuse.ops.norm import cuda as norm_cuda
  norm_cuda._library()  # builds the library and registers its targets
  return norm_cuda


def _softmax_cuda():
  from jaxfuse.ops.softmax import cuda as softmax_cuda
  softmax_cuda._library()
  return softmax_cuda


def norm_forward_call(rng):
  """LayerNorm over (G, R, N) bf16 with per-group bf16 weight and bias."""
  norm_cuda = _norm_cuda()
  t = norm_cuda.forward_tiling(N, jnp.bfloat16)
  stat = jax.ShapeDtypeStruct((GROUPS, ROWS), jnp.float32)
  return Call(
      "jaxfuse_norm_forward",
      dict(x=random(rng, (GROUPS, ROWS, N), jnp.bfloat16, offset=1.0),
           weight=random(rng, (GROUPS, N), jnp.bfloat16, scale=0.5, offset=1.0),
           bias=random(rng, (GROUPS, N), jnp.bfloat16, scale=0.5)),
      dict(y=jax.ShapeDtypeStruct((GROUPS, ROWS, N), jnp.bfloat16), mean=stat, rstd=stat),
      _attrs(eps=EPS, lanes=t.lanes, clusters=CLUSTERS, layer=1, has_weight=1, has_bias=1)
      | _tiling_attrs(t))


def norm_backward_call(rng):
  """LayerNorm's backward over (G, R, N) bf16, its two gradients of different dtypes (dweight
  bf16, dbias float32), each written in its own."""
  norm_cuda = _norm_cuda()
  t = norm_cuda.backward_tiling(N, jnp.bfloat16)
  x = random(rng, (GROUPS, ROWS, N), jnp.bfloat16, offset=1.0)
  x64 = np.asarray(x, np.float64)
  mean = x64.mean(-1)
  rstd = 1 / np.sqrt(x64.var(-1) + EPS)
  return Call(
      "jaxfuse_norm_backward",
      dict(dy=random(rng, x.shape, jnp.bfloat16), x=x,
           weight=random(rng, (GROUPS, N), jnp.bfloat16, scale=0.5, offset=1.0),
           mean=jnp.asarray(mean, jnp.float32), rstd=jnp.asarray(rstd, jnp.float32)),
      dict(dx=jax.ShapeDtypeStruct(x.shape, jnp.bfloat16),
           dweight=jax.ShapeDtypeStruct((GROUPS, N), jnp.bfloat16),
           dbias=jax.ShapeDtypeStruct((GROUPS, N), jnp.float32),
           partials=jax.ShapeDtypeStruct((2, GROUPS, CLUSTERS, N), jnp.float32)),
      _attrs(lanes=t.lanes, clusters=CLUSTERS, layer=1, has_weight=1, has_bias=1)
      | _attrs(cluster=t.cluster, threads=t.threads, units=t.units))


def softmax_forward_call(rng):
  t = _softmax_cuda().forward_tiling(N, jnp.bfloat16)
  return Call("jaxfuse_softmax_forward",
              dict(x=random(rng, (ROWS, N), jnp.bfloat16, scale=3.0),
                   mask=jnp.asarray(rng.random((ROWS * N,)) > 0.3)),
              dict(y=jax.ShapeDtypeStruct((ROWS, N), jnp.bfloat16)),
              _attrs(scale=0.7, log=0, causal_rows=0, causal_offset=0, has_mask=1,
                     mask_column_stride=1, clusters=CLUSTERS) | _tiling_attrs(t)
              | mask_reading([ROWS], [N]))


def mask_reading(sizes, strides):
  """The softmax forward's (size, stride) groups of its mask's rows, as int64 array attributes."""
  return dict(mask_sizes=np.array(sizes, np.int64), mask_strides=np.array(strides, np.int64))


def softmax_backward_call(rng):
  t = _softmax_cuda().backward_tiling(N, jnp.bfloat16)
  y = jax.nn.softmax(random(rng, (ROWS, N), jnp.float32, scale=3.0)).astype(jnp.bfloat16)
  return Call("jaxfuse_softmax_backward",
              dict(y=y, dy=random(rng, (ROWS, N), jnp.bfloat16)),
              dict(dx=jax.ShapeDtypeStruct((ROWS, N), jnp.bfloat16)),
              _attrs(scale=0.7, log=0, causal_rows=0, causal_offset=0, clusters=CLUSTERS)
              | _tiling_attrs(t))


def cross_entropy_call(rng):
  """The fused loss and gradient, a cotangent scale per row, no bias (an empty one), every
  column a class."""
  t = _softmax_cuda().cross_entropy_tiling(N, jnp.bfloat16)
  return Call(
      "jaxfuse_cross_entropy",
      dict(logits=random(rng, (ROWS, N), jnp.bfloat16, scale=2.0),
           labels=jnp.asarray(rng.integers(0, N, (ROWS,)), jnp.int32),
           row_scale=random(rng, (ROWS,), jnp.float32, scale=0.1, offset=1.0),
           bias=jnp.zeros((0,), jnp.float32)),
      dict(loss=jax.ShapeDtypeStruct((ROWS,), jnp.float32),
           grad=jax.ShapeDtypeStruct((ROWS, N), jnp.bfloat16)),
      _attrs(smoothing=0.0, z_loss=0.0, ignore_index=0, has_ignore=0, with_grad=1, counted=N,
             clusters=CLUSTERS) | _tiling_attrs(t))


CALLS = {"norm_forward": norm_forward_call, "norm_backward": norm_backward_call,
         "softmax_forward": softmax_forward_call, "softmax_backward": softmax_backward_call,
         "cross_entropy": cross_entropy_call}

# The tiling checks every handler makes (rows.cuh check_tiling, then each kernel's dispatch).
TILING_CASES = [
    ("cluster above 16", [attrs(cluster=17)], "cluster=17"),
    ("cluster zero", [attrs(cluster=0)], "cluster=0"),
    ("threads not whole warps", [attrs(threads=48)], "threads=48"),
    ("threads above 512", [attrs(threads=1024)], "threads=1024"),
    ("units out of range", [attrs(units=16)], "units=16"),
    ("units not built", [attrs(threads=512, units=3)], "no kernel is built"),
    ("row beyond capacity", [attrs(threads=32, units=1)], "holds 256 elements"),
    ("no clusters", [attrs(clusters=0)], "clusters=0"),
    ("clusters beyond the grid", [attrs(clusters=2**31)], "clusters=2147483648"),
]
STAGED_CASES = [("stages out of range", [attrs(stages=5)], "stages=5")]
LANES_CASES = [
    ("lanes not a power of two", [attrs(lanes=12)], "lanes=12"),
    ("lanes above 32", [attrs(lanes=64)], "lanes=64"),
    ("lanes in a cluster", [attrs(cluster=2, lanes=16)], "lanes=16"),
]

BAD_CALLS = {
    "norm_forward": TILING_CASES + STAGED_CASES + LANES_CASES + [
        ("x rank", [arg("x", lambda x: x[0])], r"x must be \(G, R, N\)"),
        ("x dtype", [arg("x", lambda x: x.astype(jnp.int32))], "x is int32"),
        ("y shape", [out("y", shape=(GROUPS, ROWS + 1, N))], "y has shape"),
        ("y dtype", [out("y", dtype=jnp.float16)], "y is float16"),
        ("weight length", [arg("weight", lambda w: w[:, :-8])], "weight has 8176 elements"),
        ("bias length", [arg("bias", lambda b: b[:1])], "bias has 4096 elements"),
        ("bias dtype", [arg("bias", lambda b: b.astype(jnp.float32))], "bias is float32"),
        ("absent weight of neither size", [attrs(has_weight=0), arg("weight", lambda w: w[:1])],
         r"weight \(unused\) has 4096 elements"),
        ("mean length", [out("mean", shape=(GROUPS, ROWS - 1))], "mean has 72 elements"),
        ("rstd dtype", [out("rstd", dtype=jnp.bfloat16)], "rstd is bfloat16"),
        ("eps", [attrs(eps=float("nan"))], "eps="),
        ("flag", [attrs(layer=2)], "layer=2"),
        ("rows not a multiple of 8",
         shorter_rows("x", "weight", "bias", outs=("y",)), "rows of 4092 elements"),
        ("staged CTAs too large", [attrs(stages=1, threads=512, units=8)], "no kernel is built"),
        ("RMSNorm with a bias", [attrs(layer=0)], r"RMSNorm \(layer=0\) has no bias"),
    ],
    "norm_backward": TILING_CASES + LANES_CASES + [
        ("x rank", [arg("x", lambda x: x[None])], r"x must be \(G, R, N\)"),
        ("dy shape", [arg("dy", lambda dy: dy[:, 1:])], "dy has shape"),
        ("dy dtype", [arg("dy", lambda dy: dy.astype(jnp.float16))], "dy is float16"),
        ("weight length", [arg("weight", lambda w: w[:1])], "weight has 4096 elements"),
        ("mean length", [arg("mean", lambda m: m[:, 1:])], "mean has 72 elements"),
        ("RMSNorm's unused mean of neither size", [attrs(layer=0), arg("mean", lambda m: m[:1])],
         r"mean \(unused\) has 37 elements"),
        ("rstd length", [arg("rstd", lambda r: r[:1])], "rstd has 37 elements"),
        ("dx dtype", [out("dx", dtype=jnp.float32)], "dx is float32"),
        ("dx shape", [out("dx", shape=(GROUPS * ROWS, N))], "dx has shape"),
        ("dweight length", [out("dweight", shape=(GROUPS, N - 8))], "dweight has 8176 elements"),
        ("dweight dtype", [out("dweight", dtype=jnp.int32)], "dweight is int32"),
        ("absent dbias not one element", [attrs(has_bias=0)],
         "dbias is absent but has 8192 elements"),
        ("partials for other clusters", [out("partials", shape=(2, GROUPS, CLUSTERS + 1, N))],
         "partials has"),
        ("partials dtype", [out("partials", dtype=jnp.bfloat16)], "partials is bfloat16"),
        ("flag", [attrs(has_weight=3)], "has_weight=3"),
        ("RMSNorm with a bias", [attrs(layer=0)], r"RMSNorm \(layer=0\) has no bias"),
        ("rows not a multiple of 8",
         shorter_rows("dy", "x", "weight", outs=("dx", "dweight", "dbias")),
         "rows of 4092 elements"),
    ],
    "softmax_forward": TILING_CASES + STAGED_CASES + [
        ("x rank", [arg("x", lambda x: x[None])], r"x must be \(R, N\)"),
        ("x dtype", [arg("x", lambda x: x.astype(jnp.int32))], "x is int32"),
        ("y shape", [out("y", shape=(ROWS + 1, N))], "y has shape"),
        ("y dtype", [out("y", dtype=jnp.float32)], "y is float32"),
        ("scale", [attrs(scale=float("inf"))], "scale="),
        ("flag", [attrs(log=2)], "log=2"),
        ("rows not a multiple of 8", shorter_rows("x", outs=("y",)), "rows of 4092 elements"),
        ("causal rows that do not divide the rows", [attrs(causal_rows=5)],
         "causal_rows=5 does not divide the 37 rows"),
        ("causal offset", [attrs(causal_rows=ROWS, causal_offset=-ROWS - 1)], "causal_offset="),
        ("mask dtype", [arg("mask", lambda m: m.astype(jnp.int8))], "mask is int8, not bool"),
        ("mask groups of two lengths",
         [lambda call: call.attrs.update(mask_reading([ROWS], [N, 0]))], "mask_strides have"),
        ("mask groups for other rows",
         [lambda call: call.attrs.update(mask_reading([ROWS - 1], [N]))],
         "mask_sizes multiply to 36"),
        ("mask read past its end",
         [lambda call: call.attrs.update(mask_reading([ROWS], [N + 8]))],
         "mask_strides reach element"),
        ("mask rows off the 8-element grid",
         [lambda call: call.attrs.update(mask_reading([ROWS], [4]))], "multiples of 8"),
        ("mask column stride", [attrs(mask_column_stride=2)], "mask_column_stride=2"),
    ],
    "softmax_backward": TILING_CASES + [
        ("y rank", [arg("y", lambda y: y[0])], r"y must be \(R, N\)"),
        ("dy shape", [arg("dy", lambda dy: dy[1:])], "dy has shape"),
        ("dy dtype", [arg("dy", lambda dy: dy.astype(jnp.float32))], "dy is float32"),
        ("dx shape", [out("dx", shape=(ROWS, 2 * N))], "dx has shape"),
        ("staged", [attrs(stages=1)], "stages=1"),
        ("scale", [attrs(scale=float("nan"))], "scale="),
        ("rows not a multiple of 8", shorter_rows("y", "dy", outs=("dx",)),
         "rows of 4092 elements"),
        ("causal rows that do not divide the rows", [attrs(causal_rows=5)],
         "causal_rows=5 does not divide the 37 rows"),
        ("causal offset", [attrs(causal_rows=ROWS, causal_offset=N + 1)], "causal_offset="),
    ],
    "cross_entropy": TILING_CASES + STAGED_CASES + [
        ("logits rank", [arg("logits", lambda x: x[None])], r"logits must be \(R, N\)"),
        ("labels length", [arg("labels", lambda l: l[:-1])], "labels has 36 elements"),
        ("labels dtype", [arg("labels", lambda l: l.astype(jnp.uint32))], "Wrong buffer dtype"),
        ("row_scale length", [arg("row_scale", lambda s: s[:2])], "row_scale has 2 elements"),
        ("bias length", [arg("bias", lambda b: jnp.ones((3,), jnp.float32))],
         "bias has 3 elements"),
        ("loss length", [out("loss", shape=(ROWS - 1,))], "loss has 36 elements"),
        ("grad shape", [out("grad", shape=(ROWS - 1, N))], "grad has shape"),
        ("grad dtype", [out("grad", dtype=jnp.float32)], "grad is float32"),
        ("lse dtype", [attrs(with_grad=0)], "lse is bfloat16"),
        ("lse length", [attrs(with_grad=0), out("grad", shape=(ROWS + 1,), dtype=jnp.float32)],
         "lse has 38 elements"),
        ("smoothing", [attrs(smoothing=1.0)], "smoothing="),
        ("z_loss", [attrs(z_loss=-1.0)], "z_loss="),
        ("ignore_index beyond int32", [attrs(ignore_index=2**40)], "ignore_index="),
        ("flag", [attrs(has_ignore=2)], "has_ignore=2"),
        ("classes beyond the row", [attrs(counted=N + 1)], "counted=4097"),
        ("rows not a multiple of 8",
         shorter_rows("logits", outs=("grad",)) + [attrs(counted=N - 4)],
         "rows of 4092 elements"),
    ],
}


@pytest.mark.gpu
@pytest.mark.parametrize("target,changes,match", [
    pytest.param(target, changes, match, id=f"{target}: {case}")
    for target, cases in BAD_CALLS.items() for case, changes, match in cases])
def test_gpu_malformed_call_raises(rng, target, changes, match):
  """Each check class of each handler: the call raises, naming the operand or attribute."""
  call = CALLS[target](rng)
  for change in changes:
    change(call)
  with pytest.raises(jax.errors.JaxRuntimeError, match=match):
    call.run()
  # The refusal launched nothing and left the GPU usable.
  CALLS[target](rng).run()


def _norm_statistics(x, *, layer):
  """float64 (x_hat, rstd) of LayerNorm (RMSNorm without ``layer``) over the last axis."""
  x = np.asarray(x, np.float64)
  centered = x - x.mean(-1, keepdims=True) if layer else x
  rstd = 1 / np.sqrt((centered ** 2).mean(-1, keepdims=True) + EPS)
  return centered * rstd, rstd


def _norm_gradients(x, w, dy, *, layer):
  """float64 (dx, dweight, dbias) over (G, R, N) with (G, N) weights."""
  x_hat, rstd = _norm_statistics(x, layer=layer)
  dy = np.asarray(dy, np.float64)
  g = dy * np.asarray(w, np.float64)[:, None]
  c1 = g.mean(-1, keepdims=True) if layer else 0.0
  dx = rstd * (g - c1 - x_hat * (g * x_hat).mean(-1, keepdims=True))
  return dx, (dy * x_hat).sum(1), dy.sum(1)


@pytest.mark.gpu
def test_gpu_well_formed_norm_calls(rng):
  forward = norm_forward_call(rng)
  y, mean, rstd = forward.run()
  x, w, b = (np.asarray(a, np.float64) for a in forward.args.values())
  x_hat, rstd_ref = _norm_statistics(x, layer=True)
  assert_close(y, x_hat * w[:, None] + b[:, None], name="y")
  assert_close(mean, x.mean(-1), name="mean")
  assert_close(rstd, rstd_ref[..., 0], name="rstd")

  backward = norm_backward_call(rng)
  dx, dweight, dbias, _ = backward.run()
  dy, x, w, _, _ = backward.args.values()
  dx_ref, dw_ref, db_ref = _norm_gradients(x, w, dy, layer=True)
  assert (dweight.dtype, dbias.dtype) == (jnp.bfloat16, jnp.float32)
  assert_close(dx, dx_ref, factor=4, name="dx")
  assert_close(dweight, dw_ref, factor=4, name="dweight")
  assert_close(dbias, db_ref, factor=4, name="dbias")


@pytest.mark.gpu
def test_gpu_well_formed_softmax_calls(rng):
  forward = softmax_forward_call(rng)
  (y,) = forward.run()
  keep = np.asarray(forward.args["mask"]).reshape(ROWS, N)
  z = np.where(keep, 0.7 * np.asarray(forward.args["x"], np.float64), -np.inf)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  assert_close(y, p, name="softmax")

  backward = softmax_backward_call(rng)
  (dx,) = backward.run()
  y, dy = (np.asarray(a, np.float64) for a in backward.args.values())
  assert_close(dx, 0.7 * y * (dy - (dy * y).sum(-1, keepdims=True)), factor=4, name="dx")

  call = cross_entropy_call(rng)
  loss, grad = call.run()
  logits, labels, row_scale, _ = (np.asarray(a, np.float64) for a in call.args.values())
  labels = labels.astype(np.int64)
  top = logits.max(-1, keepdims=True)
  lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[:, 0]
  rows = np.arange(ROWS)
  assert_close(loss, lse - logits[rows, labels], name="loss")
  expected = np.exp(logits - lse[:, None])
  expected[rows, labels] -= 1
  assert_close(grad, expected * row_scale[:, None], factor=4, name="grad")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("shape", [(4096, 256), (64, 32768)], ids=str)
def test_gpu_norm_backward_param_grads_repeat_bitwise(rng, kind, shape):
  """Short rows (hundreds of partials, one per CTA) and long ones (a partial per cluster):
  weight and bias gradients of their parameters' dtypes (bf16 weight, float32 bias), the same
  bits on a second run, and right against float64."""
  n = shape[-1]
  if reason := _norm_cuda().unsupported(n, jnp.bfloat16, jnp.float32, [jnp.bfloat16]):
    pytest.skip(reason)
  x = random(rng, shape, jnp.bfloat16, offset=1.0 if kind == "layer" else 0.0)
  w = random(rng, (n,), jnp.bfloat16, scale=0.5, offset=1.0)
  b = random(rng, (n,), jnp.float32, scale=0.5) if kind == "layer" else None
  present = [a for a in (x, w, b) if a is not None]
  norm = functools.partial(jaxfuse.layer_norm if kind == "layer" else jaxfuse.rms_norm, eps=EPS,
                           implementation="cuda")
  y_dtype = jnp.result_type(*present)
  dy = random(rng, shape, y_dtype)
  step = jax.jit(lambda *a: jax.vjp(norm, *a)[1](dy))
  first, second = step(*present), step(*present)
  for a, c in zip(first, second):
    assert np.asarray(a).tobytes() == np.asarray(c).tobytes()
  _, dw_ref, db_ref = _norm_gradients(x[None], w[None], dy[None], layer=kind == "layer")
  assert first[1].dtype == w.dtype
  assert_close(first[1], dw_ref[0], factor=4, name="dweight")
  if b is not None:
    assert first[2].dtype == b.dtype
    assert_close(first[2], db_ref[0], factor=4, name="dbias")
