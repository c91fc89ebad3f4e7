"""Running a per-shard kernel on sharded operands without gathering them.

XLA cannot see inside a Pallas or FFI kernel, so on its own it replicates a kernel's operands
(an all-gather of the whole activation) before the call. :func:`parallel_call` describes each
operand by one *factor* name per dimension, in the manner of an einsum, and says which factors
are *parallel*: computed independently shard by shard (batch rows, heads). Then

* with explicitly sharded operands (``jax.sharding.AxisType.Explicit``) the kernel runs under
  ``jax.shard_map`` with the operands' own shardings;
* otherwise it is a ``custom_partitioning`` op: under ``jit`` the partitioner keeps the parallel
  factors sharded as they come and runs the kernel on each shard.

An output that lacks a parallel factor of the inputs (a weight gradient summed over rows) is
summed across the shards of that factor with ``psum``. A non-parallel factor (the normalized
axis, a softmax axis) that arrives sharded is handled by ``sharded_whole_fn``, a per-shard
function that reduces across those mesh axes itself; an op without one raises ``ValueError``
rather than gather a large array behind the user's back.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

Dims = tuple[str, ...]


def parallel_call(op: str, local_fn: Callable, *args, in_dims: Sequence[Dims],
                  out_dims: Sequence[Dims], parallel: frozenset[str] | set[str],
                  sharded_whole_fn: Callable | None = None):
  """Calls ``local_fn(*args)`` shard by shard; returns a tuple of outputs.

  Args:
    op: public op name, for error messages.
    local_fn: per-shard computation returning a tuple of arrays laid out as ``out_dims``.
    args: arrays, laid out as ``in_dims``.
    in_dims, out_dims: one factor name per dimension of each argument / output. A factor is one
      logical axis: the same name in two places means the same size and the same sharding. Each
      factor takes its sharding from the first argument that has it.
    parallel: factors that may stay sharded.
    sharded_whole_fn: ``f(*local_args, axis_names=...)`` for when non-parallel factors are
      sharded over the mesh axes ``axis_names``; it must reduce over them itself.
  """
  in_dims, out_dims = tuple(map(tuple, in_dims)), tuple(map(tuple, out_dims))
  if jax.device_count() == 1:
    return tuple(local_fn(*args))
  plan = functools.partial(_Plan, op, in_dims, out_dims, frozenset(parallel), local_fn,
                           sharded_whole_fn)
  mesh = _explicit_mesh(args)
  if mesh is not None:
    p = plan([a.shape for a in args], [jax.typeof(a).sharding.spec for a in args])
    args = [a if jax.typeof(a).sharding.spec == spec
            else jax.sharding.reshard(a, NamedSharding(mesh, spec))
            for a, spec in zip(args, p.in_specs)]
    return tuple(jax.shard_map(p.per_shard, mesh=mesh, in_specs=tuple(p.in_specs),
                               out_specs=tuple(p.out_specs), check_vma=False)(*args))
  return tuple(_partitioned(plan, in_dims, out_dims)(*args))


class _Plan:
  """Per-shard layout for one set of operand shardings.

  A factor keeps the sharding it has on the largest operand that carries it (the first of
  equally large ones that is sharded along it): the activations decide, and a small operand laid
  out differently (a weight, a statistic) is the one moved.
  """

  def __init__(self, op, in_dims, out_dims, parallel, local_fn, sharded_whole_fn, shapes, specs):
    axes_of: dict[str, tuple[str, ...]] = {}
    sizes = [math.prod(shape) for shape in shapes]
    for factor in dict.fromkeys(f for dims in in_dims for f in dims):
      holders = [i for i, dims in enumerate(in_dims) if factor in dims]
      largest = max(sizes[i] for i in holders)
      axes_of[factor] = ()
      for i in holders:
        if sizes[i] == largest:
          entry = _entry(specs[i], in_dims[i].index(factor))
          if entry:
            axes_of[factor] = entry
            break
    self.whole_axes = tuple(a for f, axes in axes_of.items() if f not in parallel for a in axes)
    if self.whole_axes and sharded_whole_fn is None:
      sharded = {f: axes for f, axes in axes_of.items() if f not in parallel and axes}
      raise ValueError(f"{op}: the reduced axes of the input are sharded ({sharded}); shard only "
                       f"the leading (batch) axes, or replicate the reduced ones")
    used = [a for axes in axes_of.values() for a in axes]
    if len(used) != len(set(used)):
      raise ValueError(f"{op}: one mesh axis shards two different axes of the operands: {axes_of}")

    def spec(dims):
      # A factor only an output has (a kernel's saved intermediate) is whole on every shard.
      axes = [axes_of.get(f, ()) for f in dims]
      return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in axes))

    self.in_specs = [spec(d) for d in in_dims]
    self.out_specs = [spec(d) for d in out_dims]
    self.psum_axes = [tuple(a for f, axes in axes_of.items() if f in parallel and f not in dims
                            for a in axes) for dims in out_dims]
    self._local_fn = local_fn
    self._sharded_whole_fn = sharded_whole_fn

  def per_shard(self, *args):
    if self.whole_axes:
      outs = self._sharded_whole_fn(*args, axis_names=self.whole_axes)
    else:
      outs = self._local_fn(*args)
    return tuple(jax.lax.psum(o, axes) if axes else o for o, axes in zip(outs, self.psum_axes))


def _entry(spec, dim):
  entries = tuple(spec)
  entry = entries[dim] if dim < len(entries) else None
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def replicated_sharding(*arrays):
  """Where ``arrays`` are explicitly sharded, a replicated sharding on their mesh (the
  ``out_sharding`` of a product that contracts their sharded axes, such as a weight gradient
  over the batch); else None."""
  mesh = _explicit_mesh(arrays)
  return None if mesh is None else NamedSharding(mesh, PartitionSpec())


def explicit_sharding(a, spec_of: Callable[[tuple], tuple]):
  """Where ``a`` is explicitly sharded, the sharding ``spec_of(a's spec)`` on its mesh (the spec
  one entry per axis of ``a``): the ``out_sharding`` of a product whose output follows ``a``'s
  layout; else None."""
  mesh = _explicit_mesh([a])
  if mesh is None:
    return None
  spec = tuple(jax.typeof(a).sharding.spec)
  return NamedSharding(mesh, PartitionSpec(*spec_of(spec + (None,) * (a.ndim - len(spec)))))


def _explicit_mesh(args):
  """The abstract mesh of explicitly sharded operands, or None."""
  for a in args:
    sharding = getattr(jax.typeof(a), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()):
      continue
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    if explicit and any(e is not None for e in sharding.spec):
      return mesh
  return None


def _partitioned(plan, in_dims, out_dims):
  """A custom_partitioning op running ``plan(...).per_shard`` under the operands' shardings."""

  def specs_of(arg_shapes):
    specs = []
    for s in arg_shapes:
      sharding = s.sharding
      specs.append(sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec())
    return specs

  def run_unpartitioned(*args):
    return plan([a.shape for a in args], [PartitionSpec()] * len(args)).per_shard(*args)

  def shardings(mesh, specs):
    return tuple(NamedSharding(mesh, s) for s in specs)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return shardings(mesh, plan([s.shape for s in arg_shapes], specs_of(arg_shapes)).out_specs)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    p = plan([s.shape for s in arg_shapes], specs_of(arg_shapes))
    return mesh, p.per_shard, shardings(mesh, p.out_specs), shardings(mesh, p.in_specs)

  fn = custom_partitioning(run_unpartitioned)
  rule = f"{', '.join(' '.join(d) for d in in_dims)} -> {', '.join(' '.join(d) for d in out_dims)}"
  fn.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule)
  return fn
