"""The training examples run a few steps on tiny configurations, fused and unfused alike."""

import dataclasses
import gc
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("optax")

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import gpt  # noqa: E402


def _tiny(**changes):
  return dataclasses.replace(gpt.PRESETS["tiny"], **changes)


def _loss_and_gradients(cfg, variant, batch):
  graphdef, params = nnx.split(gpt.build(cfg, variant))
  loss = lambda params: nnx.merge(graphdef, params).loss(*batch)
  return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("dtype,packed,tolerance", [("float32", True, 1e-5),
                                                    ("bfloat16", False, 3e-2)],
                         ids=["float32-packed", "bfloat16-stream"])
def test_gpt_fused_and_unfused_losses_and_gradients_match(dtype, packed, tolerance):
  """The two models hold the same parameters: one batch's loss and every gradient agree.
  Compared directly rather than through training steps, whose Adam updates would hide a
  wrongly scaled gradient (training is compared in the sharded test)."""
  cfg = _tiny(dtype=dtype, layers=1, seq_len=64)
  batch = gpt.text_batch(np.random.default_rng(0), cfg, packed)
  fused_loss, fused = _loss_and_gradients(cfg, "fused", batch)
  unfused_loss, unfused = _loss_and_gradients(cfg, "unfused-xla", batch)
  np.testing.assert_allclose(fused_loss, unfused_loss, rtol=tolerance)
  # Relative to the largest gradient: some are zero up to rounding (the key bias's).
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(unfused))
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(fused),
                               jax.tree.leaves(unfused)):
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * scale,
                               err_msg=jax.tree_util.keystr(path))


def test_packed_rows_restart_positions_and_drop_labels_across_documents():
  rng = np.random.default_rng(3)
  cfg = _tiny(seq_len=4097 // 4, batch=3)
  for batch in (gpt.text_batch(rng, cfg, packed=True), gpt.random_batch(rng, cfg, packed=True)):
    tokens, labels, positions, segments = batch
    assert tokens.shape == labels.shape == positions.shape == segments.shape == (3, cfg.seq_len)
    for row in range(3):
      for t in range(cfg.seq_len):
        start = t == 0 or segments[row, t] != segments[row, t - 1]
        assert positions[row, t] == (0 if start else positions[row, t - 1] + 1)
        last = t + 1 < cfg.seq_len and segments[row, t + 1] != segments[row, t]
        if last:
          assert labels[row, t] == -1
        elif t + 1 < cfg.seq_len:
          assert labels[row, t] == tokens[row, t + 1]
  assert np.all(np.diff(segments, axis=1) >= 0) and (segments[:, -1] == 3).all()


def test_gpt_bench_reports_every_variant(tmp_path):
  out = tmp_path / "bench.json"
  record = gpt.main(["--bench", "--preset", "tiny", "--layers", "1", "--seq-len", "32",
                     "--vocab", "300", "--batch", "8", "--steps", "10", "--no-max-batch",
                     "--json", str(out)])
  assert [r["variant"] for r in record["rows"]] == ["fused", "unfused-xla"]
  assert json.loads(out.read_text())["rows"][0]["tokens_per_s"] > 0
  assert all(r["temp_bytes"] > 0 for r in record["rows"])


_SHARDED = textwrap.dedent("""
    import re, sys
    sys.path.insert(0, sys.argv[1])
    import dataclasses, jax, numpy as np, gpt
    assert jax.device_count() == 8
    from jaxfuse.ops.linear_cross_entropy import reference
    cfg = dataclasses.replace(gpt.PRESETS["tiny"], dtype="float32", layers=1, seq_len=64)
    reference.CHUNK_ELEMENTS = 32 * cfg.vocab  # several loss chunks per device, as at GPT-2's
    for spec in ("8,1", "4,2"):
      mesh = gpt.make_mesh(spec)
      trainer = gpt.Trainer(cfg, "fused", mesh, 4)
      hlo = trainer.compiled(cfg.batch, True).as_text()
      assert not re.search(r"all-gather(-start)?\\(", hlo), spec
      assert re.search(r"all-reduce(-start)?\\(", hlo), spec  # the gradients' sum
      kernel = trainer.params["blocks"][0]["mlp"]["fc"]["kernel"][...]
      assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    # Data and model parallel at once (the last mesh): the fused model trains as the unfused.
    fused, unfused = (gpt.train(cfg, variant, 4, mesh=mesh, packed=True, progress=False)
                      for variant in ("fused", "unfused-xla"))
    assert fused[-1] < fused[0]  # it learns
    np.testing.assert_allclose(fused, unfused, rtol=1e-5)
    print("ok")
""")


def test_gpt_sharded_step_adds_no_all_gathers():
  # The suite's flags (conftest.py) and eight devices whatever they say.
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _SHARDED, str(EXAMPLES)], env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_lstm_language_model_fused_and_unfused_losses_match():
  import lstm_lm
  cfg = dataclasses.replace(lstm_lm.PRESETS["tiny"], seq_len=17, batch=5, hidden=24)
  unfused, fused = lstm_lm.build_pair(cfg)
  losses = [lstm_lm.train(cfg, model, 4, name=name, progress=False)
            for name, model in (("fused", fused), ("unfused", unfused))]
  assert losses[0][-1] < losses[0][0]
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


