"""Pallas (Triton) kernels for RMSNorm and LayerNorm, forward and backward.

Arrays arrive flattened to ``x: (G, R, N)`` (weight groups, rows, features) with parameters
``(G, N)``; G is 1 except under ``vmap`` with a batched weight.

Forward: a program owns ``block_rows`` rows. When a row fits one register tile (``block_cols``
>= N) it is read once, reduced and written: one read and one write of ``x``'s size. Longer rows
are walked in column chunks twice, statistics first (LayerNorm merges the chunks' mean and M2
with Chan's formula, so a large mean does not cancel the variance) and then the output; the
second walk hits L2, where the first left the row (``evict_last``).

Backward: dx needs two per-row sums over the features (of ``x_hat * w * dy``, and for LayerNorm
of ``w * dy``), and the weight/bias gradients are sums over rows. The grid is persistent: a few
programs per SM, each walking a fixed strided set of row blocks, computes dx for its rows and
keeps its share of ``dweight``/``dbias`` in float32. Stage two sums the per-program partials in a
fixed order in a second small kernel. No atomics: the same inputs give the same bits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxfuse._core import registry
from jaxfuse._core.validation import compute_dtype


@dataclasses.dataclass(frozen=True)
class NormBlocks:
  """Tiling of one kernel: a (block_rows, block_cols) register tile per step.

  Both kernels run a persistent grid of ``programs`` programs per weight group (None: a
  multiple of the SM count), each walking a fixed, strided set of row blocks.
  """
  block_rows: int
  block_cols: int
  num_warps: int
  programs: int | None = None


# Defaults measured on an H100 (benchmarks/tune_norm.py, bf16, 16384 rows): the forward wants
# ~16 elements per thread and a few thousand programs in flight; the backward, which also keeps
# the weight-gradient accumulators in registers, wants smaller tiles and two programs per SM.
# Rows longer than the column caps are walked in chunks, twice, the second walk from L2.
_FWD_MAX_COLS = 32768
_BWD_MAX_COLS = 16384


def forward_blocks(n_rows: int, n_cols: int) -> NormBlocks:
  block_cols = min(pl.next_power_of_2(n_cols), _FWD_MAX_COLS)
  tile = 1024 if block_cols < 1024 else 8192
  block_rows = max(1, min(tile // block_cols, pl.next_power_of_2(n_rows)))
  num_warps = 8 if block_cols < 1024 else 16 if block_cols < 8192 else block_cols // 1024
  return NormBlocks(block_rows, block_cols, num_warps, 8 * registry.num_multiprocessors())


def backward_blocks(n_rows: int, n_cols: int, kind: str = "rms") -> NormBlocks:
  # LayerNorm keeps two accumulator rows (dweight, dbias): past 8192 columns they spill.
  max_cols = _BWD_MAX_COLS if kind == "rms" else _BWD_MAX_COLS // 2
  block_cols = min(pl.next_power_of_2(n_cols), max_cols)
  sms = registry.num_multiprocessors()
  if n_cols > max_cols:
    return (NormBlocks(1, 8192, 16, 2 * sms) if n_cols <= 2 * max_cols
            else NormBlocks(2, 2048, 4, 4 * sms))
  block_rows = max(1, min(4096 // block_cols, 16, pl.next_power_of_2(n_rows)))
  num_warps = max(8, min(16, block_rows * block_cols // 512))
  return NormBlocks(block_rows, block_cols, num_warps, (1 if block_cols >= 8192 else 2) * sms)


def _programs(blocks, n_rows, n_groups):
  """Programs per group for a persistent grid, evened out so no program gets an extra step."""
  n_row_blocks = pl.cdiv(n_rows, blocks.block_rows)
  target = blocks.programs or 2 * registry.num_multiprocessors()
  target = max(1, min(n_row_blocks, target // n_groups))
  return pl.cdiv(n_row_blocks, pl.cdiv(n_row_blocks, target))


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
    self.n_steps = (pl.cdiv(n_rows, block_rows) - self.p + self.n_programs - 1) // self.n_programs

  def rows(self, step):
    """Row indices of a step and their mask; steps past the end are fully masked."""
    rows = (self.p + step * self.n_programs) * self.block_rows + jnp.arange(
        self.block_rows, dtype=jnp.int32)
    return rows, rows < self.n_rows

  def loop(self, load, body, init):
    """``body(step, loaded, carry)`` over this program's steps, loading a step ahead.

    The next block's loads are issued before this block's reductions, so a program keeps memory
    requests in flight while it computes: the register-level equivalent of double buffering.
    """
    if not self.prefetch:
      return lax.fori_loop(0, self.n_steps, lambda i, c: body(i, load(i), c), init)

    def step(i, state):
      carry, loaded = state
      ahead = load(i + 1)
      return body(i, loaded, carry), ahead
    return lax.fori_loop(0, self.n_steps, step, (init, load(0)))[0]


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

  @pl.loop(0, blk.n_steps)
  def _(i):
    rows, row_ok = blk.rows(i)
    zeros = jnp.zeros((blocks.block_rows,), cdt)
    if kind == "layer":
      def stats(j, carry):
        count, mean, m2 = carry
        x_raw, mask = load_tile(rows, row_ok, j, "evict_last")
        x = x_raw.astype(cdt)
        chunk_count = jnp.minimum(bc, n_cols - j * bc).astype(cdt)
        chunk_mean = jnp.sum(x, axis=1) / chunk_count
        d = jnp.where(mask, x - chunk_mean[:, None], 0.0)
        total = count + chunk_count
        delta = chunk_mean - mean
        return (total, mean + delta * (chunk_count / total),
                m2 + jnp.sum(d * d, axis=1) + delta * delta * (count * chunk_count / total))
      _, mean, m2 = lax.fori_loop(0, n_chunks, stats, (jnp.zeros((), cdt), zeros, zeros))
      var = m2 / n_cols
    else:
      def stats(j, sum_sq):
        x = load_tile(rows, row_ok, j, "evict_last")[0].astype(cdt)
        return sum_sq + jnp.sum(x * x, axis=1)
      mean, var = None, lax.fori_loop(0, n_chunks, stats, zeros) / n_cols
    rstd = lax.rsqrt(var + eps)

    @pl.loop(0, n_chunks)
    def _(j):
      x = load_tile(rows, row_ok, j, "evict_first")[0].astype(cdt)
      write(rows, row_ok, j, x, mean, rstd, *params(j))

    write_stats(rows, row_ok, mean, rstd)


def forward(x, weight, bias, *, kind, eps, out_dtype, blocks: NormBlocks | None = None):
  """``x (G, R, N)``, ``weight``/``bias`` ``(G, N)`` or None -> ``(y, mean | None, rstd)``."""
  n_groups, n_rows, n_cols = x.shape
  blocks = blocks or forward_blocks(n_rows, n_cols)
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


def _backward_kernel(*refs, kind, has_weight, has_bias, n_rows, n_cols, blocks, cdt):
  dy_ref, x_ref, *refs = refs
  w_ref = refs.pop(0) if has_weight else None
  mean_ref = refs.pop(0) if kind == "layer" else None
  rstd_ref, dx_ref, *partial_refs = refs
  dw_ref = partial_refs.pop(0) if has_weight else None
  db_ref = partial_refs.pop(0) if has_bias else None
  # The backward also holds the weight-gradient accumulators: prefetch only small shares.
  blk = _RowBlocks(n_rows, blocks, prefetch_limit=16)
  g, p, bc = blk.g, blk.p, blocks.block_cols
  n_chunks = pl.cdiv(n_cols, bc)

  def columns(j):
    cols = j * bc + jnp.arange(bc, dtype=jnp.int32)
    return cols, cols < n_cols

  def load_rows(i, j, evict=None):
    """Raw x and dy tiles of step i, chunk j, and the rows' statistics."""
    rows, row_ok = blk.rows(i)
    cols, col_ok = columns(j)
    mask = row_ok[:, None] & col_ok[None, :]
    index = (g, rows[:, None], cols[None, :])
    rstd = _load(rstd_ref, (g, rows), row_ok, cdt)
    mean = _load(mean_ref, (g, rows), row_ok, cdt) if kind == "layer" else None
    return (_load(x_ref, index, mask, evict=evict), _load(dy_ref, index, mask, evict=evict),
            mean, rstd, mask)

  def math(loaded, w):
    """x_hat, dy and w * dy of a tile, zero outside the array."""
    x_raw, dy_raw, mean, rstd, mask = loaded
    dy = dy_raw.astype(cdt)
    x_hat = x_raw.astype(cdt)
    if mean is not None:
      x_hat = jnp.where(mask, x_hat - mean[:, None], 0.0)
    x_hat = x_hat * rstd[:, None]
    return x_hat, dy, (dy * w[None, :] if w is not None else dy)

  def weight(j):
    cols, col_ok = columns(j)
    return _load(w_ref, (g, cols), col_ok, cdt) if has_weight else None

  def store_dx(i, j, x_hat, wdy, rstd, c1, c2):
    rows, row_ok = blk.rows(i)
    cols, col_ok = columns(j)
    dx = wdy - x_hat * c1[:, None]
    if c2 is not None:
      dx = dx - c2[:, None]
    plgpu.store(dx_ref.at[g, rows[:, None], cols[None, :]],
                (dx * rstd[:, None]).astype(dx_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])

  def row_sums(x_hat, wdy):
    return jnp.sum(x_hat * wdy, axis=1), (jnp.sum(wdy, axis=1) if kind == "layer" else None)

  param_partials = [(r, f) for r, f in ((dw_ref, lambda x_hat, dy: x_hat * dy),
                                        (db_ref, lambda x_hat, dy: dy)) if r is not None]

  if n_chunks == 1:
    w = weight(0)

    def body(i, loaded, acc):
      x_hat, dy, wdy = math(loaded, w)
      c1, c2 = row_sums(x_hat, wdy)
      store_dx(i, 0, x_hat, wdy, loaded[3], c1 / n_cols, None if c2 is None else c2 / n_cols)
      return tuple(a + jnp.sum(f(x_hat, dy), axis=0) for a, (_, f) in zip(acc, param_partials))

    acc = blk.loop(lambda i: load_rows(i, 0), body,
                   tuple(jnp.zeros((bc,), cdt) for _ in param_partials))
    cols, col_ok = columns(0)
    for a, (ref, _) in zip(acc, param_partials):
      plgpu.store(ref.at[g, p, cols], a, mask=col_ok)
    return

  # Long rows: two walks over the row per row block. The first accumulates the row sums and adds
  # this block's share of dweight/dbias into the program's own partial row (L2 resident); the
  # second computes dx from the same chunks, which the first walk left in L2.
  @pl.loop(0, blk.n_steps)
  def _(i):
    def first_walk(j, sums):
      loaded = load_rows(i, j, "evict_last")
      x_hat, dy, wdy = math(loaded, weight(j))
      cols, col_ok = columns(j)
      for ref, f in param_partials:
        index = (g, p, cols)
        previous = plgpu.load(ref.at[index], mask=col_ok & (i > 0), other=0.0)
        plgpu.store(ref.at[index], previous + jnp.sum(f(x_hat, dy), axis=0), mask=col_ok)
      c1, c2 = row_sums(x_hat, wdy)
      return (sums[0] + c1,) + (() if c2 is None else (sums[1] + c2,))

    zeros = jnp.zeros((blocks.block_rows,), cdt)
    sums = lax.fori_loop(0, n_chunks, first_walk, (zeros,) * (2 if kind == "layer" else 1))
    # The next block's first walk reads partials that other threads of this program stored.
    if not registry.interpret_mode():
      plgpu.debug_barrier()
    c1 = sums[0] / n_cols
    c2 = sums[1] / n_cols if kind == "layer" else None

    @pl.loop(0, n_chunks)
    def _(j):
      loaded = load_rows(i, j, "evict_first")
      x_hat, _, wdy = math(loaded, weight(j))
      store_dx(i, j, x_hat, wdy, loaded[3], c1, c2)


