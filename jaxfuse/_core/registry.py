"""Which implementation runs an op: validation of the name, availability, and `None` selection.

Every public op takes ``implementation=`` with one of :data:`IMPLEMENTATIONS` or ``None``. An op
declares the backends it has and, for each, a function that returns ``None`` when the backend can
run on this machine or a sentence saying why not. A backend named by the user that cannot run
raises :class:`NotImplementedError` with that sentence; ``None`` picks the first runnable backend
of the op's preference order, passing over (and logging, on the ``jaxfuse`` logger) those that
cannot run, with their reasons. There is no silent fallback from a named backend.

JAX 0.11 deprecated Pallas's Triton backend and will remove it: where
``jax.experimental.pallas.triton`` cannot be imported, ``'triton'`` reports itself unavailable
and every op runs on its other backends. JAX warns each time it lowers a Triton kernel; users
who leave ``implementation=None`` should not see that for a choice jaxfuse made, so it is
filtered once jaxfuse runs one, and naming ``'triton'`` gives jaxfuse's own warning instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence

import jax

try:
  from jax.experimental.pallas import triton as pallas_triton
except ImportError:  # a JAX without Pallas's Triton backend
  pallas_triton = None

logger = logging.getLogger("jaxfuse")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

IMPLEMENTATIONS = ("xla", "triton", "mosaic", "cuda", "cudnn")

Availability = Callable[[], "str | None"]


def platform() -> str:
  """The platform ops are traced for: ``'cpu'``, ``'gpu'`` or ``'tpu'``."""
  return jax.default_backend()


@functools.cache
def cuda_compute_capability() -> tuple[int, int] | None:
  """(major, minor) of the default CUDA device, or ``None`` when there is none."""
  if platform() != "gpu":
    return None
  capability = getattr(jax.devices()[0], "compute_capability", None)
  if not capability:
    return None
  major, minor = str(capability).split(".")[:2]
  return int(major), int(minor)


@functools.cache
def device_kind() -> str | None:
  """The default GPU's name (``'NVIDIA H100 80GB HBM3'``), which tuned tables are keyed by, or
  None off the GPU."""
  return jax.devices()[0].device_kind if platform() == "gpu" else None


@functools.cache
def num_multiprocessors() -> int:
  """Streaming multiprocessors of the default GPU (a small number on the CPU interpreter)."""
  if platform() != "gpu":
    return 4
  return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def interpret_mode() -> bool:
  """Pallas kernels run in the interpreter on the CPU: how the tests exercise them."""
  return platform() == "cpu"


# Set (to anything but "" or "0"), jaxfuse runs as if Pallas's Triton backend were gone: the
# day JAX removes it, measured and tested today.
WITHOUT_TRITON_VARIABLE = "JAXFUSE_WITHOUT_TRITON"
_without_triton = contextvars.ContextVar("jaxfuse_without_triton", default=False)


def triton_switched_off() -> bool:
  """Whether jaxfuse runs as if Pallas's Triton backend were absent: the environment variable
  :data:`WITHOUT_TRITON_VARIABLE`, or inside :func:`without_triton`."""
  return (_without_triton.get()
          or os.environ.get(WITHOUT_TRITON_VARIABLE, "") not in ("", "0"))


@contextlib.contextmanager
def without_triton():
  """The jaxfuse ops traced inside (in this thread or task) run as if Pallas's Triton backend
  were absent, as ``JAXFUSE_WITHOUT_TRITON=1`` makes them for the whole process. Tracing is
  what it changes: a function jitted and traced outside keeps its trace when called inside,
  and the other way round."""
  token = _without_triton.set(True)
  try:
    yield
  finally:
    _without_triton.reset(token)


def triton_unavailable() -> str | None:
  if pallas_triton is None:
    return (f"the 'triton' implementation runs on Pallas's Triton backend, which this JAX "
            f"({jax.__version__}) does not have (jax.experimental.pallas.triton cannot be "
            f"imported)")
  if triton_switched_off():
    return (f"the 'triton' implementation is switched off ({WITHOUT_TRITON_VARIABLE} is set, "
            f"or inside jaxfuse.without_triton()): jaxfuse runs as if Pallas's Triton backend "
            f"were gone")
  if platform() == "cpu":
    return None
  capability = cuda_compute_capability()
  if capability is None:
    return (f"the 'triton' implementation needs an NVIDIA GPU (or the CPU, where it runs in the "
            f"Pallas interpreter); the default backend here is {platform()!r}")
  if capability < (8, 0):
    return (f"the 'triton' implementation needs compute capability 8.0 or newer; this GPU has "
            f"{capability[0]}.{capability[1]}")
  return None


def xla_available() -> str | None:
  return None


# Pallas's Triton kernels index each dimension in int32 (the lowering widens only the offsets
# it forms from them): every dimension must leave room for the blocks that reach past its end
# (a prefetched block of rows, a chunk of columns).
TRITON_MAX_EXTENT = 2**31 - 2**20


def triton_extents_refusal(view: str, extents) -> str | None:
  """Why a Triton kernel cannot index an array viewed as ``extents``, or None."""
  if max(extents) > TRITON_MAX_EXTENT:
    return (f"the 'triton' kernels index each dimension in int32; {view} {tuple(extents)} has "
            f"one of more than {TRITON_MAX_EXTENT} elements")
  return None


def check_triton_extents(op: str, view: str, extents):
  if reason := triton_extents_refusal(view, extents):
    raise NotImplementedError(f"{op}(implementation='triton'): {reason}")


_TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"


def using_triton(named: bool):
  """Called as an op picks its Triton kernels: JAX's deprecation warning, raised when the
  enclosing jit lowers them, is filtered, and a user who named ``'triton'`` is told once by a
  warning of jaxfuse's own."""
  warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)
  if named and platform() == "gpu":
    _warn_named_triton()


