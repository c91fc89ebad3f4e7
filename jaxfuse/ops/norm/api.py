"""``jaxfuse.rms_norm`` and ``jaxfuse.layer_norm``: validation, dispatch, VJP, vmap, sharding."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxfuse._core import op, registry, tuned
from jaxfuse._core.sharding import parallel_call
from jaxfuse._core.validation import (canonical_dtype, check_array, check_positive_float,
                                      describe)
from jaxfuse.ops.norm import cuda as cuda_kernels
from jaxfuse.ops.norm import reference, triton

_BACKENDS = {"xla": registry.xla_available, "triton": registry.triton_unavailable,
             "cuda": cuda_kernels.unavailable}
_KERNELS = {"triton": triton, "cuda": cuda_kernels}


def _preference():
  # On the CPU the kernels only run interpreted.
  return ("xla",) if registry.platform() == "cpu" else ("triton", "xla")


def _untuned() -> dict:
  # A GPU never measured: Triton while a program holds a row block in registers, CUDA's
  # cluster kernels past it (where a Pallas program walks a row twice), LayerNorm's backward
  # on CUDA's short-row kernel, whose lanes hold whole rows, and no bands of few rows for XLA.
  # Without Triton, CUDA wherever it runs.
  return {"triton_max_features": {f"{op}/{use}": 16384 for op in ("rms", "layer")
                                  for use in ("forward", "step")},
          "cuda_from_without_triton": {f"{op}/{use}": 0 for op in ("rms", "layer")
                                       for use in ("forward", "step")},
          "xla_few_rows": {},
          "rules": [{"when": {"op": "layer", "direction": "backward", "cuda_short_rows": True},
                     "use": "cuda"}],
          "cuda_backward_partials": []}


def _cuda_backward_clusters(kind: str, x_dtype, n_cols: int) -> int | None:
  """A cap on the CUDA backward's persistent grid, or None for the clusters resident at once.
  Each cluster writes a float32 partial row per parameter gradient, which a second kernel
  reads back: ``cuda_backward_partials`` (entries of the form ``{"when": facts, "elements":
  E}``, the first that holds) holds those partials to about E elements per SM, where fewer,
  longer-walking clusters measured faster."""
  facts = dict(op=kind, length=n_cols, itemsize=jnp.dtype(x_dtype).itemsize)
  for entry in tuned.rows("norm", _untuned)["cuda_backward_partials"]:
    if tuned.matches(entry["when"], facts):
      return registry.num_multiprocessors() * max(1, entry["elements"] // n_cols)
  return None


def _fastest(facts: dict, few_rows_use: str, cuda_runs, triton_runs) -> str:
  """The fastest implementation for one direction (``facts["direction"]``), by this GPU's
  tuned table (``jaxfuse/ops/norm/tuned/``): its ``rules``, measured exceptions matched on
  ``facts``, else the general rule.

  Few rows of long 16-bit features leave a program per row with most of the GPU idle, and
  XLA's fusions win there: ``xla_few_rows`` holds, per norm and ``few_rows_use`` (the
  evaluated ``forward``, or both directions of a training ``step``, which XLA fuses into one
  program), bands ``[most rows, least length, most length, ...]`` (pairs of bounds) where XLA
  measured faster (a call takes the first entry of at least its rows; ``[most rows]``: no band
  there; none past the last entry, or where empty). Up to ``triton_max_features`` (per norm
  and ``few_rows_use`` too) the Triton kernels hold a row block in registers and win. Longer
  rows a Pallas program walks twice, and there the CUDA kernels, which hold a row in a thread
  block cluster, mostly win. Both directions share the saved statistics, so any forward pairs
  with any backward. Where the CUDA kernels cannot run (rows that do not fit a cluster,
  float64) the two-walk Triton forward still beats XLA's, and XLA's backward beats the
  two-walk Triton one. Without Triton the CUDA kernels come first from
  ``cuda_from_without_triton`` (per norm and use) and XLA's fusions below. ``cuda_runs()`` and
  ``triton_runs()`` say whether those kernels can take this call (the first builds them on
  first use): the first is asked only where CUDA would be chosen, the second past the rules
  and bands, since without Triton the choice differs.
  """
  table = tuned.rows("norm", _untuned)
  runs = {"cuda": cuda_runs, "triton": triton_runs, "xla": lambda: True}
  if chosen := tuned.ruled(table["rules"], facts, lambda name: runs[name]()):
    return chosen
  bands = table["xla_few_rows"].get(f"{facts['op']}/{few_rows_use}") or ()
  bounds = next((entry[1:] for entry in bands if facts["rows"] <= entry[0]), ())
  if any(tuned.matches({"itemsize": 2, "out_itemsize": 2, "min_length": least,
                        "max_length": most}, facts)
         for least, most in zip(bounds[::2], bounds[1::2])):
    return "xla"
  longest = table["triton_max_features"][f"{facts['op']}/{few_rows_use}"]
  n = facts["length"]
  if not triton_runs():
    cuda_from = table["cuda_from_without_triton"][f"{facts['op']}/{few_rows_use}"]
    return "cuda" if cuda_from is not None and n >= cuda_from and cuda_runs() else "xla"
  if n > longest and cuda_runs():
    return "cuda"
  if (facts["direction"] == "forward" or n <= longest) and triton_runs():
    return "triton"
  return "xla"


def rms_norm(x, weight=None, *, eps: float = 1e-6, normalized_ndim: int | None = None,
             out_dtype=None, implementation: str | None = None):
  """Root-mean-square normalization, ``x / sqrt(mean(x**2) + eps) * weight``.

  Args:
    x: ``(*batch, *features)`` float16, bfloat16, float32 or float64.
    weight: optional ``features``-shaped scale; the statistics are taken over its
      ``weight.ndim`` trailing axes of ``x``. Its dtype may differ from ``x``'s.
    eps: added to the mean square; a Python float > 0.
    normalized_ndim: number of trailing axes to normalize over when there is no weight
      (default 1). If given with a weight it must equal ``weight.ndim``.
    out_dtype: output dtype; default ``jnp.result_type(x, weight)``. Pass ``weight.dtype`` for
      the "output takes the weight's dtype" convention.
    implementation: ``'xla'``, ``'triton'`` (a Pallas kernel; interpreted on the CPU),
      ``'cuda'`` (CUDA kernels built with nvcc on first use, for Hopper GPUs:
      {cuda_limits}) or ``None`` for the fastest available here.

  Returns:
    An array of ``x.shape``. Statistics are accumulated in float32 (float64 for float64
    inputs). Differentiable with respect to ``x`` and ``weight``.
  """
  return _normalize("rms_norm", "rms", x, weight, None, eps, normalized_ndim, out_dtype,
                    implementation)


def layer_norm(x, weight=None, bias=None, *, eps: float = 1e-5,
               normalized_ndim: int | None = None, out_dtype=None,
               implementation: str | None = None):
  """Layer normalization, ``(x - mean) / sqrt(var + eps) * weight + bias``.

  Args:
    x: ``(*batch, *features)`` float16, bfloat16, float32 or float64.
    weight: optional ``features``-shaped scale; the statistics are taken over its
      ``weight.ndim`` trailing axes of ``x``.
    bias: optional shift, the same shape as ``weight`` (or, without a weight, ``features``).
    eps: added to the (biased) variance; a Python float > 0.
    normalized_ndim: number of trailing axes to normalize over when there is neither weight nor
      bias (default 1). If given with them it must equal their ``ndim``.
    out_dtype: output dtype; default ``jnp.result_type(x, weight, bias)``.
    implementation: ``'xla'``, ``'triton'``, ``'cuda'`` or ``None`` (see :func:`rms_norm`).

  Returns:
    An array of ``x.shape``, differentiable with respect to ``x``, ``weight`` and ``bias``.
  """
  return _normalize("layer_norm", "layer", x, weight, bias, eps, normalized_ndim, out_dtype,
                    implementation)


# The limits the 'cuda' kernels enforce, from the constants they enforce them by.
rms_norm.__doc__ = rms_norm.__doc__.replace("{cuda_limits}", cuda_kernels.limits())


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything about a call that is fixed at trace time."""
  op: str
  kind: str
  eps: float
  norm_ndim: int
  out_dtype: jnp.dtype
  bias_dtype: jnp.dtype | None
  plan: op.Plan
  group_ndim: int = 0


