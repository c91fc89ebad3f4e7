"""Bench cases for ``lstm`` and ``gru``: the forward and a training step (a loss over y, the
gradients for x and the weights) of whole sequences, with PyTorch's cuDNN RNNs (``torch``,
timed from its profiler's trace as JAX's rows are, its training step's temporary memory
counted as JAX's: the peak over what the module and inputs hold, less the outputs), for
the float32 LSTM ``jax.experimental.rnn``, and None with the lengths on the device
(:data:`DEVICE_LENGTHS`) side by side.

``jaxfuse bench rnn --grid`` sweeps :data:`GRID_BATCHES` x :data:`GRID_HIDDEN` for both cells,
float32 and bfloat16, one layer and two bidirectional ones, and reports None's ratio to the
faster of the comparators (:data:`COMPARATORS`) per point, with heat maps.

FLOPs count the matrix products: per layer and direction ``2 * B * T * G * H * (I_layer + H)``;
the training step counts three times the forward. float32 allows TF32, as both comparators do
by default.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp

from jaxfuse._core import registry, tune
from jaxfuse._core.bench import DEFAULT, TF32_TOLERANCE, Case, implementation_arg
from jaxfuse._core.timing import measure, time_torch
from jaxfuse.ops.rnn import api
from jaxfuse.ops.rnn.weights import GATES, weight_count

# The CUDA libraries this family's cases run, loaded (built on a cold cache) side by side before
# any is timed.
CUDA_LIBRARIES = ("jaxfuse.ops.rnn.cuda", "jaxfuse.ops.rnn.cudnn")

# None's row with the lengths on the device (the others' whole sequences take none).
DEVICE_LENGTHS = "default-device-lengths"

# (cell, batch, steps, input, hidden, layers, bidirectional): the cases of issue 20's table and
# the first of issue 44's, where None takes cuDNN (a call per layer and direction with the
# lengths on the device).
GPU_CASES = [("lstm", 4, 1024, 512, 512, 1, False), ("lstm", 64, 256, 512, 512, 2, False),
             ("lstm", 16, 512, 256, 1024, 1, True), ("gru", 64, 256, 512, 512, 2, False),
             ("gru", 4, 1024, 512, 512, 1, False), ("lstm", 256, 128, 1024, 1024, 1, False)]
CPU_CASES = [("lstm", 4, 64, 64, 64, 1, False), ("gru", 4, 64, 64, 64, 1, True)]


def _inputs(key, cell, b, t, i, h, layers, bidirectional, dtype):
  directions = 2 if bidirectional else 1
  keys = jax.random.split(key, 5)
  state = (layers * directions, b, h)
  count = weight_count(cell, i, h, layers, bidirectional)
  return (jax.random.normal(keys[0], (b, t, i), dtype),
          0.5 * jax.random.normal(keys[1], state, dtype),
          0.5 * jax.random.normal(keys[2], state, dtype),
          jax.random.uniform(keys[3], (count,), dtype, -h ** -0.5, h ** -0.5),
          jax.random.normal(keys[4], (b, t, directions * h), dtype))


def _call(cell, i, h, layers, bidirectional, impl, x, h0, c0, w, lengths=None):
  # Whole sequences (no lengths) by default, which every implementation, cuDNN's included,
  # takes.
  sizes = dict(input_size=i, hidden_size=h, num_layers=layers, bidirectional=bidirectional,
               implementation=implementation_arg(impl))
  if cell == "lstm":
    return api.lstm(x, h0, c0, w, lengths, **sizes)[0]
  return api.gru(x, h0, w, lengths, **sizes)[0]


def _forward(spec, impl):
  return lambda x, h0, c0, w, dy: _call(*spec, impl, x, h0, c0, w)


def _train(spec, impl):
  def step(x, h0, c0, w, dy):
    y, vjp = jax.vjp(lambda x, w: _call(*spec, impl, x, h0, c0, w), x, w)
    return (y,) + vjp(dy)
  return step


def _torch_timer(cell, i, h, layers, bidirectional, dtype, inputs):
  """Timings of torch.nn.LSTM/GRU's forward and training step on these inputs' sizes."""
  import torch
  torch.backends.cuda.matmul.allow_tf32 = True
  torch.backends.cudnn.allow_tf32 = True
  torch_dtype = {jnp.dtype(jnp.float32): torch.float32,
                 jnp.dtype(jnp.bfloat16): torch.bfloat16}[jnp.dtype(dtype)]
  module = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(
      i, h, layers, batch_first=True, bidirectional=bidirectional)
  module = module.to("cuda", torch_dtype)
  # One contiguous weight buffer, as cuDNN wants; else each call compacts the weights first.
  module.flatten_parameters()
  b, t = inputs[0].shape[:2]
  x = torch.randn(b, t, i, device="cuda", dtype=torch_dtype, requires_grad=True)
  dy = torch.randn(b, t, (2 if bidirectional else 1) * h, device="cuda", dtype=torch_dtype)

  def forward(_):
    with torch.no_grad():
      module(x)

  def train(_):
    # A training step starts from no gradients (torch's optimizers set them to None).
    module.zero_grad(set_to_none=True)
    x.grad = None
    y, _ = module(x)
    y.backward(dy)

  # The training step's temporary memory as JAX counts it: its peak over what the module and
  # inputs hold, less its outputs (y and the gradients).
  train(0)
  module.zero_grad(set_to_none=True)
  x.grad = None
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  held = torch.cuda.memory_allocated()
  train(0)
  torch.cuda.synchronize()
  outputs = ((dy.numel() + x.numel()) * x.element_size()
             + sum(p.numel() * p.element_size() for p in module.parameters()))
  temp_mib = (torch.cuda.max_memory_allocated() - held - outputs) / 2**20
  timings = time_torch(forward), time_torch(train), temp_mib
  # What PyTorch's allocator keeps cached would be missing from the JAX rows after it.
  del module, x, dy
  torch.cuda.empty_cache()
  return timings


def _jax_rnn_timer(i, h, layers, bidirectional, inputs):
  """Timings of jax.experimental.rnn's cuDNN LSTM (float32 only), timed as JAX's rows are:
  its forward and backward copy the lengths to the host and wait for the stream."""
  from jax.experimental import rnn
  x, h0, c0, w, dy = inputs
  lengths = jnp.full((x.shape[0],), x.shape[1], jnp.int32)
  run = lambda x, w: rnn.lstm(x, h0, c0, w, lengths, input_size=i, hidden_size=h,
                              num_layers=layers, dropout=0.0, bidirectional=bidirectional)[0]

  def train(x, w, dy):
    y, vjp = jax.vjp(run, x, w)
    return (y,) + vjp(dy)

  return measure(jax.jit(run), [(x, w)])[0], measure(jax.jit(train), [(x, w, dy)])[0]


def _device_lengths_timer(cell, i, h, layers, bidirectional, inputs):
  """Timings of None's choice with the lengths in a device array, as a training loop passes
  them: where None takes cuDNN, a call per layer and direction rather than one."""
  x, h0, c0, w, dy = inputs
  lengths = jnp.full((x.shape[0],), x.shape[1], jnp.int32)
  run = lambda x, w, lengths: _call(cell, i, h, layers, bidirectional, DEFAULT, x, h0, c0, w,
                                    lengths)

  def train(x, w, lengths, dy):
    y, vjp = jax.vjp(lambda x, w: run(x, w, lengths), x, w)
    return (y,) + vjp(dy)

  return (measure(jax.jit(run), [(x, w, lengths)])[0],
          measure(jax.jit(train), [(x, w, lengths, dy)])[0])


def _comparators(cell, i, h, layers, bidirectional, dtype) -> dict:
  out = {"torch": functools.partial(_torch_timer, cell, i, h, layers, bidirectional, dtype)}
  if cell == "lstm" and dtype == jnp.float32:
    out["jax.experimental.rnn"] = functools.partial(_jax_rnn_timer, i, h, layers,
                                                    bidirectional)
  return out


def _flops(cell, b, t, i, h, layers, bidirectional) -> float:
  directions = 2 if bidirectional else 1
  per_layer = [(i if layer == 0 else directions * h) + h for layer in range(layers)]
  return sum(2 * b * t * directions * GATES[cell] * h * k for k in per_layer)


def _layout(layers, bidirectional, dtype) -> str:
  """A case label's tail: ``'L2 bi bfloat16'``."""
  return f"L{layers}{' bi' if bidirectional else ''} {jnp.dtype(dtype).name}"


