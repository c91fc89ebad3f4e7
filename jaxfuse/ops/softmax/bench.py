"""Bench cases for ``softmax`` and ``softmax_cross_entropy``, beside ``jax.nn`` and ``optax``.

Bytes counted: softmax forward reads x and writes y (2 passes); its training step adds the
backward's reads of y and dy and write of dx (5 passes). Cross-entropy reads the logits (1 pass)
for the loss; its training step (loss and dlogits) reads the logits and writes dlogits (2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfuse._core import registry, tune
from jaxfuse._core.bench import DEFAULT, Case, implementation_arg
from jaxfuse.ops.softmax.api import softmax, softmax_cross_entropy

# The CUDA libraries this family's cases run, loaded (built on a cold cache) side by side before
# any is timed.
CUDA_LIBRARIES = ("jaxfuse.ops.softmax.cuda",)

GPU_SOFTMAX = [(16384, n) for n in (1024, 4096, 8192, 16384, 32768)] + [(4096, 131072),
                                                                       (4096, 262144)]
GPU_CROSS_ENTROPY = [(8192, 131072), (16384, 32768)]


def _softmax_fn(impl, queries=None):
  """The softmax of rows (R, N); with ``queries``, of causal scores viewed as (R / T, T, N)."""
  if impl == "jax.nn":
    plain = jax.nn.softmax
    if queries:
      def plain(x):
        keep = jnp.tril(jnp.ones(x.shape[-2:], bool))
        return jax.nn.softmax(x, where=keep) * keep
  else:
    plain = functools.partial(softmax, implementation=implementation_arg(impl),
                              is_causal=bool(queries))
  if not queries:
    return plain
  return lambda x: plain(x.reshape(-1, queries, x.shape[-1])).reshape(x.shape)


def _softmax_forward(impl, queries=None):
  f = _softmax_fn(impl, queries)
  return lambda x, dy: f(x)


def _softmax_train(impl, queries=None):
  f = _softmax_fn(impl, queries)

  def step(x, dy):
    y, vjp = jax.vjp(f, x)
    return y, vjp(dy)[0]
  return step


def _softmax_inputs(key, rows, n, dtype):
  kx, kd = jax.random.split(key)
  return (3.0 * jax.random.normal(kx, (rows, n), dtype), jax.random.normal(kd, (rows, n), dtype))


def _ce_fn(impl):
  if impl == "optax":
    import optax
    return lambda logits, labels: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(logits, labels))
  return functools.partial(softmax_cross_entropy, implementation=implementation_arg(impl))


def _ce_forward(impl):
  return _ce_fn(impl)


def _ce_train(impl):
  return jax.value_and_grad(_ce_fn(impl))


def _ce_inputs(key, rows, vocab, dtype):
  kx, kl = jax.random.split(key)
  return (2.0 * jax.random.normal(kx, (rows, vocab), dtype),
          jax.random.randint(kl, (rows,), 0, vocab, jnp.int32))


def _softmax_train_floors(x, dy):
  # dx = y * dy - y * sum(y * dy) nearly cancels in rows with one dominant probability: there
  # the rounding of its terms, not dx's own size, bounds the error.
  y = jax.nn.softmax(x)
  return 0.0, jnp.linalg.norm(y * dy, axis=-1, keepdims=True)


def _softmax_case(rows, n, dtype, impls, check_only=(), queries=None):
  """Rows (rows, n); with ``queries``, causal scores of that many queries a block of rows."""
  pass_bytes = rows * n * jnp.dtype(dtype).itemsize
  return Case(
      op="softmax",
      label=f"{rows}x{n} {jnp.dtype(dtype).name}" + (" causal" if queries else ""), size=n,
      make_inputs=functools.partial(_softmax_inputs, rows=rows, n=n, dtype=dtype),
      forward=functools.partial(_softmax_forward, queries=queries),
      train=functools.partial(_softmax_train, queries=queries),
      forward_work=2 * pass_bytes, train_work=5 * pass_bytes, reduction_length=n,
      # exp's own rounding and the division by the row's sum, beside the output's
      roundings=4, train_floors=_softmax_train_floors,
      implementations=impls, check_only=check_only)


def _ce_case(rows, vocab, dtype, impls, check_only=()):
  pass_bytes = rows * vocab * jnp.dtype(dtype).itemsize
  return Case(
      op="cross_entropy", label=f"{rows}x{vocab} {jnp.dtype(dtype).name}", size=vocab,
      make_inputs=functools.partial(_ce_inputs, rows=rows, vocab=vocab, dtype=dtype),
      forward=_ce_forward, train=_ce_train,
      forward_work=pass_bytes, train_work=2 * pass_bytes, reduction_length=max(rows, vocab),
      implementations=impls, check_only=check_only)


def cases(quick: bool = False) -> list[Case]:
  on_gpu = registry.platform() == "gpu"
  if on_gpu:
    softmax_shapes = GPU_SOFTMAX[:2] if quick else GPU_SOFTMAX
    ce_shapes = GPU_CROSS_ENTROPY[:1] if quick else GPU_CROSS_ENTROPY
    impls, check_only = ("jax.nn", "xla", "triton", "cuda", DEFAULT), ()
  else:
    softmax_shapes, ce_shapes = [(64, 1000), (16, 40000)][:1 if quick else 2], [(64, 5000)]
    impls, check_only = ("jax.nn", "xla"), ("triton",)
  dtype = jnp.bfloat16
  ce_impls = tuple("optax" if i == "jax.nn" else i for i in impls)
  return ([_softmax_case(rows, n, dtype, impls, check_only) for rows, n in softmax_shapes]
          + [_ce_case(rows, vocab, dtype, ce_impls, check_only) for rows, vocab in ce_shapes])


# (rows, row length, dtype) off the tuned sizes: one row to many, short rows to the longest
# the kernels hold, lengths on both sides of the dispatch thresholds, vocabularies of real
# models (GPT-2's odd 50257, Llama's 32000 and 128256).
REGRET_SOFTMAX = [
    (4, 32000, jnp.bfloat16), (64, 128256, jnp.bfloat16), (512, 16384, jnp.bfloat16),
    (2048, 24576, jnp.bfloat16), (8192, 1024, jnp.float32), (65536, 256, jnp.bfloat16),
    (1024, 65536, jnp.float32), (4096, 8192, jnp.float16), (16, 262144, jnp.bfloat16),
    (8192, 16376, jnp.bfloat16), (1000, 50257, jnp.bfloat16),
]
REGRET_CROSS_ENTROPY = [
    (8, 50264, jnp.bfloat16), (512, 32000, jnp.bfloat16), (4096, 128256, jnp.bfloat16),
    (8192, 32768, jnp.float32), (16384, 8192, jnp.bfloat16), (2048, 262144, jnp.bfloat16),
    (1024, 151936, jnp.bfloat16), (8192, 50257, jnp.bfloat16), (32, 131072, jnp.bfloat16),
    (300, 131072, jnp.bfloat16), (64, 131072, jnp.bfloat16), (128, 32768, jnp.bfloat16),
    (16, 262144, jnp.bfloat16),
]


def regret_cases() -> list[Case]:
  """``None`` against every implementation over the regret grids (a few checked rows on the
  CPU)."""
  if registry.platform() != "gpu":
    return [_softmax_case(64, 1000, jnp.bfloat16, ("xla", DEFAULT)),
            _ce_case(64, 5000, jnp.bfloat16, ("xla", DEFAULT))]
  impls = ("xla", "triton", "cuda", DEFAULT)
  # Attention scores: 64 heads of 2048 causal queries over 2048 keys, and 2 of 16384 (rows the
  # CUDA kernels take).
  return ([_softmax_case(rows, n, dtype, impls) for rows, n, dtype in REGRET_SOFTMAX]
          + [_softmax_case(heads * n, n, jnp.bfloat16, impls, queries=n)
             for heads, n in ((64, 2048), (2, 16384))]
          + [_ce_case(rows, vocab, dtype, impls) for rows, vocab, dtype in REGRET_CROSS_ENTROPY])


# The tuning grid: bfloat16 rows of these lengths, as many as make 2^26 elements (past the L2).
TUNE_LENGTHS = (1024, 2048, 4096, 8192, 12288, 16376, 16384, 24576, 32768, 65536, 131072,
                262144)
TUNE_ELEMENTS = 2**26


def tune_cases() -> list[Case]:
  """Softmax and cross-entropy rows of :data:`TUNE_LENGTHS` under each implementation."""
  impls = ("xla", "triton", "cuda")
  return ([_softmax_case(TUNE_ELEMENTS // n, n, jnp.bfloat16, impls) for n in TUNE_LENGTHS]
          + [_ce_case(TUNE_ELEMENTS // n, n, jnp.bfloat16, impls) for n in TUNE_LENGTHS])


def tuned_rows(rows) -> dict:
  """The lengths from which CUDA goes before Triton (``cuda_from_<row>``), and before XLA
  where Triton is gone (``..._without_triton``), at the least regret (None: never): for an
  evaluated call's forward, and for both directions of a differentiated call, by the whole
  step's times (a pair of kernels is timed together)."""
  by_op = {op: [r for r in rows if r.op == op] for op in ("softmax", "cross_entropy")}
  uses = {"forward": ("softmax", "forward"), "step": ("softmax", "step"),
          "cross_entropy": ("cross_entropy", "step"),
          "cross_entropy_loss": ("cross_entropy", "forward")}
  return {f"cuda_from_{row}{suffix}": tune.least_regret_suffix(
              tune.times_by_size(by_op[op], use, "cuda", other))
          for row, (op, use) in uses.items()
          for suffix, other in (("", "triton"), ("_without_triton", "xla"))}
