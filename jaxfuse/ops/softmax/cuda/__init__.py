"""CUDA kernels for softmax, log-softmax and the softmax cross-entropy over long rows
(``softmax.cu``), through XLA's FFI.

A row is split over a thread-block cluster of up to 16 CTAs that hold it on chip (in registers,
or in shared memory as it arrives), so the softmax forward reads x once, its backward reads y
and dy once, and the cross-entropy reads the logits once and writes their gradient in the same
pass. The cross-entropy's long rows are streamed instead: one CTA walks each, reading it a
second time (mostly from L2) for the gradient. They take the softmax over the last axis.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._core import cuda, registry
from jaxfuse._core.cuda import Tiling
from jaxfuse.ops.softmax import reference

_SOURCE = Path(__file__).with_name("softmax.cu")
_HANDLERS = {"jaxfuse_softmax_forward": "JaxfuseSoftmaxForward",
             "jaxfuse_softmax_backward": "JaxfuseSoftmaxBackward",
             "jaxfuse_cross_entropy": "JaxfuseCrossEntropy"}
_SUPPORTED = tuple(map(jnp.dtype, (jnp.float16, jnp.bfloat16, jnp.float32)))
LIBRARY = cuda.Library(_SOURCE, _HANDLERS)


def unavailable() -> str | None:
  """Why these kernels cannot run here (no Hopper GPU, no nvcc, a failed build), or None."""
  return LIBRARY.unavailable()


# Units per thread, in order of preference, by item size (softmax.cu). Through registers, a
# thread keeps its next row in flight while its slice of the current one is at most four 16-byte
# vectors; the last choice gives that up to hold the longest rows. Rows of 64 KiB and more are
# fed through one shared-memory stage instead (cp.async), with eight vectors a thread: the copy
# of the next row is in flight while the current one is reduced, without the registers to hold
# it. Measured on the H100 (benchmarks/tune.py softmax_cuda, bf16): from 32768 columns the
# staged kernel in CTAs of 256 threads wins, the more the longer the row; below, the most units
# per thread through registers in 512-thread CTAs.
FORWARD_UNITS = {2: (4, 2, 1), 4: (2, 1, 4)}
STAGED_UNITS = {2: 8, 4: 4}
STAGED_FROM_BYTES = 64 * 1024
BACKWARD_UNITS = {2: (2, 1, 4), 4: (1, 2)}
# The cross-entropy streams rows of 16 KiB of logits and more: a cluster holding a long row has
# no loads in flight through its barrier, a CTA walking it has them throughout, at any number of
# rows. The loss alone takes CTAs of 128 threads, wider ones (up to 512) while the rows would
# give the GPU fewer than half the threads its SMs hold; the fused loss and gradient, which
# reads each row again from L2, the largest CTA that still walks its row in two steps or more
# (benchmarks/tune.py softmax_cuda, H200: 2026-11-28-h200-tune-ce-streaming-v4*.json, and for
# fewer rows 2026-11-28-h200-tune-ce-few-rows-{a,b}.json).
STREAMED_FROM_BYTES = 16 * 1024
STREAMED_THREADS = (128, 256, 512)
STREAM_STEP_BYTES = 64  # softmax.cu: kStreamVectors 16-byte loads a thread a step
STREAM_THREADS_PER_SM = 1024  # softmax.cu: two CTAs of kThreads, 64 registers a thread
_KERNEL_IDS = {"forward": 0, "backward": 1, "cross_entropy": 2}


def forward_tiling(n_cols: int, dtype) -> Tiling | None:
  width = jnp.dtype(dtype).itemsize
  if n_cols * width >= STAGED_FROM_BYTES:
    units = (STAGED_UNITS[width],)
    # 256-thread CTAs up to clusters of 8, then CTAs of 512 before the non-portable 16.
    return (cuda.tiling(n_cols, units, max_cluster=8, max_threads=256, stages=1)
            or cuda.tiling(n_cols, units, stages=1))
  return cuda.tiling(n_cols, FORWARD_UNITS[width])


def cross_entropy_tiling(n_cols: int, dtype, fused: bool = False,
                         n_rows: int | None = None) -> Tiling | None:
  """Rows the kernels hold (see :func:`longest_row`) of at least ``STREAMED_FROM_BYTES`` are
  streamed: one CTA walks each row (softmax.cu cross_entropy_streaming_kernel), of
  :func:`streamed_threads` for the call's ``n_rows`` (None: many). Shorter rows are held in
  registers (the gradient needs the registers a staged feed would take: it spills there), in
  clusters of at most two CTAs, then the widest slices to keep clusters small. The ``fused``
  loss and gradient of 16-bit logits take one CTA of the widest slices over a cluster of two
  (benchmarks/tune.py softmax_cuda at 16384x32768: 2026-11-28-h200-tune-ce-cuda.json, a tie in
  2026-11-22-h100-tune-cross-entropy.json)."""
  width = jnp.dtype(dtype).itemsize
  narrow = cuda.tiling(n_cols, FORWARD_UNITS[width], max_cluster=2)
  if fused and width == 2 and narrow is not None and narrow.cluster > 1:
    narrow = cuda.tiling(n_cols, (STAGED_UNITS[width],), max_cluster=1) or narrow
  held = narrow or cuda.tiling(n_cols, (STAGED_UNITS[width],))
  if held is not None and n_cols * width >= STREAMED_FROM_BYTES:
    return Tiling.streaming(streamed_threads(n_cols * width, fused, n_rows))
  return held


def streamed_threads(row_bytes: int, fused: bool, n_rows: int | None = None) -> int:
  """The threads of a CTA that streams rows of ``row_bytes``. The fused loss and gradient: the
  most of ``STREAMED_THREADS`` that walk a row in at least two steps (fewer rows in flight keep
  their second read in L2, but a CTA wider than half its row idles threads). The loss alone:
  the fewest whose CTAs, one for each of ``n_rows``, fill at least half the threads the SMs
  hold, as wide as one step of the row allows."""
  if fused:
    fits = [t for t in STREAMED_THREADS if 2 * t * STREAM_STEP_BYTES <= row_bytes]
    return max(fits, default=STREAMED_THREADS[0])
  fits = [t for t in STREAMED_THREADS if t * STREAM_STEP_BYTES <= row_bytes]
  if n_rows is None:
    return fits[0]
  half = registry.num_multiprocessors() * STREAM_THREADS_PER_SM // 2
  return next((t for t in fits if n_rows * t >= half), fits[-1])


def backward_tiling(n_cols: int, dtype) -> Tiling | None:
  return cuda.tiling(n_cols, BACKWARD_UNITS[jnp.dtype(dtype).itemsize])


def longest_row(dtype, directions=("forward", "backward"),
                max_cluster: int = cuda.MAX_CLUSTER) -> int:
  """The longest row of ``dtype`` the kernels of every one of ``directions`` hold in clusters
  of up to ``max_cluster`` CTAs."""
  width = jnp.dtype(dtype).itemsize
  units = {"forward": FORWARD_UNITS[width] + (STAGED_UNITS[width],),
           "backward": BACKWARD_UNITS[width]}
  return min(cuda.longest_row(units[d], max_cluster) for d in directions)


def limits() -> str:
  """The rows the kernels take, in words (docstrings and README; a test keeps them equal)."""
  return (f"rows that are a multiple of {cuda.UNIT} elements, up to "
          f"{longest_row(jnp.float16)} float16/bfloat16 or {longest_row(jnp.float32)} "
          f"float32 elements")


# The most queries a causal softmax's rows may have: the kernels walk them in 32 bits, with
# room for the offset and the row length (softmax.cu's CausalEnds).
MAX_CAUSAL_QUERIES = 2**30


def unsupported(n_cols: int, dtype, *, directions=("forward", "backward")) -> str | None:
  """Why the CUDA kernels cannot take rows of ``n_cols`` elements of ``dtype``, or None."""
  if jnp.dtype(dtype) not in _SUPPORTED:
    return f"the 'cuda' kernels take float16, bfloat16 and float32, not {jnp.dtype(dtype).name}"
  if n_cols % cuda.UNIT:
    return (f"the 'cuda' kernels move rows in {cuda.UNIT}-element vectors; the row length "
            f"{n_cols} is not a multiple of {cuda.UNIT}")
  clusters = cuda.cluster_limit()
  longest = longest_row(dtype, directions, clusters)
  if n_cols > longest:
    return (f"the 'cuda' kernels hold a row on chip in one {cuda.holder(clusters)}, at most "
            f"{longest} {jnp.dtype(dtype).name} elements; the row length is {n_cols} ('triton' "
            f"walks rows of any length)")
  return None


@functools.cache
def _library():
  library = LIBRARY.load()
  library.jaxfuse_softmax_clusters.argtypes = [ctypes.c_int] * 7
  library.jaxfuse_softmax_clusters.restype = ctypes.c_int
  return library


@functools.cache
def resident_clusters(kernel: str, dtype, flag: bool, t: Tiling) -> int:
  """Clusters the GPU holds at once: the persistent grid, sized at trace time."""
  count = _library().jaxfuse_softmax_clusters(_KERNEL_IDS[kernel], jnp.dtype(dtype).itemsize,
                                              flag, t.cluster, t.threads, t.units, t.stages)
  if count <= 0:
    raise NotImplementedError(f"the 'cuda' {kernel} kernel cannot launch {t} on this GPU")
  return count


def _grid(kernel, dtype, flag, t: Tiling, n_rows: int, waves: int | None) -> dict:
  """A launch's attributes, sized at trace time. Every ffi_call here takes them, so this is
  where the library is loaded and its FFI targets registered, before any call lowers."""
  _library()
  if t.is_streaming:
    clusters = cuda.streamed_ctas(n_rows)
  else:
    clusters = cuda.persistent_clusters(resident_clusters(kernel, dtype, flag, t), n_rows,
                                        waves or cuda.GRID_WAVES)
  return dict(cluster=np.int64(t.cluster), threads=np.int64(t.threads),
              units=np.int64(t.units), stages=np.int64(t.stages), clusters=np.int64(clusters))


def _rows(x):
  return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


MAX_MASK_GROUPS = 4  # softmax.cu kMaxMaskGroups


def _mask_groups(x_shape, mask_shape) -> list[tuple[int, int]]:
  """x's leading dimensions as the fewest (size, stride) groups, innermost last, through which
  row r's offset in a dense mask of ``mask_shape`` (x's rank, broadcasting to it) is read:
  neighbours merge where the outer stride is the inner one times its size (broadcast runs
  included, at stride 0)."""
  dense = np.cumprod((1,) + tuple(mask_shape[:0:-1]))[::-1]
  groups = []
  for size, extent, stride in zip(x_shape[:-1], mask_shape[:-1], dense[:-1]):
    stride = int(stride) if extent > 1 else 0
    if size == 1:
      continue
    if groups and groups[-1][1] == size * stride:
      groups[-1] = (groups[-1][0] * size, stride)
    else:
      groups.append((size, stride))
  return groups or [(1, 0)]


def _mask_operand(x, mask):
  """The forward's mask operand and attributes: a boolean mask broadcasting to x read in
  place, or materialized at x's shape where its pattern takes more than MAX_MASK_GROUPS groups
  of rows; a stand-in without one."""
  if mask is None:
    return jnp.zeros((1,), jnp.bool_), dict(
        has_mask=np.int64(0), mask_sizes=np.ones(1, np.int64),
        mask_strides=np.zeros(1, np.int64), mask_column_stride=np.int64(0))
  mask = mask.reshape((1,) * (x.ndim - mask.ndim) + mask.shape)
  groups = _mask_groups(x.shape, mask.shape)
  if len(groups) > MAX_MASK_GROUPS:
    mask = jnp.broadcast_to(mask, x.shape)
    groups = _mask_groups(x.shape, mask.shape)
  return mask.reshape(-1), dict(
      has_mask=np.int64(1), mask_sizes=np.array([g[0] for g in groups], np.int64),
      mask_strides=np.array([g[1] for g in groups], np.int64),
      mask_column_stride=np.int64(mask.shape[-1] > 1))


def _causal_attrs(shape, causal_offset: int | None) -> dict:
  """The kernels' causal attributes: rows in blocks of ``shape[-2]`` queries, or none."""
  return dict(causal_rows=np.int64(0 if causal_offset is None else shape[-2]),
              causal_offset=np.int64(causal_offset or 0))


