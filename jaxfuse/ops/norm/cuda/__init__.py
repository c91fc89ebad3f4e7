"""CUDA kernels for RMSNorm and LayerNorm (``norm.cu``), through XLA's FFI.

Same calling convention as the Triton kernels: ``x (G, R, N)``, parameters ``(G, N)``. A long
row is split over a thread-block cluster of up to 16 CTAs that hold it in registers, so the
forward reads x once and the backward reads x and dy once. A single Pallas program cannot hold
a row of tens of thousands of elements and walks it twice; that second walk is what these
kernels save. A short row (what 32 lanes hold: up to 1024 16-bit elements, float32 512
forward and 256 backward) is held by a group of lanes of one warp, many rows to a CTA, each
thread loading its next row while it works on the current one.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._core import cuda
from jaxfuse._core.cuda import Tiling

_SOURCE = Path(__file__).with_name("norm.cu")
_HANDLERS = {"jaxfuse_norm_forward": "JaxfuseNormForward",
             "jaxfuse_norm_backward": "JaxfuseNormBackward"}

# Units per thread the kernels are built for (norm.cu), by x's item size: beyond them the two
# rows a thread keeps in flight would spill out of registers. Rows of STAGED_FROM_BYTES and
# more go forward through one shared-memory stage instead, at twice the units per thread in
# CTAs of at most STAGED_THREADS.
FORWARD_UNITS = {2: (4, 2, 1), 4: (2, 1)}
BACKWARD_UNITS = {2: (2, 1), 4: (1,)}
STAGED_UNITS = {2: 8, 4: 4}
STAGED_THREADS = 256
STAGED_FROM_BYTES = 64 * 1024
# Short rows (norm.cu), units per thread in order of preference, up to what fits beside the next
# row. Measured with benchmarks/tune.py norm_cuda: two units on 16 lanes beat one on 32 lanes in
# both directions on the H100, where four on 8 lanes tie with them forward; on the H200 four
# units beat two forward (benchmarks/results/2026-11-28-h200-tune-norm-cuda-s37-fwd.json) and
# tie with them backward, where four on 32 lanes beat a CTA a row for 1024 16-bit elements
# (...-s37-short-bwd.json). Where they beat the Triton kernels is the tuned tables' to say
# (jaxfuse/ops/norm/tuned/).
SHORT_FORWARD_UNITS = {2: (4, 2, 1), 4: (2, 1)}
SHORT_BACKWARD_UNITS = {2: (2, 4, 1), 4: (1,)}
_SUPPORTED = tuple(map(jnp.dtype, (jnp.float16, jnp.bfloat16, jnp.float32)))
LIBRARY = cuda.Library(_SOURCE, _HANDLERS)


def unavailable() -> str | None:
  """Why these kernels cannot run here (no Hopper GPU, no nvcc, a failed build), or None."""
  return LIBRARY.unavailable()


# Defaults measured on the H100 (benchmarks/tune.py norm_cuda, bf16, 16384 rows): through
# registers, the most units per thread, then clusters of 512-thread CTAs; a cluster barrier per
# row costs more than the loads a CTA overlaps with it, so fewer, larger CTAs per row win.
# Staged (32768 columns and more), CTAs of 128 threads up to clusters of 8, then of 256: their
# small stages and parameter slices let more CTAs share an SM, which beat registers, two stages,
# parameters read from global memory at each row, and 256-thread CTAs at half the units. LayerNorm's
# two parameter slices beside the stage take 49 KiB per 128-thread CTA, so four CTAs share an SM
# against RMSNorm's six: fewer active warps per scheduler, the likeliest cause of its lower rate.
# float32 parameters beside 16-bit x double the parameter slices, so there the slices are halved
# and the clusters doubled (up to 16 CTAs) to keep as many CTAs on an SM; against the widest
# slices that wins or ties for every output dtype but RMSNorm's bf16, a little behind there.
# A float32 y beside 16-bit x doubles what a unit stores, and four units through registers then
# spill: at most two (benchmarks/results/2026-11-28-h200-tune-norm-cuda-s37-fwd.json).
def forward_tiling(n_cols: int, x_dtype, param_dtype=None, out_dtype=None) -> Tiling | None:
  width = jnp.dtype(x_dtype).itemsize
  wider = lambda dtype: dtype is not None and jnp.dtype(dtype).itemsize > width
  if short := cuda.short_tiling(n_cols, SHORT_FORWARD_UNITS[width]):
    return short
  staged = None
  if n_cols * width >= STAGED_FROM_BYTES:
    units = STAGED_UNITS[width]
    if wider(param_dtype) or wider(out_dtype):
      staged = cuda.tiling(n_cols, (units // 2,), max_threads=128, stages=1)
    staged = (staged or cuda.tiling(n_cols, (units,), max_cluster=8, max_threads=128, stages=1)
              or cuda.tiling(n_cols, (units,), max_threads=STAGED_THREADS, stages=1))
  units = FORWARD_UNITS[width]
  return staged or cuda.tiling(n_cols, units[1:] if wider(out_dtype) else units)


# A float32 dy beside 16-bit x (float32 parameters promote the output) triples a unit's
# registers, so two units of both rows and the next ones spill: one unit a thread while a CTA
# holds the row (benchmarks/tune.py norm_cuda's "f32 params" problems), and short rows of at
# most two units, whose four-unit kernels were timed with 16-bit dy alone. LayerNorm's kernel
# for rows a CTA of at most HELD_THREADS holds (its parameter sums in registers, not beside the
# next row's) keeps two units without spilling, and beat one unit in 512 threads
# (benchmarks/results/2026-11-29-h200-tune-norm-cuda-s39-f32-dy.json). norm.cu's kHeldThreads.
HELD_THREADS = 256


def backward_tiling(n_cols: int, x_dtype, dy_dtype=None, kind: str = "rms") -> Tiling | None:
  width = jnp.dtype(x_dtype).itemsize
  wide_dy = dy_dtype is not None and jnp.dtype(dy_dtype).itemsize > width
  short_units = tuple(u for u in SHORT_BACKWARD_UNITS[width] if not wide_dy or u <= 2)
  held = wide_dy and kind == "layer" and cuda.tiling(n_cols, (2,), max_cluster=1,
                                                     max_threads=HELD_THREADS)
  return (cuda.short_tiling(n_cols, short_units) or held
          or (wide_dy and cuda.tiling(n_cols, (1,), max_cluster=1))
          or cuda.tiling(n_cols, BACKWARD_UNITS[width]))


def longest_row(x_dtype, max_cluster: int = cuda.MAX_CLUSTER) -> int:
  """The longest row both directions hold in clusters of up to ``max_cluster`` CTAs, for x of
  ``x_dtype``."""
  return cuda.longest_row(BACKWARD_UNITS[jnp.dtype(x_dtype).itemsize], max_cluster)


def limits() -> str:
  """The rows the kernels take, in words (docstrings and README; a test keeps them equal)."""
  return (f"normalized sizes that are a multiple of {cuda.UNIT}, up to "
          f"{longest_row(jnp.float16)} float16/bfloat16 or {longest_row(jnp.float32)} "
          f"float32 elements")


def unsupported(n_cols: int, x_dtype, out_dtype, param_dtypes) -> str | None:
  """Why the CUDA kernels cannot normalize rows of ``n_cols`` elements of these dtypes, or
  None. Outputs (and so dy) must have x's dtype or float32; parameters of any float dtype
  other than x's are read as float32."""
  for dtype in (x_dtype, out_dtype, *param_dtypes):
    if jnp.dtype(dtype) not in _SUPPORTED:
      return f"the 'cuda' kernels take float16, bfloat16 and float32, not {jnp.dtype(dtype).name}"
  if jnp.dtype(out_dtype) not in (jnp.dtype(x_dtype), jnp.dtype(jnp.float32)):
    return (f"the 'cuda' kernels write x's dtype or float32, not {jnp.dtype(out_dtype).name} for "
            f"x of {jnp.dtype(x_dtype).name}")
  if n_cols % cuda.UNIT:
    return (f"the 'cuda' kernels move rows in {cuda.UNIT}-element vectors; the normalized size "
            f"{n_cols} is not a multiple of {cuda.UNIT}")
  if backward_tiling(n_cols, x_dtype) is None or forward_tiling(n_cols, x_dtype) is None:
    clusters = cuda.cluster_limit()
    return (f"the 'cuda' kernels hold a row in the registers of one {cuda.holder(clusters)}, at "
            f"most {longest_row(x_dtype, clusters)} {jnp.dtype(x_dtype).name} elements; the "
            f"normalized size is {n_cols} ('triton' walks rows of any length)")
  return None


