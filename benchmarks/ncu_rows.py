"""Runs row-wise calls twice per implementation, for Nsight Compute to read their kernels
(registers, occupancy, DRAM throughput: what a time alone does not say).

    ncu -k regex:'norm|softmax|cross_entropy' --section SpeedOfLight --section Occupancy \\
        --section LaunchStats -c 40 \\
        python benchmarks/ncu_rows.py rms_norm:16384x256 softmax:64x2048x2048:causal \\
        [--impl cuda,triton] [--grad] [--dtype bfloat16] [--param-dtype float32]

A call is ``op:shape[:causal]`` with op one of ``OPS``; ``--grad`` runs the training step (value
and gradients of the output's sum, parameters included) instead of the forward. Each call runs
twice, so a kernel's first launch (``-c`` counts launches) may be skipped with ``--launch-skip``.
``--param-dtype`` gives the norms' parameters a dtype of their own (float32 beside bfloat16 x
promotes the output to float32, as jnp does).
"""

import sys

import jax
import jax.numpy as jnp

import jaxfuse

OPS = ("rms_norm", "layer_norm", "softmax", "log_softmax", "softmax_cross_entropy")


def function(op, shape, dtype, causal, impl, param_dtype):
  """``(fn, args)`` of one call: the op over random inputs of ``shape`` and ``dtype``."""
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], shape, dtype)
  if op in ("rms_norm", "layer_norm"):
    w = jax.random.normal(keys[1], shape[-1:], param_dtype)
    extra = (w, w) if op == "layer_norm" else (w,)
    return lambda x, *p: getattr(jaxfuse, op)(x, *p, implementation=impl), (x, *extra)
  if op == "softmax_cross_entropy":
    labels = jax.random.randint(keys[2], shape[:-1], 0, shape[-1])
    return (lambda x: jaxfuse.softmax_cross_entropy(x, labels, implementation=impl)), (x,)
  return (lambda x: getattr(jaxfuse, op)(x, is_causal=causal, implementation=impl)), (x,)


def main(argv):
  flags = {a: argv[i + 1] for i, a in enumerate(argv)
           if a in ("--impl", "--dtype", "--param-dtype")}
  dtype = jnp.dtype(flags.get("--dtype", "bfloat16"))
  param_dtype = jnp.dtype(flags.get("--param-dtype", dtype))
  impls = flags.get("--impl", "cuda,triton").split(",")
  grad = "--grad" in argv
  calls = [a for i, a in enumerate(argv) if ":" in a and argv[i - 1] not in flags]
  for call in calls:
    op, shape, *rest = call.split(":")
    if op not in OPS:
      raise SystemExit(f"unknown op {op!r}: one of {', '.join(OPS)}")
    shape = tuple(int(d) for d in shape.split("x"))
    for impl in impls:
      fn, args = function(op, shape, dtype, rest == ["causal"], impl, param_dtype)
      loss = lambda *a, fn=fn: jnp.sum(fn(*a).astype(jnp.float32))
      run = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))) if grad else fn)
      for _ in range(2):
        jax.block_until_ready(run(*args))
      print(f"{call} {impl}: ran", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
