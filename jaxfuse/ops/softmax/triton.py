"""Pallas (Triton) kernels for softmax, log-softmax and softmax cross-entropy.

Softmax: ``x`` is viewed as ``(pre, n, post)`` with the softmax over ``n``. For the last axis
(post == 1) a tile is ``(block_rows, block_cols)`` rows by columns; for an inner axis a tile is
``(block_cols, block_rows)``: one ``pre`` index, columns along ``n`` and rows along ``post``,
so loads stay contiguous along ``post`` and the axis is never transposed in memory. A row that
fits one tile is read once and written once; a longer row is walked twice in chunks, an online
max/sum first and the normalized output second, the second walk from L2. The online max/sum is
kept per element and reduced across threads once per row, so the walk itself never waits on a
cross-warp reduction, and each walk loads the next chunk before it computes on the current one.

Masks are read through their own (broadcast) strides, and the causal mask is computed from the
indices, so neither is ever expanded to the shape of ``x``.

Every array is indexed with one int32 index per dimension, never through a flat offset formed in
a kernel: Pallas' Triton lowering scales each index by its stride, in 64 bits for arrays larger
than 2^32 bytes, so arrays of more than 2^31 elements are addressed exactly (see
:func:`unsupported` and :func:`_mask_operand` for the two limits of that rule).

Cross-entropy: one row of logits at a time (the vocabulary is long), online log-sum-exp in a
first walk; when the loss is reduced ('mean' or 'sum') the gradient for a unit cotangent is
written in the second walk of the same kernel, so a training step reads the logits once from
DRAM and writes the gradient once, and the probabilities never reach memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxfuse._core.registry import pallas_triton as plgpu  # None where JAX has no Triton

from jaxfuse._core import registry
from jaxfuse._core.pipelining import pipelined_loop
from jaxfuse._core.validation import compute_dtype

_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class Blocks:
  """A tile of ``block_rows`` independent rows by ``block_cols`` along the reduced axis.

  ``programs`` walk fixed, strided sets of tiles (a persistent grid); None gives every tile a
  program of its own.
  """
  block_rows: int
  block_cols: int
  num_warps: int
  programs: int | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static description of a softmax: shape, axis, mask strides and the causal rule."""
  shape: tuple[int, ...]
  axis: int
  mask_strides: tuple[int, ...] | None = None  # per dim of x; 0 where the mask broadcasts
  causal: bool = False
  causal_offset: int = 0

  @property
  def pre(self):
    return math.prod(self.shape[:self.axis])

  @property
  def n(self):
    return self.shape[self.axis]

  @property
  def post(self):
    return math.prod(self.shape[self.axis + 1:])


# Register tiles of ~16 elements per thread with a few thousand programs in flight (the norm
# kernels' measurements on an H100, which share the access pattern). A row longer than one tile
# is walked twice in chunks, the second walk from L2: then one program per SM, so the rows in
# flight (132 of up to 512 KB) stay as close to the H100's 50 MB L2 as they can. The backward,
# which holds two tiles (y and dy), walks rows over 16384 in chunks too (benchmarks/tune.py).
_MAX_COLS = 32768
_MAX_BACKWARD_COLS = 16384
_CHUNK_COLS = 16384


