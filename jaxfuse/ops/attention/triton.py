"""Pallas (Triton) FlashAttention-2: forward, and a backward in two passes (dK/dV, then dQ).

Forward: a program owns ``block_q`` query rows of one head and walks the key/value blocks that
its causal/window band can reach (blocks wholly outside the band are never loaded), keeping an
online softmax in float32 and saving the log-sum-exp per row.

Backward: ``delta = rowsum(dO * O)`` (minus any dLSE) comes from XLA. The dK/dV pass gives a
program one key/value block of one KV head (keys-first tiles, so no operand is transposed in
registers) and walks every query block of every query head of its group (grouped-query
attention sums over the group in a fixed order, without atomics); the dQ pass mirrors the
forward. Both recompute the probabilities from the saved log-sum-exp, so no (T, S)
array ever reaches memory, and both are deterministic.

Masks (causal with an offset, local window, segment ids, sequence lengths) are computed from
positions inside the kernel, and only on the blocks at the edges of the band: blocks wholly
inside it skip the mask. Exponentials are base 2, with log2(e) folded into the score scale.
Head dimensions are padded to a power of two in registers only.

Every array (q, k, v, the outputs, lse and delta, segment ids) is indexed with one int32 index
per dimension, never through a flat offset formed in a kernel: Pallas' Triton lowering scales
each index by its stride, in 64 bits for arrays larger than 2^32 bytes, so large batches and
long sequences past 2^31 elements are addressed exactly.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxfuse._core.registry import pallas_triton as plgpu  # None where JAX has no Triton

from jaxfuse._core import registry
from jaxfuse.ops.attention import reference
from jaxfuse.ops.attention.reference import MaskSpec

_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
  """One kernel's tiling: ``block_q`` query rows by ``block_k`` key rows per step."""
  block_q: int
  block_k: int
  num_warps: int
  num_stages: int


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
  forward: KernelBlocks
  dkdv: KernelBlocks
  dq: KernelBlocks


def default_blocks(head_dim: int) -> AttentionBlocks:
  # Measured on an H100 (benchmarks/tune.py, bf16; benchmarks/results/*-tune*.json). The
  # dK/dV pass holds a long key block (the rows of its two accumulators) and streams short
  # query blocks; the dQ pass and the forward do the opposite.
  if head_dim <= 64:
    return AttentionBlocks(KernelBlocks(64, 64, 4, 3), KernelBlocks(32, 128, 4, 3),
                           KernelBlocks(128, 64, 4, 3))
  if head_dim <= 128:
    return AttentionBlocks(KernelBlocks(128, 128, 8, 3), KernelBlocks(64, 128, 8, 3),
                           KernelBlocks(128, 64, 8, 3))
  return AttentionBlocks(KernelBlocks(64, 32, 4, 2), KernelBlocks(32, 64, 4, 2),
                         KernelBlocks(64, 32, 4, 2))


@dataclasses.dataclass(frozen=True)
class _Static:
  spec: MaskSpec
  scale: float
  t: int
  s: int
  n: int
  kv_heads: int
  h: int
  hv: int
  has_segments: bool
  has_q_len: bool
  has_kv_len: bool
  allow_tf32: bool | None
  blocks: AttentionBlocks

  @property
  def group(self):
    return self.n // self.kv_heads

  @property
  def hp(self):
    return max(16, pl.next_power_of_2(self.h))

  @property
  def hvp(self):
    return max(16, pl.next_power_of_2(self.hv))

  @property
  def masks_every_block(self):
    """Segments and lengths depend on data: every block computes its mask."""
    return self.has_segments or self.has_q_len or self.has_kv_len

  def right_reach(self):
    """How far right of the diagonal a key may be (None: unbounded)."""
    spec = self.spec
    if spec.is_causal:
      return 0 if spec.window is None else min(0, spec.window[1])
    return None if spec.window is None else spec.window[1]

  def left_reach(self):
    return None if self.spec.window is None else self.spec.window[0]