def _library():
  return LIBRARY.load()


def _params(x, *params):
  # Parameters of x's dtype are read as they are, others as float32 (exact for every supported
  # dtype). The kernel reads the parameter dtype from its weight operand; an absent parameter
  # is never read, so a present one (or x) of that dtype stands in for its pointer.
  present = [p for p in params if p is not None]
  common = x.dtype if all(p.dtype == x.dtype for p in present) else jnp.float32
  stand_in = present[0].astype(common) if present else x
  return [stand_in if p is None else p.astype(common) for p in params]


@functools.cache
def resident_clusters(direction: str, kind: str, x_dtype, other_dtype, param_dtype, t: Tiling,
                      has_weight: bool, has_bias: bool) -> int:
  """Clusters (for short rows, CTAs) the GPU holds at once: the persistent grid, sized at
  trace time."""
  query = _library().jaxfuse_norm_clusters
  query.argtypes = [ctypes.c_int] * 12
  query.restype = ctypes.c_int
  count = query(direction == "backward", jnp.dtype(x_dtype).itemsize,
                jnp.dtype(other_dtype).itemsize, jnp.dtype(param_dtype).itemsize,
                kind == "layer", t.cluster, t.threads, t.units, t.stages, t.lanes, has_weight,
                has_bias)
  if count <= 0:
    raise NotImplementedError(f"the 'cuda' norm {direction} cannot launch {t} on this GPU")
  return count


