"""jaxfuse.attention against a float64 reference over a grid of features.

The reference here is written independently of the library: dense (T, S) scores in float64 with
the masks built in NumPy. The 'triton' kernels run in the Pallas interpreter on the CPU (which
fills outputs with NaN first, so unwritten elements fail).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfuse
from jaxfuse._core import op
from jaxfuse._core.testing import assert_close, random, x64
from jaxfuse.ops.attention import reference

IMPLS = ["xla", "triton"]


def positional_mask(t, s, causal=False, offset=0, window=None):
  """``(T, S)``: whether query i may attend to key j under the causal mask and the window, as
  ``jaxfuse.attention`` documents them."""
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  keep = np.ones((t, s), bool)
  if causal:
    keep &= j <= i + offset
  if window is not None:
    keep &= (j >= i + offset - window[0]) & (j <= i + offset + window[1])
  return keep


def dense_reference(q, k, v, *, scale=None, causal=False, offset=0, window=None, q_seg=None,
                    kv_seg=None, q_len=None, kv_len=None, cap=None, bias=None, mask=None, do=None,
                    dlse=None):
  """float64 (out, lse) and, given do (and dlse, else zeros), (dq, dk, dv) by JAX autodiff of
  the dense formula."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  scale = 1 / np.sqrt(h) if scale is None else scale
  keep = np.ones((b, n, t, s), bool) & positional_mask(t, s, causal, offset, window)
  if q_seg is not None:
    keep &= (np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :])[:, None]
  if q_len is not None:
    keep &= (np.arange(t)[None, :] < np.asarray(q_len)[:, None])[:, None, :, None]
  if kv_len is not None:
    keep &= (np.arange(s)[None, :] < np.asarray(kv_len)[:, None])[:, None, None, :]
  if mask is not None:
    keep &= np.asarray(mask)
  with x64():
    def f(q, k, v):
      kk = jnp.repeat(k, n // kh, axis=2)
      vv = jnp.repeat(v, n // kh, axis=2)
      sc = jnp.einsum("btnh,bsnh->bnts", q, kk) * scale
      if cap is not None:
        sc = cap * jnp.tanh(sc / cap)
      if bias is not None:
        sc = sc + jnp.asarray(np.asarray(bias, np.float64))
      sc = jnp.where(keep, sc, -jnp.inf)
      m = jnp.max(sc, -1, keepdims=True)
      m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
      p = jnp.exp(sc - m)
      l = jnp.sum(p, -1, keepdims=True)
      p = p / jnp.where(l > 0, l, 1.0)
      lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)[..., 0]
      return jnp.einsum("bnts,bsnh->btnh", p, vv), lse
    @jax.jit  # one program, not an op-by-op dispatch
    def outputs_and_grads(q, k, v, do, dlse):
      (out, lse), vjp = jax.vjp(f, q, k, v)
      if do is None:
        return out, lse, None
      return out, lse, vjp((do, jnp.zeros_like(lse) if dlse is None else dlse))

    wide = lambda a: None if a is None else jnp.asarray(np.asarray(a, np.float64))
    out, lse, grads = outputs_and_grads(*map(wide, (q, k, v, do, dlse)))
    return (np.asarray(out), np.asarray(lse),
            None if grads is None else tuple(np.asarray(g) for g in grads))


def inputs(rng, b, t, s, n, kh, h, hv=None, dtype=jnp.float32):
  return (random(rng, (b, t, n, h), dtype), random(rng, (b, s, kh, h), dtype),
          random(rng, (b, s, kh, hv or h), dtype), random(rng, (b, t, n, hv or h), dtype))


def run(impl, q, k, v, do, dlse=None, **kw):
  # One program (the keywords, concrete lengths included, stay constants), not an op-by-op
  # dispatch.
  @jax.jit
  def outputs_and_grads(q, k, v, do, dlse):
    (out, lse), vjp = jax.vjp(lambda q, k, v: jaxfuse.attention(
        q, k, v, return_lse=True, implementation=impl, **kw), q, k, v)
    return out, lse, vjp((do, jnp.zeros_like(lse) if dlse is None else dlse))
  return outputs_and_grads(q, k, v, do, dlse)


def gradient_floors(q, k, v, do, *, causal=False, offset=0, window=None, q_seg=None,
                    kv_seg=None, q_len=None, kv_len=None, cap=None, block=512):
  """reference.gradient_floors in float64, for ``dense_reference``'s mask keywords."""
  del cap  # it only shrinks the terms
  as_array = lambda a: None if a is None else jnp.asarray(a)
  with x64():
    wide = (jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, v, do))
    spec = reference.MaskSpec(causal, offset, window)
    return tuple(np.asarray(f) for f in reference.gradient_floors(
        *wide, spec, (as_array(q_seg), as_array(kv_seg)), (as_array(q_len), as_array(kv_len)),
        block=block))


def compare(got, ref, factor=10, dtype=None, floors=(0.0, 0.0)):
  out, lse, grads = got
  r_out, r_lse, r_grads = ref
  assert_close(out, r_out, dtype, name="out")
  finite = np.isfinite(r_lse)
  assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
  assert_close(np.asarray(lse)[finite], r_lse[finite], jnp.float32, name="lse")
  for name, g, r, floor in zip(("dq", "dk", "dv"), grads, r_grads, (*floors, 0.0)):
    assert_close(g, r, dtype, factor=factor, name=name, floor=floor)


# (B, T, S, N, K, H, Hv): odd lengths, T != S, GQA and MQA, head dims 32..256 incl. 80, 96, 192.
SHAPES = [(1, 1, 1, 1, 1, 32, None), (2, 37, 45, 4, 2, 24, 40), (1, 70, 33, 3, 1, 80, None),
          (1, 20, 20, 2, 2, 96, 64), (1, 9, 17, 2, 1, 192, None), (1, 16, 24, 1, 1, 256, 128)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes_and_head_dims(rng, impl, shape):
  b, t, s, n, kh, h, hv = shape
  q, k, v, do = inputs(rng, b, t, s, n, kh, h, hv)
  compare(run(impl, q, k, v, do), dense_reference(q, k, v, do=do))


FEATURES = [
    dict(causal=True),
    dict(causal=True, offset=8),  # bottom-right: queries are the last T of S keys
    dict(causal=True, offset=-5),  # first rows fully masked
    dict(window=(4, 4)),
    dict(window=(6, 0), causal=True, offset=8),
    dict(cap=2.5),
    dict(segments=True),
    dict(segments=True, causal=True, window=(10, 3), offset=8),
    dict(lengths=True),
    dict(lengths=True, segments=True, causal=True, offset=8, cap=4.0),
]


def feature_kwargs(rng, feature, b, t, s, scale=1):
  """``attention`` and ``dense_reference`` keywords for one of FEATURES, whose offsets,
  windows and lengths are multiplied by ``scale``."""
  kw, ref_kw = {}, {}
  offset = feature.get("offset", 0) * scale
  if feature.get("causal"):
    kw.update(is_causal=True, causal_offset=offset)
    ref_kw.update(causal=True, offset=offset)
  if "window" in feature:
    window = tuple(w * scale for w in feature["window"])
    kw.update(local_window_size=window, causal_offset=offset)
    ref_kw.update(window=window, offset=offset)
  if "cap" in feature:
    kw["logits_soft_cap"] = ref_kw["cap"] = feature["cap"]
  if feature.get("segments"):
    q_seg = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32)
    kv_seg = jnp.asarray(np.sort(rng.integers(0, 3, (b, s)), axis=1), jnp.int32)
    kw["segment_ids"] = (q_seg, kv_seg)
    ref_kw.update(q_seg=q_seg, kv_seg=kv_seg)
  if feature.get("lengths"):
    q_len, kv_len = [t, 19 * scale][:b], [11 * scale, s][:b]
    kw.update(query_seq_lengths=jnp.array(q_len), key_value_seq_lengths=jnp.array(kv_len))
    ref_kw.update(q_len=q_len, kv_len=kv_len)
  return kw, ref_kw


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("feature", FEATURES, ids=str)
def test_features_and_combinations(rng, impl, feature):
  b, t, s, n, kh, h = 2, 25, 33, 4, 2, 32
  q, k, v, do = inputs(rng, b, t, s, n, kh, h)
  kw, ref_kw = feature_kwargs(rng, feature, b, t, s)
  compare(run(impl, q, k, v, do, **kw), dense_reference(q, k, v, do=do, **ref_kw))


@pytest.mark.triton
@pytest.mark.parametrize("feature", [f for f in FEATURES if not f.keys() & {"segments", "lengths"}]
                         + [{}], ids=str)