def test_ragged_batches_are_zero_past_each_length():
  import lstm_lm
  cfg = lstm_lm.PRESETS["tiny"]
  tokens, labels, lengths = lstm_lm.ragged_batch(np.random.default_rng(1), cfg)
  assert tokens.shape == labels.shape == (cfg.batch, cfg.seq_len)
  assert lengths.min() >= cfg.seq_len // 4 and lengths.max() <= cfg.seq_len
  past = np.arange(cfg.seq_len) >= lengths[:, None]
  assert (tokens[past] == 0).all() and (labels[past] == 0).all()
  inside = ~past[:, :-1] & ~past[:, 1:]
  np.testing.assert_array_equal(labels[:, :-1][inside], tokens[:, 1:][inside])


def test_gpt_variant_names_the_fused_layers_implementations():
  """``fused:<layer>=<implementation>+...`` reaches the layers; other forms are refused."""
  cfg = _tiny(layers=2)
  model = gpt.build(cfg, "fused:attention=xla+mlp=xla+norm=xla")
  assert all(b.attn.implementation == b.mlp.implementation == b.ln1.implementation ==
             b.ln2.implementation == "xla" for b in model.blocks)
  assert model.ln_f.implementation == "xla"
  assert gpt.build(cfg, "fused").blocks[0].mlp.implementation is None
  for bad in ("fused:loss=xla", "fused:mlp", "fused:mlp=xla+mlp=cuda", "unfused-xla:mlp=xla"):
    with pytest.raises(ValueError, match="only 'fused' takes"):
      gpt.build(cfg, bad)


def test_gpt_bench_windows_take_turns_and_a_failing_run_leaves_them():
  """Each window runs one variant's steps after the other's; a run that raises leaves with its
  error while the rest go on; Python's collector is on again afterwards."""
  order = []

  def run_of(name, fail_at=None):
    def run(i):
      if i == fail_at:
        raise RuntimeError("out of memory")
      order.append((name, i))
      return np.float32(i)
    return run

  timed = gpt.step_windows({"a": run_of("a"), "b": run_of("b", fail_at=12)}, steps=30,
                           window=5)
  assert order[:10] == [("a", i) for i in range(5)] + [("b", i) for i in range(5)]
  assert len(timed["a"].ms) == 6 and timed["a"].loss == 29 and timed["a"].error is None
  assert len(timed["b"].ms) == 2 and "out of memory" in timed["b"].error
  assert gc.isenabled()