def _arange(n):
  return jnp.arange(n, dtype=jnp.int32)


def _cdiv(a, b):
  """Ceiling division of a traced non-negative (after clamping) integer."""
  return (jnp.maximum(a, 0) + b - 1) // b


def _kv_blocks(st, q0, block_q, block_k, kv_len):
  """Key blocks for queries q0 .. q0 + block_q - 1: ``(lo, full_lo, full_hi, hi)``.

  Blocks in [lo, hi) are reachable; those in [full_lo, full_hi) are wholly inside the band
  and the key range for every query of the block, so they need no mask.
  """
  off = st.spec.causal_offset
  right, left = st.right_reach(), st.left_reach()
  end = st.s if kv_len is None else jnp.minimum(kv_len, st.s)
  if right is not None:
    end = jnp.minimum(end, q0 + block_q - 1 + off + right + 1)
  start = 0 if left is None else jnp.maximum(q0 + off - left, 0)
  lo = start // block_k
  hi = jnp.maximum(lo, _cdiv(end, block_k))
  full_lo = lo if left is None else _cdiv(q0 + block_q - 1 + off - left, block_k)
  full_hi = st.s // block_k
  if right is not None:
    full_hi = jnp.minimum(full_hi, jnp.maximum(q0 + off + right + 1, 0) // block_k)
  return _band(lo, full_lo, full_hi, hi, st)


def _q_blocks(st, k0, block_q, block_k):
  """Query blocks that reach keys k0 .. k0 + block_k - 1, as in :func:`_kv_blocks`."""
  off = st.spec.causal_offset
  right, left = st.right_reach(), st.left_reach()
  start = 0 if right is None else jnp.maximum(k0 - off - right, 0)
  end = st.t if left is None else jnp.clip(k0 + block_k - 1 - off + left + 1, 0, st.t)
  lo = start // block_q
  hi = jnp.maximum(lo, _cdiv(end, block_q))
  full_lo = lo if right is None else _cdiv(k0 + block_k - 1 - off - right, block_q)
  full_hi = hi if left is None else jnp.maximum(k0 + left - off + 1, 0) // block_q
  # Keys past the end are masked: a partial key block has no unmasked query blocks.
  full_hi = full_hi * (k0 + block_k <= st.s)
  return _band(lo, full_lo, full_hi, hi, st)


def _band(lo, full_lo, full_hi, hi, st):
  if st.masks_every_block:
    return lo, hi, hi, hi
  full_lo = jnp.clip(full_lo, lo, hi)
  return lo, full_lo, jnp.clip(full_hi, full_lo, hi), hi


def _banded_loop(band, body, init):
  """``body(j, carry, masked)`` over the band: one loop over the unmasked middle blocks and
  one over the masked blocks on either side of it (the mask costs only where it bites)."""
  lo, full_lo, full_hi, hi = band
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), init)
  n_left = full_lo - lo

  def masked(i, carry):
    return body(jnp.where(i < n_left, lo + i, full_hi + i - n_left), carry, masked=True)

  return lax.fori_loop(0, n_left + hi - full_hi, masked, carry)


def _allowed(st, qi, kj, q_seg, kv_seg, q_len, kv_len, keys_first=False):
  """(queries, keys) mask of a tile, or (keys, queries) with ``keys_first``."""
  qa, ka = (1, 0) if keys_first else (0, 1)
  q_pos, k_pos = jnp.expand_dims(qi, ka), jnp.expand_dims(kj, qa)
  ok = (q_pos < st.t) & (k_pos < st.s)
  diag = q_pos + st.spec.causal_offset
  if st.spec.is_causal:
    ok = ok & (k_pos <= diag)
  if st.spec.window is not None:
    left, right = st.spec.window
    ok = ok & (k_pos >= diag - left) & (k_pos <= diag + right)
  if q_seg is not None:
    ok = ok & (jnp.expand_dims(q_seg, ka) == jnp.expand_dims(kv_seg, qa))
  if q_len is not None:
    ok = ok & (q_pos < q_len)
  if kv_len is not None:
    ok = ok & (k_pos < kv_len)
  return ok


