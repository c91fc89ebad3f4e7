"""The README and the docstrings state the limits the code enforces, from the same constants."""

from pathlib import Path

import jax.numpy as jnp

import jaxfuse
from jaxfuse.ops.norm import cuda as norm_cuda
from jaxfuse.ops.rnn import cuda as rnn_cuda
from jaxfuse.ops.softmax import cuda as softmax_cuda

README = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())


def _stated(module):
  return (f"up to {module.longest_row(jnp.float16)} float16/bfloat16 or "
          f"{module.longest_row(jnp.float32)} float32 elements")


def test_readme_states_the_cuda_row_limits():
  assert README.count(_stated(norm_cuda)) == 1
  assert README.count(_stated(softmax_cuda)) == 2  # softmax and cross-entropy


def test_docstrings_state_the_cuda_row_limits():
  for op, module in ((jaxfuse.rms_norm, norm_cuda),
                     (jaxfuse.softmax, softmax_cuda),
                     (jaxfuse.softmax_cross_entropy, softmax_cuda)):
    assert module.limits() in " ".join(op.__doc__.split()), op.__name__
    assert "{cuda_limits}" not in op.__doc__


def test_the_limits_are_the_refusals():
  for module, args in ((norm_cuda, lambda n, d: (n, d, d, [d])),
                       (softmax_cuda, lambda n, d: (n, d))):
    for dtype in (jnp.bfloat16, jnp.float32):
      longest = module.longest_row(dtype)
      assert module.unsupported(*args(longest, dtype)) is None
      assert "at most" in module.unsupported(*args(longest + 8, dtype))


def test_readme_and_docstring_state_the_rnn_limits():
  assert README.count(rnn_cuda.limits()) == 1
  assert rnn_cuda.limits() in " ".join(jaxfuse.lstm.__doc__.split())
  assert "{cuda_limits}" not in jaxfuse.lstm.__doc__


def test_the_rnn_limits_are_the_largest_planned_layers():
  largest = rnn_cuda._largest_hidden("lstm", jnp.bfloat16, 1)
  plans = lambda hidden: [rnn_cuda._try_plan(4, p, 64, hidden, 1, jnp.dtype(jnp.bfloat16),
                                             *rnn_cuda._H100) for p in ("forward", "backward")]
  assert all(plans(largest)) and not all(plans(largest + 1))