def _case(cell, b, t, i, h, layers, bidirectional, dtype, impls, external=None):
  spec = (cell, i, h, layers, bidirectional)
  flops = _flops(cell, b, t, i, h, layers, bidirectional)
  label = f"{cell.upper()} {b}x{t}x{i}x{h} {_layout(layers, bidirectional, dtype)}"
  return Case(
      op=cell, label=label, size=b,
      make_inputs=functools.partial(_inputs, cell=cell, b=b, t=t, i=i, h=h, layers=layers,
                                    bidirectional=bidirectional, dtype=dtype),
      forward=functools.partial(_forward, spec), train=functools.partial(_train, spec),
      forward_work=flops, train_work=3 * flops, implementations=impls, unit="TFLOP/s",
      external=external or {}, steps=t, reduction_length=max(b * t, i + h),
      # Each layer past the first rounds its input and, backward, that input's gradient to the
      # dtype once more (cuDNN keeps both in it between layers).
      roundings=layers + 1,
      tolerance=(TF32_TOLERANCE if registry.platform() == "gpu" and dtype == jnp.float32
                 else None))


_GPU_IMPLEMENTATIONS = ("cuda", DEFAULT, "cudnn")


def cases(quick: bool = False) -> list[Case]:
  on_gpu = registry.platform() == "gpu"
  shapes = (GPU_CASES if on_gpu else CPU_CASES)[:1 if quick else None]
  out = []
  for index, (cell, b, t, i, h, layers, bidirectional) in enumerate(shapes):
    dtypes = (jnp.float32, jnp.bfloat16)
    if quick:
      dtypes = dtypes[:1]
    elif not on_gpu:
      # On a CPU, where only XLA runs, the cases share the dtypes out: each shape once.
      dtypes = (dtypes[index % len(dtypes)],)
    for dtype in dtypes:
      impls, external = ("xla",), {}
      if on_gpu:
        impls = _GPU_IMPLEMENTATIONS
        external = {**_comparators(cell, i, h, layers, bidirectional, dtype),
                    DEVICE_LENGTHS: functools.partial(_device_lengths_timer, cell, i, h,
                                                      layers, bidirectional)}
      out.append(_case(cell, b, t, i, h, layers, bidirectional, dtype, impls, external))
  return out


