"""Bench cases for ``attention``: TFLOP/s of the forward and of the training step.

FLOPs: ``4 * B * T * S * N * H`` for the two matrix products of the forward (halved when
causal, T == S); the training step counts 3.5 times that (the forward's two products plus the
backward's five).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxfuse._core import registry, tune
from jaxfuse._core.bench import DEFAULT, Case, implementation_arg
from jaxfuse.ops.attention import reference
from jaxfuse.ops.attention.api import attention, work_tiles

GPU_SHAPES = [(4, 4096, 16, 128), (1, 16384, 16, 128), (8, 2048, 16, 64), (2, 8192, 8, 256)]


def _inputs(key, b, t, n, h, dtype):
  kq, kk, kv, kd = jax.random.split(key, 4)
  shape = (b, t, n, h)
  return tuple(jax.random.normal(k_, shape, dtype) for k_ in (kq, kk, kv, kd))


def _forward(kw, impl):
  impl = implementation_arg(impl)
  return lambda q, k, v, do: attention(q, k, v, **kw, implementation=impl)


def _train(kw, impl):
  impl = implementation_arg(impl)

  def step(q, k, v, do):
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, **kw, implementation=impl), q, k, v)
    return (out,) + vjp(do)
  return step


def _mask_spec(kw):
  window = kw.get("local_window_size")
  return reference.MaskSpec(kw.get("is_causal", False), kw.get("causal_offset", 0),
                            None if window is None else tuple(window))


def _train_floors(kw, q, k, v, do):
  ids = kw.get("segment_ids")
  dq, dk = reference.gradient_floors(q, k, v, do, _mask_spec(kw), (ids, ids))
  return 0.0, dq, dk, 0.0


def _allowed_pairs(b, t, kw):
  """(query, key) pairs the masks keep, over the batch: the FLOPs that count are 4 H per pair
  per head."""
  ids = kw.get("segment_ids")
  keep = reference.allowed(_mask_spec(kw), jnp.arange(t), jnp.arange(t), ids, ids,
                           kw.get("query_seq_lengths"), kw.get("key_value_seq_lengths"))
  return b * t * t if keep is None else int(keep.sum()) * (b // keep.shape[0])


# Masked calls at (4, 4096, 16, 128) or near it: rates count only the pairs the masks keep, to
# be read against cuDNN's plain causal (or full) rate in the same run. cuDNN refuses all but
# the ragged batch (rows of 4096, 3072, 2048 and 1024 tokens, padding past them).
MASKED = [("4 documents causal", 4096, dict(is_causal=True), 4, False),
          ("causal offset 512", 4096, dict(is_causal=True, causal_offset=512), None, False),
          ("window (256, 256)", 4096, dict(local_window_size=(256, 256)), None, False),
          ("full", 4000, {}, None, False), ("causal", 4000, dict(is_causal=True), None, False),
          ("ragged causal", 4096, dict(is_causal=True), None, True)]


def masked_kwargs(b, t, kw, documents, ragged):
  """``attention``'s keyword arguments for a ``MASKED`` entry at batch ``b``: ``documents``
  equal segments per row, or ragged rows of t, 3t/4, ... tokens."""
  if documents:
    ids = jnp.repeat(jnp.arange(documents, dtype=jnp.int32), t // documents)
    kw = dict(kw, segment_ids=jnp.broadcast_to(ids, (b, t)))
  if ragged:
    lengths = t - jnp.arange(b, dtype=jnp.int32) * (t // b)
    kw = dict(kw, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
  return kw


def _case(label, b, t, n, h, kw, flops, impls, check_only=()):
  return Case(
      op="attention", label=label, size=t,
      make_inputs=functools.partial(_inputs, b=b, t=t, n=n, h=h, dtype=jnp.bfloat16),
      forward=functools.partial(_forward, kw), train=functools.partial(_train, kw),
      forward_work=flops, train_work=3.5 * flops, implementations=impls, unit="TFLOP/s",
      check_only=check_only, reduction_length=max(b * t, t * h),
      train_floors=functools.partial(_train_floors, kw))


def _plain_case(b, t, n, h, causal, impls, check_only=()):
  return _case(f"{b}x{t}x{n}x{h} {'causal' if causal else 'full'}", b, t, n, h,
               dict(is_causal=causal), 4 * b * t * t * n * h / (2 if causal else 1), impls,
               check_only)


def cases(quick: bool = False) -> list[Case]:
  gpu = registry.platform() == "gpu"
  if gpu:
    shapes = GPU_SHAPES[:1] if quick else GPU_SHAPES
    check_only = ()
  else:
    shapes, check_only = [(1, 256, 2, 64)], ("triton",)
  out = []
  for b, t, n, h in shapes:
    for causal in (True,) if quick else (False, True):
      impls = ("cudnn", "triton", "mosaic", DEFAULT) if gpu else ("xla", DEFAULT)
      if gpu and t <= 2048:
        impls = ("xla",) + impls
      out.append(_plain_case(b, t, n, h, causal, impls, check_only))
  if gpu and not quick:
    b, n, h = 4, 16, 128
    for name, t, kw, documents, ragged in MASKED:
      kw = masked_kwargs(b, t, kw, documents, ragged)
      out.append(_case(f"{b}x{t}x{n}x{h} {name}", b, t, n, h, kw,
                       4 * _allowed_pairs(b, t, kw) * n * h,
                       ("cudnn", "triton", "mosaic", DEFAULT)))
  return out


# (batch, queries, heads, head dim, causal) off the tuned shapes: short and long rows, small
# and large batches, every head dim the kernels take, each side of the tuned query limits.
REGRET_GRID = [
    (1, 1024, 8, 64, False), (2, 2048, 12, 64, True), (16, 512, 16, 128, False),
    (8, 1024, 32, 128, True), (2, 3072, 16, 128, False), (1, 8192, 16, 128, True),
    (2, 8192, 16, 128, False), (4, 4096, 8, 256, True), (1, 16384, 8, 64, False),
    (2, 6144, 16, 64, True),
]


def regret_cases() -> list[Case]:
  """``None`` against every implementation over :data:`REGRET_GRID` (one checked case on the
  CPU)."""
  if registry.platform() != "gpu":
    return [_plain_case(1, 256, 2, 64, True, ("xla", DEFAULT))]
  return [_plain_case(b, t, n, h, causal,
                      (("xla",) if t <= 2048 else ()) + ("cudnn", "triton", "mosaic", DEFAULT))
          for b, t, n, h, causal in REGRET_GRID]


# The tuning grid: for each head dim (with its head count) and mask, query counts across the
# tables' limits, the batch keeping 16384 tokens so that every point does as much work per query.
TUNE_HEAD_DIMS = {64: 16, 128: 16, 256: 8}
TUNE_QUERIES = (512, 1024, 2048, 3072, 4096, 6144, 8192, 16384)


# Small grids, (batch, queries, heads) per head dim and mask: from a fraction of the SMs'
# worth of work tiles to a few waves, under the three kernels.
TUNE_SMALL_GRIDS = ((1, 512, 8), (1, 1024, 8), (1, 2048, 8), (2, 2048, 16))
TUNE_TOKENS = 16384


def tune_cases() -> list[Case]:
  """cuDNN and 'mosaic' over :data:`TUNE_QUERIES` per head dim and mask, and
  :data:`TUNE_SMALL_GRIDS` of head dims 64 and 128 under Triton too."""
  return ([_plain_case(max(1, TUNE_TOKENS // t), t, n, h, causal, ("cudnn", "mosaic"))
           for h, n in TUNE_HEAD_DIMS.items() for causal in (True, False) for t in TUNE_QUERIES]
          + [_plain_case(b, t, n, h, causal, ("cudnn", "mosaic", "triton"))
             for h in (64, 128) for causal in (True, False) for b, t, n in TUNE_SMALL_GRIDS])


def _shape(label: str) -> tuple[int, ...]:
  """``(batch, queries, heads, head dim)`` of a plain case's label."""
  return tuple(int(d) for d in label.split()[0].split("x"))


