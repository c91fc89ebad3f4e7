"""A 2-layer LSTM language model over ragged batches, with jaxfuse's LSTM or flax's.

    python examples/lstm_lm.py                       # tiny model, stdlib corpus, fused
    python examples/lstm_lm.py --unfused             # flax nnx.RNN(OptimizedLSTMCell), optax
    python examples/lstm_lm.py --compare --steps 200 --plot lstm.png
    python examples/lstm_lm.py --bench --preset base  # training steps per second, side by side

Each row of a batch is a window of the Python standard library's source (bytes) of its own
random length: the batch is ragged, the padding past each row's length takes no part in the
recurrence, the loss or the gradients. The fused model runs ``jaxfuse.nn.LSTM`` (all layers in
one call of ``jaxfuse.lstm``, persistent kernels on a GPU) and ``jaxfuse.nn.cross_entropy_loss``;
the unfused one a stack of ``nnx.RNN(nnx.OptimizedLSTMCell)`` and optax's loss. Both start
from the same parameters: flax's cells, packed into cuDNN's flat layout for the fused model.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxfuse
import jaxfuse.nn as jnn
from gpt import plot, run_steps, stdlib_stream, step_ms


@dataclasses.dataclass(frozen=True)
class Config:
  embed: int
  hidden: int
  layers: int
  seq_len: int
  batch: int
  learning_rate: float = 2e-3
  vocab: int = 256


PRESETS = {
    "tiny": Config(embed=32, hidden=64, layers=2, seq_len=48, batch=8),
    "base": Config(embed=256, hidden=512, layers=2, seq_len=512, batch=32),
}


class LanguageModel(nnx.Module):

  def __init__(self, cfg: Config, *, fused: bool, rngs: nnx.Rngs):
    self.fused = fused
    self.embed = nnx.Embed(cfg.vocab, cfg.embed, rngs=rngs)
    if fused:
      self.lstm = jnn.LSTM(cfg.embed, cfg.hidden, num_layers=cfg.layers, rngs=rngs)
    else:
      sizes = [cfg.embed] + [cfg.hidden] * (cfg.layers - 1)
      # No random stream kept (rngs=False): the initial carry is given, zeros.
      cells = [nnx.RNN(nnx.OptimizedLSTMCell(n, cfg.hidden, rngs=rngs), rngs=False)
               for n in sizes]
      self.lstm = nnx.List(cells) if hasattr(nnx, "List") else cells
    self.head = nnx.Linear(cfg.hidden, cfg.vocab, rngs=rngs)

  def loss(self, tokens, labels, lengths):
    """Mean next-byte cross-entropy over each row's first ``lengths`` positions."""
    x = self.embed(tokens)
    if self.fused:
      x, _ = self.lstm(x, lengths)
    else:
      zeros = jnp.zeros((tokens.shape[0], self.head.in_features), x.dtype)
      for layer in self.lstm:
        x = layer(x, initial_carry=(zeros, zeros), seq_lengths=lengths)
    logits = self.head(x)
    counted = jnp.arange(tokens.shape[1]) < lengths[:, None]
    if self.fused:
      return jnn.cross_entropy_loss(logits, labels, where=counted)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(jnp.where(counted, losses, 0.0)) / jnp.maximum(jnp.sum(counted), 1)


def input_bias_frozen(cfg: Config) -> jax.Array:
  """1 for each of the fused LSTM's weights, 0 for its input biases b_ih: flax's cell has one
  bias per gate where cuDNN's layout has two, so the fused model keeps b_ih at zero to train
  the same function (two biases would move at twice Adam's step)."""
  ones = lambda shape: {p: jnp.ones(shape(p)) for p in range(cfg.layers)}
  inputs = lambda p: cfg.embed if p == 0 else cfg.hidden
  bias = ones(lambda p: (4 * cfg.hidden,))
  return jaxfuse.pack_lstm_weights(ones(lambda p: (4 * cfg.hidden, inputs(p))),
                                   ones(lambda p: (4 * cfg.hidden, cfg.hidden)),
                                   jax.tree.map(jnp.zeros_like, bias), bias)


def build_pair(cfg: Config, seed: int = 0):
  """The unfused and fused models, holding the same parameters."""
  unfused = LanguageModel(cfg, fused=False, rngs=nnx.Rngs(seed))
  fused = LanguageModel(cfg, fused=True, rngs=nnx.Rngs(seed))
  fused.lstm.weights[...] = jnn.lstm_weights_from_flax(unfused.lstm)
  # Copies: each model's training step donates its own buffers.
  nnx.update(fused.embed, jax.tree.map(jnp.copy, nnx.state(unfused.embed)))
  nnx.update(fused.head, jax.tree.map(jnp.copy, nnx.state(unfused.head)))
  return unfused, fused


