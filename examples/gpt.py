"""A GPT decoder trained with jaxfuse's layers (``--fused``) or flax's (``--unfused``).

    python examples/gpt.py                          # tiny model, stdlib corpus, fused
    python examples/gpt.py --unfused                # flax layers, jax.nn attention, optax loss
    python examples/gpt.py --preset small --packed  # documents packed into rows, segment ids
    python examples/gpt.py --compare --steps 200 --plot loss.png   # both, same batches
    python examples/gpt.py --bench                  # GPT-2 small, random tokens, side by side
    python examples/gpt.py --mesh 4,2               # data x model parallel over 8 devices

The corpus is the Python standard library's own source files, byte by byte (vocabulary 256):
text every machine has. ``--bench`` uses random tokens at GPT-2's vocabulary (50257).

The two models hold the same parameters (flax's ``LayerNorm``, ``MultiHeadAttention``
``query/key/value/out`` kernels, ``Linear``, ``Embed``): the fused one computes them with
``jaxfuse.nn.LayerNorm``, ``jaxfuse.nn.CausalSelfAttention``, ``jaxfuse.nn.GeluMLP`` (its
backward recomputes the GELU) and ``jaxfuse.linear_cross_entropy`` on the tied
embedding (the logits never reach memory); the unfused one with ``flax.nnx.LayerNorm``,
``nnx.MultiHeadAttention`` over ``jax.nn.dot_product_attention`` (``--attention xla`` or
``cudnn``) and ``optax.softmax_cross_entropy_with_integer_labels`` on float32 logits.

Several devices: ``--mesh data,model`` shards the batch over ``data`` and the attention heads
and MLP columns over ``model`` (Megatron style); the default is data parallel over every
device. Several hosts: run the same command on each host with ``--distributed``, which calls
``jax.distributed.initialize()`` (its coordinator and process ids come from the environment,
e.g. ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``, or a cluster
launcher JAX recognizes); the mesh then spans every process's devices and each host feeds its
share of the batch. Nothing in it is specific to jaxfuse.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import pathlib
import statistics
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxfuse
import jaxfuse.nn as jnn
from jaxfuse._core.clocks import ClockSampler


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int
  width: int
  heads: int
  seq_len: int
  batch: int
  kv_heads: int | None = None
  vocab: int = 256
  dtype: str = "bfloat16"
  learning_rate: float = 3e-4
  warmup: int = 50


PRESETS = {
    "tiny": Config(layers=2, width=64, heads=4, seq_len=128, batch=8, learning_rate=1e-3,
                   warmup=10),
    "small": Config(layers=6, width=384, heads=6, seq_len=1024, batch=8),
    "gpt2": Config(layers=12, width=768, heads=12, seq_len=2048, batch=8),
}


# --- model --------------------------------------------------------------------------------


def jax_nn_attention(implementation):
  """An ``attention_fn`` for ``nnx.MultiHeadAttention`` calling ``jax.nn.dot_product_attention``
  with ``implementation`` (``None``: jax's own choice, XLA for masks)."""

  def attention_fn(query, key, value, bias=None, mask=None, *, is_causal=False, **_):
    mask = None if mask is None else mask.astype(jnp.bool_)
    return jax.nn.dot_product_attention(query, key, value, bias, mask, is_causal=is_causal,
                                        implementation=implementation)

  return attention_fn


class FlaxMLP(nnx.Module):
  """``proj(gelu(fc(x)))`` in flax's own layers: the unfused model's MLP."""

  def __init__(self, width: int, hidden: int, **kw):
    self.fc = nnx.Linear(width, hidden, **kw)
    self.proj = nnx.Linear(hidden, width, **kw)

  def __call__(self, x):
    return self.proj(jax.nn.gelu(self.fc(x)))


class Block(nnx.Module):

  def __init__(self, cfg: Config, fused: bool, attention: str | None, rngs: nnx.Rngs):
    kw = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.float32, rngs=rngs)
    norm = jnn.LayerNorm if fused else nnx.LayerNorm
    self.fused = fused
    self.ln1, self.ln2 = norm(cfg.width, **kw), norm(cfg.width, **kw)
    if fused:
      self.attn = jnn.CausalSelfAttention(cfg.heads, cfg.width, num_kv_heads=cfg.kv_heads, **kw)
    else:
      self.attn = nnx.MultiHeadAttention(cfg.heads, cfg.width, num_kv_heads=cfg.kv_heads,
                                         attention_fn=jax_nn_attention(attention),
                                         decode=False, **kw)
    # The same parameters (mlp.fc, mlp.proj) either way; the fused layer's backward recomputes
    # the GELU instead of holding its output.
    self.mlp = (jnn.GeluMLP if fused else FlaxMLP)(cfg.width, 4 * cfg.width, **kw)

  def __call__(self, x, segment_ids, mask):
    h = self.ln1(x)
    if self.fused:
      h = self.attn(h, segment_ids=segment_ids)
    elif mask is None:
      h = self.attn(h, is_causal=True)
    else:
      h = self.attn(h, mask=mask)
    x = x + h
    return x + self.mlp(self.ln2(x))


