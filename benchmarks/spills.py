"""Registers and spills of each CUDA kernel as ptxas reports them, on any machine with nvcc (no
GPU needed):

    PYTHONPATH=. python benchmarks/spills.py SOURCE [--arch sm_90] [--all] [--only TEXT]

compiles SOURCE (e.g. ``jaxfuse/ops/norm/cuda/norm.cu``) with the build's flags to a cubin
under ``-Xptxas -v`` and prints, per kernel that spills (every kernel with ``--all``; those
whose name holds TEXT with ``--only``), its registers, spill stores and loads and its template
arguments. A kernel held to 64 registers by its launch bounds spills what its rows do not fit:
local-memory traffic beside the rows' own, which a change to a kernel's registers shows here
before any GPU times it.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from jaxfuse._core.cuda import build


def report(source: Path, arch: str) -> list[tuple[str, int, int, int]]:
  """``(kernel, registers, spill store bytes, spill load bytes)`` of each kernel in ``source``."""
  toolchain = build.find_toolchain()
  if toolchain is None:
    raise SystemExit(build.NO_NVCC)
  with tempfile.TemporaryDirectory() as tmp:
    command = [f for f in build._command(toolchain, source, arch, f"{tmp}/k.cubin")
               if f != "-shared"]
    result = subprocess.run(command[:1] + ["-cubin", "-Xptxas", "-v"] + command[1:],
                            capture_output=True, text=True)
  if result.returncode:
    raise SystemExit(result.stderr)
  kernels, name = [], None
  for line in result.stderr.splitlines():
    if m := re.search(r"Compiling entry function '(\S+)'", line):
      name = m.group(1)
    elif name and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
      stores, loads = int(m.group(1)), int(m.group(2))
    elif name and (m := re.search(r"Used (\d+) registers", line)):
      kernels.append((name, int(m.group(1)), stores, loads))
      name = None
  return kernels


def demangled(names: list[str]) -> list[str]:
  if not shutil.which("c++filt"):
    return names
  out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True,
                       text=True).stdout.splitlines()
  # The kernel and its template arguments, without the namespaces and parameters.
  return [re.sub(r"^.*::(\w+<.*>)\(.*$", r"\1", d) for d in out]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("source", type=Path)
  parser.add_argument("--arch", default="sm_90")
  parser.add_argument("--all", action="store_true", help="every kernel, not only those that spill")
  parser.add_argument("--only", default="", help="kernels whose name holds this text")
  args = parser.parse_args(argv)
  kernels = report(args.source, args.arch)
  names = demangled([k[0] for k in kernels])
  shown = [(n, *k[1:]) for n, k in zip(names, kernels)
           if args.only in n and (args.all or k[2] or k[3])]
  for name, registers, stores, loads in sorted(shown, key=lambda k: -(k[2] + k[3])):
    print(f"{registers:4d} registers {stores:5d} B spilled {loads:5d} B reloaded  {name}")
  spilling = sum(1 for k in kernels if k[2] or k[3])
  print(f"{len(kernels)} kernels for {args.arch}, {spilling} spill")


if __name__ == "__main__":
  main()