# (cell, batch, steps, input, hidden, layers, bidirectional, dtype): batch 1 to 256, small
# to large hidden sizes, both cells and directions.
REGRET_GRID = [
    ("lstm", 1, 256, 256, 256, 1, False, jnp.float32),
    ("lstm", 16, 128, 512, 512, 2, True, jnp.float32),
    ("lstm", 64, 256, 1024, 1024, 1, False, jnp.bfloat16),
    ("lstm", 256, 64, 512, 512, 2, False, jnp.float32),
    ("gru", 8, 256, 256, 512, 1, False, jnp.bfloat16),
    ("gru", 128, 128, 512, 512, 2, True, jnp.float32),
]


def regret_cases() -> list[Case]:
  """``None`` against every implementation over :data:`REGRET_GRID` (the CPU cases there)."""
  if registry.platform() != "gpu":
    return [_case(*shape, jnp.float32, ("xla", DEFAULT)) for shape in CPU_CASES[:1]]
  return [_case(*shape, ("xla",) + _GPU_IMPLEMENTATIONS)
          for shape in REGRET_GRID]


# The tuning grid: batch x hidden, TUNE_STEPS steps, each cell, dtype and layout (one layer in
# one direction; two layers in two, the bidirectional networks' table, see api._GRID_ROWS).
TUNE_BATCHES = (1, 4, 16, 64, 256, 1024)
TUNE_HIDDEN = (128, 256, 512, 1024, 2048)
TUNE_LAYOUTS = ((1, False), (2, True))
TUNE_STEPS = 64
TUNED_IMPLEMENTATIONS = ("cuda", "cudnn", "xla")


def tune_cases() -> list[Case]:
  """The fused kernels, cuDNN's and XLA's scan over the tuning grid, each cell, dtype and
  layout."""
  return [_case(cell, b, TUNE_STEPS, h, h, layers, bidirectional, dtype, TUNED_IMPLEMENTATIONS)
          for cell in GATES for dtype in (jnp.float32, jnp.bfloat16)
          for layers, bidirectional in TUNE_LAYOUTS for b in TUNE_BATCHES for h in TUNE_HIDDEN]