def _normalize(op, kind, x, weight, bias, eps, normalized_ndim, out_dtype, implementation):
  x = check_array(op, "x", x)
  weight = None if weight is None else check_array(op, "weight", weight)
  bias = None if bias is None else check_array(op, "bias", bias)
  eps = check_positive_float(op, "eps", eps)
  params = [(n, p) for n, p in (("weight", weight), ("bias", bias)) if p is not None]
  if normalized_ndim is not None and (not isinstance(normalized_ndim, int)
                                      or isinstance(normalized_ndim, bool)):
    raise TypeError(f"{op}: normalized_ndim must be an int, got {normalized_ndim!r}")
  if params:
    norm_ndim = params[0][1].ndim
    features = x.shape[x.ndim - norm_ndim:] if norm_ndim <= x.ndim else None
    for name, p in params:
      if p.ndim == 0 or p.shape != features or p.shape != params[0][1].shape:
        raise ValueError(f"{op}: {name} must have the shape of the trailing axes of x it "
                         f"normalizes, x.shape[-{name}.ndim:]; got x {describe(x)} and "
                         + ", ".join(f"{n} {describe(q)}" for n, q in params))
    if normalized_ndim is not None and normalized_ndim != norm_ndim:
      raise ValueError(f"{op}: normalized_ndim={normalized_ndim} disagrees with "
                       f"{params[0][0]}.ndim={norm_ndim} ({describe(params[0][1])})")
  else:
    norm_ndim = 1 if normalized_ndim is None else normalized_ndim
    if not 1 <= norm_ndim <= x.ndim:
      raise ValueError(f"{op}: normalized_ndim must be between 1 and x.ndim={x.ndim}, got "
                       f"{norm_ndim} (x {describe(x)})")
  if math.prod(x.shape[x.ndim - norm_ndim:]) == 0:
    raise ValueError(f"{op}: cannot normalize over zero elements (x {describe(x)}, "
                     f"normalizing its last {norm_ndim} axes)")
  out_dtype = canonical_dtype(op, "out_dtype", out_dtype) or \
      jnp.result_type(x, *(p for _, p in params))
  n = math.prod(x.shape[x.ndim - norm_ndim:])
  plan = _plan(op, kind, implementation, n, x.size // n, x.dtype, out_dtype,
               [p.dtype for _, p in params], lambda: f"x {describe(x)}")
  st = _Static(op, kind, eps, norm_ndim, jnp.dtype(out_dtype),
               None if bias is None else jnp.dtype(bias.dtype), plan)
  return _norm_jit(x, weight, bias, st)


