"""XLA attention: the exact reference, and a query-chunked form whose memory is linear in S.

Layouts follow ``jax.nn.dot_product_attention``: ``q (B, T, N, H)``, ``k (B, S, K, H)``,
``v (B, S, K, Hv)`` with K dividing N (grouped-query attention). Scores and softmax are float32.
A query row with no allowed key gets output 0, log-sum-exp -inf, and zero gradients.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The structured masks, all computed from positions (never materialized as (T, S))."""
  is_causal: bool = False
  causal_offset: int = 0
  window: tuple[int, int] | None = None  # (left, right) around the aligned diagonal
  soft_cap: float | None = None


def allowed(spec: MaskSpec, q_pos, k_pos, q_seg=None, kv_seg=None, q_len=None, kv_len=None):
  """Boolean ``(B or 1, T', S)`` (or None): which (query, key) pairs may attend.

  ``q_pos (T',)`` and ``k_pos (S,)`` are absolute positions; segments are ``(B, T')`` and
  ``(B, S)``; lengths ``(B,)``.
  """
  ok = None

  def both(a, b):
    return b if a is None else a & b

  diag = q_pos[:, None] + spec.causal_offset
  if spec.is_causal:
    ok = both(ok, (k_pos[None, :] <= diag)[None])
  if spec.window is not None:
    left, right = spec.window
    ok = both(ok, ((k_pos[None, :] >= diag - left) & (k_pos[None, :] <= diag + right))[None])
  if q_seg is not None:
    ok = both(ok, q_seg[:, :, None] == kv_seg[:, None, :])
  if q_len is not None:
    ok = both(ok, (q_pos[None, :] < q_len[:, None])[:, :, None])
  if kv_len is not None:
    ok = both(ok, (k_pos[None, :] < kv_len[:, None])[:, None, :])
  return ok


def _scores(q, k, scale, spec, precision):
  b, t, n, h = q.shape
  kh = k.shape[2]
  qg = q.reshape(b, t, kh, n // kh, h)
  s = jnp.einsum("btkgh,bskh->bkgts", qg, k, precision=precision,
                 preferred_element_type=jnp.promote_types(q.dtype, jnp.float32)) * scale
  if spec.soft_cap is not None:
    s = spec.soft_cap * jnp.tanh(s / spec.soft_cap)
  return s  # (B, K, G, T, S)


def _group(a, kh):
  """(B, N, T, S)-broadcastable array -> (B, K, G, T, S)-broadcastable."""
  a = a.reshape((1,) * (4 - a.ndim) + a.shape)
  if a.shape[1] == 1:
    return a[:, :, None]
  return a.reshape(a.shape[0], kh, a.shape[1] // kh, *a.shape[2:])


def attention_block(q, k, v, bias, mask, q_pos, segs, lens, *, scale, spec, precision):
  """Exact attention of the queries at positions ``q_pos`` against all keys."""
  b, t, n, _ = q.shape
  s_len, kh = k.shape[1], k.shape[2]
  s = _scores(q, k, scale, spec, precision)
  if bias is not None:
    s = s + _group(bias, kh).astype(s.dtype)
  ok = allowed(spec, q_pos, jnp.arange(s_len), *segs, *lens)
  ok = None if ok is None else ok[:, None, None]
  if mask is not None:
    m = _group(mask, kh)
    ok = m if ok is None else ok & m
  if ok is not None:
    s = jnp.where(ok, s, -jnp.inf)
  m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  m = jnp.where(m == -jnp.inf, 0.0, m)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  l_safe = jnp.where(l > 0, l, 1.0)
  o = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, precision=precision,
                 preferred_element_type=s.dtype) / jnp.moveaxis(l_safe, 3, 1)
  lse = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)[..., 0]  # (B, K, G, T)
  return o.reshape(b, t, n, v.shape[-1]).astype(q.dtype), lse.reshape(b, n, t)


# Score bytes above which 'xla' walks the queries in chunks, keeping memory linear in S.
CHUNK_BYTES = 1 << 28


