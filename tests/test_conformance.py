"""Every op under every implementation behaves as a JAX function: jit gives the eager bits,
gradients agree with XLA's, vmap over a leading or an inner axis is the loop of calls,
``jax.checkpoint`` changes nothing, second derivatives are XLA's or a named refusal, a
batch-sharded input is never all-gathered, and a non-float input is refused naming the
argument.

The CPU runs 'xla' and the Pallas Triton kernels (interpreted); a GPU adds 'cuda', 'mosaic' and
'cudnn' (tests marked ``gpu``). Per-family tests check the values against float64.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse


@dataclasses.dataclass(frozen=True)
class Op:
  """An op as the conformance tests see it: ``call(impl, *args)`` on ``make(rng)``'s arguments,
  differentiated with respect to ``wrt``; ``mapped`` is the argument vmap maps over (its
  leading axis is a batch axis), ``inner_axis`` an inner axis of it that vmap may also take
  (the call keeps its rank), and ``batch`` the partition spec of each argument that carries
  the batch (the others replicated)."""
  name: str
  make: Callable
  call: Callable
  impls: tuple[str, ...]
  wrt: tuple[int, ...] = (0,)
  mapped: int = 0
  inner_axis: int | None = 1
  batch: tuple = (P("batch"),)
  tolerance: float = 2e-5
  sixteen_bit: tuple[str, ...] = ()  # implementations that take 16-bit inputs only
  # How far a batch-sharded call's gradients may move from one device's: 16-bit gradients
  # summed over the batch's shards round once more there.
  sharded_tolerance: float = 1e-5
  xla_twice: bool = True  # whether 'xla' takes second derivatives


def _normal(rng, shape, scale=1.0):
  return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def _norm_args(rng):
  return _normal(rng, (6, 40)), 1.0 + _normal(rng, (40,), 0.1), _normal(rng, (40,), 0.1)


def _ce_args(rng):
  return _normal(rng, (6, 56), 2.0), jnp.asarray(rng.integers(0, 56, (6,)), jnp.int32)


def _lce_args(rng):
  return (_normal(rng, (6, 16)), _normal(rng, (16, 40), 0.25),
          jnp.asarray(rng.integers(0, 40, (6,)), jnp.int32))


def _mlp_args(rng):
  return (_normal(rng, (6, 16)), _normal(rng, (16, 40), 0.25), _normal(rng, (40,), 0.1),
          _normal(rng, (40, 16), 0.25), _normal(rng, (16,), 0.1))


def _attention_args(rng):
  return tuple(_normal(rng, (2, 24, 2, 64)) for _ in range(3))


def _rnn_args(rng, cell):
  count = (jaxfuse.lstm_weight_count if cell == "lstm" else jaxfuse.gru_weight_count)(8, 16, 1)
  states = (_normal(rng, (1, 4, 16)),) * (2 if cell == "lstm" else 1)
  return (_normal(rng, (4, 7, 8)), *states, _normal(rng, (count,), 0.3),
          jnp.asarray([7, 5, 2, 6], jnp.int32))


def _rnn_call(cell):
  def call(impl, x, *rest):
    out = getattr(jaxfuse, cell)(x, *rest, input_size=8, hidden_size=16, num_layers=1,
                                 precision=HIGHEST, implementation=impl)
    return out[0]
  return call


def _attention(impl, q, k, v):
  # float32 products in full precision, as the XLA reference takes them; cuDNN and Mosaic
  # take 16-bit inputs and no precision.
  precision = None if impl in ATTENTION_SIXTEEN_BIT else HIGHEST
  return jaxfuse.attention(q, k, v, is_causal=True, precision=precision, implementation=impl)


GPU = ("cuda",)
# float32 matrix products on a GPU default to TF32; the comparisons want full precision.
HIGHEST = jax.lax.Precision.HIGHEST
# cuDNN's and Mosaic's attention take 16-bit inputs.
ATTENTION_SIXTEEN_BIT = ("mosaic", "cudnn")
OPS = [
    Op("rms_norm", _norm_args, lambda impl, x, w, b: jaxfuse.rms_norm(x, w, implementation=impl),
       ("xla", "triton") + GPU, wrt=(0, 1)),
    Op("layer_norm", _norm_args,
       lambda impl, x, w, b: jaxfuse.layer_norm(x, w, b, implementation=impl),
       ("xla", "triton") + GPU, wrt=(0, 1, 2)),
    Op("softmax", lambda rng: (_normal(rng, (6, 48), 3.0),),
       lambda impl, x: jaxfuse.softmax(x, implementation=impl), ("xla", "triton") + GPU),
    Op("log_softmax", lambda rng: (_normal(rng, (6, 48), 3.0),),
       lambda impl, x: jaxfuse.log_softmax(x, implementation=impl), ("xla", "triton") + GPU),
    Op("softmax_cross_entropy", _ce_args,
       lambda impl, x, y: jaxfuse.softmax_cross_entropy(x, y, reduction="none",
                                                        implementation=impl),
       ("xla", "triton") + GPU, inner_axis=None, batch=(P("batch"), P("batch"))),
    Op("linear_cross_entropy", _lce_args,
       lambda impl, x, w, y: jaxfuse.linear_cross_entropy(x, w, y, reduction="none",
                                                         implementation=impl),
       ("xla",) + GPU, wrt=(0, 1), inner_axis=None, batch=(P("batch"), None, P("batch")),
       xla_twice=False),
    Op("gelu_mlp", _mlp_args,
       lambda impl, *a: jaxfuse.gelu_mlp(*a, implementation=impl), ("xla", "cuda"),
       wrt=(0, 1, 2, 3, 4), inner_axis=None, batch=(P("batch"), None, None, None, None),
       sixteen_bit=("cuda",), sharded_tolerance=2.0 ** -8),
    Op("attention", _attention_args, _attention,
       ("xla", "triton", "mosaic", "cudnn"), wrt=(0, 1, 2), inner_axis=2,
       batch=(P("batch"),) * 3, tolerance=1e-4, sixteen_bit=ATTENTION_SIXTEEN_BIT),
    Op("lstm", lambda rng: _rnn_args(rng, "lstm"), _rnn_call("lstm"),
       ("xla",) + GPU + ("cudnn",), wrt=(0, 3), inner_axis=None,
       batch=(P("batch"), P(None, "batch"), P(None, "batch"), None, P("batch"))),
    Op("gru", lambda rng: _rnn_args(rng, "gru"), _rnn_call("gru"), ("xla",) + GPU + ("cudnn",),
       wrt=(0, 2), inner_axis=None, batch=(P("batch"), P(None, "batch"), None, P("batch"))),
]
# Implementations the CPU runs; the others are the GPU's.
CPU_IMPLS = ("xla", "triton")
CASES = [pytest.param(op, impl, id=f"{op.name}-{impl}",
                      marks=() if impl in CPU_IMPLS else pytest.mark.gpu)
         for op in OPS for impl in op.impls]


def _args(op, impl, rng):
  args = op.make(rng)
  if impl in op.sixteen_bit:
    args = tuple(a.astype(jnp.bfloat16) for a in args)
  return args


def _loss(op, impl, args):
  def loss(*wrt):
    full = list(args)
    for i, a in zip(op.wrt, wrt):
      full[i] = a
    out = op.call(impl, *full)
    # A fixed, non-uniform cotangent: the sum alone would hide a wrong softmax gradient.
    return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape)))
  return loss


def _close(a, b, tolerance):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert a.shape == b.shape
  assert np.linalg.norm(a - b) <= tolerance * max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("op,impl", CASES)
def test_jit_gives_the_eager_bits(rng, op, impl):
  args = _args(op, impl, rng)
  eager = op.call(impl, *args)
  jitted = jax.jit(lambda *a: op.call(impl, *a))(*args)
  assert np.array_equal(np.asarray(eager), np.asarray(jitted))


@pytest.mark.parametrize("op,impl", CASES)
def test_gradients_agree_with_xla_and_survive_checkpoint(rng, op, impl):
  args = _args(op, impl, rng)
  wrt = [args[i] for i in op.wrt]
  grads = jax.jit(jax.grad(_loss(op, impl, args), argnums=tuple(range(len(wrt)))))(*wrt)
  wide = tuple(a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a
               for a in args)
  expected = jax.grad(_loss(op, "xla", wide), argnums=tuple(range(len(wrt))))(
      *[wide[i] for i in op.wrt])
  tolerance = 2e-2 if impl in op.sixteen_bit else op.tolerance
  for g, e in zip(grads, expected):
    _close(g, e, tolerance)
  remat = jax.jit(jax.grad(jax.checkpoint(_loss(op, impl, args)),
                           argnums=tuple(range(len(wrt)))))(*wrt)
  for g, r in zip(grads, remat):
    assert np.array_equal(np.asarray(g), np.asarray(r))


@pytest.mark.parametrize("op,impl", CASES)
def test_second_derivatives_agree_with_xla_or_are_refused_by_name(rng, op, impl):
  # A kernel's backward is a kernel too: differentiating it again either works as XLA's does
  # or is a NotImplementedError that says so, never an error from inside JAX.
  args = _args(op, impl, rng)
  wide = tuple(a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a
               for a in args)

  def second(impl, args):
    first = jax.grad(_loss(op, impl, args))
    return jax.grad(lambda a: jnp.sum(first(a).astype(jnp.float32) ** 2))(args[op.wrt[0]])

  if not op.xla_twice:
    with pytest.raises(NotImplementedError, match="differentiable once"):
      second(impl, args)
    return
  expected = second("xla", wide)
  assert np.all(np.isfinite(np.asarray(expected)))
  try:
    got = second(impl, args)
  except NotImplementedError as error:
    assert impl != "xla" and "differentiable once" in str(error)
    return
  _close(got, expected, 10 * (2e-2 if impl in op.sixteen_bit else op.tolerance))


def _stack_along(args, op, axis, copies=3):
  """Arguments with a new axis at ``axis`` of the mapped one (``copies`` perturbed copies), the
  others as they are."""
  mapped = args[op.mapped]
  stacked = jnp.stack([mapped * (1.0 + 0.25 * i) for i in range(copies)], axis=axis)
  return args[:op.mapped] + (stacked,) + args[op.mapped + 1:]


@pytest.mark.parametrize("axis", ["leading", "inner"])
@pytest.mark.parametrize("op,impl", CASES)
def test_vmap_over_a_leading_or_an_inner_axis_is_the_loop(rng, op, impl, axis):
  where = 0 if axis == "leading" else op.inner_axis
  if where is None:
    pytest.skip(f"{op.name} has no inner axis that keeps the call's rank")
  args = _stack_along(_args(op, impl, rng), op, where)
  in_axes = tuple(where if i == op.mapped else None for i in range(len(args)))
  batched = jax.jit(jax.vmap(lambda *a: op.call(impl, *a), in_axes=in_axes))(*args)
  for i in range(3):
    one = list(args)
    one[op.mapped] = jnp.take(args[op.mapped], i, axis=where)
    _close(batched[i], op.call(impl, *one), 1e-6)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
@pytest.mark.parametrize("op,impl", CASES)
def test_a_batch_sharded_input_is_never_gathered(rng, op, impl, axis_type):
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip("needs two devices")
  mesh = jax.make_mesh((2,), ("batch",), axis_types=(axis_type,))
  args = _args(op, impl, rng)
  specs = op.batch + (None,) * (len(args) - len(op.batch))
  # Every argument on the mesh (replicated where it carries no batch), as an explicit mesh asks.
  placed = tuple(jax.device_put(a, NamedSharding(mesh, P() if spec is None else spec))
                 for a, spec in zip(args, specs))
  grads = lambda args: jax.jit(jax.grad(_loss(op, impl, args),
                                        argnums=tuple(range(len(op.wrt)))))
  wrt = [placed[i] for i in op.wrt]
  hlo = grads(placed).lower(*wrt).compile().as_text()
  assert "all-gather" not in hlo
  tolerance = op.sharded_tolerance if impl in op.sixteen_bit else 1e-5
  for g, e in zip(grads(placed)(*wrt), grads(args)(*[args[i] for i in op.wrt])):
    _close(g, e, tolerance)


@pytest.mark.parametrize("op,impl", CASES)
def test_an_integer_input_is_refused_by_name(rng, op, impl):
  args = list(_args(op, impl, rng))
  args[op.mapped] = args[op.mapped].astype(jnp.int32)
  with pytest.raises(TypeError, match=rf"{op.name}: \w+ .*int32"):
    op.call(impl, *args)


def test_mapped_axis_first_hands_a_call_its_mapped_axis_first_both_ways():
  """JAX's cuDNN attention batches only a leading mapped axis: a probe with the same limit
  sees axis 0 under vmap over an inner axis, at every level of nested vmaps, and gradients go
  through unchanged."""
  from jax.extend.core import Primitive
  from jax.interpreters import batching, mlir

  from jaxfuse._core.batching import mapped_axis_first

  seen = []
  probe = Primitive("leading_axis_probe")
  probe.def_impl(lambda x: 2 * x)
  probe.def_abstract_eval(lambda x: x)
  mlir.register_lowering(probe, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))

  def rule(args, dims):
    seen.append(dims[0])
    return probe.bind(*args), dims[0]

  batching.primitive_batchers[probe] = rule
  x = jnp.asarray(np.random.default_rng(7).normal(size=(2, 3, 5)), jnp.float32)
  out = jax.vmap(lambda a: probe.bind(mapped_axis_first(a)), in_axes=2)(x)
  assert seen == [0]
  np.testing.assert_array_equal(out, 2 * jnp.moveaxis(x, 2, 0))
  seen.clear()
  nested = jax.vmap(jax.vmap(lambda a: probe.bind(mapped_axis_first(a)), in_axes=0), in_axes=2)
  np.testing.assert_array_equal(nested(x), 2 * jnp.moveaxis(x, 2, 0))
  assert seen == [0, 0]
  loss = lambda a: jnp.sum(jnp.sin(mapped_axis_first(a)) ** 2)
  grads = jax.vmap(jax.grad(loss), in_axes=2, out_axes=2)(x)
  np.testing.assert_allclose(grads, jnp.sin(2 * x), rtol=1e-6)
  lengths = jax.vmap(mapped_axis_first, in_axes=1)(jnp.arange(6, dtype=jnp.int32).reshape(2, 3))
  np.testing.assert_array_equal(lengths, jnp.arange(6).reshape(2, 3).T)
