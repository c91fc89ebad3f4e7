"""The ceilings ``jaxfuse bench`` quotes rates against, measured in the same run: the best
device-to-device copy (memory-bound ops) and a bf16 matrix product (compute-bound ones)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfuse._core import registry
from jaxfuse._core.cuda import copies
from jaxfuse._core.timing import measure, time_ms

# Bytes a copy ceiling reads (and writes): far past any L2.
_CEILING_BYTES = 1 << 29


def copy_ceilings() -> dict[str, float]:
  """GB/s (bytes read plus bytes written) of each device-to-device copy this machine has:
  XLA's (a negation, one fused kernel), and on a GPU that builds jaxfuse's CUDA kernels, the
  driver's ``cudaMemcpyAsync`` and each shape of jaxfuse's copy kernel."""
  n = _CEILING_BYTES // 2 if registry.platform() == "gpu" else 1 << 22
  keys = jax.random.split(jax.random.key(1), 2)
  sets = [(jax.random.normal(k, (n,), jnp.bfloat16),) for k in keys]
  candidates = {"XLA copy (negation)": lambda a: -a}
  if copies.LIBRARY.unavailable() is None:
    candidates["cudaMemcpyAsync"] = copies.memcpy
    for unroll, ctas, streaming in copies.KERNEL_SHAPES:
      stores = ", evict-first" if streaming else ""
      name = f"copy kernel ({unroll} vectors x {ctas} CTAs/SM{stores})"
      candidates[name] = functools.partial(copies.copy, unroll=unroll, ctas_per_sm=ctas,
                                           streaming=streaming)
  rates = {}
  for name, fn in candidates.items():
    timing, out = measure(jax.jit(fn), sets, min_seconds=0.1, groups=3)
    if name != "XLA copy (negation)" and not bool(jnp.array_equal(out, sets[0][0])):
      raise AssertionError(f"{name} did not copy its input")
    rates[name] = 2 * n * 2 / (timing.span_ms * 1e-3) / 1e9
  return rates


def copy_bandwidth() -> float:
  """GB/s of the best device-to-device copy here (see :func:`copy_ceilings`)."""
  return max(copy_ceilings().values())


def matmul_rate() -> float:
  """TFLOP/s of a bf16 matrix product (8192^3 on a GPU)."""
  n = 8192 if registry.platform() == "gpu" else 512
  keys = jax.random.split(jax.random.key(2), 4)
  sets = [(jax.random.normal(k, (n, n), jnp.bfloat16),
           jax.random.normal(jax.random.fold_in(k, 1), (n, n), jnp.bfloat16)) for k in keys]
  ms = time_ms(lambda a, b: a @ b, sets)
  return 2 * n ** 3 / (ms * 1e-3) / 1e12
