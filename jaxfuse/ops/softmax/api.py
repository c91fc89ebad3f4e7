"""``softmax``, ``log_softmax`` and ``softmax_cross_entropy``: validation, dispatch, VJPs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._core import op, registry, tuned
from jaxfuse._core.batching import fold_into_batch
from jaxfuse._core.op import resolve_plan, timed_as
from jaxfuse._core.sharding import parallel_call
from jaxfuse._core.validation import (check_array, compute_dtype, counted_labels,
                                      cross_entropy_options, describe, int32_labels,
                                      poison_stray_rows, reduction_scale, static_bool,
                                      static_float, static_int)
from jaxfuse.ops.softmax import cuda as cuda_kernels
from jaxfuse.ops.softmax import reference, triton

_BACKENDS = {"xla": registry.xla_available, "triton": registry.triton_unavailable,
             "cuda": cuda_kernels.unavailable}
_KERNELS = {"triton": triton, "cuda": cuda_kernels}


def _preference():
  return ("xla",) if registry.platform() == "cpu" else ("triton", "xla")


def _untuned() -> dict:
  # A GPU never measured: Triton for the rows it holds in registers (one tile), the CUDA
  # kernels, which hold a row on chip in a thread-block cluster, for the longer rows a Pallas
  # program walks twice; without Triton they are weighed against XLA's fusions, which hold
  # short rows well and long ones badly.
  return {"cuda_from_forward": 32768, "cuda_from_step": 16384,
          "cuda_from_cross_entropy": None, "cuda_from_cross_entropy_loss": None,
          **{f"cuda_from_{row}_without_triton": 16384
             for row in ("forward", "step", "cross_entropy", "cross_entropy_loss")},
          "rules": []}


def _fastest(op: str, use: str, row: str, n: int, x, cuda_refusal, extents,
             plain: bool = True, causal: bool = False) -> str:
  """The fastest implementation for ``use`` (see :data:`op.USES`) by this GPU's tuned table
  (``jaxfuse/ops/softmax/tuned/``): its ``rules``, measured exceptions matched on the call's
  facts, else 'cuda' for rows it can take from the length the table's ``cuda_from_<row>``
  gives (``cuda_from_<row>_without_triton`` where Triton is gone; ``None``: never), else
  'triton' where it runs, else 'xla'. ``n`` is the row length, ``x`` the array whose rows are
  normalized, ``cuda_refusal()`` says why the CUDA kernels cannot take the call, ``extents``
  is the array as the Triton kernels view it, ``plain`` says the rows are the last axis,
  without a mask, and ``causal`` that they are causal scores."""
  triton_runs = registry.runs(
      op, "triton", lambda: registry.triton_unavailable() or triton.unsupported(extents))
  cuda_takes = cuda_refusal() is None
  cuda_runs = lambda: cuda_takes and registry.runs(op, "cuda", cuda_kernels.unavailable)
  table = tuned.rows("softmax", _untuned)
  facts = dict(op=op, use=use, direction="backward" if use == "backward" else "forward",
               length=n, elements=x.size, plain=plain, itemsize=jnp.dtype(x.dtype).itemsize,
               causal=causal, cuda_takes=cuda_takes, triton=triton_runs)
  runs = {"cuda": cuda_runs, "triton": lambda: triton_runs, "xla": lambda: True}
  if chosen := tuned.ruled(table["rules"], facts, lambda name: runs[name]()):
    return chosen
  cuda_from = table[f"cuda_from_{row}" + ("" if triton_runs else "_without_triton")]
  if cuda_from is not None and n >= cuda_from and cuda_runs():
    return "cuda"
  return "triton" if triton_runs else "xla"


def softmax(x, axis: int = -1, *, scale: float = 1.0, mask=None, is_causal: bool = False,
            causal_offset: int = 0, implementation: str | None = None):
  """Softmax of ``scale * x`` along ``axis``, optionally masked.

  Args:
    x: float16, bfloat16, float32 or float64 array of any shape.
    axis: the axis to normalize (any; an inner axis is read in place, not transposed).
    scale: multiplies ``x`` first (a Python float, e.g. ``1 / sqrt(head_dim)``).
    mask: boolean array broadcastable to ``x``; True keeps a logit, False removes it.
    is_causal: mask the last two axes of ``x`` as (query i, key j), keeping
      ``j <= i + causal_offset``. Offset 0 is ``jax.nn``'s alignment; ``S - T`` aligns the
      queries with the last T of S keys (decoding with a cache).
    causal_offset: see ``is_causal``.
    implementation: ``'xla'``, ``'triton'``, ``'cuda'`` (CUDA kernels built with nvcc on first
      use, for Hopper GPUs: the last axis, {cuda_limits}) or ``None`` (fastest available
      here).

  Returns:
    An array like ``x``. A fully masked row is all zeros and has zero gradient. Accumulation
    is in float32 (float64 for float64 inputs).
  """
  return _softmax_entry("softmax", False, x, axis, scale, mask, is_causal, causal_offset,
                        implementation)


def log_softmax(x, axis: int = -1, *, scale: float = 1.0, mask=None, is_causal: bool = False,
                causal_offset: int = 0, implementation: str | None = None):
  """Log-softmax of ``scale * x`` along ``axis``; arguments as :func:`softmax`.

  Masked entries are ``-inf``; a fully masked row is all ``-inf`` with zero gradient.
  """
  return _softmax_entry("log_softmax", True, x, axis, scale, mask, is_causal, causal_offset,
                        implementation)


@dataclasses.dataclass(frozen=True)
class _SoftmaxStatic:
  op: str
  log: bool
  layout: triton.Layout
  scale: float
  plan: op.Plan

  @property
  def causal_offset(self) -> int | None:
    """The causal mask's offset, None without one (as the CUDA kernels take it)."""
    return self.layout.causal_offset if self.layout.causal else None


