"""``jaxfuse.explain``: what ``implementation=None`` runs for a call on this device, and why."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from jaxfuse._core import registry


@dataclasses.dataclass(frozen=True)
class Choice:
  """One jaxfuse op of an explained call: the implementation asked for, what runs for each
  use (only evaluated, the forward of a differentiated call, its backward) and each
  implementation passed over because it cannot run here, with the reason. An implementation
  neither run nor passed over runs here but is slower for this call (by the GPU's tuned table)
  or later in the op's order."""
  op: str
  implementation: str | None
  evaluated: str
  forward: str
  backward: str
  passed_over: dict[str, str]

  def __str__(self) -> str:
    uses = (f"evaluated {self.evaluated}, forward {self.forward}, backward {self.backward}"
            if len({self.evaluated, self.forward, self.backward}) > 1 else self.evaluated)
    lines = [f"{self.op}(implementation={self.implementation!r}): {uses}"]
    lines += [f"  passed over {name!r}: {reason}" for name, reason in self.passed_over.items()]
    return "\n".join(lines)


def explain(fn: Callable, *args, **kwargs) -> list[Choice]:
  """What ``fn(*args, **kwargs)`` runs on this device, for each jaxfuse op it calls.

  ``fn`` is a jaxfuse op or any function that calls them; ``args`` are arrays or
  ``jax.ShapeDtypeStruct``s. The call is only traced (``jax.eval_shape``): nothing runs. The
  choices are printed and returned; the ``jaxfuse`` logger tells each at DEBUG as ops resolve.

  Example::

      jaxfuse.explain(jaxfuse.rms_norm, jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16),
                      jax.ShapeDtypeStruct((4096,), jnp.bfloat16))
  """
  with registry.recording() as events:
    jax.eval_shape(lambda *a: fn(*a, **kwargs), *args)
  choices, reasons = [], {}
  for kind, op, *rest in events:
    if kind == "passed over":
      name, reason = rest
      reasons.setdefault(op, {})[name] = reason
    else:
      implementation, plan = rest
      choices.append(Choice(op, implementation, plan.evaluated, plan.forward, plan.backward,
                            reasons.pop(op, {})))
  for choice in choices:
    print(choice)
  return choices
