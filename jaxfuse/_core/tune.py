"""``jaxfuse tune FAMILY [--write]``: a family's tuned-table rows measured on this GPU.

A family's bench module gives ``tune_cases()``, a grid of problems that crosses its dispatch
thresholds with only the named implementations, and ``tuned_rows(rows)``, the table rows
those timings imply (the helpers below: the size up to which, or from which, one
implementation is used at the least regret against the faster, the bands of sizes per row
count in which it is, an order by geometric mean), each row only where the run timed some
of its grid (a part run, ``--only``, is written only together with the others, ``--from``).
The bench checks every implementation against float64 as it times it; one that fails counts
as infinitely slow there, and ``--write`` refuses such a run. A case whose float64 reference
ran out of GPU memory is a point left untimed. The command saves the run (in
the checkout's ``benchmarks/results/``, after each case), and with ``--write`` puts the rows,
each citing it, into ``jaxfuse/ops/<family>/tuned/<this GPU>.json`` over the rows it had. A
family's ``rules`` (measured exceptions on dtype, element count and the like) are not derived:
they stay as the table has them. A family whose bench module also says what calls a tuning
point stands for (``tune_facts(row, use)``: the facts its dispatch matches rules on) derives
its thresholds without the points the GPU's rules decide, which those thresholds never reach:
its ``tuned_rows(rows, ruled)`` leaves out a point where ``ruled(row, use)``.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxfuse._core import registry, tuned
from jaxfuse._core.bench import NO_REFERENCE, Row


def time_of(row: Row, use: str) -> float | None:
  """``row``'s time for ``use``: its forward, its training step, or the backward alone (the
  step less the forward). None where it did not run or failed its check."""
  if failed(row) or row.forward_ms is None:
    return None
  if use == "forward":
    return row.forward_ms
  if row.train_ms is None:
    return None
  return row.train_ms if use == "step" else row.train_ms - row.forward_ms


def times_by_case(rows: Iterable[Row], use: str, first: str, others: Sequence[str]
                  ) -> list[tuple[Row, float, float]]:
  """``(first's row, first's time, the fastest of others' time)`` for each case where first
  and one of ``others`` ran. An implementation that failed its check there counts as
  infinitely slow: no threshold is read across a wrong result."""
  by_case: dict[tuple[str, str], dict[str, Row]] = {}
  for row in rows:
    by_case.setdefault((row.op, row.label), {})[row.implementation] = row
  time = lambda row: math.inf if failed(row) else time_of(row, use)
  points = []
  for ran in by_case.values():
    rivals = [t for name in others if name in ran and (t := time(ran[name])) is not None]
    if first in ran and (mine := time(ran[first])) is not None and rivals:
      points.append((ran[first], mine, min(rivals)))
  return points


def times_by_size(rows: Iterable[Row], use: str, first: str,
                  second: str) -> list[tuple[int, float, float]]:
  """``(size, first's time, second's time)`` for each case both ran, by size (see
  :func:`times_by_case`)."""
  return sorted((row.size, mine, theirs)
                for row, mine, theirs in times_by_case(rows, use, first, (second,)))


def failed(row: Row) -> bool:
  """Whether ``row``'s implementation failed its check. One that could not be checked (the
  float64 reference ran out of GPU memory) did not fail: its case is a point the run left
  untimed."""
  return row.note.startswith("FAILED") and not unchecked(row)


def unchecked(row: Row) -> bool:
  return row.note.startswith(f"FAILED: {NO_REFERENCE}") and "RESOURCE_EXHAUSTED" in row.note


def _least_regret(points: Sequence[tuple[int, float, float]], candidates: Sequence[Any],
                  uses_first: Callable[[Any, int], bool]) -> Any:
  """The candidate whose choice per point costs least against the faster of the two there:
  the least worst ratio, then the least geometric mean of the ratios, then the earliest in
  ``candidates`` (the callers put first the candidate a tie should go to)."""
  # Times clamped above zero: a backward read as the step less the forward can be nil.
  clamped = [(size, max(first, 1e-9), max(second, 1e-9)) for size, first, second in points
             if min(first, second) < math.inf]

  def regret(candidate):
    ratios = [(first if uses_first(candidate, size) else second) / min(first, second)
              for size, first, second in clamped]
    worst = max(ratios, default=1.0)
    mean = (math.fsum(map(math.log, ratios)) / len(ratios) if ratios and math.isfinite(worst)
            else math.inf)
    return worst, mean

  return min(candidates, key=regret)


def least_regret_prefix(points: Sequence[tuple[int, float, float]]) -> int | None:
  """The size up to which the first implementation is used (the second past it) at the least
  regret, as :func:`_least_regret` weighs it; None: the second everywhere. A loss at one size
  does not hide wins above it, and a failed check (infinitely slow) is never chosen."""
  sizes = sorted({size for size, _, _ in points})
  return _least_regret(points, [*reversed(sizes), None],
                       lambda limit, size: limit is not None and size <= limit)


def least_regret_suffix(points: Sequence[tuple[int, float, float]],
                        sizes: Iterable[int] | None = None) -> int | None:
  """The size from which the first implementation is used (the second below it) at the least
  regret; None: the second everywhere. ``sizes``: where it may start (the points' sizes by
  default); a tie goes to the least."""
  sizes = sorted(set(sizes) if sizes is not None else {size for size, _, _ in points})
  return _least_regret(points, [*sizes, None],
                       lambda start, size: start is not None and size >= start)


def geometric_floor(low: int, high: int) -> int:
  """The geometric mean of two sizes, rounded down: the last size nearer ``low`` by ratio."""
  return math.isqrt(low * high)


def geometric_ceil(low: int, high: int) -> int:
  """The geometric mean of two sizes, rounded up: the first size nearer ``high`` by ratio."""
  return math.isqrt(low * high - 1) + 1


def winning_bands(points: Sequence[tuple[tuple[int, int], float, float]]
                  ) -> list[list[int]] | None:
  """``[[most rows, least length, most length, least length, most length, ...], ...]``: per
  row count measured, the bands of lengths in which the first implementation is faster (the
  second outside them; ties go to the second), so no measured point pays a regret;
  ``[most rows]`` where it wins nowhere, and None where it wins at no row count. A bound
  between two measured counts or lengths lies at their geometric mean (the outermost at the
  measured one), so a call takes the nearest measurement's choice. ``points``: ``((rows,
  length), first's time, second's time)``."""
  counts = sorted({r for (r, _), _, _ in points})
  bands = []
  for i, rows in enumerate(counts):
    at = sorted((n, first < second) for (r, n), first, second in points if r == rows)
    entry = [rows if i == len(counts) - 1 else geometric_floor(rows, counts[i + 1])]
    for j, (n, wins) in enumerate(at):
      if not wins:
        continue
      if j == 0 or not at[j - 1][1]:
        entry.append(n if j == 0 else geometric_ceil(at[j - 1][0], n))
      if j == len(at) - 1 or not at[j + 1][1]:
        entry.append(n if j == len(at) - 1 else geometric_floor(n, at[j + 1][0]))
    bands.append(entry)
  return bands if any(len(entry) > 1 for entry in bands) else None


def order_by_geometric_mean(rows: Iterable[Row], use: str, names: Sequence[str]) -> list[str]:
  """``names`` fastest first by the geometric mean of their times over the cases every one of
  them ran; an order kept as given where no case ran them all."""
  by_case: dict[tuple[str, str], dict[str, float]] = {}
  for row in rows:
    t = time_of(row, use)
    if t is not None:
      by_case.setdefault((row.op, row.label), {})[row.implementation] = t
  shared = [times for times in by_case.values() if all(n in times for n in names)]
  if not shared:
    return list(names)
  mean = {n: math.fsum(math.log(times[n]) for times in shared) / len(shared) for n in names}
  return sorted(names, key=lambda n: (mean[n], names.index(n)))


def family_module(family: str, part: str):
  return importlib.import_module(f"jaxfuse.ops.{family}.{part}")


def write_rows(family: str, kind: str, values: Mapping[str, Any],
               sources: Mapping[str, list[str]]) -> str:
  """Puts ``values`` into ``family``'s table for GPU ``kind`` (a new one where it has none),
  each row citing its ``sources`` (one run as a string), and returns the table's path."""
  path = tuned.table_path(family, tuned.device_file(kind))
  table = (json.loads(path.read_text()) if path.is_file()
           else {"device": kind, "inherits": None, "rows": {}})
  for name, value in values.items():
    cited = sources[name]
    table["rows"][name] = {"value": value, "source": cited[0] if len(cited) == 1 else cited}
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(table_text(table))
  return str(path)


