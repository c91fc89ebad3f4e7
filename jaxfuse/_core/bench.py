"""The bench harness behind ``jaxfuse bench``: timing, ceilings, errors, tables, JSON and plots.

Each op family supplies :class:`Case` objects. For each case and implementation the harness
checks the forward output and the training step (output and every gradient) against float64
references, then times both. Timing runs ``copies`` independent calls inside one jitted
function on freshly drawn inputs, so repeated runs do not read from a warm L2, and takes the
median over repetitions; on a GPU it reads the device's busy time from a profiler trace, so
host launch costs never stand in for kernel time (see :func:`time_ms`). Rates are quoted
against the ceilings measured in the same run: a device-to-device copy for memory-bound ops and
a bf16 matrix product for compute-bound ones.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import glob
import json
import math
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

from jaxfuse._core import registry
from jaxfuse._core.testing import TOLERANCE, relative_error, x64


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
  # Comparators outside JAX (PyTorch), each timing itself on the inputs: ``fn(inputs) ->
  # (forward_ms, train_ms)``. Their outputs are not checked.
  external: Mapping[str, Callable[[tuple], tuple[float, float]]] = dataclasses.field(
      default_factory=dict)
  # Time steps a call walks (recurrent ops): the table adds microseconds per step.
  steps: int | None = None
  # The tests' relative error bound for every output, where the dtype's does not apply
  # (float32 computed through TF32).
  tolerance: float | None = None
  # ``train_floors(*inputs)`` on the float64 inputs: per output of ``train``, the
  # ``relative_error`` floor (a scalar or one per row), for gradients whose rows can cancel
  # to ~0 while the terms they sum are not small (causal attention's first queries).
  train_floors: Callable[..., tuple] | None = None


# The row of ``implementation=None``: what a user gets without choosing.
DEFAULT = "default"


def implementation_arg(name: str) -> str | None:
  """The ``implementation=`` argument a bench row's name stands for."""
  return None if name == DEFAULT else name


@dataclasses.dataclass
class Row:
  op: str
  label: str
  size: int
  implementation: str
  unit: str
  forward_ms: float | None = None
  forward_rate: float | None = None
  train_ms: float | None = None
  train_rate: float | None = None
  train_temp_mib: float | None = None
  forward_error: float | None = None
  train_error: float | None = None
  ceiling_name: str = ""
  # Copy of the case's first input, same bytes as the forward: the ceiling at this size.
  size_copy_rate: float | None = None
  forward_pct: float | None = None
  train_pct: float | None = None
  steps: int | None = None
  note: str = ""


def _rate(work, ms, unit):
  if ms is None:
    return None
  return work / (ms * 1e-3) / (1e9 if unit == "GB/s" else 1e12)


def _block(tree):
  for leaf in jax.tree.leaves(tree):
    leaf.block_until_ready()


def time_ms(fn: Callable, input_sets: Sequence[tuple], *, min_seconds: float = 0.3,
            groups: int = 7) -> float:
  """Median milliseconds of one ``fn`` call, from calls on ``len(input_sets)`` input sets.

  On a GPU a group's time is the device's busy time read from a profiler trace (the union of
  its kernels' intervals): at small sizes the host needs longer to launch a call than the GPU
  needs to run it, and a host clock would time the launches. Elsewhere calls are dispatched
  back to back and waited for once per group, so the host clock reads the device's work.
  """
  batched = jax.jit(lambda sets: [fn(*s) for s in sets])
  _block(batched(input_sets))
  t0 = time.perf_counter()
  _block(batched(input_sets))
  single = time.perf_counter() - t0
  calls = int(max(3, min(200, math.ceil(min_seconds / groups / max(single, 1e-6)))))
  group_seconds = _profiled_seconds if timing_method() == PROFILER else _clock_seconds
  times = [group_seconds(batched, input_sets, calls) / calls for _ in range(groups)]
  return statistics.median(times) * 1e3 / len(input_sets)


PROFILER = "GPU busy time from a profiler trace"
FORWARD_ONLY = "forward only"
HOST_CLOCK = "host clock around back-to-back calls"


@functools.cache
def timing_method() -> str:
  """How :func:`time_ms` reads time here: the profiler on a GPU whose trace shows kernels."""
  if registry.platform() != "gpu":
    return HOST_CLOCK
  probe = jax.jit(lambda a: -a)
  a = jnp.ones((1 << 20,), jnp.float32)
  _block(probe(a))
  try:
    return PROFILER if _profiled_seconds(probe, a, 1) > 0 else HOST_CLOCK
  except Exception:  # noqa: BLE001  (no CUPTI or no trace: the host clock still works)
    return HOST_CLOCK


def _clock_seconds(batched, input_sets, calls) -> float:
  t0 = time.perf_counter()
  for _ in range(calls):
    out = batched(input_sets)
  _block(out)
  return time.perf_counter() - t0