def dispatch_facts(kind: str, n: int, rows: int, x_dtype, out_dtype) -> dict:
  """What the tuned table's rules match a call on (besides its use: :func:`use_facts`)."""
  return dict(op=kind, length=n, rows=rows, elements=rows * n,
              itemsize=jnp.dtype(x_dtype).itemsize, out_itemsize=jnp.dtype(out_dtype).itemsize,
              cuda_short_rows=(jnp.dtype(x_dtype).itemsize == 2 and jnp.dtype(out_dtype) == x_dtype
                               and getattr(cuda_kernels.backward_tiling(n, x_dtype), "lanes",
                                           0) > 0))


def use_facts(use: str) -> dict:
  """The rules' facts of one use (``op.USES``): it, and the direction it runs."""
  return dict(use=use, direction="backward" if use == "backward" else "forward")


def _plan(op_name, kind, implementation, n, rows, x_dtype, out_dtype, param_dtypes, what):
  """The call's plan for ``rows`` rows of ``n`` features: the named implementation, or by
  measurement for ``None`` among those that run here (see :func:`_fastest`)."""
  cuda_refusal = lambda: cuda_kernels.unsupported(n, x_dtype, out_dtype, param_dtypes)
  cuda_runs = lambda: (cuda_refusal() is None
                       and registry.runs(op_name, "cuda", cuda_kernels.unavailable))
  triton_runs = lambda: registry.runs(
      op_name, "triton",
      lambda: registry.triton_unavailable() or triton.unsupported((1, rows, n)))

  facts = functools.cache(lambda: dispatch_facts(kind, n, rows, x_dtype, out_dtype))

  def fastest(use):
    return _fastest(dict(facts(), **use_facts(use)), op.timed_as(use), cuda_runs, triton_runs)

  chosen = op.resolve_plan(op_name, implementation, _BACKENDS, _preference(), fastest)
  if implementation == "cuda" and (reason := cuda_refusal()):
    raise NotImplementedError(f"{op_name}(implementation='cuda') cannot take {what()}: {reason}")
  return chosen


