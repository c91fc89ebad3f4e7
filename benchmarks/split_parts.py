"""Deals a tuning run or a grid out to the GPUs of one host, as parts for
``benchmarks/run_on_gpus.sh``:

    PYTHONPATH=. python benchmarks/split_parts.py GPUS NAME tune FAMILY [--only TEXT ...] \\
        [--skip TEXT ...]
    PYTHONPATH=. python benchmarks/split_parts.py GPUS NAME bench FAMILY --grid \\
        [--impl A,B] [--graph-every-program] [--only TEXT ...] [--skip TEXT ...]

prints a ``GPU|command`` line per GPU: ``jaxfuse`` timing its share of the selected cases (those
with a label that holds an ``--only`` text and no ``--skip`` text, each named by its label)
into ``benchmarks/results/NAME-pGPU.json`` with ``--resume``, so a part cut short goes on where
it stopped. The cases are dealt by their work, the largest first, each to
the GPU with the least so far. Run it on the GPU host: a grid's cases depend on the platform.
``KIND`` in NAME is left for run_on_gpus.sh to fill in; the parts are reported together with
``jaxfuse tune FAMILY --from ...`` or ``jaxfuse bench --grid --from ...``.
"""

from __future__ import annotations

import argparse
import heapq
import importlib
import shlex

from jaxfuse import cli


def deal(cases, gpus: int) -> list[list[str]]:
  """The labels of ``cases`` in ``gpus`` shares of about equal cost. A part selects its cases by
  label, which several ops may share (softmax and cross-entropy rows of one shape), so a label
  goes whole to one GPU. A case costs a compile and a check of its own (1) and its time, up to
  four more for the largest of them."""
  largest = max((c.forward_work for c in cases), default=0) or 1
  costs = {}
  for case in cases:
    costs[case.label] = costs.get(case.label, 0) + 1 + 4 * case.forward_work / largest
  shares = [[] for _ in range(gpus)]
  loads = [(0.0, gpu) for gpu in range(gpus)]
  for label in sorted(costs, key=costs.get, reverse=True):
    load, gpu = heapq.heappop(loads)
    shares[gpu].append(label)
    heapq.heappush(loads, (load + costs[label], gpu))
  return shares


def commands(gpus: int, name: str, command: str, family: str, *, impl: str | None = None,
             graph_every_program: bool = False, only: list[str] | None = None,
             skip: list[str] | None = None) -> list[tuple[int, list[str]]]:
  """``(GPU, argv)`` of each part that has cases: ``command`` ``'tune'`` (the family's tuning
  grid) or ``'bench'`` (its grid against other libraries)."""
  if command == "tune":
    cases = importlib.import_module(cli.FAMILIES[family]).tune_cases()
    base = ["python", "-m", "jaxfuse", "tune", family]
  else:
    cases = [case for _, case in cli._cases([family], False, "grid")[0]]
    base = ["python", "-m", "jaxfuse", "bench", family, "--grid"]
    base += ["--graph-every-program"] if graph_every_program else []
  if only:
    cases = cli._only(cases, only)
  if skip:
    cases = [case for case in cases if not cli._only([case], skip)]
  parts = []
  for gpu, share in enumerate(deal(cases, gpus)):
    if not share:
      continue
    argv = list(base)
    if impl:
      offered = {i for c in cases if c.label in share for i in (*c.implementations, *c.external)}
      argv += ["--impl", ",".join(i for i in impl.split(",") if i in offered)]
    # Spaces at both ends: the whole label, not one that holds it ("LSTM 4x" in "LSTM 64x").
    for label in share:
      argv += ["--only", f" {label} "]
    parts.append((gpu, argv + ["--json", f"benchmarks/results/{name}-p{gpu}.json", "--resume"]))
  return parts


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("gpus", type=int)
  parser.add_argument("name", help="the parts' file names: benchmarks/results/NAME-pGPU.json")
  parser.add_argument("command", choices=("tune", "bench"))
  parser.add_argument("family", choices=tuple(cli.FAMILIES))
  parser.add_argument("--grid", action="store_true")
  parser.add_argument("--impl", help="comma-separated, as jaxfuse bench takes it")
  parser.add_argument("--graph-every-program", action="store_true")
  parser.add_argument("--only", action="append", metavar="TEXT")
  parser.add_argument("--skip", action="append", metavar="TEXT")
  args = parser.parse_args(argv)
  if args.command == "bench" and not args.grid:
    parser.error("bench parts split a grid: give --grid")
  if args.command == "tune" and (args.grid or args.impl or args.graph_every_program):
    parser.error("tune times its own grid, every program a graph: drop the bench options")
  parts = commands(args.gpus, args.name, args.command, args.family, impl=args.impl,
                   graph_every_program=args.graph_every_program, only=args.only,
                   skip=args.skip)
  if not parts:
    parser.error("no case is left after --only and --skip: nothing to split")
  for gpu, command in parts:
    print(f"{gpu}|{shlex.join(command)}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
