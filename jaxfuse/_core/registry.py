"""Which implementation runs an op: validation of the name, availability, and `None` selection.

Every public op takes ``implementation=`` with one of :data:`IMPLEMENTATIONS` or ``None``. An op
declares the backends it has and, for each, a function that returns ``None`` when the backend can
run on this machine or a sentence saying why not. A backend named by the user that cannot run
raises :class:`NotImplementedError` with that sentence; ``None`` picks the first runnable backend
of the op's preference order. There is no silent fallback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import jax

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
def num_multiprocessors() -> int:
  """Streaming multiprocessors of the default GPU (a small number on the CPU interpreter)."""
  if platform() != "gpu":
    return 4
  return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def interpret_mode() -> bool:
  """Pallas kernels run in the interpreter on the CPU: how the tests exercise them."""
  return platform() == "cpu"


def triton_unavailable() -> str | None:
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
      if backends[name]() is None:
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
