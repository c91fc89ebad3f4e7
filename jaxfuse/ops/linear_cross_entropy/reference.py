"""XLA implementation of ``linear_cross_entropy``: the tokens walked in chunks.

Each chunk of rows gets its logits ``x[rows] @ weight + bias`` in float32, folds them into
its rows' log-sum-exp and loss and, when gradients are asked for, into ``dx[rows]`` and the
running ``dweight`` and ``dbias``, before the next chunk's logits replace them. The chunks are
the iterations of a loop, so temporary memory is one chunk's logits whatever XLA's scheduler
does: ``CHUNK_ELEMENTS``, never tokens x vocabulary.

Chunks of whole rows (rather than of vocabulary columns with an online log-sum-exp) are what
lets the loss and its gradients come out of one walk: a row's softmax needs its log-sum-exp,
which a column chunk only has after the last chunk. One walk is three matrix products, as
many as the unfused loss; a column walk needs a second pass that recomputes the logits (four).
The last chunk ends at the last row and may overlap the one before; its rows already done are
masked out of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Logits held per chunk, float32: 512 MiB, a few percent of the unfused training step's
# (tokens, vocabulary) logits and their gradient at GPT-2's shape, while a chunk's products
# stay large enough for the matrix units. Fewer, larger chunks also mean fewer passes of the
# float32 dweight accumulator through memory.
CHUNK_ELEMENTS = 1 << 27


def rows_per_chunk(tokens: int, vocab: int, width: int, elements: int) -> int:
  """Rows of the chunks that walk ``tokens``: at most ``elements // vocab`` (whole tiles of the
  products' row blocks where that allows), in as many chunks as costs the least.

  The last chunk ends at the last row, so rows it shares with the one before are computed
  twice (GPT-2's 16384 tokens in chunks of 2560 would compute 17920); each chunk also passes
  the float32 ``(width, vocab)`` weight gradient through memory once, as many bytes as
  ``width`` rows of float32 logits. The chunk count that costs least is taken, with rows
  spread evenly over the chunks (GPT-2's: 7 chunks of 2432).
  """
  cap = max(1, elements // vocab)
  tile = next((t for t in (128, 8) if cap >= t), 1)
  cap -= cap % tile
  if cap >= tokens:
    return tokens

  def rows(chunks):
    r = -(-tokens // chunks)
    return min(r + -r % tile, cap)

  def cost(r):
    chunks = -(-tokens // r)
    return chunks * (r + width)

  fewest = -(-tokens // cap)
  return min((rows(c) for c in range(fewest, 2 * fewest + 1)), key=lambda r: (cost(r), -r))


def padded_vocab(vocab: int) -> int:
  return vocab + -vocab % 128


def walk(x, weight, bias, labels, *, label_smoothing, z_loss, row_grad=None, lse=None,
         chunk_elements=CHUNK_ELEMENTS, row_pass=None):
  """Per-row loss (0 where ``labels`` is -1) and log-sum-exp, and with ``row_grad`` (the
  cotangent of each row's loss) the gradients ``(dx, dweight, dbias)`` in float32 (float64
  for float64; dbias None without a bias). ``x (N, W)`` in the products' operand dtype,
  ``weight (W, V)``, ``bias (V,)`` or None,
  ``labels (N,)`` int32; ``lse`` spares recomputing the log-sum-exps of a forward pass.
  ``row_pass`` takes each chunk's logits to its rows' losses and gradient (``xla_rows``'s
  contract; a kernel's may leave the log-sum-exps unwritten when it computes gradients)."""
  row_pass = row_pass or xla_rows
  tokens, vocab = x.shape[0], weight.shape[1]
  accumulate = jnp.promote_types(jnp.float32, x.dtype)
  rows = rows_per_chunk(tokens, vocab, x.shape[1], chunk_elements)
  # A vocabulary of whole 128-column tiles: for an odd one (GPT-2's 50257) XLA would pad the
  # weight for cuBLAS in every chunk, or pick generated matmuls at a fraction of its rate
  # (GPU profile: benchmarks/profile_gpt.py). Padded once here, the extra columns' logits take
  # no part in the loss and their softmax gradient is zero.
  padded = padded_vocab(vocab)
  weight = jnp.pad(weight.astype(x.dtype), ((0, 0), (0, padded - vocab)))
  bias = None if bias is None else bias.astype(accumulate)
  with_grads = row_grad is not None

  def chunk(index, carry):
    start = jnp.minimum(index * rows, tokens - rows)
    new = start + jnp.arange(rows) >= index * rows
    take = lambda a: lax.dynamic_slice_in_dim(a, start, rows)
    put = lambda a, part: lax.dynamic_update_slice_in_dim(
        a, jnp.where(new.reshape((rows,) + (1,) * (a.ndim - 1)), part, take(a)), start, 0)
    xs, label = take(x), take(labels)
    logits = lax.dot_general(xs, weight, (((1,), (0,)), ((), ())),
                             preferred_element_type=accumulate)
    row_scale = jnp.where(new & (label >= 0), take(row_grad), 0.0) if with_grads else None
    loss, row_lse, d, dbias = row_pass(
        logits, bias, label, row_scale, None if lse is None else take(lse), classes=vocab,
        label_smoothing=label_smoothing, z_loss=z_loss, grad_dtype=x.dtype)
    carry = dict(carry, loss=put(carry["loss"], loss), lse=put(carry["lse"], row_lse))
    if not with_grads:
      return carry
    dx = lax.dot_general(d, weight, (((1,), (1,)), ((), ())), preferred_element_type=accumulate)
    dweight = lax.dot_general(xs, d, (((0,), (0,)), ((), ())), preferred_element_type=accumulate)
    carry = dict(carry, dx=put(carry["dx"], dx), dweight=carry["dweight"] + dweight)
    if bias is not None:
      carry["dbias"] = carry["dbias"] + dbias
    return carry

  init = dict(loss=jnp.zeros((tokens,), accumulate), lse=jnp.zeros((tokens,), accumulate))
  if with_grads:
    init.update(dx=jnp.zeros(x.shape, accumulate), dweight=jnp.zeros(weight.shape, accumulate))
    if bias is not None:
      init["dbias"] = jnp.zeros((vocab,), accumulate)
  out = lax.fori_loop(0, -(-tokens // rows), chunk, init)
  grads = (out["dx"], out["dweight"][:, :vocab], out.get("dbias")) if with_grads else None
  return out["loss"], out["lse"], grads


def xla_rows(logits, bias, labels, row_scale, lse, *, classes, label_smoothing, z_loss,
             grad_dtype):
  """One chunk's rows from their logits ``(R, P)`` (the first ``classes`` columns are the
  classes, the rest padding), before ``bias (classes,)`` or None: the per-row loss (0 where
  ``labels`` is -1) and log-sum-exp (``lse`` when given), and with ``row_scale`` (each row's
  cotangent, 0 for rows not counted) the gradient of the scaled losses with respect to the
  padded logits in ``grad_dtype`` (zero in the padding), the products' operand, and its column
  sums (dbias, float32, None without a bias)."""
  padded = logits.shape[1]
  logits = logits[:, :classes]
  if bias is not None:
    logits = logits + bias
  row_lse = _logsumexp_rows(logits) if lse is None else lse
  picked = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[:, None], axis=1)[:, 0]
  loss = row_lse - (1.0 - label_smoothing) * picked
  if label_smoothing:
    loss = loss - label_smoothing * jnp.mean(logits, axis=1)
  if z_loss:
    loss = loss + z_loss * row_lse * row_lse
  loss = jnp.where(labels >= 0, loss, 0.0)
  if row_scale is None:
    return loss, row_lse, None, None
  scale = row_scale * (1.0 + 2.0 * z_loss * row_lse)
  hit = jnp.arange(classes) == labels[:, None]
  d = (jnp.exp(logits - row_lse[:, None]) * scale[:, None]
       - jnp.where(hit, (1.0 - label_smoothing) * row_scale[:, None], 0.0)
       - label_smoothing / classes * row_scale[:, None])
  # The products take d in the operands' dtype, as XLA's gradient of x @ weight would.
  operand = jnp.pad(d.astype(grad_dtype), ((0, 0), (0, padded - classes)))
  return loss, row_lse, operand, None if bias is None else jnp.sum(d, axis=0)


def _logsumexp_rows(logits):
  """Each row's log-sum-exp in one pass over the logits (a running maximum and the sum of
  exponentials under it, as in online softmax) where ``jax.nn.logsumexp`` reads them twice,
  and a chunk's float32 logits are the largest array it moves (measured: benchmarks/results/)."""

  def combine(a, b):
    (max_a, sum_a), (max_b, sum_b) = a, b
    top = jnp.maximum(max_a, max_b)
    # exp(-inf - -inf) is NaN: a side that has seen only -inf adds nothing.
    scaled = lambda m, s: jnp.where(m == -jnp.inf, 0.0, s * jnp.exp(m - top))
    return top, scaled(max_a, sum_a) + scaled(max_b, sum_b)

  top, total = lax.reduce((logits, jnp.ones_like(logits)),
                          (jnp.array(-jnp.inf, logits.dtype), jnp.array(0, logits.dtype)),
                          combine, (1,))
  # A +inf logit gives top = inf and exp(inf - inf) = NaN; logsumexp is inf there.
  return jnp.where(top == jnp.inf, top, top + jnp.log(total))
