"""cuDNN's LSTM and GRU (``cudnnRNNForward``, ``cudnnRNNBackwardData_v8`` and
``cudnnRNNBackwardWeights_v8``) through XLA's FFI (``rnn_cudnn.cu``): every layer and direction
in one call, on tensor cores at any size.

The flat weight vector of :mod:`jaxfuse.ops.rnn.weights` is cuDNN's weight space itself, so the
weights go in as they are. cuDNN reads the sequence lengths from the host when it sets a call
up (it ignores a copy on the device), so they are an attribute of the compiled call: a
:class:`Call` holds them, known at trace time. Lengths that live on the device would need a
copy to the host and a wait on the stream in every call; the caller runs whole sequences
instead and reads what it needs at each sequence's end.

Calling convention (L layers, D directions, B batch, T steps, I input, H hidden, one dtype;
GRU's cell states are ``(1,)`` placeholders): forward ``(x (B, T, I), h0 (L*D, B, H),
c0 (L*D, B, H), w (count,)) -> y (B, T, D*H), h_n, c_n`` plus the reserve the backward needs,
bytes shaped ``(B, row_bytes)`` (:func:`reserve_row_bytes`) so that a shard of the batch holds
its own; backward ``(dy, dh_n, dc_n, x, h0, c0, w, y, reserve) -> dx, dh0, dc0, dw``. A shard's
reserve is one blob in cuDNN's layout, not a row per sequence: the backward must take the batch
split as the forward did (the residuals keep the activations' sharding)."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._core import cuda

_SOURCE = Path(__file__).with_name("rnn_cudnn.cu")
_HANDLERS = {"jaxfuse_cudnn_rnn_forward": "JaxfuseCudnnRnnForward",
             "jaxfuse_cudnn_rnn_backward": "JaxfuseCudnnRnnBackward"}
LIBRARY = cuda.Library(_SOURCE, _HANDLERS, vendor="cudnn")
_CELLS = {"lstm": 0, "gru": 1}
_DTYPES = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.float16): 1, jnp.dtype(jnp.bfloat16): 2}
# cudnnMathType_t: the default lets float32 products take TF32 (as cuDNN and torch do), FMA
# keeps them in float32.
_DEFAULT_MATH, _FMA_MATH = 0, 3


def unavailable() -> str | None:
  """Why cuDNN's RNN cannot run here (no GPU, no nvcc or cuDNN, a failed build), or None."""
  return LIBRARY.unavailable()


def unsupported(dtypes) -> str | None:
  """Why these kernels cannot take a call of ``dtypes`` (x, states, weights), or None."""
  names = sorted({jnp.dtype(d).name for d in dtypes})
  if len(names) > 1:
    return f"cuDNN's RNN takes x, the states and the weights in one dtype (here {names})"
  if jnp.dtype(names[0]) not in _DTYPES:
    return f"cuDNN's RNN takes float32, float16 and bfloat16, not {names[0]}"
  return None


@dataclasses.dataclass(frozen=True)
class Call:
  """One configuration, its host lengths included (each at least 1: an empty sequence runs one
  step whose results the caller discards)."""
  cell: str
  input_size: int
  hidden_size: int
  num_layers: int
  bidirectional: bool
  batch: int
  time: int
  dtype: jnp.dtype
  exact: bool
  lengths: tuple[int, ...]
  # The batch this call is a shard of (its own batch where None): every shard's reserve rows
  # and the whole batch's must be alike.
  split_from: int | None = None

  def attributes(self) -> dict:
    return dict(cell=np.int64(_CELLS[self.cell]), dtype=np.int64(_DTYPES[self.dtype]),
                math=np.int64(_FMA_MATH if self.exact else _DEFAULT_MATH),
                input_size=np.int64(self.input_size), hidden_size=np.int64(self.hidden_size),
                num_layers=np.int64(self.num_layers),
                bidirectional=np.int64(self.bidirectional), batch=np.int64(self.batch),
                time=np.int64(self.time), lengths=np.asarray(self.lengths, np.int32))

  def uniform(self, batch: int) -> Call:
    """This configuration for a shard of ``batch`` sequences, all ``time`` long."""
    return dataclasses.replace(self, batch=batch, lengths=(self.time,) * batch,
                               split_from=self.split_from or self.batch)

  @property
  def whole(self) -> bool:
    """Whether every sequence runs all ``time`` steps."""
    return all(n == self.time for n in self.lengths)

  @property
  def states(self) -> tuple[int, int, int]:
    return (self.num_layers * (2 if self.bidirectional else 1), self.batch, self.hidden_size)

  @property
  def cell_states(self) -> jax.ShapeDtypeStruct:
    """LSTM's cell states; GRU's ``(1,)`` placeholder."""
    return jax.ShapeDtypeStruct(self.states if self.cell == "lstm" else (1,), self.dtype)


# cudnnRNNAlgo_t's standard algorithm and its persistent one for small hidden sizes (one kernel
# walks every step), which cuDNN runs for whole sequences up to a hidden size per use: these
# bounds are PyTorch's, whose training step takes the persistent kernels in both directions
# only up to the smaller one.
_STANDARD, _SMALL_HIDDEN = 0, 1
_SMALL_HIDDEN_MOST = {False: 192, True: 128}  # by training


