"""Test set-up: eight fake CPU devices for the sharding tests, fresh random seeds, GPU marker."""

import os

# Must happen before jax initializes its backends; harmless on a GPU machine.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import secrets  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def rng(request):
  """A freshly seeded generator; the seed is printed on failure to replay a case."""
  seed = secrets.randbits(32)
  print(f"{request.node.name}: numpy seed {seed}")
  return np.random.default_rng(seed)