def _profiled_seconds(batched, input_sets, calls) -> float:
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir):
      for _ in range(calls):
        out = batched(input_sets)
      _block(out)
    intervals = []
    for path in glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True):
      for plane in jax.profiler.ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU"):
          intervals += [(e.start_ns, e.start_ns + e.duration_ns)
                        for line in plane.lines if line.name.startswith("Stream")
                        for e in line.events]
  busy_ns, reached = 0.0, -math.inf
  for start, end in sorted(intervals):
    busy_ns += max(0.0, end - max(start, reached))
    reached = max(reached, end)
  return busy_ns * 1e-9


def copies_for(bytes_per_call: float) -> int:
  """Independent calls per timing: enough that a call never reads what an earlier call left
  in L2 (50 MB on an H100), within memory."""
  return int(max(2, min(32, math.ceil(200e6 / max(bytes_per_call, 1.0)))))


def copy_bandwidth() -> float:
  """GB/s of a large device-to-device copy (bytes read plus bytes written)."""
  n = (1 << 28) if registry.platform() == "gpu" else (1 << 22)
  keys = jax.random.split(jax.random.key(1), 4)
  sets = [(jax.random.normal(k, (n,), jnp.bfloat16),) for k in keys]
  ms = time_ms(lambda a: -a, sets)
  return 2 * n * 2 / (ms * 1e-3) / 1e9


def matmul_rate() -> float:
  """TFLOP/s of a bf16 matrix product (8192^3 on a GPU)."""
  n = 8192 if registry.platform() == "gpu" else 512
  keys = jax.random.split(jax.random.key(2), 4)
  sets = [(jax.random.normal(k, (n, n), jnp.bfloat16),
           jax.random.normal(jax.random.fold_in(k, 1), (n, n), jnp.bfloat16)) for k in keys]
  ms = time_ms(lambda a, b: a @ b, sets)
  return 2 * n ** 3 / (ms * 1e-3) / 1e12


