"""The bench harness behind ``jaxfuse bench``: timing and checks (what it prints and saves is
:mod:`jaxfuse._core.report`'s, the ceilings it quotes rates against
:mod:`jaxfuse._core.ceilings`').

Each op family supplies :class:`Case` objects. For each case and implementation the harness
compiles the forward and the training step (output and every gradient) once, checks those
programs' outputs against float64 references (sampled rows of large outputs, bounds from the
dtype's rounding and the reduction's length), then times the same programs. Calls run one at a
time, back to back, cycling through input sets so that none reads what the last left in L2;
on a GPU each call's time is its span in a profiler trace, from its first kernel's start to
its last kernel's end, for JAX's rows and PyTorch's alike (see :func:`measure`), with its busy
time beside it. Rates are quoted against ceilings measured in the same run: the best of
several device-to-device copies for memory-bound ops (only for problems past the L2) and a
bf16 matrix product for compute-bound ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import glob
import math
import os
import platform as host_platform
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._core import device, registry
from jaxfuse._core.cuda.build import ARCH_VARIABLE
from jaxfuse._core.progress import Progress
from jaxfuse._core.testing import relative_error, x64


@dataclasses.dataclass
class Case:
  """One benchmarked problem.

  ``forward(impl)`` and ``train(impl)`` return functions of the inputs; ``train`` returns the
  output and all gradients (a training step). ``*_work`` is the minimal bytes moved (unit GB/s)
  or FLOPs done (unit TFLOP/s) per call.
  """
  op: str
  label: str
  size: int
  make_inputs: Callable[[jax.Array], tuple]
  forward: Callable[[str], Callable]
  train: Callable[[str], Callable] | None
  forward_work: float
  train_work: float
  implementations: Sequence[str]
  unit: str = "GB/s"
  # Implementations checked for correctness but not timed (the Pallas interpreter on the CPU).
  check_only: Sequence[str] = ()
  # Comparators outside JAX (PyTorch), each timing itself on the inputs with
  # :func:`time_torch`: ``fn(inputs) -> (forward Timing, train Timing[, train temp MiB])``.
  # Their outputs are not checked.
  external: Mapping[str, Callable[[tuple], tuple]] = dataclasses.field(
      default_factory=dict)
  # What a row of an implementation should say beside its numbers (how a comparator computes).
  notes: Mapping[str, str] = dataclasses.field(default_factory=dict)
  # Time steps a call walks (recurrent ops): the table adds microseconds per step.
  steps: int | None = None
  # Terms a reduction of the op sums (row length, keys, classes): float32 accumulation error
  # grows with it (see :func:`error_bound`).
  reduction_length: int = 1
  # Roundings to the output's dtype on the way to it (intermediates held in it count).
  roundings: int = 2
  # A relative error bound for every output, where the dtype's rounding does not bound it
  # (float32 computed through TF32).
  tolerance: float | None = None
  # ``train_floors(*inputs)`` on the float64 inputs: per output of ``train``, the
  # ``relative_error`` floor (a scalar or one per row), for gradients whose rows can cancel
  # to ~0 while the terms they sum are not small (causal attention's first queries).
  train_floors: Callable[..., tuple] | None = None


# The row of ``implementation=None``: what a user gets without choosing.
DEFAULT = "default"
# None as if Pallas's Triton backend were gone (registry.without_triton), beside None's row.
DEFAULT_WITHOUT_TRITON = "default-no-triton"


def implementation_arg(name: str) -> str | None:
  """The ``implementation=`` argument a bench row's name stands for."""
  return None if name in (DEFAULT, DEFAULT_WITHOUT_TRITON) else name


@dataclasses.dataclass
class Row:
  op: str
  label: str
  size: int
  implementation: str
  unit: str
  # Times are spans (see :class:`Timing`); busy and wall times and activities per call beside.
  forward_ms: float | None = None
  forward_rate: float | None = None
  train_ms: float | None = None
  train_rate: float | None = None
  forward_busy_ms: float | None = None
  train_busy_ms: float | None = None
  forward_wall_ms: float | None = None
  train_wall_ms: float | None = None
  forward_kernels: int | None = None
  train_kernels: int | None = None
  train_temp_mib: float | None = None
  # What the jaxfuse ops of each program ran ("triton+cuda": a Triton forward, a CUDA backward).
  forward_ran: str | None = None
  train_ran: str | None = None
  forward_error: float | None = None
  train_error: float | None = None
  ceiling_name: str = ""
  # XLA's copy of the case's first input, one call at a time: the copy rate at this size.
  size_copy_rate: float | None = None
  # The forward fits the cache (see L2_MULTIPLE): its rates are not quoted against the copy.
  cache_resident: bool = False
  forward_pct: float | None = None
  train_pct: float | None = None
  steps: int | None = None
  note: str = ""
  # Host seconds this row took to compile, to check and to time: where a sweep's time goes (a
  # comparator's all in time_s).
  compile_s: float | None = None
  check_s: float | None = None
  time_s: float | None = None


