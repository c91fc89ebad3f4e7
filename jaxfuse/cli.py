"""Command line: ``jaxfuse bench [family-or-op ...] [--regret] [--json PATH] [--plot PATH]``,
``jaxfuse tune FAMILY [--write] [--json PATH] [--resume]`` and ``jaxfuse build [--arch sm_90]``."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib
import itertools
import json
import os
import sys
import time
from pathlib import Path

from jaxfuse._core import bench, registry, report, tune, tuned

# Op families with a bench spec module exposing ``cases(quick) -> list[Case]``,
# ``regret_cases() -> list[Case]``, ``tune_cases() -> list[Case]`` and ``tuned_rows(rows)``;
# one with a grid against other libraries adds ``grid_cases()``, ``grid_place(label)`` and
# its ``COMPARATORS``; one with CUDA kernels names their modules in ``CUDA_LIBRARIES``.
FAMILIES = {
    "norm": "jaxfuse.ops.norm.bench",
    "softmax": "jaxfuse.ops.softmax.bench",
    "linear_cross_entropy": "jaxfuse.ops.linear_cross_entropy.bench",
    "attention": "jaxfuse.ops.attention.bench",
    "rnn": "jaxfuse.ops.rnn.bench",
    "mlp": "jaxfuse.ops.mlp.bench",
}
# The copy kernels the ceilings time, beside the families' own CUDA libraries.
COPIES = "jaxfuse._core.cuda.copies"
# Seconds of calls a --quick timing spans (timing.MIN_SECONDS otherwise).
QUICK_SECONDS = 0.1


def _cases(names, quick, mode):
  """``(family, case)`` of the selected cases in :data:`FAMILIES`' order, and unknown names."""
  cases = []
  for family, module in FAMILIES.items():
    spec = importlib.import_module(module)
    if mode == "grid":
      family_cases = spec.grid_cases() if hasattr(spec, "grid_cases") else []
    else:
      family_cases = spec.regret_cases() if mode == "regret" else spec.cases(quick)
    cases += [(family, c) for c in family_cases
              if not names or family in names or c.op in names]
  unknown = [n for n in names if n not in FAMILIES and not any(c.op == n for _, c in cases)]
  return cases, unknown


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="jaxfuse")
  parser.add_argument("--version", action="version", version=_version())
  sub = parser.add_subparsers(dest="command", required=True)
  b = sub.add_parser("bench", help="check every op against float64 and time it on this device")
  b.add_argument("ops", nargs="*", help=f"families ({', '.join(FAMILIES)}) or op names; "
                                        "default: all")
  b.add_argument("--json", metavar="PATH", help="save the numbers with device, date, versions")
  b.add_argument("--plot", metavar="PATH", help="save a PNG of rate against size")
  b.add_argument("--quick", action="store_true", help="a few sizes only")
  b.add_argument("--regret", action="store_true",
                 help="None against every implementation over grids past the tuned shapes: "
                      "per point the fastest named time over None's, the worst and the "
                      "geometric mean (--plot draws the regrets)")
  b.add_argument("--impl", help="comma-separated implementations to run (default: all)")
  b.add_argument("--sizes", help="comma-separated problem sizes (the plots' x values) to keep")
  b.add_argument("--only", action="append", metavar="TEXT",
                 help="keep the cases whose label contains TEXT (repeatable; a space at "
                      "either end matches the label's start or end)")
  b.add_argument("--grid", action="store_true",
                 help="a family's grid against other libraries (rnn: batch x hidden per "
                      "cell, dtype and layout): None's ratio to the faster comparator per "
                      "point, the worst and the geometric mean (--plot draws heat maps)")
  b.add_argument("--without-triton", action="store_true",
                 help="beside None's row, None as if Pallas's Triton backend were gone (as "
                      f"{registry.WITHOUT_TRITON_VARIABLE}=1 runs the whole process), and per "
                      "point None's time over that row's")
  b.add_argument("--graph-every-program", action="store_true",
                 help="let XLA run every timed program as a CUDA graph, as the steps of a "
                      "model are (XLA graphs only programs of several kernels by default)")
  b.add_argument("--resume", action="store_true",
                 help="with --json: keep the cases that run already timed (same GPU, timing "
                      "and mode) and time the rest into it: a run cut short goes on where it "
                      "stopped")
  b.add_argument("--from", dest="recorded", action="append", metavar="RUN",
                 help="with --grid or --regret: the report (and --plot) of saved runs of "
                      "that mode, one GPU and one timing, instead of timing (repeatable: a "
                      "long grid timed in parts; a point in several takes the last run's)")
  t = sub.add_parser("tune", help="time a family's implementations across its dispatch "
                                  "thresholds on this GPU (every program as a CUDA graph) "
                                  "and derive its tuned-table rows")
  t.add_argument("family", choices=tuple(FAMILIES))
  t.add_argument("--json", metavar="PATH",
                 help="where the run is saved (default: DATE-GPU-tune-FAMILY.json in the "
                      "checkout's benchmarks/results/, else here)")
  t.add_argument("--write", action="store_true",
                 help="put the rows into jaxfuse/ops/FAMILY/tuned/GPU.json, citing the run")
  t.add_argument("--only", action="append", metavar="TEXT",
                 help="time only the cases whose label contains TEXT (repeatable; a space at "
                      "either end matches the label's start or end), to split a long run; "
                      "--from writes the rows from the parts together")
  t.add_argument("--from", dest="recorded", action="append", metavar="RUN",
                 help="derive the rows from saved tuning runs of this family (repeatable; no "
                      "GPU needed; a point in several takes the last one's times) instead of "
                      "timing one")
  t.add_argument("--resume", action="store_true",
                 help="with --json: keep the cases that run already timed (same GPU and "
                      "timing) and time the rest into it: a run cut short goes on where it "
                      "stopped")
  c = sub.add_parser("build", help="build the CUDA kernels now (for an image to bake in), "
                                   "into $JAXFUSE_CACHE or ~/.cache/jaxfuse")
  c.add_argument("--arch", help="GPU architecture, e.g. sm_90 (default: this machine's GPU)")
  args = parser.parse_args(argv)
  if args.command == "build":
    return _build(args.arch)
  if args.command == "tune":
    if args.recorded:
      if args.json or args.only or args.resume:
        parser.error("--from reads saved runs: --json, --only and --resume choose what to "
                     "time")
      return _tune_from(args.family, args.recorded, args.write)
    if args.resume and not args.json:
      # The default path is dated: a run resumed the next day would start over.
      parser.error("--resume goes on with the run saved at --json: name it")
    if args.only and args.write:
      # A part's rows hold only its cases and would replace the table's whole rows.
      parser.error("--write takes a whole run: time the parts with --only, then write the "
                   "rows from them together with --from PART --from PART ...")
    # Tables choose for a model's step, which runs as a graph: small problems timed without
    # one measure their launches.
    _graph_every_program()
    return _tune(args.family, args.json, args.write, args.only, args.resume)

  if args.recorded:
    if not (args.grid or args.regret) or args.grid and args.regret:
      parser.error("--from reports saved runs of --grid or of --regret: ask for one")
    timing = [name for name, given in (("--json", args.json), ("--only", args.only),
                                       ("--sizes", args.sizes), ("--impl", args.impl),
                                       ("--quick", args.quick),
                                       ("--without-triton", args.without_triton),
                                       ("--graph-every-program", args.graph_every_program),
                                       ("--resume", args.resume))
              if given]
    if timing or args.ops:
      parser.error(f"--from reads saved runs and times nothing: drop "
                   f"{', '.join(timing + (['the ops'] if args.ops else []))}")
    return _report_from(args.recorded, "grid" if args.grid else "regret", args.plot)
  if args.graph_every_program:
    _graph_every_program()
  if args.grid:
    # PyTorch's rows allocate beside JAX's, which by default takes most of the GPU at start
    # and would leave them too little at the grid's largest points.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if args.regret and args.grid:
    parser.error("--regret and --grid are two different reports: ask for one")
  mode = "regret" if args.regret else "grid" if args.grid else "cases"
  tagged, unknown = _cases(args.ops, args.quick, mode)
  if args.without_triton:
    tagged = [(family, dataclasses.replace(c, implementations=_beside_default(c.implementations)))
              for family, c in tagged]
  cases = [c for _, c in tagged]
  if mode == "grid" and not cases:
    parser.error("--grid: only rnn (lstm, gru) has a grid")
  if unknown:
    parser.error(f"unknown op or family: {', '.join(unknown)}")
  if args.sizes:
    try:
      keep = {int(v) for v in args.sizes.split(",")}
    except ValueError:
      parser.error(f"--sizes takes comma-separated integers, got {args.sizes!r}")
    cases = [c for c in cases if c.size in keep]
  if args.only:
    cases = _only(cases, args.only)
  impls = args.impl.split(",") if args.impl else None
  if impls and args.without_triton and bench.DEFAULT in impls:
    impls.append(bench.DEFAULT_WITHOUT_TRITON)
  offered = {i for c in cases for i in (*c.implementations, *c.check_only, *c.external)}
  if impls and (unknown := [i for i in impls if i not in offered]):
    parser.error(f"--impl: {', '.join(unknown)} is not among the selected cases' "
                 f"implementations ({', '.join(sorted(offered))})")
  if not cases:
    parser.error("no case is left after --sizes/--only: nothing to run")
  if args.resume and not args.json:
    parser.error("--resume goes on with the run saved at --json: name it")
  on_gpu = registry.platform() == "gpu"
  env = bench.environment()
  earlier, ceilings = [], {}
  if args.resume:
    resumed = _resumed("bench", args.json, cases, "GPU, timing method, XLA_FLAGS, mode",
                       lambda r: (r.get("device"), r.get("timing"), r.get("xla_flags"),
                                  _mode_of(r)),
                       (env["device"], env["timing"], env["xla_flags"], mode))
    if resumed is None:
      return 2
    earlier, ceilings, cases = resumed
  family_of = {id(c): family for family, c in tagged}
  # A cold cache's builds go on beside the families that need none of them.
  built = (_load_libraries({family_of[id(c)] for c in cases}, impls, wait=False) if on_gpu
           else lambda family: True)
  print(f"jaxfuse bench on {env['device']} (jax {env['jax_version']}, {env['date']}); "
        f"timing: {env['timing']}")
  if not on_gpu:
    print("No GPU here: XLA is timed, the Pallas kernels are only checked in the interpreter. "
          "Kernel timings need a GPU.")

  def regrets(rows):
    return _regrets(rows, mode) if mode != "cases" else []

  def no_triton_regrets(rows):
    return report.regrets(rows, against=bench.DEFAULT.__eq__,
                          subject=bench.DEFAULT_WITHOUT_TRITON)

  def save(rows, ceilings):
    found = regrets(rows)
    extra = ({"regrets": [{**vars(r), "by_choice": r.by_choice} for r in found]}
             if mode != "cases" else {})
    if mode == "grid":
      extra["against"] = sorted(_comparators())
    if args.without_triton:
      extra["without_triton"] = [{**vars(r), "by_choice": r.by_choice}
                                 for r in no_triton_regrets(rows)]
    report.save_json(args.json, rows, ceilings, **extra)

  # Each family's table is printed as soon as it is done.
  rows = earlier
  for group in _ready_first(_consecutive(cases, lambda c: family_of[id(c)]),
                            lambda group: built(family_of[id(group[0])])):
    done = len(rows)
    on_case = (lambda so_far, c: save(rows[:done] + so_far, c)) if args.json else None
    group_rows, ceilings = bench.run(group, implementations=impls, on_case=on_case,
                                     ceilings=ceilings,
                                     min_seconds=QUICK_SECONDS if args.quick else None)
    rows += group_rows
    print(report.table(group_rows, ceilings), flush=True)
  found = regrets(rows)
  if mode != "cases":
    _print_regrets(found, mode, rows)
  if args.without_triton:
    print("\nNone without Pallas Triton: None's time over its time as if Triton were gone "
          "(below 1: slower without)\n"
          + report.regret_table(no_triton_regrets(rows), subject="no Triton"))
  if args.json:
    save(rows, ceilings)
    print(f"saved {args.json}")
  if args.plot:
    drawn = (_plot_regrets(args.plot, found, mode) if mode != "cases"
             else report.save_plot(args.plot, rows, ceilings))
    print(f"saved {args.plot}" if drawn else f"nothing to plot: {args.plot} not written")
  # A jaxfuse kernel that is wrong or broke fails the job; an implementation this machine
  # lacks, or a comparator that is not installed, does not.
  failed = [r for r in rows if r.note.startswith("FAILED")]
  for r in failed:
    print(f"FAILED: {r.op} {r.label} {r.implementation}: {r.note}", file=sys.stderr)
  return 1 if failed else 0