def test_unmasked_interior_blocks(rng, monkeypatch, feature):
  """Small tiles on long sequences: most blocks lie wholly inside the band and skip the mask;
  the edges of the band (causal diagonal, window sides, key tail) are masked."""
  from jaxfuse.ops.attention import triton as kernels
  small = kernels.AttentionBlocks(kernels.KernelBlocks(16, 8, 4, 1),
                                  kernels.KernelBlocks(8, 16, 4, 1),
                                  kernels.KernelBlocks(16, 8, 4, 1))
  monkeypatch.setattr(kernels, "default_blocks", lambda head_dim: small)
  b, t, s, n, kh, h = 1, 45, 61, 2, 1, 16
  q, k, v, do = inputs(rng, b, t, s, n, kh, h)
  kw, ref_kw = {}, {}
  offset = feature.get("offset", 0)
  if feature.get("causal"):
    kw.update(is_causal=True, causal_offset=offset)
    ref_kw.update(causal=True, offset=offset)
  if "window" in feature:
    kw.update(local_window_size=feature["window"], causal_offset=offset)
    ref_kw.update(window=feature["window"], offset=offset)
  if "cap" in feature:
    kw["logits_soft_cap"] = ref_kw["cap"] = feature["cap"]
  compare(run("triton", q, k, v, do, **kw), dense_reference(q, k, v, do=do, **ref_kw))