def table_text(table: Mapping[str, Any]) -> str:
  """``table`` as its file holds it: indented, with lists of numbers or strings on one line
  each."""
  text = json.dumps(table, indent=1)
  # Anchored on the line breaks only indenting writes: a JSON string never holds one.
  return re.sub(r'\[(?:\n *(?:[-+.\deE]+|null|"(?:[^"\\\n]|\\.)*"),?)+\n *\]',
                lambda m: json.dumps(json.loads(m.group(0))), text) + "\n"


def results_dir() -> Path | None:
  """``benchmarks/results/`` of the checkout jaxfuse runs from, where tables cite their runs;
  None for an installed copy, whose tables are not written."""
  results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
  return results if results.is_dir() else None


def cited_path(path: str) -> str | None:
  """``path`` as a table row cites it (relative to the checkout), or None where it does not
  lie in the checkout's ``benchmarks/results/``."""
  results = results_dir()
  full = Path(path).resolve()
  if results is None or results not in full.parents:
    return None
  return full.relative_to(results.parent.parent).as_posix()


def derive_names(family: str) -> list[str]:
  """The names of the rows a whole tuning run of ``family`` derives: its cases, every
  implementation timed alike (also those this machine cannot run)."""
  bench_module = family_module(family, "bench")
  rows = [Row(op=case.op, label=case.label, size=case.size, implementation=name, unit="",
              forward_ms=1.0, train_ms=2.0)
          for case in bench_module.tune_cases() for name in registry.IMPLEMENTATIONS]
  return list(bench_module.tuned_rows(rows))