MAX_GROUP_BLOCKS = 65535  # CUDA's limit on a grid's y dimension (norm.cu grid())


def _grid(n_groups: int, n_rows: int, t: Tiling, resident: int, waves: int = 1) -> int:
  """Clusters to launch along x: ``waves`` times those resident, none without a row. Short
  rows take one row of CTAs per parameter group along y (norm.cu grid()), so the resident CTAs
  are shared out over the groups: a vmapped step of few rows a group still fills the GPU."""
  if not t.lanes:
    return cuda.persistent_clusters(resident, n_rows, waves)
  rows_at_once = t.threads // t.lanes
  per_group = -(-resident * waves // min(n_groups, MAX_GROUP_BLOCKS))
  return max(1, min(per_group, -(-n_rows // rows_at_once)))


# The forward's persistent grid in waves of resident clusters (benchmarks/tune.py norm_cuda
# times them): LayerNorm, with twice RMSNorm's arithmetic a row, was faster at fewer. Short
# rows launch one wave: each group of lanes walks its rows with the next one in flight.
FORWARD_WAVES = {"rms": cuda.GRID_WAVES, "layer": 2}
SHORT_FORWARD_WAVES = 1


def forward_waves(kind: str, t: Tiling) -> int:
  return SHORT_FORWARD_WAVES if t.lanes else FORWARD_WAVES[kind]


def forward(x, weight, bias, *, kind, eps, out_dtype, tiling: Tiling | None = None,
            waves: int | None = None):
  """``x (G, R, N)``, ``weight``/``bias`` ``(G, N)`` or None -> ``(y, mean | None, rstd)``.
  A row tiling's persistent grid is ``waves`` (default :func:`forward_waves`) times the
  clusters resident at once; the backward keeps one wave, as each of its clusters writes
  partial parameter gradients."""
  n_groups, n_rows, n_cols = x.shape
  has_weight, has_bias = weight is not None, bias is not None
  weight, bias = _params(x, weight, bias)
  t = tiling or forward_tiling(n_cols, x.dtype, weight.dtype if has_weight or has_bias else None,
                              out_dtype)
  t.check(n_cols)
  clusters = _grid(n_groups, n_rows, t,
                   resident_clusters("forward", kind, x.dtype, out_dtype, weight.dtype, t,
                                     has_weight, has_bias), waves or forward_waves(kind, t))
  stat = jax.ShapeDtypeStruct((n_groups, n_rows), jnp.float32)
  y, mean, rstd = jax.ffi.ffi_call(
      "jaxfuse_norm_forward", (jax.ShapeDtypeStruct(x.shape, out_dtype), stat, stat))(
          x, weight, bias, eps=np.float32(eps), cluster=np.int64(t.cluster),
          threads=np.int64(t.threads), units=np.int64(t.units), stages=np.int64(t.stages),
          lanes=np.int64(t.lanes), clusters=np.int64(clusters), layer=np.int64(kind == "layer"),
          has_weight=np.int64(has_weight), has_bias=np.int64(has_bias))
  return y, (mean if kind == "layer" else None), rstd


def backward(dy, x, weight, mean, rstd, *, kind, has_bias, bias_dtype=None,
             tiling: Tiling | None = None, max_clusters: int | None = None):
  """Returns ``(dx, dweight | None, dbias | None)`` for ``(G, R, N)`` inputs. ``max_clusters``
  caps the persistent grid below the clusters resident at once: each cluster writes a float32
  partial row per parameter gradient, which fewer clusters, each walking more rows, write and
  read less of (``benchmarks/tune.py norm_cuda`` times the trade)."""
  n_groups, n_rows, n_cols = x.shape
  has_weight = weight is not None
  t = tiling or backward_tiling(n_cols, x.dtype, dy.dtype, kind)
  t.check(n_cols)
  (kernel_weight,) = _params(x, weight)
  resident = resident_clusters("backward", kind, x.dtype, dy.dtype, kernel_weight.dtype, t,
                               has_weight, has_bias)
  clusters = _grid(n_groups, n_rows, t, min(resident, max_clusters or resident))
  # One call, two stages (norm.cu): float32 partial sums of the parameter gradients per
  # cluster, then their sum over the clusters in a fixed order, in the parameters' dtypes.
  n_params = has_weight + has_bias
  unused = jax.ShapeDtypeStruct((1,), jnp.float32)
  grad = lambda dtype: jax.ShapeDtypeStruct((n_groups, n_cols), dtype)
  partials = (jax.ShapeDtypeStruct((n_params, n_groups, clusters, n_cols), jnp.float32)
              if n_params else unused)
  dx, dweight, dbias, _ = jax.ffi.ffi_call(
      "jaxfuse_norm_backward",
      (jax.ShapeDtypeStruct(x.shape, x.dtype), grad(weight.dtype) if has_weight else unused,
       grad(bias_dtype) if has_bias else unused, partials))(
          dy, x, kernel_weight, x if mean is None else mean, rstd,
          cluster=np.int64(t.cluster), threads=np.int64(t.threads), units=np.int64(t.units),
          lanes=np.int64(t.lanes), clusters=np.int64(clusters), layer=np.int64(kind == "layer"),
          has_weight=np.int64(has_weight), has_bias=np.int64(has_bias))
  return dx, (dweight if has_weight else None), (dbias if has_bias else None)