def _check_triton_band(walk, ok, block_rows, block_cols, padding_allowed, case):
  """``walk(first_row)`` gives the ``(lo, full_lo, full_hi, hi)`` column blocks of the rows
  from ``first_row`` of the rows-by-columns mask ``ok``: every allowed pair lies in a block of
  [lo, hi), and the blocks of [full_lo, full_hi), which skip the mask, allow every pair of the
  rows (columns past ``ok``'s taking ``padding_allowed``). Returns the bands."""
  n_rows, n_cols = ok.shape
  col_blocks = -(-n_cols // block_cols)
  firsts = np.arange(0, n_rows, block_rows)
  # A width shared by the cases, so that the mapped ops compile once.
  starts = jnp.arange(128 * -(-len(firsts) // 128), dtype=jnp.int32) * block_rows
  bands = np.stack([np.broadcast_to(np.asarray(x), starts.shape)
                    for x in jax.vmap(walk)(starts)], 1)[:len(firsts)]
  padded = np.pad(ok, ((0, 0), (0, col_blocks * block_cols - n_cols)),
                  constant_values=padding_allowed)
  for first, band in zip(firsts.tolist(), bands.tolist()):
    lo, full_lo, full_hi, hi = band
    where = (case, block_rows, block_cols, first, band)
    assert 0 <= lo <= full_lo <= full_hi <= hi, where
    assert lo == hi or hi <= col_blocks, where
    needed = np.nonzero(ok[first:first + block_rows].any(0))[0] // block_cols
    assert np.all((needed >= lo) & (needed < hi)), where
    assert padded[first:first + block_rows, full_lo * block_cols:full_hi * block_cols].all(), where
  return bands


def _check_triton_walks(bands):
  """``_banded_loop`` over each ``(lo, full_lo, full_hi, hi)`` visits every block of [lo, hi)
  once: unmasked in [full_lo, full_hi), masked elsewhere."""
  from jaxfuse.ops.attention import triton as kernels
  width = int(bands[:, 3].max()) + 1

  def visits(band):
    body = lambda j, seen, masked: seen.at[int(not masked), j].add(1)
    return kernels._banded_loop(tuple(band), body, jnp.zeros((2, width), jnp.int32))

  blocks = np.arange(width)
  for band, (masked, unmasked) in zip(bands, np.asarray(jax.vmap(visits)(jnp.asarray(bands)))):
    lo, full_lo, full_hi, hi = band
    inside = (blocks >= full_lo) & (blocks < full_hi)
    np.testing.assert_array_equal(unmasked, inside, err_msg=str(band))
    np.testing.assert_array_equal(masked, (blocks >= lo) & (blocks < hi) & ~inside,
                                  err_msg=str(band))


def test_triton_bands_cover_every_allowed_pair(rng):
  """The 'triton' kernels' key-block bands (forward and dQ) and query-block bands (dK/dV), on
  the host, against the mask over random lengths, tiles, causal offsets and windows (their
  edges mostly off the tiles, where a band one key short drops a pair), lengths and segments
  (which mask every block); and the loop that walks the bands."""
  from jaxfuse.ops.attention import api
  from jaxfuse.ops.attention import triton as kernels
  from jaxfuse.ops.attention.reference import MaskSpec
  tiles = [1, 2, 4, 8, 16, 32]
  bands = []
  for _ in range(300):
    t, s = (int(x) for x in rng.integers(1, 70, 2))
    causal = bool(rng.integers(2))
    window = tuple(int(x) for x in rng.integers(0, 20, 2)) if rng.integers(2) else None
    # Clamped as the API clamps what reaches the kernels.
    offset, window = api._band(int(rng.integers(-t - 5, s + 5)), window, t, s)
    q_len, kv_len = (int(rng.integers(0, n + 1)) if rng.integers(4) == 0 else None
                     for n in (t, s))
    segments = bool(rng.integers(4) == 0)
    ok = positional_mask(t, s, causal, offset, window)
    if segments:
      q_ids, kv_ids = (np.sort(rng.integers(0, 3, n)) for n in (t, s))
      ok &= q_ids[:, None] == kv_ids[None, :]
    if q_len is not None:
      ok[q_len:] = False
    if kv_len is not None:
      ok[:, kv_len:] = False
    forward, dkdv, dq = (kernels.KernelBlocks(*(int(x) for x in rng.choice(tiles, 2)), 4, 1)
                         for _ in range(3))
    st = kernels._Static(spec=MaskSpec(causal, offset, window), scale=1.0, t=t, s=s, n=1,
                         kv_heads=1, h=16, hv=16, has_segments=segments,
                         has_q_len=q_len is not None, has_kv_len=kv_len is not None,
                         allow_tf32=None, blocks=kernels.AttentionBlocks(forward, dkdv, dq))
    case = (t, s, st.spec, q_len, kv_len, segments)
    # Queries by key blocks: a key past S is a zero key, whose score would take probability.
    for blocks in (forward, dq):
      bands.append(_check_triton_band(
          functools.partial(kernels._kv_blocks, st, block_q=blocks.block_q,
                            block_k=blocks.block_k, kv_len=kv_len),
          ok, blocks.block_q, blocks.block_k, False, case))
    # Keys by query blocks: a query past T (the walk may leave its block unmasked) has dO = 0
    # and delta = 0, so it adds nothing.
    bands.append(_check_triton_band(
        functools.partial(kernels._q_blocks, st, block_q=dkdv.block_q, block_k=dkdv.block_k),
        ok.T, dkdv.block_k, dkdv.block_q, True, case))
  _check_triton_walks(np.unique(np.concatenate(bands), axis=0))


# (T, S, mask) whose band edges fall one key past the default tiles' boundaries (offset + right
# is 1 and offset - left is -1 modulo them): a band one key short drops exactly those pairs.
OFF_TILE_BANDS = [
    (130, 131, dict(causal=True, offset=1)),
    (70, 135, dict(causal=True, offset=65)),  # bottom-right: the last T of S keys
    (135, 70, dict(causal=True, offset=-63)),  # the first 63 rows fully masked
    (130, 131, dict(window=(4, 62), offset=3)),
    (130, 131, dict(causal=True, window=(66, 0), offset=1)),
    # Wide enough for unmasked blocks, whose edges fall one key inside a tile boundary: a range
    # one key (or one block) wider would skip the mask where it bites.
    (130, 131, dict(window=(129, 123), offset=3)),
]


@pytest.mark.triton
@pytest.mark.parametrize("t,s,feature", OFF_TILE_BANDS, ids=str)
def test_triton_band_edges_off_the_tiles(rng, t, s, feature):
  """The default tiles' bands on the masks above: output and gradients against float64."""
  q, k, v, do = inputs(rng, 1, t, s, 1, 1, 16)
  kw, ref_kw = feature_kwargs(rng, feature, 1, t, s)
  compare(run("triton", q, k, v, do, **kw), dense_reference(q, k, v, do=do, **ref_kw))


@pytest.mark.parametrize("impl", IMPLS + [pytest.param("mosaic", marks=pytest.mark.gpu)])
def test_lse_cotangent_reaches_the_inputs(rng, impl):
  """Gradients through the returned log-sum-exp too (a dLSE cotangent, which the kernels fold
  into delta: the Mosaic dQ kernel in its own rowsum(dO * O)), causal with GQA and odd
  lengths: against the float64 reference."""
  dtype = jnp.float32
  if impl == "mosaic":
    _mosaic_or_skip()
    dtype = jnp.bfloat16
  b, t, s, n, kh, h = 2, 100, 130, 4, 2, 64
  q, k, v, do = inputs(rng, b, t, s, n, kh, h, dtype=dtype)
  dlse = random(rng, (b, n, t), jnp.float32)
  ref_kw = dict(causal=True, offset=s - t)
  compare(run(impl, q, k, v, do, dlse, is_causal=True, causal_offset=s - t),
          dense_reference(q, k, v, do=do, dlse=dlse, **ref_kw), factor=4,
          dtype=None if dtype == jnp.float32 else dtype,
          floors=gradient_floors(q, k, v, do, **ref_kw))


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_give_zero_and_zero_gradient(rng, impl):
  q, k, v, do = inputs(rng, 1, 6, 6, 2, 2, 32)
  out, lse, (dq, dk, dv) = run(impl, q, k, v, do, is_causal=True, causal_offset=-3)
  assert np.all(np.asarray(out)[:, :3] == 0) and np.all(np.asarray(dq)[:, :3] == 0)
  assert np.all(np.isneginf(np.asarray(lse)[:, :, :3]))
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_and_float16(rng, impl):
  for dtype in (jnp.bfloat16, jnp.float16):
    q, k, v, do = inputs(rng, 1, 40, 40, 2, 1, 64, dtype=dtype)
    compare(run(impl, q, k, v, do, is_causal=True), dense_reference(q, k, v, causal=True, do=do),
            factor=4, dtype=dtype)


@pytest.mark.parametrize("impl", ["xla"])
def test_bias_and_mask(rng, impl):
  q, k, v, do = inputs(rng, 2, 12, 15, 4, 2, 32)
  bias = random(rng, (1, 4, 12, 15), jnp.float32)
  mask = jnp.asarray(rng.random((2, 1, 12, 15)) > 0.3)
  got = run(impl, q, k, v, do, bias=bias, mask=mask)
  compare(got, dense_reference(q, k, v, bias=bias, mask=np.asarray(mask), do=do))
  dbias = jax.grad(lambda b: jnp.sum(jaxfuse.attention(q, k, v, bias=b, implementation=impl)
                                     * do))(bias)
  assert dbias.shape == bias.shape and np.all(np.isfinite(np.asarray(dbias)))


def test_gradient_floors_bound_the_cancelling_rows(rng):
  # Causal: the first query sees one key, so its dq is 0 while its terms are not; the floors
  # must not depend on the query block they are walked in (GQA, T not a multiple of it).
  q, k, v, do = inputs(rng, 2, 13, 13, 4, 2, 16)
  _, _, (dq, _, _) = dense_reference(q, k, v, causal=True, do=do)
  whole = gradient_floors(q, k, v, do, causal=True)
  walked = gradient_floors(q, k, v, do, causal=True, block=4)
  for a, b in zip(whole, walked):
    np.testing.assert_allclose(a, b, rtol=1e-12)
  assert whole[0].shape == (2, 13, 4, 1) and whole[1].shape == (2, 13, 2, 1)
  assert np.all(whole[0][:, 0] > 100 * np.linalg.norm(dq[:, 0], axis=-1, keepdims=True))
  assert np.all(whole[0] > 0) and np.all(whole[1] > 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_offsets_and_windows_past_every_key(rng, impl):
  """Offsets and windows beyond int32 mean what they say: every key, or none."""
  q, k, v, _ = inputs(rng, 1, 9, 13, 2, 1, 32)
  full = jaxfuse.attention(q, k, v, implementation=impl)
  for kw in (dict(is_causal=True, causal_offset=2 ** 40), dict(local_window_size=2 ** 40),
             dict(local_window_size=(2 ** 41, 0), causal_offset=2 ** 40)):
    np.testing.assert_allclose(jaxfuse.attention(q, k, v, implementation=impl, **kw), full,
                               rtol=1e-6, atol=1e-6)
  none = jaxfuse.attention(q, k, v, is_causal=True, causal_offset=-2 ** 40, implementation=impl)
  assert not np.any(np.asarray(none))
  shifted = jaxfuse.attention(q, k, v, local_window_size=(2 ** 40, 2), causal_offset=3,
                              implementation=impl)
  ref, _, _ = dense_reference(q, k, v, window=(30, 2), offset=3)
  assert_close(shifted, ref, name="out")


@pytest.mark.triton
def test_triton_refuses_bias_clearly(rng):
  q, k, v, _ = inputs(rng, 1, 8, 8, 1, 1, 32)
  with pytest.raises(NotImplementedError, match="bias"):
    jaxfuse.attention(q, k, v, bias=jnp.zeros((8, 8)), implementation="triton")


def test_chunked_xla_matches_and_is_linear_in_memory(rng, monkeypatch):
  from jaxfuse.ops.attention import api
  q, k, v, do = inputs(rng, 1, 50, 64, 2, 1, 32)
  ref = dense_reference(q, k, v, causal=True, window=(20, 0), do=do)
  monkeypatch.setattr(reference, "CHUNK_BYTES", 2 * 64 * 4 * 16)
  api._attention_jit.clear_cache()  # the threshold is read when tracing
  compare(run("xla", q, k, v, do, is_causal=True, local_window_size=(20, 0)), ref)
  # Long keys, short heads: one (T, S) float32 score array is 1 MiB and dominates the dense step.
  q, k, v, _ = inputs(rng, 1, 512, 512, 1, 1, 16)

  def temp(chunk_bytes):
    monkeypatch.setattr(reference, "CHUNK_BYTES", chunk_bytes)
    api._attention_jit.clear_cache()
    step = jax.jit(jax.grad(lambda q: jnp.sum(jaxfuse.attention(q, k, v, implementation="xla"))))
    return step.lower(q).compile().memory_analysis().temp_size_in_bytes

  dense, chunked = temp(1 << 40), temp(64 * 512 * 4)
  assert chunked < 512 * 512 * 4 < dense
  api._attention_jit.clear_cache()


@pytest.mark.triton
def test_triton_step_keeps_no_score_matrix(rng):
  q, k, v, _ = inputs(rng, 1, 256, 256, 1, 1, 32)
  step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jaxfuse.attention(
      q, k, v, implementation="triton")), argnums=(0, 1, 2)))
  hlo = step.lower(q, k, v).as_text()
  assert "256x256" not in hlo.replace(" ", "") and "f32[1,1,256,256]" not in hlo


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_jit_checkpoint(rng, impl):
  q, k, v, do = inputs(rng, 3, 10, 12, 2, 1, 32)
  f = lambda q, k, v: jaxfuse.attention(q, k, v, is_causal=True, causal_offset=2,
                                        implementation=impl)
  batched = jax.jit(jax.vmap(f, in_axes=(0, 0, 0)))(q[:, None], k[:, None], v[:, None])[:, 0]
  ref = dense_reference(q, k, v, causal=True, offset=2)[0]
  assert_close(batched, ref)
  loss = lambda q: jnp.sum(f(q, k, v) * do)
  np.testing.assert_allclose(jax.grad(jax.checkpoint(loss))(q), jax.grad(loss)(q), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_unbatched_inputs(rng, impl):
  q, k, v, _ = inputs(rng, 1, 7, 9, 2, 2, 32)
  out = jaxfuse.attention(q[0], k[0], v[0], implementation=impl)
  assert out.shape == (7, 2, 32)
  assert_close(out, dense_reference(q, k, v)[0][0])


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic_backward(rng, impl):
  q, k, v, do = inputs(rng, 1, 64, 64, 4, 1, 32)
  step = jax.jit(lambda q, k, v: run(impl, q, k, v, do)[2])
  for a, b in zip(step(q, k, v), step(q, k, v)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("spec", [P("d"), P(None, None, "d"), P("a", None, "b")], ids=str)
def test_batch_and_head_sharding_never_gathers(rng, impl, spec):
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  names = ("a", "b") if "a" in str(spec) else ("d",)
  shape = (2, 4) if len(names) == 2 else (8,)
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
  q, k, v, do = inputs(rng, 8, 16, 16, 8, 8 if "b" in names or spec == P(None, None, "d") else 4,
                       32)
  step = jax.jit(lambda q, k, v: run(impl, q, k, v, do, is_causal=True)[::2])
  single = step(q, k, v)
  put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
  compiled = step.lower(put(q), put(k), put(v)).compile()
  assert "all-gather" not in compiled.as_text()
  for a, b in zip(jax.tree.leaves(compiled(put(q), put(k), put(v))), jax.tree.leaves(single)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(q=(2, 8, 3, 32)), ValueError, "heads"),
    (dict(q=(2, 8, 4)), ValueError, "query"),
    (dict(k=(2, 8, 2, 16)), ValueError, "key"),
    (dict(q_dtype=jnp.bfloat16), TypeError, "dtype"),
    (dict(segment_ids=jnp.zeros((2, 9), jnp.int32)), ValueError, "segment_ids"),
    (dict(segment_ids=jnp.zeros((2, 8))), TypeError, "segment_ids"),
    (dict(local_window_size=(-1, 2)), ValueError, "local_window_size"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
    (dict(bias=jnp.zeros((3, 8, 8))), ValueError, "bias"),
    (dict(mask=jnp.zeros((8, 8))), TypeError, "mask"),
    (dict(implementation="mosaic"), NotImplementedError, "mosaic"),
    (dict(implementation="cudnn", cpu_only=True), NotImplementedError, "cudnn"),
    (dict(query_seq_lengths=jnp.zeros((3,), jnp.int32)), ValueError, "query_seq_lengths"),
    (dict(query_seq_lengths=jnp.asarray([-1, 3])), ValueError, r"query_seq_lengths.*\[0, 8\]"),
    (dict(key_value_seq_lengths=jnp.asarray([100, 3])), ValueError,
     r"key_value_seq_lengths.*\[0, 8\]"),
    (dict(k=(2, 0, 2, 32)), ValueError, "S = 0"),
    (dict(causal_offset=3), ValueError, "causal_offset"),
    (dict(is_causal="False"), TypeError, "is_causal"),
    (dict(local_window_size=2.0), TypeError, "local_window_size"),
    (dict(q=(2, 8, 4, 0), k=(2, 8, 2, 0)), ValueError, "H = 0"),
], ids=str)
def test_bad_input(kwargs, error, match):
  kwargs = dict(kwargs)
  if kwargs.pop("cpu_only", False) and jax.default_backend() != "cpu":
    pytest.skip("cudnn runs on a GPU")
  q = jnp.zeros(kwargs.pop("q", (2, 8, 4, 32)), kwargs.pop("q_dtype", jnp.float32))
  k = jnp.zeros(kwargs.pop("k", (2, 8, 2, 32)))
  with pytest.raises(error, match=match):
    jaxfuse.attention(q, k, jnp.zeros(k.shape), **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_outputs_have_empty_gradients(rng, impl):
  # No batch, queries, heads or value features: an empty output, not a kernel of no grid.
  q, k, v, _ = inputs(rng, 2, 8, 8, 4, 2, 32)
  for empty in ((q[:0], k[:0], v[:0]), (q[:, :0], k, v), (q[:, :, :0], k, v),
                (q, k, v[..., :0])):
    out, grads = jax.value_and_grad(
        lambda *a: jnp.sum(jaxfuse.attention(*a, implementation=impl)), (0, 1, 2))(*empty)
    assert float(out) == 0.0
    assert [g.shape for g in grads] == [a.shape for a in empty]


def test_empty_queries_and_huge_offsets_have_defined_results(rng):
  q, k, v, _ = inputs(rng, 2, 8, 8, 4, 2, 32)
  assert jaxfuse.attention(q[:, :0], k, v).shape == (2, 0, 4, 32)
  # Two programs (one masks, one does not): equal up to their roundings.
  np.testing.assert_allclose(jaxfuse.attention(q, k, v, is_causal=True, causal_offset=2**40),
                             jaxfuse.attention(q, k, v), rtol=1e-6, atol=1e-7)
  # Traced lengths cannot be read at trace time: they are taken as given.
  lengths = jnp.asarray([8, 3])
  np.testing.assert_allclose(
      jax.jit(lambda n: jaxfuse.attention(q, k, v, key_value_seq_lengths=n))(lengths),
      jaxfuse.attention(q, k, v, key_value_seq_lengths=lengths), rtol=1e-5, atol=1e-6)


def test_cudnn_refusal_is_a_reason_not_a_crash(rng, monkeypatch):
  """jax.nn's cuDNN path refuses some shapes while tracing (sequence lengths, a value head dim
  unlike the query's): naming 'cudnn' then raises NotImplementedError with its reason, and
  None (on a GPU) moves on to the next implementation instead of failing."""
  from jaxfuse.ops.attention import api

  def refusing(*args, implementation=None, **kwargs):
    assert implementation == "cudnn"
    raise NotImplementedError("Unsupported sequence length Q 3, KV 7.")

  monkeypatch.setitem(api._BACKENDS, "cudnn", lambda: None)
  monkeypatch.setattr(jax.nn, "dot_product_attention", refusing)
  api._cudnn_rejects.cache_clear()
  q, k, v, _ = inputs(rng, 1, 3, 7, 2, 2, 64, dtype=jnp.bfloat16)
  try:
    with pytest.raises(NotImplementedError, match="Unsupported sequence length Q 3, KV 7"):
      jaxfuse.attention(q, k, v, implementation="cudnn")
    call = api._Call(api.MaskSpec(False, 0, None, None), 0.125, None, False, False, False,
                     False, False, False, q.dtype)
    assert "refuses" in api._cudnn_unsupported(call, (q, k, v, None, None, None, None))
  finally:
    api._cudnn_rejects.cache_clear()


def test_default_takes_mosaic_before_cudnn_where_it_measured_faster(monkeypatch):
  """On an H100, None takes 'mosaic' before cuDNN where it measured faster, apart for calls
  only evaluated and calls differentiated (the tuned table's rows); cuDNN first elsewhere and
  on GPUs without a table; a named implementation runs both ways."""
  from jaxfuse._core import registry
  from jaxfuse.ops.attention import api
  monkeypatch.setattr(registry, "platform", lambda: "gpu")
  for name in ("cudnn", "mosaic"):
    monkeypatch.setitem(api._BACKENDS, name, lambda: None)
  monkeypatch.setattr(api, "_cudnn_unsupported", lambda call, arrays: None)
  monkeypatch.setattr(api, "_mosaic_unsupported", lambda call, arrays: None)

  def chosen(kind, causal, t, h, hv=None, implementation=None):
    monkeypatch.setattr(registry, "device_kind", lambda: kind)
    # 16 heads: grids of at least 512 work tiles, past the tables' small-grid bounds.
    q = jax.ShapeDtypeStruct((2, t, 16, h), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, t, 16, hv or h), jnp.bfloat16)
    call = api._Call(api.MaskSpec(causal, 0, None, None), 0.1, None, False, False, False,
                     False, False, False, jnp.bfloat16)
    plan = api._resolve(implementation, call, (q, q, v, None, None, None, None))
    assert plan.forward == plan.backward
    return plan.evaluated, plan.forward

  h100 = "NVIDIA H100 80GB HBM3"
  mosaic, cudnn = ("mosaic",) * 2, ("cudnn",) * 2
  assert chosen(h100, True, 4096, 128) == mosaic
  assert chosen(h100, True, 2048, 64) == mosaic
  assert chosen(h100, True, 16384, 128) == ("mosaic", "cudnn")
  assert chosen(h100, True, 16385, 128) == cudnn
  assert chosen(h100, True, 8192, 256) == ("mosaic", "cudnn")
  assert chosen(h100, True, 2048, 256) == mosaic
  assert chosen(h100, True, 2049, 256) == ("mosaic", "cudnn")
  assert chosen(h100, True, 2048, 128, hv=256) == mosaic  # keyed by the wider head dim
  assert chosen(h100, True, 4096, 128, hv=256) == ("mosaic", "cudnn")
  assert chosen(h100, False, 1024, 128) == ("cudnn", "mosaic")
  assert chosen(h100, False, 1025, 128) == cudnn
  assert chosen(h100, False, 8192, 256) == ("cudnn", "mosaic")
  assert chosen(h100, True, 8192, 64) == mosaic
  assert chosen(h100, True, 8193, 64) == ("mosaic", "cudnn")
  assert chosen(h100, True, 16385, 64) == cudnn
  assert chosen(h100, False, 1024, 64) == mosaic
  assert chosen(h100, False, 1025, 64) == ("mosaic", "cudnn")
  assert chosen(h100, False, 16385, 64) == cudnn
  assert chosen(h100, False, 8192, 256, implementation="cudnn") == cudnn
  assert chosen(h100, True, 16384, 128, implementation="mosaic") == mosaic
  assert chosen("NVIDIA H200", True, 2048, 128) == mosaic  # its table inherits the H100's
  assert chosen("NVIDIA A100-SXM4-80GB", True, 2048, 128) == cudnn
  assert chosen("NVIDIA A100-SXM4-80GB", False, 2048, 64) == cudnn


def test_evaluated_and_differentiated_by_different_kernels(rng, monkeypatch):
  """Where None's choices for evaluation and for differentiation differ, a call only
  evaluated traces the first, and one differentiated (in jit, vmap) only the second, whose
  output and gradients are the reference's."""
  from jaxfuse.ops.attention import api
  traced = []
  original = api._implementation

  def spy(impl, *args):
    traced.append(impl)
    return original(impl, *args)

  monkeypatch.setattr(api, "_implementation", spy)
  api._attention_jit.clear_cache()
  q, k, v, do = inputs(rng, 2, 37, 37, 2, 1, 32)
  lengths = jnp.array([37, 20], jnp.int32)
  call = api._Call(api.MaskSpec(True, 0, None, None), 32 ** -0.5, None, False, False, False,
                   True, True, False, q.dtype)
  plan = op.Plan("xla", "triton", "triton")
  attend = lambda q, k, v: api._attention_jit(q, k, v, None, None, None, None, lengths,
                                              lengths, plan, call)[0]
  ref_out, _, ref_grads = dense_reference(q, k, v, causal=True, q_len=lengths,
                                          kv_len=lengths, do=do)
  try:
    out, lse = api._attention_jit(q, k, v, None, None, None, None, lengths, lengths, plan,
                                  call)
    assert traced == ["xla"] and lse is None
    assert_close(out, ref_out, name="out")
    traced.clear()
    out, vjp = jax.vjp(attend, q, k, v)
    assert traced == ["triton"]
    assert_close(out, ref_out, name="out")
    for name, g, r in zip(("dq", "dk", "dv"), vjp(do), ref_grads):
      assert_close(g, r, factor=10, name=name)
    step = jax.jit(jax.vmap(jax.grad(lambda q: jnp.sum(attend(q, k, v) * do))))
    dq = step(jnp.stack([q, q]))
    assert traced[-1] == "triton" and "xla" not in traced
    assert_close(dq[1], ref_grads[0], factor=10, name="dq under vmap")
  finally:
    api._attention_jit.clear_cache()


@pytest.mark.triton
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 1000, 1000, 4, 2, 128), (1, 257, 2049, 2, 2, 64),
                                   (1, 512, 512, 2, 1, 256)], ids=str)
