"""Attention on Hopper's matrix units, forward and backward: Pallas Mosaic GPU, wgmma and TMA.

Forward. A work item is ``2 * block_q`` query rows of one head. The kernel is persistent: a
CTA per SM takes items in pairs, dealt round-robin (``_work_item``), and runs three
warpgroups. The third is the producer: it streams the key and value tiles of ``block_kv`` rows
into a ring of ``stages`` shared-memory slots by TMA, each slot guarded by a "loaded" barrier,
and refills a slot once both consumers have arrived on its "consumed" barrier. The ring runs
on from one item into the next, so the next item's first tiles load while this one's last
compute and its output is stored. The other two are consumers, each with ``block_q`` query
rows (the next item's loading into a second buffer): S = Q K^T by wgmma into a float32
accumulator, the online softmax in base 2 (running maximum of the scaled scores, exponentials
as exp2), then O += P V by wgmma. A schedule barrier the consumers pass twice per tile makes
them take turns on the tensor cores, so one's softmax runs while the other's products do
(FlashAttention-3's ping-pong).

Masks come from positions (causal with an offset, a (left, right) window, key and query
lengths) and from segment ids. Each consumer walks the key tiles of its band in three runs:
masked tiles at the band's lower edge, tiles whose keys every row sees (no mask), masked tiles
at the upper edge; tiles wholly outside the band are not loaded. Segment ids mask the tiles
other than those whose ids are all the rows' one id; query lengths (in the forward) mask every
tile. The producer loads the union of both consumers' bands; a consumer passes the
tiles only its partner needs, waiting and arriving on their barriers without computing (a
Mosaic barrier's phase is tracked per thread, so no wait may be skipped).

Partial tiles: queries and keys past T and S are read as zeros by TMA, which also drops stores
past T; keys past S are masked. Query and value head dims are 64, 128 or 256, independently.

Backward: two kernels of the same shape (a producer streaming tiles to two consumers, each
holding a block of rows; bands walked in masked and unmasked runs), each summing in a fixed
order, so the gradients are deterministic without atomics. A CTA takes one item, or, with
``BackwardConfig.persistent``, one CTA per SM takes items in pairs as the forward's, its ring
running on across items and the next item's rows loading into a second buffer. The dK/dV
kernel holds key blocks and streams the query tiles of every query head of the key's group in
turn (GQA sums over the group in order); the dQ kernel holds query blocks and streams key
tiles. Both recompute the probabilities from the saved log-sum-exp; a row with none saved (no
allowed key, padding, past the query length) has lse = +inf and so no probability, which no
mask has to see. At head dim 256 a key block's two float32 gradients outgrow a warpgroup's
registers: ``BackwardConfig.paired_dk_dv`` gives each consumer one of them, for one block of
key rows, the two trading P^T and dP^T - delta through shared memory.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxfuse._core import registry
from jaxfuse.ops.attention import reference

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_CONSUMERS = 2
_SMEM_BYTES = 227 * 1024  # shared memory a Hopper CTA may take


@dataclasses.dataclass(frozen=True)
class Config:
  """Rows per consumer warpgroup (``block_q``, a CTA takes two such blocks), key/value rows per
  tile, and the tiles in flight. ``prefetch_q``: the next item's queries load into a second
  buffer while this item's run."""
  block_q: int = 64
  block_kv: int = 128
  stages: int = 2
  prefetch_q: bool = True
  # Masks compare each score's column minus row with scalar bounds (``_Band.mask``), or, False,
  # its positions.
  diagonal_mask: bool = True

  def __post_init__(self):
    # With one slot every load would wait for the products before it: nothing in flight.
    if self.stages < 2:
      raise ValueError(f"Config.stages must be at least 2, got {self.stages}")


# Per head dim (the larger of the query's and the value's; the kernel is Hopper's only): tiles
# whose Q (two buffers with prefetch_q), K and V slots fit the 227 KiB of shared memory, the
# fastest of those timed (benchmarks/results/2026-11-24-h100-tune-attention-mosaic-hd128.json;
# in the persistent kernel, 2026-11-25-h100-tune-attention-mosaic-persistent.json, prefetching
# the queries gained up to 7% and lost 1% once). At head dim 256 a second buffer does not fit,
# and masks by positions ran its causal forward 1.7% faster than by diagonals, which ran head
# dims 64 and 128 4% and 1% faster
# (benchmarks/results/2026-11-26-h100-tune-attention-mosaic-mask-form.json).
CONFIGS = {64: Config(64, 128, 3), 128: Config(64, 128, 2),
           256: Config(64, 64, 2, prefetch_q=False, diagonal_mask=False)}


def unavailable() -> str | None:
  """Why the kernel cannot run here, or None: it needs Pallas Mosaic GPU and a Hopper GPU."""
  try:
    from jax.experimental.pallas import mosaic_gpu  # noqa: F401
  except ImportError as e:
    return f"this JAX ({jax.__version__}) has no Pallas Mosaic GPU: {e}"
  capability = registry.cuda_compute_capability()
  if capability is None or capability[0] != 9:
    return (f"the 'mosaic' attention is written for Hopper (sm_90) wgmma; this device is "
            f"{registry.platform()} {capability}")
  return None


# Where no mask needs the scores (no causal mask, window or segments), at head dim 64 key
# tiles twice as long halve the rescaling rounds and turns per key: 1.09x cuDNN's rate
# against 1.01x; causal they lost 1%
# (benchmarks/results/2026-11-25-h100-tune-attention-mosaic-persistent.json).
UNMASKED_CONFIGS = {64: Config(64, 256, 2)}


def _unmasked(spec, has_segments: bool) -> bool:
  """Whether no mask walks the bands (no causal mask, window or segments): the unmasked
  tables apply."""
  return not (spec.is_causal or spec.window is not None or has_segments)


def default_config(h: int, hv: int, spec, has_segments: bool) -> Config:
  """The forward's tiles for head dims ``h`` (queries, keys) and ``hv`` (values) and a mask."""
  dim = max(h, hv)
  if _unmasked(spec, has_segments):
    return UNMASKED_CONFIGS.get(dim, CONFIGS[dim])
  return CONFIGS[dim]


def unsupported(q_shape, k_shape, v_shape, dtype, *, spec, has_segments, has_q_len,
                has_kv_len, return_lse=False) -> str | None:
  """Why the kernel cannot take this call, naming the argument, or None."""
  del spec, has_segments, has_q_len, has_kv_len, return_lse  # all taken
  h, hv = q_shape[3], v_shape[3]
  if jnp.dtype(dtype) not in (jnp.float16, jnp.bfloat16):
    return f"the 'mosaic' kernel takes float16 and bfloat16, not {jnp.dtype(dtype).name}"
  for name, dim in (("query/key head dim", h), ("value head dim", hv)):
    if dim not in CONFIGS:
      return f"the 'mosaic' kernel takes a {name} in {tuple(CONFIGS)}, not {dim}"
  return None


