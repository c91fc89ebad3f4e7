"""Flax NNX layers over jaxfuse's ops (needs ``flax``; ``pip install "jaxfuse[nn]"``).

``RMSNorm`` and ``LayerNorm`` are drop-ins for ``flax.nnx.RMSNorm`` and ``flax.nnx.LayerNorm``:
the same constructor arguments, parameters (``scale``, ``bias``) and dtype rules, so a
checkpoint of one loads into the other. ``LSTM`` and ``GRU`` hold the flat cuDNN-layout weights
of ``jaxfuse.lstm`` and ``jaxfuse.gru``. ``dot_product_attention`` is an ``attention_fn`` for
``flax.nnx.MultiHeadAttention``, ``CausalSelfAttention`` a decoder's attention layer with
``MultiHeadAttention``'s parameters, ``GeluMLP`` a transformer's MLP (two ``nnx.Linear``s) whose
backward recomputes the activation, and ``cross_entropy_loss`` the training loop's loss.
"""

try:
  import flax  # noqa: F401
except ModuleNotFoundError as missing:
  raise ModuleNotFoundError('jaxfuse.nn builds on flax, which is not installed: '
                            'pip install "jaxfuse[nn]" (or pip install flax)') from missing

from jaxfuse.nn.attention import CausalSelfAttention, dot_product_attention
from jaxfuse.nn.losses import cross_entropy_loss
from jaxfuse.nn.mlp import GeluMLP
from jaxfuse.nn.normalization import LayerNorm, RMSNorm
from jaxfuse.nn.recurrent import GRU, LSTM, gru_weights_from_flax, lstm_weights_from_flax

__all__ = ["GRU", "GeluMLP", "LSTM", "CausalSelfAttention", "LayerNorm", "RMSNorm",
           "cross_entropy_loss", "dot_product_attention", "gru_weights_from_flax",
           "lstm_weights_from_flax"]