def _grid_specs():
  return [spec for spec in map(importlib.import_module, FAMILIES.values())
          if hasattr(spec, "grid_cases")]


def _comparators() -> set[str]:
  """The other libraries' rows that a grid weighs None against."""
  return {name for spec in _grid_specs() for name in spec.COMPARATORS}


def _regrets(rows, mode: str):
  """None's ratio per point to the faster comparator (grid) or to the fastest named
  implementation (regret)."""
  if mode == "grid":
    return report.regrets(rows, against=_comparators().__contains__)
  return report.regrets(rows)


def _print_regrets(found, mode: str, rows):
  if mode == "grid":
    print(f"\nNone against the faster of {', '.join(sorted(_comparators()))}: that one's time "
          f"over None's (above 1: None faster)")
  print("\n" + report.regret_table(found))
  if mode == "grid":
    for against in sorted(_comparators()):
      if any(r.implementation == against and r.train_temp_mib for r in rows):
        print(f"\nThe training step's temporary memory, None's over {against}'s peak (below "
              f"1: None needs less)\n" + report.memory_table(rows, against))


def _plot_regrets(path: str, found, mode: str) -> bool:
  if mode == "grid":
    places = {c.op: spec.grid_place for spec in _grid_specs() for c in spec.grid_cases()}
    return report.save_heatmaps(path, found, lambda r: places[r.op](r.label))
  return report.save_regret_plot(path, found)


