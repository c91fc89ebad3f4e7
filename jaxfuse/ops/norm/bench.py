"""Bench cases for ``rms_norm`` and ``layer_norm``.

Bytes counted: forward reads x and writes y (2 passes); the training step reads x twice (forward
and backward), writes y, reads dy and writes dx (5 passes). Parameters and statistics are
negligible next to them and not counted.

The ``*_f32_params`` ops are the mixed-precision layer of a training model (flax's default
``param_dtype``): bf16 x with float32 weight and bias, so y and dy are float32 (``jnp``'s
promotion) and a pass over them moves twice x's bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfuse._core import cuda, registry, tune
from jaxfuse._core.bench import DEFAULT, Case, implementation_arg
from jaxfuse.ops.norm import cuda as cuda_kernels
from jaxfuse.ops.norm.api import dispatch_facts, layer_norm, rms_norm, use_facts

# The CUDA libraries this family's cases run, loaded (built on a cold cache) side by side before
# any is timed.
CUDA_LIBRARIES = ("jaxfuse.ops.norm.cuda",)

GPU_SIZES = (256, 1024, 2048, 4096, 8192, 16384, 65536)
GPU_MIXED_SIZES = (4096, 65536)
GPU_ROWS = 16384


def _inputs(key, rows, n, dtype, param_dtype, with_bias):
  kx, kw, kb, kd = jax.random.split(key, 4)
  x = jax.random.normal(kx, (rows, n), dtype)
  w = 1.0 + 0.1 * jax.random.normal(kw, (n,), param_dtype)
  dy = jax.random.normal(kd, (rows, n), jnp.result_type(dtype, param_dtype))
  b = 0.1 * jax.random.normal(kb, (n,), param_dtype) if with_bias else None
  return (x, w, b, dy) if with_bias else (x, w, dy)


def _forward(fn, impl):
  impl = implementation_arg(impl)
  return lambda x, w, *rest: fn(x, w, *rest[:-1], implementation=impl)


def _train(fn, impl):
  impl = implementation_arg(impl)

  def step(x, *params_and_dy):
    *params, dy = params_and_dy
    y, vjp = jax.vjp(lambda x, *p: fn(x, *p, implementation=impl), x, *params)
    return (y,) + vjp(dy)
  return step


def _cuda_takes(n, dtype, param_dtype):
  out_dtype = jnp.result_type(dtype, param_dtype)
  return (cuda.unavailable() is None
          and cuda_kernels.unsupported(n, dtype, out_dtype, [param_dtype]) is None)


def _case(op, fn, with_bias, rows, n, dtype, param_dtype, impls, check_only=()):
  # A pass over y or dy (result_type(x, params)), counted in passes of x's bytes.
  y_passes = jnp.dtype(jnp.result_type(dtype, param_dtype)).itemsize // jnp.dtype(dtype).itemsize
  pass_bytes = rows * n * jnp.dtype(dtype).itemsize
  suffix = "" if jnp.dtype(param_dtype) == jnp.dtype(dtype) else "_f32_params"
  return Case(
      op=op + suffix, label=f"{rows}x{n} {jnp.dtype(dtype).name}", size=n,
      make_inputs=functools.partial(_inputs, rows=rows, n=n, dtype=dtype,
                                    param_dtype=param_dtype, with_bias=with_bias),
      forward=functools.partial(_forward, fn), train=functools.partial(_train, fn),
      forward_work=(1 + y_passes) * pass_bytes, train_work=(3 + 2 * y_passes) * pass_bytes,
      reduction_length=max(rows, n),
      implementations=[i for i in impls if i != "cuda" or _cuda_takes(n, dtype, param_dtype)],
      check_only=check_only)


OPS = (("rms_norm", rms_norm, False), ("layer_norm", layer_norm, True))


def cases(quick: bool = False) -> list[Case]:
  on_gpu = registry.platform() == "gpu"
  if on_gpu:
    rows = GPU_ROWS
    sizes, mixed_sizes = ((256, 2048), ()) if quick else (GPU_SIZES, GPU_MIXED_SIZES)
    impls, check_only = ("xla", "triton", "cuda", DEFAULT), ()
  else:
    # The whole run times 1000 features once: in its mixed-precision cases, not its plain ones.
    rows, (sizes, mixed_sizes) = 64, ((1000,), ()) if quick else ((256, 4097), (1000,))
    impls, check_only = ("xla",), ("triton",)
  dtype = jnp.bfloat16
  return [_case(op, fn, with_bias, rows, n, dtype, param_dtype, impls, check_only)
          for param_dtype, op_sizes in ((dtype, sizes), (jnp.float32, mixed_sizes))
          for op, fn, with_bias in OPS for n in op_sizes]


# (rows, features, x dtype, parameter dtype) off the tuned sizes: one row to many, short rows
# to the longest the kernels hold, sizes on both sides of the dispatch thresholds, odd sizes.
REGRET_GRID = [
    (1, 4096, jnp.bfloat16, jnp.bfloat16), (8, 12288, jnp.bfloat16, jnp.bfloat16),
    (128, 768, jnp.bfloat16, jnp.bfloat16), (1000, 1000, jnp.bfloat16, jnp.bfloat16),
    (32768, 512, jnp.bfloat16, jnp.bfloat16), (65536, 128, jnp.bfloat16, jnp.bfloat16),
    (16384, 2048, jnp.float16, jnp.float16), (4096, 5120, jnp.float32, jnp.float32),
    (8192, 16392, jnp.bfloat16, jnp.bfloat16), (4096, 24576, jnp.bfloat16, jnp.bfloat16),
    (2048, 32768, jnp.float32, jnp.float32), (256, 131072, jnp.bfloat16, jnp.bfloat16),
    (8192, 8192, jnp.bfloat16, jnp.float32), (1024, 65536, jnp.bfloat16, jnp.float32),
]


def regret_cases() -> list[Case]:
  """``None`` against every implementation over :data:`REGRET_GRID` (a few checked rows on
  the CPU)."""
  if registry.platform() != "gpu":
    return [_case(op, fn, bias, 64, 1000, jnp.bfloat16, jnp.bfloat16, ("xla", DEFAULT))
            for op, fn, bias in OPS]
  return [_case(op, fn, with_bias, rows, n, dtype, param_dtype,
                ("xla", "triton", "cuda", DEFAULT))
          for rows, n, dtype, param_dtype in REGRET_GRID for op, fn, with_bias in OPS]


# The tuning grid: bfloat16 rows of these lengths, as many as make 2^26 elements (past the L2).
TUNE_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768, 65536)
TUNE_ELEMENTS = 2**26


# Few rows (a decoding batch): a kernel's program per row leaves most of the GPU idle, and
# XLA's fusions may win; (rows, length) across where they do.
FEW_ROWS = (1, 8, 64)
FEW_ROWS_LENGTHS = (1024, 4096, 12288, 32768)


def tune_cases() -> list[Case]:
  """RMSNorm and LayerNorm rows of :data:`TUNE_LENGTHS` and :data:`FEW_ROWS` of
  :data:`FEW_ROWS_LENGTHS` under XLA, Triton and CUDA."""
  return ([_case(op, fn, with_bias, TUNE_ELEMENTS // n, n, jnp.bfloat16, jnp.bfloat16,
                 ("xla", "triton", "cuda"))
           for op, fn, with_bias in OPS for n in TUNE_LENGTHS]
          + [_case(op, fn, with_bias, rows, n, jnp.bfloat16, jnp.bfloat16,
                   ("xla", "triton", "cuda"))
             for op, fn, with_bias in OPS for rows in FEW_ROWS for n in FEW_ROWS_LENGTHS])


def _rows_of(label: str) -> int:
  return int(label.split("x")[0])


def tune_facts(row, use: str) -> list[dict]:
  """The dispatch facts (``api.dispatch_facts``) of the calls a tuning row's ``use`` times:
  an evaluated forward, or both directions of a training step."""
  x_dtype = jnp.dtype(row.label.split()[1])
  base = dispatch_facts(row.op.split("_")[0], row.size, _rows_of(row.label), x_dtype, x_dtype)
  return [dict(base, **use_facts(u))
          for u in (("evaluated",) if use == "forward" else ("forward", "backward"))]


def _few_rows_points(rows, use: str):
  """``((rows, length), XLA's time, the faster kernel's time)`` of one norm's few-rows cases."""
  return sorted(((_rows_of(row.label), row.size), mine, theirs) for row, mine, theirs
                in tune.times_by_case(rows, use, "xla", ("triton", "cuda")))