_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _scores(st, a, b):
  """Scores ``a @ b.T`` in base-2 units (natural scores times log2(e), so ``exp2`` gives the
  softmax's exponentials with one multiply folded into the scale), soft-capped, and tanh of
  the cap's argument for the backward."""
  dot = plgpu.dot(a, b, trans_b=True, allow_tf32=st.allow_tf32).astype(jnp.float32)
  if st.spec.soft_cap is None:
    return dot * (st.scale * _LOG2E), None
  t = jnp.tanh(dot * (st.scale / st.spec.soft_cap))
  return t * (st.spec.soft_cap * _LOG2E), t


class _Refs:
  """Unpacks the optional segment and length operands shared by the three kernels."""

  def __init__(self, st, refs):
    refs = list(refs)
    self.q_seg = refs.pop(0) if st.has_segments else None
    self.kv_seg = refs.pop(0) if st.has_segments else None
    self.q_len = refs.pop(0) if st.has_q_len else None
    self.kv_len = refs.pop(0) if st.has_kv_len else None
    self.rest = refs

  def lengths(self, b):
    q_len = None if self.q_len is None else plgpu.load(self.q_len.at[b])
    kv_len = None if self.kv_len is None else plgpu.load(self.kv_len.at[b])
    return q_len, kv_len

  def q_segments(self, b, qi, ok):
    return None if self.q_seg is None else plgpu.load(self.q_seg.at[b, qi], mask=ok, other=-1)

  def kv_segments(self, b, kj, ok):
    return None if self.kv_seg is None else plgpu.load(self.kv_seg.at[b, kj], mask=ok, other=-2)


def _tile(ref, b, rows, head, width, n_rows, n_cols):
  cols = _arange(width)
  mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
  return plgpu.load(ref.at[b, rows[:, None], head, cols[None, :]], mask=mask, other=0.0)


