"""The bench harness behind ``jaxfuse bench``: checks and timings (how a call is timed is
:mod:`jaxfuse._core.timing`'s, what it prints and saves :mod:`jaxfuse._core.report`'s, the
ceilings it quotes rates against :mod:`jaxfuse._core.ceilings`').

Each op family supplies :class:`Case` objects. For each case and implementation the harness
compiles the forward and the training step (output and every gradient) once, checks those
programs' outputs against float64 references (sampled rows of large outputs, bounds from the
dtype's rounding and the reduction's length), then times the same programs. Calls run one at a
time, back to back, cycling through input sets so that none reads what the last left in L2;
on a GPU each call's time is its span in a profiler trace, from its first kernel's start to
its last kernel's end, for JAX's rows and PyTorch's alike, with its busy
time beside it. Rates are quoted against ceilings measured in the same run: the best of
several device-to-device copies for memory-bound ops (only for problems past the L2) and a
bf16 matrix product for compute-bound ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import platform as host_platform
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._core import ceilings as measured
from jaxfuse._core import device, registry
from jaxfuse._core.cuda.build import ARCH_VARIABLE
from jaxfuse._core.progress import Progress
from jaxfuse._core.testing import relative_error, x64
from jaxfuse._core.timing import MIN_SECONDS, Timing, measure, timing_method


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


FORWARD_ONLY = "forward only"
NO_REFERENCE = "no float64 reference"


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
        ceilings: dict | None = None, min_seconds: float | None = None
        ) -> tuple[list[Row], dict]:
  """Checks and times ``cases``; returns the rows and the ceilings measured.

  ``on_case(rows, ceilings)`` is called after each case, so a long sweep saves as it goes.
  ``ceilings`` measured by an earlier run on this machine are reused (and added to).
  ``min_seconds``: each timing's span of calls (default :data:`MIN_SECONDS`)."""
  token = MIN_SECONDS.set(min_seconds or MIN_SECONDS.get())
  try:
    return _run(cases, implementations, time_it, on_case, ceilings)
  finally:
    MIN_SECONDS.reset(token)


def _run(cases, implementations, time_it, on_case, ceilings):
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
    wide = jax.jit(_upcast)(inputs)
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
  # One program makes each set: op by op, each random draw and its scaling would compile apart.
  make_inputs = jax.jit(case.make_inputs)
  inputs = make_inputs(key)
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
    sets += [make_inputs(jax.random.fold_in(key, i)) for i in range(1, n_sets)]
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
