"""jaxfuse: fused GPU kernels for JAX, with a pure-XLA path that runs anywhere.

Every op takes ``implementation=``: ``'xla'`` (reference, any backend), ``'triton'`` (Pallas on
Triton; interpreted on the CPU), ``'mosaic'`` (Pallas Mosaic GPU, Hopper), ``'cuda'`` (CUDA C++
through XLA's FFI, built on first use), ``'cudnn'`` where cuDNN has the op, and ``None`` for
the fastest available for this call on this device (by its tuned table).
``jaxfuse.without_triton()`` (or ``JAXFUSE_WITHOUT_TRITON=1`` for the process) runs jaxfuse as
if Pallas's Triton backend, which JAX deprecated, were already gone.
"""

from jaxfuse._core.explain import explain
from jaxfuse._core.registry import IMPLEMENTATIONS, without_triton
from jaxfuse.ops.attention.api import attention
from jaxfuse.ops.linear_cross_entropy.api import linear_cross_entropy
from jaxfuse.ops.mlp.api import gelu_mlp
from jaxfuse.ops.norm.api import layer_norm, rms_norm
from jaxfuse.ops.rnn.api import gru, lstm
from jaxfuse.ops.rnn.weights import (gru_weight_count, gru_weights_from_torch,
                                     gru_weights_to_torch, init_gru_weights, init_lstm_weights,
                                     lstm_weight_count, lstm_weights_from_torch,
                                     lstm_weights_to_torch, pack_gru_weights, pack_lstm_weights,
                                     unpack_gru_weights, unpack_lstm_weights)
from jaxfuse.ops.softmax.api import log_softmax, softmax, softmax_cross_entropy

__version__ = "0.1.0"

__all__ = [
    "IMPLEMENTATIONS", "attention", "explain", "gelu_mlp", "layer_norm", "linear_cross_entropy",
    "log_softmax", "rms_norm", "softmax", "softmax_cross_entropy", "gru", "gru_weight_count",
    "gru_weights_from_torch", "gru_weights_to_torch", "init_gru_weights", "init_lstm_weights",
    "lstm", "lstm_weight_count", "lstm_weights_from_torch", "lstm_weights_to_torch",
    "pack_gru_weights", "pack_lstm_weights", "unpack_gru_weights", "unpack_lstm_weights",
    "without_triton",
]
