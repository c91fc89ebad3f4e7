"""Attention forward on Hopper's matrix units: Pallas Mosaic GPU, wgmma and TMA.

A CTA owns ``2 * block_q`` query rows of one head and runs three warpgroups. The third is the
producer: it streams the key and value tiles of ``block_kv`` rows into a ring of ``stages``
shared-memory slots by TMA, each slot guarded by a "loaded" barrier, and refills a slot once
both consumers have arrived on its "consumed" barrier. The other two are consumers, each with
``block_q`` query rows in registers: S = Q K^T by wgmma into a float32 accumulator, the online
softmax in base 2 (running maximum of the scaled scores, exponentials as exp2), then O += P V
by wgmma. A schedule barrier the consumers pass twice per tile makes them take turns on the
tensor cores, so one's softmax runs while the other's products do (FlashAttention-3's
ping-pong).

Causal masks: tiles wholly below the diagonal run without a mask, the diagonal's with one, and
tiles wholly above it are not loaded or computed. A consumer whose rows end before its partner's
still passes every tile the producer loads, arriving on its barriers without computing.

So far: the forward and its log-sum-exp, float16 and bfloat16, head dims 64, 128 and 256 (equal
for query and value), GQA/MQA, ``causal_offset``, and sequence lengths that are whole tiles;
every other argument is refused by :func:`unsupported`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxfuse._core import registry

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_CONSUMERS = 2


@dataclasses.dataclass(frozen=True)
class Config:
  """Rows per consumer warpgroup (``block_q``, a CTA takes two such blocks), key/value rows per
  tile, and the tiles in flight."""
  block_q: int = 64
  block_kv: int = 128
  stages: int = 2

  def __post_init__(self):
    # The producer refills a slot only after both its key and value are consumed, while a
    # consumer waits for the next key before releasing the value: one slot would deadlock.
    if self.stages < 2:
      raise ValueError(f"Config.stages must be at least 2, got {self.stages}")


# Per head dim: tiles whose Q, K and V slots fit the 227 KiB of shared memory.
CONFIGS = {64: Config(64, 128, 3), 128: Config(64, 128, 2), 256: Config(64, 64, 2)}


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


def unsupported(q_shape, k_shape, v_shape, dtype, *, spec, has_segments, has_q_len,
                has_kv_len, return_lse=False) -> str | None:
  """Why the kernel cannot take this call, naming the argument, or None."""
  del return_lse  # always computed
  _, t, _, h = q_shape
  s, hv = k_shape[1], v_shape[3]
  for present, name in ((has_segments, "segment_ids"), (has_q_len, "query_seq_lengths"),
                        (has_kv_len, "key_value_seq_lengths"),
                        (spec.window is not None, "local_window_size"),
                        (spec.soft_cap is not None, "logits_soft_cap")):
    if present:
      return f"the 'mosaic' kernel has no {name} yet"
  if jnp.dtype(dtype) not in (jnp.float16, jnp.bfloat16):
    return f"the 'mosaic' kernel takes float16 and bfloat16, not {jnp.dtype(dtype).name}"
  if h not in CONFIGS:
    return f"the 'mosaic' kernel takes head dims {tuple(CONFIGS)}, not {h}"
  if hv != h:
    return f"the 'mosaic' kernel needs the value head dim ({hv}) equal to the query's ({h})"
  cfg = CONFIGS[h]
  if t % (_CONSUMERS * cfg.block_q) or s % cfg.block_kv:
    return (f"the 'mosaic' kernel needs T a multiple of {_CONSUMERS * cfg.block_q} and S of "
            f"{cfg.block_kv} (T={t}, S={s})")
  return None


def forward(q, k, v, extras, *, spec, scale, allow_tf32=None, config: Config | None = None):
  """``(out (B, T, N, H), lse (B, N, T) float32)`` for ``q (B, T, N, H)``,
  ``k, v (B, S, K, H)``; ``extras`` must be empty (see :func:`unsupported`)."""
  del allow_tf32  # 16-bit operands only
  if any(e is not None for e in extras):
    raise NotImplementedError("the 'mosaic' kernel takes no segment ids or lengths")
  cfg = config or CONFIGS[q.shape[-1]]
  return _forward(q, k, v, spec.is_causal, spec.causal_offset, float(scale), cfg)


def backward(*args, **kwargs):
  raise NotImplementedError("the 'mosaic' attention has no backward yet; differentiate "
                            "implementation='triton', 'cudnn' or None")


def _forward(q, k, v, causal: bool, offset: int, scale: float, cfg: Config):
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  b, t, n, h = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  groups = n // kv_heads
  dtype = q.dtype
  block_q, block_kv = cfg.block_q, cfg.block_kv
  rows_per_cta = _CONSUMERS * block_q
  kv_tiles = s // block_kv
  stages = max(2, min(cfg.stages, kv_tiles))
  scale2 = scale * _LOG2E  # scores in base 2: exp(x) = exp2(x log2 e)

  def iota(shape, axis):
    return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)

  def when(condition, fn):
    """``pl.when``, or ``fn`` run or skipped at trace time for a Python condition."""
    if isinstance(condition, bool):
      return fn() if condition else None
    return pl.when(condition)(fn)

  def tiles_needed(last_row):
    """Key tiles that rows up to ``last_row`` see: all, or up to the causal diagonal."""
    if not causal:
      return kv_tiles  # a Python int: loop bounds and conditions known at trace time
    seen = last_row + 1 + offset
    return jnp.clip(lax.div(seen + block_kv - 1, block_kv), 0, kv_tiles).astype(jnp.int32)

  def body(q_ref, k_ref, v_ref, out_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem,
           k_loaded, v_loaded, q_loaded, k_consumed, v_consumed, schedule):
    batch, head, tile = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("t")
    wg = lax.axis_index("wg")
    cta_first = tile * rows_per_cta
    cta_tiles = tiles_needed(cta_first + rows_per_cta - 1)

    def take_turn():
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)

    @pl.when(wg < _CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(232, action="increase")
      first = cta_first + wg * block_q
      my_q = q_smem.at[wg]
      plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(first, block_q), head], my_q,
                              q_loaded.at[wg])
      plgpu.barrier_wait(q_loaded.at[wg])
      my_tiles = tiles_needed(first + block_q - 1)
      # Tiles every row of this block sees whole: no mask needed.
      unmasked = (my_tiles if not causal else
                  jnp.clip(lax.div(first + offset + 1, block_kv), 0, my_tiles))

      row_stat = lambda value: plgpu.layout_cast(jnp.full((block_q,), value, jnp.float32),
                                         plgpu.Layout.WGMMA.reduce(1))
      carry = (plgpu.layout_cast(jnp.zeros((block_q, h), jnp.float32), plgpu.Layout.WGMMA),
               row_stat(-jnp.inf), row_stat(0.0))

      when(my_tiles > 0, lambda: plgpu.barrier_wait(k_loaded.at[0]))

      pl.when(wg == 1)(take_turn)

      def step(j, carry, masked):
        acc, m_i, l_i = carry
        slot = lax.rem(j, stages)

        def scores(acc_ref):
          plgpu.wgmma(acc_ref, my_q, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
          take_turn()
          return acc_ref[...]

        z = pl.run_scoped(scores, plgpu.ACC((block_q, block_kv), jnp.float32)) * scale2
        plgpu.barrier_arrive(k_consumed.at[slot])
        if masked:
          rows, cols = iota(z.shape, 0), iota(z.shape, 1)
          z = jnp.where(cols + j * block_kv <= rows + first + offset, z, -jnp.inf)
        m_new = jnp.maximum(m_i, z.max(axis=1))
        # A row that has seen only masked scores keeps m = -inf: shift it by 0, not -inf.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - shift)
        p = jnp.exp2(z - lax.broadcast_in_dim(shift, z.shape, [0]))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i = l_i * alpha + p.sum(axis=1)
        p = p.astype(dtype)
        acc, l_i, m_new, p = lax.optimization_barrier((acc, l_i, m_new, p))
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(v_loaded.at[slot])
        plgpu.barrier_wait(schedule)

        def values(acc_ref):
          plgpu.wgmma(acc_ref, p, v_smem.at[slot])
          nxt = j + 1

          when(nxt < my_tiles, lambda: plgpu.barrier_wait(k_loaded.at[lax.rem(nxt, stages)]))

        acc = pl.run_state(values)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_consumed.at[slot])
        return acc, m_new, l_i

      carry = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), carry)
      if causal:
        carry = lax.fori_loop(unmasked, my_tiles, functools.partial(step, masked=True), carry)

      if causal:
        # Tiles the partner needs and this block does not: release them, keep the turns.
        @pl.loop(my_tiles, cta_tiles)
        def _(j):
          slot = lax.rem(j, stages)
          plgpu.barrier_arrive(k_consumed.at[slot])
          plgpu.barrier_arrive(v_consumed.at[slot])
          take_turn()
          take_turn()

      pl.when(wg == 0)(take_turn)
      acc, m_i, l_i = carry
      inverse = jnp.where(l_i == 0.0, 0.0, 1.0 / l_i)  # no key at all: 0, as the reference
      my_q[...] = (acc * lax.broadcast_in_dim(inverse, acc.shape, [0])).astype(dtype)
      lse_smem.at[wg][...] = (m_i + jnp.log2(l_i)) * _LN2
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(my_q, out_ref.at[batch, pl.ds(first, block_q), head])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(first, block_q)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      kv_head = lax.div(head, groups)

      def load(j, slot):
        rows = (batch, pl.ds(j * block_kv, block_kv), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])

      for j in range(stages):
        when(j < cta_tiles, functools.partial(load, j, j))

      @pl.loop(stages, jnp.maximum(cta_tiles, stages) if causal else max(kv_tiles, stages))
      def _(j):
        slot = lax.rem(j, stages)
        plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.barrier_wait(v_consumed.at[slot])
        load(j, slot)

  def entry(q_ref, k_ref, v_ref, out_ref, lse_ref):
    # wgmma reads shared memory in 8 x 64 tiles with the 128-byte swizzle.
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    pl.run_scoped(
        lambda *scratch: body(q_ref, k_ref, v_ref, out_ref, lse_ref, *scratch),
        plgpu.SMEM((_CONSUMERS, block_q, h), dtype, transforms=transforms),
        plgpu.SMEM((stages, block_kv, h), dtype, transforms=transforms),
        plgpu.SMEM((stages, block_kv, h), dtype, transforms=transforms),
        plgpu.SMEM((_CONSUMERS, block_q), jnp.float32),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=_CONSUMERS),
        plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=_CONSUMERS),
        collective_axes="wg",
    )

  out_types = (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32))
  kernel = plgpu.kernel(
      entry, out_type=out_types, grid=(b, n, t // rows_per_cta), grid_names=("b", "n", "t"),
      num_threads=_CONSUMERS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True))
  return kernel(q, k, v)