def _resumed(command: str, path: str, cases, what: str, facts, here):
  """The rows and ceilings of the run saved at ``path`` (none where there is no file yet) and
  the ``cases`` it did not time; None, said why, where ``facts(record)`` (the ``what`` of the
  run) differ from ``here``."""
  if not os.path.exists(path):
    print(f"no run at {path} yet: timing every case into it")
    return [], {}, cases
  record = json.loads(Path(path).read_text())
  if facts(record) != here:
    print(f"jaxfuse {command} --resume: {path} was timed otherwise ({what}): "
          f"{facts(record)}, here {here}", file=sys.stderr)
    return None
  earlier = [bench.Row(**row) for row in record["rows"]]
  # A case's rows are saved together once all its implementations ran.
  timed = {(row.op, row.label) for row in earlier}
  left = [c for c in cases if (c.op, c.label) not in timed]
  print(f"resuming {path}: {len(timed)} cases timed, {len(left)} left")
  return earlier, record.get("ceilings") or {}, left


def _mode_of(record) -> str:
  """'grid', 'regret' or 'cases': the kind of bench run a saved record is."""
  if "against" in record or " --grid" in record.get("command", ""):
    return "grid"
  return "regret" if "regrets" in record else "cases"


def _report_from(paths: list[str], mode: str, plot: str | None) -> int:
  """The grid's or regret's report of saved runs: each point's rows from the last run that
  timed it (a ratio is never taken across runs), all of one GPU and one timing."""
  points, sources = {}, set()
  for path in paths:
    record = json.loads(Path(path).read_text())
    if _mode_of(record) != mode:
      print(f"jaxfuse bench --from: {path} is not a run of --{mode}", file=sys.stderr)
      return 2
    sources.add((record["device"], record.get("timing"), record.get("xla_flags")))
    by_point = {}
    for row in record["rows"]:
      by_point.setdefault((row["op"], row["label"]), []).append(bench.Row(**row))
    replaced = len(points.keys() & by_point.keys())
    points.update(by_point)
    again = f", {replaced} of them timed again" if replaced else ""
    count = f"{len(by_point)} shape{'s' if len(by_point) != 1 else ''}"
    print(f"{path}: {count}{again} ({record['device']}, jax "
          f"{record['jax_version']}, {record['date']}, XLA_FLAGS={record.get('xla_flags')!r})")
  if len(sources) != 1:
    print(f"jaxfuse bench --from: the runs differ in GPU or timing (method, XLA_FLAGS): "
          f"{sorted(sources, key=str)}", file=sys.stderr)
    return 2
  rows = [row for rows in points.values() for row in rows]
  found = _regrets(rows, mode)
  _print_regrets(found, mode, rows)
  if plot:
    drawn = _plot_regrets(plot, found, mode)
    print(f"saved {plot}" if drawn else f"nothing to plot: {plot} not written")
  return 0