def _forward_kernel(q_ref, k_ref, v_ref, *refs, st: _Static):
  r = _Refs(st, refs)
  o_ref, lse_ref = r.rest
  bq, bk = st.blocks.forward.block_q, st.blocks.forward.block_k
  qb, bn = pl.program_id(0), pl.program_id(1)
  b, n = bn // st.n, bn % st.n
  kh = n // st.group
  qi = qb * bq + _arange(bq)
  q = _tile(q_ref, b, qi, n, st.hp, st.t, st.h)
  q_len, kv_len = r.lengths(b)
  q_seg = r.q_segments(b, qi, qi < st.t)

  def body(j, carry, masked):
    m, l, acc = carry
    kj = j * bk + _arange(bk)
    k = _tile(k_ref, b, kj, kh, st.hp, st.s, st.h)
    v = _tile(v_ref, b, kj, kh, st.hvp, st.s, st.hv)
    s, _ = _scores(st, q, k)
    if masked:
      ok = _allowed(st, qi, kj, q_seg, r.kv_segments(b, kj, kj < st.s), q_len, kv_len)
      s = jnp.where(ok, s, _NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, allow_tf32=st.allow_tf32)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc

  init = (jnp.full((bq,), _NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros((bq, st.hvp), jnp.float32))
  m, l, acc = _banded_loop(_kv_blocks(st, qb * bq, bq, bk, kv_len), body, init)
  l_safe = jnp.where(l > 0, l, 1.0)
  out = acc / l_safe[:, None]
  cols = _arange(st.hvp)
  plgpu.store(o_ref.at[b, qi[:, None], n, cols[None, :]], out.astype(o_ref.dtype),
              mask=(qi < st.t)[:, None] & (cols < st.hv)[None, :])
  m_safe = jnp.where(m == _NEG_INF, 0.0, m)
  lse = m_safe * _LN2 + jnp.log(l_safe)
  plgpu.store(lse_ref.at[b, n, qi], jnp.where(l > 0, lse, _NEG_INF), mask=qi < st.t)


def _base2_lse(lse):
  # A row with no allowed key saved lse = -inf: +inf makes its probabilities 0.
  return jnp.where(lse == _NEG_INF, jnp.inf, lse * _LOG2E)


def _score_grad(p, dp, delta, t, delta_axis):
  ds = p * (dp - jnp.expand_dims(delta, delta_axis))
  return ds if t is None else ds * (1.0 - t * t)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: _Static):
  """Keys-first tiles (scores transposed: keys by queries), so every product takes its
  operands as stored and no register tile is transposed."""
  r = _Refs(st, refs)
  dk_ref, dv_ref = r.rest
  bq, bk = st.blocks.dkdv.block_q, st.blocks.dkdv.block_k
  kb, bh = pl.program_id(0), pl.program_id(1)
  b, kh = bh // st.kv_heads, bh % st.kv_heads
  kj = kb * bk + _arange(bk)
  k = _tile(k_ref, b, kj, kh, st.hp, st.s, st.h)
  v = _tile(v_ref, b, kj, kh, st.hvp, st.s, st.hv)
  q_len, kv_len = r.lengths(b)
  kv_seg = r.kv_segments(b, kj, kj < st.s)
  band = _q_blocks(st, kb * bk, bq, bk)

  def head(g, carry):
    n = kh * st.group + g

    def body(i, carry, masked):
      dk, dv = carry
      qi = i * bq + _arange(bq)
      q = _tile(q_ref, b, qi, n, st.hp, st.t, st.h)
      do = _tile(do_ref, b, qi, n, st.hvp, st.t, st.hv)
      lse = _base2_lse(plgpu.load(lse_ref.at[b, n, qi], mask=qi < st.t, other=0.0))
      delta = plgpu.load(delta_ref.at[b, n, qi], mask=qi < st.t, other=0.0)
      s, t = _scores(st, k, q)
      p = jnp.exp2(s - lse[None, :])
      if masked:
        ok = _allowed(st, qi, kj, r.q_segments(b, qi, qi < st.t), kv_seg, q_len, kv_len,
                      keys_first=True)
        p = jnp.where(ok, p, 0.0)
      dv = dv + plgpu.dot(p.astype(do.dtype), do, allow_tf32=st.allow_tf32)
      dp = plgpu.dot(v, do, trans_b=True, allow_tf32=st.allow_tf32)
      ds = _score_grad(p, dp, delta, t, 0)
      dk = dk + plgpu.dot(ds.astype(q.dtype), q, allow_tf32=st.allow_tf32)
      return dk, dv

    return _banded_loop(band, body, carry)

  dk, dv = lax.fori_loop(0, st.group, head, (jnp.zeros((bk, st.hp), jnp.float32),
                                             jnp.zeros((bk, st.hvp), jnp.float32)))
  for ref, value, width, real in ((dk_ref, dk * st.scale, st.hp, st.h),
                                  (dv_ref, dv, st.hvp, st.hv)):
    cols = _arange(width)
    plgpu.store(ref.at[b, kj[:, None], kh, cols[None, :]], value.astype(ref.dtype),
                mask=(kj < st.s)[:, None] & (cols < real)[None, :])


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: _Static):
  r = _Refs(st, refs)
  (dq_ref,) = r.rest
  bq, bk = st.blocks.dq.block_q, st.blocks.dq.block_k
  qb, bn = pl.program_id(0), pl.program_id(1)
  b, n = bn // st.n, bn % st.n
  kh = n // st.group
  qi = qb * bq + _arange(bq)
  q = _tile(q_ref, b, qi, n, st.hp, st.t, st.h)
  do = _tile(do_ref, b, qi, n, st.hvp, st.t, st.hv)
  lse = _base2_lse(plgpu.load(lse_ref.at[b, n, qi], mask=qi < st.t, other=0.0))
  delta = plgpu.load(delta_ref.at[b, n, qi], mask=qi < st.t, other=0.0)
  q_len, kv_len = r.lengths(b)
  q_seg = r.q_segments(b, qi, qi < st.t)

  def body(j, dq, masked):
    kj = j * bk + _arange(bk)
    k = _tile(k_ref, b, kj, kh, st.hp, st.s, st.h)
    v = _tile(v_ref, b, kj, kh, st.hvp, st.s, st.hv)
    s, t = _scores(st, q, k)
    p = jnp.exp2(s - lse[:, None])
    if masked:
      ok = _allowed(st, qi, kj, q_seg, r.kv_segments(b, kj, kj < st.s), q_len, kv_len)
      p = jnp.where(ok, p, 0.0)
    dp = plgpu.dot(do, v, trans_b=True, allow_tf32=st.allow_tf32)
    ds = _score_grad(p, dp, delta, t, 1)
    return dq + plgpu.dot(ds.astype(k.dtype), k, allow_tf32=st.allow_tf32)

  band = _kv_blocks(st, qb * bq, bq, bk, kv_len)
  dq = _banded_loop(band, body, jnp.zeros((bq, st.hp), jnp.float32)) * st.scale
  cols = _arange(st.hp)
  plgpu.store(dq_ref.at[b, qi[:, None], n, cols[None, :]], dq.astype(dq_ref.dtype),
              mask=(qi < st.t)[:, None] & (cols < st.h)[None, :])


