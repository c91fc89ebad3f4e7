"""Persistent LSTM and GRU recurrences in CUDA (``rnn.cu``), through XLA's FFI.

One call runs every time step of one layer (both directions of a bidirectional layer). The
caller projects the inputs of all steps beforehand (``xp = x W_ih^T + b``, one XLA matmul); the
kernel keeps its share of ``W_hh`` in shared memory for the whole walk and meets the other CTAs
once per step at a grid barrier. :func:`plan` decides how a layer is spread over the GPU.

Calling convention (D directions, G gates, B batch, S steps, H hidden):

* forward ``(xp (B, S, D, G*H) f32, w_hh (D, G*H, H), b_hn (D, H) f32, h0 (D, B, H) f32,
  c0 (D, B, H) f32, lengths (B,) i32) -> y (B, S, D, H), h_n, c_n (D, B, H) f32`` and, when
  saving for the backward, ``gates (B, S, D, 4H)`` and ``states (B, S, D, H)`` (f32);
* backward ``(dy, dh_n, dc_n, gates, states, h0, c0, w_hh, lengths) -> dxp (B, S, D, G*H),
  dhn (B, S, D, H) (GRU), dh0, dc0 (D, B, H)``, all f32.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._core import cuda
from jaxfuse.ops.rnn.weights import GATES

_SOURCE = Path(__file__).with_name("rnn.cu")
_HANDLERS = {"jaxfuse_rnn_forward": "JaxfuseRnnForward",
             "jaxfuse_rnn_backward": "JaxfuseRnnBackward"}
_SUPPORTED = tuple(map(jnp.dtype, (jnp.float16, jnp.bfloat16, jnp.float32)))
# Tuned and tested on Hopper only.
LIBRARY = cuda.Library(_SOURCE, _HANDLERS, min_arch=90)

# rnn.cu's constants: warps per CTA (16 rather than 8: faster training steps in most cases
# measured, benchmarks/results/), the most weight columns a CTA holds, the most (batch row,
# unit) items a chunk updates (one a thread), the words after each staged row and the most
# staging buffers.
_WARPS = 16
_MAX_COLUMNS = 64
_MAX_ITEMS = 32 * _WARPS
_PAD = 4
_MAX_STAGES = 4
# Staging buffers when K does not fit in flight at once: 2, which ran the backward faster than
# 3 or 4 (measured: benchmarks/results/).
_CYCLED_STAGES = 2
# Batch rows staged at once (a multiple of 16): beyond one chunk a step stages h again per chunk.
MAX_BATCH_CHUNK = 64


def unavailable() -> str | None:
  """Why these kernels cannot run here (no Hopper GPU, no nvcc, a failed build), or None."""
  return LIBRARY.unavailable()


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one pass (forward or backward) of a layer is spread over the GPU (rnn.cu ``Shape``).

  The batch is split into ``groups`` of ``group_rows`` rows, independent recurrences; per
  (direction, group) ``ctas`` CTAs own ``units`` hidden units each. The directions run in one
  launch when ``concurrent``, else one after the other. A CTA's warps split the weight columns
  ``n_split`` ways and K the rest. ``batch_chunk`` rows and ``chunk_words`` 32-bit words of the
  previous step's h (or gate gradients) are staged at once, through ``stages`` buffers.
  """
  ctas: int
  units: int
  groups: int
  group_rows: int
  n_split: int
  batch_chunk: int
  chunk_words: int
  stages: int
  concurrent: bool

  def attributes(self) -> dict:
    return {name: np.int64(value) for name, value in dataclasses.asdict(self).items()}


@functools.cache
def _device() -> tuple[int, int]:
  """(SMs, the shared memory a CTA may opt into) of the current GPU."""
  library = LIBRARY.load()
  library.jaxfuse_rnn_device.argtypes = [ctypes.POINTER(ctypes.c_int)] * 2
  sms, shared = ctypes.c_int(0), ctypes.c_int(0)
  if not library.jaxfuse_rnn_device(ctypes.byref(sms), ctypes.byref(shared)):
    raise NotImplementedError("the 'cuda' RNN kernels cannot query this GPU")
  return sms.value, shared.value


def _per_word(dtype) -> int:
  return 4 // jnp.dtype(dtype).itemsize