class GPT(nnx.Module):
  """Pre-norm decoder with learned positions and an output layer tied to the embedding."""

  def __init__(self, cfg: Config, *, fused: bool, attention: str | None = "xla",
               rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.fused = fused
    self.embed = nnx.Embed(cfg.vocab, cfg.width, dtype=dtype, rngs=rngs)
    self.position = nnx.Embed(cfg.seq_len, cfg.width, dtype=dtype, rngs=rngs)
    blocks = [Block(cfg, fused, attention, rngs) for _ in range(cfg.layers)]
    self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks  # flax < 0.12
    norm = jnn.LayerNorm if fused else nnx.LayerNorm
    self.ln_f = norm(cfg.width, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

  def loss(self, tokens, labels, positions, segment_ids=None):
    """Mean next-token cross-entropy over the labels >= 0 (-1 marks a document's last token)."""
    mask = None
    if segment_ids is not None and not self.fused:
      # Packed rows for jax.nn: causal within each document, a block-diagonal mask.
      mask = nnx.combine_masks(nnx.make_causal_mask(tokens),
                               nnx.make_attention_mask(segment_ids, segment_ids, jnp.equal))
    x = self.embed(tokens) + self.position(positions)
    for block in self.blocks:
      x = block(x, segment_ids, mask)
    x = self.ln_f(x)
    embedding = self.embed.embedding[...].astype(x.dtype)
    if self.fused:
      return jaxfuse.linear_cross_entropy(x.reshape(-1, x.shape[-1]), embedding.T,
                                          labels.reshape(-1), ignore_index=-1)
    logits = (x @ embedding.T).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
    counted = labels >= 0
    return jnp.sum(jnp.where(counted, losses, 0.0)) / jnp.maximum(jnp.sum(counted), 1)


def build(cfg: Config, variant: str, seed: int = 0):
  """The model of ``variant`` (``fused``, or ``unfused-<attention>`` with attention ``xla``,
  ``cudnn`` or ``default``), initialized from ``seed``: the same parameters for every
  variant. ``fused:<layer>=<implementation>+...`` names the implementation of the fused
  model's ``attention``, ``mlp`` or ``norm`` layers (else ``None``'s choice), e.g.
  ``fused:attention=cudnn+mlp=cuda``."""
  implementations = _layer_implementations(variant)
  fused = variant.split(":")[0] == "fused"
  attention = None if fused else {"xla": "xla", "cudnn": "cudnn", "default": None}[
      variant.removeprefix("unfused-")]
  model = GPT(cfg, fused=fused, attention=attention, rngs=nnx.Rngs(seed))
  for block in model.blocks:
    modules = {"attention": [block.attn], "mlp": [block.mlp], "norm": [block.ln1, block.ln2]}
    for layer, implementation in implementations.items():
      for module in modules[layer]:
        module.implementation = implementation
  if "norm" in implementations:
    model.ln_f.implementation = implementations["norm"]
  return model


def _layer_implementations(variant: str) -> dict[str, str]:
  name, _, named = variant.partition(":")
  pairs = [p.partition("=") for p in named.split("+") if p]
  layers = [layer for layer, _, _ in pairs]
  if (named and name != "fused") or len(set(layers)) < len(layers) or any(
      not impl or layer not in ("attention", "mlp", "norm") for layer, _, impl in pairs):
    raise ValueError(f"variant {variant!r}: only 'fused' takes ':<layer>=<implementation>+"
                     f"...' with layers attention, mlp and norm, each once")
  return {layer: impl for layer, _, impl in pairs}


# --- data ---------------------------------------------------------------------------------


@functools.cache
def stdlib_documents() -> tuple[np.ndarray, ...]:
  """The standard library's ``.py`` files (third-party packages left out) as uint8 arrays."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  paths = sorted(p for p in root.rglob("*.py")
                 if "site-packages" not in p.parts and "dist-packages" not in p.parts)
  docs = tuple(np.frombuffer(p.read_bytes(), np.uint8) for p in paths)
  return tuple(d for d in docs if d.size > 1)


def text_batch(rng, cfg: Config, packed: bool):
  """``(tokens, labels, positions, segment_ids or None)``, each ``(batch, seq_len)`` int32.

  Unpacked: windows of the corpus as one stream. Packed: each row is filled with whole
  documents drawn at random (the last cut at the row's end), positions restart in each, and a
  document's last token has no label."""
  docs = stdlib_documents()
  t = cfg.seq_len
  if not packed:
    stream = stdlib_stream()
    starts = rng.integers(0, stream.size - t - 1, cfg.batch)
    rows = np.stack([stream[s:s + t + 1] for s in starts]).astype(np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (cfg.batch, t))
    return rows[:, :-1], rows[:, 1:], positions, None
  rows = np.empty((cfg.batch, t + 1), np.int32)
  segments = np.empty((cfg.batch, t + 1), np.int32)
  for r in range(cfg.batch):
    filled, segment = 0, 0
    while filled < t + 1:
      doc = docs[rng.integers(len(docs))][: t + 1 - filled]
      rows[r, filled:filled + doc.size] = doc
      segments[r, filled:filled + doc.size] = segment
      filled, segment = filled + doc.size, segment + 1
  return _packed(rows, segments)


def _packed(rows, segments):
  t = rows.shape[1] - 1
  labels = np.where(segments[:, 1:] == segments[:, :-1], rows[:, 1:], -1)
  starts = np.concatenate([np.ones((rows.shape[0], 1), bool),
                           segments[:, 1:t] != segments[:, :t - 1]], axis=1)
  index = np.broadcast_to(np.arange(t), (rows.shape[0], t))
  positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
  return (rows[:, :-1], labels.astype(np.int32), positions.astype(np.int32),
          segments[:, :-1].copy())


@functools.cache
def stdlib_stream() -> np.ndarray:
  return np.concatenate(stdlib_documents())


def random_batch(rng, cfg: Config, packed: bool, documents_per_row: int = 4):
  """Random tokens; packed rows hold ``documents_per_row`` documents of random lengths."""
  rows = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1)).astype(np.int32)
  if not packed:
    positions = np.broadcast_to(np.arange(cfg.seq_len, dtype=np.int32), rows[:, 1:].shape)
    return rows[:, :-1], rows[:, 1:], positions, None
  cuts = np.sort(rng.choice(np.arange(1, cfg.seq_len), (cfg.batch, documents_per_row - 1),
                            replace=False), axis=1) if documents_per_row > 1 else None
  segments = np.zeros_like(rows)
  for r in range(cfg.batch):
    for c in (() if cuts is None else cuts[r]):
      segments[r, c:] += 1
  return _packed(rows, segments)


# --- training -----------------------------------------------------------------------------


def make_mesh(spec: str | None):
  devices = jax.devices()
  data, model = (len(devices), 1) if spec is None else (int(s) for s in spec.split(","))
  if data * model != len(devices):
    raise SystemExit(f"--mesh {spec}: data x model must be the {len(devices)} devices")
  return jax.make_mesh((data, model), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def parameter_spec(path) -> P:
  """Megatron-style tensor parallelism over ``model``: attention heads and MLP columns in,
  their output projections' rows out, the rest replicated."""
  names = tuple(str(p.key) for p in path if hasattr(p, "key"))  # the module path
  if "attn" in names:
    if names[-2] in ("query", "key", "value"):
      return P(None, "model", None) if names[-1] == "kernel" else P("model", None)
    if names[-2] == "out" and names[-1] == "kernel":
      return P("model", None, None)
  if names[-2:] == ("fc", "kernel"):
    return P(None, "model")
  if names[-2:] == ("fc", "bias"):
    return P("model")
  if names[-2:] == ("proj", "kernel"):
    return P("model", None)
  return P()


def make_train_step(graphdef, cfg: Config, total_steps: int):
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.learning_rate, min(cfg.warmup, max(total_steps - 1, 1)), max(total_steps, 2),
      cfg.learning_rate / 10)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))

  def loss_fn(params, batch):
    return nnx.merge(graphdef, params).loss(*batch)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return tx, train_step


