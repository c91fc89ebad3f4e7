"""The README and the docstrings state the limits the code enforces, from the same constants,
and every Python snippet of the README runs."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

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


def _readme_snippets() -> list[str]:
  text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _snippet_inputs(index: int) -> dict:
  """The names each README snippet takes as given (small, random, on this device)."""
  keys = iter(jax.random.split(jax.random.key(index), 24))
  normal = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32)
  if index == 1:  # the ops at a glance
    i, h = 8, 16
    return dict(
        x=normal(4, 64), weight=1 + normal(64), bias=normal(64), logits=normal(4, 50),
        labels=jnp.arange(4), h=normal(4, 16), w_out=normal(16, 50), q=normal(2, 128, 4, 64),
        k=normal(2, 128, 4, 64), v=normal(2, 128, 4, 64), w1=normal(64, 256) / 8,
        b1=normal(256), w2=normal(256, 64) / 16, b2=normal(64),
        ids=jnp.repeat(jnp.arange(2), 64)[None].repeat(2, 0),  # two documents a row
        seq=normal(3, 5, i), h_0=normal(4, 3, h), c_0=normal(4, 3, h), I=i, H=h,
        weights=jaxfuse.init_lstm_weights(next(keys), i, h, 2, True),
        gru_weights=jaxfuse.init_gru_weights(next(keys), i, h, 2, True),
        seq_lengths=jnp.asarray([5, 3, 1]))
  if index == 2:  # the flax layers
    return dict(x=normal(2, 6, 80), seq_lengths=jnp.asarray([6, 4]))
  return {}


def test_every_readme_snippet_runs(capsys):
  snippets = _readme_snippets()
  # Quick start, the ops at a glance, the flax layers: a new snippet needs its inputs above.
  assert len(snippets) == 3
  for index, snippet in enumerate(snippets):
    if "flax" in snippet:
      pytest.importorskip("flax")
    exec(compile(snippet, f"README.md snippet {index}", "exec"), _snippet_inputs(index))
  assert "attention(implementation=None): " in capsys.readouterr().out