def padded_inner(inner: int, dtype) -> int:
  """The exchange rows' length: K rounded up to whole mma k-tiles (8 words)."""
  tile = 8 * _per_word(dtype)
  return -(-inner // tile) * tile


def _shared_bytes(columns, k_tiles, batch_chunk, chunk_words, stages, n_split) -> int:
  n_tiles = -(-columns // 8)
  return (n_tiles * k_tiles * 32 * 8 + stages * batch_chunk * (chunk_words + _PAD) * 4
          + _WARPS // n_split * batch_chunk * (n_tiles * 8 + _PAD) * 4)


def _staging(columns, k_tiles, row_words, batch_chunk, n_split, shared, cycled):
  """(chunk_words, stages) staging a row of K through as few refills as fit, or None when the
  chunks of more than 16 rows would be shorter than 64 words (fewer rows at once do better).

  Every buffer is filled ahead: K in `stages` chunks is all in flight at once; beyond that the
  buffers cycle."""
  fits = lambda words, stages: _shared_bytes(columns, k_tiles, batch_chunk, words, stages,
                                             n_split) <= shared
  for stages in range(1, _MAX_STAGES + 1):
    words = -(-row_words // (8 * stages)) * 8
    if fits(words, stages):
      return words, stages
  words, least = row_words // 8 * 8, 64 if batch_chunk > 16 else 8
  while words > least and not fits(words, cycled):
    words -= 8
  return (words, cycled) if fits(words, cycled) else None


def _try_plan(gates, direction_pass, batch, hidden, directions, dtype, sms, shared,
              concurrent=(True, False), group_rows=None, cycled=_CYCLED_STAGES):
  """The plan that stages the fewest words of K per CTA and time step (both directions
  counted when they run one after the other), then refills the staging the fewest times, then
  splits the batch least; or None.

  An SM takes in only so many bytes a step from L2, so splitting the batch into groups (each
  CTA owning more units of fewer rows) shortens the step while the weights fit
  (benchmarks/results/2026-11-23-h100-tune-rnn-groups.json). `concurrent` and `group_rows`
  restrict the choice."""
  forward = direction_pass == "forward"
  inner = hidden if forward else gates * hidden
  row_words = padded_inner(inner, dtype) // _per_word(dtype)
  k_tiles = row_words // 8
  m_tiles = -(-batch // 16)
  options = ({16 * -(-m_tiles // g) for g in range(1, m_tiles + 1)} if group_rows is None
             else {group_rows})
  if directions == 1:
    concurrent = (True,)
  best = None
  for together, rows in itertools.product(concurrent, sorted(options, reverse=True)):
    ctas_allowed = sms // directions if together else sms
    launches = 1 if together else directions
    groups = -(-batch // rows)
    per_group = ctas_allowed // groups
    if per_group == 0:
      continue
    # The fewest units per CTA that spread the layer over the group's SMs; the backward fills
    # whole 8-column tiles (a CTA of 4 units does the products of 8), the forward at least one.
    least = 8 if not forward else -(-8 // gates)
    units = max(least, -(-hidden // per_group))
    columns = gates * units if forward else units
    if columns > _MAX_COLUMNS:
      continue
    n_tiles = -(-columns // 8)
    # Warps split N as far as leaves each two n-tiles (an A fragment feeds two products): fewer
    # K groups, so smaller partial sums to add.
    n_split = 1 << max(0, (n_tiles // 2).bit_length() - 1)
    batch_chunk, staging = min(MAX_BATCH_CHUNK, rows), None
    while batch_chunk >= 16 and staging is None:
      if batch_chunk * units <= _MAX_ITEMS:
        staging = _staging(columns, k_tiles, row_words, batch_chunk, n_split, shared, cycled)
      if staging is None:
        batch_chunk -= 16
    if staging is None:
      continue
    chunk_words, stages = staging
    chunks = -(-row_words // chunk_words)
    refills = -(-rows // batch_chunk) * -(-chunks // stages)
    cost = (launches * rows * row_words, launches * refills, groups)
    if best is None or cost < best[0]:
      best = cost, Plan(-(-hidden // units), units, groups, rows, n_split, batch_chunk,
                        chunk_words, stages, together)
  return best and best[1]


@functools.cache
def plan(cell: str, direction_pass: str, batch: int, hidden: int, directions: int,
         dtype) -> Plan | None:
  """The launch of one pass of a layer, or None when its weights do not fit on chip.

  Within a batch group, as many CTAs as the SMs allow, each owning the fewest units: fewer,
  wider CTAs were slower in every case measured on the H100, forward and backward
  (benchmarks/results/2026-11-23-h100-tune-rnn-16-warps.json). The batch split: _try_plan."""
  return _try_plan(GATES[cell], direction_pass, batch, hidden, directions, jnp.dtype(dtype),
                   *_device())


def unsupported(cell: str, batch: int, hidden: int, directions: int, dtype) -> str | None:
  """Why the kernels cannot run this layer, or None."""
  if jnp.dtype(dtype) not in _SUPPORTED:
    return f"the 'cuda' RNN kernels take float16, bfloat16 and float32, not {jnp.dtype(dtype)}"
  for direction_pass in ("forward", "backward"):
    if plan(cell, direction_pass, batch, hidden, directions, dtype) is None:
      gates = GATES[cell]
      mib = gates * hidden * hidden * jnp.dtype(dtype).itemsize / 2**20
      return (f"the 'cuda' {cell.upper()} keeps W_hh ({gates} * {hidden} x {hidden}, {mib:.1f} "
              f"MiB a direction in {jnp.dtype(dtype).name}) in shared memory spread over the "
              f"SMs; it does not fit on this GPU")
  return None


def _scratch(directions, batch, inner, dtype, p: Plan):
  """The exchange buffers and barrier counters a launch works in (outputs XLA then drops)."""
  return (jax.ShapeDtypeStruct((2, directions, batch, padded_inner(inner, dtype)), dtype),
          jax.ShapeDtypeStruct((directions * p.groups,), jnp.uint32))


def forward(cell, xp, w_hh, b_hn, h0, c0, lengths, *, exact: bool, save: bool,
            launch: Plan | None = None):
  batch, steps, directions, _ = xp.shape
  hidden = w_hh.shape[2]
  p = launch or plan(cell, "forward", batch, hidden, directions, w_hh.dtype)
  f32 = jnp.float32
  state = jax.ShapeDtypeStruct((directions, batch, hidden), f32)
  sequence = (batch, steps, directions)
  reserve = [sequence + (4 * hidden,), sequence + (hidden,)] if save else [(1,), (1,)]
  outputs = (jax.ShapeDtypeStruct(sequence + (hidden,), w_hh.dtype), state, state,
             *(jax.ShapeDtypeStruct(shape, f32) for shape in reserve),
             *_scratch(directions, batch, hidden, w_hh.dtype, p))
  y, h_n, c_n, gates, states, _, _ = jax.ffi.ffi_call("jaxfuse_rnn_forward", outputs)(
      xp, w_hh, b_hn, h0, c0, lengths, gate_count=np.int64(GATES[cell]),
      exact=np.int64(exact), save=np.int64(save), **p.attributes())
  return (y, h_n, c_n, gates, states) if save else (y, h_n, c_n)


def backward(cell, dy, dh_n, dc_n, gates, states, h0, c0, w_hh, lengths, *, exact: bool,
             launch: Plan | None = None):
  batch, steps, directions, hidden = dy.shape
  g = GATES[cell]
  p = launch or plan(cell, "backward", batch, hidden, directions, w_hh.dtype)
  f32 = jnp.float32
  state = jax.ShapeDtypeStruct((directions, batch, hidden), f32)
  sequence = (batch, steps, directions)
  dhn_shape = sequence + (hidden,) if cell == "gru" else (1,)
  outputs = (jax.ShapeDtypeStruct(sequence + (g * hidden,), f32),
             jax.ShapeDtypeStruct(dhn_shape, f32), state, state,
             *_scratch(directions, batch, g * hidden, w_hh.dtype, p))
  dxp, dhn, dh0, dc0, _, _ = jax.ffi.ffi_call("jaxfuse_rnn_backward", outputs)(
      dy, dh_n, dc_n, gates, states, h0, c0, w_hh, lengths, gate_count=np.int64(g),
      exact=np.int64(exact), **p.attributes())
  return dxp, (dhn if cell == "gru" else None), dh0, dc0


# The H100's SMs and opt-in shared memory a CTA: the limits the docs quote.
_H100 = (132, 227 * 1024)


def _largest_hidden(cell, dtype, directions) -> int:
  fits = lambda h: all(_try_plan(GATES[cell], p, 64, h, directions, jnp.dtype(dtype), *_H100)
                       for p in ("forward", "backward"))
  low, high = 1, 1 << 14
  while low < high:
    mid = (low + high + 1) // 2
    low, high = (mid, high) if fits(mid) else (low, mid - 1)
  return low


def limits() -> str:
  """The layers the kernels take, in words (docstrings and README; a test keeps them equal)."""
  return (f"W_hh of a direction held in shared memory over the SMs: on an H100 an LSTM of "
          f"hidden size up to {_largest_hidden('lstm', jnp.bfloat16, 1)} in 16-bit types or "
          f"{_largest_hidden('lstm', jnp.float32, 1)} in float32, a GRU up to "
          f"{_largest_hidden('gru', jnp.bfloat16, 1)} or {_largest_hidden('gru', jnp.float32, 1)}")
