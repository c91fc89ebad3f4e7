"""Software pipelining for Pallas (Triton) kernels that walk a row in register tiles."""

from __future__ import annotations

from jax import lax


def pipelined_loop(n, load, body, init):
  """``body(i, load(i), carry)`` for ``i < n``, issuing ``load(i + 1)`` before ``body(i)``.

  A warp issues instructions in order, so a plain loop waits for tile ``i``'s loads only after
  reducing tile ``i - 1``. Loading one tile ahead keeps a tile's memory requests in flight
  while the previous one is reduced: the register-level equivalent of double buffering.
  ``load(n)`` must be fully masked; its values are never used.
  """
  def step(i, state):
    carry, loaded = state
    ahead = load(i + 1)
    return body(i, loaded, carry), ahead
  return lax.fori_loop(0, n, step, (init, load(0)))[0]
