"""Pallas (Triton) kernels for softmax, log-softmax and softmax cross-entropy.

Softmax: ``x`` is viewed as ``(pre, n, post)`` with the softmax over ``n``. For the last axis
(post == 1) a tile is ``(block_rows, block_cols)`` rows by columns; for an inner axis a tile is
``(block_cols, block_rows)``: one ``pre`` index, columns along ``n`` and rows along ``post``,
so loads stay contiguous along ``post`` and the axis is never transposed in memory. A row that
fits one tile is read once and written once; a longer row is walked twice in chunks, an online
max/sum first and the normalized output second, the second walk from L2.

Masks are read through their own (broadcast) strides, and the causal mask is computed from the
indices, so neither is ever expanded to the shape of ``x``.

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
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxfuse._core import registry
from jaxfuse._core.validation import compute_dtype

_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class Blocks:
  """A tile of ``block_rows`` independent rows by ``block_cols`` along the reduced axis."""
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
# kernels' measurements on an H100, which share the access pattern); rows longer than the
# column cap are walked twice.
_MAX_COLS = 32768


def default_blocks(layout: Layout) -> Blocks:
  rows = layout.pre if layout.post == 1 else layout.post
  block_cols = min(pl.next_power_of_2(layout.n), _MAX_COLS)
  tile = 1024 if block_cols < 1024 else 8192
  block_rows = max(1, min(tile // block_cols, pl.next_power_of_2(rows), 64))
  if layout.post > 1:
    block_rows = max(block_rows, min(16, pl.next_power_of_2(layout.post)))
  num_warps = 8 if block_cols < 1024 else 16 if block_cols < 8192 else block_cols // 1024
  return Blocks(block_rows, block_cols, num_warps, 8 * registry.num_multiprocessors())


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
      offset = sum(self.coordinate(d, where) * s for d, s in enumerate(layout.mask_strides) if s)
      offset = jnp.broadcast_to(jnp.asarray(offset, jnp.int32), in_bounds.shape)
      keep = keep & (plgpu.load(mask_ref.at[offset], mask=in_bounds, other=0) != 0)
    if layout.causal:
      ndim = len(layout.shape)
      q = self.coordinate(ndim - 2, where)
      k = self.coordinate(ndim - 1, where)
      keep = keep & (k <= q + layout.causal_offset)
    return keep


def _online(m, s, z, red):
  """Merges a chunk of logits ``z`` into a running max ``m`` and sum of exponentials ``s``."""
  m_new = jnp.maximum(m, jnp.max(z, axis=red))
  m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
  s = s * jnp.exp(jnp.where(m == _NEG_INF, _NEG_INF, m - m_safe)) + jnp.sum(
      jnp.exp(z - jnp.expand_dims(m_safe, red)), axis=red)
  return m_new, s


def _softmax_forward_kernel(*refs, layout, blocks, scale, log, has_mask, cdt):
  x_ref, *refs = refs
  mask_ref = refs.pop(0) if has_mask else None
  (y_ref,) = refs
  tiles = _Tiles(layout, blocks)
  red = tiles.red

  def logits(rows, j, evict=None):
    index, in_bounds, where = tiles.at(rows, j)
    kwargs = {} if evict is None else {"eviction_policy": evict}
    x = plgpu.load(x_ref.at[index], mask=in_bounds, other=0.0, **kwargs)
    keep = tiles.keep(in_bounds, where, mask_ref)
    return jnp.where(keep, x.astype(cdt) * scale, _NEG_INF), keep, index, in_bounds

  def write(z, keep, index, in_bounds, m, s):
    m_safe = tiles.expand(jnp.where(m == _NEG_INF, 0.0, m))
    s = tiles.expand(s)
    if log:
      y = jnp.where(keep, z - m_safe - jnp.log(s), _NEG_INF)
    else:
      y = jnp.where(s == 0, 0.0, jnp.exp(z - m_safe) / s)
    plgpu.store(y_ref.at[index], y.astype(y_ref.dtype), mask=in_bounds)

  @pl.loop(0, tiles.n_steps)
  def _(i):
    rows = tiles.rows(i)
    if tiles.n_chunks == 1:
      z, keep, index, in_bounds = logits(rows, 0)
      m = jnp.max(z, axis=red)
      m_safe = jnp.where(m == _NEG_INF, 0.0, m)
      s = jnp.sum(jnp.exp(z - tiles.expand(m_safe)), axis=red)
      write(z, keep, index, in_bounds, m, s)
      return
    shape = (blocks.block_rows,)
    init = (jnp.full(shape, _NEG_INF, cdt), jnp.zeros(shape, cdt))
    m, s = lax.fori_loop(0, tiles.n_chunks,
                         lambda j, c: _online(*c, logits(rows, j, "evict_last")[0], red), init)

    @pl.loop(0, tiles.n_chunks)
    def _(j):
      write(*logits(rows, j, "evict_first"), m, s)


def _softmax_backward_kernel(y_ref, dy_ref, dx_ref, *, layout, blocks, scale, log, cdt):
  tiles = _Tiles(layout, blocks)
  red = tiles.red

  def load(rows, j, evict=None):
    index, in_bounds, _ = tiles.at(rows, j)
    kwargs = {} if evict is None else {"eviction_policy": evict}
    y = plgpu.load(y_ref.at[index], mask=in_bounds, other=_NEG_INF if log else 0.0,
                   **kwargs).astype(cdt)
    dy = plgpu.load(dy_ref.at[index], mask=in_bounds, other=0.0, **kwargs).astype(cdt)
    return y, dy, index, in_bounds

  # softmax: dx = y * (dy - sum(dy * y)); log-softmax: dx = dy - exp(y) * sum(dy), with masked
  # entries (y = -inf) taking no part and getting zero.
  def row_sum(y, dy):
    return jnp.sum(jnp.where(y > _NEG_INF, dy, 0.0) if log else dy * y, axis=red)

  def write(y, dy, index, in_bounds, c):
    c = tiles.expand(c)
    dx = jnp.where(y > _NEG_INF, dy - jnp.exp(y) * c, 0.0) if log else y * (dy - c)
    plgpu.store(dx_ref.at[index], (dx * scale).astype(dx_ref.dtype), mask=in_bounds)

  @pl.loop(0, tiles.n_steps)
  def _(i):
    rows = tiles.rows(i)
    if tiles.n_chunks == 1:
      y, dy, index, in_bounds = load(rows, 0)
      write(y, dy, index, in_bounds, row_sum(y, dy))
      return
    c = lax.fori_loop(0, tiles.n_chunks,
                      lambda j, c: c + row_sum(*load(rows, j, "evict_last")[:2]),
                      jnp.zeros((blocks.block_rows,), cdt))

    @pl.loop(0, tiles.n_chunks)
    def _(j):
      write(*load(rows, j, "evict_first"), c)


def _grid(layout, blocks):
  rows = layout.pre if layout.post == 1 else layout.post
  n_tiles = pl.cdiv(rows, blocks.block_rows) * (1 if layout.post == 1 else layout.pre)
  target = max(1, min(n_tiles, blocks.programs or 8 * registry.num_multiprocessors()))
  return (pl.cdiv(n_tiles, pl.cdiv(n_tiles, target)),)


def softmax_forward(x, mask, layout: Layout, *, scale, log, blocks: Blocks | None = None):
  """``x`` of ``layout.shape``; ``mask`` a flat int8 array read with ``layout.mask_strides``."""
  blocks = blocks or default_blocks(layout)
  x3 = x.reshape(layout.pre, layout.n, layout.post)
  kernel = functools.partial(_softmax_forward_kernel, layout=layout, blocks=blocks, scale=scale,
                             log=log, has_mask=mask is not None, cdt=compute_dtype(x.dtype))
  y = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(x3.shape, x.dtype), grid=_grid(layout, blocks),
      compiler_params=_params(blocks), interpret=registry.interpret_mode(),
      name=f"jaxfuse_{'log_' if log else ''}softmax_fwd",
  )(x3, *([] if mask is None else [mask]))
  return y.reshape(x.shape)


def softmax_backward(y, dy, layout: Layout, *, scale, log, blocks: Blocks | None = None):
  blocks = blocks or default_blocks(layout)
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


def cross_entropy_blocks(n_rows: int, vocab: int) -> Blocks:
  """One row per step for long vocabularies, with a row's two walks kept within L2: one
  program per SM holds ~132 rows of 256 KB (bf16, 131072 entries) in flight."""
  block_cols = min(pl.next_power_of_2(vocab), 16384)
  block_rows = max(1, min(8192 // block_cols, pl.next_power_of_2(n_rows), 64))
  num_warps = 16 if block_cols * block_rows >= 8192 else 8
  programs = registry.num_multiprocessors() * (1 if vocab > block_cols else 8)
  return Blocks(block_rows, block_cols, num_warps, programs)


def _cross_entropy_kernel(*refs, n_rows, vocab, blocks, label_smoothing, z_loss, mode):
  """mode 'loss': loss and lse. 'fused': also the gradient, scaled per row. 'grad': only the
  gradient, from a saved lse."""
  logits_ref, labels_ref, *refs = refs
  lse_in_ref = refs.pop(0) if mode == "grad" else None
  scale_ref = refs.pop(0) if mode != "loss" else None
  if mode == "grad":
    (grad_ref,) = refs
  else:
    loss_ref, lse_ref, *grad = refs
    grad_ref = grad[0] if grad else None
  p, n_programs = pl.program_id(0), pl.num_programs(0)
  br, bc = blocks.block_rows, blocks.block_cols
  n_steps = (pl.cdiv(n_rows, br) - p + n_programs - 1) // n_programs
  n_chunks = pl.cdiv(vocab, bc)

  def tile(rows, row_ok, j, evict=None):
    cols = j * bc + jnp.arange(bc, dtype=jnp.int32)
    mask = row_ok[:, None] & (cols < vocab)[None, :]
    kwargs = {} if evict is None else {"eviction_policy": evict}
    x = plgpu.load(logits_ref.at[rows[:, None], cols[None, :]], mask=mask, other=_NEG_INF,
                   **kwargs).astype(jnp.float32)
    return x, cols, mask

  @pl.loop(0, n_steps)
  def _(i):
    rows = (p + i * n_programs) * br + jnp.arange(br, dtype=jnp.int32)
    row_ok = rows < n_rows
    labels = plgpu.load(labels_ref.at[rows], mask=row_ok, other=-1)
    valid = (labels >= 0) & (labels < vocab)
    if mode == "grad":
      lse = plgpu.load(lse_in_ref.at[rows], mask=row_ok, other=0.0)
    else:
      shape = (br,)
      init = (jnp.full(shape, _NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32),
              jnp.zeros(shape, jnp.float32))

      def first_walk(j, carry):
        m, s, total = carry
        x, _, mask = tile(rows, row_ok, j, "evict_last" if grad_ref is not None else None)
        m, s = _online(m, s, x, 1)
        return m, s, total + jnp.sum(jnp.where(mask, x, 0.0), axis=1)

      m, s, total = lax.fori_loop(0, n_chunks, first_walk, init)
      lse = jnp.where(m == _NEG_INF, 0.0, m) + jnp.log(s)
      picked = plgpu.load(logits_ref.at[rows, jnp.where(valid, labels, 0)],
                          mask=row_ok & valid, other=0.0).astype(jnp.float32)
      loss = lse - (1.0 - label_smoothing) * picked
      if label_smoothing:
        loss = loss - (label_smoothing / vocab) * total
      if z_loss:
        loss = loss + z_loss * lse * lse
      plgpu.store(loss_ref.at[rows], jnp.where(valid, loss, 0.0), mask=row_ok)
      plgpu.store(lse_ref.at[rows], lse, mask=row_ok)
    if grad_ref is None:
      return
    row_scale = jnp.where(valid, plgpu.load(scale_ref.at[rows], mask=row_ok, other=0.0), 0.0)
    prob_scale = row_scale * (1.0 + 2.0 * z_loss * lse) if z_loss else row_scale

    @pl.loop(0, n_chunks)
    def _(j):
      x, cols, mask = tile(rows, row_ok, j, "evict_first")
      d = jnp.exp(x - lse[:, None]) * prob_scale[:, None]
      target = jnp.where(cols[None, :] == labels[:, None], 1.0 - label_smoothing, 0.0)
      if label_smoothing:
        target = target + label_smoothing / vocab
      d = d - target * row_scale[:, None]
      plgpu.store(grad_ref.at[rows[:, None], cols[None, :]], d.astype(grad_ref.dtype), mask=mask)


def cross_entropy(logits, labels, *, label_smoothing, z_loss, row_scale=None, lse=None,
                  mode, blocks: Blocks | None = None):
  """``logits (R, V)``, int32 ``labels (R,)``; see :func:`_cross_entropy_kernel` for ``mode``.

  Returns ``(loss, lse)``, ``(loss, lse, grad)`` or ``grad``.
  """
  n_rows, vocab = logits.shape
  blocks = blocks or cross_entropy_blocks(n_rows, vocab)
  row = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
  grad = jax.ShapeDtypeStruct(logits.shape, logits.dtype)
  out_shape = {"loss": [row, row], "fused": [row, row, grad], "grad": grad}[mode]
  inputs = [logits, labels] + ([lse] if mode == "grad" else []) + (
      [row_scale] if mode != "loss" else [])
  kernel = functools.partial(_cross_entropy_kernel, n_rows=n_rows, vocab=vocab, blocks=blocks,
                             label_smoothing=label_smoothing, z_loss=z_loss, mode=mode)
  target = max(1, min(pl.cdiv(n_rows, blocks.block_rows), blocks.programs or registry.num_multiprocessors()))
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=(target,), compiler_params=_params(blocks),
      interpret=registry.interpret_mode(), name=f"jaxfuse_cross_entropy_{mode}",
  )(*inputs)
