"""Times kernel tilings on this GPU, to choose the defaults in the ops' triton.py and cuda/ files.

    PYTHONPATH=. python benchmarks/tune.py [norm norm_cuda softmax cross_entropy softmax_cuda
        attention attention_mosaic attention_mosaic_bwd rnn_cuda]
        [--only SUBSTR] [--json PATH]

Each problem times its default tiling first and then the candidates, calling the kernels
directly (no custom VJP, no XLA around them). Memory-bound rates count the passes over the
array (norm forward 2: x read, y written; norm backward 3: x and dy read, dx written, each in
its dtype; softmax the same; cross-entropy 2: logits read, gradient written) against the copy
measured in the same run; attention counts matrix-product FLOPs against the bf16 matmul
measured in the same run.
Every candidate's output is compared with the default's, so a broken tiling shows as an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._core import bench, registry, timing
from jaxfuse._core import ceilings as measured
from jaxfuse._core.cuda import Tiling
from jaxfuse._core.testing import relative_error


def _time(fn, sets):
  return timing.time_ms(fn, sets, min_seconds=0.15, groups=3)


def _sets(make, bytes_per_call):
  n = max(2, min(8, bench.copies_for(bytes_per_call)))
  return [make(jax.random.key(i)) for i in range(n)]


def _normal_pair(shape, key):
  """Two bf16 arrays of ``shape``: the rows, and a cotangent (or the output's stand-in)."""
  kx, kd = jax.random.split(key)
  return (jax.random.normal(kx, shape, jnp.bfloat16), jax.random.normal(kd, shape, jnp.bfloat16))


def _disagreement(result, reference) -> float:
  """The worst row's error against the default's output, over the outputs; a row far smaller
  than its output's typical row is measured against the typical one (a causal dQ's first rows
  are zero up to rounding, which against themselves reads as 100%)."""
  errors = []
  for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(reference)):
    b64 = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    typical = float(np.sqrt(np.mean(np.sum(b64 * b64, axis=-1))))
    errors.append(relative_error(a, b, floor=typical))
  return max(errors)