def _softmax_entry(op, log, x, axis, scale, mask, is_causal, causal_offset, implementation):
  x = check_array(op, "x", x)
  if x.ndim == 0:
    raise ValueError(f"{op}: x must have at least one axis, got {describe(x)}")
  axis = static_int(op, "axis", axis)
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"{op}: axis {axis} is out of range for x {describe(x)}")
  axis %= x.ndim
  scale = static_float(op, "scale", scale)
  causal_offset = static_int(op, "causal_offset", causal_offset)
  is_causal = static_bool(op, "is_causal", is_causal)
  if is_causal and x.ndim < 2:
    raise ValueError(f"{op}: is_causal needs the last two axes (query, key); x is {describe(x)}")
  if causal_offset and not is_causal:
    raise ValueError(f"{op}: causal_offset={causal_offset} applies to is_causal=True; alone it "
                     f"does nothing")
  if is_causal:
    # The mask compares j - i, in [1 - T, S - 1], with the offset: clamped to [-T, S] it masks
    # the same and stays far from the kernels' int32 overflow (and one compilation per mask).
    causal_offset = min(max(causal_offset, -x.shape[-2]), x.shape[-1])
  strides = None
  if mask is not None:
    mask = check_array(op, "mask", mask, floating=False)
    if mask.dtype != jnp.bool_:
      raise TypeError(f"{op}: mask must be boolean (True = keep), got {describe(mask)}")
    try:
      np.broadcast_shapes(mask.shape, x.shape)
      ok = np.broadcast_shapes(mask.shape, x.shape) == x.shape
    except ValueError:
      ok = False
    if not ok:
      raise ValueError(f"{op}: mask {describe(mask)} does not broadcast to x {describe(x)}")
    mask = mask.reshape((1,) * (x.ndim - mask.ndim) + mask.shape)
    dense = np.cumprod((1,) + mask.shape[:0:-1])[::-1]
    strides = tuple(int(s) if m > 1 else 0 for s, m in zip(dense, mask.shape))
  layout = triton.Layout(tuple(x.shape), axis, strides, bool(is_causal), causal_offset)
  def cuda_refusal(directions=("forward", "backward")):
    if axis != x.ndim - 1:
      return "the 'cuda' kernels take the softmax over the last axis"
    if is_causal and x.shape[-2] > cuda_kernels.MAX_CAUSAL_QUERIES:
      return (f"the 'cuda' kernels walk causal rows in 32 bits, up to "
              f"{cuda_kernels.MAX_CAUSAL_QUERIES} queries, not {x.shape[-2]}")
    return cuda_kernels.unsupported(x.shape[-1], x.dtype, directions=directions)

  def fastest(use):
    direction = "backward" if use == "backward" else "forward"
    plain = axis == x.ndim - 1 and mask is None and not is_causal
    return _fastest(op, use, timed_as(use), x.shape[axis], x,
                    lambda: cuda_refusal((direction,)), (layout.pre, layout.n, layout.post),
                    plain, bool(is_causal))

  plan = resolve_plan(op, implementation, _BACKENDS, _preference(), fastest)
  if implementation == "cuda" and (reason := cuda_refusal()):
    raise NotImplementedError(f"{op}(implementation='cuda') cannot take x {describe(x)} over "
                              f"axis {axis}: {reason}")
  st = _SoftmaxStatic(op, log, layout, scale, plan)
  return _softmax_jit(x, mask, st)


