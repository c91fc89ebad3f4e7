"""Attention on Hopper's matrix units, forward and backward: Pallas Mosaic GPU, wgmma and TMA.

Forward. A work item is ``2 * block_q`` query rows of one head. The kernel is persistent: a
CTA per SM takes items in pairs, dealt round-robin (``_work_item``), and runs three
warpgroups. The third is the producer: it streams the key and value tiles of ``block_kv`` rows
into a ring of ``stages`` shared-memory slots by TMA, each slot guarded by a "loaded" barrier,
and refills a slot once both consumers have arrived on its "consumed" barrier. The ring runs
on from one item into the next, so the next item's first tiles load while this one's last
compute and its output is stored. The other two are consumers, each with ``block_q`` query
rows (the next item's loading into a second buffer): S = Q K^T by wgmma into a float32
accumulator, the online softmax in base 2 (running maximum of the scaled scores, exponentials
as exp2), then O += P V by wgmma. A schedule barrier the consumers pass twice per tile makes
them take turns on the tensor cores, so one's softmax runs while the other's products do
(FlashAttention-3's ping-pong).

Masks come from positions (causal with an offset, a (left, right) window, key and query
lengths) and from segment ids. Each consumer walks the key tiles of its band in three runs:
masked tiles at the band's lower edge, tiles whose keys every row sees (no mask), masked tiles
at the upper edge; tiles wholly outside the band are not loaded. Segment ids mask the tiles
other than those whose ids are all the rows' one id; query lengths (in the forward) mask every
tile. The producer loads the union of both consumers' bands; a consumer passes the
tiles only its partner needs, waiting and arriving on their barriers without computing (a
Mosaic barrier's phase is tracked per thread, so no wait may be skipped).

Partial tiles: queries and keys past T and S are read as zeros by TMA, which also drops stores
past T; keys past S are masked. Query and value head dims are 64, 128 or 256, independently.

Backward: two kernels of the same shape (a producer streaming tiles to two consumers, each
holding a block of rows; bands walked in masked and unmasked runs), each summing in a fixed
order, so the gradients are deterministic without atomics. A CTA takes one item, or, with
``BackwardConfig.persistent``, one CTA per SM takes items in pairs as the forward's, its ring
running on across items and the next item's rows loading into a second buffer. The dK/dV
kernel holds key blocks and streams the query tiles of every query head of the key's group in
turn (GQA sums over the group in order); the dQ kernel holds query blocks and streams key
tiles. Both recompute the probabilities from the saved log-sum-exp; a row with none saved (no
allowed key, padding, past the query length) has lse = +inf and so no probability, which no
mask has to see. At head dim 256 a key block's two float32 gradients outgrow a warpgroup's
registers: ``BackwardConfig.paired_dk_dv`` gives each consumer one of them, for one block of
key rows, the two trading P^T and dP^T - delta through shared memory.

Modules: ``config`` (the tiles' tables, and the calls and machines the kernels take),
``band`` (which tiles the mask lets each block of rows walk, and which items each CTA takes),
``pipeline`` (the pieces the kernels share), ``fwd`` (the forward), ``bwd`` (the backward's
entry and its dQ kernel) and ``bwd_dkdv`` (its dK/dV kernels): no module shares a name with
the ``forward`` and ``backward`` this package exports.
"""

# The kernels' modules import Pallas Mosaic GPU inside their functions: this package imports
# on a JAX without it, and ``unavailable`` says why it cannot run.
from jaxfuse.ops.attention.mosaic.band import _Band, _segment_spans, _work_item
from jaxfuse.ops.attention.mosaic.bwd import backward
from jaxfuse.ops.attention.mosaic.config import (BACKWARD_CONFIGS, BACKWARD_UNMASKED_CONFIGS,
                                                 CONFIGS, UNMASKED_CONFIGS, BackwardConfig,
                                                 Config, default_backward_config,
                                                 default_config, unavailable, unsupported)
from jaxfuse.ops.attention.mosaic.fwd import forward
from jaxfuse.ops.attention.mosaic.pipeline import _walk

# A name is read where it is defined: a test that patches a table or helper patches its module
# (``config``, ``band``, ``pipeline``), not these copies. The private names are the index math
# the tests check without a GPU.
__all__ = [
    "BACKWARD_CONFIGS", "BACKWARD_UNMASKED_CONFIGS", "CONFIGS", "UNMASKED_CONFIGS",
    "BackwardConfig", "Config", "backward", "default_backward_config", "default_config",
    "forward", "unavailable", "unsupported",
    "_Band", "_segment_spans", "_walk", "_work_item",
]