def forward(q, k, v, extras, *, spec, scale, allow_tf32=None, config: Config | None = None):
  """``(out (B, T, N, Hv), lse (B, N, T) float32)`` for ``q (B, T, N, H)``,
  ``k (B, S, K, H)``, ``v (B, S, K, Hv)``; ``extras = (q_seg (B, T), kv_seg (B, S),
  q_len (B,), kv_len (B,))``, each possibly None."""
  del allow_tf32  # 16-bit operands only
  q_seg, kv_seg, q_len, kv_len = extras
  cfg = config or default_config(q.shape[3], v.shape[3], spec, q_seg is not None)
  t, s = q.shape[1], k.shape[1]
  # TMA copies of 8 x 64 tiles need T and S multiples of 8 (the rows past them are masked or
  # dropped); other tails TMA's bounds take care of, without a copy.
  q = _pad_rows(q, -(-t // 8) * 8)
  kv_tiles = -(-s // cfg.block_kv)
  # Where the pipeline's first loads reach the last tile, their static start must keep the
  # whole tile in bounds: so few keys are padded to whole tiles.
  kv_rows = kv_tiles * cfg.block_kv if kv_tiles <= max(2, cfg.stages) else -(-s // 8) * 8
  k, v = (_pad_rows(a, kv_rows) for a in (k, v))
  tp = -(-t // (_CONSUMERS * cfg.block_q)) * _CONSUMERS * cfg.block_q
  sp = kv_tiles * cfg.block_kv
  # Segment rows are padded to whole tiles: TMA needs 16-byte row strides, and every tile's
  # ids then lie in bounds.
  seg = lambda a, n: None if a is None else _pad_rows(a.astype(jnp.int32), n)
  as_int = lambda a: None if a is None else a.astype(jnp.int32)
  spans = None if q_seg is None else _segment_spans(q_seg, kv_seg, tp, sp, cfg.block_q,
                                                      cfg.block_kv)
  out, lse = _forward(q, k, v, seg(q_seg, tp), seg(kv_seg, sp), spans, as_int(q_len),
                      as_int(kv_len), t, s, spec, float(scale), cfg)
  return out[:, :t], lse[..., :t]


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


def _loop(lower, upper, fn, carry):
  """``lax.fori_loop``, nothing at all where the bounds are Python ints and empty."""
  if isinstance(lower, int) and isinstance(upper, int) and lower >= upper:
    return carry
  return lax.fori_loop(lower, upper, fn, carry)


def _load(plgpu, ref, layout):
  """The whole of ``ref`` in registers: JAX 0.10's ``plgpu.load`` takes the index as an
  argument, 0.11's deprecates it for ``ref.at``."""
  if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def _when(condition, fn):
  """``pl.when``, or ``fn`` run or skipped at trace time for a Python condition."""
  if isinstance(condition, bool):
    return fn() if condition else None
  from jax.experimental import pallas as pl
  return pl.when(condition)(fn)


def _swizzled(rows: int = 64):
  """wgmma reads shared memory (16-bit values) in 8 x 64 tiles with the 128-byte swizzle, or,
  where some product contracts over tiles of fewer than 64 ``rows``, 8 x 32 tiles with the
  64-byte swizzle (wgmma steps through the contraction a swizzle's width at a time)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  swizzle = 128 if rows % 64 == 0 else 64
  return dict(transforms=(plgpu.TilingTransform((8, swizzle // 2)),
                          plgpu.SwizzleTransform(swizzle)))


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


def _forward(q, k, v, q_seg, kv_seg, spans, q_len, kv_len, t: int, s: int, spec,
             scale: float, cfg: Config):
  """The kernel on ``q`` and ``k, v`` whose rows past ``t`` and ``s`` are padding."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  b, _, n, h = q.shape
  kv_heads, hv = k.shape[2], v.shape[3]
  groups = n // kv_heads
  dtype = q.dtype
  block_q, block_kv = cfg.block_q, cfg.block_kv
  rows_per_cta = _CONSUMERS * block_q
  q_tiles, kv_tiles = -(-t // rows_per_cta), -(-s // block_kv)
  stages = max(2, min(cfg.stages, kv_tiles))
  q_buffers = 2 if cfg.prefetch_q else 1
  ctas, count, work_item = _schedule(b, n, q_tiles)
  cap = spec.soft_cap
  has_segments = q_seg is not None
  band = _Band.of_queries(t, spec, block_q, block_kv, kv_tiles,
                          # Query lengths mask every tile: the rows past them, stored
                          # like the others, must see no key.
                          mask_every_tile=q_len is not None)
  # Scores enter exp2 as one fused multiply-add, z * factor - max, with the maximum kept in
  # scaled units; a soft-cap (or a scale <= 0, which would flip the maximum) scales first.
  factor = scale * _LOG2E if cap is None and scale > 0 else 1.0

  item = lambda i: work_item(lax.axis_index("cta"), i)

  def tile_range(batch, tile, kv_len_ref, q_len_ref, spans_ref):
    """``keys``, ``q_rows``, ``span_of`` and the CTA's key tiles (``band.cta``) of a tile."""
    keys = s if kv_len_ref is None else jnp.clip(kv_len_ref[batch], 0, s)
    q_rows = None if q_len_ref is None else jnp.clip(q_len_ref[batch], 0, t)
    span_of = _block_spans(spans_ref, batch, jnp.minimum(tile, q_tiles - 1))
    cta_lo, cta_hi = band.cta(tile * rows_per_cta, keys, span_of, q_rows)
    return keys, q_rows, span_of, (cta_lo, jnp.where(tile < q_tiles, cta_hi, cta_lo))

  def body(q_ref, k_ref, v_ref, extras, *refs):
    q_seg_ref, kv_seg_ref, spans_ref, q_len_ref, kv_len_ref = extras
    (out_ref, lse_ref, q_smem, k_smem, v_smem, o_smem, lse_smem, q_seg_smem, kv_seg_smem,
     k_loaded, v_loaded, seg_loaded, q_loaded, k_consumed, v_consumed, schedule) = refs
    wg = lax.axis_index("wg")
    my_items = count(lax.axis_index("cta"))

    def take_turn():
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)

    @pl.when(wg < _CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(232, action="increase")

      def load_q(i, buffer):
        batch, head, tile = item(i)
        first = tile * rows_per_cta + wg * block_q
        loaded = q_loaded.at[buffer * _CONSUMERS + wg]
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(first, block_q), head],
                                q_smem.at[buffer, wg], loaded)
        if has_segments:
          plgpu.copy_gmem_to_smem(q_seg_ref.at[batch, pl.ds(first, block_q)],
                                  q_seg_smem.at[buffer, wg], loaded)

      load_q(0, 0)

      def run_item(i, streamed):
        """The CTA's item ``i``; ``streamed``: the key tiles the ring carried before it."""
        batch, head, tile = item(i)
        keys, q_rows, span_of, (cta_lo, cta_hi) = tile_range(batch, tile, kv_len_ref,
                                                             q_len_ref, spans_ref)
        slot_of = lambda j: lax.rem(streamed + j - cta_lo, stages)
        buffer = lax.rem(i, q_buffers)
        my_q = q_smem.at[buffer, wg]
        plgpu.barrier_wait(q_loaded.at[buffer * _CONSUMERS + wg])
        # The item before's output has left shared memory (the other query buffer, where it
        # was staged, or its own): the next queries may load there.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if q_buffers > 1:
          _when(i + 1 < my_items, lambda: load_q(i + 1, 1 - buffer))
        if has_segments:
          q_ids = _load(plgpu, q_seg_smem.at[buffer, wg], plgpu.Layout.WGMMA.reduce(1))
        first = tile * rows_per_cta + wg * block_q
        span = None if span_of is None else span_of(wg)
        lo, full_lo, full_hi, hi = band.block(first, keys, span, (cta_lo, cta_hi), q_rows)

        def mask(z, j, slot):
          ids = None if not has_segments else lambda: (
              q_ids, _load(plgpu, kv_seg_smem.at[slot], plgpu.Layout.WGMMA.reduce(0)))
          return band.mask(z, first, j * block_kv, keys, q_rows, ids, cfg.diagonal_mask)

        row_stat = lambda value: plgpu.layout_cast(jnp.full((block_q,), value, jnp.float32),
                                                   plgpu.Layout.WGMMA.reduce(1))
        carry = (plgpu.layout_cast(jnp.zeros((block_q, hv), jnp.float32), plgpu.Layout.WGMMA),
                 row_stat(-jnp.inf), row_stat(0.0))

        def wait_next_key(j):
          _when(j + 1 < cta_hi, lambda: plgpu.barrier_wait(k_loaded.at[slot_of(j + 1)]))

        _when(cta_lo < cta_hi, lambda: plgpu.barrier_wait(k_loaded.at[slot_of(cta_lo)]))
        pl.when(wg == 1)(take_turn)

        def step(j, carry, masked):
          acc, m_i, l_i = carry
          slot = slot_of(j)

          def scores(acc_ref):
            plgpu.wgmma(acc_ref, my_q, k_smem.at[slot].transpose((1, 0)))
            take_turn()
            return acc_ref[...]

          z = pl.run_scoped(scores, plgpu.ACC((block_q, block_kv), jnp.float32))
          plgpu.barrier_arrive(k_consumed.at[slot])
          if cap is not None:
            z = jnp.tanh(z * (scale / cap)) * (cap * _LOG2E)  # base 2: exp(x) = exp2(x log2 e)
          elif factor == 1.0:
            z = z * (scale * _LOG2E)
          if has_segments:
            plgpu.barrier_wait(seg_loaded.at[slot])
          if masked:
            z = mask(z, j, slot)
          m_new = jnp.maximum(m_i, z.max(axis=1) * factor)
          # A row that has seen only masked scores keeps m = -inf: shift it by 0, not -inf.
          shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
          alpha = jnp.exp2(m_i - shift)
          p = jnp.exp2(z * factor - lax.broadcast_in_dim(shift, z.shape, [0]))
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          l_i = l_i * alpha + p.sum(axis=1)
          p = p.astype(dtype)
          acc, l_i, m_new, p = lax.optimization_barrier((acc, l_i, m_new, p))
          plgpu.barrier_arrive(schedule)
          plgpu.barrier_wait(v_loaded.at[slot])
          plgpu.barrier_wait(schedule)

          def values(acc_ref):
            plgpu.wgmma(acc_ref, p, v_smem.at[slot])
            wait_next_key(j)

          acc = pl.run_state(values)(plgpu.ACC.init(acc))
          plgpu.barrier_arrive(v_consumed.at[slot])
          return acc, m_new, l_i

        def skip(j, carry):
          """A tile the partner needs and these rows do not: its barriers pass, the turns
          keep alternating."""
          slot = slot_of(j)
          plgpu.barrier_arrive(k_consumed.at[slot])
          take_turn()
          if has_segments:
            plgpu.barrier_wait(seg_loaded.at[slot])
          plgpu.barrier_wait(v_loaded.at[slot])
          plgpu.barrier_arrive(v_consumed.at[slot])
          take_turn()
          wait_next_key(j)
          return carry

        acc, m_i, l_i = _walk((lo, full_lo, full_hi, hi), (cta_lo, cta_hi), step, skip, carry)
        pl.when(wg == 0)(take_turn)

        inverse = jnp.where(l_i == 0.0, 0.0, 1.0 / l_i)  # no key at all: 0, as the reference
        my_out = my_q if o_smem is None else o_smem.at[wg]
        my_out[...] = (acc * lax.broadcast_in_dim(inverse, acc.shape, [0])).astype(dtype)
        lse_smem.at[wg][...] = (m_i + jnp.log2(l_i)) * _LN2
        plgpu.commit_smem()

        @pl.when(tile < q_tiles)
        def _store():  # rows past T are dropped by TMA's bounds
          plgpu.copy_smem_to_gmem(my_out, out_ref.at[batch, pl.ds(first, block_q), head])
          plgpu.copy_smem_to_gmem(lse_smem.at[wg],
                                  lse_ref.at[batch, head, pl.ds(first, block_q)])

        if q_buffers == 1:  # the next queries go where these were
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          _when(i + 1 < my_items, lambda: load_q(i + 1, 0))
        return streamed + cta_hi - cta_lo

      lax.fori_loop(0, my_items, run_item, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")

      def stream_item(i, streamed):
        """The key and value tiles of the CTA's item ``i`` into the ring, running on into the
        next item's tiles. A slot's key refills once both consumers' scores have read it, its
        value (and segment ids, which the mask reads after the scores) once both products
        have: the next key loads half a tile sooner."""
        batch, head, tile = item(i)
        _, _, _, (cta_lo, cta_hi) = tile_range(batch, tile, kv_len_ref, q_len_ref, spans_ref)
        kv_head = lax.div(head, jnp.int32(groups))

        @pl.loop(cta_lo, cta_hi)
        def _(j):
          ring = streamed + j - cta_lo
          slot = lax.rem(ring, stages)

          refill = ring >= stages
          # Keys past S read as zeros (TMA's bounds) and are masked.
          rows = (batch, pl.ds(j * block_kv, block_kv), kv_head)
          _when(refill, lambda: plgpu.barrier_wait(k_consumed.at[slot]))
          plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])
          _when(refill, lambda: plgpu.barrier_wait(v_consumed.at[slot]))
          if has_segments:
            plgpu.copy_gmem_to_smem(kv_seg_ref.at[batch, pl.ds(j * block_kv, block_kv)],
                                    kv_seg_smem.at[slot], seg_loaded.at[slot])
          plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])

        return streamed + cta_hi - cta_lo

      lax.fori_loop(0, my_items, stream_item, jnp.int32(0))

  tiled = _swizzled()
  scratch = [
      plgpu.SMEM((q_buffers, _CONSUMERS, block_q, h), dtype, **tiled),
      plgpu.SMEM((stages, block_kv, h), dtype, **tiled),
      plgpu.SMEM((stages, block_kv, hv), dtype, **tiled),
      # The output is staged where its queries were, where it has their head dim.
      plgpu.SMEM((_CONSUMERS, block_q, hv), dtype, **tiled) if hv != h else None,
      plgpu.SMEM((_CONSUMERS, block_q), jnp.float32),
      plgpu.SMEM((q_buffers, _CONSUMERS, block_q), jnp.int32) if has_segments else None,
      plgpu.SMEM((stages, block_kv), jnp.int32) if has_segments else None,
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages) if has_segments else None,
      # Queries (and their segment ids: a second copy) per buffer and consumer.
      plgpu.Barrier(num_arrivals=1 + has_segments, num_barriers=q_buffers * _CONSUMERS),
      plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=_CONSUMERS),
  ]
  out_types = (jax.ShapeDtypeStruct((b, q.shape[1], n, hv), dtype),
               jax.ShapeDtypeStruct((b, n, q_tiles * rows_per_cta), jnp.float32))
  return _launch(body, scratch, out_types, ctas, (q, k, v),
                 (q_seg, kv_seg, spans, q_len, kv_len))


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Tiles of the two backward kernels. dK/dV: each consumer warpgroup holds ``dkdv_block_kv``
  key rows and their two float32 gradients while query tiles of ``dkdv_block_q`` rows stream
  past; dQ: each holds ``dq_block_q`` query rows and their gradient while key tiles of
  ``dq_block_kv`` rows stream past. ``stages``: streamed tiles in flight. ``persistent``: a
  CTA per SM runs item after item (``_schedule``), the next item's held rows loading into a
  second buffer while this item's walk runs; else a CTA per item."""
  dkdv_block_kv: int = 64
  dkdv_block_q: int = 64
  dq_block_q: int = 64
  dq_block_kv: int = 64
  stages: int = 2
  # dK and dV with the two consumers sharing one block of key rows, one holding dK, the other
  # dV (``_dkdv_paired``): at head dim 256 a key block's two float32 gradients together
  # outgrow a warpgroup's registers.
  paired_dk_dv: bool = False
  # Masks by column minus row, or, False, by positions (``Config.diagonal_mask``).
  diagonal_mask: bool = True
  persistent: bool = False

  def __post_init__(self):
    if self.stages < 2:
      raise ValueError(f"BackwardConfig.stages must be at least 2, got {self.stages}")
    if self.persistent and self.paired_dk_dv:
      raise ValueError("BackwardConfig.persistent takes dK and dV in one warpgroup, not "
                       "paired_dk_dv")
    # The dQ kernel's items then cover every query row the dK/dV kernel streams: the stats it
    # hands on (lse, delta) have no row unwritten.
    if (2 * self.dq_block_q) % self.dkdv_block_q:
      raise ValueError(f"BackwardConfig.dkdv_block_q ({self.dkdv_block_q}) must divide two "
                       f"dq_block_q ({2 * self.dq_block_q})")