def _softmax(x, mask, st):
  return _softmax_forward(x, mask, st, st.plan.evaluated)


def _softmax_fwd(x, mask, st):
  y = _softmax_forward(x, mask, st, st.plan.forward)
  return y, y


def _softmax_bwd(st, y, dy):
  if st.plan.backward == "xla" or y.size == 0:
    dx = reference.softmax_backward(y, dy, axis=st.layout.axis, scale=st.scale, log=st.log)
  else:
    dx = _softmax_kernels(st, st.plan.backward).backward(y, dy)
  return dx, None


_softmax = op.differentiable(_softmax, _softmax_fwd, _softmax_bwd, static=(2,))
_softmax_jit = jax.jit(_softmax, static_argnums=(2,))


def _softmax_forward(x, mask, st, impl):
  if impl == "xla" or x.size == 0:
    layout = st.layout
    keep = reference.keep_mask(x.shape, layout.axis, mask, layout.causal, layout.causal_offset)
    return reference.softmax_forward(x, keep, axis=layout.axis, scale=st.scale, log=st.log)
  return _softmax_kernels(st, impl).forward(x, mask)


class _SoftmaxKernels:
  """One implementation's kernels (Triton or CUDA) for one static configuration: sharding
  over the non-softmax axes, vmap."""

  def __init__(self, st, impl):
    self.st, self.impl = st, impl
    self.forward = op.vmappable(self._sharded_forward, self._forward_rule)
    self.backward = op.vmappable(self._sharded_backward, self._backward_rule)

  def _dims(self, ndim):
    axis = self.st.layout.axis
    dims = tuple(f"a{i}" for i in range(ndim))
    # With a causal mask the query axis is part of the pattern: keep it whole as well.
    whole = {axis} | ({ndim - 2} if self.st.layout.causal else set())
    return dims, {d for i, d in enumerate(dims) if i not in whole}

  def _sharded_forward(self, x, mask):
    st = self.st
    dims, parallel = self._dims(x.ndim)
    if mask is None:
      args, in_dims = [x], [dims]
    else:
      # A broadcast mask dimension is its own factor: it is never sharded.
      mask_dims = tuple(d if m > 1 else f"m{i}" for i, (d, m) in enumerate(zip(dims, mask.shape)))
      args, in_dims = [x, mask], [dims, mask_dims]

    def local(x, *mask):
      if self.impl == "cuda":
        return (cuda_kernels.softmax_forward(x, scale=st.scale, log=st.log,
                                             causal_offset=st.causal_offset,
                                             mask=mask[0] if mask else None),)
      layout = dataclasses.replace(st.layout, shape=tuple(x.shape))
      flat = None
      if mask:
        m = mask[0]
        dense = np.cumprod((1,) + m.shape[:0:-1])[::-1]
        layout = dataclasses.replace(layout, mask_strides=tuple(
            int(s) if size > 1 else 0 for s, size in zip(dense, m.shape)))
        flat = m.reshape(-1).astype(jnp.int8)
      return (triton.softmax_forward(x, flat, layout, scale=st.scale, log=st.log),)

    return parallel_call(st.op, local, *args, in_dims=in_dims, out_dims=[dims],
                         parallel=parallel)[0]

  def _sharded_backward(self, y, dy):
    st = self.st
    dims, parallel = self._dims(y.ndim)

    def local(y, dy):
      if self.impl == "cuda":
        return (cuda_kernels.softmax_backward(y, dy, scale=st.scale, log=st.log,
                                              causal_offset=st.causal_offset),)
      layout = dataclasses.replace(st.layout, shape=tuple(y.shape), mask_strides=None)
      return (triton.softmax_backward(y, dy, layout, scale=st.scale, log=st.log),)

    return parallel_call(st.op, local, y, dy, in_dims=[dims, dims], out_dims=[dims],
                         parallel=parallel)[0]

  # vmap adds a leading axis: move the softmax axis along with it.
  def _shifted(self):
    layout = self.st.layout
    return _softmax_kernels(dataclasses.replace(self.st, layout=dataclasses.replace(
        layout, shape=(0,) + layout.shape, axis=layout.axis + 1,
        mask_strides=None if layout.mask_strides is None else (0,) + layout.mask_strides)),
        self.impl)

  def _forward_rule(self, axis_size, in_batched, x, mask):
    if not in_batched[0]:
      x = jnp.broadcast_to(x, (axis_size,) + x.shape)
    if mask is not None and not in_batched[1]:
      mask = mask[None]
    return self._shifted().forward(x, mask), True

  def _backward_rule(self, axis_size, in_batched, y, dy):
    y, dy = (a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
             for a, b in zip((y, dy), in_batched))
    return self._shifted().backward(y, dy), True


