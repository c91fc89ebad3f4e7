"""Batch sharding over every GPU of one host: no all-gather, results equal to one device.

    PYTHONPATH=. python benchmarks/multi_gpu_check.py

The CPU tests check the same on eight fake devices; this runs the compiled kernels (Triton,
CUDA and the ``None`` choice) on real ones, under automatic and explicit sharding.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfuse


def _cases(rng):
  def layer_norm_step(impl):
    def step(x, w, b, dy):
      y, vjp = jax.vjp(lambda *a: jaxfuse.layer_norm(*a, implementation=impl), x, w, b)
      return (y,) + vjp(dy)
    return step

  def softmax_step(impl):
    def step(x, dy):
      y, vjp = jax.vjp(lambda x: jaxfuse.softmax(x, implementation=impl), x)
      return (y,) + vjp(dy)
    return step

  def cross_entropy_step(impl):
    def step(logits, labels):
      loss = lambda l: jaxfuse.softmax_cross_entropy(l, labels, implementation=impl)
      return jax.value_and_grad(loss)(logits)
    return step

  def attention_step(impl):
    def step(q, k, v, segments, do):
      fn = lambda q, k, v: jaxfuse.attention(q, k, v, is_causal=True, segment_ids=segments,
                                             implementation=impl)
      o, vjp = jax.vjp(fn, q, k, v)
      return (o,) + vjp(do)
    return step

  def linear_cross_entropy_step(impl):
    def step(x, weight, labels):
      loss = lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels, implementation=impl)
      return jax.value_and_grad(loss, argnums=(0, 1))(x, weight)
    return step

  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  for impl in ("triton", "cuda", None):
    for n in (4096, 32768):
      args = (normal(8, 64, n), 1 + 0.1 * normal(n), 0.1 * normal(n), normal(8, 64, n))
      yield (f"layer_norm {impl} n={n}", layer_norm_step(impl), args,
             (P("d"), P(), P(), P("d")))
  for impl in ("triton", None):
    yield (f"softmax {impl}", softmax_step(impl), (normal(8, 128, 8192), normal(8, 128, 8192)),
           (P("d"), P("d")))
    labels = jnp.asarray(rng.integers(0, 32768, (1024,)), jnp.int32)
    yield (f"cross_entropy {impl}", cross_entropy_step(impl), (normal(1024, 32768), labels),
           (P("d"), P("d")))
  # Two documents per row: the segments travel with their rows.
  segments = jnp.asarray(np.arange(1024) >= rng.integers(1, 1024, (8, 1)), jnp.int32)
  for impl in ("triton", "mosaic", None):
    qkv = [normal(8, 1024, 8, 128) for _ in range(4)]
    yield (f"attention {impl}", attention_step(impl), (*qkv[:3], segments, qkv[3]),
           (P("d"), P("d"), P("d"), P("d"), P("d")))
  for impl in ("cuda", None):
    labels = jnp.asarray(rng.integers(0, 50257, (8192,)), jnp.int32)
    yield (f"linear_cross_entropy {impl}", linear_cross_entropy_step(impl),
           (normal(8192, 768), 0.05 * normal(768, 50257), labels), (P("d"), P(), P("d")))


def _max_relative_difference(actual, expected):
  worst = 0.0
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
    worst = max(worst, float(np.max(np.abs(a - e)) / (np.max(np.abs(e)) + 1e-30)))
  return worst


def main() -> int:
  print(jax.devices(), flush=True)
  rng = np.random.default_rng(0)
  failures = 0
  for axis_type in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(axis_type,))
    for label, step, args, specs in _cases(rng):
      single = jax.jit(step)(*args)
      sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
      compiled = jax.jit(step).lower(*sharded).compile()
      hlo = compiled.as_text()
      gathers = "all-gather" in hlo or "all-to-all" in hlo
      # Weight gradients are summed over the shards in another order: bf16 rounding differs.
      difference = _max_relative_difference(compiled(*sharded), single)
      ok = not gathers and difference < 2e-2
      failures += not ok
      print(f"{axis_type} {label:28s} all-gather={gathers} max relative difference vs one "
            f"device {difference:.2e} {'ok' if ok else 'FAIL'}", flush=True)
  print("failures:", failures)
  return int(failures > 0)


if __name__ == "__main__":
  sys.exit(main())
