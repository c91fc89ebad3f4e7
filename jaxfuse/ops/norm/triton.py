"""Pallas (Triton) kernels for RMSNorm and LayerNorm, forward and backward.

Arrays arrive flattened to ``x: (G, R, N)`` (weight groups, rows, features) with parameters
``(G, N)``; G is 1 except under ``vmap`` with a batched weight.

Forward: a program owns ``block_rows`` rows. When a row fits one register tile (``block_cols``
>= N) it is read once, reduced and written: one read and one write of ``x``'s size. Longer rows
are walked in column chunks twice, statistics first (LayerNorm keeps a Welford mean and M2 per
element and merges them with Chan's formula once per row, so a large mean does not cancel the
variance) and then the output; the second walk hits L2, where the first left the row
(``evict_last``).

Backward: dx needs two per-row sums over the features (of ``x_hat * w * dy``, and for LayerNorm
of ``w * dy``), and the weight/bias gradients are sums over rows. The grid is persistent: a few
programs per SM, each walking a fixed strided set of row blocks, computes dx for its rows and
keeps its share of ``dweight``/``dbias`` in float32 registers, one accumulator per column. A row
longer than one tile is walked twice in an unrolled chunk loop (the second walk from L2), so
each chunk keeps accumulators of its own. Rows too long for that ('split') get dx from a row
kernel and the weight gradients from a column-parallel kernel over row ranges. Stage two sums
the per-program partials in a fixed order in a small kernel. No atomics: the same inputs give
the same bits.

Every array is indexed with one int32 index per dimension, never through a flat offset formed in
a kernel: Pallas' Triton lowering scales each index by its stride, in 64 bits for arrays larger
than 2^32 bytes, so inputs of more than 2^31 elements are addressed exactly (see
:func:`unsupported` for the limit of that rule).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxfuse._core.registry import pallas_triton as plgpu  # None where JAX has no Triton

from jaxfuse._core import registry
from jaxfuse._core.pipelining import pipelined_loop
from jaxfuse._core.validation import compute_dtype


@dataclasses.dataclass(frozen=True)
class NormBlocks:
  """Tiling of one kernel: a (block_rows, block_cols) register tile per step.

  ``programs`` per weight group walk fixed, strided sets of row blocks (a persistent grid);
  None gives every row block a program of its own.
  """
  block_rows: int
  block_cols: int
  num_warps: int
  programs: int | None = None
  # Backward only: 'chunks' or 'split' (see _backward_strategy); None chooses by size.
  strategy: str | None = None


# Defaults measured on an H100 (benchmarks/tune.py, bf16, 16384 rows; results in
# benchmarks/results/*-tune*.json). The forward wants ~16 elements per thread and thousands of
# programs in flight; short rows do best with a program per row block, and LayerNorm, whose
# two dependent row reductions leave the memory pipe idle longer, with small tiles. The
# backward, which also keeps the weight-gradient accumulators in registers, wants one or two
# programs per SM. Rows longer than one tile are walked in chunks, twice, the second walk
# from L2.
_FWD_MAX_COLS = 32768
_BWD_MAX_COLS = 8192
# The unrolled backward walk ('chunks') keeps one float32 accumulator per column and weight
# gradient in registers: at most this many per thread, over at most this many chunks.
_MAX_ACCUMULATORS_PER_THREAD = 64
_MAX_UNROLLED_CHUNKS = 8


def forward_blocks(n_rows: int, n_cols: int, kind: str = "rms") -> NormBlocks:
  sms = registry.num_multiprocessors()
  block_cols = min(pl.next_power_of_2(n_cols), _FWD_MAX_COLS)
  rows = pl.next_power_of_2(n_rows)
  if block_cols <= 512:
    # Short rows, 32 elements per thread: RMSNorm in small programs, one per row block;
    # LayerNorm, with its second reduction, in programs four times wider on a persistent grid.
    block_rows = min(8 if kind == "rms" else 32, rows)
    return NormBlocks(block_rows, block_cols, max(1, block_rows * block_cols // 1024),
                      None if kind == "rms" else 8 * sms)
  if kind == "rms" and block_cols == 1024:
    return NormBlocks(min(4, rows), block_cols, 8)
  if kind == "layer" and block_cols <= 2048:
    return NormBlocks(min(2, rows), block_cols, 4)
  if kind == "layer" and block_cols == 8192:
    return NormBlocks(min(2, rows), block_cols, 16, 4 * sms)
  if n_cols > _FWD_MAX_COLS:
    # Walked twice: two programs per SM keep the rows in flight (~34 MB at 64K bf16) in L2.
    return NormBlocks(1, 16384, 16, 2 * sms)
  block_rows = max(1, min((1024 if block_cols < 1024 else 8192) // block_cols, rows))
  num_warps = 16 if block_cols < 8192 else block_cols // 1024
  return NormBlocks(block_rows, block_cols, num_warps, 8 * sms)


def backward_blocks(n_rows: int, n_cols: int, kind: str = "rms") -> NormBlocks:
  sms = registry.num_multiprocessors()
  block_cols = min(pl.next_power_of_2(n_cols), _BWD_MAX_COLS)
  if n_cols > block_cols:
    accumulators = 1 if kind == "rms" else 2
    chunks = NormBlocks(1, 8192 // accumulators, 16, sms)
    if _backward_strategy(chunks, n_cols, accumulators) == "chunks":
      return chunks
    return NormBlocks(1, 8192, 16, 2 * sms)
  if block_cols <= 1024:
    # Small tiles of 16 elements a thread, so the next tile fits beside them and is prefetched,
    # four programs to an SM; _sum_partials reduces their many partial sums cheaply.
    block_rows = max(1, min(2048 // block_cols, 32, pl.next_power_of_2(n_rows)))
    return NormBlocks(block_rows, block_cols, 4, 4 * sms)
  block_rows = max(1, min(4096 // block_cols, 16, pl.next_power_of_2(n_rows)))
  num_warps = max(8, min(16, block_rows * block_cols // 512))
  return NormBlocks(block_rows, block_cols, num_warps, (1 if block_cols >= 8192 else 2) * sms)


def _programs(blocks, n_rows, n_groups):
  """Programs per group for a persistent grid, evened out so no program gets an extra step."""
  n_row_blocks = pl.cdiv(n_rows, blocks.block_rows)
  if blocks.programs is None:
    return n_row_blocks
  target = max(1, min(n_row_blocks, blocks.programs // n_groups))
  return pl.cdiv(n_row_blocks, pl.cdiv(n_row_blocks, target))


_VIEW = "x viewed as (groups, rows, features)"


def unsupported(shape) -> str | None:
  """Why the kernels cannot take x viewed as ``(groups, rows, features)``, or None."""
  return registry.triton_extents_refusal(_VIEW, shape)


def _check_extents(kind, shape):
  registry.check_triton_extents(f"{kind}_norm", _VIEW, shape)


def _compiler_params(blocks):
  return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=1)


def _load(ref, index, mask, dtype=None, evict=None):
  kwargs = {} if evict is None else {"eviction_policy": evict}
  value = plgpu.load(ref.at[index], mask=mask, other=0.0, **kwargs)
  return value if dtype is None else value.astype(dtype)


class _RowBlocks:
  """Program ``p`` of ``P`` (per group ``g``) owns row blocks ``p, p + P, p + 2P, ...``."""

  def __init__(self, n_rows, blocks, prefetch_limit):
    block_rows = blocks.block_rows
    # Holding the next tile too costs registers: only worth it while a thread's share is small.
    self.prefetch = block_rows * blocks.block_cols <= prefetch_limit * 32 * blocks.num_warps
    self.g, self.p = pl.program_id(0), pl.program_id(1)
    self.n_programs = pl.num_programs(1)
    self.n_rows, self.block_rows = n_rows, block_rows
    self.n_row_blocks = pl.cdiv(n_rows, block_rows)
    self.n_steps = (self.n_row_blocks - self.p + self.n_programs - 1) // self.n_programs

  def rows(self, step):
    """Row indices of a step and their mask; steps past the end are fully masked."""
    # A step past the end (the prefetch after the last) stops at the end: with a program per
    # row block it would reach twice the row count, where int32 rows of a large x wrap to
    # negative indices that pass the mask.
    block = jnp.minimum(self.p + step * self.n_programs, self.n_row_blocks)
    rows = block * self.block_rows + jnp.arange(self.block_rows, dtype=jnp.int32)
    return rows, rows < self.n_rows

  def loop(self, load, body, init):
    """``body(step, loaded, carry)`` over this program's steps, loading a step ahead when the
    tiles are small enough to hold two."""
    if not self.prefetch:
      return lax.fori_loop(0, self.n_steps, lambda i, c: body(i, load(i), c), init)
    return pipelined_loop(self.n_steps, load, body, init)


def _forward_kernel(*refs, kind, has_weight, has_bias, eps, n_rows, n_cols, blocks, cdt):
  x_ref, *refs = refs
  w_ref = refs.pop(0) if has_weight else None
  b_ref = refs.pop(0) if has_bias else None
  y_ref, *stat_refs = refs
  blk = _RowBlocks(n_rows, blocks, prefetch_limit=32)
  g, bc = blk.g, blocks.block_cols
  n_chunks = pl.cdiv(n_cols, bc)

  def columns(j):
    cols = j * bc + jnp.arange(bc, dtype=jnp.int32)
    return cols, cols < n_cols

  def params(j):
    cols, col_ok = columns(j)
    w = _load(w_ref, (g, cols), col_ok, cdt) if has_weight else None
    b = _load(b_ref, (g, cols), col_ok, cdt) if has_bias else None
    return w, b

  def write(rows, row_ok, j, x, mean, rstd, w, b):
    cols, col_ok = columns(j)
    y = (x if mean is None else x - mean[:, None]) * rstd[:, None]
    if w is not None:
      y = y * w[None, :]
    if b is not None:
      y = y + b[None, :]
    plgpu.store(y_ref.at[g, rows[:, None], cols[None, :]], y.astype(y_ref.dtype),
                mask=row_ok[:, None] & col_ok[None, :])

  def write_stats(rows, row_ok, mean, rstd):
    if kind == "layer":
      plgpu.store(stat_refs[0].at[g, rows], mean.astype(stat_refs[0].dtype), mask=row_ok)
    plgpu.store(stat_refs[-1].at[g, rows], rstd.astype(stat_refs[-1].dtype), mask=row_ok)

  def load_tile(rows, row_ok, j, evict=None):
    cols, col_ok = columns(j)
    mask = row_ok[:, None] & col_ok[None, :]
    return _load(x_ref, (g, rows[:, None], cols[None, :]), mask, evict=evict), mask

  if n_chunks == 1:
    w, b = params(0)

    def body(i, loaded, carry):
      rows, row_ok = blk.rows(i)
      x_raw, mask = loaded
      x = x_raw.astype(cdt)
      if kind == "layer":
        mean = jnp.sum(x, axis=1) / n_cols
        centred = jnp.where(mask, x - mean[:, None], 0.0)
        var = jnp.sum(centred * centred, axis=1) / n_cols
      else:
        mean, var = None, jnp.sum(x * x, axis=1) / n_cols
      rstd = lax.rsqrt(var + eps)
      write(rows, row_ok, 0, x, mean, rstd, w, b)
      write_stats(rows, row_ok, mean, rstd)
      return carry

    blk.loop(lambda i: load_tile(*blk.rows(i), 0), body, ())
    return

  # Long rows: both walks keep the next chunk's loads in flight while a chunk is reduced.
  @pl.loop(0, blk.n_steps)
  def _(i):
    rows, row_ok = blk.rows(i)
    first_chunks = lambda j: load_tile(rows, row_ok, j, "evict_last")
    if kind == "layer":
      # Welford's update per element (each lane sees one column per chunk), then Chan's merge
      # of the lanes once per row: no reduction across threads inside the walk.
      def stats(j, loaded, carry):
        mean, m2 = carry
        x_raw, mask = loaded
        x = x_raw.astype(cdt)
        delta = x - mean
        mean = jnp.where(mask, mean + delta / (j + 1).astype(cdt), mean)
        return mean, jnp.where(mask, m2 + delta * (x - mean), m2)
      tile = jnp.zeros((blocks.block_rows, bc), cdt)
      lane_mean, lane_m2 = pipelined_loop(n_chunks, first_chunks, stats, (tile, tile))
      last_cols, _ = columns(n_chunks - 1)
      lane_count = (n_chunks - (last_cols >= n_cols).astype(cdt))[None, :]
      # For data far from zero the sum of the lane means rounds much coarser than the mean's
      # own ulp; a second sum, of the lanes' (small) offsets from that first estimate, corrects
      # it and gives the between-lane part of M2 around the corrected mean.
      rough = jnp.sum(lane_count * lane_mean, axis=1) / n_cols
      offset = lane_mean - rough[:, None]
      correction = jnp.sum(lane_count * offset, axis=1) / n_cols
      mean = rough + correction
      m2 = jnp.sum(lane_m2 + lane_count * offset * offset, axis=1)
      var = (m2 - n_cols * correction * correction) / n_cols
    else:
      # Squares are summed elementwise and reduced across the row once, at the end.
      def stats(j, loaded, sum_sq):
        x = loaded[0].astype(cdt)
        return sum_sq + x * x
      sum_sq = pipelined_loop(n_chunks, first_chunks, stats,
                               jnp.zeros((blocks.block_rows, bc), cdt))
      mean, var = None, jnp.sum(sum_sq, axis=1) / n_cols
    rstd = lax.rsqrt(var + eps)

    def output(j, loaded, carry):
      write(rows, row_ok, j, loaded[0].astype(cdt), mean, rstd, *params(j))
      return carry

    pipelined_loop(n_chunks, lambda j: load_tile(rows, row_ok, j, "evict_first"), output, ())
    write_stats(rows, row_ok, mean, rstd)


def forward(x, weight, bias, *, kind, eps, out_dtype, blocks: NormBlocks | None = None):
  """``x (G, R, N)``, ``weight``/``bias`` ``(G, N)`` or None -> ``(y, mean | None, rstd)``."""
  n_groups, n_rows, n_cols = x.shape
  _check_extents(kind, x.shape)
  blocks = blocks or forward_blocks(n_rows, n_cols, kind)
  cdt = compute_dtype(x.dtype, None if weight is None else weight.dtype)
  stat = jax.ShapeDtypeStruct((n_groups, n_rows), cdt)
  out_shape = [jax.ShapeDtypeStruct(x.shape, out_dtype)] + [stat] * (2 if kind == "layer" else 1)
  kernel = functools.partial(
      _forward_kernel, kind=kind, has_weight=weight is not None, has_bias=bias is not None,
      eps=eps, n_rows=n_rows, n_cols=n_cols, blocks=blocks, cdt=cdt)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape,
      grid=(n_groups, _programs(blocks, n_rows, n_groups)),
      compiler_params=_compiler_params(blocks), interpret=registry.interpret_mode(),
      name=f"jaxfuse_{kind}_norm_fwd",
  )(x, *[p for p in (weight, bias) if p is not None])
  return (outs[0], outs[1], outs[2]) if kind == "layer" else (outs[0], None, outs[1])


def _backward_strategy(blocks: NormBlocks, n_cols: int, n_accumulators: int) -> str:
  """How the backward walks a row: 'tile' (one register tile), 'chunks' (a statically unrolled
  walk whose weight-gradient accumulators, one per chunk, stay in registers) or 'split' (dx
  from a row kernel, the weight gradients from a column-parallel kernel)."""
  n_chunks = pl.cdiv(n_cols, blocks.block_cols)
  if n_chunks == 1:
    return "tile"
  if blocks.strategy is not None:
    return blocks.strategy
  per_thread = n_accumulators * n_chunks * blocks.block_cols // (32 * blocks.num_warps)
  if n_chunks <= _MAX_UNROLLED_CHUNKS and per_thread <= _MAX_ACCUMULATORS_PER_THREAD:
    return "chunks"
  return "split"


class _BackwardTiles:
  """Loads and per-tile math shared by the backward kernels."""

  def __init__(self, kind, refs, g, n_cols, block_cols, cdt):
    self.kind, self.g, self.n_cols, self.bc, self.cdt = kind, g, n_cols, block_cols, cdt
    self.dy_ref, self.x_ref, self.w_ref, self.mean_ref, self.rstd_ref = refs

  def columns(self, j):
    cols = j * self.bc + jnp.arange(self.bc, dtype=jnp.int32)
    return cols, cols < self.n_cols

  def load(self, rows, row_ok, j, evict=None):
    """Raw x and dy tiles of chunk j of ``rows``, the rows' statistics and the tile mask."""
    cols, col_ok = self.columns(j)
    mask = row_ok[:, None] & col_ok[None, :]
    index = (self.g, rows[:, None], cols[None, :])
    rstd = _load(self.rstd_ref, (self.g, rows), row_ok, self.cdt)
    mean = (_load(self.mean_ref, (self.g, rows), row_ok, self.cdt)
            if self.kind == "layer" else None)
    return (_load(self.x_ref, index, mask, evict=evict),
            _load(self.dy_ref, index, mask, evict=evict), mean, rstd, mask)

  def weight(self, j):
    if self.w_ref is None:
      return None
    cols, col_ok = self.columns(j)
    return _load(self.w_ref, (self.g, cols), col_ok, self.cdt)

  def math(self, loaded, w):
    """x_hat, dy and w * dy of a tile, zero outside the array."""
    x_raw, dy_raw, mean, rstd, mask = loaded
    dy = dy_raw.astype(self.cdt)
    x_hat = x_raw.astype(self.cdt)
    if mean is not None:
      x_hat = jnp.where(mask, x_hat - mean[:, None], 0.0)
    x_hat = x_hat * rstd[:, None]
    return x_hat, dy, (dy * w[None, :] if w is not None else dy)

  def row_terms(self, x_hat, wdy):
    """Elementwise terms of dx's row sums: sum(x_hat * w * dy) and, for LayerNorm, sum(w * dy)."""
    return (x_hat * wdy,) + ((wdy,) if self.kind == "layer" else ())