def attention(q, k, v, bias, mask, segs, lens, *, scale, spec, precision, chunk=None):
  """Returns ``(out (B, T, N, Hv), lse (B, N, T))``.

  ``segs`` is ``(q_seg, kv_seg)`` or ``(None, None)``; ``lens`` is ``(q_len, kv_len)``.
  """
  b, t, n, _ = q.shape
  s_len = k.shape[1]
  if chunk is None:
    per_query = b * n * s_len * jnp.dtype(jnp.promote_types(q.dtype, jnp.float32)).itemsize
    if per_query * t <= CHUNK_BYTES:
      return attention_block(q, k, v, bias, mask, jnp.arange(t), segs, lens, scale=scale,
                             spec=spec, precision=precision)
    chunk = max(16, min(t, CHUNK_BYTES // per_query))
  n_chunks = -(-t // chunk)
  pad = n_chunks * chunk - t

  def pad_t(a, axis):
    if a is None or a.shape[axis] == 1:
      return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, pad)
    return jnp.pad(a, widths)

  def bias_like(a):
    return None if a is None else pad_t(a.reshape((1,) * (4 - a.ndim) + a.shape), 2)

  qp, q_seg = pad_t(q, 1), pad_t(segs[0], 1)
  bias_p, mask_p = bias_like(bias), bias_like(mask)

  def take(a, i, axis):
    if a is None or a.shape[axis] == 1:
      return a
    return lax.dynamic_slice_in_dim(a, i * chunk, chunk, axis)

  # Each chunk's scores are recomputed in the backward pass instead of being stored.
  @jax.checkpoint
  def one(i):
    q_pos = i * chunk + jnp.arange(chunk)
    return attention_block(take(qp, i, 1), k, v, take(bias_p, i, 2), take(mask_p, i, 2), q_pos,
                           (take(q_seg, i, 1), segs[1]), lens, scale=scale, spec=spec,
                           precision=precision)

  outs, lses = lax.map(one, jnp.arange(n_chunks))
  out = jnp.moveaxis(outs, 0, 1).reshape(b, n_chunks * chunk, n, v.shape[-1])[:, :t]
  lse = jnp.moveaxis(lses, 0, 2).reshape(b, n, n_chunks * chunk)[..., :t]
  return out, lse


def gradient_floors(q, k, v, do, spec: MaskSpec = MaskSpec(), segments=(None, None),
                    lengths=(None, None), *, scale=None, block=512):
  """Per row of dq ``(B, T, N, 1)`` and of dk ``(B, S, K, 1)``: the size of the terms each is
  the sum of, ``scale * dS_ij * k_j`` (``q_i``) with ``dS = P * (dP - D)``, their rounding
  errors adding in quadrature; ``dP_ij = dO_i . v_j`` and ``D_i = dO_i . O_i`` count as the
  root-sum-square of their own products, which their rounding scales with (a dot product that
  happens to be ~0 rounds like any other). Where a query sees few keys, dq cancels to ~0 (one
  key: P = 1, dP = D) and this, not its own size, bounds the error: the floor of
  ``relative_error``. ``spec``'s masks, ``segments`` and ``lengths`` apply (its soft-cap,
  which only shrinks the terms, does not). Queries are walked in blocks, so memory is
  ``B * N * block * S``."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  scale = h ** -0.5 if scale is None else scale
  k, v = (jnp.repeat(a, n // kh, axis=2) for a in (k, v))
  block = min(block, t)
  blocks = -(-t // block)

  def split(a):  # zero rows pad T: their dO is 0, so they add no terms
    a = jnp.pad(a, ((0, 0), (0, blocks * block - t)) + ((0, 0),) * (a.ndim - 2))
    return a.reshape(b, blocks, block, *a.shape[2:]).swapaxes(0, 1)

  q_seg, kv_seg = segments
  q_seg = jnp.zeros((b, t), jnp.int32) if q_seg is None else q_seg
  kv_seg = jnp.zeros((b, s), jnp.int32) if kv_seg is None else kv_seg

  k_sq = jnp.sum(k * k, axis=-1)

  def one_block(dk_sq, xs):
    qb, dob, q_pos, q_seg_b = xs
    scores = jnp.einsum("btnh,bsnh->bnts", qb, k) * scale
    keep = allowed(spec, q_pos, jnp.arange(s), q_seg_b, kv_seg, *lengths)
    scores = jnp.where(keep[:, None], scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1, keepdims=True)
    p = jnp.where(jnp.isfinite(lse), jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0)), 0)
    dp_size = jnp.sqrt(jnp.einsum("btnh,bsnh->bnts", dob * dob, v * v))
    out = jnp.einsum("bnts,bsnh->btnh", p, v)
    d_size = jnp.sqrt(jnp.sum((dob * out) ** 2, -1)).transpose(0, 2, 1)[..., None]
    terms_sq = (p * (dp_size + d_size)) ** 2
    dq = scale * jnp.sqrt(jnp.einsum("bnts,bsn->btn", terms_sq, k_sq))
    return dk_sq + jnp.einsum("bnts,btn->bsn", terms_sq, jnp.sum(qb * qb, -1)), dq

  q_pos = jnp.arange(blocks * block).reshape(blocks, block)
  dk_sq, dq = lax.scan(one_block, jnp.zeros((b, s, n), q.dtype),
                       (split(q), split(do), q_pos, split(q_seg)))
  dq = dq.swapaxes(0, 1).reshape(b, blocks * block, n)[:, :t]
  dk = (scale * jnp.sqrt(dk_sq)).reshape(b, s, kh, n // kh).sum(-1)
  return dq[..., None], dk[..., None]


def delta(do, out):
  """``delta (B, N, T)`` for the flash backward kernels: the sum over the head dim of
  ``dO * O`` in float32. It is reduced along the contiguous head dim in a pass of its own, then
  transposed (H times smaller): fused into the Mosaic kernels' operand packing, XLA reduced it
  across the transposed layout, a strided walk far below the copy rate."""
  rows = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  return jnp.swapaxes(lax.optimization_barrier(rows), 1, 2)