def _rate(work, ms, unit):
  if ms is None:
    return None
  return work / (ms * 1e-3) / (1e9 if unit == "GB/s" else 1e12)


def _block(tree):
  for leaf in jax.tree.leaves(tree):
    leaf.block_until_ready()


@dataclasses.dataclass(frozen=True)
class Timing:
  """Milliseconds of one call, each the median over groups of back-to-back calls.

  ``span_ms``: from the call's first kernel's start to its last kernel's end on the GPU, gaps
  inside the call included (what a user waits for); ``busy_ms``: the union of its kernels'
  intervals (``None`` where no trace is read); ``wall_ms``: the host clock over a group, per
  call. ``kernels``: GPU activities (kernels, copies) per call, the same in every group; 0
  where no trace is read."""
  span_ms: float
  busy_ms: float | None
  wall_ms: float
  kernels: int


class TimingError(RuntimeError):
  """A trace that cannot be split into calls, or whose times contradict each other."""


PROFILER = ("GPU span per call from a profiler trace (first kernel's start to last kernel's "
            "end), busy time beside it")
HOST_CLOCK = "host clock around back-to-back calls"
FORWARD_ONLY = "forward only"
NO_REFERENCE = "no float64 reference"


@functools.cache
def timing_method() -> str:
  """How calls are timed here: from a profiler trace on a GPU whose trace shows kernels."""
  if registry.platform() != "gpu":
    return HOST_CLOCK
  probe = jax.jit(lambda a: -a)
  a = jnp.ones((1 << 20,), jnp.float32)
  _block(probe(a))
  try:
    with tempfile.TemporaryDirectory() as log_dir:
      with jax.profiler.trace(log_dir):
        _block(probe(a))
      return PROFILER if _jax_trace_intervals(log_dir) else HOST_CLOCK
  except Exception:  # noqa: BLE001  (no CUPTI or no trace: the host clock still works)
    return HOST_CLOCK


def split_calls(intervals, calls: int) -> list[tuple[float, float]]:
  """(span, busy) of each of ``calls`` back-to-back calls from their GPU activities'
  ``(start, end)`` intervals, in any unit.

  The calls run one after another (each on one stream or several), so the sorted activities
  fall into ``calls`` runs of equal length that do not overlap; anything else means the trace
  cannot be split by call."""
  intervals = sorted(intervals)
  if not intervals or len(intervals) % calls:
    raise TimingError(f"{len(intervals)} GPU activities in a trace of {calls} calls: the calls "
                      f"did not each run the same number")
  per_call = len(intervals) // calls
  out, reached = [], -math.inf
  for c in range(calls):
    chunk = intervals[c * per_call:(c + 1) * per_call]
    if chunk[0][0] < reached:
      raise TimingError(f"call {c} starts before call {c - 1} ends: the calls overlap "
                        f"(several streams), so their activities cannot be told apart")
    end = max(e for _, e in chunk)
    out.append((end - chunk[0][0], _union(chunk)))
    reached = end
  return out


def _union(intervals) -> float:
  total, reached = 0.0, -math.inf
  for start, end in sorted(intervals):
    total += max(0.0, end - max(start, reached))
    reached = max(reached, end)
  return total