def tuned_rows(rows, ruled=lambda row, use: False) -> dict:
  """Per norm, for the evaluated forward and the training step: the longest rows up to which
  Triton's kernels beat CUDA's at the least regret (0: CUDA wherever it runs), the length from
  which CUDA's beat XLA's fusions where Triton is gone (None: never), and the bands of lengths
  in which XLA beats the faster kernel per row count of :data:`FEW_ROWS` (see
  :func:`tune.winning_bands`). Each only where the run timed its grid, and without the points
  a rule of the table decides (``ruled(row, use)``: see :func:`tune.ruled_by`)."""
  rows = [r for r in rows if r.op in {op for op, _, _ in OPS}]
  few = [r for r in rows if _rows_of(r.label) in FEW_ROWS]
  many = [r for r in rows if _rows_of(r.label) not in FEW_ROWS]
  free = lambda some, op, use: [r for r in some if r.op == op and not ruled(r, use)]

  def per_norm_and_use(value):
    return {f"{op.split('_')[0]}/{use}": value(op, use) for op, _, _ in OPS
            for use in ("forward", "step")}

  def times(op, use, first, second):
    return tune.times_by_size(free(many, op, use), use, first, second)

  out = {}
  if many:
    out["triton_max_features"] = per_norm_and_use(
        lambda op, use: tune.least_regret_prefix(times(op, use, "triton", "cuda")) or 0)
  if all(any(r.op == op and r.implementation == "xla" for r in many) for op, _, _ in OPS):
    # CUDA may start at any length timed, ruled or not: where rules decide the least lengths
    # of the grid, the least length free of them that CUDA wins reaches down past them.
    out["cuda_from_without_triton"] = per_norm_and_use(
        lambda op, use: tune.least_regret_suffix(times(op, use, "cuda", "xla"),
                                                 {r.size for r in many if r.op == op}))
  if few:
    out["xla_few_rows"] = per_norm_and_use(
        lambda op, use: tune.winning_bands(_few_rows_points(free(few, op, use), use)))
  return out
