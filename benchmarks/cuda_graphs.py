"""Whole jitted training steps of small layers with XLA's CUDA graphs on and off.

    PYTHONPATH=. python benchmarks/cuda_graphs.py graphs OUT.json
    PYTHONPATH=. python benchmarks/cuda_graphs.py nographs OUT.json

A stack of LayerNorm, softmax and RMSNorm layers between matrix products, ending in a
cross-entropy, per implementation, and a one-layer LSTM, at token counts from launch-bound to
memory-bound. Each row gives the wall clock per step (the median of 7 windows of back-to-back
steps), and a digest of the first step's loss and gradients and their norms. ``nographs``
turns XLA's command buffers off (``--xla_gpu_enable_command_buffer=``): where jaxfuse's custom
calls join XLA's CUDA graphs, a launch-bound step is faster with them on.
"""

import datetime
import hashlib
import json
import os
import statistics
import sys
import time

mode, out_path = sys.argv[1], sys.argv[2]
if mode == "nographs":
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="

import jax  # noqa: E402  (XLA_FLAGS is read when jax starts)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxfuse  # noqa: E402

def digest(tree):
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    h.update(np.asarray(jax.device_get(leaf)).tobytes())
  return h.hexdigest()[:16]


def norms(tree):
  """Each output's float64 norm: the on and off runs compare by these within rounding (XLA's
  own kernels need not give the same bits with graphs on and off)."""
  return [float(np.linalg.norm(np.asarray(jax.device_get(leaf), np.float64)))
          for leaf in jax.tree.leaves(tree)]


def wall_per_step(f, args, steps=50, windows=7):
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(windows):
    t = time.perf_counter()
    for _ in range(steps):
      r = f(*args)
    jax.block_until_ready(r)
    times.append((time.perf_counter() - t) / steps * 1e3)
  return statistics.median(times)

def mlp_model(impl, layers):
  def loss(params, x, labels):
    h = x
    for w, g in params["layers"]:
      h = jaxfuse.layer_norm(h @ w, g, implementation=impl["norm"])
      h = h + jaxfuse.softmax(h, implementation=impl["softmax"])
      h = jaxfuse.rms_norm(h, g, implementation=impl["norm"])
    logits = h @ params["out"]
    return jaxfuse.softmax_cross_entropy(logits, labels, implementation=impl["ce"])
  return jax.jit(jax.value_and_grad(loss))

def lstm_model(impl):
  def loss(w, x, h0, c0, lengths):
    y, _, _ = jaxfuse.lstm(x, h0, c0, w, lengths, input_size=x.shape[-1],
                           hidden_size=h0.shape[-1], num_layers=1, implementation=impl)
    return jnp.sum(y.astype(jnp.float32) ** 2)
  return jax.jit(jax.value_and_grad(loss))

rows = []
key = jax.random.PRNGKey(0)
for tokens, width, layers in [(8, 768, 12), (256, 768, 12), (8192, 1024, 12)]:
  ks = jax.random.split(key, 2 * layers + 3)
  dt = jnp.bfloat16
  params = {"layers": [(jax.random.normal(ks[2 * i], (width, width), dt) / width ** 0.5,
                        1 + 0.1 * jax.random.normal(ks[2 * i + 1], (width,), dt))
                       for i in range(layers)],
            "out": jax.random.normal(ks[-3], (width, 4096), dt) / width ** 0.5}
  x = jax.random.normal(ks[-2], (tokens, width), dt)
  labels = jax.random.randint(ks[-1], (tokens,), 0, 4096)
  for name, impl in [("xla", dict(norm="xla", softmax="xla", ce="xla")),
                     ("triton", dict(norm="triton", softmax="triton", ce="triton")),
                     ("cuda", dict(norm="cuda", softmax="cuda", ce="cuda")),
                     ("default", dict(norm=None, softmax=None, ce=None)),
                     # None's tables send tiny cross-entropies to XLA: that choice alone.
                     ("triton, xla loss", dict(norm="triton", softmax="triton", ce="xla"))]:
    f = mlp_model(impl, layers)
    try:
      val = f(params, x, labels)
      ms = wall_per_step(f, (params, x, labels))
    except Exception as e:  # noqa: BLE001
      rows.append(dict(model="mlp", tokens=tokens, impl=name, error=str(e)[:300])); continue
    rows.append(dict(model="mlp", tokens=tokens, width=width, layers=layers, impl=name,
                     ms=ms, digest=digest(val), norms=norms(val)))
    print(rows[-1], flush=True)

for batch, hidden, steps in [(4, 256, 64), (64, 512, 128)]:
  k = jax.random.split(key, 4)
  count = jaxfuse.lstm_weight_count(hidden, hidden, 1)
  w = 0.05 * jax.random.normal(k[0], (count,), jnp.float32)
  x = jax.random.normal(k[1], (batch, steps, hidden), jnp.float32)
  h0 = jax.random.normal(k[2], (1, batch, hidden), jnp.float32)
  c0 = jax.random.normal(k[3], (1, batch, hidden), jnp.float32)
  lengths = jnp.full((batch,), steps, jnp.int32).at[0].set(steps // 2)
  for impl in ["xla", "cuda"]:
    f = lstm_model(impl)
    try:
      val = f(w, x, h0, c0, lengths)
      ms = wall_per_step(f, (w, x, h0, c0, lengths), steps=20)
    except Exception as e:  # noqa: BLE001
      rows.append(dict(model="lstm", batch=batch, impl=impl, error=str(e)[:300])); continue
    rows.append(dict(model="lstm", batch=batch, hidden=hidden, steps=steps, impl=impl, ms=ms,
                     digest=digest(val), norms=norms(val)))
    print(rows[-1], flush=True)
json.dump(dict(mode=mode, device=jax.devices()[0].device_kind, jax=jax.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=" ".join(sys.argv),
               xla_flags=os.environ.get("XLA_FLAGS", ""), rows=rows),
          open(out_path, "w"), indent=1)
