"""Attention forward on Hopper's matrix units: Pallas Mosaic GPU, wgmma and TMA. (Its
gradients come from the Triton backward, which takes the same residuals: see ``api``.)

A CTA owns ``2 * block_q`` query rows of one head and runs three warpgroups. The third is the
producer: it streams the key and value tiles of ``block_kv`` rows into a ring of ``stages``
shared-memory slots by TMA, each slot guarded by a "loaded" barrier, and refills a slot once
both consumers have arrived on its "consumed" barrier. The other two are consumers, each with
``block_q`` query rows in registers: S = Q K^T by wgmma into a float32 accumulator, the online
softmax in base 2 (running maximum of the scaled scores, exponentials as exp2), then O += P V
by wgmma. A schedule barrier the consumers pass twice per tile makes them take turns on the
tensor cores, so one's softmax runs while the other's products do (FlashAttention-3's
ping-pong).

Masks come from positions (causal with an offset, a (left, right) window, key and query
lengths) and from segment ids. Each consumer walks the key tiles of its band in three runs:
masked tiles at the band's lower edge, tiles whose keys every row sees (no mask), masked tiles
at the upper edge; tiles wholly outside the band are not loaded. Segment ids and query lengths
mask every tile. The producer loads the union of both consumers' bands; a consumer passes the
tiles only its partner needs, waiting and arriving on their barriers without computing (a
Mosaic barrier's phase is tracked per thread, so no wait may be skipped).

Partial tiles: queries and keys past T and S are read as zeros by TMA, which also drops stores
past T; keys past S are masked. Query and value head dims are 64, 128 or 256, independently.
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


# Per head dim (the larger of the query's and the value's; the kernel is Hopper's only): tiles
# whose Q, K, V (and output) slots fit the 227 KiB of shared memory, the fastest of those timed
# (benchmarks/results/2026-11-24-h100-tune-attention-mosaic-hd128.json).
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


def _config(h: int, hv: int) -> Config:
  return CONFIGS[max(h, hv)]


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
  cfg = config or _config(q.shape[3], v.shape[3])
  q_seg, kv_seg, q_len, kv_len = extras
  t, s = q.shape[1], k.shape[1]
  # TMA copies of 8 x 64 tiles need T and S multiples of 8 (the rows past them are masked or
  # dropped); other tails TMA's bounds take care of, without a copy.
  pad_rows = lambda a, n: a if a.shape[1] == n else jnp.pad(
      a, ((0, 0), (0, n - a.shape[1])) + ((0, 0),) * (a.ndim - 2))
  q = pad_rows(q, -(-t // 8) * 8)
  kv_tiles = -(-s // cfg.block_kv)
  # Where the pipeline's first loads reach the last tile, their static start must keep the
  # whole tile in bounds: so few keys are padded to whole tiles.
  kv_rows = kv_tiles * cfg.block_kv if kv_tiles <= max(2, cfg.stages) else -(-s // 8) * 8
  k, v = (pad_rows(a, kv_rows) for a in (k, v))
  tp = -(-t // (_CONSUMERS * cfg.block_q)) * _CONSUMERS * cfg.block_q
  sp = kv_tiles * cfg.block_kv
  # Segment rows are padded to whole tiles: TMA needs 16-byte row strides, and every tile's
  # ids then lie in bounds.
  seg = lambda a, n: None if a is None else pad_rows(a.astype(jnp.int32), n)
  as_int = lambda a: None if a is None else a.astype(jnp.int32)
  spans = None if q_seg is None else _segment_spans(q_seg, kv_seg, tp, sp, cfg)
  out, lse = _forward(q, k, v, seg(q_seg, tp), seg(kv_seg, sp), spans, as_int(q_len),
                      as_int(kv_len), t, s, spec, float(scale), cfg)
  return out[:, :t], lse[..., :t]


def _segment_spans(q_seg, kv_seg, tp: int, sp: int, cfg: Config):
  """``(B, tp // block_q, 2)``: per block of query rows, the key tiles ``[lo, hi)`` from the
  first to the last whose range of segment ids meets the block's. Packed documents (sorted
  ids) then walk only their own document's tiles; any ids stay correct, as every tile is
  masked."""
  b = q_seg.shape[0]
  # Padding repeats the last id, widening no range (padded keys are masked by S).
  edge = lambda a, n: jnp.pad(a.astype(jnp.int32), ((0, 0), (0, n - a.shape[1])), mode="edge")
  qs = edge(q_seg, tp).reshape(b, -1, cfg.block_q)
  ks = edge(kv_seg, sp).reshape(b, -1, cfg.block_kv)
  meets = ((qs.min(-1)[:, :, None] <= ks.max(-1)[:, None, :])
           & (ks.min(-1)[:, None, :] <= qs.max(-1)[:, :, None]))
  lo = jnp.argmax(meets, -1)
  hi = jnp.where(meets.any(-1), ks.shape[1] - jnp.argmax(meets[..., ::-1], -1), lo)
  return jnp.stack([lo, hi], -1).astype(jnp.int32)


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


def _div(a, b: int):
  """``a // b`` for ``a >= 0``, a Python int where ``a`` is one."""
  return a // b if isinstance(a, int) else lax.div(a, jnp.int32(b))


