"""What ``jaxfuse bench`` prints and saves: tables, JSON, plots, and the regret of ``None``.

The regret of ``implementation=None`` at a point (a case, forward or training step) is the time
of the fastest implementation named there divided by the time of what None ran: 1 where None
picked the fastest, below 1 by the share it lost. A point is launch-bound where None's span is
more than twice its busy time: the GPU waited on the host between kernels, which a call inside
a larger program (the host running ahead) would not.

The regret by choice counts 1 at a point where None ran the very implementation that was
fastest there: two timings of one program differ only by the GPU's run-to-run spread, and what
the bar asks of None is the choice.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence

from jaxfuse._core import device
from jaxfuse._core.bench import (DEFAULT, DEFAULT_WITHOUT_TRITON, L2_MULTIPLE, Row, environment,
                                 is_comparator)
from jaxfuse._core.timing import timing_method


def _fmt(v, spec):
  return "" if v is None else format(v, spec)


def _pct(row, value):
  timed = row.forward_ms is not None
  return "cache" if timed and row.cache_resident else _fmt(value, "6.1f")


def table(rows: Sequence[Row], ceilings: dict) -> str:
  """Plain-text tables, one per op."""
  out = []
  units = {r.unit for r in rows}
  if "copy GB/s" in ceilings and "GB/s" in units:
    out.append(f"copy ceiling: {ceilings['copy GB/s']:.0f} GB/s by {ceilings['copy']}, the best "
               f"of: " + ", ".join(f"{k} {v:.0f}" for k, v in ceilings["copies GB/s"].items()))
  if "matmul TFLOP/s" in ceilings and "TFLOP/s" in units:
    out.append(f"matmul ceiling: {ceilings['matmul TFLOP/s']:.0f} TFLOP/s (bf16 8192^3)")
  gpu = device.describe()
  if gpu is not None:
    out.append(f"'cache' in %ceil: the forward moves under {L2_MULTIPLE}x the L2 "
               f"({gpu.l2_bytes / 2**20:.0f} MiB), so its rate is not quoted against the copy")
  out.append(f"ms: {timing_method()}; busy: the kernels' union")
  for op in dict.fromkeys(r.op for r in rows):
    op_rows = [r for r in rows if r.op == op]
    unit = op_rows[0].unit
    lw = max(28, *(len(r.label) for r in op_rows))
    iw = max(8, *(len(r.implementation) for r in op_rows))
    header = (f"{'shape':<{lw}} {'impl':<{iw}} {'fwd ms':>8} {'busy':>8} {'fwd ' + unit:>12} "
              f"{'%ceil':>6} {'step ms':>8} {'busy':>8} {'step ' + unit:>13} {'%ceil':>6} "
              f"{'temp MiB':>9} {'err fwd':>9} {'err step':>9} {'size copy':>10}")
    out += ["", f"## {op}", header, "-" * len(header)]
    for r in op_rows:
      line = (f"{r.label:<{lw}} {r.implementation:<{iw}} {_fmt(r.forward_ms, '8.3f'):>8} "
              f"{_fmt(r.forward_busy_ms, '8.3f'):>8} "
              f"{_fmt(r.forward_rate, '12.1f'):>12} {_pct(r, r.forward_pct):>6} "
              f"{_fmt(r.train_ms, '8.3f'):>8} {_fmt(r.train_busy_ms, '8.3f'):>8} "
              f"{_fmt(r.train_rate, '13.1f'):>13} "
              f"{_pct(r, r.train_pct):>6} {_fmt(r.train_temp_mib, '9.1f'):>9} "
              f"{_fmt(r.forward_error, '9.1e'):>9} {_fmt(r.train_error, '9.1e'):>9} "
              f"{_fmt(r.size_copy_rate, '10.0f'):>10}")
      if r.steps and r.forward_ms is not None:
        line += (f"  {r.forward_ms * 1e3 / r.steps:.2f}/"
                 f"{_fmt(r.train_ms and r.train_ms * 1e3 / r.steps, '.2f')} us/step")
      out.append(line + (f"  {r.note}" if r.note else ""))
  return "\n".join(out)


def save_json(path: str, rows: Sequence[Row], ceilings: dict, **extra):
  record = dict(environment(), ceilings=ceilings, rows=[dataclasses.asdict(r) for r in rows],
                **extra)
  # Written beside and moved over: a run killed mid-write (a time limit) keeps its last save.
  with open(f"{path}.tmp", "w") as f:
    json.dump(record, f, indent=1)
  os.replace(f"{path}.tmp", path)


def save_plot(path: str, rows: Sequence[Row], ceilings: dict) -> bool:
  """Rate against problem size per implementation, forward and training step, one row per op;
  False where there is nothing to draw (no file written)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ops = list(dict.fromkeys(r.op for r in rows if r.forward_rate is not None))
  if not ops:
    return False
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
  return True