def test_gpu_flash_attention(rng, causal, shape):
  b, t, s, n, kh, h = shape
  q, k, v, do = inputs(rng, b, t, s, n, kh, h, dtype=jnp.bfloat16)
  offset = s - t if causal else 0
  ref = dense_reference(q, k, v, causal=causal, offset=offset, do=do)
  compare(run("triton", q, k, v, do, is_causal=causal, causal_offset=offset), ref, factor=4,
          dtype=jnp.bfloat16,
          floors=gradient_floors(q, k, v, do, causal=causal, offset=offset))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 3, 7, 2, 2, 64, 64), (2, 257, 257, 2, 2, 80, 80),
                                   (2, 130, 130, 2, 1, 128, 64)], ids=str)
def test_gpu_default_runs_where_cudnn_refuses(rng, shape):
  b, t, s, n, kh, h, hv = shape
  q, k, v, do = inputs(rng, b, t, s, n, kh, h, hv, dtype=jnp.bfloat16)
  out, vjp = jax.vjp(lambda q, k, v: jaxfuse.attention(q, k, v, is_causal=True,
                                                       causal_offset=s - t), q, k, v)
  r_out, _, r_grads = dense_reference(q, k, v, causal=True, offset=s - t, do=do)
  assert_close(out, r_out, jnp.bfloat16, name="out")
  for name, g, r in zip(("dq", "dk", "dv"), vjp(do), r_grads):
    assert_close(g, r, jnp.bfloat16, factor=4, name=name)


