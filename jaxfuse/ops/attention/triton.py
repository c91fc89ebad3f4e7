"""Pallas (Triton) FlashAttention-2: forward, and a backward in two passes (dK/dV, then dQ).

Forward: a program owns ``block_q`` query rows of one head and walks the key/value blocks that
its causal/window band can reach (blocks wholly outside the band are never loaded), keeping an
online softmax in float32 and saving the log-sum-exp per row.

Backward: ``delta = rowsum(dO * O)`` comes from XLA. The dK/dV pass gives a program one
key/value block of one KV head and walks every query block of every query head of its group
(grouped-query attention sums over the group in a fixed order, without atomics); the dQ pass
mirrors the forward. Both recompute the probabilities from the saved log-sum-exp, so no (T, S)
array ever reaches memory, and both are deterministic.

Masks (causal with an offset, local window, segment ids, sequence lengths) are computed from
positions inside the kernel. Head dimensions are padded to a power of two in registers only.
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
from jaxfuse.ops.attention.reference import MaskSpec

_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
  block_q: int
  block_k: int
  num_warps: int
  num_stages: int
  block_q_bwd: int
  block_k_bwd: int
  num_warps_bwd: int


def default_blocks(head_dim: int) -> AttentionBlocks:
  if head_dim <= 64:
    return AttentionBlocks(128, 64, 4, 3, 64, 64, 4)
  if head_dim <= 128:
    return AttentionBlocks(128, 64, 8, 3, 64, 64, 8)
  return AttentionBlocks(64, 32, 8, 2, 32, 32, 8)


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


def _kv_blocks(st, q0, block_q, block_k, kv_len):
  """[lo, hi) key blocks that queries q0 .. q0 + block_q - 1 can reach."""
  off = st.spec.causal_offset
  right, left = st.right_reach(), st.left_reach()
  end = st.s if kv_len is None else jnp.minimum(kv_len, st.s)
  if right is not None:
    end = jnp.minimum(end, q0 + block_q - 1 + off + right + 1)
  start = 0 if left is None else jnp.maximum(q0 + off - left, 0)
  lo = start // block_k
  return lo, jnp.maximum(lo, (end + block_k - 1) // block_k)


def _q_blocks(st, k0, block_q, block_k):
  """[lo, hi) query blocks that can reach keys k0 .. k0 + block_k - 1."""
  off = st.spec.causal_offset
  right, left = st.right_reach(), st.left_reach()
  start = 0 if right is None else jnp.maximum(k0 - off - right, 0)
  end = st.t if left is None else jnp.clip(k0 + block_k - 1 - off + left + 1, 0, st.t)
  lo = start // block_q
  return lo, jnp.maximum(lo, (end + block_q - 1) // block_q)


def _allowed(st, qi, kj, q_seg, kv_seg, q_len, kv_len):
  ok = (qi[:, None] < st.t) & (kj[None, :] < st.s)
  diag = qi[:, None] + st.spec.causal_offset
  if st.spec.is_causal:
    ok = ok & (kj[None, :] <= diag)
  if st.spec.window is not None:
    left, right = st.spec.window
    ok = ok & (kj[None, :] >= diag - left) & (kj[None, :] <= diag + right)
  if q_seg is not None:
    ok = ok & (q_seg[:, None] == kv_seg[None, :])
  if q_len is not None:
    ok = ok & (qi[:, None] < q_len)
  if kv_len is not None:
    ok = ok & (kj[None, :] < kv_len)
  return ok


def _scores(st, q, k):
  """Scaled (and soft-capped) scores, and tanh of the cap's argument for the backward."""
  s = plgpu.dot(q, k, trans_b=True, allow_tf32=st.allow_tf32).astype(jnp.float32) * st.scale
  if st.spec.soft_cap is None:
    return s, None
  t = jnp.tanh(s / st.spec.soft_cap)
  return st.spec.soft_cap * t, t


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
  return plgpu.load(ref.at[b, rows[:, None], head, cols[None, :]], mask=mask, other=0.0), mask