def ruled_by(family: str, kind: str | None) -> Callable[[Row, str], bool] | None:
  """Whether one of the ``rules`` of ``kind``'s ``family`` table decides a tuning row's calls
  for a use (``'forward'``: evaluated; ``'step'``: either direction of a training step); None
  for a family without ``tune_facts``."""
  facts_of = getattr(family_module(family, "bench"), "tune_facts", None)
  if facts_of is None:
    return None
  table = (tuned.read_table(family, tuned.device_file(kind)) or {}) if kind else {}
  rules = table.get("rules", {}).get("value", [])
  return lambda row, use: any(tuned.matches(rule["when"], facts)
                              for facts in facts_of(row, use) for rule in rules)


def derive(family: str, rows: Sequence[Row], kind: str | None = None) -> dict[str, Any]:
  """The table rows ``family``'s bench module reads from a tuning run's ``rows`` on ``kind``
  (whose table's rules it leaves alone: see :func:`ruled_by`)."""
  bench_module = family_module(family, "bench")
  ruled = ruled_by(family, kind)
  derived = (bench_module.tuned_rows(rows) if ruled is None
             else bench_module.tuned_rows(rows, ruled))
  unknown = set(derived) - set(family_module(family, "api")._untuned())
  if unknown:
    raise ValueError(f"{family}'s tuned_rows gave rows its api does not read: {sorted(unknown)}")
  return derived
