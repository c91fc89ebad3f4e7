"""The bench harness's verdicts: a comparator that is not installed is noted and passes, a
jaxfuse implementation that is wrong or crashes fails the job."""

import dataclasses

import jax.numpy as jnp

from jaxfuse import cli
from jaxfuse._core import bench


def _case(forward):
  return bench.Case(op="probe", label="8x16 float32", size=16,
                    make_inputs=lambda key: (jnp.linspace(-1.0, 1.0, 128).reshape(8, 16),),
                    forward=forward, train=None, forward_work=1.0, train_work=1.0,
                    implementations=("xla", "optax", "triton"))


def _forward(wrong=(), crash=(), missing=()):
  def make(impl):
    if impl in missing:
      import jaxfuse_no_such_module  # noqa: F401
    if impl in crash:
      raise RuntimeError("kernel exploded")
    return (lambda x: x * 1.5) if impl in wrong else (lambda x: x * 1.0)
  return make


def _notes(rows):
  return {r.implementation: r.note for r in rows}


def test_missing_comparator_is_noted_not_failed():
  rows, _ = bench.run([_case(_forward(missing=("optax",)))], time_it=False)
  notes = _notes(rows)
  assert notes["optax"] == "not installed: jaxfuse_no_such_module"
  assert notes["xla"] == "" and notes["triton"] == ""


def test_wrong_or_crashing_kernel_fails():
  rows, _ = bench.run([_case(_forward(wrong=("triton",), crash=("optax",)))], time_it=False)
  notes = _notes(rows)
  assert notes["triton"].startswith("FAILED: relative error")
  assert notes["optax"].startswith("comparator failed: RuntimeError")
  rows, _ = bench.run([_case(_forward(crash=("triton",)))], time_it=False)
  assert _notes(rows)["triton"].startswith("FAILED: RuntimeError")


def test_exit_code_counts_only_jaxfuse_failures(monkeypatch, capsys):
  monkeypatch.setattr(cli, "_cases", lambda names, quick: (
      [_case(_forward(missing=("optax",)))], []))
  run = bench.run
  monkeypatch.setattr(bench, "run", lambda cases, implementations=None, on_case=None:
                      run(cases, time_it=False))
  assert cli.main(["bench"]) == 0
  monkeypatch.setattr(cli, "_cases", lambda names, quick: (
      [_case(_forward(wrong=("triton",)))], []))
  assert cli.main(["bench"]) == 1
  assert "FAILED: probe 8x16 float32 triton" in capsys.readouterr().err


def test_only_keeps_the_cases_whose_label_has_the_text(monkeypatch):
  ran = []
  monkeypatch.setattr(cli, "_cases", lambda names, quick: (
      [dataclasses.replace(_case(_forward()), label=label)
       for label in ("4x4096 causal", "4x4096 window (256, 256)", "4x4096 full")], []))
  monkeypatch.setattr(bench, "run", lambda cases, implementations=None, on_case=None:
                      (ran.extend(c.label for c in cases), ([], {}))[1])
  monkeypatch.setattr(bench, "table", lambda rows, ceilings: "")
  assert cli.main(["bench", "--only", "window (256, 256)", "--only", "causal"]) == 0
  assert ran == ["4x4096 causal", "4x4096 window (256, 256)"]