def _norm(x, weight, bias, st):
  return _forward(x, weight, bias, st, st.plan.evaluated)[0]


def _norm_fwd(x, weight, bias, st):
  y, mean, rstd = _forward(x, weight, bias, st, st.plan.forward)
  return y, (x, weight, mean, rstd)


def _norm_bwd(st, residuals, dy):
  x, weight, mean, rstd = residuals
  return _backward(dy, x, weight, mean, rstd, st, st.plan.backward)


_norm = op.differentiable(_norm, _norm_fwd, _norm_bwd, static=(3,))
_norm_jit = jax.jit(_norm, static_argnums=(3,))


def _forward(x, weight, bias, st, impl):
  if impl == "xla" or x.size == 0:
    return reference.forward(x, weight, bias, kind=st.kind, eps=st.eps, norm_ndim=st.norm_ndim,
                             group_ndim=st.group_ndim, out_dtype=st.out_dtype)
  return _kernels(st, impl).forward(x, weight, bias)


def _backward(dy, x, weight, mean, rstd, st, impl):
  if impl == "xla" or x.size == 0:
    return reference.backward(dy, x, weight, mean, rstd, kind=st.kind,
                              has_bias=st.bias_dtype is not None, norm_ndim=st.norm_ndim,
                              group_ndim=st.group_ndim, bias_dtype=st.bias_dtype)
  return _kernels(st, impl).backward(dy, x, weight, mean, rstd)