def tuned_rows(rows) -> dict:
  """``fastest/CELL/DTYPE/USE`` (one direction) and ``fastest/CELL/DTYPE/USE/bidirectional``
  for each cell, dtype, use (the evaluated ``forward``, the training ``step``) and layout the
  run timed: its batches and hidden sizes and, at each (batch, hidden), the implementations
  that ran and passed their check there, fastest first (``'cuda>xla'``; ``''`` at a point the
  run did not time). Rows of other cases (another run's steps or layers) are left out."""
  tuning = {case.label for case in tune_cases()}
  out = {}
  for op, dtype, (layers, bidirectional) in itertools.product(GATES, ("float32", "bfloat16"),
                                                               TUNE_LAYOUTS):
    layout = f" {_layout(layers, bidirectional, dtype)}"
    group = [r for r in rows if r.op == op and r.label.endswith(layout)
             and r.label in tuning and r.implementation in TUNED_IMPLEMENTATIONS]
    for use in ("forward", "step"):
      times = {}
      for row in group:
        t = tune.time_of(row, use)
        if t is not None:
          times.setdefault(grid_place(row.label)[1:], {})[row.implementation] = t
      if not times:
        continue
      batches = sorted({b for b, _ in times})
      hidden = sorted({h for _, h in times})
      order = lambda ran: ">".join(sorted(ran, key=lambda n: (ran[n], n)))
      name = f"fastest/{op}/{dtype}/{use}{'/bidirectional' if bidirectional else ''}"
      out[name] = {"batch": batches, "hidden": hidden,
                   "order": [[order(times.get((b, h), {})) for h in hidden] for b in batches]}
  return out


# The grid: batch x hidden (input = hidden), each cell, dtype and layout (layers,
# bidirectional), T = GRID_STEPS or fewer where the training step's saved activations would
# pass GRID_SAVED_BYTES.
GRID_BATCHES = (1, 4, 16, 64, 256, 1024)
GRID_HIDDEN = (128, 256, 512, 1024, 2048)
GRID_LAYOUTS = ((1, False), (2, True))
GRID_STEPS = 256
GRID_SAVED_BYTES = 8 << 30
# What None is weighed against on the grid: PyTorch's cuDNN RNNs and jax.experimental.rnn's.
COMPARATORS = ("torch", "jax.experimental.rnn")


def grid_steps(cell, b, h, layers, bidirectional) -> int:
  """T for a grid point: the saved gates and states (float32) of every layer and direction
  within :data:`GRID_SAVED_BYTES`, halving from :data:`GRID_STEPS`."""
  per_step = b * h * (GATES[cell] + 2) * 4 * layers * (2 if bidirectional else 1)
  t = GRID_STEPS
  while t > 16 and t * per_step > GRID_SAVED_BYTES:
    t //= 2
  return t


def grid_cases() -> list[Case]:
  """None, the named implementations and the comparators at every grid point (on the CPU, the
  smallest points, checked)."""
  on_gpu = registry.platform() == "gpu"
  batches, hidden = (GRID_BATCHES, GRID_HIDDEN) if on_gpu else ((1, 4), (128,))
  out = []
  for cell in GATES:
    for dtype in (jnp.float32, jnp.bfloat16):
      for layers, bidirectional in GRID_LAYOUTS:
        for b in batches:
          for h in hidden:
            t = grid_steps(cell, b, h, layers, bidirectional) if on_gpu else 8
            impls, external = (DEFAULT, "xla"), {}
            if on_gpu:
              impls = ("xla",) + _GPU_IMPLEMENTATIONS
              external = _comparators(cell, h, h, layers, bidirectional, dtype)
            out.append(_case(cell, b, t, h, h, layers, bidirectional, dtype, impls, external))
  return out


def grid_place(label: str) -> tuple[str, int, int]:
  """A grid case's heat map and cell in it: ``'LSTM 4x256x512x512 L2 bi float32'`` ->
  ``('LSTM L2 bi float32', 4, 512)``."""
  cell, shape, *rest = label.split()
  b, _, _, h = (int(v) for v in shape.split("x"))
  return " ".join([cell] + rest), b, h