@functools.cache
def _softmax_kernels(st, impl) -> _SoftmaxKernels:
  return _SoftmaxKernels(st, impl)


# --------------------------------------------------------------------------- cross-entropy


def softmax_cross_entropy(logits, labels, *, ignore_index: int | None = None,
                          label_smoothing: float = 0.0, z_loss: float = 0.0,
                          reduction: str = "mean", implementation: str | None = None):
  """Cross-entropy between ``softmax(logits)`` and integer labels, without materializing the
  probabilities.

  Per row, with ``lse = logsumexp(logits)`` over the last axis and ``V`` classes::

      loss = lse - (1 - label_smoothing) * logits[label]
             - label_smoothing * mean(logits) + z_loss * lse**2

  i.e. the cross-entropy against the smoothed target ``(1 - s) * onehot + s / V``, plus the
  z-loss that keeps ``lse`` near 0. With ``reduction='none'`` and the other defaults it
  equals ``optax.softmax_cross_entropy_with_integer_labels`` (the default ``'mean'`` averages
  it over the counted rows).

  Args:
    logits: ``(..., V)`` float16, bfloat16, float32 or float64.
    labels: integer array of ``logits.shape[:-1]``. A label outside ``[0, V)`` other than
      ``ignore_index`` makes its row's loss NaN (so a ``'mean'`` or ``'sum'`` is NaN), as
      optax reads it; its row gets no gradient. A wide label is never narrowed into range.
    ignore_index: rows with this label contribute no loss and no gradient, and are not counted
      by ``'mean'``.
    label_smoothing: in ``[0, 1)``.
    z_loss: coefficient of ``lse**2`` (>= 0).
    reduction: ``'mean'`` over counted rows (0 when none), ``'sum'``, or ``'none'`` for the
      per-row losses (ignored rows 0).
    implementation: ``'xla'``, ``'triton'``, ``'cuda'`` (logits' {cuda_limits}; see
      :func:`softmax`) or ``None``.

  Returns:
    A float32 scalar (float64 for float64 logits), or per-row losses for ``'none'``.
  """
  op = "softmax_cross_entropy"
  logits = check_array(op, "logits", logits)
  labels = check_array(op, "labels", labels, floating=False)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"{op}: labels must be integers, got {describe(labels)}")
  if logits.ndim == 0 or labels.shape != logits.shape[:-1]:
    raise ValueError(f"{op}: labels must have shape logits.shape[:-1]; got logits "
                     f"{describe(logits)} and labels {describe(labels)}")
  if logits.shape[-1] == 0:
    raise ValueError(f"{op}: logits have no classes ({describe(logits)})")
  ignore_index, label_smoothing, z_loss = cross_entropy_options(
      op, ignore_index, label_smoothing, z_loss, reduction)
  vocab = logits.shape[-1]
  cuda_refusal = lambda: cuda_kernels.unsupported(vocab, logits.dtype)

  # The loss and its gradient come from one pass (the training step's kernel), or the loss
  # alone where the call is only evaluated.
  def fastest(use):
    row = "cross_entropy_loss" if use == "evaluated" else "cross_entropy"
    return _fastest(op, use, row, vocab, logits, cuda_refusal, (labels.size, vocab))

  plan = resolve_plan(op, implementation, _BACKENDS, _preference(), fastest,
                      empty=labels.size == 0)
  if implementation == "cuda" and (reason := cuda_refusal()):
    raise NotImplementedError(f"{op}(implementation='cuda') cannot take logits "
                              f"{describe(logits)}: {reason}")
  st = _CrossEntropyStatic(label_smoothing, z_loss, reduction, ignore_index, plan)
  return _cross_entropy_jit(logits, labels, st)


