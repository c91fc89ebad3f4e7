"""Building jaxfuse's CUDA sources with nvcc and registering their handlers as XLA FFI targets.

A kernel family declares a :class:`Library` (its ``.cu`` source and ``{FFI target: handler
symbol}``). The first use builds it for this GPU's architecture, or takes it from the cache
(``$JAXFUSE_CACHE`` or ``~/.cache/jaxfuse``), keyed by everything that goes into the binary:
sources and headers, flags, XLA's FFI headers, the nvcc and host compiler versions, jax's
version and the architecture. One process builds while the others wait on a file lock; a
build prints one line on stderr when it starts and one when it ends, is stopped after
``$JAXFUSE_BUILD_TIMEOUT`` seconds (default 1200), and leaves no partial file behind. A failed
build is remembered for the process: :meth:`Library.unavailable` then reports it, so
``implementation=None`` moves on and ``'cuda'`` raises it, without running nvcc again.
``jaxfuse build`` builds every library ahead of time (for an image to bake in).

The architecture is this GPU's (``sm_90`` on an H100), or ``$JAXFUSE_CUDA_ARCH``:
``compute_80`` builds PTX of the path a GPU before Hopper runs (no thread-block clusters: a row
in one CTA), which the driver compiles for the GPU at hand, so a Hopper GPU tests that path.

nvcc is looked for in ``$JAXFUSE_NVCC``, on ``PATH``, in ``$CUDA_HOME``, ``/usr/local/cuda``,
then in the NVIDIA wheels that ``pip install "jax[cuda13]"`` (or ``cuda12``) brings into
site-packages (``nvidia/cu13/bin/nvcc`` beside ``nvidia/cu13/include`` and ``lib``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import os
import re
import shutil
import site
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import jax

from jaxfuse._core import registry

_HERE = Path(__file__).parent
DEFAULT_TIMEOUT_S = 1200.0
DEFAULT_TOOLKIT = "/usr/local/cuda"
# nvcc's flags, beside the architecture, the include directories and the paths in and out.
# XLA's FFI headers trip two harmless nvcc front-end warnings.
FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-diag-suppress", "940,2473")
# Where NVIDIA's pip wheels put the toolkit, relative to a site-packages directory: CUDA 13's
# wheels share one prefix; CUDA 12's either that or one directory per component.
_WHEEL_LAYOUTS = (
    ("nvidia/cu13/bin/nvcc", ("nvidia/cu13/include",), ("nvidia/cu13/lib",)),
    ("nvidia/cu12/bin/nvcc", ("nvidia/cu12/include",), ("nvidia/cu12/lib",)),
    ("nvidia/cuda_nvcc/bin/nvcc", ("nvidia/cuda_nvcc/include", "nvidia/cuda_runtime/include"),
     ("nvidia/cuda_runtime/lib",)),
)


@dataclasses.dataclass(frozen=True)
class Toolchain:
  """An nvcc and what it needs beyond its own defaults: the include and library directories
  of a wheel layout (empty for a toolkit installed as a whole)."""
  nvcc: str
  include_dirs: tuple[str, ...] = ()
  library_dirs: tuple[str, ...] = ()

  def link_flags(self) -> tuple[str, ...]:
    """A wheel layout may ship the CUDA runtime only as ``libcudart.so.N``; link that file
    itself then (the process has it loaded already, through jax's CUDA plugin)."""
    flags = tuple(f"-L{d}" for d in self.library_dirs)
    if not self.library_dirs or any((Path(d) / "libcudart_static.a").exists()
                                    for d in self.library_dirs):
      return flags
    shared = sorted(p for d in self.library_dirs for p in Path(d).glob("libcudart.so*"))
    return flags + (("--cudart=none", "-Xlinker", str(shared[0])) if shared else ())


def _site_dirs() -> list[Path]:
  dirs = [Path(p) for p in sys.path if p]
  with contextlib.suppress(AttributeError):
    dirs += [Path(p) for p in site.getsitepackages()]
  with contextlib.suppress(AttributeError):
    dirs.append(Path(site.getusersitepackages()))
  return list(dict.fromkeys(dirs))


def _executable(path) -> bool:
  return bool(path) and os.path.isfile(path) and os.access(path, os.X_OK)


def find_toolchain(site_dirs=None) -> Toolchain | None:
  """The first nvcc of ``$JAXFUSE_NVCC``, ``PATH``, ``$CUDA_HOME/bin``, ``DEFAULT_TOOLKIT/bin``
  and the NVIDIA wheels under ``site_dirs`` (default: this interpreter's ``sys.path``)."""
  for candidate in (os.environ.get("JAXFUSE_NVCC"), shutil.which("nvcc"),
                    *(os.path.join(root, "bin", "nvcc")
                      for root in (os.environ.get("CUDA_HOME"), DEFAULT_TOOLKIT) if root)):
    if _executable(candidate):
      return Toolchain(str(candidate))
  for root in (_site_dirs() if site_dirs is None else [Path(d) for d in site_dirs]):
    for nvcc, includes, libraries in _WHEEL_LAYOUTS:
      if _executable(root / nvcc):
        existing = lambda dirs: tuple(str(root / d) for d in dirs if (root / d).is_dir())
        return Toolchain(str(root / nvcc), existing(includes), existing(libraries))
  return None


@functools.cache
def _toolchain() -> Toolchain | None:
  return find_toolchain()


NO_NVCC = ("nvcc was not found (set JAXFUSE_NVCC, put CUDA's bin directory on PATH, or pip "
           "install nvidia-cuda-nvcc and nvidia-cuda-runtime, which 'jax[cuda13]' brings)")


ARCH_VARIABLE = "JAXFUSE_CUDA_ARCH"
# Thread-block clusters, which split a long row over several CTAs, from this architecture on.
CLUSTERS_FROM = 90
MAX_CLUSTER = 16  # CTAs; non-portable above 8, an H100 launches up to 16


def arch_number(arch: str) -> int | None:
  """``'sm_90'``, ``'sm_90a'`` or ``'compute_80'`` -> 90 or 80; None for anything else."""
  match = re.fullmatch(r"(?:sm|compute)_(\d+)a?", arch)
  return int(match.group(1)) if match else None


def _forced_arch() -> str | None:
  arch = os.environ.get(ARCH_VARIABLE)
  if arch and (arch_number(arch) or 0) < 80:
    raise ValueError(f"{ARCH_VARIABLE}={arch!r}: expected sm_XY or compute_XY of 80 or newer")
  return arch or None


def unavailable() -> str | None:
  """Why no CUDA kernel can run here (no GPU of compute capability 8.0 or newer, no nvcc), or
  ``None``."""
  if registry.platform() != "gpu":
    return (f"the 'cuda' implementation needs an NVIDIA GPU; the default backend here is "
            f"{registry.platform()!r}")
  capability = registry.cuda_compute_capability()
  if capability is None or capability < (8, 0):
    found = "no CUDA device" if capability is None else f"compute capability {capability}"
    return (f"the 'cuda' kernels need compute capability 8.0 (Ampere) or newer; found {found}")
  if (arch_number(gpu_arch()) or 0) > 10 * capability[0] + capability[1]:
    return (f"{ARCH_VARIABLE}={gpu_arch()} is newer than this GPU (compute capability "
            f"{capability[0]}.{capability[1]})")
  if _toolchain() is None:
    return f"the 'cuda' kernels are built on first use and {NO_NVCC}"
  return None


def gpu_arch() -> str:
  """The architecture the kernels are built for: ``$JAXFUSE_CUDA_ARCH``, else this GPU's."""
  if forced := _forced_arch():
    return forced
  major, minor = registry.cuda_compute_capability()
  return f"sm_{major}{minor}"


def cluster_limit() -> int:
  """The most CTAs of a cluster the kernels built here may use: :data:`MAX_CLUSTER`, or 1 (the
  CTA alone) for an architecture before Hopper (a forced one included); :data:`MAX_CLUSTER`
  with no GPU, where nothing runs."""
  if _forced_arch() is None and registry.cuda_compute_capability() is None:
    return MAX_CLUSTER
  return MAX_CLUSTER if arch_number(gpu_arch()) >= CLUSTERS_FROM else 1


def _version(command) -> str:
  try:
    return subprocess.run([*command, "--version"], capture_output=True, text=True,
                          timeout=60).stdout
  except (OSError, subprocess.SubprocessError):
    return "unknown"


@functools.cache
def _ffi_headers_digest() -> str:
  digest = hashlib.sha256()
  root = Path(jax.ffi.include_dir())
  for path in sorted(p for p in root.rglob("*") if p.is_file()):
    digest.update(str(path.relative_to(root)).encode())
    digest.update(path.read_bytes())
  return digest.hexdigest()


@functools.cache
def _compiler_versions(toolchain: Toolchain) -> str:
  host = os.environ.get("NVCC_CCBIN") or shutil.which("c++") or shutil.which("g++") or "c++"
  return _version([toolchain.nvcc]) + _version([host])


@functools.cache
def splits_compilation(nvcc: str) -> bool:
  """Whether this nvcc can spread a file's device compilation (its many kernel instantiations,
  through the compiler and the assembler) over several threads."""
  try:
    usage = subprocess.run([nvcc, "--help"], capture_output=True, text=True, timeout=60).stdout
  except (OSError, subprocess.SubprocessError):
    return False
  return "--split-compile" in usage


def compile_threads() -> int:
  """Threads each nvcc splits its device compilation over: this machine's CPUs shared by the
  four or five family libraries that build side by side (``jaxfuse build``, the bench)."""
  return max(1, (os.cpu_count() or 1) // 4)


def _command(toolchain: Toolchain, source: Path, arch: str, output: str,
             extra: tuple[str, ...] = (), threads: int = 1) -> list[str]:
  """nvcc's command line; ``threads`` above 1 splits the device compilation where this nvcc
  can, which leaves the binary as it is (so the cache key leaves it out)."""
  includes = [f"-I{d}" for d in (jax.ffi.include_dir(), _HERE, *toolchain.include_dirs)]
  split = ([f"--split-compile={threads}"]
           if threads > 1 and splits_compilation(toolchain.nvcc) else [])
  return [toolchain.nvcc, *FLAGS, *split, f"-arch={arch}", *includes, *toolchain.link_flags(),
          *extra, "-o", output, str(source)]


def find_cudnn(site_dirs=None) -> tuple[str, ...] | None:
  """nvcc's flags to compile and link against cuDNN 9: the wheel that ``jax[cuda13]`` (or
  ``cuda12``) brings (``nvidia/cudnn``, whose library has only its versioned name), else a
  toolkit's or the system's; None: not found."""
  for root in (_site_dirs() if site_dirs is None else [Path(d) for d in site_dirs]):
    home = root / "nvidia" / "cudnn"
    if (home / "include" / "cudnn.h").is_file() and (home / "lib" / "libcudnn.so.9").exists():
      return (f"-I{home / 'include'}", f"-L{home / 'lib'}", "-l:libcudnn.so.9", "-Xlinker",
              f"-rpath={home / 'lib'}")
  for include in (os.environ.get("CUDA_HOME"), DEFAULT_TOOLKIT, "/usr"):
    if include and (Path(include) / "include" / "cudnn.h").is_file():
      return (f"-I{Path(include) / 'include'}", "-lcudnn")
  return None


NO_CUDNN = ("cuDNN 9 was not found (pip install nvidia-cudnn-cu13, which 'jax[cuda13]' brings, "
            "or a cuDNN under CUDA_HOME)")

# cuBLASLt as the CUDA 13 and 12 wheels lay it out (the library under its versioned name only).
_CUBLAS_WHEELS = (("nvidia/cu13", "libcublasLt.so.13"), ("nvidia/cu12", "libcublasLt.so.12"),
                  ("nvidia/cublas", "libcublasLt.so.12"))


def find_cublaslt(site_dirs=None) -> tuple[str, ...] | None:
  """nvcc's flags to compile and link against cuBLASLt: the wheel that ``jax[cuda13]`` (or
  ``cuda12``) brings, which XLA itself loads, else a toolkit's; None: not found."""
  for root in (_site_dirs() if site_dirs is None else [Path(d) for d in site_dirs]):
    for home, library in _CUBLAS_WHEELS:
      home = root / home
      if (home / "include" / "cublasLt.h").is_file() and (home / "lib" / library).exists():
        return (f"-I{home / 'include'}", f"-L{home / 'lib'}", f"-l:{library}", "-Xlinker",
                f"-rpath={home / 'lib'}")
  for toolkit in (os.environ.get("CUDA_HOME"), DEFAULT_TOOLKIT):
    if toolkit and (Path(toolkit) / "include" / "cublasLt.h").is_file():
      lib = Path(toolkit) / "lib64"
      return (f"-I{Path(toolkit) / 'include'}", f"-L{lib}", "-lcublasLt", "-Xlinker",
              f"-rpath={lib}")
  return None


NO_CUBLASLT = ("cuBLASLt was not found (pip install nvidia-cublas, which 'jax[cuda13]' brings, "
               "or a CUDA toolkit under CUDA_HOME)")

# The vendor libraries a family may link: how to find each, and what to say when it is missing.
VENDORS = {"cudnn": (find_cudnn, NO_CUDNN), "cublaslt": (find_cublaslt, NO_CUBLASLT)}


@functools.cache
def _vendor_flags(vendor: str) -> tuple[str, ...] | None:
  return VENDORS[vendor][0]()


def cache_key(source: Path, arch: str, toolchain: Toolchain, extra: tuple[str, ...] = ()) -> str:
  """A digest of everything the built library depends on."""
  digest = hashlib.sha256()
  # Headers by name and contents in an order of their names, and the command without this
  # tree's path: a copy of the same sources elsewhere (an installed package, another checkout)
  # shares the cache.
  by_name = lambda paths: sorted(paths, key=lambda path: path.name)
  headers = dict.fromkeys(by_name([*source.parent.glob("*.cuh"), *source.parent.glob("*.h")])
                          + by_name(_HERE.glob("*.cuh")))
  for path in (source, *headers):
    digest.update(path.name.encode())
    digest.update(path.read_bytes())
  flags = [("-I<jaxfuse>" if flag == f"-I{_HERE}" else flag)
           for flag in _command(toolchain, Path(source.name), arch, "OUT", extra)]
  digest.update("\0".join(flags).encode())
  digest.update(_ffi_headers_digest().encode())
  digest.update(_compiler_versions(toolchain).encode())
  digest.update(f"{jax.__version__}\0{arch}".encode())
  return digest.hexdigest()[:20]


def cache_dir() -> Path:
  root = os.environ.get("JAXFUSE_CACHE") or Path.home() / ".cache" / "jaxfuse"
  return Path(root) / "cuda"


def _timeout_s() -> float:
  value = os.environ.get("JAXFUSE_BUILD_TIMEOUT")
  try:
    return float(value) if value else DEFAULT_TIMEOUT_S
  except ValueError:
    raise ValueError(f"JAXFUSE_BUILD_TIMEOUT must be a number of seconds, got {value!r}") \
        from None


def _say(message: str):
  print(f"jaxfuse: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _exclusive(lock_path: Path, what: str):
  """Holds ``lock_path`` exclusively; says so when another process holds it first."""
  with open(lock_path, "a") as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      _say(f"waiting for another process building {what}")
      fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def build(source: Path, arch: str, toolchain: Toolchain | None = None,
          extra: tuple[str, ...] = ()) -> Path:
  """The shared library of ``source`` for ``arch`` (e.g. ``'sm_90'``), with nvcc's ``extra``
  flags: from the cache, or built now. Raises RuntimeError when nvcc fails or runs out of
  time."""
  toolchain = toolchain or _toolchain()
  if toolchain is None:
    raise RuntimeError(NO_NVCC)
  source = Path(source)
  target = cache_dir() / f"{source.stem}-{arch}-{cache_key(source, arch, toolchain, extra)}.so"
  if target.exists():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  with _exclusive(target.with_suffix(".lock"), source.name):
    if target.exists():  # built by the process that held the lock
      return target
    # Built beside the target and renamed into place: no reader ever sees half a library.
    fd, partial = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".partial",
                                   dir=target.parent)
    os.close(fd)
    command = _command(toolchain, source, arch, partial, extra, compile_threads())
    timeout = _timeout_s()
    _say(f"building {source.name} for {arch} with {toolchain.nvcc} (once; cached in "
         f"{target.parent})")
    start = time.monotonic()
    try:
      result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
      if result.returncode != 0:
        raise RuntimeError(f"building {source.name} failed:\n{' '.join(command)}\n"
                           f"{result.stderr.strip()}")
      os.replace(partial, target)
    except subprocess.TimeoutExpired:
      raise RuntimeError(f"building {source.name} took longer than {timeout:.0f} s "
                         f"(JAXFUSE_BUILD_TIMEOUT)") from None
    finally:
      with contextlib.suppress(FileNotFoundError):
        os.unlink(partial)
    _say(f"built {source.name} in {time.monotonic() - start:.1f} s")
  return target


class Library:
  """One CUDA source of a kernel family and the FFI targets its handlers register, built for
  architectures from ``min_arch`` (90: tested on Hopper only), linked against ``vendor`` (a
  key of :data:`VENDORS`) where given."""

  def __init__(self, source: Path, handlers: Mapping[str, str], min_arch: int = 80,
               vendor: str | None = None):
    if vendor is not None and vendor not in VENDORS:
      raise ValueError(f"vendor must be one of {sorted(VENDORS)} or None, got {vendor!r}")
    self.source = Path(source)
    self.handlers = dict(handlers)
    self.min_arch = min_arch
    self.vendor = vendor
    self._library: ctypes.CDLL | None = None
    self._failure: str | None = None
    self._lock = threading.Lock()

  def unavailable(self) -> str | None:
    """Why this library cannot run here, or ``None`` once it is built, loaded and registered
    (which this call does on first use)."""
    reason = unavailable()
    if reason is not None:
      return reason
    if arch_number(gpu_arch()) < self.min_arch:
      return (f"{self.source.name} is built for sm_{self.min_arch} or newer, not "
              f"{gpu_arch()}")
    if self.flags() is None:
      return VENDORS[self.vendor][1]
    with self._lock:
      if self._library is None and self._failure is None:
        try:
          self._load()
        except Exception as e:  # noqa: BLE001  (any failure to build or load is a reason)
          self._failure = f"{type(e).__name__}: {e}"
    return self._failure

  def flags(self) -> tuple[str, ...] | None:
    """nvcc's flags beside the common ones; None where the vendor library it links was not
    found."""
    return _vendor_flags(self.vendor) if self.vendor else ()

  def load(self) -> ctypes.CDLL:
    """The loaded library, its handlers registered; NotImplementedError saying why not."""
    reason = self.unavailable()
    if reason is not None:
      raise NotImplementedError(reason)
    return self._library

  def _load(self):
    library = ctypes.CDLL(str(build(self.source, gpu_arch(), extra=self.flags())))
    for target, symbol in self.handlers.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                  platform="CUDA")
    self._library = library
