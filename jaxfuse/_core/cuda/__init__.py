"""jaxfuse's CUDA kernels: built with nvcc on first use, registered as XLA FFI targets.

A kernel family ships its ``.cu`` source next to its Python wrapper. :func:`load` compiles it for
this GPU's architecture (once per source, nvcc, jax version and GPU: the shared library is
cached under ``$JAXFUSE_CACHE`` or ``~/.cache/jaxfuse``), loads it and registers its handlers.
Nothing is built at import time, and nothing at all off a GPU.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

import jax

from jaxfuse._core import registry

_HERE = Path(__file__).parent

UNIT = 8  # elements per 16-byte (or, for float32, 32-byte) vector
MAX_CLUSTER = 16  # CTAs; non-portable above 8, an H100 launches up to 16
MAX_THREADS = 512


@dataclasses.dataclass(frozen=True)
class Tiling:
  """A row is held by ``cluster`` CTAs of ``threads`` threads, ``units`` 8-element units each,
  fed through ``stages`` shared-memory stages, or through registers when 0 (rows.cuh). With
  ``lanes`` (a power of two up to 32), a short row is held by that many lanes of one warp
  instead, and each CTA of ``threads`` holds ``threads // lanes`` rows (rows.cuh LaneSlice)."""
  cluster: int
  threads: int
  units: int
  stages: int = 0
  lanes: int = 0

  @property
  def capacity(self) -> int:
    if self.lanes:
      return self.lanes * self.units * UNIT
    return self.cluster * self.threads * self.units * UNIT

  def check(self, n_cols: int):
    if self.lanes and (self.lanes & (self.lanes - 1) or self.lanes > 32 or self.cluster != 1
                       or self.threads % 32):
      raise ValueError(f"{self}: a short-row tiling takes a power of two up to 32 lanes, whole "
                       f"warps and no cluster")
    if self.capacity < n_cols:
      raise ValueError(f"{self} holds {self.capacity} elements of a row, fewer than its {n_cols}")


def longest_row(units_choices) -> int:
  """Elements of the longest row 16 CTAs of 512 threads hold at the widest of these slices."""
  return MAX_CLUSTER * MAX_THREADS * max(units_choices) * UNIT


def tiling(n_cols: int, units_choices, *, min_cluster: int = 1, max_cluster: int = MAX_CLUSTER,
           max_threads: int = MAX_THREADS, stages: int = 0) -> Tiling | None:
  """The first ``units`` per thread at which ``max_cluster`` CTAs of at most ``max_threads``
  threads hold the row: the smallest such cluster of at least ``min_cluster`` CTAs, trimmed to
  the fewest threads (whole warps) that still cover it."""
  n_units = math.ceil(n_cols / UNIT)
  for units in units_choices:
    cluster = min(max_cluster, max(min_cluster, math.ceil(n_units / (max_threads * units))))
    threads = 32 * math.ceil(n_units / (cluster * units) / 32)
    if threads <= max_threads:
      return Tiling(cluster, threads, units, stages)
  return None


def short_tiling(n_cols: int, units_choices, *, threads: int = 256) -> Tiling | None:
  """The first ``units`` per thread at which one warp holds the row, on the fewest lanes (a
  power of two) that cover it, then trimmed to the fewest of ``units_choices`` those lanes
  need, in CTAs of ``threads``."""
  n_units = math.ceil(n_cols / UNIT)
  for units in units_choices:
    lanes = 1 << max(0, math.ceil(n_units / units) - 1).bit_length()
    if lanes <= 32:
      units = min(u for u in units_choices if lanes * u >= n_units)
      return Tiling(1, threads, units, 0, lanes)
  return None


@functools.cache
def nvcc() -> str | None:
  """Path of nvcc: ``$JAXFUSE_NVCC``, then ``PATH``, then ``$CUDA_HOME``, then /usr/local/cuda."""
  candidates = [os.environ.get("JAXFUSE_NVCC"), shutil.which("nvcc")]
  candidates += [str(Path(root) / "bin" / "nvcc")
                 for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if root]
  return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def unavailable() -> str | None:
  """Why the 'cuda' kernels cannot run here, or ``None``."""
  if registry.platform() != "gpu":
    return (f"the 'cuda' implementation needs an NVIDIA GPU; the default backend here is "
            f"{registry.platform()!r}")
  capability = registry.cuda_compute_capability()
  if capability is None or capability < (9, 0):
    found = "no CUDA device" if capability is None else f"compute capability {capability}"
    return (f"the 'cuda' kernels split rows across thread-block clusters, which need compute "
            f"capability 9.0 (Hopper) or newer; found {found}")
  if nvcc() is None:
    return ("the 'cuda' kernels are built on first use and nvcc was not found (set JAXFUSE_NVCC "
            "or put CUDA's bin directory on PATH)")
  return None


def _cache_dir() -> Path:
  root = os.environ.get("JAXFUSE_CACHE") or Path.home() / ".cache" / "jaxfuse"
  return Path(root) / "cuda"


def _build(source: Path, arch: str) -> Path:
  compiler = nvcc()
  version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
  headers = sorted(_HERE.glob("*.cuh"))
  digest = hashlib.sha256()
  for part in [source.read_bytes()] + [h.read_bytes() for h in headers]:
    digest.update(part)
  digest.update(f"{version}{jax.__version__}{arch}".encode())
  target = _cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"
  if target.exists():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  # Built beside the target and renamed into place, so concurrent builders never see half a file.
  fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
  os.close(fd)
  command = [compiler, "-O3", "-std=c++17", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC",
             # XLA's FFI headers trip two harmless nvcc front-end warnings.
             "-diag-suppress", "940,2473", "-I", jax.ffi.include_dir(), "-I", str(_HERE),
             "-o", partial, str(source)]
  result = subprocess.run(command, capture_output=True, text=True)
  if result.returncode != 0:
    os.unlink(partial)
    raise RuntimeError(f"building {source.name} failed:\n{' '.join(command)}\n{result.stderr}")
  os.replace(partial, target)
  return target


@functools.cache
def _load(source: Path, handlers: tuple[tuple[str, str], ...]) -> ctypes.CDLL:
  major, minor = registry.cuda_compute_capability()
  library = ctypes.CDLL(str(_build(source, f"sm_{major}{minor}")))
  for target, symbol in handlers:
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                platform="CUDA")
  return library


def load(source: Path, handlers: Mapping[str, str]) -> ctypes.CDLL:
  """Builds (once) and loads ``source``; registers ``{ffi target name: handler symbol}``."""
  reason = unavailable()
  if reason is not None:
    raise NotImplementedError(reason)
  return _load(Path(source), tuple(sorted(handlers.items())))