def _mosaic_or_skip():
  from jaxfuse.ops.attention import mosaic
  if reason := mosaic.unavailable():
    pytest.skip(reason)


def check_mosaic_forward(q, k, v, kw, ref_kw):
  out, lse = jaxfuse.attention(q, k, v, return_lse=True, implementation="mosaic", **kw)
  r_out, r_lse, _ = dense_reference(q, k, v, **ref_kw)
  assert_close(out, r_out, jnp.bfloat16, name="out")
  finite = np.isfinite(r_lse)
  assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
  assert_close(np.asarray(lse)[finite], r_lse[finite], jnp.bfloat16, name="lse")
  again = jaxfuse.attention(q, k, v, implementation="mosaic", **kw)
  assert np.array_equal(np.asarray(again), np.asarray(out))  # same bits


@pytest.mark.gpu
@pytest.mark.parametrize("causal,offset", [(False, 0), (True, 0), (True, None), (True, -100)])
@pytest.mark.parametrize("shape", [(2, 256, 384, 4, 2, 128, 128), (1, 384, 256, 3, 1, 64, 64),
                                   (1, 128, 512, 2, 2, 256, 256), (1, 1000, 1100, 2, 2, 128, 128),
                                   (1, 77, 64, 1, 1, 64, 128), (1, 129, 200, 2, 2, 256, 128),
                                   (2, 257, 257, 2, 1, 128, 256), (1, 300, 517, 2, 1, 64, 256)],
                         ids=str)
def test_gpu_mosaic_forward(rng, shape, causal, offset):
  """The Hopper kernel's output and log-sum-exp on whole and partial tiles, value head dims
  unlike the query's; offset None is bottom-right (S - T), -100 leaves the first rows with no
  key at all."""
  _mosaic_or_skip()
  b, t, s, n, kh, h, hv = shape
  offset = s - t if offset is None else offset
  q, k, v, _ = inputs(rng, b, t, s, n, kh, h, hv, dtype=jnp.bfloat16)
  check_mosaic_forward(q, k, v, dict(is_causal=causal, causal_offset=offset),
                       dict(causal=causal, offset=offset))


@pytest.mark.gpu
@pytest.mark.parametrize("causal,offset", [(False, 0), (True, 0), (True, None), (True, -100)])
@pytest.mark.parametrize("shape", [(2, 256, 384, 4, 2, 128, 128), (1, 384, 256, 3, 1, 64, 64),
                                   (1, 1000, 1100, 2, 2, 128, 128), (1, 77, 64, 1, 1, 64, 128),
                                   (2, 257, 257, 4, 1, 128, 64), (1, 130, 200, 2, 2, 256, 128)],
                         ids=str)
def test_gpu_mosaic_backward(rng, shape, causal, offset):
  """The Hopper backward's dQ, dK, dV (GQA summed over the group) on whole and partial tiles
  and value head dims unlike the query's, deterministic."""
  _mosaic_or_skip()
  b, t, s, n, kh, h, hv = shape
  offset = s - t if offset is None else offset
  q, k, v, do = inputs(rng, b, t, s, n, kh, h, hv, dtype=jnp.bfloat16)
  kw, ref_kw = dict(is_causal=causal, causal_offset=offset), dict(causal=causal, offset=offset)
  got = run("mosaic", q, k, v, do, **kw)
  compare(got, dense_reference(q, k, v, do=do, **ref_kw), factor=4, dtype=jnp.bfloat16,
          floors=gradient_floors(q, k, v, do, **ref_kw))
  for first, again in zip(got[2], run("mosaic", q, k, v, do, **kw)[2]):
    assert np.array_equal(np.asarray(first), np.asarray(again))  # same bits


@pytest.mark.gpu
@pytest.mark.parametrize("kw,ref_kw", [
    (dict(is_causal=True, causal_offset=70), dict(causal=True, offset=70)),
    (dict(local_window_size=(90, 20), key_value_seq_lengths=[250, 517]),
     dict(window=(90, 20), kv_len=[250, 517])), ({}, {})], ids=str)
@pytest.mark.parametrize("shape", [(2, 300, 517, 4, 2, 256, 256), (2, 200, 517, 2, 2, 128, 256),
                                   (2, 129, 517, 2, 1, 256, 64), (2, 200, 517, 2, 2, 128, 64)],
                         ids=str)
def test_gpu_mosaic_backward_paired_gradients(rng, shape, kw, ref_kw):
  """dK and dV paired (one gradient per consumer of a shared key block) on 32-row streamed
  tiles (head dim 256's configuration), also at head dims that need not pair them, against the
  float64 gradients."""
  _mosaic_or_skip()
  from jaxfuse.ops.attention import mosaic
  from jaxfuse.ops.attention.api import _band
  from jaxfuse.ops.attention.reference import MaskSpec
  b, t, s, n, kh, h, hv = shape
  q, k, v, do = inputs(rng, b, t, s, n, kh, h, hv, dtype=jnp.bfloat16)
  kv_len = kw.get("key_value_seq_lengths")
  extras = (None, None, None, None if kv_len is None else jnp.asarray(kv_len))
  offset, window = _band(kw.get("causal_offset", 0), kw.get("local_window_size"), t, s)
  spec = MaskSpec(kw.get("is_causal", False), offset, window)
  scale = h ** -0.5
  out, lse = mosaic.forward(q, k, v, extras, spec=spec, scale=scale)
  grads = mosaic.backward(q, k, v, do, lse, out, jnp.zeros_like(lse), extras, spec=spec,
                          scale=scale, config=mosaic.BACKWARD_CONFIGS[256])
  _, _, r_grads = dense_reference(q, k, v, do=do, **ref_kw)
  floors = gradient_floors(q, k, v, do, **ref_kw)
  for name, g, r, floor in zip(("dq", "dk", "dv"), grads, r_grads, (*floors, 0.0)):
    assert_close(g, r, jnp.bfloat16, factor=4, name=name, floor=floor)


@pytest.fixture
def few_ctas(monkeypatch):
  """The 'mosaic' kernels persistent (the backward's too, where its tables allow) on three
  CTAs, so that each runs many items (buffers reused, rings running on across items); the jit
  caches are cleared around the test, so that it traces these kernels and no later test finds
  them there."""
  from jaxfuse._core import registry
  from jaxfuse.ops.attention import mosaic
  monkeypatch.setattr(registry, "num_multiprocessors", lambda: 3)
  for name in ("BACKWARD_CONFIGS", "BACKWARD_UNMASKED_CONFIGS"):
    monkeypatch.setattr(mosaic.config, name, {
        dim: cfg if cfg.paired_dk_dv else dataclasses.replace(cfg, persistent=True)
        for dim, cfg in getattr(mosaic.config, name).items()})
  jax.clear_caches()
  yield
  jax.clear_caches()


