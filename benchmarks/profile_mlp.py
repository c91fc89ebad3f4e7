"""GPU time per kernel of ``gelu_mlp``'s training step (bfloat16, 'xla'), as one program and in
the contexts a model gives it: where XLA's fusions put the forward's GELU.

    python benchmarks/profile_mlp.py [--top 12]

Timed as one program (the output and every gradient for a cotangent), XLA computes the
forward's activation in the backward's elementwise pass over the hidden layer; a model's step,
whose backward begins after its loss, pays a forward pass of its own. Prints, per context, the
kernels' microseconds per call, most first.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from profile_gpt import kernel_times  # noqa: E402

import jaxfuse  # noqa: E402


def _inputs(lead, width=768, hidden=3072, dtype=jnp.bfloat16):
  keys = jax.random.split(jax.random.key(0), 6)
  normal = lambda k, shape, scale=1.0: (jax.random.normal(k, shape) * scale).astype(dtype)
  return (normal(keys[0], (*lead, width)), normal(keys[1], (width, hidden), width ** -0.5),
          normal(keys[2], (hidden,), 0.1), normal(keys[3], (hidden, width), hidden ** -0.5),
          normal(keys[4], (width,), 0.1), normal(keys[5], (*lead, width)))


def _mlp(*params):
  return jaxfuse.gelu_mlp(*params, implementation="xla")


def output_and_gradients(x, w1, b1, w2, b2, dy):
  y, vjp = jax.vjp(_mlp, x, w1, b1, w2, b2)
  return (y,) + vjp(dy)


def output_then_gradients(x, w1, b1, w2, b2, dy):
  y, vjp = jax.vjp(_mlp, x, w1, b1, w2, b2)
  y, dy = jax.lax.optimization_barrier((y, dy))  # as the bench's step: a model's order
  return (y,) + vjp(dy)


def gradients_of_a_residual_block(x, w1, b1, w2, b2, dy):
  def loss(x, *params):
    h = jaxfuse.layer_norm(x, jnp.ones(x.shape[-1], x.dtype), jnp.zeros(x.shape[-1], x.dtype))
    return jnp.sum(((x + _mlp(h, *params)) * dy).astype(jnp.float32))
  return jax.grad(loss, (0, 1, 2, 3, 4))(x, w1, b1, w2, b2)


CONTEXTS = [("output and gradients, one program", output_and_gradients, (16384,)),
            ("output, then gradients", output_then_gradients, (16384,)),
            ("output and gradients, 3-D rows", output_and_gradients, (8, 2048)),
            ("gradients of a residual block", gradients_of_a_residual_block, (8, 2048))]


def main(argv):
  top = int(argv[argv.index("--top") + 1]) if "--top" in argv else 12
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
  for name, fn, lead in CONTEXTS:
    args, step = _inputs(lead), jax.jit(fn)
    times = kernel_times(lambda: jax.block_until_ready(step(*args)), calls=5)
    print(f"\n{name} {lead}: {sum(times.values()):8.1f} us of kernels")
    for kernel, us in sorted(times.items(), key=lambda t: -t[1])[:top]:
      print(f"    {us:8.1f}  {kernel[:100]}")


if __name__ == "__main__":
  main(sys.argv[1:])
