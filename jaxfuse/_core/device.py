"""What the default GPU is made of: name, compute capability, SMs, shared memory, L2 and DRAM.

Read from the CUDA driver (``libcuda``, which any working NVIDIA GPU has) through ctypes, so
nothing needs building; JAX's device object tells the name and SM count but not the caches.
Off a GPU, or where the driver cannot be asked, :func:`describe` returns ``None``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import jax

from jaxfuse._core import registry

# CUdevice_attribute values (cuda.h), stable across CUDA releases.
_MULTIPROCESSOR_COUNT = 16
_MEMORY_CLOCK_RATE_KHZ = 36
_GLOBAL_MEMORY_BUS_WIDTH_BITS = 37
_L2_CACHE_SIZE = 38
_COMPUTE_CAPABILITY_MAJOR = 75
_COMPUTE_CAPABILITY_MINOR = 76
_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97


@dataclasses.dataclass(frozen=True)
class Device:
  """One CUDA device's resources. ``dram_peak_gbs`` is the data sheet's rate (clock times bus
  width, both edges), not a measured one; it is ``None`` where the driver no longer reports
  the memory clock."""
  kind: str
  compute_capability: tuple[int, int]
  multiprocessors: int
  shared_memory_per_block: int
  l2_bytes: int
  dram_peak_gbs: float | None


def _driver_attributes(ordinal: int, attributes) -> list[int] | None:
  for name in ("libcuda.so.1", "libcuda.so"):
    try:
      cuda = ctypes.CDLL(name)
      break
    except OSError:
      continue
  else:
    return None
  device, value = ctypes.c_int(), ctypes.c_int()
  if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
    return None
  values = []
  for attribute in attributes:
    status = cuda.cuDeviceGetAttribute(ctypes.byref(value), attribute, device)
    values.append(value.value if status == 0 else 0)
  return values


@functools.cache
def describe() -> Device | None:
  """The default GPU's resources, or ``None`` off a GPU or without the CUDA driver."""
  if registry.platform() != "gpu":
    return None
  jax_device = jax.devices()[0]
  ordinal = int(getattr(jax_device, "local_hardware_id", None) or 0)
  values = _driver_attributes(ordinal, (
      _COMPUTE_CAPABILITY_MAJOR, _COMPUTE_CAPABILITY_MINOR, _MULTIPROCESSOR_COUNT,
      _MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, _L2_CACHE_SIZE, _MEMORY_CLOCK_RATE_KHZ,
      _GLOBAL_MEMORY_BUS_WIDTH_BITS))
  if values is None or not values[4]:
    return None
  major, minor, sms, shared, l2, clock_khz, bus_bits = values
  peak = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None
  return Device(jax_device.device_kind, (major, minor), sms, shared, l2, peak)