def _sum_partials_kernel(partial_ref, out_ref, *, n_partials, n_cols, block_partials, block_cols):
  g = pl.program_id(0)
  cols = pl.program_id(1) * block_cols + jnp.arange(block_cols, dtype=jnp.int32)
  col_ok = cols < n_cols

  def step(i, acc):
    idx = i * block_partials + jnp.arange(block_partials, dtype=jnp.int32)
    mask = (idx < n_partials)[:, None] & col_ok[None, :]
    tile = plgpu.load(partial_ref.at[g, idx[:, None], cols[None, :]], mask=mask, other=0.0)
    return acc + jnp.sum(tile, axis=0)

  total = lax.fori_loop(0, pl.cdiv(n_partials, block_partials), step,
                        jnp.zeros((block_cols,), partial_ref.dtype))
  plgpu.store(out_ref.at[g, cols], total.astype(out_ref.dtype), mask=col_ok)


def _sum_partials(partials, dtype):
  """Stage two: ``(G, P, N)`` partials -> ``(G, N)``, summed in a fixed order."""
  n_groups, n_partials, n_cols = partials.shape
  block_partials = min(pl.next_power_of_2(n_partials), 32)
  block_cols = min(pl.next_power_of_2(n_cols), 256)
  kernel = functools.partial(_sum_partials_kernel, n_partials=n_partials, n_cols=n_cols,
                             block_partials=block_partials, block_cols=block_cols)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((n_groups, n_cols), dtype),
      grid=(n_groups, pl.cdiv(n_cols, block_cols)),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=registry.interpret_mode(), name="jaxfuse_norm_sum_partials",
  )(partials)