def _forward_kernel(q_ref, k_ref, v_ref, *refs, st: _Static):
  r = _Refs(st, refs)
  o_ref, lse_ref = r.rest
  bq, bk = st.blocks.block_q, st.blocks.block_k
  qb, bn = pl.program_id(0), pl.program_id(1)
  b, n = bn // st.n, bn % st.n
  kh = n // st.group
  qi = qb * bq + _arange(bq)
  q, _ = _tile(q_ref, b, qi, n, st.hp, st.t, st.h)
  q_len, kv_len = r.lengths(b)
  q_seg = r.q_segments(b, qi, qi < st.t)
  lo, hi = _kv_blocks(st, qb * bq, bq, bk, kv_len)

  def body(j, carry):
    m, l, acc = carry
    kj = j * bk + _arange(bk)
    k, _ = _tile(k_ref, b, kj, kh, st.hp, st.s, st.h)
    v, _ = _tile(v_ref, b, kj, kh, st.hvp, st.s, st.hv)
    s, _ = _scores(st, q, k)
    ok = _allowed(st, qi, kj, q_seg, r.kv_segments(b, kj, kj < st.s), q_len, kv_len)
    s = jnp.where(ok, s, _NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
    alpha = jnp.exp(jnp.where(m == _NEG_INF, _NEG_INF, m - m_safe))
    p = jnp.exp(s - m_safe[:, None])
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, allow_tf32=st.allow_tf32)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc

  init = (jnp.full((bq,), _NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros((bq, st.hvp), jnp.float32))
  m, l, acc = lax.fori_loop(lo, hi, body, init)
  l_safe = jnp.where(l > 0, l, 1.0)
  out = acc / l_safe[:, None]
  cols = _arange(st.hvp)
  plgpu.store(o_ref.at[b, qi[:, None], n, cols[None, :]], out.astype(o_ref.dtype),
              mask=(qi < st.t)[:, None] & (cols < st.hv)[None, :])
  m_safe = jnp.where(m == _NEG_INF, 0.0, m)
  plgpu.store(lse_ref.at[b, n, qi], jnp.where(l > 0, m_safe + jnp.log(l_safe), _NEG_INF),
              mask=qi < st.t)


def _probabilities(st, q, k, qi, kj, q_seg, kv_seg, q_len, kv_len, lse):
  s, t = _scores(st, q, k)
  ok = _allowed(st, qi, kj, q_seg, kv_seg, q_len, kv_len)
  # A row with no allowed key saved lse = -inf: its probabilities are 0.
  lse = jnp.where(lse == _NEG_INF, jnp.inf, lse)
  return jnp.where(ok, jnp.exp(s - lse[:, None]), 0.0), t


def _score_grad(st, p, dp, delta, t):
  ds = p * (dp - delta[:, None])
  return ds if t is None else ds * (1.0 - t * t)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: _Static):
  r = _Refs(st, refs)
  dk_ref, dv_ref = r.rest
  bq, bk = st.blocks.block_q_bwd, st.blocks.block_k_bwd
  kb, bh = pl.program_id(0), pl.program_id(1)
  b, kh = bh // st.kv_heads, bh % st.kv_heads
  kj = kb * bk + _arange(bk)
  k, _ = _tile(k_ref, b, kj, kh, st.hp, st.s, st.h)
  v, _ = _tile(v_ref, b, kj, kh, st.hvp, st.s, st.hv)
  q_len, kv_len = r.lengths(b)
  kv_seg = r.kv_segments(b, kj, kj < st.s)
  lo, hi = _q_blocks(st, kb * bk, bq, bk)

  def head(g, carry):
    n = kh * st.group + g

    def body(i, carry):
      dk, dv = carry
      qi = i * bq + _arange(bq)
      q, _ = _tile(q_ref, b, qi, n, st.hp, st.t, st.h)
      do, _ = _tile(do_ref, b, qi, n, st.hvp, st.t, st.hv)
      lse = plgpu.load(lse_ref.at[b, n, qi], mask=qi < st.t, other=0.0)
      delta = plgpu.load(delta_ref.at[b, n, qi], mask=qi < st.t, other=0.0)
      p, t = _probabilities(st, q, k, qi, kj, r.q_segments(b, qi, qi < st.t), kv_seg, q_len,
                            kv_len, lse)
      dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True, allow_tf32=st.allow_tf32)
      dp = plgpu.dot(do, v, trans_b=True, allow_tf32=st.allow_tf32)
      ds = _score_grad(st, p, dp, delta, t)
      dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True, allow_tf32=st.allow_tf32)
      return dk, dv

    return lax.fori_loop(lo, hi, body, carry)

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
  bq, bk = st.blocks.block_q_bwd, st.blocks.block_k_bwd
  qb, bn = pl.program_id(0), pl.program_id(1)
  b, n = bn // st.n, bn % st.n
  kh = n // st.group
  qi = qb * bq + _arange(bq)
  q, _ = _tile(q_ref, b, qi, n, st.hp, st.t, st.h)
  do, _ = _tile(do_ref, b, qi, n, st.hvp, st.t, st.hv)
  lse = plgpu.load(lse_ref.at[b, n, qi], mask=qi < st.t, other=0.0)
  delta = plgpu.load(delta_ref.at[b, n, qi], mask=qi < st.t, other=0.0)
  q_len, kv_len = r.lengths(b)
  q_seg = r.q_segments(b, qi, qi < st.t)
  lo, hi = _kv_blocks(st, qb * bq, bq, bk, kv_len)

  def body(j, dq):
    kj = j * bk + _arange(bk)
    k, _ = _tile(k_ref, b, kj, kh, st.hp, st.s, st.h)
    v, _ = _tile(v_ref, b, kj, kh, st.hvp, st.s, st.hv)
    p, t = _probabilities(st, q, k, qi, kj, q_seg, r.kv_segments(b, kj, kj < st.s), q_len,
                          kv_len, lse)
    dp = plgpu.dot(do, v, trans_b=True, allow_tf32=st.allow_tf32)
    ds = _score_grad(st, p, dp, delta, t)
    return dq + plgpu.dot(ds.astype(k.dtype), k, allow_tf32=st.allow_tf32)

  dq = lax.fori_loop(lo, hi, body, jnp.zeros((bq, st.hp), jnp.float32)) * st.scale
  cols = _arange(st.hp)
  plgpu.store(dq_ref.at[b, qi[:, None], n, cols[None, :]], dq.astype(dq_ref.dtype),
              mask=(qi < st.t)[:, None] & (cols < st.h)[None, :])