# None's span over its busy time past which a point is launch-bound.
LAUNCH_BOUND = 2.0


@dataclasses.dataclass(frozen=True)
class Regret:
  op: str
  label: str
  direction: str  # "forward" or "step"
  regret: float  # fastest named time / None's time
  fastest: str
  fastest_ms: float
  default_ms: float
  launch_bound: bool
  ran: str | None = None  # what None ran there (see Row.forward_ran)
  fastest_ran: str | None = None  # what the fastest row ran there
  chosen_ms: float | None = None  # the time of the named row of what None ran, if one is

  @property
  def by_choice(self) -> float:
    """What None's choice alone costs, apart from its own row's timing noise (the same program
    timed apart): the fastest named time over that of the named row of what None ran; where
    no row is that, 1 if the fastest row ran what None ran, else the regret."""
    if self.chosen_ms:
      return self.fastest_ms / self.chosen_ms
    return 1.0 if self.ran is not None and self.ran == self.fastest_ran else self.regret


def regrets(rows: Sequence[Row], against: Callable[[str], bool] | None = None,
            subject: str = DEFAULT) -> list[Regret]:
  """None's regret at every case and direction where it and a named implementation ran, or
  where ``against`` is given, one of the implementations it accepts (comparators). ``subject``:
  the row weighed (:data:`DEFAULT_WITHOUT_TRITON` against None's, say)."""
  if against is None:
    against = lambda impl: (impl not in (DEFAULT, DEFAULT_WITHOUT_TRITON)
                            and not is_comparator(impl))
  out = []
  busy = {"forward": "forward_busy_ms", "step": "train_busy_ms"}
  ran = {"forward": "forward_ran", "step": "train_ran"}
  for key in dict.fromkeys((r.op, r.label) for r in rows):
    case_rows = [r for r in rows if (r.op, r.label) == key]
    default = next((r for r in case_rows if r.implementation == subject), None)
    if default is None:
      continue
    for direction, field in (("forward", "forward_ms"), ("step", "train_ms")):
      named = {r.implementation: getattr(r, field) for r in case_rows
               if against(r.implementation) and getattr(r, field) is not None}
      ran_by = {r.implementation: getattr(r, ran[direction]) for r in case_rows}
      ms = getattr(default, field)
      if named and ms is not None:
        fastest = min(named, key=named.get)
        busy_ms = getattr(default, busy[direction])
        out.append(Regret(*key, direction, named[fastest] / ms, fastest, named[fastest], ms,
                          busy_ms is not None and ms > LAUNCH_BOUND * busy_ms,
                          ran_by[subject], ran_by[fastest], named.get(ran_by[subject])))
  return out


def regret_table(found: Sequence[Regret], subject: str = "None") -> str:
  """Each point's regret and what ``subject`` (the row weighed) ran there, then per op and
  over all, of every point, of each use's (the forward's, the training step's), of those not
  launch-bound and by choice: the worst point and the geometric mean."""
  if not found:
    return f"regret: no point where {subject} and a row it is weighed against both ran"
  width = max(28, *(len(r.label) for r in found))
  ran_width = max(len(subject) + 4, *(len(r.ran or "") for r in found))
  header = (f"{'op':<24} {'shape':<{width}} {'use':<8} {'regret':>7} {'fastest':<8} "
            f"{subject + ' ran':<{ran_width}} {'ms':>9} {subject + ' ms':>9}")
  out = [header, "-" * len(header)]
  out += [f"{r.op:<24} {r.label:<{width}} {r.direction:<8} {r.regret:7.3f} {r.fastest:<8} "
          f"{r.ran or '':<{ran_width}} {r.fastest_ms:9.4f} {r.default_ms:9.4f}"
          f"{'  launch-bound' if r.launch_bound else ''}"
          for r in found]
  out.append("")
  timed = lambda r: r.regret
  chosen = lambda r: r.by_choice
  for op in list(dict.fromkeys(r.op for r in found)) + [None]:
    points = [r for r in found if op is None or r.op == op]
    for which, subset, value in (("", points, timed),
                                 *((f" ({use} only)", [r for r in points if r.direction == use],
                                    timed) for use in ("forward", "step")),
                                 (" (not launch-bound)",
                                  [r for r in points if not r.launch_bound], timed),
                                 (" (by choice)", points, chosen)):
      if not subset:
        continue
      worst = min(subset, key=value)
      mean = math.exp(sum(math.log(value(r)) for r in subset) / len(subset))
      out.append(f"{op or 'all':<24} worst {value(worst):.3f} ({worst.label} "
                 f"{worst.direction}, {worst.fastest}), geometric mean {mean:.3f} over "
                 f"{len(subset)} points{which}")
  return "\n".join(out)


