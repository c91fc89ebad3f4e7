"""How ``jaxfuse bench`` times a call: back-to-back calls in groups; on a GPU each call's span
read from a JAX profiler trace (first kernel's start to last kernel's end, busy time beside it),
for JAX's programs and PyTorch's alike; elsewhere the host clock."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import glob
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxfuse._core import registry


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


# The seconds of calls a timing spans by default: ``bench.run``'s ``min_seconds`` while it runs
# (a quick run's shorter window reaches the comparators' own runners too).
MIN_SECONDS = contextvars.ContextVar("min_seconds", default=0.3)


def measure(compiled: Callable, input_sets: Sequence[tuple], *, time_it: bool = True,
            min_seconds: float | None = None, groups: int = 5) -> tuple[Timing | None, object]:
  """Times ``compiled`` (a jitted function, or one compiled ahead) on calls that cycle through
  ``input_sets``, so that a call does not read what the last one left in L2, and returns the
  timing and the outputs of its first call (on the first set), which are what a caller
  checks: the program timed is the program checked. ``min_seconds``: see
  :data:`MIN_SECONDS`.
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
  return _timed(run_groups, single, min_seconds=min_seconds or MIN_SECONDS.get(),
                groups=groups), first


def time_torch(call: Callable[[int], object], *, min_seconds: float | None = None,
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
  return _timed(functools.partial(_torch_groups, call), single,
                min_seconds=min_seconds or MIN_SECONDS.get(), groups=groups)


def time_ms(fn: Callable, input_sets: Sequence[tuple], *, min_seconds: float | None = None,
            groups: int = 5) -> float:
  """Median span in milliseconds of one ``fn`` call (see :func:`measure`)."""
  timing, _ = measure(jax.jit(fn), input_sets, min_seconds=min_seconds, groups=groups)
  return timing.span_ms