@pytest.mark.gpu
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("feature", FEATURES + [{}], ids=str)
def test_gpu_mosaic_many_items_per_cta(rng, few_ctas, feature, h):
  """Forward and backward persistent with many work items per CTA (held rows
  double-buffered), under every mask feature, GQA and partial tiles: against the float64
  reference, and the same bits twice."""
  _mosaic_or_skip()
  b, t, s, n, kh = 2, 1000, 1320, 4, 2
  q, k, v, do = inputs(rng, b, t, s, n, kh, h, dtype=jnp.bfloat16)
  kw, ref_kw = feature_kwargs(rng, feature, b, t, s, scale=40)
  got = run("mosaic", q, k, v, do, **kw)
  compare(got, dense_reference(q, k, v, do=do, **ref_kw), factor=4, dtype=jnp.bfloat16,
          floors=gradient_floors(q, k, v, do, **ref_kw))
  for first, again in zip(got[2], run("mosaic", q, k, v, do, **kw)[2]):
    assert np.array_equal(np.asarray(first), np.asarray(again))  # same bits


@pytest.mark.gpu
@pytest.mark.parametrize("feature", FEATURES + [{}], ids=str)
def test_gpu_mosaic_features(rng, feature):
  """FEATURES at 40 times the CPU tests' sizes: bands that span many tiles (skipped, masked
  and whole ones), three segments per row, lengths inside a tile; and the gradients."""
  _mosaic_or_skip()
  b, t, s, n, kh, h = 2, 1000, 1320, 4, 2, 128
  q, k, v, do = inputs(rng, b, t, s, n, kh, h, dtype=jnp.bfloat16)
  kw, ref_kw = feature_kwargs(rng, feature, b, t, s, scale=40)
  check_mosaic_forward(q, k, v, kw, ref_kw)
  compare(run("mosaic", q, k, v, do, **kw), dense_reference(q, k, v, do=do, **ref_kw),
          factor=4, dtype=jnp.bfloat16, floors=gradient_floors(q, k, v, do, **ref_kw))


@pytest.mark.gpu
def test_gpu_default_packed_documents(rng):
  """What the GPT example's packed rows run (None on Hopper: the Mosaic kernels): head dim
  64, causal within documents of uneven lengths."""
  _mosaic_or_skip()
  b, t, n, h = 2, 1024, 4, 64
  q, k, v, do = inputs(rng, b, t, t, n, n, h, dtype=jnp.bfloat16)
  ends = np.sort(rng.choice(np.arange(1, t), size=(b, 3), replace=False), axis=1)
  ids = jnp.asarray((np.arange(t)[None, :, None] >= ends[:, None, :]).sum(-1), jnp.int32)
  ref_kw = dict(causal=True, q_seg=ids, kv_seg=ids)
  compare(run(None, q, k, v, do, is_causal=True, segment_ids=ids),
          dense_reference(q, k, v, do=do, **ref_kw), factor=4, dtype=jnp.bfloat16,
          floors=gradient_floors(q, k, v, do, **ref_kw))