def softmax_forward(x, *, scale: float, log: bool, causal_offset: int | None = None,
                    mask=None, tiling: Tiling | None = None, waves: int | None = None):
  """Softmax (or log-softmax) of ``scale * x`` over the last axis of ``x``, on a persistent
  grid of ``waves`` (default ``GRID_WAVES``) times the clusters resident at once. With
  ``causal_offset`` (in ``[-T, S]`` for ``x (..., T, S)``), key ``j`` of query ``i`` takes part
  only where ``j <= i + causal_offset``; with ``mask`` (boolean, broadcasting to ``x``), only
  where it is True."""
  x2 = _rows(x)
  t = tiling or forward_tiling(x2.shape[1], x.dtype)
  t.check(x2.shape[1])
  mask_operand, mask_attrs = _mask_operand(x, mask)
  y = jax.ffi.ffi_call("jaxfuse_softmax_forward", jax.ShapeDtypeStruct(x2.shape, x.dtype))(
      x2, mask_operand, scale=np.float32(scale), log=np.int64(log),
      **_causal_attrs(x.shape, causal_offset), **mask_attrs,
      **_grid("forward", x.dtype, log, t, x2.shape[0], waves))
  return y.reshape(x.shape)


def softmax_backward(y, dy, *, scale: float, log: bool, causal_offset: int | None = None,
                     tiling: Tiling | None = None, waves: int | None = None):
  """Gradient of ``scale * x`` from the output ``y`` and its cotangent ``dy``, on ``waves``
  waves of clusters as the forward. With the forward's ``causal_offset``, the keys it masked
  are not read and get zero gradient."""
  y2 = _rows(y)
  t = tiling or backward_tiling(y2.shape[1], y.dtype)
  t.check(y2.shape[1])
  dx = jax.ffi.ffi_call("jaxfuse_softmax_backward", jax.ShapeDtypeStruct(y2.shape, y.dtype))(
      y2, _rows(dy).astype(y.dtype), scale=np.float32(scale), log=np.int64(log),
      **_causal_attrs(y.shape, causal_offset),
      **_grid("backward", y.dtype, log, t, y2.shape[0], waves))
  return dx.reshape(y.shape)