def default_blocks(layout: Layout, direction: str = "forward") -> Blocks:
  rows = layout.pre if layout.post == 1 else layout.post
  sms = registry.num_multiprocessors()
  longest = _MAX_COLS if direction == "forward" else _MAX_BACKWARD_COLS
  if layout.n > longest:
    if layout.post == 1:
      return Blocks(1, _CHUNK_COLS, 32, sms)
    return Blocks(16, 512, 16, sms)
  block_cols = min(pl.next_power_of_2(layout.n), _MAX_COLS)
  if direction == "forward" and layout.post == 1 and 1024 <= block_cols <= 8192:
    # A row per program, 8 to 16 elements per thread, no persistent grid: faster than the
    # persistent tiles below at these lengths (measured: benchmarks/results/).
    return Blocks(1, block_cols, min(16, max(4, block_cols // 512)))
  tile = 1024 if block_cols < 1024 else 8192
  block_rows = max(1, min(tile // block_cols, pl.next_power_of_2(rows), 64))
  if layout.post > 1:
    block_rows = max(block_rows, min(16, pl.next_power_of_2(layout.post)))
  num_warps = 8 if block_cols < 1024 else 16 if block_cols < 8192 else block_cols // 1024
  return Blocks(block_rows, block_cols, num_warps, 8 * sms)


def _params(blocks):
  return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=1)


class _Tiles:
  """Indexing of one program's tiles over the (pre, n, post) view; the grid is persistent."""

  def __init__(self, layout: Layout, blocks: Blocks):
    self.layout, self.blocks = layout, blocks
    self.trailing = layout.post == 1
    self.red = 1 if self.trailing else 0  # tile axis that runs along the softmax axis
    rows = layout.pre if self.trailing else layout.post
    self.row_blocks = pl.cdiv(rows, blocks.block_rows)
    n_tiles = self.row_blocks * (1 if self.trailing else layout.pre)
    p, n_programs = pl.program_id(0), pl.num_programs(0)
    self.n_steps = (n_tiles - p + n_programs - 1) // n_programs
    self._p, self._n_programs = p, n_programs
    self.n_chunks = pl.cdiv(layout.n, blocks.block_cols)
    br, bc = blocks.block_rows, blocks.block_cols
    self.tile_shape = (br, bc) if self.trailing else (bc, br)

  def rows(self, step):
    """The tile's independent-row indices and mask, and its ``pre`` index (inner axis)."""
    t = self._p + step * self._n_programs
    br = self.blocks.block_rows
    block, pre = (t, None) if self.trailing else (t % self.row_blocks, t // self.row_blocks)
    idx = block * br + jnp.arange(br, dtype=jnp.int32)
    limit = self.layout.pre if self.trailing else self.layout.post
    return idx, idx < limit, pre

  def at(self, rows, j):
    """Indexer, in-bounds mask and per-dimension index arrays of chunk ``j`` of a tile."""
    idx, row_ok, pre = rows
    cols = j * self.blocks.block_cols + jnp.arange(self.blocks.block_cols, dtype=jnp.int32)
    col_ok = cols < self.layout.n
    if self.trailing:
      r, c = idx[:, None], cols[None, :]
      return (r, c, 0), row_ok[:, None] & col_ok[None, :], (r, c, None)
    r, c = idx[None, :], cols[:, None]
    return (pre, c, r), col_ok[:, None] & row_ok[None, :], (pre, c, r)

  def expand(self, v):
    """A per-row vector broadcast back against a tile."""
    return v[:, None] if self.trailing else v[None, :]

  def coordinate(self, dim, where):
    """Index along dimension ``dim`` of x for every element of a tile."""
    pre, col, post = where
    shape, axis = self.layout.shape, self.layout.axis
    if dim == axis:
      return col
    if dim < axis:
      return (pre // math.prod(shape[dim + 1:axis])) % shape[dim]
    return (post // math.prod(shape[dim + 1:])) % shape[dim]

  def keep(self, in_bounds, where, mask_ref):
    keep = in_bounds
    layout = self.layout
    if mask_ref is not None:
      # An index per dimension the mask varies along: a flat offset summed here in int32 would
      # wrap past 2^31 elements.
      index = tuple(jnp.broadcast_to(self.coordinate(d, where), in_bounds.shape)
                    for d in _mask_dims(layout)) or jnp.zeros(in_bounds.shape, jnp.int32)
      keep = keep & (plgpu.load(mask_ref.at[index], mask=in_bounds, other=0) != 0)
    if layout.causal:
      ndim = len(layout.shape)
      q = self.coordinate(ndim - 2, where)
      k = self.coordinate(ndim - 1, where)
      keep = keep & (k <= q + layout.causal_offset)
    return keep


_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _load(ref, index, mask, other, evict=None):
  kwargs = {} if evict is None else {"eviction_policy": evict}
  return plgpu.load(ref.at[index], mask=mask, other=other, **kwargs)


# The kernels work in base 2: logits are scaled by log2(e) as they are loaded, so every
# exponential is one exp2 (a single MUFU instruction) instead of expf's longer sequence.
def _merge_lanes(m, s, z):
  """Folds a tile of base-2 logits into per-element running maxima ``m`` and sums ``s``
  (relative to ``m``): no reduction across threads inside the loop.

  Rescaled to the new maximum, one of the two terms is always exp2(0) = 1, so an element costs
  one exponential, exp2(-|z - m|): the long-row walks issue as many exponentials as loads.
  """
  d = jnp.where(z == _NEG_INF, _NEG_INF, z - m)  # -inf - -inf would be NaN
  e = jnp.exp2(-jnp.abs(d))
  return jnp.maximum(m, z), jnp.where(d > 0, s * e + 1.0, s + e)


def _reduce_lanes(m, s, red):
  """Row maximum and sum of exponentials relative to it, from :func:`_merge_lanes` state."""
  row_max = jnp.max(m, axis=red)
  safe = jnp.where(row_max == _NEG_INF, 0.0, row_max)
  return row_max, jnp.sum(s * jnp.exp2(m - jnp.expand_dims(safe, red)), axis=red)


def _softmax_forward_kernel(*refs, layout, blocks, scale, log, has_mask, cdt):
  x_ref, *refs = refs
  mask_ref = refs.pop(0) if has_mask else None
  (y_ref,) = refs
  tiles = _Tiles(layout, blocks)
  red = tiles.red

  def load(rows, j, evict=None):
    index, in_bounds, _ = tiles.at(rows, j)
    return _load(x_ref, index, in_bounds, 0.0, evict)

  def logits(rows, j, x):
    """Base-2 logits of a loaded tile (-inf where masked out) and the keep mask."""
    _, in_bounds, where = tiles.at(rows, j)
    keep = tiles.keep(in_bounds, where, mask_ref)
    return jnp.where(keep, x.astype(cdt) * (scale * _LOG2E), _NEG_INF), keep

  def write(rows, j, z, keep, m, s):
    index, in_bounds, _ = tiles.at(rows, j)
    m_safe = tiles.expand(jnp.where(m == _NEG_INF, 0.0, m))
    s = tiles.expand(s)
    if log:
      y = jnp.where(keep, (z - m_safe) * _LN2 - jnp.log(s), _NEG_INF)
    else:
      y = jnp.where(s == 0, 0.0, jnp.exp2(z - m_safe) / s)
    plgpu.store(y_ref.at[index], y.astype(y_ref.dtype), mask=in_bounds)

  @pl.loop(0, tiles.n_steps)
  def _(i):
    rows = tiles.rows(i)
    if tiles.n_chunks == 1:
      z, keep = logits(rows, 0, load(rows, 0))
      m = jnp.max(z, axis=red)
      m_safe = jnp.where(m == _NEG_INF, 0.0, m)
      s = jnp.sum(jnp.exp2(z - tiles.expand(m_safe)), axis=red)
      write(rows, 0, z, keep, m, s)
      return
    shape = tiles.tile_shape
    m, s = pipelined_loop(tiles.n_chunks, lambda j: load(rows, j, "evict_last"),
                          lambda j, x, c: _merge_lanes(*c, logits(rows, j, x)[0]),
                          (jnp.full(shape, _NEG_INF, cdt), jnp.zeros(shape, cdt)))
    m, s = _reduce_lanes(m, s, red)
    pipelined_loop(tiles.n_chunks, lambda j: load(rows, j, "evict_first"),
                   lambda j, x, c: write(rows, j, *logits(rows, j, x), m, s), None)


def _softmax_backward_kernel(y_ref, dy_ref, dx_ref, *, layout, blocks, scale, log, cdt):
  tiles = _Tiles(layout, blocks)
  red = tiles.red

  def load(rows, j, evict=None):
    index, in_bounds, _ = tiles.at(rows, j)
    return (_load(y_ref, index, in_bounds, _NEG_INF if log else 0.0, evict).astype(cdt),
            _load(dy_ref, index, in_bounds, 0.0, evict).astype(cdt))

  # softmax: dx = y * (dy - sum(dy * y)); log-softmax: dx = dy - exp(y) * sum(dy), with masked
  # entries (y = -inf) taking no part and getting zero.
  def row_terms(y, dy):
    return jnp.where(y > _NEG_INF, dy, 0.0) if log else dy * y

  def write(rows, j, y, dy, c):
    index, in_bounds, _ = tiles.at(rows, j)
    c = tiles.expand(c)
    dx = jnp.where(y > _NEG_INF, dy - jnp.exp2(y * _LOG2E) * c, 0.0) if log else y * (dy - c)
    plgpu.store(dx_ref.at[index], (dx * scale).astype(dx_ref.dtype), mask=in_bounds)

  @pl.loop(0, tiles.n_steps)
  def _(i):
    rows = tiles.rows(i)
    if tiles.n_chunks == 1:
      y, dy = load(rows, 0)
      write(rows, 0, y, dy, jnp.sum(row_terms(y, dy), axis=red))
      return
    terms = pipelined_loop(tiles.n_chunks, lambda j: load(rows, j, "evict_last"),
                           lambda j, loaded, c: c + row_terms(*loaded),
                           jnp.zeros(tiles.tile_shape, cdt))
    c = jnp.sum(terms, axis=red)
    pipelined_loop(tiles.n_chunks, lambda j: load(rows, j, "evict_first"),
                   lambda j, loaded, carry: write(rows, j, *loaded, c), None)


def unsupported(extents) -> str | None:
  """Why the kernels cannot take an array viewed as ``extents`` (``(pre, n, post)`` for
  softmax, ``(rows, classes)`` for cross-entropy), or None."""
  return registry.triton_extents_refusal("the view", extents)


def _check_extents(op, extents):
  registry.check_triton_extents(op, "the view", extents)


def _mask_dims(layout):
  """The dimensions of x the mask varies along (it broadcasts along the others)."""
  return tuple(d for d, s in enumerate(layout.mask_strides) if s)


def _mask_operand(mask, layout):
  """The flat int8 mask as an array of its varying dimensions, indexed one dimension at a time.

  The lowering offsets arrays of up to 2^32 bytes in int32: an int8 mask of 2^31 to 2^32
  elements would wrap. Held in int16 it passes 2^32 bytes and gets 64-bit offsets (a conversion
  pass over the mask, only at those sizes); larger masks get them as they are.
  """
  mask = mask.reshape(tuple(layout.shape[d] for d in _mask_dims(layout)) or (1,))
  if 2**31 < mask.size <= 2**32:
    mask = mask.astype(jnp.int16)
  return mask


def _grid(layout, blocks):
  rows = layout.pre if layout.post == 1 else layout.post
  n_tiles = pl.cdiv(rows, blocks.block_rows) * (1 if layout.post == 1 else layout.pre)
  target = n_tiles if blocks.programs is None else max(1, min(n_tiles, blocks.programs))
  return (pl.cdiv(n_tiles, pl.cdiv(n_tiles, target)),)


def softmax_forward(x, mask, layout: Layout, *, scale, log, blocks: Blocks | None = None):
  """``x`` of ``layout.shape``; ``mask`` a flat int8 array holding the mask densely over the
  dimensions of nonzero ``layout.mask_strides``, in x's order (its own dense strides)."""
  _check_extents("log_softmax" if log else "softmax", (layout.pre, layout.n, layout.post))
  blocks = blocks or default_blocks(layout)
  x3 = x.reshape(layout.pre, layout.n, layout.post)
  kernel = functools.partial(_softmax_forward_kernel, layout=layout, blocks=blocks, scale=scale,
                             log=log, has_mask=mask is not None, cdt=compute_dtype(x.dtype))
  y = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(x3.shape, x.dtype), grid=_grid(layout, blocks),
      compiler_params=_params(blocks), interpret=registry.interpret_mode(),
      name=f"jaxfuse_{'log_' if log else ''}softmax_fwd",
  )(x3, *([] if mask is None else [_mask_operand(mask, layout)]))
  return y.reshape(x.shape)


def softmax_backward(y, dy, layout: Layout, *, scale, log, blocks: Blocks | None = None):
  _check_extents("log_softmax" if log else "softmax", (layout.pre, layout.n, layout.post))
  blocks = blocks or default_blocks(layout, "backward")
  shape3 = (layout.pre, layout.n, layout.post)
  kernel = functools.partial(_softmax_backward_kernel, layout=layout, blocks=blocks, scale=scale,
                             log=log, cdt=compute_dtype(y.dtype))
  dx = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(shape3, y.dtype), grid=_grid(layout, blocks),
      compiler_params=_params(blocks), interpret=registry.interpret_mode(),
      name=f"jaxfuse_{'log_' if log else ''}softmax_bwd",
  )(y.reshape(shape3), dy.reshape(shape3))
  return dx.reshape(y.shape)


# --------------------------------------------------------------------------- cross-entropy


_CE_MAX_COLS = 16384


def cross_entropy_blocks(n_rows: int, vocab: int, mode: str = "fused") -> Blocks:
  """Rows longer than one tile are walked in chunks; when the gradient is written in a second
  walk, one program per SM keeps the rows in flight (256 KB each for bf16 x 131072) in L2."""
  sms = registry.num_multiprocessors()
  if vocab > _CE_MAX_COLS and mode == "loss":
    return Blocks(1, 8192, 16, 4 * sms)
  if vocab > _CE_MAX_COLS:
    # Measured on an H100 (benchmarks/tune.py): wide chunks for long rows, two rows per step
    # for shorter ones.
    return Blocks(1, 16384, 32, sms) if vocab >= 65536 else Blocks(2, 8192, 16, sms)
  block_cols = pl.next_power_of_2(vocab)
  block_rows = max(1, min(8192 // block_cols, pl.next_power_of_2(n_rows), 64))
  num_warps = 16 if block_cols * block_rows >= 8192 else 8
  return Blocks(block_rows, block_cols, num_warps, 8 * sms)


def _cross_entropy_kernel(*refs, n_rows, vocab, blocks, label_smoothing, z_loss, mode,
                          ignore_index, uniform_scale, cdt):
  """mode 'loss': loss and lse. 'fused': loss and the gradient, scaled per row (one scale for
  every row when ``uniform_scale``). 'grad': only the gradient, from a saved lse."""
  logits_ref, labels_ref, *refs = refs
  lse_in_ref = refs.pop(0) if mode == "grad" else None
  scale_ref = refs.pop(0) if mode != "loss" else None
  loss_ref = refs.pop(0) if mode != "grad" else None
  lse_ref = refs.pop(0) if mode == "loss" else None
  grad_ref = refs.pop(0) if mode != "loss" else None
  p, n_programs = pl.program_id(0), pl.num_programs(0)
  br, bc = blocks.block_rows, blocks.block_cols
  n_steps = (pl.cdiv(n_rows, br) - p + n_programs - 1) // n_programs
  n_chunks = pl.cdiv(vocab, bc)

  def tile(rows, row_ok, j, evict=None):
    """Base-2 logits of a chunk (-inf outside the array), its columns and its mask."""
    cols = j * bc + jnp.arange(bc, dtype=jnp.int32)
    mask = row_ok[:, None] & (cols < vocab)[None, :]
    x = _load(logits_ref, (rows[:, None], cols[None, :]), mask, _NEG_INF, evict)
    return x.astype(cdt) * _LOG2E, cols, mask

  @pl.loop(0, n_steps)
  def _(i):
    rows = (p + i * n_programs) * br + jnp.arange(br, dtype=jnp.int32)
    row_ok = rows < n_rows
    labels = plgpu.load(labels_ref.at[rows], mask=row_ok, other=-1)
    valid = (labels >= 0) & (labels < vocab)
    if ignore_index is not None:
      valid = valid & (labels != jnp.int32(ignore_index))
    if mode == "grad":
      lse = plgpu.load(lse_in_ref.at[rows], mask=row_ok, other=0.0)
    elif n_chunks == 1:
      x, _, mask = tile(rows, row_ok, 0)
      m = jnp.max(x, axis=1)
      s = jnp.sum(jnp.exp2(x - jnp.where(m == _NEG_INF, 0.0, m)[:, None]), axis=1)
      total = [jnp.where(mask, x, 0.0)] if label_smoothing else []
    else:
      # Per-element running max and sum (and the logits' sum for smoothing): the row is
      # reduced across threads once, after the walk.
      def first_walk(j, loaded, carry):
        x, _, mask = loaded
        m, s = _merge_lanes(carry[0], carry[1], x)
        return (m, s) + tuple(t + jnp.where(mask, x, 0.0) for t in carry[2:])

      shape = (br, bc)
      init = (jnp.full(shape, _NEG_INF, cdt), jnp.zeros(shape, cdt)) + (
          (jnp.zeros(shape, cdt),) if label_smoothing else ())
      evict = "evict_last" if grad_ref is not None else None
      m, s, *total = pipelined_loop(n_chunks, lambda j: tile(rows, row_ok, j, evict),
                                    first_walk, init)
      m, s = _reduce_lanes(m, s, 1)
    if mode != "grad":
      lse = jnp.where(m == _NEG_INF, 0.0, m) * _LN2 + jnp.log(s)
      picked = plgpu.load(logits_ref.at[rows, jnp.where(valid, labels, 0)],
                          mask=row_ok & valid, other=0.0).astype(cdt)
      loss = lse - (1.0 - label_smoothing) * picked
      if label_smoothing:
        loss = loss - (label_smoothing * _LN2 / vocab) * jnp.sum(total[0], axis=1)
      if z_loss:
        loss = loss + z_loss * lse * lse
      plgpu.store(loss_ref.at[rows], jnp.where(valid, loss, 0.0), mask=row_ok)
      if lse_ref is not None:
        plgpu.store(lse_ref.at[rows], lse, mask=row_ok)
    if grad_ref is None:
      return
    scale_at = jnp.zeros_like(rows) if uniform_scale else rows
    row_scale = jnp.where(valid, plgpu.load(scale_ref.at[scale_at], mask=row_ok, other=0.0), 0.0)
    prob_scale = row_scale * (1.0 + 2.0 * z_loss * lse) if z_loss else row_scale

    def second_walk(j, loaded, carry):
      x, cols, mask = loaded
      d = jnp.exp2(x - (lse * _LOG2E)[:, None]) * prob_scale[:, None]
      target = jnp.where(cols[None, :] == labels[:, None], 1.0 - label_smoothing, 0.0)
      if label_smoothing:
        target = target + label_smoothing / vocab
      d = d - target * row_scale[:, None]
      plgpu.store(grad_ref.at[rows[:, None], cols[None, :]], d.astype(grad_ref.dtype), mask=mask)
      return carry

    pipelined_loop(n_chunks, lambda j: tile(rows, row_ok, j, "evict_first"), second_walk, None)


def cross_entropy(logits, labels, *, label_smoothing, z_loss, ignore_index=None,
                  row_scale=None, lse=None, mode, blocks: Blocks | None = None):
  """``logits (R, V)``, int32 ``labels (R,)``; see :func:`_cross_entropy_kernel` for ``mode``.

  Labels outside ``[0, V)`` or equal to ``ignore_index`` give a zero loss and gradient.
  ``row_scale`` is ``(R,)``, or ``(1,)`` for one scale for all rows. Returns ``(loss, lse)``,
  ``(loss, grad)`` or ``grad``. The fused mode writes no lse: its callers need none, and a
  training step then holds no row-sized buffer but the loss.
  """
  n_rows, vocab = logits.shape
  _check_extents("softmax_cross_entropy", logits.shape)
  blocks = blocks or cross_entropy_blocks(n_rows, vocab, mode)
  cdt = compute_dtype(logits.dtype)
  row = jax.ShapeDtypeStruct((n_rows,), cdt)
  grad = jax.ShapeDtypeStruct(logits.shape, logits.dtype)
  out_shape = {"loss": [row, row], "fused": [row, grad], "grad": grad}[mode]
  inputs = [logits, labels] + ([lse] if mode == "grad" else []) + (
      [row_scale] if mode != "loss" else [])
  kernel = functools.partial(_cross_entropy_kernel, n_rows=n_rows, vocab=vocab, blocks=blocks,
                             label_smoothing=label_smoothing, z_loss=z_loss, mode=mode,
                             ignore_index=ignore_index, cdt=cdt,
                             uniform_scale=row_scale is not None and row_scale.shape[0] == 1)
  target = max(1, min(pl.cdiv(n_rows, blocks.block_rows),
                      blocks.programs or registry.num_multiprocessors()))
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=(target,), compiler_params=_params(blocks),
      interpret=registry.interpret_mode(), name=f"jaxfuse_cross_entropy_{mode}",
  )(*inputs)