# Per head dim (the larger of the query's and the value's), for the head dims CONFIGS takes.
# At 128 neither a third stage nor longer tiles gained
# (benchmarks/results/2026-11-25-h100-tune-attention-mosaic-bwd.json; on full rows a third
# stage read +0.4% and -2.4%, 2026-11-26-h100-tune-attention-mosaic-bwd-full-stages.json);
# at 64 the dQ kernel streams the forward's key tiles; at 256 shared memory takes only 32-row
# streamed tiles and the registers one float32 gradient per key block
# (benchmarks/results/2026-11-25-h100-tune-attention-mosaic-bwd-hd256*.json), which dK and
# dV paired give each consumer: four products per tile where two kernels took five, the step
# at 0.96x cuDNN's causal and 1.04x full against 0.88x and 1.03x
# (2026-11-26-h100-attention-mosaic-paired-dkdv.json, ...-table-bwd-tables.json). Consumers of 240
# registers (the producer 24) ran within 1% of 232 (and 40) either way
# (benchmarks/results/2026-11-26-h100-tune-attention-mosaic-bwd-registers.json). Masks by
# positions ran the causal step 2-3% faster at head dim 64 in two runs; at 128 and 256 the
# forms tied (2026-11-26-h100-tune-attention-mosaic-bwd-mask-form.json, ...-bwd-tables.json).
# Persistent kernels ran the step 4-5% faster at head dim 64; at 128 within 1% on (4, 4096)
# and 3% slower on 16k causal rows, where a CTA per item (the GPU deals them as CTAs finish,
# the light ones last) ends more evenly than a static deal; at 256 a second buffer of held
# rows does not fit (benchmarks/results/2026-11-26-h100-tune-attention-mosaic-bwd-persistent.json).
BACKWARD_CONFIGS = {64: BackwardConfig(64, 64, 64, 128, 2, diagonal_mask=False,
                                       persistent=True),
                    128: BackwardConfig(64, 64, 64, 64, 2),
                    256: BackwardConfig(64, 32, 64, 32, 2, paired_dk_dv=True)}