@pytest.mark.gpu
@pytest.mark.parametrize("causal,h", [(False, 256), (True, 256)])
def test_gpu_default_evaluates_and_differentiates_by_measurement(rng, causal, h):
  """Calls where None's fastest forward and fastest step differ on an H100 (head dim 256):
  evaluated and differentiated, both against float64, with odd lengths per batch row."""
  _mosaic_or_skip()
  from jaxfuse.ops.attention import api
  q, k, v, do = inputs(rng, 2, 200, 200, 2, 2, h, dtype=jnp.bfloat16)
  lengths = jnp.array([200, 131], jnp.int32)
  kw = dict(is_causal=causal, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
  call = api._Call(api.MaskSpec(causal, 0, None, None), h ** -0.5, None, False, False, False,
                   True, True, False, q.dtype)
  plan = api._resolve(None, call, (q, k, v, None, None, lengths, lengths))
  if jax.devices()[0].device_kind == "NVIDIA H100 80GB HBM3":
    assert (plan.evaluated, plan.forward) == (("mosaic", "cudnn") if causal
                                              else ("cudnn", "mosaic"))
  ref_kw = dict(causal=causal, q_len=lengths, kv_len=lengths)
  r_out, _, r_grads = dense_reference(q, k, v, do=do, **ref_kw)
  valid = np.arange(200)[None, :, None, None] < np.asarray(lengths)[:, None, None, None]
  evaluated = jax.jit(lambda q, k, v: jaxfuse.attention(q, k, v, **kw))(q, k, v)
  assert_close(np.where(valid, evaluated, 0), np.where(valid, r_out, 0), jnp.bfloat16,
               name="out")
  out, vjp = jax.vjp(lambda q, k, v: jaxfuse.attention(q, k, v, **kw), q, k, v)
  assert_close(np.where(valid, out, 0), np.where(valid, r_out, 0), jnp.bfloat16, name="out")
  for name, g, r in zip(("dq", "dk", "dv"), vjp(do), r_grads):
    assert_close(np.where(valid, g, 0), np.where(valid, r, 0), jnp.bfloat16, factor=4,
                 name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("t,s,h,kw", [
    (512, 512, 128, dict(is_causal=True, local_window_size=(64, 0), kv_len=100)),
    (256, 128, 128, dict(local_window_size=(0, 0), causal_offset=64)),
    (256, 256, 256, dict(is_causal=True, local_window_size=(32, 0), kv_len=64)),
], ids=str)
def test_gpu_mosaic_blocks_past_every_key(rng, t, s, h, kw):
  """A CTA whose second query block's window starts a tile past the CTA's last key: that
  block walks no tile (it once waited on one never loaded)."""
  _mosaic_or_skip()
  q, k, v, _ = inputs(rng, 1, t, s, 1, 1, h, dtype=jnp.bfloat16)
  kw = dict(kw)
  kv_len = kw.pop("kv_len", None)
  ref_kw = dict(causal=kw.get("is_causal", False), offset=kw.get("causal_offset", 0),
                window=kw["local_window_size"])
  if kv_len is not None:
    kw["key_value_seq_lengths"] = jnp.array([kv_len])
    ref_kw["kv_len"] = [kv_len]
  check_mosaic_forward(q, k, v, kw, ref_kw)


@pytest.mark.parametrize("b,n,q_tiles,sms", [(4, 16, 32, 132), (1, 16, 128, 132), (1, 1, 1, 132),
                                             (2, 3, 7, 5), (3, 1, 5, 132)], ids=str)
def test_mosaic_forward_deals_every_tile_once(b, n, q_tiles, sms):
  """The persistent forward's work items over its CTAs: every query tile of every head
  exactly once, besides one tile past T per head where the tile count is odd; pairs of
  tiles from both ends, so that CTAs given as many pairs walk as many causal key tiles."""
  from jaxfuse.ops.attention import mosaic
  pairs = b * n * -(-q_tiles // 2)
  ctas = min(pairs, sms)
  seen, walks = [], []
  for cta in range(ctas):
    items = 2 * ((pairs - 1 - cta) // ctas + 1)
    i = jnp.arange(items, dtype=jnp.int32)
    batch, head, tile = (np.asarray(x) for x in mosaic._work_item(jnp.int32(cta), i, ctas, n,
                                                                  q_tiles))
    seen += list(zip(batch.tolist(), head.tolist(), tile.tolist()))
    # A causal tile walks as many key tiles as its index plus one; the tile past T none.
    walks.append(np.where(tile < q_tiles, tile + 1, 0).sum())
  real = sorted(x for x in seen if x[2] < q_tiles)
  assert real == [(i, j, k) for i in range(b) for j in range(n) for k in range(q_tiles)]
  assert len(seen) - len(real) == b * n * (q_tiles % 2)
  assert all(0 <= x[0] < b and 0 <= x[1] < n and x[2] <= q_tiles for x in seen)
  if q_tiles % 2 == 0:  # every pair walks q_tiles + 1 key tiles
    pair_counts = [(pairs - 1 - cta) // ctas + 1 for cta in range(ctas)]
    assert walks == [(q_tiles + 1) * count for count in pair_counts]


def test_mosaic_segment_spans_reach_every_match(rng):
  """Each block of query rows walks the key tiles from the first to the last holding one of
  its rows' segment ids: exactly its documents' tiles when ids are sorted, and at least every
  matching tile when they are not."""
  from jaxfuse.ops.attention import mosaic
  block_q, block_kv = 4, 8
  t, s = 37, 45
  tp, sp = 40, 48
  for packed in (True, False):
    ids, kv_ids = rng.integers(0, 5, (2, t)), rng.integers(0, 5, (2, s))
    if packed:
      ids, kv_ids = np.sort(ids, axis=1), np.sort(kv_ids, axis=1)
    spans = np.asarray(mosaic._segment_spans(jnp.asarray(ids), jnp.asarray(kv_ids), tp, sp,
                                             block_q, block_kv))
    assert spans.shape == (2, tp // block_q, 4)
    for bi in range(2):
      for qb in range(tp // block_q):
        rows = ids[bi, qb * block_q:min(t, (qb + 1) * block_q)]
        match = np.isin(kv_ids[bi], rows) if rows.size else np.zeros(s, bool)
        tiles = np.unique(np.nonzero(match)[0] // block_kv)
        lo, hi, full_lo, full_hi = spans[bi, qb]
        assert lo <= full_lo <= full_hi <= hi
        if tiles.size:
          assert lo <= tiles[0] and tiles[-1] < hi
        # Tiles left unmasked hold only the block's one id (padding repeats the last id).
        padded = lambda a, n: np.pad(a, (0, n - a.size), mode="edge")
        block_ids = padded(ids[bi], tp)[qb * block_q:(qb + 1) * block_q]
        unmasked = padded(kv_ids[bi], sp)[full_lo * block_kv:full_hi * block_kv]
        assert np.all(unmasked == block_ids[0]) and np.all(block_ids == block_ids[0]) or (
            full_lo == full_hi)
  # Four sorted documents of 16 rows, tiles of 8 keys: each block sees its document's 2 tiles,
  # neither masked.
  docs = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 16)[None]
  spans = np.asarray(mosaic._segment_spans(docs, docs, 64, 64, 4, 8))
  np.testing.assert_array_equal(spans[0, :, 0], np.repeat([0, 2, 4, 6], 4))
  np.testing.assert_array_equal(spans[0, :, 1], np.repeat([2, 4, 6, 8], 4))
  np.testing.assert_array_equal(spans[0, :, 2:], spans[0, :, :2])
  # Documents of 10: a tile holding two documents is masked, a block holding two (rows 8-11)
  # has no unmasked tile.
  docs = jnp.repeat(jnp.arange(7, dtype=jnp.int32), 10)[None, :64]
  spans = np.asarray(mosaic._segment_spans(docs, docs, 64, 64, 4, 8))
  np.testing.assert_array_equal(spans[0, :4], [[0, 2, 0, 1], [0, 2, 0, 1], [0, 3, 0, 0],
                                               [1, 3, 1, 1]])


@pytest.mark.parametrize("kwargs,name", [(dict(stages=1), "stages"),
                                         (dict(dkdv_block_q=256), "dkdv_block_q"),
                                         (dict(persistent=True, paired_dk_dv=True), "persistent")])
def test_mosaic_backward_config_names_what_it_refuses(kwargs, name):
  """A backward config that could not run (no tile in flight; dK/dV query tiles reaching rows
  the dQ kernel's items leave without stats; paired dK/dV, which takes a CTA per key block,
  made persistent) is refused when made, naming the field."""
  from jaxfuse.ops.attention import mosaic
  with pytest.raises(ValueError, match=name):
    mosaic.BackwardConfig(**kwargs)
  for config in (*mosaic.BACKWARD_CONFIGS.values(), *mosaic.BACKWARD_UNMASKED_CONFIGS.values()):
    dataclasses.replace(config)  # the tables' own pass


@pytest.mark.parametrize("kwargs,name", [
    (dict(dtype=jnp.float32), "float32"), (dict(h=96), "query/key head dim"),
    (dict(hv=80), "value head dim"), (dict(h=32, hv=128), "32"),
])
def test_mosaic_names_what_it_refuses(kwargs, name):
  from jaxfuse.ops.attention import mosaic
  from jaxfuse.ops.attention.reference import MaskSpec
  h = kwargs.get("h", 128)
  shapes = ((1, 200, 2, h), (1, 300, 2, h), (1, 300, 2, kwargs.get("hv", h)))
  reason = mosaic.unsupported(*shapes, kwargs.get("dtype", jnp.bfloat16),
                              spec=MaskSpec(True, 0, None, None), has_segments=False,
                              has_q_len=False, has_kv_len=False)
  assert reason is not None and name in reason


@pytest.mark.parametrize("shape,spec,segments,lengths,dtype", [
    ((256, 384, 128, 128), (False, 0, None, None), False, False, jnp.bfloat16),
    ((1000, 1321, 64, 256), (True, 7, (100, 3), 5.0), True, True, jnp.bfloat16),
    ((77, 64, 256, 128), (True, -3, None, None), False, True, jnp.float16),
    ((512, 4096, 64, 64), (False, 0, (256, 256), None), False, False, jnp.float16),
    ((1000, 1321, 128, 64), (True, 7, (100, 3), 5.0), True, True, jnp.bfloat16),
    ((77, 64, 64, 128), (True, -3, None, None), False, True, jnp.float16),
    ((300, 700, 64, 64), (False, 0, None, None), False, False, jnp.bfloat16),  # 256-key tiles
], ids=str)
def test_mosaic_lowers_for_hopper(shape, spec, segments, lengths, dtype):
  """The kernels (forward, and backward with either mask form: at head dim 256 with dK and dV
  paired, below it also in the other scheduling) lowered for CUDA on this machine, without
  a GPU: what changes between JAX versions in Pallas Mosaic GPU (signatures, layouts,
  transforms, shared memory's size) fails here in CI."""
  pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  from jax import export
  from jaxfuse.ops.attention import mosaic
  from jaxfuse.ops.attention.reference import MaskSpec
  t, s, h, hv = shape
  arrays = [jax.ShapeDtypeStruct(d, dtype) for d in ((2, t, 4, h), (2, s, 2, h), (2, s, 2, hv))]
  ints = lambda *d: jax.ShapeDtypeStruct(d, jnp.int32)
  extras = ((ints(2, t), ints(2, s)) if segments else (None, None)) + (
      (ints(2), ints(2)) if lengths else (None, None))

  def forward(q, k, v, *present):
    present = list(present)
    return mosaic.forward(q, k, v, tuple(present.pop(0) if e is not None else None
                                         for e in extras), spec=MaskSpec(*spec), scale=0.1)

  present = [e for e in extras if e is not None]
  exported = export.export(jax.jit(forward), platforms=["cuda"])(*arrays, *present)
  assert exported.out_avals[0].shape == (2, t, 4, hv)
  assert exported.out_avals[1].shape == (2, 4, t)
  def backward(q, k, v, do, lse, out, dlse, *present, config=None):
    present = list(present)
    return mosaic.backward(q, k, v, do, lse, out, dlse, tuple(
        present.pop(0) if e is not None else None for e in extras), spec=MaskSpec(*spec),
        scale=0.1, config=config)

  stat = jax.ShapeDtypeStruct((2, 4, t), jnp.float32)
  default = mosaic.BACKWARD_CONFIGS[max(h, hv)]
  configs = [None, dataclasses.replace(default, diagonal_mask=not default.diagonal_mask)]
  if max(h, hv) < 256:  # and in the other scheduling (at 256 two buffers outgrow the memory)
    configs.append(dataclasses.replace(default, persistent=not default.persistent))
  for config in configs:
    exported = export.export(jax.jit(functools.partial(backward, config=config)),
                             platforms=["cuda"])(
        *arrays, jax.ShapeDtypeStruct((2, t, 4, hv), dtype), stat,
        jax.ShapeDtypeStruct((2, t, 4, hv), dtype), stat, *present)
    assert [a.shape for a in exported.out_avals] == [a.shape for a in arrays]


def _check_band_walk(band, ok, limit, spans, case, row_limit=None):
  """Rows by columns ``ok`` (True: a pair the kernel must compute): every allowed pair lies in
  a tile its block of rows computes, the tiles it computes unmasked allow every pair, and
  each block's walk passes every tile its CTA loads once, in the producer's order (a tile
  missed or passed twice would leave a barrier's phase unwaited, a hang)."""
  from jaxfuse.ops.attention import mosaic
  rows_per_cta = 2 * band.block_rows
  for cta in range(-(-band.rows // rows_per_cta)):
    span_of = None if spans is None else (lambda i: tuple(int(x) for x in spans[2 * cta + i]))
    cta_lo, cta_hi = (int(x) for x in band.cta(cta * rows_per_cta, limit, span_of, row_limit))
    for i in range(2):
      first = cta * rows_per_cta + i * band.block_rows
      lo, full_lo, full_hi, hi = (int(x) for x in band.block(
          first, limit, None if spans is None else span_of(i), (cta_lo, cta_hi), row_limit))
      where = (case, cta, i)
      assert cta_lo <= lo <= full_lo <= full_hi <= hi <= cta_hi <= band.col_tiles, where
      # (tile, 0 passed / 1 masked / 2 unmasked) in the order the walk visits them.
      record = lambda code: lambda j, seen, masked=True: seen + [(j, code + (not masked))]
      walked = mosaic._walk((lo, full_lo, full_hi, hi), (cta_lo, cta_hi), record(1), record(0),
                            [])
      expected = [(j, 2 if full_lo <= j < full_hi else int(lo <= j < hi))
                  for j in range(cta_lo, cta_hi)]
      assert walked == expected, where
      rows = ok[first:first + band.block_rows]
      seen = np.nonzero(rows.any(0))[0] // band.block_cols
      assert np.all((seen >= lo) & (seen < hi)), where
      # Rows past row_limit need no column (unmasked or not, they are zeroed or have no
      # probability).
      limit_rows = band.rows if row_limit is None else row_limit
      kept = rows[:max(0, min(band.block_rows, limit_rows - first))]
      assert kept[:, full_lo * band.block_cols:full_hi * band.block_cols].all(), where
      assert len(kept) or lo == hi, where  # a block past its rows' length walks nothing


def test_mosaic_bands_cover_every_allowed_pair(rng, monkeypatch):
  """The Hopper kernels' tile walks, on small tiles against the reference's mask over random
  masks: queries by key tiles (forward and dQ) and keys by query tiles (dK/dV), each stopping
  at its rows' length."""
  from jaxfuse.ops.attention import mosaic
  # The kernels' loops (lax.fori_loop) as Python loops, which may carry a record of the walk.
  monkeypatch.setattr(mosaic.pipeline, "_loop", lambda lower, upper, fn, carry: functools.reduce(
      lambda carry, j: fn(j, carry), range(lower, upper), carry))
  from jaxfuse.ops.attention.reference import MaskSpec, allowed
  block_q, block_kv = 4, 8
  # Lengths at, around and between the tiles' edges, few enough that the segment spans'
  # programs repeat (each new shape compiles).
  lengths = (1, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 23, 39)
  for _ in range(300):
    t, s = (int(x) for x in rng.choice(lengths, 2))
    causal = bool(rng.integers(2))
    window = tuple(int(x) for x in rng.integers(0, 12, 2)) if rng.integers(2) else None
    spec = MaskSpec(causal, int(rng.integers(-20, 30)), window)
    kv_len = int(rng.integers(0, s + 1)) if rng.integers(2) else None
    q_len = int(rng.integers(0, t + 1)) if rng.integers(2) else None
    segments = bool(rng.integers(2))
    q_ids, kv_ids = (np.sort(rng.integers(0, 3, n)) for n in (t, s))
    q_tiles, kv_tiles = -(-t // block_q), -(-s // block_kv)
    q_rows, kv_rows = -(-t // (2 * block_q)) * 2 * block_q, -(-s // (2 * block_kv)) * 2 * block_kv
    mask = lambda q_len, kv_len: allowed(
        spec, np.arange(t), np.arange(s),  # numpy in, numpy out
        *((q_ids[None], kv_ids[None]) if segments else (None, None)),
        None if q_len is None else np.array([q_len]),
        None if kv_len is None else np.array([kv_len]))
    ok = mask(q_len, kv_len)
    ok = np.ones((t, s), bool) if ok is None else np.broadcast_to(np.asarray(ok)[0], (t, s))
    case = (t, s, spec, kv_len, q_len, segments)
    spans = lambda *a: np.asarray(mosaic._segment_spans(*a))[0] if segments else None
    queries = mosaic._Band.of_queries(t, spec, block_q, block_kv, kv_tiles,
                                      mask_every_tile=q_len is not None)
    q_spans = spans(q_ids[None], kv_ids[None], q_rows, kv_tiles * block_kv, block_q, block_kv)
    _check_band_walk(queries, ok, s if kv_len is None else kv_len, q_spans, case, q_len)
    # dQ: rows past the query length have no probability, so they need no mask.
    dq_queries = dataclasses.replace(queries, mask_every_tile=False)
    _check_band_walk(dq_queries, ok, s if kv_len is None else kv_len, q_spans, case, q_len)
    keys = mosaic._Band.of_keys(s, spec, block_kv, block_q, q_tiles, mask_every_tile=False)
    kv_spans = spans(kv_ids[None], q_ids[None], kv_rows, q_tiles * block_q, block_kv, block_q)
    _check_band_walk(keys, ok.T, t if q_len is None else q_len, kv_spans, case, kv_len)


def test_mosaic_tile_masks_match_the_reference(rng, monkeypatch):
  """``_Band.mask`` in both of its forms (by diagonals, by positions), on every tile the
  kernels walk of random masks, keeps exactly the pairs the reference allows: queries by key
  tiles (forward, stopping at the query length) and keys by query tiles (dK/dV, whose rows past
  the key length are zeroed later, not masked). Lane-layout iotas stand in for the kernel's."""
  from jaxfuse.ops.attention import mosaic
  from jaxfuse.ops.attention.reference import MaskSpec, allowed
  monkeypatch.setattr(mosaic.band, "_iota",
                      lambda shape, axis: jax.lax.broadcasted_iota(jnp.int32, shape, axis))
  block_q, block_kv = 4, 8
  for _ in range(40):
    t, s = (int(x) for x in rng.integers(1, 30, 2))
    window = tuple(int(x) for x in rng.integers(0, 12, 2)) if rng.integers(2) else None
    spec = MaskSpec(bool(rng.integers(2)), int(rng.integers(-20, 30)), window)
    q_len, kv_len = (int(rng.integers(0, n + 1)) if rng.integers(2) else None for n in (t, s))
    segments = bool(rng.integers(2))
    q_ids, kv_ids = (np.sort(rng.integers(0, 3, n)) for n in (t, s))
    ok = allowed(spec, np.arange(t), np.arange(s),
                 *((q_ids[None], kv_ids[None]) if segments else (None, None)),
                 None if q_len is None else np.array([q_len]),
                 None if kv_len is None else np.array([kv_len]))
    ok = np.ones((t, s), bool) if ok is None else np.broadcast_to(np.asarray(ok)[0], (t, s))
    queries = mosaic._Band.of_queries(t, spec, block_q, block_kv, -(-s // block_kv), False)
    keys = mosaic._Band.of_keys(s, spec, block_kv, block_q, -(-t // block_q), False)
    for band, kept, (row_ids, col_ids), limit, row_limit, rows in (
        (queries, ok, (q_ids, kv_ids), s if kv_len is None else kv_len, q_len, t),
        (keys, ok.T, (kv_ids, q_ids), t if q_len is None else q_len, None,
         s if kv_len is None else kv_len)):
      block = lambda a, start, n: jnp.asarray(
          np.pad(a, (0, max(0, start + n - len(a))), mode="edge")[start:start + n])
      for first in range(0, rows, band.block_rows):
        for tile in range(-(-limit // band.block_cols)):
          col0 = tile * band.block_cols
          ids = lambda: (block(row_ids, first, band.block_rows),
                         block(col_ids, col0, band.block_cols))
          expected = np.zeros((band.block_rows, band.block_cols), bool)
          part = kept[first:first + band.block_rows, col0:col0 + band.block_cols]
          expected[:part.shape[0], :part.shape[1]] = part
          for diagonal in (True, False):
            scores = band.mask(jnp.zeros((band.block_rows, band.block_cols)), first, col0,
                               limit, row_limit, ids if segments else None, diagonal)
            got = np.isfinite(np.asarray(scores))
            where = (t, s, spec, q_len, kv_len, segments, band.block_rows, first, tile, diagonal)
            np.testing.assert_array_equal(got[:rows - first], expected[:rows - first],
                                          err_msg=str(where))


@pytest.mark.parametrize("kw,segments", [({}, False), (dict(is_causal=True), False),
                                         (dict(local_window_size=(8, 8)), False), ({}, True)],
                         ids=str)
def test_mosaic_tables_for_unmasked_calls_serve_only_them(kw, segments):
  """The forward's and backward's tables for calls without a causal mask, window or segments
  (``UNMASKED_CONFIGS``): every other call takes the masked tables."""
  from jaxfuse.ops.attention import bench, mosaic
  spec = bench._mask_spec(kw)
  unmasked = not (kw or segments)
  for dim in mosaic.CONFIGS:
    for table, masked_table, default in (
        (mosaic.UNMASKED_CONFIGS, mosaic.CONFIGS, mosaic.default_config),
        (mosaic.BACKWARD_UNMASKED_CONFIGS, mosaic.BACKWARD_CONFIGS,
         mosaic.default_backward_config)):
      expected = table.get(dim, masked_table[dim]) if unmasked else masked_table[dim]
      assert default(dim, 64, spec, segments) == expected, (dim, default)


def test_mosaic_names_a_precision_it_cannot_keep():
  """Precision names TF32 or not, as for 'triton'; an algorithm preset is XLA's alone: refused,
  so None moves on to 'xla'."""
  from jaxfuse.ops.attention import api
  from jaxfuse.ops.attention.reference import MaskSpec
  arrays = [jax.ShapeDtypeStruct((1, 64, 2, 256), jnp.bfloat16)] * 3
  call = lambda precision: api._Call(MaskSpec(False, 0, None, None), 0.1, precision, False,
                                     False, False, False, False, False, jnp.bfloat16)
  assert api._mosaic_unsupported(call(jax.lax.Precision.HIGHEST), arrays) is None
  reason = api._mosaic_unsupported(call(jax.lax.DotAlgorithmPreset.BF16_BF16_F32), arrays)
  assert "precision" in reason


def test_mosaic_takes_every_mask():
  from jaxfuse.ops.attention import mosaic
  from jaxfuse.ops.attention.reference import MaskSpec
  assert mosaic.unsupported((2, 1000, 4, 64), (2, 1321, 2, 64), (2, 1321, 2, 256),
                            jnp.float16, spec=MaskSpec(True, 7, (100, 3), 5.0),
                            has_segments=True, has_q_len=True, has_kv_len=True) is None
