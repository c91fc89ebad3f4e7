"""GPU time per kernel of one LSTM or GRU forward and training step, jaxfuse's implementations
beside PyTorch's cuDNN module on the same sizes: where a step's time goes.

    python benchmarks/profile_rnn.py [--cell lstm] [--shape 1024,128,2048,2048]
        [--dtype float32] [--layers 1] [--bidirectional] [--impl cudnn,default,torch]

``--shape`` is batch, steps, input, hidden; ``default`` is ``implementation=None``. The
training step is ``jaxfuse bench rnn``'s: y and the gradients of x and the weights for a
cotangent of y.
"""

import os
import pathlib
import sys

# PyTorch's module allocates beside JAX's arrays: JAX's default pool would leave it too little.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from profile_gpt import kernel_times  # noqa: E402

import jaxfuse  # noqa: E402


def _option(argv, name, default):
  return argv[argv.index(name) + 1] if name in argv else default


def jax_programs(cell, b, t, i, h, layers, bidirectional, dtype, impl):
  """``{'forward': run, 'step': run}``: each runs the compiled program once and waits."""
  directions = 2 if bidirectional else 1
  keys = jax.random.split(jax.random.key(0), 5)
  state = (layers * directions, b, h)
  x = jax.random.normal(keys[0], (b, t, i), dtype)
  h0, c0 = (0.5 * jax.random.normal(k, state, dtype) for k in keys[1:3])
  count = (jaxfuse.lstm_weight_count if cell == "lstm" else jaxfuse.gru_weight_count)(
      i, h, layers, bidirectional)
  w = jax.random.uniform(keys[3], (count,), dtype, -h ** -0.5, h ** -0.5)
  dy = jax.random.normal(keys[4], (b, t, directions * h), dtype)
  sizes = dict(input_size=i, hidden_size=h, num_layers=layers, bidirectional=bidirectional,
               implementation=None if impl == "default" else impl)
  run = (lambda x, w: jaxfuse.lstm(x, h0, c0, w, None, **sizes)[0]) if cell == "lstm" else (
      lambda x, w: jaxfuse.gru(x, h0, w, None, **sizes)[0])

  def step(x, w, dy):
    y, vjp = jax.vjp(run, x, w)
    return (y,) + vjp(dy)

  forward = jax.jit(run).lower(x, w).compile()
  train = jax.jit(step).lower(x, w, dy).compile()
  return {"forward": lambda: jax.block_until_ready(forward(x, w)),
          "step": lambda: jax.block_until_ready(train(x, w, dy))}


def torch_programs(cell, b, t, i, h, layers, bidirectional, dtype):
  import torch
  torch.backends.cuda.matmul.allow_tf32 = True
  torch.backends.cudnn.allow_tf32 = True
  torch_dtype = getattr(torch, jnp.dtype(dtype).name)
  module = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(
      i, h, layers, batch_first=True, bidirectional=bidirectional).to("cuda", torch_dtype)
  module.flatten_parameters()
  x = torch.randn(b, t, i, device="cuda", dtype=torch_dtype, requires_grad=True)
  dy = torch.randn(b, t, (2 if bidirectional else 1) * h, device="cuda", dtype=torch_dtype)

  def forward():
    with torch.no_grad():
      module(x)
    torch.cuda.synchronize()

  def step():
    module.zero_grad(set_to_none=True)
    x.grad = None
    module(x)[0].backward(dy)
    torch.cuda.synchronize()

  return {"forward": forward, "step": step}


def main(argv):
  cell = _option(argv, "--cell", "lstm")
  b, t, i, h = (int(v) for v in _option(argv, "--shape", "1024,128,2048,2048").split(","))
  dtype = jnp.dtype(_option(argv, "--dtype", "float32"))
  layers = int(_option(argv, "--layers", "1"))
  bidirectional = "--bidirectional" in argv
  impls = _option(argv, "--impl", "cudnn,default,torch").split(",")
  shape = (f"{cell.upper()} {b}x{t}x{i}x{h} L{layers}{' bi' if bidirectional else ''} "
           f"{dtype.name}")
  for impl in impls:
    spec = (cell, b, t, i, h, layers, bidirectional, dtype)
    try:
      programs = (torch_programs(*spec) if impl == "torch"
                  else jax_programs(*spec, impl))
    except (NotImplementedError, ValueError, ImportError) as e:
      print(f"\n## {shape} {impl}: refused ({str(e)[:100]})")
      continue
    for use, program in programs.items():
      try:
        totals = kernel_times(program)
      except RuntimeError as e:  # PyTorch's out-of-memory error among them
        print(f"\n## {shape} {impl} {use}: failed ({str(e)[:100]})")
        continue
      print(f"\n## {shape} {impl} {use}: {sum(totals.values()):.1f} us of kernels in "
            f"{len(totals)} kinds")
      for name, us in totals.most_common(10):
        print(f"{us:10.1f} us  {name[:100]}")


if __name__ == "__main__":
  main(sys.argv[1:])
