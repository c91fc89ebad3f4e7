"""The op layer: how a jaxfuse function picks its implementations, gets its derivatives and
is batched.

A call's :class:`Plan` names the implementation for each use: only evaluated, the forward of a
differentiated call, and its backward. A named implementation runs every use; ``None`` may find
a different fastest one for each (cuDNN attention for inference and Mosaic's for training, a
norm's Triton forward beside XLA's backward where CUDA's kernels cannot take the row), by the
family's measurements (its tuned tables, see :func:`timed_as`).

Every fused op differentiates through a VJP of its own (the kernels' backward, residuals it
chooses), built here from a primal, a forward and a backward, and kernel calls that JAX cannot
batch by itself take a vmap rule of the family's, declared here too, so that how a custom
derivative or batching rule is declared is written once for every family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
from jax.custom_batching import custom_vmap

from jaxfuse._core import registry

USES = ("evaluated", "forward", "backward")


def timed_as(use: str) -> str:
  """What a use is chosen by: an evaluated call by the forward's time, both directions of a
  differentiated call by the whole training step's (a forward and a backward chosen apart
  were never timed together)."""
  return "forward" if use == "evaluated" else "step"


@dataclasses.dataclass(frozen=True)
class Plan:
  """The implementations of one call, per use (see :data:`USES`). A forward saves what its
  plan's backward reads."""
  evaluated: str
  forward: str
  backward: str

  def __contains__(self, name: str) -> bool:
    return name in (self.evaluated, self.forward, self.backward)


def resolve_plan(op: str, implementation: str | None,
                 backends: Mapping[str, registry.Availability], preference: Sequence[str],
                 fastest: Callable[[str], str] | None = None, *, empty: bool = False) -> Plan:
  """Validates ``implementation`` for ``op`` (see :func:`registry.resolve`) and plans the call:
  the named implementation for every use; for ``None`` the first of ``preference`` that runs,
  or on a GPU ``fastest(use)`` per use where the family measured one. ``empty``: the call has
  no rows or no outputs, which XLA's reference gives as defined and a kernel would launch no
  grid for: every use takes 'xla' once a named implementation is validated."""
  if empty:
    registry.resolve(op, implementation, backends, preference)
    chosen = Plan("xla", "xla", "xla")
  elif implementation is None and fastest is not None and registry.platform() == "gpu":
    chosen = Plan(*(fastest(use) for use in USES))
  else:
    impl = registry.resolve(op, implementation, backends, preference)
    chosen = Plan(impl, impl, impl)
  if "triton" in chosen:
    registry.using_triton(named=implementation == "triton")
  registry.logger.debug("%s(implementation=%r) runs %s", op, implementation, chosen)
  registry.record("plan", op, implementation, chosen)
  return chosen


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
  function.defvjp(_differentiated_again(forward, tuple(static)),
                  _differentiated_again(backward, tuple(range(len(static)))))
  return function


def _differentiated_again(fn: Callable, static: tuple[int, ...]) -> Callable:
  """``fn``, whose own derivative (a second-order gradient differentiates a VJP's forward and
  backward) is JAX's where its calls have one, as an XLA implementation's do, and otherwise a
  ``NotImplementedError`` that says so, where JAX would fail inside a kernel call's
  differentiation with a bare assertion."""
  static = tuple(sorted(static))
  function = jax.custom_jvp(fn, nondiff_argnums=static)

  def derivative(*args):
    *config, primals, tangents = args

    def call(*arrays):
      arguments = list(arrays)
      for position, value in zip(static, config):  # ascending: each lands where it was
        arguments.insert(position, value)
      return fn(*arguments)

    # The call traced once already, so what fails here is JAX's differentiation of a kernel:
    # Pallas's assertion, an FFI call's ValueError, a primitive's missing rule, a custom_vjp's
    # TypeError.
    try:
      return jax.jvp(call, primals, tangents)
    except (AssertionError, NotImplementedError, TypeError, ValueError) as error:
      raise NotImplementedError(
          "jaxfuse: this call is differentiable once: its gradient runs kernels or sharding "
          "rules of its own, which JAX cannot differentiate again (implementation='xla' takes "
          "second derivatives of the norms, softmaxes, attention, the MLP and the recurrent "
          "layers)") from error

  function.defjvp(derivative)
  return function


def by_use(implementation: Callable, *, static: int, differentiated: int) -> Callable:
  """``f(*config, plan, *arrays)``: ``implementation(*config, plan.evaluated, *arrays)`` where
  the call is only evaluated, and ``implementation(*config, plan.forward, *arrays)`` with that
  implementation's own derivatives where it is differentiated, so a family runs its fastest
  for inference and for training where they differ. ``config``: the first ``static``
  arguments, hashable; gradients flow to the first ``differentiated`` of ``arrays``, and the
  rest take none."""

  def evaluated(*args):
    return implementation(*args[:static], args[static].evaluated, *args[static + 1:])

  def forward(*args):
    config, plan, arrays = args[:static], args[static], args[static + 1:]
    inputs, rest = arrays[:differentiated], arrays[differentiated:]
    run = lambda *inputs: implementation(*config, plan.forward, *inputs, *rest)
    out, pullback = jax.vjp(run, *inputs)  # the pullback holds the residuals
    return out, (pullback, (None,) * len(rest))

  def backward(*args):
    (pullback, none), cotangents = args[-2:]
    return pullback(cotangents) + none

  return differentiable(evaluated, forward, backward, static=range(static + 1))


def vmappable(fn: Callable, rule: Callable) -> Callable:
  """``fn`` batched by ``rule(axis_size, in_batched, *args)``, which returns the outputs and
  which of them are mapped; JAX hands it every mapped operand with the mapped axis first."""
  function = custom_vmap(fn)
  function.def_vmap(rule)
  return function