def ragged_batch(rng, cfg: Config):
  """``(tokens, labels, lengths)``: windows of the corpus, each row of a random length in
  ``[seq_len / 4, seq_len]``, zero past it."""
  stream = stdlib_stream()
  starts = rng.integers(0, stream.size - cfg.seq_len - 1, cfg.batch)
  rows = np.stack([stream[s:s + cfg.seq_len + 1] for s in starts]).astype(np.int32)
  lengths = rng.integers(cfg.seq_len // 4, cfg.seq_len + 1, cfg.batch).astype(np.int32)
  keep = np.arange(cfg.seq_len) < lengths[:, None]
  return (np.where(keep, rows[:, :-1], 0), np.where(keep, rows[:, 1:], 0), lengths)


def make_train_step(graphdef, rest, cfg: Config):
  """The jitted step over the parameters (``rest``: what else the modules hold, such as
  ``nnx.RNN``'s random streams)."""
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(cfg.learning_rate))

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: nnx.merge(graphdef, p, rest).loss(*batch))(params)
    if "weights" in grads["lstm"]:  # the fused model
      grads["lstm"]["weights"][...] = grads["lstm"]["weights"][...] * input_bias_frozen(cfg)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return tx, train_step


def train(cfg: Config, model, steps: int, *, name: str, seed: int = 0, progress=True):
  """Per-step losses of ``steps`` steps on the stdlib corpus (the same batches for a seed)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx, step = make_train_step(graphdef, rest, cfg)
  opt_state = tx.init(params)
  rng = np.random.default_rng(seed)
  state = [params, opt_state]

  def one_step():
    state[0], state[1], loss = step(*state, ragged_batch(rng, cfg))
    return loss

  return run_steps(one_step, steps, cfg.batch * cfg.seq_len, name if progress else None)


def bench(cfg: Config, steps: int = 100):
  """Training-step milliseconds and tokens/s (padding included) of both models."""
  rows = []
  for name, model in zip(("unfused", "fused"), build_pair(cfg)):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx, step = make_train_step(graphdef, rest, cfg)
    state = [params, tx.init(params)]
    batch = jax.device_put(ragged_batch(np.random.default_rng(0), cfg))

    def run(_):
      state[0], state[1], loss = step(*state, batch)
      return loss

    windows, _ = step_ms(run, steps)
    ms = statistics.median(windows)
    rows.append(dict(variant=name, step_ms=ms, step_ms_windows=windows,
                     tokens_per_s=cfg.batch * cfg.seq_len / ms * 1e3))
    print(f"{name:>8}  {ms:8.2f} ms/step (windows {min(windows):.2f}-{max(windows):.2f}, "
          f"{len(windows)})  {rows[-1]['tokens_per_s']:10,.0f} tokens/s", flush=True)
  return rows


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", choices=PRESETS, default="tiny")
  group = parser.add_mutually_exclusive_group()
  group.add_argument("--fused", dest="unfused", action="store_false", default=False)
  group.add_argument("--unfused", action="store_true")
  group.add_argument("--compare", action="store_true", help="train both on the same batches")
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--plot", default=None, help="loss-curve PNG path")
  parser.add_argument("--json", default=None, help="write losses or bench rows here")
  parser.add_argument("--bench", action="store_true")
  args = parser.parse_args(argv)
  cfg = PRESETS[args.preset]
  print(f"{cfg} on {jax.devices()[0].device_kind}", file=sys.stderr, flush=True)
  from jaxfuse._core.bench import environment
  record = dict(environment("python examples/lstm_lm.py"), config=dataclasses.asdict(cfg),
                timing="wall clock per step: step_ms the median over windows of 10 steps "
                       "(step_ms_windows), the device waited on only at each window's ends, "
                       "Python's collector run between them")
  if args.bench:
    record["rows"] = bench(cfg, args.steps)
  else:
    unfused, fused = build_pair(cfg)
    models = ({"fused": fused, "unfused": unfused} if args.compare else
              {"unfused": unfused} if args.unfused else {"fused": fused})
    curves = {name: train(cfg, model, args.steps, name=name) for name, model in models.items()}
    record["losses"] = curves
    if args.compare:
      difference = float(np.max(np.abs(np.subtract(*curves.values()))))
      record["largest_loss_difference"] = difference
      print(f"largest |fused - unfused| loss difference over {args.steps} steps: "
            f"{difference:.5f}")
    if args.plot:
      plot(args.plot, curves, title="2-layer LSTM on the stdlib corpus")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(record, f, indent=1)
  return record


if __name__ == "__main__":
  main()