def _select(condition, a, b):
  return (a if condition else b) if isinstance(condition, bool) else jnp.where(condition, a, b)


@dataclasses.dataclass(frozen=True)
class _Band:
  """Which key tiles query rows walk. Bounds are Python ints where nothing is traced (the
  plain full case: static loops), else int32 scalars."""
  t: int  # query rows (those past it are padding)
  spec: object  # reference.MaskSpec
  block_q: int
  block_kv: int
  kv_tiles: int
  mask_every_tile: bool

  def tiles(self, first, last, keys, span=None):
    """Rows ``first..last`` (clipped to T): ``(lo, full_lo, full_hi, hi)``, ``[lo, hi)`` every
    tile with a key some row may see, ``[full_lo, full_hi)`` those whose keys every row sees
    (no mask). ``keys``: the keys that exist (S, or this batch's length); ``span``: the tiles
    the rows' segment ids reach."""
    spec, block_kv = self.spec, self.block_kv
    offset = spec.causal_offset
    last = _minimum(last, self.t - 1)
    end, begin = keys, 0  # keys allowed to some row: [begin, end)
    full_end, full_begin = keys, 0  # keys allowed to every row
    if spec.is_causal:
      end = _minimum(end, last + offset + 1)
      full_end = _minimum(full_end, first + offset + 1)
    if spec.window is not None:
      left, right = spec.window
      end = _minimum(end, last + offset + right + 1)
      full_end = _minimum(full_end, first + offset + right + 1)
      begin = _maximum(0, first + offset - left)
      full_begin = _maximum(0, last + offset - left)
    lo = _minimum(_div(_maximum(begin, 0), block_kv), self.kv_tiles)
    hi = _div(_maximum(end, 0) + block_kv - 1, block_kv)
    if span is not None:
      lo, hi = _maximum(lo, span[0]), _minimum(hi, span[1])
    hi = _maximum(lo, hi)
    if self.mask_every_tile:
      return lo, hi, hi, hi
    full_lo = _minimum(hi, _maximum(lo, _div(full_begin + block_kv - 1, block_kv)))
    full_hi = _minimum(hi, _maximum(full_lo, _div(_maximum(full_end, 0), block_kv)))
    return lo, full_lo, full_hi, hi

  def cta(self, cta_first, keys, span_of=None):
    """``[cta_lo, cta_hi)``: the tiles the producer loads for a CTA's two query blocks, the
    hull of their ranges (``span_of(i)``: block i's segment span, or None)."""
    if span_of is None:  # bands grow with the rows: the CTA's is its rows' band
      cta_lo, _, _, cta_hi = self.tiles(cta_first, cta_first + _CONSUMERS * self.block_q - 1,
                                        keys)
      return cta_lo, cta_hi
    ranges = [self.tiles(cta_first + i * self.block_q, cta_first + (i + 1) * self.block_q - 1,
                         keys, span_of(i)) for i in range(_CONSUMERS)]
    cta_hi, cta_lo = 0, self.kv_tiles  # an empty block's range is left out
    for lo, _, _, hi in ranges:
      cta_hi = _maximum(cta_hi, _select(lo < hi, hi, 0))
      cta_lo = _minimum(cta_lo, _select(lo < hi, lo, self.kv_tiles))
    return _minimum(cta_lo, cta_hi), cta_hi

  def block(self, first, keys, span, cta):
    """The block of rows from ``first``: its ``tiles`` within the CTA's ``(cta_lo, cta_hi)``.
    Tiles of the hull outside them are passed as the partner's; a block whose band lies past
    the CTA's (no key for any of its rows) gets none."""
    cta_lo, cta_hi = cta
    lo, full_lo, full_hi, hi = self.tiles(first, first + self.block_q - 1, keys, span)
    lo = _minimum(_maximum(lo, cta_lo), cta_hi)
    return (lo,) + tuple(_minimum(_maximum(x, lo), cta_hi) for x in (full_lo, full_hi, hi))


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
  causal, offset, window, cap = spec.is_causal, spec.causal_offset, spec.window, spec.soft_cap
  has_segments = q_seg is not None
  optional = [a for a in (q_seg, kv_seg, spans, q_len, kv_len) if a is not None]
  band = _Band(t, spec, block_q, block_kv, kv_tiles,
               # Every tile is masked when a mask depends on data (segments, query lengths).
               mask_every_tile=has_segments or q_len is not None)

  def iota(shape, axis):
    return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)

  def when(condition, fn):
    """``pl.when``, or ``fn`` run or skipped at trace time for a Python condition."""
    if isinstance(condition, bool):
      return fn() if condition else None
    return pl.when(condition)(fn)

  def body(q_ref, k_ref, v_ref, *refs):
    refs = list(refs)
    q_seg_ref = refs.pop(0) if has_segments else None
    kv_seg_ref = refs.pop(0) if has_segments else None
    spans_ref = refs.pop(0) if has_segments else None
    q_len_ref = refs.pop(0) if q_len is not None else None
    kv_len_ref = refs.pop(0) if kv_len is not None else None
    (out_ref, lse_ref, q_smem, k_smem, v_smem, o_smem, lse_smem, q_seg_smem, kv_seg_smem,
     k_loaded, v_loaded, seg_loaded, q_loaded, k_consumed, v_consumed, schedule) = refs
    batch, head, tile = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("t")
    wg = lax.axis_index("wg")
    keys = s if kv_len_ref is None else jnp.clip(kv_len_ref[batch], 0, s)
    cta_first = tile * rows_per_cta

    span_of = None if spans_ref is None else (
        lambda i: (spans_ref[batch, tile * _CONSUMERS + i, 0],
                   spans_ref[batch, tile * _CONSUMERS + i, 1]))
    cta_lo, cta_hi = band.cta(cta_first, keys, span_of)
    slot_of = lambda j: lax.rem(j - cta_lo, stages)

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
      if has_segments:
        plgpu.copy_gmem_to_smem(q_seg_ref.at[batch, pl.ds(first, block_q)],
                                q_seg_smem.at[wg], seg_loaded.at[stages + wg])
        plgpu.barrier_wait(seg_loaded.at[stages + wg])
        q_ids = _load(plgpu, q_seg_smem.at[wg], plgpu.Layout.WGMMA.reduce(1))
      plgpu.barrier_wait(q_loaded.at[wg])
      span = None if span_of is None else span_of(wg)
      lo, full_lo, full_hi, hi = band.block(first, keys, span, (cta_lo, cta_hi))
      if q_len_ref is not None:
        q_rows = jnp.clip(q_len_ref[batch], 0, t)

      def mask(z, j, slot):
        rows, cols = iota(z.shape, 0) + first, iota(z.shape, 1) + j * block_kv
        ok = cols < keys
        if causal:
          ok = ok & (cols <= rows + offset)
        if window is not None:
          ok = ok & (cols >= rows + offset - window[0]) & (cols <= rows + offset + window[1])
        if q_len_ref is not None:
          ok = ok & (rows < q_rows)
        if has_segments:
          kv_ids = _load(plgpu, kv_seg_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
          ok = ok & (lax.broadcast_in_dim(q_ids, z.shape, [0])
                     == lax.broadcast_in_dim(kv_ids, z.shape, [1]))
        return jnp.where(ok, z, -jnp.inf)

      row_stat = lambda value: plgpu.layout_cast(jnp.full((block_q,), value, jnp.float32),
                                                 plgpu.Layout.WGMMA.reduce(1))
      carry = (plgpu.layout_cast(jnp.zeros((block_q, hv), jnp.float32), plgpu.Layout.WGMMA),
               row_stat(-jnp.inf), row_stat(0.0))

      def wait_next_key(j):
        when(j + 1 < cta_hi, lambda: plgpu.barrier_wait(k_loaded.at[slot_of(j + 1)]))

      when(cta_lo < cta_hi, lambda: plgpu.barrier_wait(k_loaded.at[slot_of(cta_lo)]))
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
        if cap is None:
          z = z * (scale * _LOG2E)  # base 2: exp(x) = exp2(x log2 e)
        else:
          z = jnp.tanh(z * (scale / cap)) * (cap * _LOG2E)
        if has_segments:
          plgpu.barrier_wait(seg_loaded.at[slot])
        if masked:
          z = mask(z, j, slot)
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

      carry = _loop(cta_lo, lo, skip, carry)
      carry = _loop(lo, full_lo, functools.partial(step, masked=True), carry)
      carry = _loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
      carry = _loop(full_hi, hi, functools.partial(step, masked=True), carry)
      carry = _loop(hi, cta_hi, skip, carry)
      pl.when(wg == 0)(take_turn)

      acc, m_i, l_i = carry
      inverse = jnp.where(l_i == 0.0, 0.0, 1.0 / l_i)  # no key at all: 0, as the reference
      my_out = my_q if o_smem is None else o_smem.at[wg]
      my_out[...] = (acc * lax.broadcast_in_dim(inverse, acc.shape, [0])).astype(dtype)
      lse_smem.at[wg][...] = (m_i + jnp.log2(l_i)) * _LN2
      plgpu.commit_smem()
      # Rows past T are dropped by TMA's bounds.
      plgpu.copy_smem_to_gmem(my_out, out_ref.at[batch, pl.ds(first, block_q), head])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(first, block_q)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      kv_head = lax.div(head, jnp.int32(groups))

      def load(j, slot):
        # Keys past S read as zeros (TMA's bounds) and are masked.
        rows = (batch, pl.ds(j * block_kv, block_kv), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])
        if has_segments:
          plgpu.copy_gmem_to_smem(kv_seg_ref.at[batch, pl.ds(j * block_kv, block_kv)],
                                  kv_seg_smem.at[slot], seg_loaded.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])

      for i in range(min(stages, kv_tiles)):  # a static start past S fails to trace
        when(cta_lo + i < cta_hi, functools.partial(load, cta_lo + i, i))

      @pl.loop(cta_lo + stages, _maximum(cta_hi, cta_lo + stages))
      def _(j):
        slot = slot_of(j)
        plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.barrier_wait(v_consumed.at[slot])
        load(j, slot)

  def entry(*refs):
    # wgmma reads shared memory in 8 x 64 tiles with the 128-byte swizzle.
    tiled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    scratch = [
        plgpu.SMEM((_CONSUMERS, block_q, h), dtype, **tiled),
        plgpu.SMEM((stages, block_kv, h), dtype, **tiled),
        plgpu.SMEM((stages, block_kv, hv), dtype, **tiled),
        plgpu.SMEM((_CONSUMERS, block_q, hv), dtype, **tiled) if hv != h else None,
        plgpu.SMEM((_CONSUMERS, block_q), jnp.float32),
        plgpu.SMEM((_CONSUMERS, block_q), jnp.int32) if has_segments else None,
        plgpu.SMEM((stages, block_kv), jnp.int32) if has_segments else None,
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        # Key segment ids per slot, then query segment ids per consumer.
        plgpu.Barrier(num_barriers=stages + _CONSUMERS) if has_segments else None,
        plgpu.Barrier(num_barriers=_CONSUMERS),
        plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=_CONSUMERS),
    ]
    present = [x for x in scratch if x is not None]

    def with_scratch(*allocated):
      allocated = list(allocated)
      body(*refs, *[None if x is None else allocated.pop(0) for x in scratch])

    pl.run_scoped(with_scratch, *present, collective_axes="wg")

  out_types = (jax.ShapeDtypeStruct((b, q.shape[1], n, hv), dtype),
               jax.ShapeDtypeStruct((b, n, q_tiles * rows_per_cta), jnp.float32))
  kernel = plgpu.kernel(
      entry, out_type=out_types, grid=(b, n, q_tiles), grid_names=("b", "n", "t"),
      num_threads=_CONSUMERS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True))
  return kernel(q, k, v, *optional)