def _beside_default(implementations):
  """``implementations`` with None's row without Triton after None's."""
  out = []
  for impl in implementations:
    out += [impl] + ([bench.DEFAULT_WITHOUT_TRITON] if impl == bench.DEFAULT else [])
  return tuple(out)


def _consecutive(items, key):
  """``items`` in runs of equal ``key``, in order."""
  return [list(run) for _, run in itertools.groupby(items, key)]


def _ready_first(items, ready, poll_s: float = 0.2):
  """``items`` in order, save that each time the first left is not ``ready`` the first that
  is comes before it (once none is, the first to become so)."""
  left = list(items)
  while left:
    while not (chosen := next((item for item in left if ready(item)), None)):
      time.sleep(poll_s)
    left.remove(chosen)
    yield chosen


def _version() -> str:
  import jax
  import jaxfuse
  return f"jaxfuse {jaxfuse.__version__} (jax {jax.__version__})"


def _tune(family: str, path: str | None, write: bool, only: list[str] | None,
          resume: bool = False) -> int:
  kind = registry.device_kind()
  if kind is None:
    print("jaxfuse tune: tuned tables are per GPU kind, and there is no GPU here",
          file=sys.stderr)
    return 2
  env = bench.environment()
  part = "-part" if only else ""
  name = f"{env['date'][:10]}-{tuned.device_file(kind)}-tune-{family}{part}.json"
  path = path or os.path.join(tune.results_dir() or ".", name)
  if write and tune.cited_path(path) is None:
    return _uncitable(path)
  cases = importlib.import_module(FAMILIES[family]).tune_cases()
  if only:
    cases = _only(cases, only)
  print(f"jaxfuse tune {family} on {kind} (jax {env['jax_version']}, {env['date']})")
  earlier, ceilings = [], {}
  if resume:
    resumed = _resumed("tune", path, cases, "family, GPU, timing method, XLA_FLAGS",
                       lambda r: (r.get("tune_family"), r.get("device_kind"), r.get("timing"),
                                  r.get("xla_flags")),
                       (family, kind, env["timing"], env["xla_flags"]))
    if resumed is None:
      return 2
    earlier, ceilings, cases = resumed
  _load_libraries({family} if cases else set())
  # Saved after each case: a run cut short still gives its rows to --from and --resume.
  save = lambda so_far, ceilings, **extra: report.save_json(
      path, earlier + so_far, ceilings, tune_family=family, device_kind=kind, **extra)
  new_rows, ceilings = bench.run(cases, on_case=save, ceilings=ceilings)
  rows = earlier + new_rows
  print(report.table(rows, ceilings))
  values = tune.derive(family, rows, kind)
  save(new_rows, ceilings, tuned_rows=values)
  print(f"saved {path}")
  return _tuned_rows(family, kind, rows, values, dict.fromkeys(values, [path]), write)