@functools.cache
def algorithm(call: Call, training: bool) -> int:
  """The algorithm of ``call``'s forward (the training one with ``training``, which the
  backward shares): the persistent kernels where their bounds allow and cuDNN takes them, for
  the default math only (float32 FMA math, asked by ``precision``, keeps the standard
  algorithm, whose products are known to follow it)."""
  if call.whole and not call.exact and call.hidden_size <= _SMALL_HIDDEN_MOST[training]:
    try:
      _sizes(call, training, _SMALL_HIDDEN)
      return _SMALL_HIDDEN
    except NotImplementedError:
      pass
  return _STANDARD


def scratch_bytes(call: Call, training: bool) -> tuple[int, int]:
  """``(workspace, reserve)`` bytes cuDNN asks for ``call`` (asked once per configuration)."""
  return _sizes(call, training, algorithm(call, training))


@functools.cache
def _sizes(call: Call, training: bool, algo: int) -> tuple[int, int]:
  library = LIBRARY.load()
  function = library.jaxfuse_cudnn_rnn_sizes
  function.argtypes = ([ctypes.c_int64] * 10 + [ctypes.POINTER(ctypes.c_int32), ctypes.c_int64]
                       + [ctypes.POINTER(ctypes.c_uint64)] * 3
                       + [ctypes.c_char_p, ctypes.c_int64])
  attrs = call.attributes()
  lengths = np.ascontiguousarray(attrs.pop("lengths"))
  workspace, reserve, weights = (ctypes.c_uint64(0) for _ in range(3))
  error = ctypes.create_string_buffer(512)
  status = function(*(int(attrs[k]) for k in ("cell", "dtype", "math", "input_size",
                                                "hidden_size", "num_layers", "bidirectional",
                                                "batch", "time")), algo,
                    lengths.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), int(training),
                    ctypes.byref(workspace), ctypes.byref(reserve), ctypes.byref(weights),
                    error, len(error))
  if status:
    raise NotImplementedError(f"cuDNN's RNN refuses this call: {error.value.decode()}")
  return max(workspace.value, 1), max(reserve.value, 1)


def reserve_row_bytes(call: Call, training: bool) -> int:
  """The reserve's bytes per sequence. cuDNN's reserve is not linear in the batch, so whole
  sequences, which a mesh may split, take the widest row of every split of the batch over up
  to all the devices (a shard rounded up): the whole batch's reserve and each shard's then
  have rows alike. On a machine of several devices an unsplit call takes that width too."""
  if not call.whole:
    return -(-scratch_bytes(call, training)[1] // call.batch)
  whole = call.split_from or call.batch
  shards = {-(-whole // n) for n in range(1, jax.device_count() + 1)}
  return max(-(-scratch_bytes(call.uniform(b), training)[1] // b) for b in shards)


def forward(call: Call, x, h0, c0, w, *, training: bool):
  """``(y, h_n, c_n, reserve)``; ``c_n`` is None for GRU."""
  workspace, _ = scratch_bytes(call, training)
  states = jax.ShapeDtypeStruct(call.states, call.dtype)
  directions = 2 if call.bidirectional else 1
  outputs = (jax.ShapeDtypeStruct((call.time, call.batch, directions * call.hidden_size),
                                  call.dtype), states, call.cell_states,
             jax.ShapeDtypeStruct((call.batch, reserve_row_bytes(call, training)), jnp.uint8),
             jax.ShapeDtypeStruct((workspace,), jnp.uint8))
  y, h_n, c_n, reserved, _ = jax.ffi.ffi_call("jaxfuse_cudnn_rnn_forward", outputs)(
      _swap(x), h0, c0, w, training=np.int64(training),
      algo=np.int64(algorithm(call, training)), **call.attributes())
  return _swap(y), h_n, c_n if call.cell == "lstm" else None, reserved


def _swap(a):
  """A batch-major sequence time-major (as cuDNN takes it), or a time-major one batch-major."""
  return jnp.swapaxes(a, 0, 1)


def backward(call: Call, dy, dh_n, dc_n, x, h0, c0, w, y, reserve):
  """``(dx, dh0, dc0, dw)``; ``dc0`` is None for GRU."""
  workspace, _ = scratch_bytes(call, True)
  outputs = (jax.ShapeDtypeStruct(_swap(x).shape, call.dtype),
             jax.ShapeDtypeStruct(call.states, call.dtype), call.cell_states,
             jax.ShapeDtypeStruct(w.shape, call.dtype),
             jax.ShapeDtypeStruct(reserve.shape, jnp.uint8),
             jax.ShapeDtypeStruct((workspace,), jnp.uint8))
  # cudnnRNNBackwardData_v8 writes into the reserve: the call owns its copy.
  dx, dh0, dc0, dw, _, _ = jax.ffi.ffi_call(
      "jaxfuse_cudnn_rnn_backward", outputs, input_output_aliases={8: 4})(
          _swap(dy), dh_n, dc_n, _swap(x), h0, c0, w, _swap(y), reserve,
          algo=np.int64(algorithm(call, True)), **call.attributes())
  return _swap(dx), dh0, dc0 if call.cell == "lstm" else None, dw