def backward(dy, x, weight, mean, rstd, *, kind, has_bias, bias_dtype=None,
             blocks: NormBlocks | None = None):
  """Returns ``(dx, dweight | None, dbias | None)`` for ``(G, R, N)`` inputs."""
  n_groups, n_rows, n_cols = x.shape
  blocks = blocks or backward_blocks(n_rows, n_cols, kind)
  programs = _programs(blocks, n_rows, n_groups)
  has_weight = weight is not None
  partial = jax.ShapeDtypeStruct((n_groups, programs, n_cols), rstd.dtype)
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)] + [partial] * (has_weight + has_bias)
  kernel = functools.partial(
      _backward_kernel, kind=kind, has_weight=has_weight, has_bias=has_bias, n_rows=n_rows,
      n_cols=n_cols, blocks=blocks, cdt=rstd.dtype)
  inputs = [dy, x] + [a for a in (weight, mean) if a is not None] + [rstd]
  dx, *partials = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(n_groups, programs),
      compiler_params=_compiler_params(blocks), interpret=registry.interpret_mode(),
      name=f"jaxfuse_{kind}_norm_bwd",
  )(*inputs)
  dweight = _sum_partials(partials.pop(0), weight.dtype) if has_weight else None
  dbias = _sum_partials(partials.pop(0), bias_dtype) if has_bias else None
  return dx, dweight, dbias