def _static(q, k, v, extras, spec, scale, allow_tf32, blocks):
  q_seg, _, q_len, kv_len = extras
  return _Static(spec, scale, q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
                 v.shape[3], q_seg is not None, q_len is not None, kv_len is not None,
                 allow_tf32, blocks or default_blocks(max(q.shape[3], v.shape[3])))


def _params(blocks: KernelBlocks):
  return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _extras(extras):
  return [a for a in extras if a is not None]


def forward(q, k, v, extras, *, spec: MaskSpec, scale: float, allow_tf32=None,
            blocks: AttentionBlocks | None = None):
  """``extras = (q_seg, kv_seg, q_len, kv_len)`` (each may be None) -> ``(out, lse)``."""
  st = _static(q, k, v, extras, spec, scale, allow_tf32, blocks)
  b = q.shape[0]
  return pl.pallas_call(
      functools.partial(_forward_kernel, st=st),
      out_shape=[jax.ShapeDtypeStruct(q.shape[:3] + (st.hv,), q.dtype),
                 jax.ShapeDtypeStruct((b, st.n, st.t), jnp.float32)],
      grid=(pl.cdiv(st.t, st.blocks.forward.block_q), b * st.n),
      compiler_params=_params(st.blocks.forward),
      interpret=registry.interpret_mode(), name="jaxfuse_flash_attention_fwd",
  )(q, k, v, *_extras(extras))


def backward(q, k, v, do, lse, out, dlse, extras, *, spec: MaskSpec, scale: float,
             allow_tf32=None, blocks: AttentionBlocks | None = None):
  """Returns ``(dq, dk, dv)`` from the forward's ``out`` and ``lse`` and the cotangents ``do``
  and ``dlse (B, N, T)``."""
  delta = reference.delta(do, out) - dlse
  st = _static(q, k, v, extras, spec, scale, allow_tf32, blocks)
  b = q.shape[0]
  inputs = (q, k, v, do, lse, delta, *_extras(extras))
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, st=st),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      grid=(pl.cdiv(st.s, st.blocks.dkdv.block_k), b * st.kv_heads),
      compiler_params=_params(st.blocks.dkdv),
      interpret=registry.interpret_mode(), name="jaxfuse_flash_attention_dkdv",
  )(*inputs)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, st=st),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(pl.cdiv(st.t, st.blocks.dq.block_q), b * st.n),
      compiler_params=_params(st.blocks.dq),
      interpret=registry.interpret_mode(), name="jaxfuse_flash_attention_dq",
  )(*inputs)
  return dq, dk, dv
