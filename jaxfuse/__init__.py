"""jaxfuse: fused GPU kernels for JAX, with a pure-XLA path that runs anywhere.

Every op takes ``implementation=``: ``'xla'`` (reference, any backend), ``'triton'`` (Pallas on
Triton; interpreted on the CPU), and ``None`` for the fastest available on this device.
"""

from jaxfuse._core.registry import IMPLEMENTATIONS
from jaxfuse.ops.attention.api import attention
from jaxfuse.ops.norm.api import layer_norm, rms_norm
from jaxfuse.ops.softmax.api import log_softmax, softmax, softmax_cross_entropy

__version__ = "0.1.0"

__all__ = [
    "IMPLEMENTATIONS", "attention", "layer_norm", "log_softmax", "rms_norm", "softmax", "softmax_cross_entropy",
]