@dataclasses.dataclass(frozen=True)
class _CrossEntropyStatic:
  label_smoothing: float
  z_loss: float
  reduction: str
  ignore_index: int | None
  plan: op.Plan  # a step's forward and backward are one pass: the loss and its gradient


@functools.partial(jax.jit, static_argnums=(2,))
def _cross_entropy_jit(logits, labels, st):
  vocab = logits.shape[-1]
  labels, stray = int32_labels(labels, vocab, st.ignore_index)
  valid = counted_labels(labels, vocab, st.ignore_index)
  if "xla" in st.plan:
    labels = jnp.where(valid, labels, -1)
  # The kernels take the labels as they are and apply the same validity rule themselves: a
  # masked copy of the labels would be one more row-sized buffer in the training step.
  cdt = jnp.promote_types(jnp.float32, logits.dtype)
  if st.reduction == "none":
    loss = _per_row_loss(logits, labels, st)
  else:
    loss = _reduced_loss(logits, labels, reduction_scale(valid, st.reduction, cdt), st)
  return poison_stray_rows(loss, stray, st.reduction)


# 'mean' / 'sum': the kernel computes the gradient for a unit cotangent while the logits are
# read for the loss, and the backward only scales it (XLA drops the scale when it is 1, as
# it is at the end of a training step). ``scale`` is the scalar 1/count or 1.
def _reduced_loss(logits, labels, scale, st):
  loss, _ = _rows(logits, labels, st, st.plan.evaluated)
  return jnp.sum(loss) * scale


def _reduced_loss_fwd(logits, labels, scale, st):
  if st.plan.forward == "xla":
    loss, lse = _rows(logits, labels, st, "xla")
    grad = reference.cross_entropy_grad(logits, labels, labels >= 0, lse,
                                        jnp.broadcast_to(scale, labels.shape),
                                        label_smoothing=st.label_smoothing, z_loss=st.z_loss)
  else:
    loss, grad = _ce_kernels(st, st.plan.forward).fused(logits, labels, scale.reshape(1))
  return jnp.sum(loss) * scale, grad


