"""Flax NNX layers over jaxfuse's ops (needs ``flax``; ``pip install "jaxfuse[nn]"``).

``RMSNorm`` and ``LayerNorm`` are drop-ins for ``flax.nnx.RMSNorm`` and ``flax.nnx.LayerNorm``:
the same constructor arguments, parameters (``scale``, ``bias``) and dtype rules, so a
checkpoint of one loads into the other. ``LSTM`` and ``GRU`` hold the flat cuDNN-layout weights
of ``jaxfuse.lstm`` and ``jaxfuse.gru``.
"""

from jaxfuse.nn.normalization import LayerNorm, RMSNorm
from jaxfuse.nn.recurrent import GRU, LSTM

__all__ = ["GRU", "LSTM", "LayerNorm", "RMSNorm"]