def _static(q, k, v, extras, spec, scale, allow_tf32, blocks):
  q_seg, _, q_len, kv_len = extras
  return _Static(spec, scale, q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
                 v.shape[3], q_seg is not None, q_len is not None, kv_len is not None,
                 allow_tf32, blocks or default_blocks(max(q.shape[3], v.shape[3])))


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
      grid=(pl.cdiv(st.t, st.blocks.block_q), b * st.n),
      compiler_params=plgpu.CompilerParams(num_warps=st.blocks.num_warps,
                                           num_stages=st.blocks.num_stages),
      interpret=registry.interpret_mode(), name="jaxfuse_flash_attention_fwd",
  )(q, k, v, *_extras(extras))


def backward(q, k, v, do, lse, delta, extras, *, spec: MaskSpec, scale: float, allow_tf32=None,
             blocks: AttentionBlocks | None = None):
  """Returns ``(dq, dk, dv)``; ``delta (B, N, T)`` is ``rowsum(dO * O)`` minus any dLSE."""
  st = _static(q, k, v, extras, spec, scale, allow_tf32, blocks)
  b = q.shape[0]
  params = plgpu.CompilerParams(num_warps=st.blocks.num_warps_bwd, num_stages=2)
  inputs = (q, k, v, do, lse, delta, *_extras(extras))
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, st=st),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      grid=(pl.cdiv(st.s, st.blocks.block_k_bwd), b * st.kv_heads), compiler_params=params,
      interpret=registry.interpret_mode(), name="jaxfuse_flash_attention_dkdv",
  )(*inputs)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, st=st),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(pl.cdiv(st.t, st.blocks.block_q_bwd), b * st.n), compiler_params=params,
      interpret=registry.interpret_mode(), name="jaxfuse_flash_attention_dq",
  )(*inputs)
  return dq, dk, dv