class Trainer:
  """One variant's parameters, optimizer state and jitted step, laid out on ``mesh``."""

  def __init__(self, cfg: Config, variant: str, mesh, total_steps: int, seed: int = 0):
    model = build(cfg, variant, seed)
    self.cfg, self.mesh = cfg, mesh
    graphdef, params = nnx.split(model)
    heads = (cfg.heads, cfg.kv_heads or cfg.heads, 4 * cfg.width)
    if any(h % mesh.shape["model"] for h in heads):
      raise ValueError(f"the model axis ({mesh.shape['model']}) must divide the heads and "
                       f"the MLP width {heads}")
    if cfg.batch % (mesh.shape["data"] * jax.process_count()):
      raise ValueError(f"the batch ({cfg.batch}) must divide over the data axis "
                       f"({mesh.shape['data']}) and the processes ({jax.process_count()})")
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, parameter_spec(path)), params)
    self.params = jax.device_put(params, shardings)
    tx, self.step_fn = make_train_step(graphdef, cfg, total_steps)
    self.opt_state = jax.jit(tx.init)(self.params)
    self.batch_sharding = NamedSharding(mesh, P("data"))

  def device_batch(self, batch):
    """Each process's rows (all of them on one host) placed as one global array."""
    return tuple(None if a is None else jax.make_array_from_process_local_data(
        self.batch_sharding, np.asarray(a)) for a in batch)

  def step(self, batch):
    self.params, self.opt_state, loss = self.step_fn(self.params, self.opt_state,
                                                     self.device_batch(batch))
    return loss

  def compiled(self, batch_size: int, packed: bool):
    """The step compiled for ``batch_size`` rows, from shapes alone (nothing allocated)."""
    rows = jax.ShapeDtypeStruct((batch_size, self.cfg.seq_len), jnp.int32,
                                sharding=self.batch_sharding)
    batch = (rows, rows, rows, rows if packed else None)
    return self.step_fn.lower(self.params, self.opt_state, batch).compile()