class Sweep:
  """Runs candidates of one problem and records one JSON line each."""

  def __init__(self, ceilings, out, only):
    self.ceilings, self.out, self.only, self.results = ceilings, out, only, []

  def wanted(self, label):
    return not self.only or any(o in label for o in self.only)

  def problem(self, family, label, fn, variants, sets, work, unit="GB/s"):
    if not self.wanted(label):
      return
    reference = None
    for i, blocks in enumerate(dict.fromkeys(variants)):  # a candidate that is the default once
      line = dict(family=family, problem=label, blocks=str(blocks), default=i == 0)
      try:
        result = jax.block_until_ready(fn(blocks, *sets[0]))
        if reference is None:
          reference = result
        line["error_vs_default"] = _disagreement(result, reference)
        ms = _time(functools.partial(fn, blocks), sets)
        rate = work / (ms * 1e-3) / (1e9 if unit == "GB/s" else 1e12)
        ceiling = self.ceilings["copy GB/s" if unit == "GB/s" else "matmul TFLOP/s"]
        line.update(ms=ms, rate=rate, unit=unit, pct=100 * rate / ceiling)
      except Exception as e:  # noqa: BLE001  (a tiling that fails to compile is a result too)
        line["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
      self.results.append(line)
      print(json.dumps(line), flush=True)
      if self.out:
        self.save()

  def save(self):
    with open(self.out, "w") as f:
      json.dump(dict(bench.environment("benchmarks/tune.py"), ceilings=self.ceilings,
                     results=self.results), f, indent=1)

  def summary(self):
    print("\nbest per problem:")
    for label in dict.fromkeys(r["problem"] for r in self.results):
      rows = [r for r in self.results if r["problem"] == label and "ms" in r]
      if not rows:
        continue
      best = min(rows, key=lambda r: r["ms"])
      default = next((r for r in rows if r["default"]), None)
      print(f"{label:<36} best {best['pct']:5.1f}% {best['blocks']}"
            + (f" | default {default['pct']:5.1f}%" if default else ""))


# --------------------------------------------------------------------------- norm

_NORM_ROWS = 16384


def _norm_inputs(n, key, rows=_NORM_ROWS):
  """x and dy ``(1, rows, n)`` and a weight ``(1, n)``, bf16."""
  kx, kd, kw = jax.random.split(key, 3)
  return (jax.random.normal(kx, (1, rows, n), jnp.bfloat16),
          jax.random.normal(kd, (1, rows, n), jnp.bfloat16),
          1 + 0.1 * jax.random.normal(kw, (1, n), jnp.bfloat16))


def _norm(sweep):
  from jaxfuse.ops.norm import triton
  from jaxfuse.ops.norm.triton import NormBlocks as B
  sms = registry.num_multiprocessors()
  rows = _NORM_ROWS

  def fwd(kind, blocks, x, dy, w):
    return triton.forward(x, w, w if kind == "layer" else None, kind=kind, eps=1e-5,
                          out_dtype=x.dtype, blocks=blocks)[0]

  def bwd(kind, blocks, x, dy, w, mean, rstd):
    return triton.backward(dy, x, w, mean, rstd, kind=kind, has_bias=kind == "layer",
                           bias_dtype=w.dtype, blocks=blocks)

  def grid(rows_, warps, programs, n):
    return [B(r, n, w, p) for r in rows_ for w in warps for p in programs]

  plans = {
      ("rms", 256, "fwd"): grid((8, 16, 32), (2, 4, 8), (8 * sms, 1 << 20), 256),
      ("layer", 256, "fwd"): grid((8, 16, 32), (2, 4, 8), (8 * sms, 1 << 20), 256),
      ("rms", 256, "bwd"): grid((4, 8, 16, 32), (4, 8), (sms, 2 * sms, 4 * sms, 8 * sms), 256),
      ("layer", 256, "bwd"): grid((4, 8, 16, 32), (4, 8), (sms, 2 * sms, 4 * sms, 8 * sms),
                                  256),
      ("layer", 1024, "fwd"): grid((2, 4, 8, 16), (4, 8, 16), (8 * sms, 1 << 20), 1024),
      ("rms", 1024, "fwd"): grid((2, 4, 8, 16), (4, 8, 16), (8 * sms, 1 << 20), 1024),
      ("rms", 1024, "bwd"): grid((2, 4, 8, 16), (4, 8), (sms, 2 * sms, 4 * sms), 1024),
      ("layer", 1024, "bwd"): grid((2, 4, 8, 16), (4, 8), (sms, 2 * sms, 4 * sms), 1024),
      ("layer", 2048, "fwd"): grid((1, 2, 4), (4, 8, 16), (8 * sms, 1 << 20), 2048),
      ("rms", 2048, "bwd"): grid((1, 2, 4, 8), (8, 16), (sms, 2 * sms, 4 * sms), 2048),
      ("layer", 2048, "bwd"): grid((1, 2, 4, 8), (8, 16), (sms, 2 * sms, 4 * sms), 2048),
      ("layer", 4096, "bwd"): grid((1, 2, 4), (8, 16), (sms, 2 * sms), 4096),
      ("layer", 8192, "fwd"): grid((1, 2), (8, 16, 32), (4 * sms, 8 * sms), 8192),
      ("rms", 16384, "bwd"): [
          B(1, 16384, 16, sms), B(1, 16384, 32, sms), B(1, 4096, 16, sms),
          B(1, 4096, 16, 2 * sms), B(1, 2048, 16, sms), B(1, 8192, 16, sms),
          B(1, 4096, 32, sms), B(1, 8192, 16, 2 * sms, "split"),
          B(1, 8192, 16, sms, "split"), B(1, 4096, 8, 4 * sms, "split")],
      ("layer", 16384, "bwd"): [
          B(1, 2048, 16, sms, "chunks"), B(1, 4096, 16, sms, "chunks"),
          B(1, 8192, 16, sms, "chunks"), B(1, 2048, 32, 2 * sms),
          B(1, 4096, 32, sms), B(1, 2048, 32, sms), B(1, 8192, 32, sms),
          B(1, 4096, 32, 2 * sms), B(1, 8192, 16, sms, "split"),
          B(1, 8192, 16, 2 * sms, "split"), B(1, 4096, 16, 2 * sms, "split"),
          B(1, 4096, 8, 4 * sms, "split")],
  }
  for kind in ("rms", "layer"):
    plans[(kind, 65536, "bwd")] = [
        B(1, 8192, 16, 2 * sms), B(1, 8192, 16, sms), B(1, 4096, 16, 2 * sms),
        B(1, 16384, 32, sms), B(1, 4096, 8, 4 * sms), B(2, 4096, 16, sms)]
    plans[(kind, 65536, "fwd")] = [
        B(1, 32768, 32, 8 * sms), B(1, 32768, 32, 2 * sms), B(1, 32768, 32, sms),
        B(1, 16384, 16, sms), B(1, 16384, 16, 2 * sms), B(1, 16384, 32, sms),
        B(1, 8192, 16, sms), B(1, 8192, 16, 2 * sms), B(1, 8192, 8, 4 * sms)]
  label = lambda kind, n, direction: f"{kind} {rows}x{n} {direction}"
  plans = {key: v for key, v in plans.items() if sweep.wanted(label(*key))}
  for n in sorted({n for _, n, _ in plans}):
    pass_bytes = rows * n * 2
    sets = _sets(functools.partial(_norm_inputs, n), 3 * pass_bytes)
    for (kind, n_, direction), variants in plans.items():
      if n_ != n:
        continue
      default = (triton.forward_blocks(rows, n, kind) if direction == "fwd"
                 else triton.backward_blocks(rows, n, kind))
      variants = list(dict.fromkeys([default] + variants))
      if direction == "fwd":
        fn, data, passes = functools.partial(fwd, kind), sets, 2
      else:
        data = []
        for x, dy, w in sets:
          _, mean, rstd = triton.forward(x, w, None, kind=kind, eps=1e-5, out_dtype=x.dtype)
          data.append((x, dy, w, mean, rstd))
        fn, passes = functools.partial(bwd, kind), 3
      sweep.problem("norm", label(kind, n, direction), fn, variants, data,
                    passes * pass_bytes)


# A variant is a tiling, or (tiling, knob) for the one other setting its problem times (a
# forward's waves of persistent clusters, the norm backward's cap on them); a tiling alone
# leaves that setting at its default (None).
def _knob(variant):
  return variant if isinstance(variant, tuple) else (variant, None)


def _other_waves(tiling, default):
  return [(tiling, waves) for waves in (1, 2, 4, 8) if waves != default]


def _norm_cuda(sweep):
  """Cluster shapes of the 'cuda' kernels: (CTAs per row, threads per CTA, units per thread),
  and for short rows the lanes that hold a row."""
  from jaxfuse.ops.norm import cuda
  from jaxfuse._core import cuda as cuda_core
  from jaxfuse._core.cuda import Tiling as T
  sms = registry.num_multiprocessors()

  # Float32 parameters beside bfloat16 x make float32 outputs (jnp's promotion), so dy too.
  def fwd(kind, variant, x, dy, w):
    tiling, waves = _knob(variant)
    return cuda.forward(x, w, w if kind == "layer" else None, kind=kind, eps=1e-5,
                        out_dtype=dy.dtype, tiling=tiling, waves=waves)[0]

  # The backward's knob caps the persistent grid below the resident clusters: fewer float32
  # partial rows of the parameter gradients to write and read.
  def bwd(kind, variant, x, dy, w, mean, rstd):
    tiling, max_clusters = _knob(variant)
    return cuda.backward(dy, x, w, mean, rstd, kind=kind, has_bias=kind == "layer",
                         bias_dtype=w.dtype, tiling=tiling, max_clusters=max_clusters)

  # Short rows: (threads, units, lanes), a row to a group of lanes of one warp.
  def lanes(threads, units, n_lanes):
    return T(1, threads, units, 0, n_lanes)

  # Forward: rows through registers, or staged through one or two shared-memory stages beside
  # the parameter slices (measured slower: the parameters read from global memory at each row).
  plans = {256: ([lanes(256, 2, 16), lanes(256, 1, 32), lanes(128, 2, 16), lanes(64, 1, 32),
                  lanes(128, 4, 8), lanes(64, 4, 8)],
                 [lanes(256, 2, 16), lanes(256, 4, 8), lanes(128, 4, 8), lanes(256, 1, 32),
                  lanes(64, 1, 32)]),
           512: ([lanes(256, 2, 32), lanes(128, 2, 32)],
                 [lanes(256, 2, 32), lanes(256, 4, 16), lanes(128, 4, 16)]),
           1024: ([lanes(128, 4, 32), lanes(64, 4, 32)],
                  [T(1, 64, 2), T(1, 128, 1), lanes(128, 4, 32), lanes(64, 4, 32)]),
           # Where the Triton kernels lead: wider CTAs at fewer units, and rows split over two
           # to eight CTAs.
           2048: ([T(1, 128, 2), T(1, 256, 1), T(2, 64, 2), T(2, 32, 4)],
                  [T(1, 256, 1), T(2, 64, 2), T(2, 128, 1)]),
           4096: ([T(1, 256, 2), T(1, 512, 1), T(2, 64, 4), T(2, 128, 2)],
                  [T(1, 512, 1), T(2, 128, 2), T(4, 64, 2)]),
           8192: ([T(1, 512, 2), T(2, 128, 4), T(2, 256, 2), T(4, 64, 4)],
                  [T(2, 256, 2), T(2, 512, 1), T(4, 128, 2)]),
           16384: ([T(2, 256, 4), T(2, 512, 2), T(4, 128, 4), T(4, 256, 2)],
                   [T(4, 256, 2), T(4, 512, 1), T(8, 128, 2)]),
           32768: ([T(2, 512, 4), T(2, 256, 8, 1), T(4, 128, 8, 2), T(8, 64, 8, 1)],
                   [T(8, 256, 2), T(8, 512, 1)]),
           65536: ([T(4, 512, 4), T(4, 256, 8, 1), T(8, 128, 8, 2), T(16, 64, 8, 1)],
                   [T(16, 256, 2), T(16, 512, 1)]),
           131072: ([T(8, 512, 4), T(8, 256, 8, 1), T(16, 128, 8, 2)], [])}

  # Rows of 1024 to 16384 through shared-memory stages: up to four rows a CTA in flight
  # without the registers to hold them.
  def staged(n):
    shapes = [(u, s) for u in (4, 8) for s in ((1, 2, 3, 4) if u == 4 else (1, 2))]
    return [t for u, s in shapes
            if (t := cuda_core.tiling(n, (u,), max_threads=cuda.STAGED_THREADS, stages=s))]

  for n in (1024, 2048, 4096, 8192, 16384):
    plans[n] = (plans[n][0] + staged(n), plans[n][1])

  def as_float32_params(x, dy, w):
    return x, dy.astype(jnp.float32), w.astype(jnp.float32)

  problems = [(n, variants, "") for n, variants in plans.items()]
  problems.append((4096, plans[4096], " f32 params"))
  for n, (forward_variants, backward_variants), params in problems:
    rows = min(_NORM_ROWS, 2**30 // n)
    sets = None
    for kind in ("rms", "layer"):
      for direction in ("fwd", "bwd"):
        label = f"cuda {kind} {rows}x{n} {direction}{params}"
        if not sweep.wanted(label) or (direction == "bwd" and not backward_variants):
          continue
        # Bytes per element of each pass: x read, then y written (forward) or dy read and dx
        # written (backward), each in its own dtype.
        y_bytes = 4 if params else 2
        work = rows * n * (2 + y_bytes + (2 if direction == "bwd" else 0))
        if sets is None:
          sets = _sets(functools.partial(_norm_inputs, n, rows=rows), rows * n * 8)
          sets = [as_float32_params(*s) for s in sets] if params else sets
        if direction == "fwd":
          fn, data = functools.partial(fwd, kind), sets
          default = cuda.forward_tiling(n, jnp.bfloat16, sets[0][2].dtype, sets[0][1].dtype)
          short = [v for v in forward_variants if v.lanes]
          variants = [default] + forward_variants + [
              knob for t in [default] + short
              for knob in _other_waves(t, cuda.forward_waves(kind, t))]
        else:
          data = []
          for x, dy, w in sets:
            _, mean, rstd = cuda.forward(x, w, None, kind=kind, eps=1e-5, out_dtype=dy.dtype)
            data.append((x, dy, w, mean, rstd))
          fn = functools.partial(bwd, kind)
          default = cuda.backward_tiling(n, jnp.bfloat16, data[0][1].dtype, kind)
          capped = [(t, k * sms) for t in (default, backward_variants[0])
                    for k in (1, 2, 4, 8, 16)]
          # A float32 dy's rows also in the tiling of a 16-bit dy's.
          variants = [default, cuda.backward_tiling(n, jnp.bfloat16)] + backward_variants + capped
        sweep.problem("norm_cuda", label, fn, list(dict.fromkeys(variants)), data, work)


# --------------------------------------------------------------------------- softmax

def _softmax(sweep):
  from jaxfuse.ops.softmax import triton
  from jaxfuse.ops.softmax.triton import Blocks as B
  sms = registry.num_multiprocessors()
  for n in (1024, 4096, 8192):
    layout = triton.Layout((16384, n), 1)
    x_sets = _sets(lambda key, n=n: (jax.random.normal(key, (16384, n), jnp.bfloat16),),
                   2 * 16384 * n * 2)
    variants = [B(r, n, w, p) for r in (1, 2, 4, 8) for w in (4, 8, 16)
                for p in (8 * sms, 1 << 20) if r * n // (32 * w) <= 64]
    sweep.problem("softmax", f"softmax 16384x{n} fwd",
                  lambda blocks, x, layout=layout: triton.softmax_forward(
                      x, None, layout, scale=1.0, log=False, blocks=blocks),
                  list(dict.fromkeys([triton.default_blocks(layout)] + variants)), x_sets,
                  2 * 16384 * n * 2)
  problems = [(16384, 32768), (4096, 131072), (4096, 262144)]
  for rows, n in problems:
    layout = triton.Layout((rows, n), 1)
    make = functools.partial(_normal_pair, (rows, n))
    variants = [B(1, 8192, 16, sms), B(1, 8192, 16, 2 * sms), B(1, 16384, 16, sms),
                B(1, 16384, 32, sms), B(1, 16384, 16, 2 * sms), B(1, 32768, 32, sms)]
    if n <= 32768:
      variants.append(B(1, 32768, 32, 8 * sms))
    pass_bytes = rows * n * 2
    sets = _sets(make, 3 * pass_bytes)
    sweep.problem("softmax", f"softmax {rows}x{n} fwd",
                  lambda blocks, x, dy, layout=layout: triton.softmax_forward(
                      x, None, layout, scale=1.0, log=False, blocks=blocks),
                  list(dict.fromkeys([triton.default_blocks(layout)] + variants)), sets,
                  2 * pass_bytes)
    sweep.problem("softmax", f"softmax {rows}x{n} bwd",
                  lambda blocks, y, dy, layout=layout: triton.softmax_backward(
                      y, dy, layout, scale=1.0, log=False, blocks=blocks),
                  list(dict.fromkeys([triton.default_blocks(layout, "backward")] + variants)),
                  sets, 3 * pass_bytes)


def _cross_entropy(sweep):
  import optax
  from jaxfuse.ops.softmax import triton
  from jaxfuse.ops.softmax.triton import Blocks as B
  sms = registry.num_multiprocessors()
  for rows, vocab in ((8192, 131072), (16384, 32768)):
    def make(key, rows=rows, vocab=vocab):
      kx, kl = jax.random.split(key)
      return (jax.random.normal(kx, (rows, vocab), jnp.bfloat16),
              jax.random.randint(kl, (rows,), 0, vocab, jnp.int32))

    pass_bytes = rows * vocab * 2
    sets = _sets(make, 2 * pass_bytes)
    scale = jnp.full((1,), 1.0 / rows, jnp.float32)
    fused = [B(1, 8192, 16, sms), B(1, 16384, 16, sms), B(1, 8192, 8, 2 * sms),
             B(1, 16384, 32, sms), B(2, 8192, 16, sms)]
    fused = list(dict.fromkeys([triton.cross_entropy_blocks(rows, vocab, "fused")] + fused))
    sweep.problem("cross_entropy", f"cross_entropy {rows}x{vocab} fused", lambda blocks, x, l: (
        triton.cross_entropy(x, l, label_smoothing=0.0, z_loss=0.0, row_scale=scale,
                             mode="fused", blocks=blocks)), fused, sets, 2 * pass_bytes)

    def optax_step(blocks, x, labels):
      loss = lambda x: optax.softmax_cross_entropy_with_integer_labels(
          x.astype(jnp.float32), labels).mean()
      return jax.value_and_grad(loss)(x)
    sweep.problem("cross_entropy", f"optax {rows}x{vocab} step", optax_step, ["optax"], sets,
                  2 * pass_bytes)
    loss_only = [B(1, 8192, 16, 8 * sms), B(1, 16384, 16, 4 * sms)]
    loss_only = list(dict.fromkeys([triton.cross_entropy_blocks(rows, vocab, "loss")]
                                   + loss_only))
    sweep.problem("cross_entropy", f"cross_entropy {rows}x{vocab} loss", lambda blocks, x, l: (
        triton.cross_entropy(x, l, label_smoothing=0.0, z_loss=0.0, mode="loss",
                             blocks=blocks)), loss_only, sets, pass_bytes)


def _cluster_shapes(n, units_choices, stages=(0,), min_threads=64):
  """Every (CTAs, threads, units, stages) tiling that holds a row of n: the candidates."""
  from jaxfuse._core.cuda import UNIT
  shapes = []
  for units in units_choices:
    for cluster in (1, 2, 4, 8, 16):
      threads = 32 * -(-n // (UNIT * cluster * units * 32))
      if min_threads <= threads <= 512 or (cluster == 1 and threads == 32):
        shapes += [Tiling(cluster, threads, units, s) for s in stages]
  return shapes


# The forward and cross-entropy read one array: eight vectors a thread through registers or one
# shared-memory stage, or four through registers, in CTAs of 256 or 512 threads (more stages,
# staged slices of four, and 128-thread CTAs measured slower on the H100); and, for rows one CTA
# holds, one or two units a thread, whose fewer registers let more CTAs share an SM. The
# backward reads two arrays through registers.
def _forward_candidates(n):
  return (_cluster_shapes(n, (8,), stages=(0, 1), min_threads=256)
          + _cluster_shapes(n, (4,), min_threads=256)
          + [t for t in _cluster_shapes(n, (2, 1)) if t.cluster == 1])


def _backward_candidates(n):
  from jaxfuse.ops.softmax import cuda
  return _cluster_shapes(n, cuda.BACKWARD_UNITS[2])


# The cross-entropy's streaming tilings: one CTA of each size walks a row.
_STREAMING = [Tiling.streaming(threads) for threads in (128, 256, 512)]


def _softmax_cuda_problems(sweep, label, n, sets, candidates, work, causal_offset=None):
  """The 'cuda' softmax forward and backward over rows of ``n`` as the problems ``{label} fwd``
  and ``{label} bwd``: each direction's default tiling, its ``candidates`` and the default on
  other waves, ``work`` bytes a call."""
  from jaxfuse._core import cuda as core
  from jaxfuse.ops.softmax import cuda

  def fwd(variant, x, dy):
    tiling, waves = _knob(variant)
    return cuda.softmax_forward(x, scale=1.0, log=False, causal_offset=causal_offset,
                                tiling=tiling, waves=waves)

  def bwd(variant, y, dy):
    tiling, waves = _knob(variant)
    return cuda.softmax_backward(y, dy, scale=1.0, log=False, causal_offset=causal_offset,
                                 tiling=tiling, waves=waves)

  for direction, fn, default in (("fwd", fwd, cuda.forward_tiling),
                                 ("bwd", bwd, cuda.backward_tiling)):
    first = default(n, jnp.bfloat16)
    variants = list(dict.fromkeys([first] + candidates[direction]
                                  + _other_waves(first, core.GRID_WAVES)))
    sweep.problem("softmax_cuda", f"{label} {direction}", fn, variants, sets, work[direction])


def _softmax_cuda_causal(sweep):
  """Causal scores (heads, T, T): the masked kernels hold more registers a thread than the
  plain ones and read about half of each row, so fewer units a thread in wider CTAs (more of
  them resident) are candidates beside the plain rows' tiling, both directions."""
  from jaxfuse.ops.softmax import cuda
  for heads, t in ((64, 2048), (2, 16384)):
    rows = heads * t
    label = f"cuda softmax {rows}x{t} causal"
    if not any(sweep.wanted(f"{label} {d}") for d in ("fwd", "bwd")):
      continue
    # Bytes of the kept half: the forward reads it and writes every score, the backward reads
    # it twice and writes every gradient.
    half, whole = rows * t, 2 * rows * t
    sets = _sets(functools.partial(_normal_pair, (heads, t, t)), 3 * whole)
    _softmax_cuda_problems(
        sweep, label, t, sets,
        {"fwd": _cluster_shapes(t, (1, 2, 4, 8)),
         "bwd": _cluster_shapes(t, cuda.BACKWARD_UNITS[2])},
        {"fwd": half + whole, "bwd": 2 * half + whole}, causal_offset=0)


def _cross_entropy_cuda_problems(sweep, rows, vocab, variants_of):
  """The 'cuda' cross-entropy's loss and fused loss and gradient over ``rows`` of ``vocab``
  bfloat16 logits, under ``variants_of(default)`` (``default``: the tiling the call takes)."""
  from jaxfuse.ops.softmax import cuda
  labels = {mode: f"cuda cross_entropy {rows}x{vocab} {mode}" for mode in ("fused", "loss")}
  if not any(map(sweep.wanted, labels.values())):
    return

  def make(key):
    kx, kl = jax.random.split(key)
    return (jax.random.normal(kx, (rows, vocab), jnp.bfloat16),
            jax.random.randint(kl, (rows,), 0, vocab, jnp.int32))

  scale = jnp.full((1,), 1.0 / rows, jnp.float32)
  for mode, label in labels.items():
    fused = mode == "fused"
    default = cuda.cross_entropy_tiling(vocab, jnp.bfloat16, fused=fused, n_rows=rows)

    def call(variant, x, labels, mode=mode):
      tiling, waves = _knob(variant)
      out = cuda.cross_entropy(x, labels, label_smoothing=0.0, z_loss=0.0, row_scale=scale,
                               mode=mode, tiling=tiling, waves=waves)
      return out if mode == "fused" else out[0]

    passes = 2 if fused else 1
    sweep.problem("softmax_cuda", label, call, list(dict.fromkeys(variants_of(default))),
                  _sets(make, passes * rows * vocab * 2), passes * rows * vocab * 2)


def _softmax_cuda(sweep):
  """Cluster shapes of the softmax and cross-entropy 'cuda' kernels, and their grids' waves."""
  from jaxfuse._core import cuda as core
  from jaxfuse.ops.softmax import cuda
  for rows, n in ((16384, 1024), (16384, 4096), (16384, 16384), (16384, 32768), (4096, 131072),
                  (4096, 262144)):
    pass_bytes = rows * n * 2
    label = f"cuda softmax {rows}x{n}"
    if not any(sweep.wanted(f"{label} {d}") for d in ("fwd", "bwd")):
      continue
    sets = _sets(functools.partial(_normal_pair, (rows, n)), 3 * pass_bytes)
    _softmax_cuda_problems(sweep, label, n, sets,
                           {"fwd": _forward_candidates(n), "bwd": _backward_candidates(n)},
                           {"fwd": 2 * pass_bytes, "bwd": 3 * pass_bytes})
  _softmax_cuda_causal(sweep)
  for rows, vocab in ((8192, 131072), (16384, 32768), (16384, 16384), (16384, 8192)):
    # Beside the forward's shapes, and timed first, those whose gradient fits the registers
    # (benchmarks/spills.py: four units staged, two through registers) at the cost of more CTAs
    # a row; and the rows streamed by CTAs of each size.
    spill_free = (_cluster_shapes(vocab, (4,), stages=(1,), min_threads=128)
                  + _cluster_shapes(vocab, (2,), min_threads=256))
    _cross_entropy_cuda_problems(sweep, rows, vocab, lambda default: (
        [default] + _STREAMING + spill_free
        + ([] if default.is_streaming else _other_waves(default, core.GRID_WAVES))
        + _forward_candidates(vocab)))
  # Fewer long rows than a wave of streaming CTAs: streamed by CTAs of each size, or held.
  sms = registry.num_multiprocessors()
  for rows, vocab in ((64, 131072), (sms, 131072), (256, 131072), (512, 131072),
                      (1024, 131072), (256, 262144), (512, 32768), (1024, 32768)):
    _cross_entropy_cuda_problems(sweep, rows, vocab, lambda default: (
        [default] + _STREAMING + _forward_candidates(vocab)))
  # linear_cross_entropy's row pass: a chunk of float32 logits (GPT-2's vocabulary padded to
  # whole units) whose gradient goes out in bfloat16. Through registers a thread of four float32
  # units keeps no next row in flight; one stage does.
  rows, vocab, classes = 2560, 50304, 50257
  label = f"cuda cross_entropy {rows}x{vocab} float32 fused"
  if sweep.wanted(label):
    def make_logits(key):
      kx, kl = jax.random.split(key)
      return (jax.random.normal(kx, (rows, vocab), jnp.float32),
              jax.random.randint(kl, (rows,), 0, classes, jnp.int32))

    scale = jnp.full((rows,), 1.0 / rows, jnp.float32)
    variants = list(dict.fromkeys([cuda.cross_entropy_tiling(vocab, jnp.float32, fused=True)]
                                  + _STREAMING
                                  + _cluster_shapes(vocab, (4, 2), stages=(0,),
                                                    min_threads=128)))
    sweep.problem("softmax_cuda", label, lambda t, x, l: cuda.cross_entropy(
        x, l, label_smoothing=0.0, z_loss=0.0, row_scale=scale, mode="fused", tiling=t,
        classes=classes, grad_dtype=jnp.bfloat16),
        variants, _sets(make_logits, rows * vocab * 6), rows * vocab * 6)


# --------------------------------------------------------------------------- attention

def _attention(sweep):
  from jaxfuse.ops.attention import triton
  from jaxfuse.ops.attention.reference import MaskSpec
  from jaxfuse.ops.attention.triton import KernelBlocks as K

  candidates = {
      128: dict(
          forward=[K(128, 128, 8, 3), K(128, 64, 4, 3), K(128, 128, 8, 2), K(128, 64, 8, 4),
                   K(128, 32, 4, 4), K(64, 64, 4, 3), K(128, 128, 4, 3)],
          dkdv=[K(64, 128, 8, 2), K(64, 128, 8, 4), K(32, 128, 4, 3), K(64, 64, 4, 3),
                K(32, 64, 4, 3), K(128, 128, 8, 3), K(128, 64, 8, 3)],
          dq=[K(128, 64, 8, 2), K(128, 64, 8, 4), K(128, 32, 4, 3), K(64, 64, 4, 3),
              K(128, 128, 8, 3), K(64, 32, 4, 3)]),
      64: dict(
          forward=[K(128, 128, 4, 3), K(128, 64, 8, 3), K(128, 64, 4, 3), K(128, 32, 4, 4)],
          dkdv=[K(64, 128, 4, 3), K(32, 64, 4, 3), K(64, 64, 4, 2), K(32, 128, 4, 5)],
          dq=[K(128, 32, 4, 3), K(64, 64, 4, 3), K(128, 64, 4, 4)]),
  }
  for b, t, n, h in ((4, 4096, 16, 128), (8, 2048, 16, 64)):
    default = triton.default_blocks(h)

    def make(key, b=b, t=t, n=n, h=h):
      keys = jax.random.split(key, 4)
      return tuple(jax.random.normal(k_, (b, t, n, h), jnp.bfloat16) for k_ in keys)

    sets = _sets(make, 8 * b * t * n * h * 2)
    for causal in (False, True):
      spec = MaskSpec(is_causal=causal)
      flops = 4 * b * t * t * n * h / (2 if causal else 1)
      kw = dict(spec=spec, scale=h ** -0.5)
      extras = (None,) * 4
      label = f"attention {b}x{t}x{n}x{h} {'causal' if causal else 'full'}"

      def fwd(blocks, q, k, v, do):
        return triton.forward(q, k, v, extras, blocks=blocks, **kw)

      bwd_sets = []
      for q, k, v, do in sets:
        out, lse = triton.forward(q, k, v, extras, **kw)
        bwd_sets.append((q, k, v, do, lse, out, jnp.zeros_like(lse)))

      def bwd(blocks, q, k, v, do, lse, out, dlse):
        return triton.backward(q, k, v, do, lse, out, dlse, extras, blocks=blocks, **kw)

      c = candidates[h]
      sweep.problem("attention", f"{label} fwd", fwd,
                    [default] + [dataclasses.replace(default, forward=f) for f in c["forward"]],
                    sets, flops, unit="TFLOP/s")
      sweep.problem("attention", f"{label} bwd dkdv", bwd,
                    [default] + [dataclasses.replace(default, dkdv=d) for d in c["dkdv"]],
                    bwd_sets, 2.5 * flops, unit="TFLOP/s")
      sweep.problem("attention", f"{label} bwd dq", bwd,
                    [default] + [dataclasses.replace(default, dq=d) for d in c["dq"]],
                    bwd_sets, 2.5 * flops, unit="TFLOP/s")


def _attention_problems(shapes, operands):
  """``(shape, sets, spec, forward FLOPs)`` for each (B, T, N, H), full then causal: input sets
  of ``operands`` bf16 arrays of that shape."""
  from jaxfuse.ops.attention.reference import MaskSpec
  for b, t, n, h in shapes:
    def make(key, b=b, t=t, n=n, h=h):
      return tuple(jax.random.normal(k_, (b, t, n, h), jnp.bfloat16)
                   for k_ in jax.random.split(key, operands))

    sets = _sets(make, 2 * operands * b * t * n * h * 2)
    for causal in (False, True):
      yield ((b, t, n, h), sets, MaskSpec(is_causal=causal),
             4 * b * t * t * n * h / (2 if causal else 1))


def _narrow_bands(operands):
  """``(label, spec, extras, sets, FLOPs)`` of a window and of packed documents at
  (4, 4096, 16, 128), with ``operands`` bf16 inputs per set; the FLOPs count only the pairs the
  masks keep."""
  from jaxfuse.ops.attention import bench as attention_bench
  b, t, n, h = 4, 4096, 16, 128
  sets = _sets(lambda key: tuple(jax.random.normal(k_, (b, t, n, h), jnp.bfloat16)
                                 for k_ in jax.random.split(key, operands)),
               operands * b * t * n * h * 2)
  ids = jnp.broadcast_to(jnp.repeat(jnp.arange(4, dtype=jnp.int32), t // 4), (b, t))
  for name, kw, extras in (("window (256, 256)", dict(local_window_size=(256, 256)),
                            (None,) * 4),
                           ("4 documents causal", dict(is_causal=True, segment_ids=ids),
                            (ids, ids, None, None))):
    yield (f"attention {b}x{t}x{n}x{h} {name}", attention_bench._mask_spec(kw), extras, sets,
           4 * attention_bench._allowed_pairs(b, t, kw) * n * h)


def _attention_mosaic(sweep):
  """The Hopper forward's tiles and pipeline depth per head dim, and cuDNN's forward on the
  same inputs (the variant named "cudnn") for the ratio within one run."""
  from jaxfuse.ops.attention import mosaic
  C = mosaic.Config
  # Shared memory bounds them: at head dim 128 a third stage or 192-key tiles fit only without
  # the second query buffer, and at head dim 256 only (64, 64, 2) fits (wgmma needs 64-row key
  # tiles).
  candidates = {64: [C(64, 128, 3), C(64, 128, 2), C(64, 128, 4), C(64, 64, 4), C(64, 256, 2),
                     C(64, 128, 3, prefetch_q=False)],
                128: [C(64, 128, 2, prefetch_q=False), C(64, 64, 4), C(64, 64, 2),
                      C(64, 128, 3, prefetch_q=False), C(64, 192, 2, prefetch_q=False)],
                256: []}
  for dim, config in mosaic.CONFIGS.items():  # and each default's other mask form
    candidates[dim].append(dataclasses.replace(config, diagonal_mask=not config.diagonal_mask))
  for (b, t, n, h), sets, spec, flops in _attention_problems(
      ((4, 4096, 16, 128), (1, 16384, 16, 128), (8, 2048, 16, 64), (2, 8192, 8, 256)), 3):
    def fwd(config, q, k, v, spec=spec, h=h):
      if config == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=spec.is_causal,
                                            implementation="cudnn")
      return mosaic.forward(q, k, v, (None,) * 4, spec=spec, scale=h ** -0.5,
                            config=config)[0]

    sweep.problem("attention_mosaic",
                  f"attention {b}x{t}x{n}x{h} {'causal' if spec.is_causal else 'full'} fwd", fwd,
                  [mosaic.default_config(h, h, spec, False), "cudnn"] + candidates[h], sets,
                  flops, unit="TFLOP/s")

  # Narrow bands (a window, packed documents) walk few tiles per query block, where shorter
  # key tiles would waste fewer masked keys; the defaults still measured fastest
  # (benchmarks/results/2026-11-25-h100-tune-attention-mosaic-narrow-bands.json).
  h = 128
  for label, spec, extras, sets, flops in _narrow_bands(operands=3):
    def masked_fwd(config, q, k, v, spec=spec, extras=extras):
      return mosaic.forward(q, k, v, extras, spec=spec, scale=h ** -0.5, config=config)[0]

    sweep.problem("attention_mosaic", f"{label} fwd", masked_fwd,
                  [mosaic.default_config(h, h, spec, extras[0] is not None)] + candidates[h],
                  sets, flops, unit="TFLOP/s")


def _attention_mosaic_bwd(sweep):
  """The Hopper backward's tiles per head dim, timed as the training step it serves (Mosaic
  forward, then the backward named by the variant), against the Mosaic forward with the
  Triton backward ("triton") and cuDNN's step ("cudnn") on the same inputs."""
  from jaxfuse.ops.attention import mosaic, triton
  B = mosaic.BackwardConfig
  candidates = {64: [B(64, 64, 64, 64, 2, persistent=True)],
                # Three stages leave room for one buffer of held rows (not persistent).
                128: [B(64, 64, 64, 64, 3)],
                # Shared memory takes 32-row streamed tiles; the tables' defaults (two and three
                # stages, dK and dV paired) are the candidates.
                256: []}
  for dim, config in mosaic.BACKWARD_CONFIGS.items():  # and each default's other mask form
    candidates[dim].append(dataclasses.replace(config, diagonal_mask=not config.diagonal_mask))
    if dim < 256:  # and its other scheduling
      candidates[dim].append(dataclasses.replace(config, persistent=not config.persistent))
  default = lambda h, spec, segments: mosaic.default_backward_config(h, h, spec, segments)

  def others(h, spec, segments):
    """The candidates and the other table's default, each once, without the default."""
    found = [mosaic.BACKWARD_CONFIGS[h], mosaic.BACKWARD_UNMASKED_CONFIGS.get(h)] + candidates[h]
    return [c for i, c in enumerate(found) if c is not None and c not in found[:i]
            and c != default(h, spec, segments)]
  for (b, t, n, h), sets, spec, flops in _attention_problems(
      ((4, 4096, 16, 128), (1, 16384, 16, 128), (8, 2048, 16, 64), (2, 8192, 8, 256)), 4):
    def step(config, q, k, v, do, spec=spec, h=h):
      if config == "cudnn":
        fn = functools.partial(jax.nn.dot_product_attention, is_causal=spec.is_causal,
                               implementation="cudnn")
        out, vjp = jax.vjp(fn, q, k, v)
        return (out,) + vjp(do)
      kw = dict(spec=spec, scale=h ** -0.5)
      out, lse = mosaic.forward(q, k, v, (None,) * 4, **kw)
      dlse = jnp.zeros_like(lse)
      if config == "triton":
        return (out,) + triton.backward(q, k, v, do, lse, out, dlse, (None,) * 4, **kw)
      return (out,) + mosaic.backward(q, k, v, do, lse, out, dlse, (None,) * 4, config=config,
                                      **kw)

    sweep.problem("attention_mosaic_bwd",
                  f"attention {b}x{t}x{n}x{h} {'causal' if spec.is_causal else 'full'} step",
                  jax.jit(step, static_argnums=0),
                  [default(h, spec, False), "triton", "cudnn"] + others(h, spec, False), sets,
                  3.5 * flops, unit="TFLOP/s")

  h = 128
  for label, spec, extras, sets, flops in _narrow_bands(operands=4):
    def masked_step(config, q, k, v, do, spec=spec, extras=extras):
      kw = dict(spec=spec, scale=h ** -0.5)
      out, lse = mosaic.forward(q, k, v, extras, **kw)
      return (out,) + mosaic.backward(q, k, v, do, lse, out, jnp.zeros_like(lse), extras,
                                      config=config, **kw)

    sweep.problem("attention_mosaic_bwd", f"{label} step",
                  jax.jit(masked_step, static_argnums=0),
                  [default(h, spec, True)] + others(h, spec, True), sets, 3.5 * flops,
                  unit="TFLOP/s")


# --------------------------------------------------------------------------- rnn


def _rnn_cuda(sweep):
  """How the persistent RNN kernels spread a layer: every CTA of a batch group stages that
  group's rows of the previous h (or gate gradients) each step, so more groups (each CTA owning
  more units of fewer rows) stage less per SM. Variants: every batch split, directions together
  or one after the other, and fewer SMs (wider CTAs)."""
  from jaxfuse.ops.rnn import cuda
  sms, shared = cuda._device()
  steps = 128
  problems = [("lstm", 64, 512, 1), ("gru", 64, 512, 1), ("lstm", 16, 1024, 2),
              ("lstm", 4, 512, 1)]
  for cell, batch, hidden, directions in problems:
    gates = 4 if cell == "lstm" else 3
    for dtype in (jnp.float32, jnp.bfloat16):
      flops = 2 * batch * steps * directions * gates * hidden * hidden
      label = f"rnn {cell} {batch}x{hidden}x{directions} {jnp.dtype(dtype).name}"

      def make(key, dtype=dtype, batch=batch, hidden=hidden, directions=directions,
               gates=gates):
        k = jax.random.split(key, 5)
        state = (directions, batch, hidden)
        return (jax.random.normal(k[0], (batch, steps, directions, gates * hidden)),
                (jax.random.normal(k[1], (directions, gates * hidden, hidden)) * hidden ** -0.5
                 ).astype(dtype),
                jnp.zeros((directions, hidden)), jax.random.normal(k[2], state),
                jax.random.normal(k[3], state), jnp.full((batch,), steps, jnp.int32),
                jax.random.normal(k[4], (batch, steps, directions, hidden), dtype))

      sets = [make(jax.random.key(i)) for i in range(2)]
      for direction_pass in ("forward", "backward"):
        variants = [cuda.plan(cell, direction_pass, batch, hidden, directions, dtype)]
        m_tiles = -(-batch // 16)
        for rows in sorted({16 * -(-m_tiles // g) for g in range(1, m_tiles + 1)}):
          for budget in (sms, sms // 2, sms // 4):
            for concurrent in ((True,), (False,)) if directions == 2 else ((True,),):
              variants.append(cuda._try_plan(gates, direction_pass, batch, hidden, directions,
                                             jnp.dtype(dtype), budget, shared, concurrent,
                                             rows))
        for cycled in (2, 3):
          variants.append(cuda._try_plan(gates, direction_pass, batch, hidden, directions,
                                         jnp.dtype(dtype), sms, shared, cycled=cycled))
        variants = [v for v in dict.fromkeys(variants) if v is not None]

        def fwd(p, xp, w, b, h0, c0, lengths, dy, cell=cell):
          return cuda.forward(cell, xp, w, b, h0, c0, lengths, exact=False, save=False,
                              launch=p)[0]

        def bwd(p, xp, w, b, h0, c0, lengths, dy, cell=cell):
          y, h_n, c_n, g, st = cuda.forward(cell, xp, w, b, h0, c0, lengths, exact=False,
                                            save=True)
          return cuda.backward(cell, dy, h_n, c_n, g, st, h0, c0, w, lengths, exact=False,
                               launch=p)[0]

        sweep.problem("rnn_cuda", f"{label} {direction_pass}",
                      fwd if direction_pass == "forward" else bwd, variants, sets,
                      flops * (1 if direction_pass == "forward" else 3), unit="TFLOP/s")


FAMILIES = {"norm": _norm, "norm_cuda": _norm_cuda, "softmax": _softmax,
            "cross_entropy": _cross_entropy, "softmax_cuda": _softmax_cuda,
            "attention": _attention, "attention_mosaic": _attention_mosaic,
            "attention_mosaic_bwd": _attention_mosaic_bwd, "rnn_cuda": _rnn_cuda}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("families", nargs="*", default=list(FAMILIES))
  parser.add_argument("--json")
  parser.add_argument("--only", action="append", help="time only problems whose label has this")
  args = parser.parse_args()
  unknown = set(args.families) - set(FAMILIES)
  if unknown:
    sys.exit(f"unknown families {sorted(unknown)}; expected some of {list(FAMILIES)}")
  ceilings = {"copy GB/s": measured.copy_bandwidth()}
  if {"attention", "attention_mosaic", "attention_mosaic_bwd", "rnn_cuda"} & set(args.families):
    ceilings["matmul TFLOP/s"] = measured.matmul_rate()
  print(f"{jax.devices()[0].device_kind}: {ceilings}", flush=True)
  sweep = Sweep(ceilings, args.json, args.only)
  for family in args.families:
    FAMILIES[family](sweep)
  sweep.summary()


if __name__ == "__main__":
  main()
