"""Test set-up: eight fake CPU devices for the sharding tests, seeds from the test's id, GPU
marker, and with JAXFUSE_WITHOUT_TRITON set the tests that need Pallas Triton skipped."""

import importlib.util
import os

# Must happen before jax initializes its backends; harmless on a GPU machine.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The tests compile thousands of small programs and run each a few times: without a GPU plugin
# (where these flags would reach the GPU's code too) LLVM's optimizations cost more than they save.
_GPU_PLUGINS = ("jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin")
if ("xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]
    and not any(importlib.util.find_spec(name) for name in _GPU_PLUGINS)):
  os.environ["XLA_FLAGS"] += (" --xla_backend_optimization_level=0"
                              " --xla_llvm_disable_expensive_passes=true")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxfuse._core import registry  # noqa: E402
from jaxfuse._core.testing import seed_for  # noqa: E402


def pytest_collection_modifyitems(config, items):
  if registry.triton_switched_off():
    # A test that names 'triton' (a parameter, an expected choice) or is marked for it.
    skip = pytest.mark.skip(reason=f"needs Pallas Triton ({registry.WITHOUT_TRITON_VARIABLE})")
    for item in items:
      params = getattr(getattr(item, "callspec", None), "params", {})
      if item.get_closest_marker("triton") or any(_names_triton(v) for v in params.values()):
        item.add_marker(skip)
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def _names_triton(value) -> bool:
  if isinstance(value, (tuple, list)):
    return any(_names_triton(v) for v in value)
  return value == "triton" if isinstance(value, str) else False


@pytest.fixture
def rng(request):
  """A generator seeded from the test's id: every run of a test sees the same inputs, and
  each test (each parametrization) its own."""
  return np.random.default_rng(seed_for(request.node.nodeid))
