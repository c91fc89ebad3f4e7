"""``jaxfuse.attention``: validation, dispatch, custom VJP and sharding."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._core import op, registry, tuned
from jaxfuse._core.batching import fold_into_batch, mapped_axis_first
from jaxfuse._core.sharding import parallel_call
from jaxfuse._core.validation import (check_array, check_lengths_range, describe, static_bool,
                                      static_float, static_int)
from jaxfuse.ops.attention import mosaic, reference, triton
from jaxfuse.ops.attention.reference import MaskSpec

OP = "attention"


def _cudnn_unavailable():
  if registry.cuda_compute_capability() is None:
    return "the 'cudnn' implementation needs an NVIDIA GPU"
  return None


_BACKENDS = {"xla": registry.xla_available, "cudnn": _cudnn_unavailable,
             "triton": registry.triton_unavailable, "mosaic": mosaic.unavailable}
_FLASH = {"triton": triton, "mosaic": mosaic}


def attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
              is_causal: bool = False, causal_offset: int = 0, segment_ids=None,
              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
              logits_soft_cap: float | None = None, return_lse: bool = False, precision=None,
              implementation: str | None = None):
  """Scaled dot-product attention in the layout of ``jax.nn.dot_product_attention``.

  Args:
    query: ``(B, T, N, H)`` (or ``(T, N, H)``), float16, bfloat16 or float32.
    key: ``(B, S, K, H)`` with K dividing N (grouped-query / multi-query attention).
    value: ``(B, S, K, Hv)``; Hv may differ from H.
    bias: optional, broadcastable to ``(B, N, T, S)``, added to the scaled scores.
    mask: optional boolean, broadcastable to ``(B, N, T, S)``; True keeps a score.
    scale: multiplies ``q . k``; default ``1 / sqrt(H)``.
    is_causal: keep key j for query i only when ``j <= i + causal_offset`` (offset 0 is
      ``jax.nn``'s alignment; ``S - T`` aligns the queries with the last T keys).
    segment_ids: int ``(B, T)`` when T == S, or a pair ``(query_ids (B, T), kv_ids (B, S))``:
      tokens attend only within their segment (packed sequences).
    query_seq_lengths, key_value_seq_lengths: int ``(B,)``; positions past them are masked.
    local_window_size: int w (same as ``(w, w)``) or ``(left, right)``: key j is kept for
      query i when ``i + causal_offset - left <= j <= i + causal_offset + right``.
    logits_soft_cap: c > 0 replaces each score s by ``c * tanh(s / c)`` (before masking).
    return_lse: also return the float32 log-sum-exp of each query row, ``(B, N, T)``.
    precision: ``jax.lax.Precision`` for the two matrix products (float32 inputs: DEFAULT may
      use TF32, HIGHEST does not), or a ``jax.lax.DotAlgorithmPreset`` (XLA only).
    implementation: ``'xla'`` (exact reference; chunked over queries when the scores would be
      large, so memory stays linear in S), ``'cudnn'``, ``'triton'`` (our FlashAttention),
      ``'mosaic'`` (Hopper wgmma and TMA through Pallas Mosaic GPU: every mask and length
      above, GQA, float16/bfloat16, query and value head dims of 64, 128 or 256, forward
      and backward) or ``None`` for the fastest that supports the arguments here: cuDNN
      where it accepts the call, then 'mosaic' on Hopper, then 'triton' ('mosaic' before
      cuDNN for the calls where it measured faster on this GPU). None chooses for
      evaluation and for differentiation apart: a call only evaluated may run one kernel
      and the same call under ``jax.grad`` another (forward and backward of one, so its
      values agree with its gradients), each the faster there.

  Returns:
    ``(B, T, N, Hv)`` like ``query`` (and the lse if asked). A query row with no allowed key
    gives 0 and zero gradients.
  """
  q, k, v = (check_array(OP, n, a) for n, a in (("query", query), ("key", key),
                                               ("value", value)))
  batched = q.ndim == 4
  if q.ndim == 3 and k.ndim == 3 and v.ndim == 3:
    q, k, v = q[None], k[None], v[None]
  if not (q.ndim == k.ndim == v.ndim == 4):
    raise ValueError(f"{OP}: query, key and value must all be (B, T, N, H) or (T, N, H); got "
                     f"query {describe(query)}, key {describe(key)}, value {describe(value)}")
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(f"{OP}: query, key and value must share a dtype; got {q.dtype}, {k.dtype}, "
                    f"{v.dtype}")
  b, t, n, h = q.shape
  _, s, kh, hk = k.shape
  if k.shape[0] != b or v.shape[:3] != k.shape[:3] or hk != h:
    raise ValueError(f"{OP}: key must be (B, S, K, H) and value (B, S, K, Hv) for query "
                     f"(B, T, N, H); got query {describe(q)}, key {describe(k)}, "
                     f"value {describe(v)}")
  if s == 0:
    raise ValueError(f"{OP}: key and value have no positions (S = 0): each query's softmax "
                     f"would be over nothing; got key {describe(k)}")
  if h == 0:
    raise ValueError(f"{OP}: query and key have no features (H = 0): every score would be 0; "
                     f"got query {describe(q)}")
  if kh == 0 or n % kh:
    raise ValueError(f"{OP}: the key/value heads ({kh}) must divide the query heads ({n})")
  is_causal = static_bool(OP, "is_causal", is_causal)
  scale = 1.0 / math.sqrt(h) if scale is None else _float("scale", scale)
  causal_offset, window = _band(_int("causal_offset", causal_offset),
                                _window(local_window_size), t, s)
  if logits_soft_cap is not None:
    logits_soft_cap = _float("logits_soft_cap", logits_soft_cap)
    if logits_soft_cap <= 0:
      raise ValueError(f"{OP}: logits_soft_cap must be > 0, got {logits_soft_cap}")
  q_seg, kv_seg = _segments(segment_ids, b, t, s)
  if causal_offset and not is_causal and local_window_size is None:
    raise ValueError(f"{OP}: causal_offset={causal_offset} applies to is_causal=True or a "
                     f"local_window_size; alone it does nothing")
  q_len = _lengths("query_seq_lengths", query_seq_lengths, b, t)
  kv_len = _lengths("key_value_seq_lengths", key_value_seq_lengths, b, s)
  bias = None if bias is None else _broadcastable("bias", bias, (b, n, t, s), floating=True)
  mask = None if mask is None else _broadcastable("mask", mask, (b, n, t, s), floating=False)
  spec = MaskSpec(is_causal, causal_offset, window, logits_soft_cap)
  call = _Call(spec, scale, precision, bias is not None, mask is not None, q_seg is not None,
               q_len is not None, kv_len is not None, return_lse, q.dtype)
  plan = _resolve(implementation, call, (q, k, v, bias, mask, q_len, kv_len),
                  empty=0 in (b, t, n, v.shape[3]))
  out, lse = _attention_jit(q, k, v, bias, mask, q_seg, kv_seg, q_len, kv_len, plan, call)
  if not batched:
    out, lse = out[0], None if lse is None else lse[0]
  return (out, lse) if return_lse else out


@dataclasses.dataclass(frozen=True)
class _Call:
  spec: MaskSpec
  scale: float
  precision: object
  has_bias: bool
  has_mask: bool
  has_segments: bool
  has_q_len: bool
  has_kv_len: bool
  return_lse: bool
  dtype: object


def _float(name, value):
  return static_float(OP, name, value)


def _int(name, value):
  return static_int(OP, name, value)


def _window(window):
  if window is None:
    return None
  if isinstance(window, (int, np.integer)):
    pair = (window, window)
  elif isinstance(window, (tuple, list, np.ndarray)):
    pair = tuple(window)
  else:
    raise TypeError(f"{OP}: local_window_size must be an int or (left, right), got {window!r}")
  if len(pair) != 2:
    raise ValueError(f"{OP}: local_window_size must be an int or (left, right), got {window!r}")
  left, right = (_int("local_window_size", w) for w in pair)
  if left < 0 or right < 0:
    raise ValueError(f"{OP}: local_window_size must be >= 0, got {window!r}")
  return left, right


def _band(offset, window, t, s):
  """The mask compares ``j - i`` (in ``[1 - T, S - 1]``) with ``offset``, ``offset - left`` and
  ``offset + right``: each is clamped to ``[-T, S]``, which keeps the mask and keeps the
  kernels' int32 positions far from overflow (and equal masks one compilation)."""
  clamp = lambda x: min(max(x, -t), s)
  if window is None:
    return clamp(offset), None
  low, high, offset = clamp(offset - window[0]), clamp(offset + window[1]), clamp(offset)
  return offset, (offset - low, high - offset)


def _int_array(name, a, shape):
  a = check_array(OP, name, a, floating=False)
  if not jnp.issubdtype(a.dtype, jnp.integer):
    raise TypeError(f"{OP}: {name} must be integers, got {describe(a)}")
  if a.shape != shape:
    raise ValueError(f"{OP}: {name} must have shape {shape}, got {describe(a)}")
  return a.astype(jnp.int32)


def _segments(segment_ids, b, t, s):
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError(f"{OP}: segment_ids must be an array or a (query_ids, kv_ids) pair")
    return (_int_array("segment_ids[0]", segment_ids[0], (b, t)),
            _int_array("segment_ids[1]", segment_ids[1], (b, s)))
  if t != s:
    raise ValueError(f"{OP}: one segment_ids array needs T == S (got T={t}, S={s}); pass "
                     f"(query_ids, kv_ids)")
  ids = _int_array("segment_ids", segment_ids, (b, t))
  return ids, ids


def _lengths(name, a, b, positions):
  if a is None:
    return None
  a = _int_array(name, a, (b,))
  check_lengths_range(OP, name, a, positions, str(positions))
  return a


def _broadcastable(name, a, shape, floating):
  a = check_array(OP, name, a, floating=floating)
  if not floating and a.dtype != jnp.bool_:
    raise TypeError(f"{OP}: {name} must be boolean (True = keep), got {describe(a)}")
  try:
    ok = a.ndim <= 4 and np.broadcast_shapes(a.shape, shape) == shape
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(f"{OP}: {name} {describe(a)} does not broadcast to (B, N, T, S) = {shape}")
  return a.reshape((1,) * (4 - a.ndim) + a.shape)


def _triton_unsupported(call):
  if call.has_bias or call.has_mask:
    return "bias and mask arrays are not supported; use 'xla' or 'cudnn'"
  if call.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
    return f"dtype {call.dtype} is not supported (float16, bfloat16, float32)"
  if call.precision is not None and _tf32(call.precision) is _UNSUPPORTED:
    return f"precision {call.precision!r} is not supported (DEFAULT, HIGH, HIGHEST)"
  return None


# jax.nn's cuDNN attention computes dq wrongly from element 2^31 of q on (the rows past it
# are far off, where 'triton' is within bf16 rounding).
_CUDNN_MAX_ELEMENTS = 2**31


def _cudnn_unsupported(call, arrays):
  spec = call.spec
  for present, name in ((spec.causal_offset != 0, "causal_offset"),
                        (call.has_segments, "segment_ids"),
                        (spec.soft_cap is not None, "logits_soft_cap"),
                        (call.return_lse, "return_lse"),
                        (call.precision is not None, "precision")):
    if present:
      return f"jax.nn.dot_product_attention(implementation='cudnn') has no {name}"
  if call.dtype not in (jnp.float16, jnp.bfloat16):
    return f"cuDNN attention needs float16 or bfloat16, got {call.dtype}"
  largest = max(math.prod(a.shape) for a in arrays[:3])
  if largest >= _CUDNN_MAX_ELEMENTS:
    return (f"cuDNN attention's gradients are wrong for query, key or value of 2^31 elements "
            f"or more (measured on an H100, jax 0.11.2: tests/test_large.py); the largest has "
            f"{largest}")
  shapes = tuple(None if a is None else (a.shape, jnp.dtype(a.dtype)) for a in arrays)
  return _cudnn_rejects(call, shapes)


def _cudnn_call(q, k, v, bias, mask, q_len, kv_len, call):
  q, k, v, bias, mask, q_len, kv_len = jax.tree.map(
      mapped_axis_first, (q, k, v, bias, mask, q_len, kv_len))
  out = jax.nn.dot_product_attention(
      q, k, v, bias=bias, mask=mask, scale=call.scale, is_causal=call.spec.is_causal,
      query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
      local_window_size=call.spec.window, implementation="cudnn")
  return mapped_axis_first(out)


@functools.lru_cache(maxsize=256)
def _cudnn_rejects(call, shapes):
  """jax.nn's cuDNN path checks sequence lengths, head dims and layouts as it traces, by rules
  that change with the cuDNN and JAX versions: trace it (forward for training, and backward)
  on abstract inputs and report what it refuses."""
  args = [None if s is None else jax.ShapeDtypeStruct(*s) for s in shapes]

  def step(q, k, v, bias, mask, q_len, kv_len):
    out, vjp = jax.vjp(lambda q, k, v: _cudnn_call(q, k, v, bias, mask, q_len, kv_len, call),
                       q, k, v)
    return vjp(out)

  try:
    jax.eval_shape(step, *args)
  except Exception as e:  # noqa: BLE001  (cuDNN missing or too old raises RuntimeError)
    return (f"jax.nn.dot_product_attention(implementation='cudnn') refuses these shapes: "
            f"{type(e).__name__}: {e}")
  return None


_UNSUPPORTED = object()


def _tf32(precision):
  """allow_tf32 for the kernel's float32 products (None: the default, which may use TF32)."""
  if precision is None:
    return None
  names = {jax.lax.Precision.DEFAULT: None, jax.lax.Precision.HIGH: None,
           jax.lax.Precision.HIGHEST: False}
  if isinstance(precision, str):
    try:
      precision = jax.lax.Precision(precision)
    except (ValueError, KeyError):
      return _UNSUPPORTED
  return names.get(precision, _UNSUPPORTED)


def _mosaic_unsupported(call, arrays):
  if call.has_bias or call.has_mask:
    return "bias and mask arrays are not supported; use 'xla' or 'cudnn'"
  if call.precision is not None and _tf32(call.precision) is _UNSUPPORTED:
    return f"precision {call.precision!r} is not supported (DEFAULT, HIGH, HIGHEST)"
  q, k, v = arrays[:3]
  return mosaic.unsupported(q.shape, k.shape, v.shape, call.dtype, spec=call.spec,
                            has_segments=call.has_segments, has_q_len=call.has_q_len,
                            has_kv_len=call.has_kv_len)


def _untuned() -> dict:
  # A GPU never measured: cuDNN first everywhere it applies, whatever the grid's size.
  return {"mosaic_before_cudnn_forward": {}, "mosaic_before_cudnn_step": {},
          "mosaic_least_tiles_forward": 0, "mosaic_least_tiles_step": 0,
          "triton_most_tiles_forward": 0, "triton_most_tiles_step": 0}


# Queries per work tile: the unit in which a call's grid is counted against the GPU's SMs.
TILE_QUERIES = 128


def work_tiles(batch: int, queries: int, heads: int) -> int:
  """Tiles of :data:`TILE_QUERIES` queries of one head: a call's parallel work."""
  return batch * heads * -(-queries // TILE_QUERIES)


def _first_by_table(call, arrays, use: str) -> str:
  """The implementation None tries first for this call, ``use`` "forward" (only evaluated) or
  "step" (differentiated), by this GPU's tuned table (``jaxfuse/ops/attention/tuned/``):
  'triton' for grids of up to ``triton_most_tiles_<use>`` work tiles; 'mosaic' from
  ``mosaic_least_tiles_<use>`` tiles up to the most queries at which Mosaic measured faster
  (per mask and head dim, ``mosaic_before_cudnn_<use>``); else cuDNN. A small grid leaves SMs
  idle, and the kernels with smaller tiles or several CTAs per head fill more of them."""
  table = tuned.rows("attention", _untuned)
  q, _, v = arrays[:3]
  tiles = work_tiles(q.shape[0], q.shape[1], q.shape[2])
  if tiles <= table[f"triton_most_tiles_{use}"]:
    return "triton"
  rules = table[f"mosaic_before_cudnn_{use}"]
  most = rules.get(f"{'causal' if call.spec.is_causal else 'full'}/{max(q.shape[3], v.shape[3])}")
  if most is not None and q.shape[1] <= most and tiles >= table[f"mosaic_least_tiles_{use}"]:
    return "mosaic"
  return "cudnn"


def _resolve(implementation, call, arrays, empty=False) -> op.Plan:
  """The call's plan: a named implementation runs every use; None may find one fastest when
  only evaluated and another when differentiated (forward and backward alike). ``empty``: no
  output elements (see :func:`op.resolve_plan`)."""
  checks = {"triton": _triton_unsupported,
            "cudnn": functools.partial(_cudnn_unsupported, arrays=arrays),
            "mosaic": functools.partial(_mosaic_unsupported, arrays=arrays)}

  def available(name):
    def check():
      reason = _BACKENDS[name]()
      return reason if reason is not None or name not in checks else checks[name](call)
    return check

  backends = {name: available(name) for name in _BACKENDS}
  # cuDNN is the fastest where it applies (but for the tuned table's calls), then the Mosaic
  # kernels, then the Triton kernels.
  def preference(use):
    if registry.platform() == "cpu":
      return ("xla",)
    first = _first_by_table(call, arrays, use)
    return (first,) + tuple(n for n in ("cudnn", "mosaic", "triton", "xla") if n != first)

  def fastest(use):
    return registry.resolve(OP, None, backends, preference(op.timed_as(use)))

  return op.resolve_plan(OP, implementation, backends, preference("step"), fastest,
                         empty=empty)


@functools.partial(jax.jit, static_argnums=(9, 10))
def _attention_jit(q, k, v, bias, mask, q_seg, kv_seg, q_len, kv_len, plan, call):
  if plan.evaluated == plan.forward != "cudnn":
    return _implementation(plan.forward, q, k, v, bias, mask, q_seg, kv_seg, q_len, kv_len,
                           call)
  # cuDNN's and 'mosaic''s plans: no segments and no lse (cuDNN takes none), no bias or mask
  # where Mosaic runs (it takes none). cuDNN's derivatives, JAX's own, go through the op layer
  # too, which refuses by name to differentiate its backward again.
  return _by_use(call, plan, q, k, v, bias, mask, q_len, kv_len), None


def _implementation(impl, q, k, v, bias, mask, q_seg, kv_seg, q_len, kv_len, call):
  if impl == "xla":
    return reference.attention(q, k, v, bias, mask, (q_seg, kv_seg), (q_len, kv_len),
                               scale=call.scale, spec=call.spec, precision=call.precision)
  if impl == "cudnn":
    return _cudnn_call(q, k, v, bias, mask, q_len, kv_len, call), None
  return _flash(q, k, v, (q_seg, kv_seg, q_len, kv_len), (impl, call))


def _without_segments(call, impl, q, k, v, bias, mask, q_len, kv_len):
  return _implementation(impl, q, k, v, bias, mask, None, None, q_len, kv_len, call)[0]


# The output of plan.evaluated, differentiated as plan.forward: the fastest for inference and
# for training where those differ. Gradients flow to q, k, v and bias.
_by_use = op.by_use(_without_segments, static=1, differentiated=4)


# ``kernel`` is (implementation, call): 'triton' or 'mosaic' and the static configuration.
def _flash(q, k, v, extras, kernel):
  return _flash_fwd(q, k, v, extras, kernel)[0]


def _flash_fwd(q, k, v, extras, kernel):
  out, lse = _kernels(*kernel)[0](q, k, v, extras)
  return (out, lse), (q, k, v, extras, out, lse)


def _flash_bwd(kernel, residuals, cotangents):
  q, k, v, extras, out, lse = residuals
  do, dlse = cotangents
  dlse = jnp.zeros_like(lse) if dlse is None else dlse
  dq, dk, dv = _kernels(*kernel)[1](q, k, v, extras, do, lse, out, dlse)
  return dq, dk, dv, jax.tree.map(lambda _: None, extras)


_flash = op.differentiable(_flash, _flash_fwd, _flash_bwd, static=(4,))


@functools.cache
def _kernels(impl, call):
  """Forward and backward kernel calls for one static configuration, vmappable."""
  return tuple(fold_into_batch(functools.partial(_sharded, impl, call, direction))
               for direction in ("forward", "backward"))


def _sharded(impl, call, direction, q, k, v, extras, *grads):
  """The kernels under any sharding of batch and heads (T, S and head dims stay whole)."""
  present = [e for e in extras if e is not None]
  kind = ["qs", "ks", "len", "len"]
  b, t, n, _ = q.shape
  kv_heads = k.shape[2]
  g = n // kv_heads
  # Query heads are (K, G): a head sharding then splits key/value heads consistently.
  dims = {"q": ("b", "t", "k", "g", "h"), "kv": ("b", "s", "k", "hk"),
          "v": ("b", "s", "k", "hv"), "qs": ("b", "t"), "ks": ("b", "s"), "len": ("b",),
          "do": ("b", "t", "k", "g", "hv"), "stat": ("b", "k", "g", "t")}
  extra_dims = [dims[kd] for kd, e in zip(kind, extras) if e is not None]

  def split(a, kv_heads=kv_heads):
    return a.reshape(a.shape[:2] + (kv_heads, -1) + a.shape[3:])

  def split_stat(a):
    return a.reshape(b, kv_heads, g, t)

  def unsplit(a):
    return a.reshape(a.shape[:2] + (a.shape[2] * a.shape[3],) + a.shape[4:])

  def rebuild(rest):
    rest = list(rest)
    return tuple(rest.pop(0) if e is not None else None for e in extras)

  tf32 = _tf32(call.precision)
  kw = dict(spec=call.spec, scale=call.scale, allow_tf32=tf32)
  if direction == "forward":
    def local(q, k, v, *rest):
      out, lse = _FLASH[impl].forward(unsplit(q), k, v, rebuild(rest), **kw)
      return split(out, k.shape[2]), lse.reshape(lse.shape[0], k.shape[2], -1, lse.shape[-1])

    out, lse = parallel_call(OP, local, split(q), k, v, *present,
                             in_dims=[dims["q"], dims["kv"], dims["v"]] + extra_dims,
                             out_dims=[dims["do"], dims["stat"]], parallel={"b", "k", "g"})
    return unsplit(out), lse.reshape(b, n, t)

  do, lse, out, dlse = grads

  def local(q, k, v, do, lse, out, dlse, *rest):
    merge = lambda a: a.reshape(a.shape[0], -1, a.shape[-1])
    dq, dk, dv = _FLASH[impl].backward(unsplit(q), k, v, unsplit(do), merge(lse), unsplit(out),
                                       merge(dlse), rebuild(rest), **kw)
    return split(dq, k.shape[2]), dk, dv

  dq, dk, dv = parallel_call(
      OP, local, split(q), k, v, split(do), split_stat(lse), split(out), split_stat(dlse),
      *present, in_dims=[dims["q"], dims["kv"], dims["v"], dims["do"], dims["stat"], dims["do"],
                         dims["stat"]] + extra_dims,
      out_dims=[dims["q"], dims["kv"], dims["v"]], parallel={"b", "k", "g"})
  return unsplit(dq), dk, dv
