"""The backward: its entry, and the dQ kernel, which runs first and, where the forward's
output rows fit beside dO's, forms delta for the dK/dV kernel (``bwd_dkdv``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxfuse.ops.attention import reference
from jaxfuse.ops.attention.mosaic.band import _Band, _block_spans, _schedule, _segment_spans
from jaxfuse.ops.attention.mosaic.bwd_dkdv import _dkdv, _dkdv_paired
from jaxfuse.ops.attention.mosaic.config import (_CONSUMERS, _SMEM_BYTES, BackwardConfig,
                                                 default_backward_config)
from jaxfuse.ops.attention.mosaic.pipeline import (_LOG2E, _launch, _load, _pad_rows, _ring,
                                                   _swizzled, _tile_gradients, _walk, _when)


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
  # TMA wants whole row groups and a tile inside its operand: few tiles pad to whole tiles.
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
