"""Times tilings of the norm kernels on this GPU, to choose the defaults in ops/norm/triton.py.

    PYTHONPATH=. python benchmarks/tune_norm.py [--kind rms] [--sizes 256,4096] [--json PATH]

Each variant runs on (1, 16384, N) bf16 inputs; the forward counts 2 passes of x, the backward
3 (x and dy read, dx written). Rates are quoted against the device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import jax
import jax.numpy as jnp

from jaxfuse._core import bench, registry
from jaxfuse.ops.norm import triton
from jaxfuse.ops.norm.triton import NormBlocks


def _variants(n, col_caps, tiles, programs):
  """Tilings whose register tile gives each thread 4 to 64 elements."""
  pl2 = 1 << (n - 1).bit_length()
  out = set()
  for bc in {min(pl2, cap) for cap in col_caps}:
    for tile, warps, p in itertools.product(tiles, (2, 4, 8, 16, 32), programs):
      br = max(1, min(16, tile // bc))
      if 4 <= br * bc // (warps * 32) <= 64:
        out.add(NormBlocks(br, bc, warps, p))
  return sorted(out, key=lambda b: (b.block_cols, b.block_rows, b.num_warps, b.programs or 0))


def forward_variants(n):
  sms = registry.num_multiprocessors()
  return _variants(n, (4096, 8192, 16384, 32768, 65536), (1024, 2048, 4096, 8192),
                   (4 * sms, 8 * sms, 16 * sms))


def backward_variants(n):
  sms = registry.num_multiprocessors()
  return _variants(n, (2048, 4096, 8192, 16384), (1024, 2048, 4096), (sms, 2 * sms, 4 * sms))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--kind", default="rms")
  parser.add_argument("--rows", type=int, default=16384)
  parser.add_argument("--sizes", default="256,1024,2048,4096,8192,16384,65536")
  parser.add_argument("--limit", type=int, default=12, help="variants per size and direction")
  parser.add_argument("--json")
  args = parser.parse_args()
  copy = bench.copy_bandwidth()
  print(f"copy {copy:.0f} GB/s on {jax.devices()[0].device_kind}")
  results = []
  for n in map(int, args.sizes.split(",")):
    pass_bytes = args.rows * n * 2

    def make(key):
      kx, kd, kw = jax.random.split(key, 3)
      x = jax.random.normal(kx, (1, args.rows, n), jnp.bfloat16)
      dy = jax.random.normal(kd, (1, args.rows, n), jnp.bfloat16)
      w = jax.random.normal(kw, (1, n), jnp.bfloat16)
      return x, dy, w

    sets = [make(jax.random.key(i)) for i in range(bench.copies_for(2 * pass_bytes))]
    y, mean, rstd = triton.forward(sets[0][0], sets[0][2], None, kind=args.kind, eps=1e-6,
                                   out_dtype=jnp.bfloat16)
    stats = [s for s in (mean, rstd) if s is not None]
    bwd_sets = [(x, dy, w, *stats) for x, dy, w in sets]
    defaults = (triton.forward_blocks(args.rows, n), triton.backward_blocks(args.rows, n))

    def fwd(blocks, x, dy, w):
      return triton.forward(x, w, None, kind=args.kind, eps=1e-6, out_dtype=x.dtype,
                            blocks=blocks)

    def bwd(blocks, x, dy, w, *stats):
      mean, rstd = (None, stats[0]) if len(stats) == 1 else stats
      return triton.backward(dy, x, w, mean, rstd, kind=args.kind, has_bias=False,
                             blocks=blocks)

    for direction, variants, fn, data, passes, default in (
        ("fwd", forward_variants(n), fwd, sets, 2, defaults[0]),
        ("bwd", backward_variants(n), bwd, bwd_sets, 3, defaults[1])):
      stride = max(1, len(variants) // args.limit)
      variants = list(dict.fromkeys([default] + variants[::stride]))
      for blocks in variants:
        try:
          ms = bench.time_ms(functools.partial(fn, blocks), data, min_seconds=0.15)
          rate = passes * pass_bytes / (ms * 1e-3) / 1e9
          line = dict(kind=args.kind, n=n, direction=direction, blocks=str(blocks),
                      default=blocks == default, ms=ms, gbps=rate, pct=100 * rate / copy)
        except Exception as e:  # noqa: BLE001
          line = dict(kind=args.kind, n=n, direction=direction, blocks=str(blocks),
                      error=f"{type(e).__name__}: {str(e)[:120]}")
        results.append(line)
        print(json.dumps(line), flush=True)
  print("\nbest per size and direction:")
  key = lambda r: (r["n"], r["direction"])
  for (n, d), group in itertools.groupby(sorted([r for r in results if "ms" in r], key=key),
                                         key=key):
    group = list(group)
    best = min(group, key=lambda r: r["ms"])
    default = next((r for r in group if r["default"]), None)
    print(f"N={n:<6} {d}: best {best['pct']:5.1f}% {best['blocks']}"
          + (f" | default {default['pct']:5.1f}%" if default else ""))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(bench.environment(), copy_gbps=copy, results=results), f, indent=1)


if __name__ == "__main__":
  main()