def _param_terms(x_hat, dy, has_weight, has_bias):
  """Elementwise terms of the weight and bias gradients, summed over rows."""
  return ((x_hat * dy,) if has_weight else ()) + ((dy,) if has_bias else ())


def _backward_kernel(*refs, kind, has_weight, has_bias, n_rows, n_cols, blocks, strategy,
                     cdt):
  dy_ref, x_ref, *refs = refs
  w_ref = refs.pop(0) if has_weight else None
  mean_ref = refs.pop(0) if kind == "layer" else None
  rstd_ref, dx_ref, *partial_refs = refs  # dweight/dbias partials; none for 'split'
  # The backward also holds the weight-gradient accumulators: prefetch only small shares.
  blk = _RowBlocks(n_rows, blocks, prefetch_limit=16)
  g, p, bc = blk.g, blk.p, blocks.block_cols
  tiles = _BackwardTiles(kind, (dy_ref, x_ref, w_ref, mean_ref, rstd_ref), g, n_cols, bc, cdt)
  n_chunks = pl.cdiv(n_cols, bc)

  def store_dx(rows, row_ok, j, x_hat, wdy, rstd, c1, c2):
    cols, col_ok = tiles.columns(j)
    dx = wdy - x_hat * c1[:, None]
    if c2 is not None:
      dx = dx - c2[:, None]
    plgpu.store(dx_ref.at[g, rows[:, None], cols[None, :]],
                (dx * rstd[:, None]).astype(dx_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])

  def means(sums):
    c1 = jnp.sum(sums[0], axis=1) / n_cols
    return c1, (jnp.sum(sums[1], axis=1) / n_cols if kind == "layer" else None)

  if strategy == "split":
    # Rows too long for register accumulators: walk each row twice, the second walk from L2
    # (evict_last on the first); the weight gradients come from _param_grads_kernel.
    @pl.loop(0, blk.n_steps)
    def _(i):
      rows, row_ok = blk.rows(i)

      def first_walk(j, loaded, sums):
        x_hat, _, wdy = tiles.math(loaded, tiles.weight(j))
        return tuple(s + t for s, t in zip(sums, tiles.row_terms(x_hat, wdy)))

      zeros = jnp.zeros((blocks.block_rows, bc), cdt)
      sums = pipelined_loop(n_chunks, lambda j: tiles.load(rows, row_ok, j, "evict_last"),
                             first_walk, (zeros,) * (2 if kind == "layer" else 1))
      c1, c2 = means(sums)

      def second_walk(j, loaded, carry):
        x_hat, _, wdy = tiles.math(loaded, tiles.weight(j))
        store_dx(rows, row_ok, j, x_hat, wdy, loaded[3], c1, c2)
        return carry

      pipelined_loop(n_chunks, lambda j: tiles.load(rows, row_ok, j, "evict_first"),
                      second_walk, ())
    return

  # 'tile' and 'chunks': the chunk loop is unrolled, so each chunk's weight-gradient
  # accumulators are registers of their own. One chunk is kept in registers between the walks;
  # more are read again from L2.
  tile_weight = tiles.weight(0) if n_chunks == 1 else None

  def body(i, first_chunk, acc):
    rows, row_ok = blk.rows(i)
    acc, sums, kept = list(acc), None, None
    for j in range(n_chunks):
      loaded = first_chunk if j == 0 else tiles.load(rows, row_ok, j, "evict_last")
      x_hat, dy, wdy = tiles.math(loaded, tile_weight if n_chunks == 1 else tiles.weight(j))
      terms = tiles.row_terms(x_hat, wdy)
      sums = terms if sums is None else tuple(s + t for s, t in zip(sums, terms))
      acc[j] = tuple(a + jnp.sum(t, axis=0) for a, t in
                     zip(acc[j], _param_terms(x_hat, dy, has_weight, has_bias)))
      if n_chunks == 1:
        kept = x_hat, wdy, loaded[3]
    c1, c2 = means(sums)
    for j in range(n_chunks):
      if kept is None:
        loaded = tiles.load(rows, row_ok, j, "evict_first")
        x_hat, _, wdy = tiles.math(loaded, tiles.weight(j))
        store_dx(rows, row_ok, j, x_hat, wdy, loaded[3], c1, c2)
      else:
        store_dx(rows, row_ok, j, *kept, c1, c2)
    return tuple(acc)

  first_evict = None if n_chunks == 1 else "evict_last"
  init = tuple(tuple(jnp.zeros((bc,), cdt) for _ in partial_refs) for _ in range(n_chunks))
  acc = blk.loop(lambda i: tiles.load(*blk.rows(i), 0, first_evict), body, init)
  for j in range(n_chunks):
    cols, col_ok = tiles.columns(j)
    for a, ref in zip(acc[j], partial_refs):
      plgpu.store(ref.at[g, p, cols], a, mask=col_ok)


