"""jaxfuse: fused GPU kernels for JAX, with a pure-XLA path that runs anywhere.

Every op takes ``implementation=``: ``'xla'`` (reference, any backend), ``'triton'`` (Pallas on
Triton; interpreted on the CPU), and ``None`` for the fastest available on this device.
"""

from jaxfuse._core.registry import IMPLEMENTATIONS
from jaxfuse.ops.norm.api import layer_norm, rms_norm

__version__ = "0.1.0"

__all__ = ["IMPLEMENTATIONS", "layer_norm", "rms_norm"]
