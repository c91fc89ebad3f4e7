"""What the kernels share: control flow static or traced, shared-memory layouts, the
producer's ring, a consumer's walk over its tiles, a tile's recomputed gradients in the
backward, and the launch of two consumer warpgroups and a producer."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax.numpy as jnp
from jax import lax

from jaxfuse.ops.attention.mosaic.band import _div
from jaxfuse.ops.attention.mosaic.config import _CONSUMERS

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


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