def train(cfg: Config, variant: str, steps: int, *, mesh, packed: bool, seed: int = 0,
          progress: bool = True) -> list[float]:
  """Trains ``variant`` for ``steps`` on the stdlib corpus; the per-step losses."""
  trainer = Trainer(cfg, variant, mesh, steps, seed)
  rng = np.random.default_rng(seed + jax.process_index())
  local = dataclasses.replace(cfg, batch=cfg.batch // jax.process_count())
  return run_steps(lambda: trainer.step(text_batch(rng, local, packed)), steps,
                   cfg.batch * cfg.seq_len, variant if progress else None)


def run_steps(step, steps: int, tokens_per_step: int, name: str | None) -> list[float]:
  """Calls ``step()`` (returning the loss) ``steps`` times; with a ``name``, a progress bar
  with the loss and tokens/s. Losses are read in groups of ten: no host sync every step."""
  losses, pending, t0 = [], [], time.perf_counter()
  for i in range(steps):
    pending.append(step())
    if i == 0 or len(pending) == 10 or i == steps - 1:
      losses += [float(l) for l in pending]
      # tokens/s of the group just read; the first step, which compiles, is read alone and
      # counts in no rate.
      rate = i and len(pending) * tokens_per_step / (time.perf_counter() - t0)
      pending, t0 = [], time.perf_counter()
      if name and rate:
        bar = "#" * (30 * (i + 1) // steps)
        print(f"\r{name:>14} [{bar:<30}] {i + 1}/{steps}  loss {losses[-1]:.4f}  "
              f"{rate:,.0f} tokens/s", end="", file=sys.stderr, flush=True)
  if name:
    print(file=sys.stderr)
  return losses


def plot(path: str, curves: dict[str, list[float]], title: str = "GPT on the stdlib corpus"):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  for name, losses in curves.items():
    ax.plot(np.arange(1, len(losses) + 1), losses, label=name, linewidth=1)
  ax.set(xlabel="step", ylabel="training loss (nats/byte)", title=title)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


# --- bench --------------------------------------------------------------------------------


def bench(cfg: Config, variants, mesh, *, packed: bool, steps: int = 100,
          find_max_batch: bool = True):
  """tokens/s, step ms and temporary memory per variant, on random tokens. The variants'
  windows of steps take turns, so that a drift of the GPU's clocks (its power cap reached, its
  heat) falls on each alike; on a GPU each window's mean SM clock and board power are recorded
  beside it: at the power cap, a step that draws more power runs at lower clocks."""
  prepared, failed = {}, {}
  for variant in variants:
    try:
      prepared[variant] = _BenchVariant(cfg, variant, mesh, packed)
    except Exception as e:  # noqa: BLE001  (a variant jax cannot run is reported, not fatal)
      failed[variant] = dict(variant=variant, error=f"{type(e).__name__}: {str(e)[:300]}")
      print(f"{variant:>16}  failed: {failed[variant]['error']}", flush=True)
  with ClockSampler() as sampler:
    timed = step_windows({v: p.run for v, p in prepared.items()}, steps, sampler=sampler)
  rows = []
  for variant in variants:
    if variant in prepared and timed[variant].error:
      failed[variant] = dict(variant=variant, error=timed[variant].error)
      print(f"{variant:>16}  failed: {timed[variant].error}", flush=True)
    if variant in failed:
      rows.append(failed[variant])
      continue
    row = prepared[variant].row(timed[variant])
    if find_max_batch:
      row["max_batch"] = largest_batch(prepared[variant].trainer, packed)
    print(_bench_line(row), flush=True)
    rows.append(row)
  return rows


class _BenchVariant:
  """One variant compiled, its first steps run (a variant that cannot run fails here)."""

  def __init__(self, cfg, variant, mesh, packed):
    self.cfg, self.variant, self.packed = cfg, variant, packed
    self.trainer = Trainer(cfg, variant, mesh, 1000)
    self.step = self.trainer.compiled(cfg.batch, packed)
    rng = np.random.default_rng(0)
    self.batches = [self.trainer.device_batch(random_batch(rng, cfg, packed)) for _ in range(2)]
    for i in range(WARMUP_STEPS):
      loss = self.run(i)
    float(loss)

  def run(self, i):
    trainer = self.trainer
    trainer.params, trainer.opt_state, loss = self.step(trainer.params, trainer.opt_state,
                                                        self.batches[i % 2])
    return loss

  def row(self, timed: Windows) -> dict:
    memory = self.step.memory_analysis()
    ms = statistics.median(timed.ms)
    row = dict(variant=self.variant, batch=self.cfg.batch, seq_len=self.cfg.seq_len,
               packed=self.packed, step_ms=ms, step_ms_windows=timed.ms,
               tokens_per_s=self.cfg.batch * self.cfg.seq_len / ms * 1e3,
               temp_bytes=getattr(memory, "temp_size_in_bytes", None),
               argument_bytes=getattr(memory, "argument_size_in_bytes", None), loss=timed.loss)
    if any(timed.clocks):
      row["clock_mhz_windows"] = [c and c["clock_mhz"] for c in timed.clocks]
      row["power_w_windows"] = [c and c["power_w"] for c in timed.clocks]
    return row


WARMUP_STEPS = 3


@dataclasses.dataclass
class Windows:
  """Wall-clock ms per step in each window, the last loss, and each window's clocks
  (:meth:`ClockSampler.over`, None where unsampled); ``error``: why a run stopped early."""
  ms: list[float]
  loss: float
  clocks: list[dict | None]
  error: str | None = None


def step_windows(runs, steps: int, window: int = 10, sampler: ClockSampler | None = None,
                 warmup: int = 0) -> dict[str, Windows]:
  """Per name of ``runs`` (``run(i)``: a training step returning its loss), the wall-clock ms a
  step in each window of ``window`` steps over ``steps`` steps after ``warmup``, the device
  waited on only at each window's ends; the runs' windows take turns. A run that raises while
  timed (out of memory, say) leaves the turns with its error."""
  for run in runs.values():
    for i in range(warmup):
      loss = run(i)
    if warmup:
      float(loss)
  timed = {name: Windows([], math.nan, []) for name in runs}
  # Python's collector, run inside a window, can stall the host for longer than the steps it
  # has queued (the GPU then idles): it runs between windows instead, as timeit does.
  collecting = gc.isenabled()
  gc.disable()
  try:
    for start in range(0, max(steps, window), window):
      for name, run in runs.items():
        if timed[name].error:
          continue
        gc.collect()
        t0 = time.perf_counter()
        try:
          for i in range(start, start + window):
            loss = run(i)
          timed[name].loss = float(loss)
        except Exception as e:  # noqa: BLE001  (one variant's failure is reported, not fatal)
          timed[name].error = f"{type(e).__name__}: {str(e)[:300]}"
          continue
        t1 = time.perf_counter()
        timed[name].ms.append((t1 - t0) / window * 1e3)
        timed[name].clocks.append(sampler.over(t0, t1) if sampler else None)
  finally:
    if collecting:
      gc.enable()
  return timed


def step_ms(run, steps: int, window: int = 10) -> tuple[list[float], float]:
  """:func:`step_windows` of one run after its warmup steps: the windows' ms and the last
  loss."""
  timed = step_windows({"": run}, steps, window, warmup=WARMUP_STEPS)[""]
  return timed.ms, timed.loss


def largest_batch(trainer: Trainer, packed: bool, limit: int | None = None) -> int | None:
  """The largest batch (a multiple of the data axis, to within a sixteenth) whose compiled
  step fits the device's memory by the compiler's own accounting. The step's memory is about
  linear in the batch: two compiles fit the line, a few more bracket where it meets the
  limit and bisect."""
  limit = limit or (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  if limit is None:
    return None
  unit = trainer.mesh.shape["data"]

  @functools.cache
  def used(multiple):
    try:
      m = trainer.compiled(multiple * unit, packed).memory_analysis()
    except Exception:  # noqa: BLE001  (an allocation the compiler refuses does not fit)
      return math.inf
    return (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
            - m.alias_size_in_bytes)

  def fits(multiple):
    return used(multiple) <= limit

  low = max(1, trainer.cfg.batch // unit)
  if not fits(low):
    return 0
  at_low, at_double = used(low), used(2 * low)
  guess = max(low, int(low + (limit - at_low) * low // max(at_double - at_low, 1)))
  step = max(1, guess // 16)
  if fits(guess):
    low, high = guess, guess + step
    while fits(high):
      low, high = high, high + step
  else:
    high = guess
    while not fits(high - step) and high - step > low:
      high -= step
    low = max(low, high - step)
  while high - low > max(1, low // 16):
    mid = (low + high) // 2
    low, high = (mid, high) if fits(mid) else (low, mid)
  return low * unit


def _bench_line(row) -> str:
  temp = "-" if row["temp_bytes"] is None else f"{row['temp_bytes'] / 2**30:6.2f} GiB"
  most = row.get("max_batch")
  windows = row["step_ms_windows"]
  clocks = [c for c in row.get("clock_mhz_windows", ()) if c]
  powers = [p for p in row.get("power_w_windows", ()) if p]
  at = (f"  at {statistics.median(clocks):.0f} MHz, {statistics.median(powers):.0f} W"
        if clocks and powers else "")
  return (f"{row['variant']:>16}  {row['step_ms']:8.1f} ms/step (windows {min(windows):.1f}-"
          f"{max(windows):.1f}, {len(windows)})  {row['tokens_per_s']:10,.0f} tokens/s  temp "
          f"{temp}  max batch {'-' if most is None else most}{at}")


def _environment(argv):
  from jaxfuse._core.bench import environment
  env = environment("python examples/gpt.py")
  env["command"] = " ".join(["python examples/gpt.py"] + list(argv))
  env["timing"] = ("wall clock per step: step_ms the median over windows of 10 steps "
                   "(step_ms_windows), the device waited on only at each window's ends, the "
                   "variants' windows in turn, Python's collector run between them; on a GPU "
                   "each window's mean SM clock and power a GPU (clock_mhz_windows, "
                   "power_w_windows, sampled by nvidia-smi)")
  return env


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", choices=PRESETS, default=None,
                      help="model size (default: tiny to train, gpt2 for --bench)")
  group = parser.add_mutually_exclusive_group()
  group.add_argument("--fused", dest="unfused", action="store_false", default=False)
  group.add_argument("--unfused", action="store_true")
  group.add_argument("--compare", action="store_true", help="train fused and unfused")
  parser.add_argument("--attention", choices=("xla", "cudnn", "default"), default="xla",
                      help="jax.nn's implementation in the unfused model")
  parser.add_argument("--packed", action="store_true")
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--batch", type=int, default=None)
  parser.add_argument("--seq-len", type=int, default=None)
  parser.add_argument("--layers", type=int, default=None)
  parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
  parser.add_argument("--vocab", type=int, default=None, help="--bench only (default 50257)")
  parser.add_argument("--mesh", default=None, help="data,model device counts")
  parser.add_argument("--distributed", action="store_true",
                      help="jax.distributed.initialize() first (multi-host)")
  parser.add_argument("--plot", default=None, help="loss-curve PNG path")
  parser.add_argument("--json", default=None, help="write losses or bench rows here")
  parser.add_argument("--bench", action="store_true")
  parser.add_argument("--variants", default=None,
                      help="--bench: comma-separated (fused, unfused-xla, unfused-cudnn, "
                           "unfused-default; fused:mlp=cuda+attention=cudnn names the "
                           "fused layers' implementations)")
  parser.add_argument("--no-max-batch", action="store_true",
                      help="--bench without searching the largest batch that fits")
  args = parser.parse_args(argv)
  if args.distributed:
    jax.distributed.initialize()
  cfg = PRESETS[args.preset or ("gpt2" if args.bench else "tiny")]
  overrides = dict(batch=args.batch, seq_len=args.seq_len, layers=args.layers, dtype=args.dtype,
                   vocab=args.vocab or (50257 if args.bench else None))
  cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
  mesh = make_mesh(args.mesh)
  print(f"{cfg} on {jax.device_count()} x {jax.devices()[0].device_kind}, mesh "
        f"{dict(mesh.shape)}", file=sys.stderr, flush=True)
  record = dict(_environment(argv), config=dataclasses.asdict(cfg), mesh=dict(mesh.shape),
                packed=args.packed)
  if args.bench:
    variants = ["fused", "unfused-xla" if not args.packed else "unfused-default"]
    if jax.devices()[0].platform == "gpu":
      variants.append("unfused-cudnn")
    variants = args.variants.split(",") if args.variants else variants
    record["rows"] = bench(cfg, variants, mesh, packed=args.packed, steps=args.steps,
                           find_max_batch=not args.no_max_batch)
  else:
    unfused = f"unfused-{args.attention}"
    variants = (["fused", unfused] if args.compare else
                [unfused] if args.unfused else ["fused"])
    curves = {v: train(cfg, v, args.steps, mesh=mesh, packed=args.packed) for v in variants}
    record["losses"] = curves
    if args.compare:
      a, b = (np.asarray(c) for c in curves.values())
      record["largest_loss_difference"] = float(np.max(np.abs(a - b)))
      print(f"largest |fused - unfused| loss difference over {args.steps} steps: "
            f"{record['largest_loss_difference']:.4f}")
    if args.plot:
      plot(args.plot, curves)
  if args.json and jax.process_index() == 0:
    with open(args.json, "w") as f:
      json.dump(record, f, indent=1)
  return record


if __name__ == "__main__":
  main()