def _param_grads_kernel(*refs, kind, has_weight, has_bias, n_rows, n_cols, blocks, cdt):
  """dweight/dbias partials of a contiguous range of rows, for one chunk of columns."""
  dy_ref, x_ref, *refs = refs
  mean_ref = refs.pop(0) if kind == "layer" else None
  rstd_ref, *out_refs = refs
  g, r, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  br, bc = blocks.block_rows, blocks.block_cols
  tiles = _BackwardTiles(kind, (dy_ref, x_ref, None, mean_ref, rstd_ref), g, n_cols, bc, cdt)
  steps = pl.cdiv(pl.cdiv(n_rows, br), pl.num_programs(1))
  first_row = r * steps * br

  def load(i):
    rows = first_row + i * br + jnp.arange(br, dtype=jnp.int32)
    return tiles.load(rows, rows < jnp.minimum(n_rows, first_row + steps * br), c)

  def body(i, loaded, acc):
    x_hat, dy, _ = tiles.math(loaded, None)
    return tuple(a + jnp.sum(t, axis=0)
                 for a, t in zip(acc, _param_terms(x_hat, dy, has_weight, has_bias)))

  acc = pipelined_loop(steps, load, body, tuple(jnp.zeros((bc,), cdt) for _ in out_refs))
  cols, col_ok = tiles.columns(c)
  for ref, a in zip(out_refs, acc):
    plgpu.store(ref.at[g, r, cols], a, mask=col_ok)


