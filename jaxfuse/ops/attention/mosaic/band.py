"""Index math of the kernels, on Python ints where nothing is traced, else on int32 scalars:
which column tiles a block of rows walks under the mask (``_Band``), the tiles segment ids
reach, and the work items each CTA takes (``_schedule``)."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from jaxfuse._core import registry
from jaxfuse.ops.attention.mosaic.config import _CONSUMERS


def _segment_spans(row_ids, col_ids, rows: int, cols: int, block_rows: int, block_cols: int):
  """``(B, rows // block_rows, 4)``: per block of rows (queries in the forward), the column
  tiles (keys) ``[lo, hi)`` from the first to the last whose range of segment ids meets the
  block's, and within them ``[full_lo, full_hi)``, the first run of tiles whose ids all equal
  the block's one id (empty where its rows hold several), which need no segment mask. Packed
  documents (sorted ids) then walk only their own document's tiles, masking only those at a
  document's edges; any ids stay correct."""
  b = row_ids.shape[0]
  # Padding repeats the last id, widening no range (padded keys are masked by S, padded
  # queries have no probability).
  edge = lambda a, n: jnp.pad(a.astype(jnp.int32), ((0, 0), (0, n - a.shape[1])), mode="edge")
  rs = edge(row_ids, rows).reshape(b, -1, 1, block_rows)
  cs = edge(col_ids, cols).reshape(b, 1, -1, block_cols)
  (row_min, row_max), (col_min, col_max) = ((a.min(-1), a.max(-1)) for a in (rs, cs))
  meets = (row_min <= col_max) & (col_min <= row_max)
  tiles = meets.shape[-1]
  lo = jnp.argmax(meets, -1)
  hi = jnp.where(meets.any(-1), tiles - jnp.argmax(meets[..., ::-1], -1), lo)
  same = (row_min == row_max) & (col_min == col_max) & (col_min == row_min)
  full_lo = jnp.where(same.any(-1), jnp.argmax(same, -1), lo)
  run_ends = ~same & (jnp.arange(tiles) >= full_lo[..., None])
  full_hi = jnp.where(run_ends.any(-1), jnp.argmax(run_ends, -1), tiles)
  full_hi = jnp.where(same.any(-1), full_hi, full_lo)
  return jnp.stack([lo, hi, full_lo, full_hi], -1).astype(jnp.int32)


def _block_spans(spans_ref, batch, cta):
  """``span_of(i)``: the segment span (``_segment_spans``) of block i of a CTA's rows, or None
  without segments."""
  if spans_ref is None:
    return None
  return lambda i: tuple(spans_ref[batch, cta * _CONSUMERS + i, j] for j in range(4))


def _minimum(a, b):
  return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _maximum(a, b):
  return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _iota(shape, axis):
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


def _div(a, b: int):
  """``a // b`` for ``a >= 0``, a Python int where ``a`` is one."""
  return a // b if isinstance(a, int) else lax.div(a, jnp.int32(b))


def _select(condition, a, b):
  return (a if condition else b) if isinstance(condition, bool) else jnp.where(condition, a, b)


def _diagonals(spec):
  """``(low, high)``: query i keeps key j where ``low <= j - i <= high`` (None: unbounded)."""
  offset = spec.causal_offset
  high = offset if spec.is_causal else None
  low = None
  if spec.window is not None:
    left, right = spec.window
    high = offset + right if high is None else min(high, offset + right)
    low = offset - left
  return low, high


@dataclasses.dataclass(frozen=True)
class _Band:
  """Which column tiles blocks of rows walk, for a mask that keeps (row, col) where
  ``low <= col - row <= high`` and col is below a limit. Rows are queries and columns keys
  in the forward and the dQ kernel, the other way round in the dK/dV kernel. Bounds are
  Python ints where nothing is traced (the plain full case: static loops), else int32
  scalars."""
  rows: int  # rows that exist (those past it are padding)
  low: int | None
  high: int | None
  block_rows: int
  block_cols: int
  col_tiles: int
  mask_every_tile: bool

  @classmethod
  def of_queries(cls, t, spec, block_q, block_kv, kv_tiles, mask_every_tile):
    return cls(t, *_diagonals(spec), block_q, block_kv, kv_tiles, mask_every_tile)

  @classmethod
  def of_keys(cls, s, spec, block_kv, block_q, q_tiles, mask_every_tile):
    low, high = _diagonals(spec)
    negate = lambda x: None if x is None else -x
    return cls(s, negate(high), negate(low), block_kv, block_q, q_tiles, mask_every_tile)

  @property
  def has_padding_block(self) -> bool:
    """Whether the last CTA's second block lies wholly past the rows."""
    return 0 < self.rows % (_CONSUMERS * self.block_rows) <= self.block_rows

  def tiles(self, first, last, limit, span=None, row_limit=None):
    """Rows ``first..last`` (clipped to the rows that exist): ``(lo, full_lo, full_hi, hi)``,
    ``[lo, hi)`` every tile with a column some row may keep, ``[full_lo, full_hi)`` those
    whose columns every row keeps (no mask). ``limit``: the columns that exist (S, or this
    batch's length); ``span``: the tiles the rows' segment ids reach; ``row_limit``: this
    batch's length of the rows, past which no row needs a tile (the kernel zeroes them or
    gives them no probability)."""
    block = self.block_cols
    last = _minimum(last, self.rows - 1)
    if row_limit is not None:
      last = _minimum(last, row_limit - 1)
    end, begin = limit, 0  # columns kept by some row: [begin, end)
    full_end, full_begin = limit, 0  # columns kept by every row
    if self.high is not None:
      end = _minimum(end, last + self.high + 1)
      full_end = _minimum(full_end, first + self.high + 1)
    if self.low is not None:
      begin = _maximum(0, first + self.low)
      full_begin = _maximum(0, last + self.low)
    lo = _minimum(_div(_maximum(begin, 0), block), self.col_tiles)
    hi = _div(_maximum(end, 0) + block - 1, block)
    if span is not None:
      lo, hi = _maximum(lo, span[0]), _minimum(hi, span[1])
    hi = _maximum(lo, hi)
    if isinstance(first, int) or self.has_padding_block or row_limit is not None:
      hi = _select(first <= last, hi, lo)  # a block of rows past the rows walks nothing
    if self.mask_every_tile:
      return lo, hi, hi, hi
    full_lo = _minimum(hi, _maximum(lo, _div(full_begin + block - 1, block)))
    full_hi = _minimum(hi, _maximum(full_lo, _div(_maximum(full_end, 0), block)))
    if span is not None:  # and the tiles of the rows' one segment id
      full_lo = _minimum(full_hi, _maximum(full_lo, span[2]))
      full_hi = _maximum(full_lo, _minimum(full_hi, span[3]))
    return lo, full_lo, full_hi, hi

  def cta(self, cta_first, limit, span_of=None, row_limit=None):
    """``[cta_lo, cta_hi)``: the tiles the producer loads for a CTA's two blocks of rows, the
    hull of their ranges (``span_of(i)``: block i's segment span, or None)."""
    if span_of is None:  # bands grow with the rows: the CTA's is its rows' band
      cta_lo, _, _, cta_hi = self.tiles(
          cta_first, cta_first + _CONSUMERS * self.block_rows - 1, limit, row_limit=row_limit)
      return cta_lo, cta_hi
    ranges = [self.tiles(cta_first + i * self.block_rows,
                         cta_first + (i + 1) * self.block_rows - 1, limit, span_of(i),
                         row_limit)
              for i in range(_CONSUMERS)]
    cta_hi, cta_lo = 0, self.col_tiles  # an empty block's range is left out
    for lo, _, _, hi in ranges:
      cta_hi = _maximum(cta_hi, _select(lo < hi, hi, 0))
      cta_lo = _minimum(cta_lo, _select(lo < hi, lo, self.col_tiles))
    return _minimum(cta_lo, cta_hi), cta_hi

  def block(self, first, limit, span, cta, row_limit=None):
    """The block of rows from ``first``: its ``tiles`` within the CTA's ``(cta_lo, cta_hi)``.
    Tiles of the hull outside them are passed as the partner's; a block whose band lies past
    the CTA's (no column for any of its rows) gets none."""
    cta_lo, cta_hi = cta
    lo, full_lo, full_hi, hi = self.tiles(first, first + self.block_rows - 1, limit, span,
                                          row_limit)
    lo = _minimum(_maximum(lo, cta_lo), cta_hi)
    return (lo,) + tuple(_minimum(_maximum(x, lo), cta_hi) for x in (full_lo, full_hi, hi))

  def mask(self, z, row0, col0, limit, row_limit=None, ids=None, diagonal=True):
    """Tile ``z`` (first row ``row0``, column ``col0``) with -inf where the band, the
    ``limit`` of the columns, the ``row_limit`` of the rows or, where ``ids()`` gives the
    rows' and columns' segment ids, unequal ids mask it. A limit that is a multiple of the
    tile costs nothing (no tile walked crosses it). ``diagonal``: the band compares the
    tile's column-minus-row with bounds that take its origin (one compare per bound and
    element), else its positions (``Config.diagonal_mask``)."""
    rows, cols = _iota(z.shape, 0), _iota(z.shape, 1)
    ok = []
    crosses_limit = not (isinstance(limit, int) and limit % self.block_cols == 0)
    if diagonal:  # the origin goes to the scalars: positions relative to it
      offsets, shift = cols - rows, col0 - row0
      if self.high is not None:
        ok.append(offsets <= self.high - shift)
      if self.low is not None:
        ok.append(offsets >= self.low - shift)
      limit = limit - col0
      row_limit = None if row_limit is None else row_limit - row0
    else:
      rows, cols = rows + row0, cols + col0
      if self.high is not None:
        ok.append(cols <= rows + self.high)
      if self.low is not None:
        ok.append(cols >= rows + self.low)
    if crosses_limit:
      ok.append(cols < limit)
    if row_limit is not None:
      ok.append(rows < row_limit)
    if ids is not None:
      row_ids, col_ids = ids()
      ok.append(lax.broadcast_in_dim(row_ids, z.shape, [0])
                == lax.broadcast_in_dim(col_ids, z.shape, [1]))
    return jnp.where(functools.reduce(jnp.logical_and, ok), z, -jnp.inf) if ok else z


def _work_item(cta, i, ctas: int, heads: int, blocks: int):
  """``(batch, head, block)``: item ``i`` of CTA ``cta`` of a persistent kernel whose items
  are ``blocks`` blocks of rows per head (query tiles in the forward).

  Work comes in pairs of blocks of one head, the k-th from each end, the later first (with an
  odd count the middle block pairs with block ``blocks``, past the rows, which walks and
  stores nothing): under a causal mask (or packed causal documents) every pair walks about
  as many tiles, so dealing pairs round-robin to the CTAs balances them. A head's pairs are
  consecutive, so the CTAs running at once stream the tiles of a few heads, from L2."""
  per_head = -(-blocks // 2)
  pair = cta + lax.div(i, 2) * ctas
  k = lax.rem(pair, per_head)
  head_of_batch = lax.div(pair, per_head)
  later = blocks - 1 - k
  block = jnp.where(lax.rem(i, 2) == 0, later, jnp.where(later == k, blocks, k))
  return lax.div(head_of_batch, heads), lax.rem(head_of_batch, heads), block


def _schedule(batch: int, heads: int, blocks: int, persistent: bool = True,
              last_first: bool = False):
  """A kernel's work over ``blocks`` blocks of rows per head: ``(ctas, count, item)``, its
  CTAs, the items CTA ``cta`` takes (``count(cta)``) and its i-th (``item(cta, i)``: batch,
  head, block). Persistent: one CTA per SM at most, items dealt in pairs (``_work_item``).
  Else a CTA per item, in the order the GPU launches them, a head's blocks from the last
  where ``last_first`` (where later blocks walk more tiles, they go first and the light ones
  even out the end)."""
  if not persistent:
    def item(cta, i):
      del i
      head_of_batch, block = lax.div(cta, blocks), lax.rem(cta, blocks)
      return (lax.div(head_of_batch, heads), lax.rem(head_of_batch, heads),
              blocks - 1 - block if last_first else block)
    return batch * heads * blocks, lambda cta: 1, item
  pairs = batch * heads * -(-blocks // 2)
  ctas = min(pairs, registry.num_multiprocessors())
  count = lambda cta: 2 * (lax.div(pairs - 1 - cta, ctas) + 1)
  return ctas, count, lambda cta, i: _work_item(cta, i, ctas, heads, blocks)
