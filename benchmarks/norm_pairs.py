"""Training-step time of the norms with each pairing of a forward and a backward implementation
forced: which direction of a step a slower pair loses its time in (``None`` may pair any
forward with any backward, as both share the saved statistics).

    XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 python benchmarks/norm_pairs.py 256,1024 \\
        [--pairs tt,cc,tc,ct] [--param-dtype float32] [--rows 16384]

A pair is two letters, forward then backward: t 'triton', c 'cuda', x 'xla'. Prints a JSON line
per (norm, features, pair): the step's GPU span and busy time in microseconds, its kernels, and
the largest difference of its outputs from the first pair's (a forced plan that ran wrong shows).
"""

import argparse
import itertools
import json

import jax
import jax.numpy as jnp

from jaxfuse._core import op, timing
from jaxfuse.ops.norm import api

NAMES = {"t": "triton", "c": "cuda", "x": "xla"}
ALL_PAIRS = "tt,cc,xc,tc,ct,xx,xt"


def forcing_plans():
  """A setter of the plan every norm call takes from then on (None: the library's own)."""
  library_plan, forced = api._plan, {}

  def plan(*args, **kwargs):
    return forced["plan"] if forced else library_plan(*args, **kwargs)

  api._plan = plan
  return lambda p: forced.update(plan=p) if p else forced.clear()


def input_sets(rows, n, param_dtype, count=4):
  sets = []
  for i in range(count):
    kx, kw, kd = jax.random.split(jax.random.key(i), 3)
    x = jax.random.normal(kx, (rows, n), jnp.bfloat16)
    w = 1 + 0.1 * jax.random.normal(kw, (n,), param_dtype)
    dy = jax.random.normal(kd, (rows, n), jnp.result_type(jnp.bfloat16, param_dtype))
    sets.append((x, w, dy))
  return sets


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("sizes")
  parser.add_argument("--pairs", default=ALL_PAIRS)
  parser.add_argument("--param-dtype", default="bfloat16")
  parser.add_argument("--rows", type=int, default=16384)
  args = parser.parse_args()
  force = forcing_plans()
  param_dtype = jnp.dtype(args.param_dtype)
  for kind, n in itertools.product(("rms", "layer"), map(int, args.sizes.split(","))):
    norm = api.rms_norm if kind == "rms" else api.layer_norm
    sets, first = input_sets(args.rows, n, param_dtype), None
    for pair in args.pairs.split(","):
      forward, backward = NAMES[pair[0]], NAMES[pair[1]]
      force(op.Plan(forward, forward, backward))

      def step(x, w, dy):
        y, vjp = jax.vjp(norm, *((x, w, w) if kind == "layer" else (x, w)))
        return (y,) + vjp(dy)

      t, outputs = timing.measure(jax.jit(step), sets)
      first = first or outputs
      difference = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                       for a, b in zip(outputs, first))
      print(json.dumps(dict(kind=kind, n=n, params=param_dtype.name, forward=forward,
                            backward=backward, us=round(t.span_ms * 1e3, 2),
                            busy=round(t.busy_ms * 1e3, 2), kernels=t.kernels,
                            maxdiff=difference)), flush=True)
      force(None)


if __name__ == "__main__":
  main()
