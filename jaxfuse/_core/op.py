"""The op layer: where jaxfuse's functions get their derivatives.

Every fused op differentiates through a VJP of its own (the kernels' backward, residuals it
chooses), built here from a primal, a forward and a backward, so that how a custom derivative
is declared is written once for every family.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax


def differentiable(primal: Callable, forward: Callable, backward: Callable, *,
                   static: Sequence[int]) -> Callable:
  """``primal`` differentiated by ``forward`` and ``backward``.

  ``forward(*args)`` returns ``primal(*args)``'s outputs and the residuals, possibly by other
  kernels than ``primal`` uses (a call only evaluated may take the fastest inference kernel);
  ``backward(*static_args, residuals, cotangents)`` returns a gradient, or None, for each
  argument not in ``static``. ``static``: the positions of hashable arguments that take no
  gradient (the call's static configuration).
  """
  function = jax.custom_vjp(primal, nondiff_argnums=tuple(static))
  function.defvjp(forward, backward)
  return function
