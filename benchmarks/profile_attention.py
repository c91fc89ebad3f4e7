"""GPU time per kernel of one attention training step (forward and gradients), per
implementation: which pass a step's time goes to.

    python benchmarks/profile_attention.py [--impl mosaic,cudnn] [--only TEXT ...]

The calls are ``jaxfuse bench attention``'s at (4, 4096, 16, 128), plain and masked; an
implementation that refuses a call is reported and skipped.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from profile_gpt import kernel_times  # noqa: E402

import jaxfuse  # noqa: E402
from jaxfuse.ops.attention import bench as attention_bench  # noqa: E402


def calls(b=4, t=4096, n=16, h=128):
  """``(label, attention keyword arguments)``: full, causal and ``MASKED``'s 4096-token calls."""
  yield "full", {}
  yield "causal", dict(is_causal=True)
  for name, length, kw, documents, ragged in attention_bench.MASKED:
    if length == t:
      yield name, attention_bench.masked_kwargs(b, t, kw, documents, ragged)


def main(argv):
  impls = (argv[argv.index("--impl") + 1].split(",") if "--impl" in argv
           else ["mosaic", "cudnn"])
  only = [argv[i + 1] for i, a in enumerate(argv) if a == "--only"]
  b, t, n, h = 4, 4096, 16, 128
  q, k, v, do = (jax.random.normal(key, (b, t, n, h), jnp.bfloat16)
                 for key in jax.random.split(jax.random.key(0), 4))
  for label, kw in calls(b, t, n, h):
    if only and not any(o in label for o in only):
      continue
    for impl in impls:
      def step(q, k, v, do, kw=kw, impl=impl):
        out, vjp = jax.vjp(lambda *a: jaxfuse.attention(*a, implementation=impl, **kw), q, k, v)
        return (out,) + vjp(do)

      try:
        compiled = jax.jit(step).lower(q, k, v, do).compile()
      except (NotImplementedError, ValueError) as e:
        print(f"\n## {b}x{t}x{n}x{h} {label} {impl}: refused ({str(e)[:100]})")
        continue
      totals = kernel_times(lambda: jax.block_until_ready(compiled(q, k, v, do)))
      print(f"\n## {b}x{t}x{n}x{h} {label} {impl}: {sum(totals.values()):.1f} us of kernels")
      for name, us in totals.most_common(8):
        print(f"{us:10.1f} us  {name[:90]}")


if __name__ == "__main__":
  main(sys.argv[1:])
