"""The backward's dK/dV kernels: each consumer warpgroup holding both gradients of its key
block (``_dkdv``), or, where a key block's two float32 gradients outgrow a warpgroup's
registers, one each, the two trading P^T and dP^T - delta through shared memory
(``_dkdv_paired``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxfuse.ops.attention.mosaic.band import _Band, _block_spans, _iota, _schedule
from jaxfuse.ops.attention.mosaic.config import _CONSUMERS, BackwardConfig
from jaxfuse.ops.attention.mosaic.pipeline import (_base2_scores, _launch, _load,
                                                   _query_tile_loader, _ring, _swizzled,
                                                   _tile_gradients, _walk, _when)


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