# Where no mask walks the bands (no causal mask, window or segments), at head dim 256 a third
# stage ran the full step 3-6% faster in three runs; causal it lost 3%
# (benchmarks/results/2026-11-25-h100-tune-attention-mosaic-bwd-hd256-stages.json,
# 2026-11-26-h100-tune-attention-mosaic-bwd-mask-form.json, ...-bwd-tables.json).
BACKWARD_UNMASKED_CONFIGS = {256: BackwardConfig(64, 32, 64, 32, 3, paired_dk_dv=True)}


def default_backward_config(h: int, hv: int, spec, has_segments: bool) -> BackwardConfig:
  """The backward's tiles for head dims ``h`` (queries, keys) and ``hv`` (values) and a mask."""
  dim = max(h, hv)
  if _unmasked(spec, has_segments):
    return BACKWARD_UNMASKED_CONFIGS.get(dim, BACKWARD_CONFIGS[dim])
  return BACKWARD_CONFIGS[dim]


def backward(q, k, v, do, lse, out, dlse, extras, *, spec, scale, allow_tf32=None,
             config: BackwardConfig | None = None):
  """``(dq, dk, dv)`` from the forward's ``out (B, T, N, Hv)`` and ``lse (B, N, T)`` (natural
  log) and the cotangents ``do`` and ``dlse (B, N, T)``. Two kernels, each summing in a fixed
  order (no atomics): dQ by query blocks, then dK/dV by key blocks, walking every query tile of
  every query head of the key's group. ``delta = rowsum(dO * O) - dlse`` comes from the dQ
  kernel, which holds dO's rows anyway, where O's fit beside them in shared memory
  (``_holds_out_rows``; else from XLA's pass, which reads dO a second time)."""
  del allow_tf32  # 16-bit operands only
  q_seg, kv_seg, q_len, kv_len = extras
  cfg = config or default_backward_config(q.shape[3], v.shape[3], spec, q_seg is not None)
  t, s = q.shape[1], k.shape[1]
  dq_band = _Band.of_queries(t, spec, cfg.dq_block_q, cfg.dq_block_kv,
                             -(-s // cfg.dq_block_kv), mask_every_tile=False)
  dkdv_band = _Band.of_keys(s, spec, cfg.dkdv_block_kv, cfg.dkdv_block_q,
                            -(-t // cfg.dkdv_block_q), mask_every_tile=False)
  # Rows of whole CTAs (two blocks) and whole streamed tiles, in both kernels.
  whole = lambda n, *blocks: -(-n // math.lcm(*blocks)) * math.lcm(*blocks)
  q_rows = whole(t, _CONSUMERS * cfg.dq_block_q, cfg.dkdv_block_q)
  kv_rows = whole(s, _CONSUMERS * cfg.dkdv_block_kv, cfg.dq_block_kv)
  # A row with no allowed key saved lse = -inf; +inf makes its probabilities 0, and so those
  # of padded rows and of rows past the query lengths: no mask needs them.
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * _LOG2E)
  in_kernel_delta = _holds_out_rows(cfg, q.shape[3], v.shape[3], q.dtype.itemsize)
  delta = -dlse if in_kernel_delta else reference.delta(do, out) - dlse
  stats = jnp.stack([jnp.pad(lse2, ((0, 0), (0, 0), (0, q_rows - t)), constant_values=jnp.inf),
                     jnp.pad(delta, ((0, 0), (0, 0), (0, q_rows - t)))], axis=2)
  ids = lambda a, n: None if a is None else _pad_rows(a.astype(jnp.int32), n)
  lengths = [None if a is None else a.astype(jnp.int32) for a in (q_len, kv_len)]
  # TMA copies of 8 x 64 tiles need T and S multiples of 8, and a tile's slice must fit its
  # operand: a streamed operand of few tiles is padded to whole tiles.
  def padded(a, n, tiles, block):
    few = tiles <= max(2, cfg.stages)
    return _pad_rows(a, tiles * block if few else -(-n // 8) * 8)
  dq_spans = dkdv_spans = None
  if q_seg is not None:
    dq_spans = _segment_spans(q_seg, kv_seg, q_rows, kv_rows, cfg.dq_block_q, cfg.dq_block_kv)
    dkdv_spans = _segment_spans(kv_seg, q_seg, kv_rows, q_rows, cfg.dkdv_block_kv,
                                cfg.dkdv_block_q)
  cap = spec.soft_cap
  dq, stats = _dq(_pad_rows(q, -(-t // 8) * 8), padded(k, s, dq_band.col_tiles, cfg.dq_block_kv),
                  padded(v, s, dq_band.col_tiles, cfg.dq_block_kv),
                  _pad_rows(do, -(-t // 8) * 8), stats, ids(q_seg, q_rows),
                  ids(kv_seg, kv_rows), dq_spans, lengths, s, dq_band, float(scale), cap, cfg,
                  _pad_rows(out, -(-t // 8) * 8) if in_kernel_delta else None)
  dkdv_args = (padded(q, t, dkdv_band.col_tiles, cfg.dkdv_block_q), _pad_rows(k, -(-s // 8) * 8),
               _pad_rows(v, -(-s // 8) * 8), padded(do, t, dkdv_band.col_tiles, cfg.dkdv_block_q),
               stats, ids(q_seg, q_rows), ids(kv_seg, kv_rows), dkdv_spans, lengths, t,
               dkdv_band, float(scale), cap, cfg)
  dk, dv = (_dkdv_paired if cfg.paired_dk_dv else _dkdv)(*dkdv_args)
  return dq[:, :t], dk[:, :s], dv[:, :s]


def _holds_out_rows(cfg: BackwardConfig, h: int, hv: int, itemsize: int) -> bool:
  """Whether the dQ kernel's shared memory holds the forward's output rows beside its Q and dO
  rows and streamed K and V tiles (with room for the stats, ids and barriers)."""
  buffers = 2 if cfg.persistent else 1
  held = buffers * _CONSUMERS * cfg.dq_block_q * (h + 2 * hv) * itemsize
  streamed = cfg.stages * cfg.dq_block_kv * (h + hv) * itemsize
  return held + streamed + 4096 <= _SMEM_BYTES


def _pad_rows(a, n):
  """``a`` with axis 1 padded with zeros to ``n`` rows (where it has fewer)."""
  if a.shape[1] >= n:
    return a
  return jnp.pad(a, ((0, 0), (0, n - a.shape[1])) + ((0, 0),) * (a.ndim - 2))


def _base2_scores(z, scale, cap):
  """Scores ``q . k`` in base-2 units (exp2 gives the softmax's exponentials), soft-capped,
  and the derivative factor of the cap (None without one)."""
  if cap is None:
    return z * (scale * _LOG2E), None
  capped = jnp.tanh(z * (scale / cap))
  return capped * (cap * _LOG2E), 1.0 - capped * capped


def _tile_gradients(s_operands, dp_operands, stats, stats_axis: int, mask, scale: float, cap):
  """``(P, dS)`` of one tile, recomputed: ``S = a b^T`` and ``dP = c d^T`` for the shared-memory
  operands ``(a, b)`` and ``(c, d)`` by wgmma, issued together; ``P = exp2(mask(S) - lse)``
  (``mask`` None: no mask), ``dS = P (dP - delta)`` times the soft-cap's derivative.
  ``stats()`` gives (lse, delta) along the tile's axis ``stats_axis``, read while the products
  run."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  tile = (s_operands[0].shape[0], s_operands[1].shape[0])

  def products(*acc_refs):
    for acc_ref, (lhs, rhs) in zip(acc_refs, (s_operands, dp_operands)):
      plgpu.wgmma(acc_ref, lhs, rhs.transpose((1, 0)))
    return tuple(acc_ref[...] for acc_ref in acc_refs)

  z, dp = pl.run_scoped(products, *[plgpu.ACC(tile, jnp.float32) for _ in range(2)])
  lse, delta = stats()
  z, cap_grad = _base2_scores(z, scale, cap)
  if mask is not None:
    z = mask(z)
  p = jnp.exp2(z - lax.broadcast_in_dim(lse, tile, [stats_axis]))
  ds = p * (dp - lax.broadcast_in_dim(delta, tile, [stats_axis]))
  return p, ds if cap_grad is None else ds * cap_grad


def _ring(stream, tiles, streamed, stages: int, consumed):
  """The producer's part of one item: ``stream(u, slot)`` of its tiles ``u`` in
  ``[0, tiles)`` into the ring of ``stages`` slots, which ``streamed`` tiles of earlier items
  have run through; a slot is refilled once the ``consumed`` barriers say its tile is done
  with. Returns the tiles streamed so far."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  @pl.loop(0, tiles)
  def _(u):
    ring = streamed + u
    slot = lax.rem(ring, stages)
    for barrier in consumed:
      _when(ring >= stages, functools.partial(plgpu.barrier_wait, barrier.at[slot]))
    stream(u, slot)

  return streamed + tiles


def _query_tile_loader(refs, slots, loaded, batch, kv_head, groups: int, lo, per_head,
                       block_q: int):
  """The dK/dV kernels' ``stream(u, slot)`` for ``_ring``: the u-th tile streamed, tile
  ``lo + u % per_head`` of query head ``u // per_head`` of the key's group; its Q, dO, stats
  (lse, delta) and, where ``refs`` has them, segment ids (``refs``: those four in global
  memory, ``slots``: in shared memory)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  q_ref, do_ref, stats_ref, q_seg_ref = refs
  q_smem, do_smem, stats_smem, q_seg_smem = slots

  def load(u, slot):
    g = _div(u, per_head) if groups > 1 else 0
    head, i = kv_head * groups + g, lo + u - g * per_head
    rows = pl.ds(i * block_q, block_q)
    plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem.at[slot], loaded.at[slot])
    plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_smem.at[slot], loaded.at[slot])
    plgpu.copy_gmem_to_smem(stats_ref.at[batch, head, :, rows], stats_smem.at[slot],
                            loaded.at[slot])
    if q_seg_ref is not None:
      plgpu.copy_gmem_to_smem(q_seg_ref.at[batch, rows], q_seg_smem.at[slot], loaded.at[slot])

  return load


def _walk(ranges, cta, step, skip, carry):
  """A consumer's tiles of the CTA's ``[cta_lo, cta_hi)``: masked tiles, unmasked tiles,
  masked tiles of its own band ``(lo, full_lo, full_hi, hi)``, the partner's tiles around
  them passed by ``skip`` (None where the band is the CTA's)."""
  lo, full_lo, full_hi, hi = ranges
  cta_lo, cta_hi = cta
  if skip is not None:
    carry = _loop(cta_lo, lo, skip, carry)
  carry = _loop(lo, full_lo, functools.partial(step, masked=True), carry)
  carry = _loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
  carry = _loop(full_hi, hi, functools.partial(step, masked=True), carry)
  return carry if skip is None else _loop(hi, cta_hi, skip, carry)


def _dq(q, k, v, do, stats, q_seg, kv_seg, spans, lengths, s: int, band: _Band, scale: float,
        cap, cfg: BackwardConfig, out=None):
  """dQ by items (``_schedule``) of two blocks of query rows of one head (one per consumer
  warpgroup: its Q, dO, lse and delta stay in shared memory and registers, the next item's
  loading into a second buffer where ``cfg.persistent``); a producer warpgroup streams the key
  and value tiles of the band through a ring that runs on from item to item. Per tile:
  S = Q K^T and dP = dO V^T, issued together; P = exp2(S - lse); dS = P (dP - delta);
  dQ += dS K. With the forward's ``out``, ``stats``' second row holds -dlse: delta adds
  rowsum(dO * O) from the rows held, and the stats go out with dQ for the dK/dV kernel."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  b, _, n, h = q.shape
  kv_heads, hv = k.shape[2], v.shape[3]
  groups = n // kv_heads
  dtype = q.dtype
  block_q, block_kv = band.block_rows, band.block_cols
  rows_per_cta = _CONSUMERS * block_q
  blocks = -(-band.rows // rows_per_cta)
  stages = max(2, min(cfg.stages, band.col_tiles))
  buffers = 2 if cfg.persistent else 1
  has_segments = q_seg is not None
  row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
  # Under a causal mask later query blocks walk more key tiles.
  ctas, count, work_item = _schedule(b, n, blocks, cfg.persistent,
                                     last_first=band.high is not None)

  def body(q_ref, k_ref, v_ref, do_ref, stats_ref, extras, *refs):
    q_seg_ref, kv_seg_ref, spans_ref, q_len_ref, kv_len_ref, out_ref = extras
    dq_ref, *refs = refs
    stats_out_ref = refs.pop(0) if out is not None else None
    (q_smem, do_smem, stats_smem, k_smem, v_smem, q_seg_smem, kv_seg_smem, out_smem,
     rows_loaded, loaded, consumed) = refs
    cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
    my_items = count(cta)

    def walked(item):
      """Item ``item``'s batch, head, block, key length, query length, segment spans and
      the key tiles its CTA streams (none for a block past the rows)."""
      batch, head, block = work_item(cta, item)
      keys = s if kv_len_ref is None else jnp.clip(kv_len_ref[batch], 0, s)
      # Queries past the length have lse = +inf (no probability): the walk only stops there.
      queries = None if q_len_ref is None else jnp.clip(q_len_ref[batch], 0, band.rows)
      span_of = _block_spans(spans_ref, batch, jnp.minimum(block, blocks - 1))
      cta_lo, cta_hi = band.cta(block * rows_per_cta, keys, span_of, queries)
      return (batch, head, block, keys, queries, span_of,
              (cta_lo, jnp.where(block < blocks, cta_hi, cta_lo)))

    @pl.when(wg < _CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(232, action="increase")

      def load_rows(item, buffer):
        batch, head, block = work_item(cta, item)
        first = block * rows_per_cta + wg * block_q
        rows = (batch, pl.ds(first, block_q), head)
        own = rows_loaded.at[buffer * _CONSUMERS + wg]
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[buffer, wg], own)
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[buffer, wg], own)
        plgpu.copy_gmem_to_smem(stats_ref.at[batch, head, :, pl.ds(first, block_q)],
                                stats_smem.at[buffer, wg], own)
        if has_segments:
          plgpu.copy_gmem_to_smem(q_seg_ref.at[batch, pl.ds(first, block_q)],
                                  q_seg_smem.at[buffer, wg], own)
        if out is not None:
          plgpu.copy_gmem_to_smem(out_ref.at[rows], out_smem.at[buffer, wg], own)

      load_rows(0, 0)

      def run_item(item, streamed):
        batch, head, block, keys, queries, span_of, (cta_lo, cta_hi) = walked(item)
        buffer = lax.rem(item, buffers)
        my_q = q_smem.at[buffer, wg]
        plgpu.barrier_wait(rows_loaded.at[buffer * _CONSUMERS + wg])
        if cfg.persistent:  # the other buffer's dQ (the item before's) has left: next rows there
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          _when(item + 1 < my_items, lambda: load_rows(item + 1, 1 - buffer))
        lse = _load(plgpu, stats_smem.at[buffer, wg, 0], row_layout)
        delta = _load(plgpu, stats_smem.at[buffer, wg, 1], row_layout)
        q_ids = _load(plgpu, q_seg_smem.at[buffer, wg], row_layout) if has_segments else None
        first = block * rows_per_cta + wg * block_q
        if out is not None:  # delta = rowsum(dO * O) - dlse, stored for the dK/dV kernel
          rows_of = lambda ref: _load(plgpu, ref.at[buffer, wg], plgpu.Layout.WGMMA)
          delta = delta + (rows_of(do_smem).astype(jnp.float32)
                           * rows_of(out_smem).astype(jnp.float32)).sum(axis=1)
          stats_smem.at[buffer, wg, 1][...] = delta
          plgpu.commit_smem()
          _when(block < blocks, lambda: plgpu.copy_smem_to_gmem(
              stats_smem.at[buffer, wg], stats_out_ref.at[batch, head, :, pl.ds(first, block_q)]))
        span = None if span_of is None else span_of(wg)
        ranges = band.block(first, keys, span, (cta_lo, cta_hi), queries)
        slot_of = lambda j: lax.rem(streamed + j - cta_lo, stages)

        def step(j, dq, masked):
          slot = slot_of(j)
          plgpu.barrier_wait(loaded.at[slot])

          def mask(z):
            ids = None if not has_segments else lambda: (
                q_ids, _load(plgpu, kv_seg_smem.at[slot], col_layout))
            return band.mask(z, first, j * block_kv, keys, ids=ids, diagonal=cfg.diagonal_mask)

          _, ds = _tile_gradients((my_q, k_smem.at[slot]),
                                  (do_smem.at[buffer, wg], v_smem.at[slot]),
                                  lambda: (lse, delta), 0, mask if masked else None, scale, cap)

          def gradient(acc_ref):
            plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem.at[slot])

          dq = pl.run_state(gradient)(plgpu.ACC.init(dq))
          plgpu.barrier_arrive(consumed.at[slot])
          return dq

        def skip(j, dq):
          slot = slot_of(j)
          plgpu.barrier_wait(loaded.at[slot])
          plgpu.barrier_arrive(consumed.at[slot])
          return dq

        dq = _walk(ranges, (cta_lo, cta_hi), step, skip,
                   plgpu.layout_cast(jnp.zeros((block_q, h), jnp.float32), plgpu.Layout.WGMMA))
        # Q's slot is free once the last product has been read.
        my_q[...] = (dq * scale).astype(dtype)
        plgpu.commit_smem()
        _when(block < blocks, lambda: plgpu.copy_smem_to_gmem(  # rows past T are dropped
            my_q, dq_ref.at[batch, pl.ds(first, block_q), head]))
        return streamed + cta_hi - cta_lo

      lax.fori_loop(0, my_items, run_item, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")

      def stream_item(item, streamed):
        batch, head, _, _, _, _, (cta_lo, cta_hi) = walked(item)
        kv_head = lax.div(head, jnp.int32(groups))

        def load(u, slot):
          rows = (batch, pl.ds((cta_lo + u) * block_kv, block_kv), kv_head)
          plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], loaded.at[slot])
          plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], loaded.at[slot])
          if has_segments:
            plgpu.copy_gmem_to_smem(kv_seg_ref.at[batch, pl.ds((cta_lo + u) * block_kv,
                                                               block_kv)],
                                    kv_seg_smem.at[slot], loaded.at[slot])

        return _ring(load, cta_hi - cta_lo, streamed, stages, (consumed,))

      lax.fori_loop(0, my_items, stream_item, jnp.int32(0))

  copies = 2 + has_segments
  tiled = _swizzled(min(block_q, block_kv))  # a product's operands share their swizzle
  scratch = [
      plgpu.SMEM((buffers, _CONSUMERS, block_q, h), dtype, **tiled),
      plgpu.SMEM((buffers, _CONSUMERS, block_q, hv), dtype, **tiled),
      plgpu.SMEM((buffers, _CONSUMERS, 2, block_q), jnp.float32),
      plgpu.SMEM((stages, block_kv, h), dtype, **tiled),
      plgpu.SMEM((stages, block_kv, hv), dtype, **tiled),
      plgpu.SMEM((buffers, _CONSUMERS, block_q), jnp.int32) if has_segments else None,
      plgpu.SMEM((stages, block_kv), jnp.int32) if has_segments else None,
      plgpu.SMEM((buffers, _CONSUMERS, block_q, hv), dtype, **tiled) if out is not None else None,
      # Q, dO, stats (ids, O) per buffer and consumer.
      plgpu.Barrier(num_arrivals=copies + 1 + (out is not None),
                    num_barriers=buffers * _CONSUMERS),
      plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
      plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
  ]
  out_types = (jax.ShapeDtypeStruct(q.shape, dtype),)
  if out is not None:
    out_types += (jax.ShapeDtypeStruct(stats.shape, jnp.float32),)
  results = _launch(body, scratch, out_types, ctas, (q, k, v, do, stats),
                    (q_seg, kv_seg, spans, *lengths, out))
  return results if out is not None else (results[0], stats)


def _dkdv(q, k, v, do, stats, q_seg, kv_seg, spans, lengths, t: int, band: _Band,
          scale: float, cap, cfg: BackwardConfig):
  """dK and dV by items (``_schedule``) of two blocks of key rows of one key/value head (one
  per consumer warpgroup: its K, V stay in shared memory, dK and dV in float32 registers; the
  next item's loading into a second buffer where ``cfg.persistent``); a producer streams, for
  each query head of the group in turn, the Q, dO, lse and delta tiles of the band, through a
  ring that runs on from item to item. Per tile, keys by queries (every product takes its
  operands as stored): S^T = K Q^T and dP^T = V dO^T, issued together;
  P^T = exp2(S^T - lse); dS^T = P^T (dP^T - delta); dV += P^T dO and dK += dS^T Q, issued
  together."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  b, _, n, h = q.shape
  kv_heads, hv = k.shape[2], v.shape[3]
  groups = n // kv_heads
  dtype = q.dtype
  block_kv, block_q = band.block_rows, band.block_cols
  rows_per_cta = _CONSUMERS * block_kv
  blocks = -(-band.rows // rows_per_cta)
  stages = max(2, min(cfg.stages, groups * band.col_tiles))
  buffers = 2 if cfg.persistent else 1
  has_segments = q_seg is not None
  row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
  # Under a causal mask earlier key blocks walk more query tiles: launched first.
  ctas, count, work_item = _schedule(b, kv_heads, blocks, cfg.persistent)

  def body(q_ref, k_ref, v_ref, do_ref, stats_ref, extras, *refs):
    q_seg_ref, kv_seg_ref, spans_ref, q_len_ref, kv_len_ref = extras
    (dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, stats_smem, kv_seg_smem, q_seg_smem,
     rows_loaded, loaded, consumed) = refs
    cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
    my_items = count(cta)

    def walked(item):
      """Item ``item``'s batch, key/value head, block, query length, key length, segment
      spans and the query tiles its CTA streams per head (none for a block past the rows)."""
      batch, kv_head, block = work_item(cta, item)
      # Queries past the lengths have lse = +inf (no probability): the band only stops there.
      queries = t if q_len_ref is None else jnp.clip(q_len_ref[batch], 0, t)
      # Keys past their length get no gradient (zeroed at the end): their walk stops there.
      keys = None if kv_len_ref is None else jnp.clip(kv_len_ref[batch], 0, band.rows)
      span_of = _block_spans(spans_ref, batch, jnp.minimum(block, blocks - 1))
      cta_lo, cta_hi = band.cta(block * rows_per_cta, queries, span_of, keys)
      return (batch, kv_head, block, queries, keys, span_of,
              (cta_lo, jnp.where(block < blocks, cta_hi, cta_lo)))

    @pl.when(wg < _CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(232, action="increase")

      def load_rows(item, buffer):
        batch, kv_head, block = work_item(cta, item)
        first = block * rows_per_cta + wg * block_kv
        rows = (batch, pl.ds(first, block_kv), kv_head)
        own = rows_loaded.at[buffer * _CONSUMERS + wg]
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[buffer, wg], own)
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[buffer, wg], own)
        if has_segments:
          plgpu.copy_gmem_to_smem(kv_seg_ref.at[batch, pl.ds(first, block_kv)],
                                  kv_seg_smem.at[buffer, wg], own)

      load_rows(0, 0)

      def run_item(item, streamed):
        batch, kv_head, block, queries, keys, span_of, (cta_lo, cta_hi) = walked(item)
        buffer = lax.rem(item, buffers)
        my_k, my_v = k_smem.at[buffer, wg], v_smem.at[buffer, wg]
        plgpu.barrier_wait(rows_loaded.at[buffer * _CONSUMERS + wg])
        if cfg.persistent:  # the other buffer's gradients (the item before's) have left
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          _when(item + 1 < my_items, lambda: load_rows(item + 1, 1 - buffer))
        kv_ids = (_load(plgpu, kv_seg_smem.at[buffer, wg], row_layout) if has_segments
                  else None)
        first = block * rows_per_cta + wg * block_kv
        span = None if span_of is None else span_of(wg)
        ranges = band.block(first, queries, span, (cta_lo, cta_hi), keys)
        cta_tiles = cta_hi - cta_lo

        def head_tiles(g, carry):
          # The producer streams tile i of head g as number g * cta_tiles + i - cta_lo.
          number = streamed + g * cta_tiles - cta_lo

          def step(i, carry, masked):
            slot = lax.rem(number + i, stages)
            plgpu.barrier_wait(loaded.at[slot])

            def mask(z):
              ids = None if not has_segments else lambda: (
                  kv_ids, _load(plgpu, q_seg_smem.at[slot], col_layout))
              return band.mask(z, first, i * block_q, queries, ids=ids,
                               diagonal=cfg.diagonal_mask)

            stats = lambda: tuple(_load(plgpu, stats_smem.at[slot, r], col_layout)
                                  for r in (0, 1))
            p, ds = _tile_gradients((my_k, q_smem.at[slot]), (my_v, do_smem.at[slot]), stats,
                                    1, mask if masked else None, scale, cap)

            def accumulate(acc_refs):
              dk_acc, dv_acc = acc_refs
              plgpu.wgmma(dv_acc, p.astype(dtype), do_smem.at[slot])  # needs no dS: first
              plgpu.wgmma(dk_acc, ds.astype(dtype), q_smem.at[slot])

            carry = pl.run_state(accumulate)(tuple(plgpu.ACC.init(a) for a in carry))
            plgpu.barrier_arrive(consumed.at[slot])
            return carry

          def skip(i, carry):
            slot = lax.rem(number + i, stages)
            plgpu.barrier_wait(loaded.at[slot])
            plgpu.barrier_arrive(consumed.at[slot])
            return carry

          return _walk(ranges, (cta_lo, cta_hi), step, skip, carry)

        carry = tuple(plgpu.layout_cast(jnp.zeros((block_kv, width), jnp.float32),
                                        plgpu.Layout.WGMMA) for width in (h, hv))
        carry = head_tiles(0, carry) if groups == 1 else lax.fori_loop(0, groups, head_tiles,
                                                                       carry)
        # K's and V's slots are free once the last products have been read.
        outputs = ((carry[0] * scale, my_k, dk_ref), (carry[1], my_v, dv_ref))
        for grad, my_rows, _ in outputs:
          if keys is not None:
            grad = jnp.where(_iota(grad.shape, 0) + first < keys, grad, 0.0)
          my_rows[...] = grad.astype(dtype)
        plgpu.commit_smem()

        @pl.when(block < blocks)
        def _store():  # rows past S are dropped
          for _, my_rows, out_ref in outputs:
            plgpu.copy_smem_to_gmem(my_rows, out_ref.at[batch, pl.ds(first, block_kv), kv_head])

        return streamed + groups * cta_tiles

      lax.fori_loop(0, my_items, run_item, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")

      def stream_item(item, streamed):
        batch, kv_head, _, _, _, _, (cta_lo, cta_hi) = walked(item)
        load = _query_tile_loader((q_ref, do_ref, stats_ref, q_seg_ref),
                                  (q_smem, do_smem, stats_smem, q_seg_smem), loaded, batch,
                                  kv_head, groups, cta_lo, cta_hi - cta_lo, block_q)
        return _ring(load, groups * (cta_hi - cta_lo), streamed, stages, (consumed,))

      lax.fori_loop(0, my_items, stream_item, jnp.int32(0))

  copies = 3 + has_segments
  tiled = _swizzled(min(block_q, block_kv))  # a product's operands share their swizzle
  scratch = [
      plgpu.SMEM((buffers, _CONSUMERS, block_kv, h), dtype, **tiled),
      plgpu.SMEM((buffers, _CONSUMERS, block_kv, hv), dtype, **tiled),
      plgpu.SMEM((stages, block_q, h), dtype, **tiled),
      plgpu.SMEM((stages, block_q, hv), dtype, **tiled),
      plgpu.SMEM((stages, 2, block_q), jnp.float32),
      plgpu.SMEM((buffers, _CONSUMERS, block_kv), jnp.int32) if has_segments else None,
      plgpu.SMEM((stages, block_q), jnp.int32) if has_segments else None,
      plgpu.Barrier(num_arrivals=copies - 1, num_barriers=buffers * _CONSUMERS),
      plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
      plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
  ]
  out_types = (jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype))
  return _launch(body, scratch, out_types, ctas, (q, k, v, do, stats),
                 (q_seg, kv_seg, spans, *lengths))



def _dkdv_paired(q, k, v, do, stats, q_seg, kv_seg, spans, lengths, t: int, band: _Band,
                 scale: float, cap, cfg: BackwardConfig):
  """dK and dV by a CTA per block of key rows of one key/value head, its two consumer
  warpgroups sharing the work of each streamed tile (keys by queries): the first holds K and
  dK and forms S^T = K Q^T and P^T = exp2(S^T - lse), the second holds V and dV and forms
  dP^T = V dO^T and dP^T - delta; each hands its result to the other through shared memory
  (two buffers each way, so neither waits for the other to read the last), then the first
  adds dK += dS^T Q, dS^T = P^T (dP^T - delta), and the second dV += P^T dO. Four products
  per tile and one float32 gradient per warpgroup, for head dims where a warpgroup's registers
  hold only one (256)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  b, _, n, h = q.shape
  kv_heads, hv = k.shape[2], v.shape[3]
  groups = n // kv_heads
  dtype = q.dtype
  block_kv, block_q = band.block_rows, band.block_cols
  blocks = -(-band.rows // block_kv)
  stages = max(2, min(cfg.stages, groups * band.col_tiles))
  has_segments = q_seg is not None
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  tile = (block_kv, block_q)
  # Under a causal mask earlier key blocks walk more query tiles: launched first.
  ctas, _, work_item = _schedule(b, kv_heads, blocks, persistent=False)

  def body(q_ref, k_ref, v_ref, do_ref, stats_ref, extras, dk_ref, dv_ref, k_smem, v_smem,
           q_smem, do_smem, stats_smem, kv_seg_smem, q_seg_smem, p_smem, d_smem, k_loaded,
           v_loaded, loaded, consumed, p_ready, p_free, d_ready, d_free):
    q_seg_ref, kv_seg_ref, spans_ref, q_len_ref, kv_len_ref = extras
    batch, kv_head, block = work_item(lax.axis_index("cta"), 0)
    wg = lax.axis_index("wg")
    # Queries past the lengths have lse = +inf (no probability): the band only stops there.
    queries = t if q_len_ref is None else jnp.clip(q_len_ref[batch], 0, t)
    # Keys past their length get no gradient (zeroed at the end): their walk stops there too.
    keys = None if kv_len_ref is None else jnp.clip(kv_len_ref[batch], 0, band.rows)
    first = block * block_kv
    span = None if spans_ref is None else tuple(spans_ref[batch, block, j] for j in range(4))
    ranges = band.tiles(first, first + block_kv - 1, queries, span, keys)
    lo, hi = ranges[0], ranges[3]
    walked = hi - lo
    rows = (batch, pl.ds(first, block_kv), kv_head)

    def walk(step, carry):
      """``step(i, slot, buffer, carry, masked)`` over tile i of the band for each query head
      of the group in turn, once it has loaded into ``slot`` of the ring; ``buffer``: the
      tile's buffer of those the consumers trade."""
      def head_tiles(g, carry):
        def loaded_step(i, carry, masked):
          u = g * walked + i - lo  # its number in the producer's stream
          slot = lax.rem(u, stages)
          plgpu.barrier_wait(loaded.at[slot])
          return step(i, slot, lax.rem(u, 2), carry, masked)
        return _walk(ranges, (lo, hi), loaded_step, None, carry)
      return head_tiles(0, carry) if groups == 1 else lax.fori_loop(0, groups, head_tiles,
                                                                    carry)

    def product(a, b):
      """``a b^T`` (keys by queries) of shared-memory operands, by wgmma."""
      def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b.transpose((1, 0)))
        return acc_ref[...]
      return pl.run_scoped(run, plgpu.ACC(tile, jnp.float32))

    def store(grad, my_rows, out_ref):
      if keys is not None:
        grad = jnp.where(_iota(grad.shape, 0) + first < keys, grad, 0.0)
      my_rows[...] = grad.astype(dtype)  # the rows' last product has read them
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(my_rows, out_ref.at[rows])  # rows past S are dropped
      plgpu.wait_smem_to_gmem(0)

    zeros = lambda width: plgpu.layout_cast(jnp.zeros((block_kv, width), jnp.float32),
                                            plgpu.Layout.WGMMA)

    @pl.when(wg == 0)
    def _keys():
      plgpu.set_max_registers(232, action="increase")
      plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, k_loaded)
      if has_segments:
        plgpu.copy_gmem_to_smem(kv_seg_ref.at[batch, pl.ds(first, block_kv)], kv_seg_smem,
                                k_loaded)
      for buffer in range(2):  # the partner's first two differences may go in
        plgpu.barrier_arrive(d_free.at[buffer])
      plgpu.barrier_wait(k_loaded)
      kv_ids = (_load(plgpu, kv_seg_smem, plgpu.Layout.WGMMA.reduce(1)) if has_segments
                else None)

      def step(i, slot, buffer, dk, masked):
        z, cap_grad = _base2_scores(product(k_smem, q_smem.at[slot]), scale, cap)
        if masked:
          ids = None if not has_segments else lambda: (
              kv_ids, _load(plgpu, q_seg_smem.at[slot], col_layout))
          z = band.mask(z, first, i * block_q, queries, ids=ids, diagonal=cfg.diagonal_mask)
        lse = _load(plgpu, stats_smem.at[slot, 0], col_layout)
        p = jnp.exp2(z - lax.broadcast_in_dim(lse, tile, [1]))
        plgpu.barrier_wait(p_free.at[buffer])
        p_smem.at[buffer][...] = p.astype(dtype)
        plgpu.commit_smem()  # the partner's product reads it
        plgpu.barrier_arrive(p_ready.at[buffer])
        plgpu.barrier_wait(d_ready.at[buffer])
        ds = p * _load(plgpu, d_smem.at[buffer], plgpu.Layout.WGMMA)
        plgpu.barrier_arrive(d_free.at[buffer])
        if cap_grad is not None:
          ds = ds * cap_grad

        def gradient(acc_ref):
          plgpu.wgmma(acc_ref, ds.astype(dtype), q_smem.at[slot])

        dk = pl.run_state(gradient)(plgpu.ACC.init(dk))
        plgpu.barrier_arrive(consumed.at[slot])
        return dk

      store(walk(step, zeros(h)) * scale, k_smem, dk_ref)

    @pl.when(wg == 1)
    def _values():
      plgpu.set_max_registers(232, action="increase")
      plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, v_loaded)
      for buffer in range(2):  # the partner's first two probabilities may go in
        plgpu.barrier_arrive(p_free.at[buffer])
      plgpu.barrier_wait(v_loaded)

      def step(i, slot, buffer, dv, masked):
        del i, masked  # the probabilities come masked
        dp = product(v_smem, do_smem.at[slot])
        delta = _load(plgpu, stats_smem.at[slot, 1], col_layout)
        plgpu.barrier_wait(d_free.at[buffer])
        d_smem.at[buffer][...] = dp - lax.broadcast_in_dim(delta, tile, [1])
        plgpu.barrier_arrive(d_ready.at[buffer])
        plgpu.barrier_wait(p_ready.at[buffer])

        def gradient(acc_ref):
          plgpu.wgmma(acc_ref, p_smem.at[buffer], do_smem.at[slot])

        dv = pl.run_state(gradient)(plgpu.ACC.init(dv))
        plgpu.barrier_arrive(p_free.at[buffer])
        plgpu.barrier_arrive(consumed.at[slot])
        return dv

      store(walk(step, zeros(hv)), v_smem, dv_ref)

    @pl.when(wg == _CONSUMERS)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")

      load = _query_tile_loader((q_ref, do_ref, stats_ref, q_seg_ref),
                                (q_smem, do_smem, stats_smem, q_seg_smem), loaded, batch,
                                kv_head, groups, lo, walked, block_q)
      _ring(load, groups * walked, 0, stages, (consumed,))

  tiled = _swizzled(min(block_q, block_kv))  # a product's operands share their swizzle
  float_tiled = dict(transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)))
  scratch = [
      plgpu.SMEM((block_kv, h), dtype, **tiled),
      plgpu.SMEM((block_kv, hv), dtype, **tiled),
      plgpu.SMEM((stages, block_q, h), dtype, **tiled),
      plgpu.SMEM((stages, block_q, hv), dtype, **tiled),
      plgpu.SMEM((stages, 2, block_q), jnp.float32),
      plgpu.SMEM((block_kv,), jnp.int32) if has_segments else None,
      plgpu.SMEM((stages, block_q), jnp.int32) if has_segments else None,
      plgpu.SMEM((2, block_kv, block_q), dtype, **tiled),
      plgpu.SMEM((2, block_kv, block_q), jnp.float32, **float_tiled),
      plgpu.Barrier(num_arrivals=1 + has_segments),
      plgpu.Barrier(),
      plgpu.Barrier(num_arrivals=3 + has_segments, num_barriers=stages),
      plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
      *(plgpu.Barrier(num_barriers=2) for _ in range(4)),
  ]
  out_types = (jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype))
  return _launch(body, scratch, out_types, ctas, (q, k, v, do, stats),
                 (q_seg, kv_seg, spans, *lengths))


def _launch(body, scratch, out_type, ctas: int, operands, extras):
  """``body(*operands, extras, *outputs, *scratch)`` on ``ctas`` CTAs (grid axis "cta") of two
  consumer warpgroups and a producer; ``extras`` (optional operands) and ``scratch`` keep
  their Nones."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  inputs = [x for x in extras if x is not None]
  present = [x for x in scratch if x is not None]

  def with_nones(items, refs):
    refs = list(refs)
    return [None if x is None else refs.pop(0) for x in items]

  def entry(*refs):
    fixed, refs = refs[:len(operands)], refs[len(operands):]
    extra_refs = tuple(with_nones(extras, refs[:len(inputs)]))

    def with_scratch(*allocated):
      body(*fixed, extra_refs, *refs[len(inputs):], *with_nones(scratch, allocated))

    pl.run_scoped(with_scratch, *present, collective_axes="wg")

  # Every reduction here runs along the rows of wgmma tiles, within warps: Mosaic's scratch for
  # reductions across warps (2 KiB by default) would be shared memory reserved for nothing.
  params = dict(approx_math=True)
  if "reduction_scratch_bytes" in {f.name for f in dataclasses.fields(plgpu.CompilerParams)}:
    params["reduction_scratch_bytes"] = 0
  kernel = plgpu.kernel(
      entry, out_type=out_type, grid=(ctas,), grid_names=("cta",),
      num_threads=_CONSUMERS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(**params))
  return kernel(*operands, *inputs)