def memory_table(rows: Sequence[Row], against: str) -> str:
  """The training step's temporary memory of None's row over ``against``'s at each point
  where both have it: per op and over all, the geometric mean and the points where None needs
  the most and the least beside it."""
  mib = {}
  for key in dict.fromkeys((r.op, r.label) for r in rows):
    temp = {r.implementation: r.train_temp_mib for r in rows if (r.op, r.label) == key}
    if temp.get(DEFAULT) and temp.get(against):
      mib[key] = temp[DEFAULT], temp[against]
  if not mib:
    return f"step memory: no point where None and {against} both have it"
  ratio = lambda key: mib[key][0] / mib[key][1]
  point = lambda key: (f"{ratio(key):.2f} ({key[1]}: {mib[key][0]:.1f} MiB against "
                       f"{mib[key][1]:.1f})")
  out = []
  for op in list(dict.fromkeys(op for op, _ in mib)) + [None]:
    keys = [key for key in mib if op is None or key[0] == op]
    mean = math.exp(sum(math.log(ratio(key)) for key in keys) / len(keys))
    out.append(f"{op or 'all':<24} geometric mean {mean:.2f} over {len(keys)} points, most "
               f"{point(max(keys, key=ratio))}, least {point(min(keys, key=ratio))}")
  return "\n".join(out)


def save_regret_plot(path: str, found: Sequence[Regret]) -> bool:
  """Regret per point, one panel per op, forward and step side by side."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ops = list(dict.fromkeys(r.op for r in found))
  if not ops:
    return False
  fig, axes = plt.subplots(len(ops), 1, figsize=(11, 3.2 * len(ops)), squeeze=False)
  for (ax,), op in zip(axes, ops):
    labels = list(dict.fromkeys(r.label for r in found if r.op == op))
    for offset, direction in ((-0.2, "forward"), (0.2, "step")):
      points = {r.label: r.regret for r in found if r.op == op and r.direction == direction}
      xs = [i + offset for i, label in enumerate(labels) if label in points]
      ax.bar(xs, [points[label] for label in labels if label in points], width=0.4,
             label=direction)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylim(min(0.5, min(r.regret for r in found)), max(1.05, max(r.regret for r in found)))
    ax.set_title(f"{op}: fastest named time / None's time")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return True


def save_heatmaps(path: str, found: Sequence[Regret],
                  place: Callable[[Regret], tuple]) -> bool:
  """One heat map per panel and use: ``place(point)`` gives a point's panel, row (batch) and
  column (hidden); the colour is its regret (above 1: None faster)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  maps = {}
  for r in found:
    panel, row, col = place(r)
    maps.setdefault((panel, r.direction), {})[row, col] = r.regret
  if not maps:
    return False
  columns = 2
  fig, axes = plt.subplots(-(-len(maps) // columns), columns, squeeze=False,
                           figsize=(6 * columns, 4.2 * -(-len(maps) // columns)))
  for ax in axes.flat[len(maps):]:
    ax.set_visible(False)
  for ax, ((panel, direction), points) in zip(axes.flat, maps.items()):
    rows = sorted({r for r, _ in points})
    cols = sorted({c for _, c in points})
    grid = np.full((len(rows), len(cols)), np.nan)
    for (r, c), value in points.items():
      grid[rows.index(r), cols.index(c)] = value
    image = ax.imshow(np.log2(grid), cmap="RdYlGn", vmin=-2, vmax=2, origin="lower")
    for (i, j), value in np.ndenumerate(grid):
      if not np.isnan(value):
        ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("hidden")
    ax.set_ylabel("batch")
    ax.set_title(f"{panel} {direction}", fontsize=9)
    fig.colorbar(image, ax=ax, label="log2 ratio")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return True