def _upcast(tree):
  return jax.tree.map(lambda a: a.astype(jnp.float64)
                      if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


# Outputs larger than this are checked on their leading rows: enough elements to see any error
# of a row kernel, without copying gigabytes of float64 to the host.
_CHECKED_ELEMENTS = 1 << 24


def _leading_rows(a):
  if a.ndim == 0 or a.size <= _CHECKED_ELEMENTS:
    return a
  return a[:max(1, _CHECKED_ELEMENTS * a.shape[0] // a.size)]


def _errors(actual, expected, case, floors=None) -> list[tuple[float, float]]:
  """(relative error of the worst row, the bound for that output) of every output: the
  case's ``tolerance`` or the output dtype's. ``floors``: one per output, cut to the checked
  leading rows like the output."""
  expected = jax.tree.leaves(expected)
  floors = [0.0] * len(expected) if floors is None else [
      np.asarray(f)[:e.shape[0]] if np.ndim(f) else f for f, e in zip(floors, expected)]
  return [(relative_error(a, e, f),
           _ERROR_SLACK * (case.tolerance or TOLERANCE.get(jnp.dtype(a.dtype), 1e-2)))
          for a, e, f in zip(jax.tree.leaves(actual), expected, floors)]


# A jaxfuse output whose worst row's error passes the tests' bound for its dtype by more than
# this is wrong, and fails the job (the bench's inputs are larger than the tests').
_ERROR_SLACK = 2.0


def is_comparator(implementation: str) -> bool:
  """A row of another library (``jax.nn``, ``optax``), not of a jaxfuse implementation."""
  return implementation != DEFAULT and implementation not in registry.IMPLEMENTATIONS


class _Progress:
  def __init__(self, total):
    self.total, self.done = total, 0
    self.enabled = sys.stderr.isatty()

  def step(self, text):
    self.done += 1
    if self.enabled:
      filled = int(30 * self.done / self.total)
      sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                       f"{text[:60]:<60}")
      sys.stderr.flush()

  def close(self):
    if self.enabled:
      sys.stderr.write("\n")


def run(cases: Sequence[Case], *, implementations: Sequence[str] | None = None,
        time_it: bool = True, on_case: Callable | None = None) -> tuple[list[Row], dict]:
  """Checks and times ``cases``; returns the rows and the ceilings measured.

  ``on_case(rows, ceilings)`` is called after each case, so a long sweep saves as it goes.
  """
  ceilings = {}
  units = {c.unit for c in cases}
  if time_it and "GB/s" in units:
    ceilings["copy GB/s"] = copy_bandwidth()
  if time_it and "TFLOP/s" in units:
    ceilings["matmul TFLOP/s"] = matmul_rate()
  todo = [(c, impl) for c in cases
          for impl in list(c.implementations) + list(c.check_only) + list(c.external)
          if implementations is None or impl in implementations]
  progress = _Progress(len(todo))
  rows = []
  for case in cases:
    impls = [i for c, i in todo if c is case]
    if impls:
      rows += _run_case(case, impls, ceilings, time_it, progress)
      if on_case:
        on_case(rows, ceilings)
  progress.close()
  return rows, ceilings


def _run_case(case, impls, ceilings, time_it, progress):
  key = jax.random.key(zlib.crc32(f"{case.op} {case.label}".encode()))
  inputs = case.make_inputs(key)
  reference_note = ""
  # Only the checked leading rows of each output are kept, of the references and of every
  # implementation's outputs, so that float64 copies of gigabyte arrays do not pile up.
  checked = lambda tree: jax.tree.map(_leading_rows, tree)
  try:
    with x64():
      wide = _upcast(inputs)
      ref_fwd = checked(case.forward("xla")(*wide))
      ref_train = checked(case.train("xla")(*wide)) if case.train else None
      floors = (None if case.train_floors is None else
                [np.asarray(f) for f in jax.tree.leaves(case.train_floors(*wide))])
      del wide
  except Exception as e:  # noqa: BLE001  (no reference: time the case, say why errors are empty)
    ref_fwd = ref_train = floors = None
    reference_note = f"no float64 reference: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
  rows, forward_only = [], set()
  for impl in impls:
    if impl in case.external:
      continue
    progress.step(f"{case.op} {case.label} {impl}")
    row = Row(case.op, case.label, case.size, impl, case.unit, steps=case.steps)
    try:
      forward = checked(jax.jit(case.forward(impl))(*inputs))
      row.note = reference_note
      errors = []
      if ref_fwd is not None:
        errors += _errors(forward, ref_fwd, case)
        row.forward_error = max(e for e, _ in errors)
      if case.train:
        try:
          train = jax.jit(case.train(impl)).lower(*inputs).compile()
        except NotImplementedError as e:  # a forward-only kernel: its forward is still timed
          forward_only.add(impl)
          row.note = f"{FORWARD_ONLY}: {e}"
        else:
          trained = checked(train(*inputs))
          if ref_train is not None:
            train_errors = _errors(trained, ref_train, case, floors)
            row.train_error = max(e for e, _ in train_errors)
            errors += train_errors
          mem = train.memory_analysis()
          row.train_temp_mib = getattr(mem, "temp_size_in_bytes", 0) / 2 ** 20 if mem else None
      wrong = [(e, bound) for e, bound in errors if not e <= bound]
      if wrong and not is_comparator(impl):
        row.note = "FAILED: relative error {:.2e} above {:.0e}".format(*wrong[0])
        forward_only.discard(impl)
    except NotImplementedError as e:
      row.note = str(e)
    except ImportError as e:
      row.note = (f"not installed: {e.name or e}" if is_comparator(impl)
                  else f"FAILED: {type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001  (a broken kernel is reported, the sweep goes on)
      what = "comparator failed" if is_comparator(impl) else "FAILED"
      row.note = f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    rows.append(row)
  del ref_fwd, ref_train
  if not time_it:
    return rows
  in_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(inputs))
  n_sets = copies_for(case.forward_work if case.unit == "GB/s" else 2 * in_bytes)
  sets = [inputs] + [case.make_inputs(jax.random.fold_in(key, i)) for i in range(1, n_sets)]
  ceiling_name = "copy GB/s" if case.unit == "GB/s" else "matmul TFLOP/s"
  size_copy = None
  if case.unit == "GB/s":
    first = inputs[0]
    size_copy = 2 * first.size * first.dtype.itemsize / (time_ms(lambda a, *_: -a, sets) * 1e-3) / 1e9
  for row in rows:
    impl = row.implementation
    if ((row.note and row.note != reference_note and impl not in forward_only)
        or impl in case.check_only):
      continue
    row.ceiling_name = ceiling_name
    row.size_copy_rate = size_copy
    row.forward_ms = time_ms(case.forward(impl), sets)
    if case.train and impl not in forward_only:
      row.train_ms = time_ms(case.train(impl), sets)
    _set_rates(row, case, ceilings)
  return rows + _run_external(case, [i for i in impls if i in case.external], inputs,
                              ceilings, progress)


def _run_external(case, impls, inputs, ceilings, progress):
  rows = []
  for impl in impls:
    progress.step(f"{case.op} {case.label} {impl}")
    row = Row(case.op, case.label, case.size, impl, case.unit, steps=case.steps,
              ceiling_name="matmul TFLOP/s" if case.unit == "TFLOP/s" else "copy GB/s")
    try:
      row.forward_ms, row.train_ms = case.external[impl](inputs)
      _set_rates(row, case, ceilings)
    except ImportError as e:
      row.note = f"not installed: {e.name or e}"
    except Exception as e:  # noqa: BLE001  (a comparator's failure is reported, not fatal)
      row.note = f"comparator failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    rows.append(row)
  return rows


def _set_rates(row, case, ceilings):
  """The row's rates from its times, and their percent of its ceiling measured in this run."""
  row.forward_rate = _rate(case.forward_work, row.forward_ms, case.unit)
  row.train_rate = _rate(case.train_work, row.train_ms, case.unit)
  ceiling = ceilings.get(row.ceiling_name)
  if ceiling:
    row.forward_pct = 100 * row.forward_rate / ceiling
    if row.train_rate is not None:
      row.train_pct = 100 * row.train_rate / ceiling


def _fmt(v, spec):
  return "" if v is None else format(v, spec)


def table(rows: Sequence[Row], ceilings: dict) -> str:
  """Plain-text tables, one per op."""
  out = []
  if ceilings:
    out.append("ceilings measured in this run: " +
               ", ".join(f"{k} {v:.0f}" for k, v in ceilings.items()))
  for op in dict.fromkeys(r.op for r in rows):
    op_rows = [r for r in rows if r.op == op]
    unit = op_rows[0].unit
    header = (f"{'shape':<28} {'impl':<8} {'fwd ms':>8} {'fwd ' + unit:>12} {'%ceil':>6} "
              f"{'step ms':>8} {'step ' + unit:>13} {'%ceil':>6} {'temp MiB':>9} "
              f"{'err fwd':>9} {'err step':>9} {'size copy':>10}")
    out += ["", f"## {op}", header, "-" * len(header)]
    for r in op_rows:
      line = (f"{r.label:<28} {r.implementation:<8} {_fmt(r.forward_ms, '8.3f'):>8} "
              f"{_fmt(r.forward_rate, '12.1f'):>12} {_fmt(r.forward_pct, '6.1f'):>6} "
              f"{_fmt(r.train_ms, '8.3f'):>8} {_fmt(r.train_rate, '13.1f'):>13} "
              f"{_fmt(r.train_pct, '6.1f'):>6} {_fmt(r.train_temp_mib, '9.1f'):>9} "
              f"{_fmt(r.forward_error, '9.1e'):>9} {_fmt(r.train_error, '9.1e'):>9} "
              f"{_fmt(r.size_copy_rate, '10.0f'):>10}")
      if r.steps and r.forward_ms is not None:
        line += (f"  {r.forward_ms * 1e3 / r.steps:.2f}/"
                 f"{_fmt(r.train_ms and r.train_ms * 1e3 / r.steps, '.2f')} us/step")
      out.append(line + (f"  {r.note}" if r.note else ""))
  return "\n".join(out)


def environment(program: str = "jaxfuse") -> dict:
  device = jax.devices()[0]
  return {
      "device": f"{device.platform}: {device.device_kind}",
      "device_count": jax.device_count(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "jax_version": jax.__version__,
      "jaxlib_version": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
      "python": host_platform.python_version(),
      "command": " ".join([program] + sys.argv[1:]),
      "timing": timing_method(),
  }


def _jaxlib_version():
  import jaxlib
  return jaxlib.__version__


def save_json(path: str, rows: Sequence[Row], ceilings: dict):
  record = dict(environment(), ceilings=ceilings, rows=[dataclasses.asdict(r) for r in rows])
  with open(path, "w") as f:
    json.dump(record, f, indent=1)


def save_plot(path: str, rows: Sequence[Row], ceilings: dict):
  """Rate against problem size per implementation, forward and training step, one row per op."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ops = list(dict.fromkeys(r.op for r in rows if r.forward_rate is not None))
  if not ops:
    return
  fig, axes = plt.subplots(len(ops), 2, figsize=(11, 3.6 * len(ops)), squeeze=False)
  for (ax_f, ax_t), op in zip(axes, ops):
    op_rows = [r for r in rows if r.op == op and r.forward_rate is not None]
    unit = op_rows[0].unit
    for impl in dict.fromkeys(r.implementation for r in op_rows):
      pts = sorted((r.size, r.forward_rate, r.train_rate) for r in op_rows
                   if r.implementation == impl)
      ax_f.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
      ax_t.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=impl)
    ceiling = ceilings.get("copy GB/s" if unit == "GB/s" else "matmul TFLOP/s")
    for ax, title in ((ax_f, "forward"), (ax_t, "training step")):
      if ceiling:
        ax.axhline(ceiling, color="gray", linestyle="--", label="ceiling")
      ax.set_xscale("log", base=2)
      ax.set_title(f"{op}: {title}")
      ax.set_xlabel("size")
      ax.set_ylabel(unit)
      ax.legend()
      ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