def _jax_trace_intervals(log_dir) -> list[tuple[int, int]]:
  """The GPU activities' ``(start, end)`` in a JAX trace, each stream's apart: an activity
  shown twice on a stream counts once, while two at the same times on two streams (a
  bidirectional RNN's directions, launched together, on a coarse GPU clock) or of two names
  on one count as the two they are."""
  intervals = []
  for path in glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True):
    for plane in jax.profiler.ProfileData.from_file(path).planes:
      if plane.name.startswith("/device:GPU"):
        for line in plane.lines:
          if line.name.startswith("Stream"):
            shown = {(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events}
            intervals += [(start, end) for start, end, _ in shown]
  return intervals


def _traced_groups(run_group, calls, groups):
  """Runs ``run_group()`` (``calls`` back-to-back calls and a wait for them, returning the
  host's seconds) ``groups`` times under one JAX profiler trace, which sees every kernel of
  the process, PyTorch's too (one trace, not one a group: starting and reading a trace costs
  more than a small problem's group). Per group: its calls' (span, busy) seconds, or None
  where the trace shows no activity; GPU activities per call; the host's seconds. The trace
  is split into ``calls * groups`` runs of equal activity counts (:func:`split_calls`), so a
  group whose calls ran other work than the rest breaks the split rather than hiding in it."""
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir):
      walls = [run_group() for _ in range(groups)]
    intervals = _jax_trace_intervals(log_dir)
  if not intervals:
    return [(None, None, wall) for wall in walls]
  per_call = [(span * 1e-9, busy * 1e-9)
              for span, busy in split_calls(intervals, calls * groups)]
  activities = len(intervals) // (calls * groups)
  return [(per_call[g * calls:(g + 1) * calls], activities, wall)
          for g, wall in enumerate(walls)]


def _jax_groups(call, calls, groups):
  out = _traced_groups(lambda: _host_group(call, calls, _block)[2], calls, groups)
  if out[0][0] is None:
    raise TimingError(f"the trace of {groups} groups of {calls} calls shows no GPU activity")
  return out


def _torch_groups(call, calls, groups):
  """PyTorch's calls on JAX's trace; where it shows none, each call's span is read from CUDA
  events around it (from the GPU reaching the call to its last kernel's end) and busy time is
  not read. (PyTorch's own profiler would hold CUPTI, leaving JAX's traces empty after it.)"""
  import torch
  marks = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(calls)] for _ in range(groups)]
  next_group = iter(marks)

  def run_group():
    t0 = time.perf_counter()
    for i, (start, end) in enumerate(next(next_group)):
      start.record()
      call(i)
      end.record()
    torch.cuda.synchronize()
    return time.perf_counter() - t0

  out = _traced_groups(run_group, calls, groups)
  return [(per_call or [(start.elapsed_time(end) * 1e-3, None) for start, end in group_marks],
           activities, wall) for (per_call, activities, wall), group_marks in zip(out, marks)]


def _host_group(call, calls, wait):
  t0 = time.perf_counter()
  for i in range(calls):
    out = call(i)
  wait(out)
  wall = time.perf_counter() - t0
  return [(wall / calls, wall / calls)] * calls, None, wall


# The GPU activities one timing trace may hold (its groups' calls' together), unless three
# calls a group already pass it.
TRACED_ACTIVITIES = 20_000
# Calls quicker than this are not probed for their activities: each takes a microsecond or
# more, so such calls hold too few for their trace to cost more than the probe's own trace.
PROBED_FROM_SECONDS = 2e-4


