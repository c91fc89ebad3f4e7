"""The forward kernel: two consumer warpgroups taking turns on the tensor cores while a
producer streams key and value tiles (the package's docstring tells the whole)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxfuse.ops.attention.mosaic.band import _Band, _block_spans, _schedule, _segment_spans
from jaxfuse.ops.attention.mosaic.config import _CONSUMERS, Config, default_config
from jaxfuse.ops.attention.mosaic.pipeline import (_LN2, _LOG2E, _launch, _load, _pad_rows,
                                                   _swizzled, _walk, _when)


def forward(q, k, v, extras, *, spec, scale, allow_tf32=None, config: Config | None = None):
  """``(out (B, T, N, Hv), lse (B, N, T) float32)`` for ``q (B, T, N, H)``,
  ``k (B, S, K, H)``, ``v (B, S, K, Hv)``; ``extras = (q_seg (B, T), kv_seg (B, S),
  q_len (B,), kv_len (B,))``, each possibly None."""
  del allow_tf32  # 16-bit operands only
  q_seg, kv_seg, q_len, kv_len = extras
  cfg = config or default_config(q.shape[3], v.shape[3], spec, q_seg is not None)
  t, s = q.shape[1], k.shape[1]
  # TMA wants whole row groups (rows past T are masked or dropped); its bounds take other tails.
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