def _sum_partials_kernel(*refs, n_partials, n_cols, block_partials, block_cols):
  partial_refs, out_refs = refs[:len(refs) // 2], refs[len(refs) // 2:]
  g = pl.program_id(0)
  cols = pl.program_id(1) * block_cols + jnp.arange(block_cols, dtype=jnp.int32)
  col_ok = cols < n_cols
  for partial_ref, out_ref in zip(partial_refs, out_refs):
    def step(i, acc, partial_ref=partial_ref):
      idx = i * block_partials + jnp.arange(block_partials, dtype=jnp.int32)
      mask = (idx < n_partials)[:, None] & col_ok[None, :]
      tile = plgpu.load(partial_ref.at[g, idx[:, None], cols[None, :]], mask=mask, other=0.0)
      return acc + jnp.sum(tile, axis=0)

    total = lax.fori_loop(0, pl.cdiv(n_partials, block_partials), step,
                          jnp.zeros((block_cols,), partial_ref.dtype))
    plgpu.store(out_ref.at[g, cols], total.astype(out_ref.dtype), mask=col_ok)


def _sum_partials(partials, dtypes):
  """Stage two: each ``(G, P, N)`` partial -> ``(G, N)``, summed in a fixed order.

  The sums are tiny (P is a few hundred) and latency-bound: one launch does all of them, each
  program loads all P partials of a narrow column strip at once, and the strips spread over
  the SMs.
  """
  n_groups, n_partials, n_cols = partials[0].shape
  block_partials = min(pl.next_power_of_2(n_partials), 512)
  block_cols = min(pl.next_power_of_2(n_cols), max(16, 8192 // block_partials))
  kernel = functools.partial(_sum_partials_kernel, n_partials=n_partials, n_cols=n_cols,
                             block_partials=block_partials, block_cols=block_cols)
  return pl.pallas_call(
      kernel, out_shape=[jax.ShapeDtypeStruct((n_groups, n_cols), d) for d in dtypes],
      grid=(n_groups, pl.cdiv(n_cols, block_cols)),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=registry.interpret_mode(), name="jaxfuse_norm_sum_partials",
  )(*partials)


def sum_param_partials(dweight_partial, dbias_partial, weight_dtype, bias_dtype):
  """Stage two of either backward: ``(G, P, N)`` float32 partials of dweight and dbias (None
  where absent) -> ``(dweight, dbias)`` in the parameters' dtypes, in one launch."""
  pairs = [(p, d) for p, d in ((dweight_partial, weight_dtype), (dbias_partial, bias_dtype))
           if p is not None]
  sums = list(_sum_partials([p for p, _ in pairs], [d for _, d in pairs])) if pairs else []
  dweight = sums.pop(0) if dweight_partial is not None else None
  dbias = sums.pop(0) if dbias_partial is not None else None
  return dweight, dbias


def _param_grads_blocks(n_rows: int, n_cols: int) -> NormBlocks:
  """Column chunks of 512 and row ranges, ~4 programs per SM, 16 elements per thread."""
  block_cols = min(pl.next_power_of_2(n_cols), 512)
  block_rows = min(8, pl.next_power_of_2(n_rows))
  col_chunks = pl.cdiv(n_cols, block_cols)
  row_groups = max(1, min(pl.cdiv(n_rows, block_rows),
                          pl.cdiv(4 * registry.num_multiprocessors(), col_chunks)))
  return NormBlocks(block_rows, block_cols, max(1, block_rows * block_cols // 512), row_groups)


def backward(dy, x, weight, mean, rstd, *, kind, has_bias, bias_dtype=None,
             blocks: NormBlocks | None = None):
  """Returns ``(dx, dweight | None, dbias | None)`` for ``(G, R, N)`` inputs."""
  n_groups, n_rows, n_cols = x.shape
  _check_extents(kind, x.shape)
  blocks = blocks or backward_blocks(n_rows, n_cols, kind)
  has_weight = weight is not None
  strategy = _backward_strategy(blocks, n_cols, has_weight + has_bias)
  programs = _programs(blocks, n_rows, n_groups)
  stats = [a for a in (mean,) if a is not None] + [rstd]
  n_partial = 0 if strategy == "split" else has_weight + has_bias
  partial = jax.ShapeDtypeStruct((n_groups, programs, n_cols), rstd.dtype)
  kernel = functools.partial(
      _backward_kernel, kind=kind, has_weight=has_weight, has_bias=has_bias, n_rows=n_rows,
      n_cols=n_cols, blocks=blocks, strategy=strategy, cdt=rstd.dtype)
  dx, *partials = pl.pallas_call(
      kernel, out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] + [partial] * n_partial,
      grid=(n_groups, programs), compiler_params=_compiler_params(blocks),
      interpret=registry.interpret_mode(), name=f"jaxfuse_{kind}_norm_bwd",
  )(dy, x, *([weight] if has_weight else []), *stats)
  if strategy == "split" and has_weight + has_bias:
    pb = _param_grads_blocks(n_rows, n_cols)
    partial = jax.ShapeDtypeStruct((n_groups, pb.programs, n_cols), rstd.dtype)
    partials = list(pl.pallas_call(
        functools.partial(_param_grads_kernel, kind=kind, has_weight=has_weight,
                          has_bias=has_bias, n_rows=n_rows, n_cols=n_cols, blocks=pb,
                          cdt=rstd.dtype),
        out_shape=[partial] * (has_weight + has_bias),
        grid=(n_groups, pb.programs, pl.cdiv(n_cols, pb.block_cols)),
        compiler_params=_compiler_params(pb), interpret=registry.interpret_mode(),
        name=f"jaxfuse_{kind}_norm_param_grads",
    )(dy, x, *stats))
  return (dx, *sum_param_partials(partials[0] if has_weight else None,
                                  partials[-1] if has_bias else None,
                                  weight.dtype if has_weight else None, bias_dtype))