def _tune_from(family: str, paths: list[str], write: bool) -> int:
  # A point timed again by a later run (a part run over a cut-short one) takes its new times.
  rows, kinds = {}, set()
  for path in paths:
    record = json.loads(Path(path).read_text())
    if (record.get("tune_family") or _family_by_rows(record)) != family:
      print(f"jaxfuse tune --from: {path} is not a tuning run of {family}", file=sys.stderr)
      return 2
    if write and tune.cited_path(path) is None:
      return _uncitable(path)
    kinds.add(record.get("device_kind") or record["gpu"]["kind"])
    rows.update({(row["op"], row["label"], row["implementation"]): (path, bench.Row(**row))
                 for row in record["rows"]})
    print(f"jaxfuse tune {family} from {path} ({record['device']}, jax "
          f"{record['jax_version']}, {record['date']})")
  if len(kinds) != 1:
    print(f"jaxfuse tune --from: the runs are of several GPUs: {sorted(kinds)}",
          file=sys.stderr)
    return 2
  kept = list(rows.values())
  timed = [row for _, row in kept]
  kind = kinds.pop()
  values = tune.derive(family, timed, kind)
  return _tuned_rows(family, kind, timed, values, _sources(family, kind, paths, kept, values),
                     write)


def _sources(family: str, kind: str, paths: list[str], kept, values: dict
             ) -> dict[str, list[str]]:
  """The runs each derived row cites: those whose kept rows (``(path, row)``, not timed
  again by a later run) alone derive it otherwise than no rows do; all runs with kept rows
  where none does (a row whose value is also its default)."""
  own = {path: [row for p, row in kept if p == path] for path in paths}
  holding = [path for path in paths if own[path]]
  empty = tune.derive(family, [], kind)
  alone = {path: tune.derive(family, own[path], kind) for path in holding}
  missing = object()
  return {name: [path for path in holding
                 if alone[path].get(name, missing) != empty.get(name, missing)] or holding
          for name in values}