def _table_key(label: str) -> str:
  """A plain case's tuned-table key: ``'4x4096x16x128 causal'`` -> ``'causal/128'``."""
  return f"{label.split()[1]}/{_shape(label)[3]}"


def _by_tiles(rows, use: str, first: str, others: tuple[str, ...]):
  """``(work tiles, first's time, the fastest of others' time)`` per case, by tiles."""
  return sorted((work_tiles(*_shape(row.label)[:3]), mine, theirs)
                for row, mine, theirs in tune.times_by_case(rows, use, first, others))


def tuned_rows(rows) -> dict:
  """Per mask and head dim and per use, the most queries up to which 'mosaic' goes before
  cuDNN at the least regret on grids of :data:`TUNE_TOKENS` tokens (no key: cuDNN first);
  per use, from :data:`TUNE_SMALL_GRIDS`, the fewest work tiles from which it does and the
  most up to which 'triton' goes before both (0: no bound), each bound at the geometric mean
  between the grids measured either side, so a call takes the nearest grid's choice. Each only
  where the run timed its grid."""
  out = {}
  tokens = lambda item: _shape(item.label)[0] * _shape(item.label)[1]
  full = [r for r in rows if tokens(r) >= TUNE_TOKENS]
  if full:
    for use in ("forward", "step"):
      out[f"mosaic_before_cudnn_{use}"] = {}
    for key in sorted({_table_key(r.label) for r in full}):
      group = [r for r in full if _table_key(r.label) == key]
      for use in ("forward", "step"):
        most = tune.least_regret_prefix(tune.times_by_size(group, use, "mosaic", "cudnn"))
        if most is not None:
          out[f"mosaic_before_cudnn_{use}"][key] = most
  small = [r for r in rows if tokens(r) < TUNE_TOKENS]
  for use in ("forward", "step"):
    points = _by_tiles(small, use, "mosaic", ("cudnn",))
    if points:
      least = tune.least_regret_suffix(points)
      below = max((tiles for tiles, _, _ in points if tiles < (least or math.inf)), default=None)
      # Mosaic losing on every small grid: from past the largest (the full grids say where it
      # wins); winning from the fewest tiles run: no bound.
      out[f"mosaic_least_tiles_{use}"] = (points[-1][0] + 1 if least is None else 0
                                          if below is None else tune.geometric_ceil(below, least))
    points = _by_tiles(small, use, "triton", ("cudnn", "mosaic"))
    if points:
      most = tune.least_regret_prefix(points)
      above = min((tiles for tiles, _, _ in points if tiles > (most or math.inf)), default=None)
      out[f"triton_most_tiles_{use}"] = (0 if most is None else most if above is None
                                         else tune.geometric_floor(most, above))
  return out