def _reduced_loss_bwd(st, grad, g):
  return grad * g.astype(grad.dtype), None, None


_reduced_loss = op.differentiable(_reduced_loss, _reduced_loss_fwd, _reduced_loss_bwd,
                                  static=(3,))


def _per_row_loss(logits, labels, st):
  return _rows(logits, labels, st, st.plan.evaluated)[0]


def _per_row_loss_fwd(logits, labels, st):
  loss, lse = _rows(logits, labels, st, st.plan.forward)
  return loss, (logits, labels, lse)


def _per_row_loss_bwd(st, residuals, g):
  logits, labels, lse = residuals
  g = g.astype(lse.dtype)
  if st.plan.backward == "xla":
    grad = reference.cross_entropy_grad(logits, labels, labels >= 0, lse, g,
                                        label_smoothing=st.label_smoothing, z_loss=st.z_loss)
  else:
    grad = _ce_kernels(st, st.plan.backward).grad(logits, labels, lse, g)
  return grad, None


_per_row_loss = op.differentiable(_per_row_loss, _per_row_loss_fwd, _per_row_loss_bwd,
                                  static=(2,))


def _rows(logits, labels, st, impl):
  if impl == "xla":
    return reference.cross_entropy_rows(logits, labels, labels >= 0,
                                        label_smoothing=st.label_smoothing, z_loss=st.z_loss)
  return _ce_kernels(st, impl).loss(logits, labels)


class _CrossEntropyKernels:
  """``impl``'s kernels: rows flattened, sharded over the row axes, vmapped by adding rows."""

  def __init__(self, st, impl):
    self.st = st
    self.kernels = _KERNELS[impl]
    self.loss = self._wrap("loss")
    self.fused = self._wrap("fused")
    self.grad = self._wrap("grad")

  def _wrap(self, mode):
    st, kernels = self.st, self.kernels

    def call(logits, labels, *extra):
      rows = tuple(f"r{i}" for i in range(labels.ndim))
      row_extra = [rows] * len(extra)
      if mode == "fused" and extra[0].size == 1:
        row_extra = [("one",)]  # one scale for all rows, replicated
      elif mode == "fused":
        # vmap folded examples with scales of their own into the rows: a scale per row.
        scale = extra[0].reshape(-1)
        extra = (jnp.repeat(scale, labels.size // scale.size).reshape(labels.shape),)

      def local(logits, labels, *extra):
        shape = labels.shape
        flat = [logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)]
        flat += [e.reshape(-1).astype(compute_dtype(logits.dtype)) for e in extra]
        if mode == "grad":
          kwargs = dict(lse=flat[2], row_scale=flat[3])
        elif mode == "fused":
          kwargs = dict(row_scale=flat[2])
        else:
          kwargs = {}
        outs = kernels.cross_entropy(flat[0], flat[1], label_smoothing=st.label_smoothing,
                                     z_loss=st.z_loss, ignore_index=st.ignore_index, mode=mode,
                                     **kwargs)
        outs = (outs,) if mode == "grad" else tuple(outs)
        return tuple(o.reshape(logits.shape if o.ndim == 2 else shape) for o in outs)

      out_dims = {"loss": [rows, rows], "fused": [rows, rows + ("v",)],
                  "grad": [rows + ("v",)]}[mode]
      outs = parallel_call("softmax_cross_entropy", local, logits, labels, *extra,
                           in_dims=[rows + ("v",), rows] + row_extra, out_dims=out_dims,
                           parallel=set(rows))
      return outs[0] if mode == "grad" else outs

    return fold_into_batch(call)


@functools.cache
def _ce_kernels(st, impl) -> _CrossEntropyKernels:
  return _CrossEntropyKernels(st, impl)


# The limits the 'cuda' kernels enforce, from the constants they enforce them by.
for _op in (softmax, softmax_cross_entropy):
  _op.__doc__ = _op.__doc__.replace("{cuda_limits}", cuda_kernels.limits())
