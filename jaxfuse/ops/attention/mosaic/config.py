"""The kernels' tiles: the forward's ``Config`` and the backward's ``BackwardConfig``, their
tables per head dim (for calls with and without a mask), and the calls and machines the
kernels take (``unsupported``, ``unavailable``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxfuse._core import registry

_CONSUMERS = 2
_SMEM_BYTES = 227 * 1024  # shared memory a Hopper CTA may take


@dataclasses.dataclass(frozen=True)
class Config:
  """Rows per consumer warpgroup (``block_q``, a CTA takes two such blocks), key/value rows per
  tile, and the tiles in flight. ``prefetch_q``: the next item's queries load into a second
  buffer while this item's run."""
  block_q: int = 64
  block_kv: int = 128
  stages: int = 2
  prefetch_q: bool = True
  # Masks compare each score's column minus row with scalar bounds (``_Band.mask``), or, False,
  # its positions.
  diagonal_mask: bool = True

  def __post_init__(self):
    # With one slot every load would wait for the products before it: nothing in flight.
    if self.stages < 2:
      raise ValueError(f"Config.stages must be at least 2, got {self.stages}")


# Per head dim (the larger of the query's and the value's; the kernel is Hopper's only): the
# fastest tiles timed (benchmarks/tune.py) of those whose Q (two buffers with prefetch_q), K and
# V slots fit the 227 KiB of shared memory. Prefetched queries load while the item before runs;
# at head dim 256 a second buffer does not fit. Each head dim takes the mask form that timed
# faster there.
CONFIGS = {64: Config(64, 128, 3), 128: Config(64, 128, 2),
           256: Config(64, 64, 2, prefetch_q=False, diagonal_mask=False)}


def unavailable() -> str | None:
  """Why the kernel cannot run here, or None: it needs Pallas Mosaic GPU and a Hopper GPU."""
  try:
    from jax.experimental.pallas import mosaic_gpu  # noqa: F401
  except ImportError as e:
    return f"this JAX ({jax.__version__}) has no Pallas Mosaic GPU: {e}"
  capability = registry.cuda_compute_capability()
  if capability is None or capability[0] != 9:
    return (f"the 'mosaic' attention is written for Hopper (sm_90) wgmma; this device is "
            f"{registry.platform()} {capability}")
  return None


# Where no mask needs the scores (no causal mask, window or segments), at head dim 64 key
# tiles twice as long halve the rescaling rounds and turns per key; under a causal mask they
# timed slower, so only these calls take them.
UNMASKED_CONFIGS = {64: Config(64, 256, 2)}


def _unmasked(spec, has_segments: bool) -> bool:
  """Whether no mask walks the bands (no causal mask, window or segments): the unmasked
  tables apply."""
  return not (spec.is_causal or spec.window is not None or has_segments)


def default_config(h: int, hv: int, spec, has_segments: bool) -> Config:
  """The forward's tiles for head dims ``h`` (queries, keys) and ``hv`` (values) and a mask."""
  dim = max(h, hv)
  if _unmasked(spec, has_segments):
    return UNMASKED_CONFIGS.get(dim, CONFIGS[dim])
  return CONFIGS[dim]


def unsupported(q_shape, k_shape, v_shape, dtype, *, spec, has_segments, has_q_len,
                has_kv_len, return_lse=False) -> str | None:
  """Why the kernel cannot take this call, naming the argument, or None."""
  del spec, has_segments, has_q_len, has_kv_len, return_lse  # all taken
  h, hv = q_shape[3], v_shape[3]
  if jnp.dtype(dtype) not in (jnp.float16, jnp.bfloat16):
    return f"the 'mosaic' kernel takes float16 and bfloat16, not {jnp.dtype(dtype).name}"
  for name, dim in (("query/key head dim", h), ("value head dim", hv)):
    if dim not in CONFIGS:
      return f"the 'mosaic' kernel takes a {name} in {tuple(CONFIGS)}, not {dim}"
  return None


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Tiles of the two backward kernels. dK/dV: each consumer warpgroup holds ``dkdv_block_kv``
  key rows and their two float32 gradients while query tiles of ``dkdv_block_q`` rows stream
  past; dQ: each holds ``dq_block_q`` query rows and their gradient while key tiles of
  ``dq_block_kv`` rows stream past. ``stages``: streamed tiles in flight. ``persistent``: a
  CTA per SM runs item after item (``_schedule``), the next item's held rows loading into a
  second buffer while this item's walk runs; else a CTA per item."""
  dkdv_block_kv: int = 64
  dkdv_block_q: int = 64
  dq_block_q: int = 64
  dq_block_kv: int = 64
  stages: int = 2
  # dK and dV with the two consumers sharing one block of key rows, one holding dK, the other
  # dV (``_dkdv_paired``): at head dim 256 a key block's two float32 gradients together
  # outgrow a warpgroup's registers.
  paired_dk_dv: bool = False
  # Masks by column minus row, or, False, by positions (``Config.diagonal_mask``).
  diagonal_mask: bool = True
  persistent: bool = False

  def __post_init__(self):
    if self.stages < 2:
      raise ValueError(f"BackwardConfig.stages must be at least 2, got {self.stages}")
    if self.persistent and self.paired_dk_dv:
      raise ValueError("BackwardConfig.persistent takes dK and dV in one warpgroup, not "
                       "paired_dk_dv")
    # The dQ kernel's items then cover every query row the dK/dV kernel streams: the stats it
    # hands on (lse, delta) have no row unwritten.
    if (2 * self.dq_block_q) % self.dkdv_block_q:
      raise ValueError(f"BackwardConfig.dkdv_block_q ({self.dkdv_block_q}) must divide two "
                       f"dq_block_q ({2 * self.dq_block_q})")


# Per head dim (the larger of the query's and the value's), for the head dims CONFIGS takes:
# the fastest timed (benchmarks/tune.py). At 64 the dQ kernel streams the forward's key tiles,
# and masks by positions and a persistent kernel paid. At 128 neither a third stage nor longer
# tiles paid, and a CTA per item ends long causal rows more evenly than a persistent kernel's
# static deal (the GPU deals CTAs as others finish, the light ones last). At 256 shared memory
# takes only 32-row streamed tiles and no second buffer of held rows, and the registers one
# float32 gradient per key block, which dK and dV paired give each consumer: four products per
# tile where two kernels took five. At 128 and 256 the mask forms tie. Consumers of 240
# registers (the producer 24) gained nothing over 232 (and 40).
BACKWARD_CONFIGS = {64: BackwardConfig(64, 64, 64, 128, 2, diagonal_mask=False,
                                       persistent=True),
                    128: BackwardConfig(64, 64, 64, 64, 2),
                    256: BackwardConfig(64, 32, 64, 32, 2, paired_dk_dv=True)}

# Where no mask walks the bands (no causal mask, window or segments), at head dim 256 a third
# stage (one more streamed tile in flight) timed faster on the full step and slower under a
# causal mask, so only these calls take it.
BACKWARD_UNMASKED_CONFIGS = {256: BackwardConfig(64, 32, 64, 32, 3, paired_dk_dv=True)}


def default_backward_config(h: int, hv: int, spec, has_segments: bool) -> BackwardConfig:
  """The backward's tiles for head dims ``h`` (queries, keys) and ``hv`` (values) and a mask."""
  dim = max(h, hv)
  if _unmasked(spec, has_segments):
    return BACKWARD_UNMASKED_CONFIGS.get(dim, BACKWARD_CONFIGS[dim])
  return BACKWARD_CONFIGS[dim]