@functools.cache
def _warn_named_triton():
  warnings.warn("implementation='triton' runs on Pallas's Triton backend, which JAX 0.11 "
                "deprecated; implementation=None picks jaxfuse's fastest kernel without it "
                "where one is as fast", DeprecationWarning, stacklevel=_caller_level())


def _caller_level() -> int:
  """warnings.warn's stacklevel of the first frame outside jaxfuse, for the function that
  calls this one."""
  frame, level = sys._getframe(2), 2
  while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
    frame, level = frame.f_back, level + 1
  return level


# Lists held open by :func:`recording` while a call traces: each pass-over and plan of the ops
# inside is appended to every one.
RECORDERS: list[list[tuple]] = []


def record(*event):
  for recorder in RECORDERS:
    recorder.append(event)


@contextlib.contextmanager
def recording():
  """Collects, in the list it yields, what the ops traced inside decide: ``("passed over",
  op, name, reason)`` and ``("plan", op, implementation, plan)``."""
  events: list[tuple] = []
  RECORDERS.append(events)
  try:
    yield events
  finally:
    RECORDERS.remove(events)


def runs(op: str, name: str, check: Availability) -> bool:
  """Whether backend ``name`` can run, by ``check()``; a reason it cannot is logged once."""
  reason = check()
  if reason is not None:
    _passed_over(op, name, reason)
    record("passed over", op, name, reason)
  return reason is None


@functools.cache
def _passed_over(op: str, name: str, reason: str):
  logger.info("%s(implementation=None) passed over %r: %s", op, name, reason)


def resolve(op: str, implementation: str | None, backends: Mapping[str, Availability],
            preference: Sequence[str]) -> str:
  """Validates ``implementation`` for ``op`` and returns the backend name to run.

  Args:
    op: public name of the op, for messages.
    implementation: the user's argument.
    backends: the op's backends, each with its availability check.
    preference: backend names in the order ``None`` should try them (fastest first).
  """
  if implementation is None:
    for name in preference:
      if runs(op, name, backends[name]):
        return name
    raise NotImplementedError(f"{op}: no implementation can run on this machine")
  if not isinstance(implementation, str):
    raise TypeError(f"{op}: implementation must be a string or None, got "
                    f"{type(implementation).__name__} {implementation!r}")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{op}: unknown implementation {implementation!r}; expected one of "
                     f"{', '.join(map(repr, IMPLEMENTATIONS))} or None")
  if implementation not in backends:
    raise NotImplementedError(
        f"{op} has no {implementation!r} implementation; it has "
        f"{', '.join(map(repr, backends))} (or None for the fastest available)")
  reason = backends[implementation]()
  if reason is not None:
    raise NotImplementedError(f"{op}(implementation={implementation!r}) cannot run here: {reason}")
  return implementation