def _family_by_rows(record) -> str | None:
  """The family of a run saved before records named it, by the rows it derived: all of one
  family's, or else the one family whose rows share any (its rows changed since)."""
  derived = set(record.get("tuned_rows") or ())
  names = {family: set(tune.derive_names(family)) for family in FAMILIES}
  exact = [family for family, rows in names.items() if derived == rows]
  sharing = [family for family, rows in names.items() if derived & rows]
  return exact[0] if exact else sharing[0] if len(sharing) == 1 else None


def _graph_every_program():
  # Read when JAX starts its GPU backend, which nothing before the call has asked for yet.
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_gpu_graph_min_graph_size=1" not in flags.split():
    os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_graph_min_graph_size=1".strip()


def _only(cases, texts: list[str]):
  """The cases whose label, between spaces, contains one of ``texts``: ' 8x' matches the
  labels that start with 8x and not 2048x."""
  return [c for c in cases if any(text in f" {c.label} " for text in texts)]


def _uncitable(path: str) -> int:
  print(f"jaxfuse tune --write: a table cites a run in the checkout's benchmarks/results/ "
        f"(jaxfuse run from a git checkout); {path} is not there", file=sys.stderr)
  return 2


def _tuned_rows(family: str, kind: str, rows, values: dict, sources: dict[str, list[str]],
                write: bool) -> int:
  """Prints the rows beside what ``kind``'s table holds now and, with ``write``, puts them in
  it unless an implementation failed its check in ``rows``."""
  before = {name: row["value"] for name, row in
            (tuned.read_table(family, tuned.device_file(kind)) or {}).items()}
  print(f"\nrows for {family} on {kind}:")
  for name, value in values.items():
    was = ("(the same as the table's)" if before.get(name) == value
           else f"(the table's: {json.dumps(before[name])})" if name in before
           else "(not in the table)")
    print(f"  {name}: {json.dumps(value)} {was}")
  failed = [r for r in rows if tune.failed(r)]
  for r in failed:
    print(f"FAILED: {r.op} {r.label} {r.implementation}: {r.note}", file=sys.stderr)
  for r in filter(tune.unchecked, rows):
    print(f"untimed: {r.op} {r.label} {r.implementation}: {r.note}", file=sys.stderr)
  if write and failed:
    print("jaxfuse tune --write: not written, an implementation failed its check",
          file=sys.stderr)
  elif write:
    cited = {name: [tune.cited_path(path) for path in paths] for name, paths in sources.items()}
    print(f"wrote {tune.write_rows(family, kind, values, cited)}")
  return 1 if failed else 0