def cross_entropy(logits, labels, *, label_smoothing, z_loss, ignore_index=None,
                  row_scale=None, lse=None, mode, tiling: Tiling | None = None, bias=None,
                  classes: int | None = None, grad_dtype=None, waves: int | None = None):
  """Same contract as ``triton.cross_entropy``: ``logits (R, V)``, int32 ``labels (R,)``;
  ``mode`` 'loss' -> ``(loss, lse)``, 'fused' -> ``(loss, grad)``, 'grad' -> ``grad``.

  For the logits of a fused linear layer: ``bias`` (float32 ``(V,)``) is added to every row,
  only the first ``classes`` columns are classes (the rest pad the row to whole tiles and get a
  zero gradient), and float32 logits may give their gradient in ``grad_dtype`` (bfloat16 or
  float16), in the same pass. ``waves``: as :func:`softmax_forward`'s."""
  n_rows, vocab = logits.shape
  classes = vocab if classes is None else classes
  if mode == "grad":
    if bias is not None or classes != vocab or grad_dtype is not None:
      raise NotImplementedError("mode='grad' takes plain logits; the fused mode takes a layer's")
    # The gradient from a saved lse is one elementwise pass, which XLA fuses as well.
    valid = (labels >= 0) & (labels < vocab)
    if ignore_index is not None:
      valid = valid & (labels != ignore_index)
    return reference.cross_entropy_grad(logits, labels, valid, lse, row_scale,
                                        label_smoothing=label_smoothing, z_loss=z_loss)
  t = tiling or cross_entropy_tiling(vocab, logits.dtype, fused=mode == "fused", n_rows=n_rows)
  t.check(vocab)
  with_grad = mode == "fused"
  rows = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
  second = (jax.ShapeDtypeStruct(logits.shape, grad_dtype or logits.dtype) if with_grad
            else rows)
  scale = row_scale if with_grad else jnp.ones((1,), jnp.float32)
  bias = jnp.zeros((0,), jnp.float32) if bias is None else bias.astype(jnp.float32)
  return jax.ffi.ffi_call("jaxfuse_cross_entropy", (rows, second))(
      logits, labels.astype(jnp.int32), scale.astype(jnp.float32), bias,
      smoothing=np.float32(label_smoothing), z_loss=np.float32(z_loss),
      ignore_index=np.int64(0 if ignore_index is None else ignore_index),
      has_ignore=np.int64(ignore_index is not None), with_grad=np.int64(with_grad),
      counted=np.int64(classes),
      **_grid("cross_entropy", logits.dtype, with_grad, t, n_rows, waves))
