"""``gelu_mlp``'s GELU inside cuBLASLt's products, through XLA's FFI (``gelu_gemm.cu``).

The first product's epilogue adds the bias and applies the GELU (the tanh form), writing the
activation and, for a differentiated call, its input (the pre-activation); the backward's
``dy @ w2.T`` applies the GELU's derivative at that input in its epilogue. The second product,
the bias and weight gradients and the input gradient stay with XLA.

Calling convention (M rows, K inputs, F hidden, E outputs, float16 or bfloat16 throughout):
``forward(x (M, K), w1 (K, F), b1 (F,), training)`` -> ``(activation (M, F),)`` and, in
training, the pre-activation (M, F); ``backward(dy (M, E), w2 (F, E), pre (M, F))`` ->
``dh (M, F)``. Rows and hidden features are computed shard by shard (a batch-sharded x, or w1,
b1 and w2 split by hidden feature as in tensor parallelism, are never gathered); under vmap the
examples run one at a time.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._core import cuda
from jaxfuse._core.batching import one_example_at_a_time
from jaxfuse._core.sharding import parallel_call

_SOURCE = Path(__file__).with_name("gelu_gemm.cu")
_HANDLERS = {"jaxfuse_gelu_gemm_forward": "JaxfuseGeluGemmForward",
             "jaxfuse_gelu_gemm_backward": "JaxfuseGeluGemmBackward"}
LIBRARY = cuda.Library(_SOURCE, _HANDLERS, vendor="cublaslt")
_DTYPES = {jnp.dtype(jnp.float16): 0, jnp.dtype(jnp.bfloat16): 1}
_FORWARD, _TRAINING, _BACKWARD = 0, 1, 2  # gelu_gemm.cu's Mode


def unavailable() -> str | None:
  """Why the cuBLASLt products cannot run here (no GPU, no nvcc or cuBLASLt, a failed build),
  or None."""
  return LIBRARY.unavailable()


def unsupported(dtype, inputs: int, hidden: int, outputs: int, approximate: bool) -> str | None:
  """Why the epilogues cannot take an MLP of these widths in ``dtype``, or None."""
  if not approximate:
    return "cuBLASLt's GELU epilogue is the tanh approximation; approximate=False has none"
  if jnp.dtype(dtype) not in _DTYPES:
    return f"the 'cuda' gelu_mlp takes float16 and bfloat16, not {jnp.dtype(dtype).name}"
  widths = dict(inputs=inputs, hidden=hidden, outputs=outputs)
  if odd := {name: width for name, width in widths.items() if width % 8 or not width}:
    return ("the 'cuda' gelu_mlp needs widths that are positive multiples of 8 (16-byte rows), "
            f"got {odd}")
  return None


@functools.cache
def _workspace(mode: int, dtype, rows: int, inner: int, features: int) -> int:
  """The bytes cuBLASLt asks for one product on any of this process's GPUs, its algorithm
  chosen once per shape and GPU (a sharded call runs the same product on each)."""
  function = LIBRARY.load().jaxfuse_gelu_gemm_workspace
  function.argtypes = [ctypes.c_int64] * 5 + [
      ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.POINTER(ctypes.c_uint64),
      ctypes.c_char_p, ctypes.c_int64]
  ids = [d.local_hardware_id for d in jax.local_devices() if d.platform == "gpu"]
  devices = (ctypes.c_int64 * len(ids))(*ids)
  bytes_, error = ctypes.c_uint64(0), ctypes.create_string_buffer(512)
  if function(mode, _DTYPES[jnp.dtype(dtype)], rows, inner, features, devices, len(ids),
              ctypes.byref(bytes_), error, len(error)):
    raise NotImplementedError(f"the 'cuda' gelu_mlp: {error.value.decode()}")
  return bytes_.value


def _attributes(mode, dtype, rows, inner, features) -> dict:
  return dict(dtype=np.int64(_DTYPES[jnp.dtype(dtype)]), rows=np.int64(rows),
              inner=np.int64(inner), features=np.int64(features),
              **({} if mode == _BACKWARD else dict(mode=np.int64(mode))))


def forward(x, w1, b1, training: bool) -> tuple:
  """``(gelu(x @ w1 + b1),)`` for rows ``x`` (M, K), and ``x @ w1 + b1`` too if ``training``."""
  return one_example_at_a_time(lambda x, w1, b1: parallel_call(
      "gelu_mlp", functools.partial(_forward, training=training), x, w1, b1,
      in_dims=[("m", "k"), ("k", "f"), ("f",)], out_dims=[("m", "f")] * (1 + training),
      parallel={"m", "f"}))(x, w1, b1)


def backward(dy, w2, pre):
  """``dh``: the GELU's input gradient for output cotangents ``dy`` (M, E)."""
  return one_example_at_a_time(lambda dy, w2, pre: parallel_call(
      "gelu_mlp", _backward, dy, w2, pre, in_dims=[("m", "e"), ("f", "e"), ("m", "f")],
      out_dims=[("m", "f")], parallel={"m", "f"}))(dy, w2, pre)[0]


def _forward(x, w1, b1, training):
  (rows, inner), features = x.shape, w1.shape[1]
  mode = _TRAINING if training else _FORWARD
  hidden = jax.ShapeDtypeStruct((rows, features), x.dtype)
  workspace = jax.ShapeDtypeStruct((max(1, _workspace(mode, x.dtype, rows, inner, features)),),
                                   jnp.uint8)
  pre = hidden if training else jax.ShapeDtypeStruct((1,), x.dtype)
  activation, pre, _ = jax.ffi.ffi_call("jaxfuse_gelu_gemm_forward", (hidden, pre, workspace))(
      x, w1, b1, **_attributes(mode, x.dtype, rows, inner, features))
  return (activation, pre) if training else (activation,)


def _backward(dy, w2, pre):
  (rows, inner), features = dy.shape, w2.shape[0]
  workspace = jax.ShapeDtypeStruct(
      (max(1, _workspace(_BACKWARD, dy.dtype, rows, inner, features)),), jnp.uint8)
  dh, _ = jax.ffi.ffi_call(
      "jaxfuse_gelu_gemm_backward", (jax.ShapeDtypeStruct(pre.shape, dy.dtype), workspace))(
          dy, w2, pre, **_attributes(_BACKWARD, dy.dtype, rows, inner, features))
  return (dh,)