class _Kernels:
  """One implementation's kernels (Triton or CUDA) for one static configuration: vmap rules
  around sharded kernel calls."""

  def __init__(self, st: _Static, impl: str):
    self.st, self.impl = st, impl
    self.forward = op.vmappable(self._sharded_forward, self._forward_rule)
    self.backward = op.vmappable(self._sharded_backward, self._backward_rule)

  # Factor names for parallel_call: groups and rows are parallel, features are reduced over.
  def _dims(self, ndim):
    st = self.st
    groups = tuple(f"g{i}" for i in range(st.group_ndim))
    rows = tuple(f"r{i}" for i in range(ndim - st.group_ndim - st.norm_ndim))
    features = tuple(f"f{i}" for i in range(st.norm_ndim))
    return groups + rows + features, groups + features, groups + rows, set(groups + rows)

  def _flat(self, x):
    st = self.st
    g = math.prod(x.shape[:st.group_ndim])
    n = math.prod(x.shape[x.ndim - st.norm_ndim:])
    return x.reshape(g, -1, n), lambda a: a.reshape(g, n), lambda s: s.reshape(g, -1)

  def _sharded_forward(self, x, weight, bias):
    st = self.st
    x_dims, param_dims, stat_dims, parallel = self._dims(x.ndim)
    params = [p for p in (weight, bias) if p is not None]
    n_stats = 2 if st.kind == "layer" else 1

    def local(x, *params):
      w, b = self._unpack(weight, bias, params)
      x3, flat_param, _ = self._flat(x)
      y, mean, rstd = _KERNELS[self.impl].forward(
          x3, None if w is None else flat_param(w), None if b is None else flat_param(b),
          kind=st.kind, eps=st.eps, out_dtype=st.out_dtype)
      stats = (rstd,) if mean is None else (mean, rstd)
      return (y.reshape(x.shape),) + tuple(s.reshape(x.shape[:x.ndim - st.norm_ndim])
                                           for s in stats)

    def feature_sharded(x, *params, axis_names):
      w, b = self._unpack(weight, bias, params)
      y, mean, rstd = reference.forward(x, w, b, kind=st.kind, eps=st.eps,
                                        norm_ndim=st.norm_ndim, group_ndim=st.group_ndim,
                                        out_dtype=st.out_dtype, axis_names=axis_names)
      return (y, rstd) if mean is None else (y, mean, rstd)

    outs = parallel_call(st.op, local, x, *params, in_dims=[x_dims] + [param_dims] * len(params),
                         out_dims=[x_dims] + [stat_dims] * n_stats, parallel=parallel,
                         sharded_whole_fn=feature_sharded)
    return (outs[0], None, outs[1]) if n_stats == 1 else tuple(outs)

  def _sharded_backward(self, dy, x, weight, mean, rstd):
    st = self.st
    has_bias = st.bias_dtype is not None
    x_dims, param_dims, stat_dims, parallel = self._dims(x.ndim)
    stats = [s for s in (mean, rstd) if s is not None]
    inputs = [dy, x] + ([weight] if weight is not None else []) + stats
    in_dims = [x_dims, x_dims] + [param_dims] * (weight is not None) + [stat_dims] * len(stats)
    out_dims = [x_dims] + [param_dims] * ((weight is not None) + has_bias)

    def split(rest):
      w = rest.pop(0) if weight is not None else None
      m = rest.pop(0) if mean is not None else None
      return w, m, rest.pop(0)

    def local(dy, x, *rest):
      w, m, r = split(list(rest))
      x3, flat_param, flat_stat = self._flat(x)
      grid = ({"max_clusters": _cuda_backward_clusters(st.kind, x.dtype, x3.shape[-1])}
              if self.impl == "cuda" else {})
      dx, dw, db = _KERNELS[self.impl].backward(
          dy.reshape(x3.shape), x3, None if w is None else flat_param(w),
          None if m is None else flat_stat(m), flat_stat(r), kind=st.kind, has_bias=has_bias,
          bias_dtype=st.bias_dtype, **grid)
      param_shape = x.shape[:st.group_ndim] + x.shape[x.ndim - st.norm_ndim:]
      return (dx.reshape(x.shape),) + tuple(g.reshape(param_shape) for g in (dw, db)
                                            if g is not None)

    def feature_sharded(dy, x, *rest, axis_names):
      w, m, r = split(list(rest))
      grads = reference.backward(dy, x, w, m, r, kind=st.kind, has_bias=has_bias,
                                 norm_ndim=st.norm_ndim, group_ndim=st.group_ndim,
                                 bias_dtype=st.bias_dtype, axis_names=axis_names)
      return tuple(g for g in grads if g is not None)

    outs = list(parallel_call(st.op, local, *inputs, in_dims=in_dims, out_dims=out_dims,
                              parallel=parallel, sharded_whole_fn=feature_sharded))
    dx = outs.pop(0)
    dw = outs.pop(0) if weight is not None else None
    return dx, dw, (outs.pop(0) if has_bias else None)

  @staticmethod
  def _unpack(weight, bias, params):
    params = list(params)
    return (params.pop(0) if weight is not None else None,
            params.pop(0) if bias is not None else None)

  # vmap: the mapped axis arrives in front. With shared parameters it is just more rows. When a
  # parameter is mapped (or the per-example parameter gradients of a mapped backward are wanted)
  # it becomes a new leading group axis of every operand.
  def _forward_rule(self, axis_size, in_batched, x, weight, bias):
    if self.st.group_ndim == 0 and not any(in_batched[1:]):
      return self._all_batched(self.forward(x, weight, bias))
    args = [a if b or a is None else _broadcast(a, axis_size)
            for a, b in zip((x, weight, bias), in_batched)]
    return self._all_batched(self._grouped().forward(*args))

  def _backward_rule(self, axis_size, in_batched, dy, x, weight, mean, rstd):
    args = [a if b or a is None else _broadcast(a, axis_size)
            for a, b in zip((dy, x, weight, mean, rstd), in_batched)]
    return self._all_batched(self._grouped().backward(*args))

  def _grouped(self) -> _Kernels:
    return _kernels(dataclasses.replace(self.st, group_ndim=self.st.group_ndim + 1), self.impl)

  @staticmethod
  def _all_batched(outs):
    return outs, tuple(None if o is None else True for o in outs)


def _broadcast(a, axis_size):
  return jnp.broadcast_to(a, (axis_size,) + a.shape)


@functools.cache
def _kernels(st: _Static, impl: str) -> _Kernels:
  return _Kernels(st, impl)