def cuda_libraries(families=tuple(FAMILIES)) -> list[str]:
  """The modules (each declares its ``LIBRARY``) of the CUDA libraries ``families`` run, and
  the ceilings' copies."""
  modules = {COPIES}
  for family in families:
    modules.update(getattr(importlib.import_module(FAMILIES[family]), "CUDA_LIBRARIES", ()))
  return sorted(modules)


def _load_libraries(families, implementations=None, *, wait: bool = True):
  """Loads the CUDA libraries that ``families``' cases run (unless ``implementations`` names
  none that can run them) and the copy kernels the ceilings time, side by side: left to each
  op's first use, a cold cache waits for one nvcc after another. A library that fails keeps
  its reason for the ops that need it. With ``wait=False`` the builds go on in the background
  (an op that needs one waits for it); the result says whether a family's libraries, and
  the copies, are loaded."""
  running_cuda = {"cuda", "cudnn", bench.DEFAULT, bench.DEFAULT_WITHOUT_TRITON}
  if implementations is not None and not running_cuda & set(implementations):
    families = ()
  modules = cuda_libraries(families)
  pool = concurrent.futures.ThreadPoolExecutor(len(modules))
  loads = {module: pool.submit(importlib.import_module(module).LIBRARY.unavailable)
           for module in modules}
  pool.shutdown(wait=wait)
  return lambda family: all(loads[module].done() for module in cuda_libraries((family,))
                            if module in loads)


def _build(arch: str | None) -> int:
  from jaxfuse._core.cuda import build
  if arch is None:
    reason = build.unavailable()
    if reason is not None:
      print(f"jaxfuse build: {reason}; name the architecture with --arch to build without "
            f"a GPU", file=sys.stderr)
      return 1
    arch = build.gpu_arch()
  number = build.arch_number(arch)
  if number is None or number < 80:
    print(f"jaxfuse build: the 'cuda' kernels need sm_80 (Ampere) or newer, or compute_80 or "
          f"newer for PTX; got --arch {arch!r}", file=sys.stderr)
    return 2
  libraries = []
  for library in (importlib.import_module(module).LIBRARY for module in cuda_libraries()):
    if number < library.min_arch:
      continue
    if library.flags() is None:
      print(f"jaxfuse build: {library.source.name} left out: {build.VENDORS[library.vendor][1]}",
            file=sys.stderr)
    else:
      libraries.append(library)
  # Each build is an nvcc process: they run side by side.
  with concurrent.futures.ThreadPoolExecutor(len(libraries)) as pool:
    builds = [(library, pool.submit(build.build, library.source, arch, None, library.flags()))
              for library in libraries]
  failed = False
  for library, future in builds:
    try:
      print(f"{library.source.name} for {arch}: {future.result()}")
    except RuntimeError as e:
      print(f"jaxfuse build: {e}", file=sys.stderr)
      failed = True
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