def _timed(run_groups, single_seconds: float, *, min_seconds: float, groups: int) -> Timing:
  """Runs ``groups`` groups of back-to-back calls (``run_groups(calls, groups)``: per group,
  its calls' (span, busy) seconds, GPU activities per call and the host's seconds), enough for
  ``min_seconds`` in all (fewer where their trace would pass :data:`TRACED_ACTIVITIES`), and
  returns the median per-call times; checks busy <= span <= wall and the same activity count
  in every group."""
  calls = int(max(3, min(200, math.ceil(min_seconds / groups / max(single_seconds, 1e-6)))))
  if calls > 3 and single_seconds >= PROBED_FROM_SECONDS:
    # A trace's cost grows with its activities: a program of many short kernels (a scan's
    # steps) gets fewer calls a group, so that reading the trace costs less than running it.
    _, activities, _ = run_groups(1, 1)[0]
    if activities:
      calls = max(3, min(calls, TRACED_ACTIVITIES // (groups * activities)))
  spans, busys, walls, counts = [], [], [], set()
  for per_call, activities, wall in run_groups(calls, groups):
    wall /= calls
    span = statistics.fmean(s for s, _ in per_call)
    busy = None if per_call[0][1] is None else statistics.fmean(b for _, b in per_call)
    # Host and GPU clocks tick apart by parts per million; a span past the host's wall by
    # more than that is a misread trace.
    if not (busy is None or busy <= span) or not span <= wall * 1.01 + 2e-6:
      busy_ms = "unread" if busy is None else f"{busy * 1e3:.4f} ms"
      raise TimingError(f"per call busy {busy_ms}, span {span * 1e3:.4f} ms, wall "
                        f"{wall * 1e3:.4f} ms: expected busy <= span <= wall")
    spans.append(span), busys.append(busy), walls.append(wall), counts.add(activities)
  if len(counts) != 1:
    raise TimingError(f"the groups ran {sorted(counts)} GPU activities per call: the timed "
                      f"program changed between groups")
  ms = lambda values: None if None in values else statistics.median(values) * 1e3
  return Timing(ms(spans), ms(busys), ms(walls), counts.pop() or 0)


def measure(compiled: Callable, input_sets: Sequence[tuple], *, time_it: bool = True,
            min_seconds: float = 0.3, groups: int = 5) -> tuple[Timing | None, object]:
  """Times ``compiled`` (a jitted function, or one compiled ahead) on calls that cycle through
  ``input_sets``, so that a call does not read what the last one left in L2, and returns the
  timing and the outputs of its first call (on the first set), which are what a caller
  checks: the program timed is the program checked.
  """
  first = compiled(*input_sets[0])
  _block(first)
  if not time_it:
    return None, first
  call = lambda i: compiled(*input_sets[i % len(input_sets)])
  t0 = time.perf_counter()
  for i in range(len(input_sets)):
    out = call(i)
  _block(out)
  single = (time.perf_counter() - t0) / len(input_sets)
  run_groups = (functools.partial(_jax_groups, call) if timing_method() == PROFILER
                else lambda calls, groups: [_host_group(call, calls, _block)
                                            for _ in range(groups)])
  return _timed(run_groups, single, min_seconds=min_seconds, groups=groups), first


def time_torch(call: Callable[[int], object], *, min_seconds: float = 0.3,
               groups: int = 5) -> Timing:
  """Times PyTorch calls as :func:`measure` times JAX's, back to back, from JAX's profiler
  trace (else CUDA events, and ``busy_ms`` is ``None``); ``call(i)`` is a group's i-th."""
  import torch
  call(0)
  torch.cuda.synchronize()
  t0 = time.perf_counter()
  for i in range(3):
    call(i)
  torch.cuda.synchronize()
  single = (time.perf_counter() - t0) / 3
  return _timed(functools.partial(_torch_groups, call), single, min_seconds=min_seconds,
                groups=groups)


def time_ms(fn: Callable, input_sets: Sequence[tuple], *, min_seconds: float = 0.3,
            groups: int = 5) -> float:
  """Median span in milliseconds of one ``fn`` call (see :func:`measure`)."""
  timing, _ = measure(jax.jit(fn), input_sets, min_seconds=min_seconds, groups=groups)
  return timing.span_ms


# A problem is past the cache when the bytes its forward moves reach this many L2s: the dirty
# lines one call leaves are then a small part of what the next one moves.
L2_MULTIPLE = 4


def copies_for(bytes_per_call: float) -> int:
  """Input sets to cycle through: enough that a call never reads what an earlier call left
  in L2, within memory."""
  l2 = device.describe().l2_bytes if device.describe() else 64 << 20
  return int(max(2, min(32, math.ceil(L2_MULTIPLE * l2 / max(bytes_per_call, 1.0)))))


def _upcast(tree):
  return jax.tree.map(lambda a: a.astype(jnp.float64)
                      if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


# Outputs of more elements than this are checked at sampled rows: enough to see any error of a
# row kernel, without copying gigabytes of float64 to the host.
_CHECKED_ELEMENTS = 1 << 24
_SAMPLED_ROWS = 512


def checked_rows(shape) -> np.ndarray | None:
  """Indices of the rows (last-axis slices, leading axes flattened) checked in an output of
  ``shape``: every row (``None``) up to :data:`_CHECKED_ELEMENTS`; else the first and last
  rows, those around elements 2^31 and 2^32 (where 32-bit offsets overflow), and random rows
  spread over the whole tensor."""
  size = math.prod(shape)
  if len(shape) == 0 or size <= _CHECKED_ELEMENTS:
    return None
  n_rows = size // shape[-1]
  picks = {0, 1, n_rows - 2, n_rows - 1}
  for boundary in (2 ** 31, 2 ** 32):
    row = boundary // shape[-1]
    picks.update(r for r in (row - 1, row, row + 1) if 0 <= r < n_rows)
  rng = np.random.default_rng(n_rows)
  picks.update(rng.choice(n_rows, size=min(n_rows, _SAMPLED_ROWS), replace=False).tolist())
  return np.array(sorted(picks))


def _sample(a):
  """``a``'s checked rows (all of ``a`` when few), as a 2-D array of rows."""
  a = jnp.asarray(a)
  rows = checked_rows(a.shape)
  if rows is None:
    return a
  return a.reshape(-1, a.shape[-1])[rows]


def _floor_rows(floor, expected_shape):
  """A floor (scalar, or one per row of an output) cut to the output's checked rows."""
  floor = np.asarray(floor)
  rows = checked_rows(expected_shape)
  if floor.ndim == 0 or rows is None:
    return floor
  return floor.reshape(-1, 1)[rows]


# A relative bound for float32 computed through TF32 (10 bits of mantissa), as a GPU's float32
# matrix products are by default.
TF32_TOLERANCE = 2e-3


def error_bound(dtype, reduction_length: int = 1, roundings: int = 2) -> float:
  """The relative error a correct kernel stays within, by the worst row: ``roundings``
  roundings to ``dtype`` on the way to the output (each at most its unit roundoff, relative),
  and float32 accumulation (float64 for float64) over ``reduction_length`` terms, which
  grows as its square root for tree and blocked sums."""
  dtype = jnp.dtype(dtype)
  unit = float(jnp.finfo(dtype).eps) / 2
  accumulate = float(jnp.finfo(jnp.float64 if dtype == jnp.float64 else jnp.float32).eps) / 2
  return roundings * unit + 4 * math.sqrt(reduction_length) * accumulate


def _errors(actual, expected, case, floors=None) -> list[tuple[float, float]]:
  """(relative error of the worst checked row, its bound) of every output. ``expected`` holds
  the reference's checked rows (:func:`_sample`), ``floors`` one floor per output, cut alike."""
  actual, expected = jax.tree.leaves(actual), jax.tree.leaves(expected)
  if len(actual) != len(expected):
    raise AssertionError(f"{len(actual)} outputs where the reference has {len(expected)}")
  floors = [0.0] * len(expected) if floors is None else floors
  out = []
  for a, e, f in zip(actual, expected, floors):
    bound = case.tolerance or error_bound(a.dtype, case.reduction_length, case.roundings)
    out.append((relative_error(_sample(a), e, f), bound))
  return out


def is_comparator(implementation: str) -> bool:
  """A row of another library (``jax.nn``, ``optax``), not of a jaxfuse implementation."""
  return (implementation not in (DEFAULT, DEFAULT_WITHOUT_TRITON)
          and implementation not in registry.IMPLEMENTATIONS)


def run(cases: Sequence[Case], *, implementations: Sequence[str] | None = None,
        time_it: bool = True, on_case: Callable | None = None,
        ceilings: dict | None = None) -> tuple[list[Row], dict]:
  """Checks and times ``cases``; returns the rows and the ceilings measured.

  ``on_case(rows, ceilings)`` is called after each case, so a long sweep saves as it goes.
  ``ceilings`` measured by an earlier run on this machine are reused (and added to)."""
  from jaxfuse._core import ceilings as measured  # it times with this module's measure()
  ceilings = {} if ceilings is None else ceilings
  units = {c.unit for c in cases}
  if time_it and "GB/s" in units and "copy GB/s" not in ceilings:
    copies = measured.copy_ceilings()
    best = max(copies, key=copies.get)
    ceilings.update({"copy GB/s": copies[best], "copy": best, "copies GB/s": copies})
  if time_it and "TFLOP/s" in units and "matmul TFLOP/s" not in ceilings:
    ceilings["matmul TFLOP/s"] = measured.matmul_rate()
  todo = [(c, impl) for c in cases
          for impl in list(c.implementations) + list(c.check_only) + list(c.external)
          if implementations is None or impl in implementations]
  progress = Progress(len(todo))
  rows = []
  for case in cases:
    impls = [i for c, i in todo if c is case]
    if impls:
      rows += _run_case(case, impls, ceilings, time_it, progress)
      if on_case:
        on_case(rows, ceilings)
  progress.close()
  return rows, ceilings


def _references(case, inputs):
  """The float64 references' checked rows (forward, training step) and the step's floors."""
  with x64():
    wide = _upcast(inputs)
    # One program each, as the timed ones are: op by op, each primitive would compile apart.
    ref_fwd = jax.tree.map(lambda a: np.asarray(_sample(a)), jax.jit(case.forward("xla"))(*wide))
    ref_train = floors = None
    if case.train:
      full = jax.tree.leaves(jax.jit(case.train("xla"))(*wide))
      ref_train = [np.asarray(_sample(a)) for a in full]
      if case.train_floors is not None:
        floors = [_floor_rows(f, a.shape)
                  for f, a in zip(jax.tree.leaves(case.train_floors(*wide)), full)]
      del full
    del wide
  return ref_fwd, ref_train, floors


def _cache_resident(case) -> bool:
  gpu = device.describe()
  return (case.unit == "GB/s" and gpu is not None
          and case.forward_work < L2_MULTIPLE * gpu.l2_bytes)


def _run_case(case, impls, ceilings, time_it, progress):
  progress.show(f"{case.op} {case.label}: inputs and float64 references")
  key = jax.random.key(zlib.crc32(f"{case.op} {case.label}".encode()))
  inputs = case.make_inputs(key)
  try:
    references, reference_failure = _references(case, inputs), None
  except Exception as e:  # noqa: BLE001  (a case without a reference fails, it is not timed)
    references = None
    reference_failure = (f"{NO_REFERENCE}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160]}")
  sets = [inputs]
  size_copy = None
  if time_it and not reference_failure:
    in_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(inputs))
    n_sets = copies_for(case.forward_work if case.unit == "GB/s" else 2 * in_bytes)
    sets += [case.make_inputs(jax.random.fold_in(key, i)) for i in range(1, n_sets)]
    if case.unit == "GB/s":
      timing, _ = measure(jax.jit(lambda a, *_: -a), sets)
      size_copy = 2 * inputs[0].size * inputs[0].dtype.itemsize / (timing.span_ms * 1e-3) / 1e9
  rows = []
  for impl in impls:
    if impl in case.external:
      continue
    progress.step(f"{case.op} {case.label} {impl}")
    row = Row(case.op, case.label, case.size, impl, case.unit, steps=case.steps,
              size_copy_rate=size_copy, cache_resident=_cache_resident(case),
              note=case.notes.get(impl, ""))
    rows.append(row)
    if reference_failure:
      row.note = reference_failure if is_comparator(impl) else f"FAILED: {reference_failure}"
      continue
    _check_and_time(case, impl, row, references, sets,
                    time_it and impl not in case.check_only, ceilings)
  if time_it and not reference_failure:
    rows += _run_external(case, [i for i in impls if i in case.external], inputs, ceilings,
                          progress)
  return rows


def _check_and_time(case, impl, row, references, sets, time_it, ceilings):
  """Compiles the forward and the training step once each, checks the outputs of those very
  programs against the references, and times them if they pass."""
  ref_fwd, ref_train, floors = references
  started = time.perf_counter()
  try:
    traced = registry.without_triton if impl == DEFAULT_WITHOUT_TRITON else contextlib.nullcontext
    with traced():
      forward, row.forward_ran = _compiled(case.forward(impl), sets[0], ("evaluated",))
    train = None
    if case.train:
      try:
        with traced():
          train, row.train_ran = _compiled(case.train(impl), sets[0], ("forward", "backward"))
      except NotImplementedError as e:  # a forward-only kernel: its forward is still timed
        row.note = f"{FORWARD_ONLY}: {e}"
    row.compile_s, started = time.perf_counter() - started, time.perf_counter()
    _, out = measure(forward, sets, time_it=False)
    errors = _errors(out, ref_fwd, case)
    row.forward_error = max(e for e, _ in errors)
    del out
    if train is not None:
      _, out = measure(train, sets, time_it=False)
      train_errors = _errors(out, ref_train, case, floors)
      row.train_error = max(e for e, _ in train_errors)
      errors += train_errors
      del out
      mem = train.memory_analysis()
      row.train_temp_mib = getattr(mem, "temp_size_in_bytes", 0) / 2 ** 20 if mem else None
    wrong = [(e, bound) for e, bound in errors if not e <= bound]
    row.check_s, started = time.perf_counter() - started, time.perf_counter()
    if wrong and not is_comparator(impl):
      row.note = "FAILED: relative error {:.2e} above {:.1e}".format(*wrong[0])
      return
    if not time_it:
      return
    row.ceiling_name = "copy GB/s" if case.unit == "GB/s" else "matmul TFLOP/s"
    _set_timing(row, "forward", measure(forward, sets)[0])
    if train is not None:
      _set_timing(row, "train", measure(train, sets)[0])
    row.time_s = time.perf_counter() - started
    _set_rates(row, case, ceilings)
  except NotImplementedError as e:
    row.note = str(e)
  except ImportError as e:
    row.note = (f"not installed: {e.name or e}" if is_comparator(impl)
                else f"FAILED: {type(e).__name__}: {e}")
  except Exception as e:  # noqa: BLE001  (a broken kernel is reported, the sweep goes on)
    what = "comparator failed" if is_comparator(impl) else "FAILED"
    row.note = f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _compiled(fn, args, uses):
  """``jax.jit(fn)`` compiled for ``args``, and the implementations its jaxfuse ops run for
  ``uses`` (of :data:`op.USES`), '+'-joined in order of first use (None where it has none)."""
  with registry.recording() as events:
    compiled = jax.jit(fn).lower(*args).compile()
  plans = [event[-1] for event in events if event[0] == "plan"]
  return compiled, "+".join(dict.fromkeys(getattr(p, use) for p in plans for use in uses)) or None


def _set_timing(row, which: str, timing: Timing | None):
  if timing is None:
    return
  setattr(row, f"{which}_ms", timing.span_ms)
  setattr(row, f"{which}_busy_ms", timing.busy_ms)
  setattr(row, f"{which}_wall_ms", timing.wall_ms)
  setattr(row, f"{which}_kernels", timing.kernels)


def _run_external(case, impls, inputs, ceilings, progress):
  rows = []
  for impl in impls:
    progress.step(f"{case.op} {case.label} {impl}")
    row = Row(case.op, case.label, case.size, impl, case.unit, steps=case.steps,
              ceiling_name="matmul TFLOP/s" if case.unit == "TFLOP/s" else "copy GB/s",
              cache_resident=_cache_resident(case))
    started = time.perf_counter()
    try:
      forward, train, *temp_mib = case.external[impl](inputs)
      row.time_s = time.perf_counter() - started
      row.train_temp_mib = temp_mib[0] if temp_mib else None
      _set_timing(row, "forward", forward)
      _set_timing(row, "train", train)
      _set_rates(row, case, ceilings)
    except ImportError as e:
      row.note = f"not installed: {e.name or e}"
    except Exception as e:  # noqa: BLE001  (a comparator's failure is reported, not fatal)
      row.note = f"comparator failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    rows.append(row)
  return rows


def _set_rates(row, case, ceilings):
  """The row's rates from its times, and their percent of its ceiling measured in this run
  (none for a cache-resident problem, which a copy past the L2 does not bound)."""
  row.forward_rate = _rate(case.forward_work, row.forward_ms, case.unit)
  row.train_rate = _rate(case.train_work, row.train_ms, case.unit)
  ceiling = ceilings.get(row.ceiling_name)
  if ceiling and not row.cache_resident:
    row.forward_pct = 100 * row.forward_rate / ceiling
    if row.train_rate is not None:
      row.train_pct = 100 * row.train_rate / ceiling


def environment(program: str = "jaxfuse") -> dict:
  first = jax.devices()[0]
  return {
      "device": f"{first.platform}: {first.device_kind}",
      "device_count": jax.device_count(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "jax_version": jax.__version__,
      "jaxlib_version": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
      "python": host_platform.python_version(),
      "command": " ".join([program] + sys.argv[1:]),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      # The CUDA kernels' forced architecture (compute_80: the pre-Hopper path), else None.
      "cuda_arch": os.environ.get(ARCH_VARIABLE),
      "timing": timing_method(),
      "gpu": dataclasses.asdict(gpu) if (gpu := device.describe()) else None,
  }


def _jaxlib_version():
  import jaxlib
  return jaxlib.__version__
