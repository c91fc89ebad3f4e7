"""The bench harness's verdicts: a comparator that is not installed is noted and passes, a
jaxfuse implementation that is wrong or crashes fails the job."""

import dataclasses
import importlib.util
import json
import shlex
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from jaxfuse import cli
from jaxfuse._core import bench, ceilings, registry, report, timing
from jaxfuse.ops.rnn import bench as rnn_bench
from jaxfuse.ops.softmax import bench as softmax_bench


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


def test_a_comparator_may_report_its_training_steps_temporary_memory():
  t = timing.Timing(1.0, 1.0, 1.0, 1)
  case = dataclasses.replace(_case(_forward()), implementations=(), external={
      "torch": lambda inputs: (t, t, 12.5), "other": lambda inputs: (t, t)})
  rows, _ = bench.run([case])
  assert {r.implementation: r.train_temp_mib for r in rows} == {"torch": 12.5, "other": None}
  assert all(r.time_s >= 0 for r in rows)  # a sweep's time spent on comparators shows


def test_exit_code_counts_only_jaxfuse_failures(monkeypatch, capsys):
  monkeypatch.setattr(cli, "_cases", lambda names, quick, regret: (
      [("norm", _case(_forward(missing=("optax",))))], []))
  run = bench.run
  monkeypatch.setattr(bench, "run", lambda cases, **_: run(cases, time_it=False))
  assert cli.main(["bench"]) == 0
  monkeypatch.setattr(cli, "_cases", lambda names, quick, regret: (
      [("norm", _case(_forward(wrong=("triton",))))], []))
  assert cli.main(["bench"]) == 1
  assert "FAILED: probe 8x16 float32 triton" in capsys.readouterr().err


def test_only_keeps_the_cases_whose_label_has_the_text(monkeypatch):
  ran = []
  monkeypatch.setattr(cli, "_cases", lambda names, quick, regret: (
      [("attention", dataclasses.replace(_case(_forward()), label=label))
       for label in ("4x4096 causal", "4x4096 window (256, 256)", "4x4096 full")], []))
  monkeypatch.setattr(bench, "run", lambda cases, **_: (ran.extend(c.label for c in cases),
                                                        ([], {}))[1])
  monkeypatch.setattr(report, "table", lambda rows, ceilings: "")
  assert cli.main(["bench", "--only", "window (256, 256)", "--only", "causal"]) == 0
  assert ran == ["4x4096 causal", "4x4096 window (256, 256)"]


def test_graph_every_program_asks_xla_to_graph_every_program_and_is_recorded(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
  probe = types.SimpleNamespace(op="probe", label="probe", size=1, implementations=("xla",),
                                check_only=(), external={})
  monkeypatch.setattr(cli, "_cases", lambda names, quick, regret: ([("norm", probe)], []))
  monkeypatch.setattr(bench, "run", lambda cases, **_: ([], {}))
  monkeypatch.setattr(report, "table", lambda rows, ceilings: "")
  assert cli.main(["bench", "--graph-every-program"]) == 0
  flags = "--xla_dump_to=/nowhere --xla_gpu_graph_min_graph_size=1"
  assert bench.environment()["xla_flags"] == flags


def _timed_row(label, impl, forward_ms, train_ms=None, op="probe"):
  return bench.Row(op, label, 16, impl, "GB/s", forward_ms=forward_ms, train_ms=train_ms)


def test_regret_is_the_fastest_named_time_over_nones():
  rows = [_timed_row("a", "xla", 2.0, 4.0), _timed_row("a", "triton", 1.0, 5.0),
          _timed_row("a", "optax", 0.5, 0.5), _timed_row("a", bench.DEFAULT, 1.25, 4.0),
          _timed_row("b", "xla", 3.0), _timed_row("b", "cuda", None),
          _timed_row("b", bench.DEFAULT, 3.0), _timed_row("c", "xla", 1.0)]
  found = report.regrets(rows)
  assert [(r.label, r.direction, r.regret, r.fastest) for r in found] == [
      ("a", "forward", 0.8, "triton"), ("a", "step", 1.0, "xla"), ("b", "forward", 1.0, "xla")]
  text = report.regret_table(found)
  assert "probe                    worst 0.800 (a forward, triton)" in text
  assert f"geometric mean {0.8 ** (1 / 3):.3f} over 3 points" in text


def test_a_grid_weighs_none_against_the_faster_comparator_and_draws_heat_maps(tmp_path,
                                                                              capsys):
  rows = [_timed_row("LSTM 4x8x64x64 L1 float32", impl, f, s, op="lstm")
          for impl, f, s in (("torch", 2.0, 4.0), ("cudnn", 3.0, 3.0), ("xla", 0.5, 0.5),
                             (bench.DEFAULT, 1.0, 6.0))]
  found = report.regrets(rows, against=("torch", "cudnn").__contains__)
  assert [(r.direction, r.regret, r.fastest) for r in found] == [
      ("forward", 2.0, "torch"), ("step", 0.5, "cudnn")]
  from jaxfuse.ops.rnn import bench as rnn_bench
  assert rnn_bench.grid_place("LSTM 4x8x64x64 L2 bi bfloat16") == ("LSTM L2 bi bfloat16", 4, 64)
  path = tmp_path / "grid.png"
  report.save_heatmaps(str(path), found, lambda r: rnn_bench.grid_place(r.label))
  assert path.stat().st_size > 0
  assert report.save_heatmaps(str(tmp_path / "none.png"), [], lambda r: ("", 0, 0)) is False
  for args in (["norm", "--grid"], ["rms_norm", "--grid"], ["rnn", "--grid", "--regret"]):
    with pytest.raises(SystemExit):
      cli.main(["bench", *args])
    assert "--grid" in capsys.readouterr().err


def test_a_grid_timed_in_parts_is_reported_from_the_saved_runs(tmp_path, capsys):
  """--from takes each point's rows from the last run that timed it, never a ratio across
  runs, and refuses runs of another mode, GPU or timing."""
  label = "LSTM 4x8x64x64 L1 float32"

  def saved(name, rows, **extra):
    path = tmp_path / name
    report.save_json(str(path), rows, {}, regrets=[], **extra)
    return str(path)

  first = saved("first.json", [_timed_row(label, "torch", 2.5, 2.5, "lstm"),
                               _timed_row(label, bench.DEFAULT, 1.0, 1.0, "lstm"),
                               _timed_row("GRU 1x8x64x64 L1 float32", "torch", 3.0, 3.0, "gru"),
                               _timed_row("GRU 1x8x64x64 L1 float32", bench.DEFAULT, 1.0,
                                          1.5, "gru")], against=["torch"])
  # A later part times the LSTM point again, its None row alone: the point is that run's.
  second = saved("second.json", [_timed_row(label, bench.DEFAULT, 4.0, 4.0, "lstm")],
                 against=["torch"])
  plot = tmp_path / "grid.png"
  assert cli.main(["bench", "--grid", "--from", first, "--plot", str(plot)]) == 0
  out = capsys.readouterr().out
  assert "first.json: 2 shapes (" in out and "worst 2.000 (GRU 1x8x64x64 L1 float32 step" in out
  assert plot.stat().st_size > 0
  assert cli.main(["bench", "--grid", "--from", first, "--from", second]) == 0
  out = capsys.readouterr().out
  assert "second.json: 1 shape, 1 of them timed again" in out
  assert "LSTM 4x8x64x64 L1 float32" not in out.split("second.json")[1]
  assert "over 2 points" in out  # the GRU's forward and step; the LSTM point has no comparator
  regret = saved("regret.json", [_timed_row(label, "xla", 1.0, 1.0, "lstm")])
  assert cli.main(["bench", "--grid", "--from", regret]) == 2
  assert "is not a run of --grid" in capsys.readouterr().err
  graphs = tmp_path / "graphs.json"
  record = json.loads(Path(first).read_text())
  graphs.write_text(json.dumps({**record, "xla_flags": "--xla_gpu_graph_min_graph_size=1"}))
  assert cli.main(["bench", "--grid", "--from", first, "--from", str(graphs)]) == 2
  assert "differ in GPU or timing" in capsys.readouterr().err
  for args in (["--from", first], ["--grid", "--from", first, "--only", "L1"],
               ["rnn", "--grid", "--from", first]):
    with pytest.raises(SystemExit):
      cli.main(["bench", *args])
    assert "--from" in capsys.readouterr().err


def test_a_bench_run_cut_short_is_resumed_where_it_stopped(tmp_path, monkeypatch, capsys):
  asked = []

  def run(todo, on_case=None, **_):
    # Times the first case, then the run is cut short (a time limit, say).
    asked.append([c.label for c in todo])
    rows = [_timed_row(todo[0].label, impl, 1.0, 1.0, todo[0].op)
            for impl in todo[0].implementations]
    on_case(rows, {})
    if len(asked) == 1:
      raise KeyboardInterrupt
    return rows, {}

  monkeypatch.setattr(bench, "run", run)
  path = str(tmp_path / "grid.json")
  cases = rnn_bench.grid_cases()
  labels = [c.label for c in cases]
  with pytest.raises(KeyboardInterrupt):
    cli.main(["bench", "rnn", "--grid", "--json", path])
  assert cli.main(["bench", "rnn", "--grid", "--json", path, "--resume"]) == 0
  assert asked == [labels, labels[1:]]
  assert f"1 cases timed, {len(labels) - 1} left" in capsys.readouterr().out
  assert [r["label"] for r in json.loads(Path(path).read_text())["rows"]] == [
      case.label for case in cases[:2] for _ in case.implementations]
  # Only a run of the same mode, GPU and timing goes on.
  assert cli.main(["bench", "rnn", "--regret", "--json", path, "--resume"]) == 2
  assert "was timed otherwise" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(["bench", "rnn", "--grid", "--resume"])
  assert "--resume" in capsys.readouterr().err


def test_a_point_is_launch_bound_where_nones_span_passes_twice_its_busy_time():
  rows = [_timed_row("a", "xla", 1.0), _timed_row("a", bench.DEFAULT, 3.0),
          _timed_row("b", "xla", 1.0), _timed_row("b", bench.DEFAULT, 1.5)]
  rows[1].forward_busy_ms = 1.4
  rows[3].forward_busy_ms = 1.0
  found = report.regrets(rows)
  assert [r.launch_bound for r in found] == [True, False]
  text = report.regret_table(found)
  assert "a                            forward    0.333 xla" in text and "launch-bound" in text
  assert "worst 0.667 (b forward, xla), geometric mean 0.667 over 1 points (not launch-bound)" \
      in text


def test_the_regret_table_sums_up_each_use_apart():
  # None at half the comparator's speed in the forward and twice it in the training step.
  rows = [_timed_row("a", "torch", 1.0, 4.0), _timed_row("a", bench.DEFAULT, 2.0, 2.0)]
  text = report.regret_table(report.regrets(rows, against="torch".__eq__))
  assert "geometric mean 1.000 over 2 points\n" in text
  assert "worst 0.500 (a forward, torch), geometric mean 0.500 over 1 points (forward only)" \
      in text
  assert "worst 2.000 (a step, torch), geometric mean 2.000 over 1 points (step only)" in text


def test_regret_by_choice_weighs_the_named_row_of_what_none_ran():
  rows = [_timed_row("a", "xla", 1.0, 2.0), _timed_row("a", "cuda", 1.1, 1.0),
          _timed_row("a", bench.DEFAULT, 1.25, 1.25), _timed_row("b", "xla", 1.0, 1.0),
          _timed_row("b", "cuda", 0.9, 1.0), _timed_row("b", bench.DEFAULT, 0.95, 1.0)]
  rows[0].forward_ran, rows[1].train_ran = "xla", "cuda"
  rows[2].forward_ran, rows[2].train_ran = "xla", "xla+cuda"
  rows[3].forward_ran, rows[4].forward_ran, rows[5].forward_ran = "xla", "cuda", "xla"
  found = report.regrets(rows)
  # a: None ran the fastest (its own row timed slower: 1 by choice); its step ran a pair no
  # named row ran (the regret). b: None ran the slower XLA, its own row timed between both.
  assert [(r.label, r.direction, r.ran, r.regret, r.by_choice) for r in found][:3] == [
      ("a", "forward", "xla", 0.8, 1.0), ("a", "step", "xla+cuda", 0.8, 0.8),
      ("b", "forward", "xla", 0.9 / 0.95, 0.9)]
  text = report.regret_table(found)
  assert "forward    0.800 xla      xla" in text
  assert "worst 0.800 (a step, cuda), geometric mean " in text
  assert f"{(0.8 * 0.9) ** 0.25:.3f} over 4 points (by choice)" in text


def test_the_memory_table_weighs_nones_step_memory_against_a_comparators_peak():
  rows = [_timed_row(label, impl, 1.0, op=op) for op, label in
          (("lstm", "a"), ("lstm", "b"), ("gru", "c"), ("gru", "d"))
          for impl in (bench.DEFAULT, "torch")]
  for row, mib in zip(rows, (1.0, 4.0, 3.0, 1.5, 2.0, 2.0, 8.0, None)):
    row.train_temp_mib = mib
  text = report.memory_table(rows, "torch").splitlines()
  assert text == [
      "lstm                     geometric mean 0.71 over 2 points, most 2.00 (b: 3.0 MiB "
      "against 1.5), least 0.25 (a: 1.0 MiB against 4.0)",
      "gru                      geometric mean 1.00 over 1 points, most 1.00 (c: 2.0 MiB "
      "against 2.0), least 1.00 (c: 2.0 MiB against 2.0)",
      "all                      geometric mean 0.79 over 3 points, most 2.00 (b: 3.0 MiB "
      "against 1.5), least 0.25 (a: 1.0 MiB against 4.0)"]
  assert "no point" in report.memory_table(rows, "jax.experimental.rnn")


def test_the_bench_records_what_each_program_of_none_ran():
  from jaxfuse.ops.norm import bench as norm_bench
  rows, _ = bench.run(norm_bench.regret_cases()[:1], time_it=False)
  ran = {r.implementation: (r.forward_ran, r.train_ran) for r in rows}
  assert ran == {"xla": ("xla", "xla"), bench.DEFAULT: ("xla", "xla")}


@pytest.mark.skipif(registry.pallas_triton is None, reason="needs Pallas Triton")
def test_the_row_without_triton_traces_none_with_triton_switched_off(monkeypatch):
  monkeypatch.delenv(registry.WITHOUT_TRITON_VARIABLE, raising=False)
  seen = {}

  def forward(impl):
    def fn(x):
      seen[impl] = registry.triton_unavailable()
      return x
    return fn

  case = dataclasses.replace(_case(forward), implementations=(
      "xla", bench.DEFAULT, bench.DEFAULT_WITHOUT_TRITON))
  rows, _ = bench.run([case], time_it=False)
  assert [r.note for r in rows] == ["", "", ""]
  assert seen["xla"] is None and seen[bench.DEFAULT] is None
  assert "switched off" in seen[bench.DEFAULT_WITHOUT_TRITON]
  assert not bench.is_comparator(bench.DEFAULT_WITHOUT_TRITON)


def test_without_triton_adds_nones_row_without_triton_and_weighs_it(monkeypatch, capsys,
                                                                    tmp_path):
  asked = []

  def run(cases, implementations=None, **_):
    asked.extend(c.implementations for c in cases)
    times = {"xla": 1.0, bench.DEFAULT: 1.0, bench.DEFAULT_WITHOUT_TRITON: 1.25}
    return [_timed_row(c.label, impl, times.get(impl, 1.0), 2.0, c.op)
            for c in cases for impl in c.implementations], {}

  monkeypatch.setattr(bench, "run", run)
  case = dataclasses.replace(_case(_forward()), implementations=("xla", bench.DEFAULT))
  monkeypatch.setattr(cli, "_cases", lambda names, quick, mode: ([("norm", case)], []))
  path = tmp_path / "run.json"
  assert cli.main(["bench", "norm", "--without-triton", "--json", str(path)]) == 0
  assert asked
  assert all(impls[impls.index(bench.DEFAULT) + 1] == bench.DEFAULT_WITHOUT_TRITON
             for impls in asked)
  out = capsys.readouterr().out
  assert "None without Pallas Triton" in out and "worst 0.800" in out
  assert "no Triton ran" in out and "no Triton ms" in out
  saved = json.loads(path.read_text())
  assert {r["regret"] for r in saved["without_triton"] if r["direction"] == "forward"} == {0.8}


def test_regret_runs_the_families_regret_grids(monkeypatch, capsys, tmp_path):
  monkeypatch.setattr(bench, "run", lambda cases, **_: (
      [_timed_row(c.label, impl, 1.0, 2.0, c.op) for c in cases for impl in c.implementations],
      {}))
  path = tmp_path / "regret.json"
  assert cli.main(["bench", "norm", "--regret", "--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "all                      worst 1.000" in out
  saved = json.loads(path.read_text())
  # The CPU grid: RMSNorm and LayerNorm, each with XLA and None, forward and step.
  assert [(r["op"], r["direction"]) for r in saved["regrets"]] == [
      ("rms_norm", "forward"), ("rms_norm", "step"), ("layer_norm", "forward"),
      ("layer_norm", "step")]


def test_calls_split_into_span_and_busy():
  # Three calls of two activities each, the second call with a gap inside it.
  intervals = [(0, 10), (10, 30), (40, 50), (70, 80), (90, 95), (95, 100)]
  assert timing.split_calls(intervals, 3) == [(30, 30), (40, 20), (10, 10)]
  # Activities of one call that overlap (two streams) count once in busy, fully in span.
  assert timing.split_calls([(0, 10), (5, 20), (30, 40), (32, 38)], 2) == [(20, 20), (10, 10)]


def test_two_streams_activities_at_the_same_times_count_apart(tmp_path, monkeypatch):
  # Each call runs a kernel on each of two streams, launched together, then on the first a
  # kernel and a copy of no length at the same time; that stream's line shows each call's first
  # kernel twice.
  streams = {"Stream #1": [e for b in (0, 20, 40) for e in ((b, b + 10), (b, b + 10),
                                                             (b + 10, b + 10),
                                                             (b + 10, b + 10, "copy"))],
             "Stream #2": [(b, b + 10) for b in (0, 20, 40)], "XLA Ops": [(0, 50)]}
  event = lambda start, end, name="kernel": types.SimpleNamespace(
      start_ns=start, duration_ns=end - start, name=name)
  plane = types.SimpleNamespace(name="/device:GPU:0", lines=[
      types.SimpleNamespace(name=name, events=[event(*e) for e in events])
      for name, events in streams.items()])
  (tmp_path / "host.xplane.pb").write_bytes(b"")
  monkeypatch.setattr(jax.profiler, "ProfileData", types.SimpleNamespace(
      from_file=lambda path: types.SimpleNamespace(planes=[plane])))
  intervals = timing._jax_trace_intervals(str(tmp_path))
  assert sorted(intervals) == sorted(
      i for b in (0, 20, 40) for i in [(b, b + 10)] * 2 + [(b + 10, b + 10)] * 2)
  assert timing.split_calls(intervals, 3) == [(10, 10)] * 3


def test_calls_that_cannot_be_told_apart_are_an_error():
  with pytest.raises(timing.TimingError, match="same number"):
    timing.split_calls([(0, 1), (2, 3), (4, 5)], 2)
  with pytest.raises(timing.TimingError, match="overlap"):
    timing.split_calls([(0, 10), (1, 2), (5, 6), (20, 30)], 2)


def test_groups_with_different_activity_counts_are_an_error():
  groups = lambda calls, n: [([(1e-3, 1e-3)] * calls, count, calls * 2e-3) for count in (2, 3)]
  with pytest.raises(timing.TimingError, match="per call"):
    timing._timed(groups, 1.0, min_seconds=0.0, groups=2)


@pytest.mark.parametrize("activities, expected_calls", [(None, 200), (1, 200), (400, 10),
                                                         (10_000, 3)])
def test_a_trace_of_many_activities_gets_fewer_calls(activities, expected_calls):
  asked = []

  def groups(calls, n):
    asked.append((calls, n))
    return [([(1e-6, 1e-6)] * calls, activities, calls * 1e-5)] * n

  timing._timed(groups, 1e-3, min_seconds=1.0, groups=5)
  assert asked[-1] == (expected_calls, 5)
  # Calls too quick to hold many activities are not probed: one trace, the calls as before.
  asked.clear()
  timing._timed(groups, 1e-6, min_seconds=1.0, groups=5)
  assert asked == [(200, 5)]


@pytest.mark.parametrize("busy", [0.5, None])
def test_a_span_past_the_wall_clock_is_an_error(busy):
  groups = lambda calls, n: [([(1.0, busy)] * calls, 2, calls * 1e-3)] * n
  with pytest.raises(timing.TimingError, match="busy <= span <= wall"):
    timing._timed(groups, 1.0, min_seconds=0.0, groups=1)


def test_large_outputs_are_checked_over_the_whole_tensor():
  rows = bench.checked_rows((1 << 21, 4096))
  assert rows[0] == 0 and rows[-1] == (1 << 21) - 1
  assert (1 << 31) // 4096 in rows and (1 << 32) // 4096 in rows
  assert np.all(np.diff(rows) > 0)
  # Random rows reach every part of the tensor, not only its head.
  assert np.histogram(rows, bins=8, range=(0, 1 << 21))[0].min() > 20
  assert bench.checked_rows((4096, 4096)) is None and bench.checked_rows(()) is None


def test_a_wrong_row_past_the_leading_ones_fails():
  a = jnp.ones((1 << 13, 4096), jnp.float32) * jnp.arange(1, 4097, dtype=jnp.float32)
  wrong_row = int(bench.checked_rows(a.shape)[-3])
  case = dataclasses.replace(_case(_forward()), tolerance=None)
  expected = np.asarray(bench._sample(a), np.float64)
  (error, _), = bench._errors(a, [expected], case)
  assert error == 0.0
  (error, bound), = bench._errors(a.at[wrong_row, 7].add(1.0), [expected], case)
  assert error > bound


def test_error_bounds_follow_rounding_and_reduction_length():
  bf16 = bench.error_bound(jnp.bfloat16)
  assert 2 ** -8 < bf16 < 2 * 2 ** -8 + 1e-6
  assert bench.error_bound(jnp.float16) < bf16 / 4
  assert bench.error_bound(jnp.float32, 1) < 1e-6
  assert bench.error_bound(jnp.float32, 1 << 16) > 10 * bench.error_bound(jnp.float32, 1)


def test_the_timed_program_is_the_checked_program():
  traces = []

  def forward(impl):
    if impl == "xla":
      return lambda x: x
    def fn(x):
      traces.append(impl)
      # A program traced a second time would compute the wrong values.
      return x * (1.0 if len(traces) == 1 else 1.5)
    return fn

  rows, _ = bench.run([_case(forward)], implementations=("xla", "triton"), time_it=True)
  assert [r.note for r in rows] == ["", ""]
  assert all(r.forward_ms > 0 for r in rows)
  assert traces.count("triton") == 1


def test_a_wrong_timed_program_fails_its_row():
  rows, _ = bench.run([_case(_forward(wrong=("triton",)))], time_it=True)
  notes = _notes(rows)
  assert notes["triton"].startswith("FAILED: relative error")
  assert [r.forward_ms for r in rows if r.implementation == "triton"] == [None]


def test_a_reference_that_raises_fails_the_row():
  def forward(impl):
    if impl == "xla":
      return lambda x: (_ for _ in ()).throw(FloatingPointError("reference broke"))
    return lambda x: x
  rows, _ = bench.run([_case(forward)], implementations=("triton",), time_it=True)
  assert _notes(rows)["triton"].startswith("FAILED: no float64 reference: FloatingPointError")


@pytest.mark.gpu
def test_gpu_timer_reads_span_and_busy_of_a_call_with_a_host_wait():
  sleep_s = 0.005
  n = 1 << 26

  def kernels(x):
    return jnp.sin(x) * 2.0

  def with_wait(x):
    y = kernels(x)
    # The host holds the call between its two kernels: span counts the wait, busy does not.
    token = io_callback(lambda a: (time.sleep(sleep_s), a)[1],
                        jax.ShapeDtypeStruct((1,), jnp.float32), y[:1], ordered=True)
    return jnp.cos(y) + token

  sets = [(jax.random.normal(jax.random.key(i), (n,), jnp.float32),) for i in range(2)]
  alone, _ = timing.measure(jax.jit(lambda x: jnp.cos(kernels(x))), sets)
  waited, _ = timing.measure(jax.jit(with_wait), sets, min_seconds=0.2, groups=3)
  assert waited.kernels >= 2
  assert waited.busy_ms <= waited.span_ms <= waited.wall_ms
  assert waited.span_ms - waited.busy_ms >= 0.9 * sleep_s * 1e3
  assert waited.span_ms < waited.busy_ms + sleep_s * 1e3 + 2.0
  # The busy time is the two kernels' (the transfers of one element add next to nothing).
  assert abs(waited.busy_ms - alone.busy_ms) < 0.1 * alone.busy_ms + 0.05


@pytest.mark.gpu
def test_gpu_copy_ceilings_copy():
  from jaxfuse._core.cuda import copies
  if copies.LIBRARY.unavailable():
    pytest.skip(copies.LIBRARY.unavailable())
  x = jax.random.normal(jax.random.key(0), ((1 << 20) + 7,), jnp.bfloat16)
  assert bool(jnp.array_equal(copies.memcpy(x), x))
  for unroll, ctas, streaming in copies.KERNEL_SHAPES:
    assert bool(jnp.array_equal(copies.copy(x, unroll, ctas, streaming), x))
  rates = ceilings.copy_ceilings()
  assert "cudaMemcpyAsync" in rates and len(rates) == 2 + len(copies.KERNEL_SHAPES)


def test_groups_are_read_from_one_trace(monkeypatch):
  ran, traces = [], []
  call = lambda i: ran.append(i) or jnp.zeros(())
  # Two groups of three calls; the second group's calls last longer.
  monkeypatch.setattr(timing, "_jax_trace_intervals",
                      lambda log_dir: traces.append(log_dir) or [
                          (10 * c + j, 10 * c + j + 2 + (c >= 3)) for c in range(6)
                          for j in (0, 4)])
  out = timing._jax_groups(call, 3, 2)
  assert ran == [0, 1, 2] * 2 and len(traces) == 1
  assert [(activities, wall > 0) for _, activities, wall in out] == [(2, True)] * 2
  assert np.allclose(out[0][0], [(6e-9, 4e-9)] * 3, rtol=1e-12, atol=0)
  assert np.allclose(out[1][0], [(7e-9, 6e-9)] * 3, rtol=1e-12, atol=0)
  monkeypatch.setattr(timing, "_jax_trace_intervals", lambda log_dir: [])
  with pytest.raises(timing.TimingError, match="no GPU activity"):
    timing._jax_groups(call, 3, 2)


@pytest.mark.parametrize("args,says", [
    (["--impl", "foo"], "--impl: foo"),
    (["norm", "--sizes", "abc"], "--sizes takes comma-separated integers"),
    (["norm", "--sizes", "12345"], "no case is left"),
    (["norm", "--only", "no such label"], "no case is left"),
], ids=["impl", "sizes text", "sizes none", "only none"])
def test_bench_refuses_arguments_that_select_nothing(capsys, args, says):
  from jaxfuse import cli
  with pytest.raises(SystemExit) as exit:
    cli.main(["bench", *args])
  assert exit.value.code == 2 and says in capsys.readouterr().err


def test_version(capsys):
  import jaxfuse
  from jaxfuse import cli
  with pytest.raises(SystemExit):
    cli.main(["--version"])
  assert f"jaxfuse {jaxfuse.__version__} (jax " in capsys.readouterr().out


def _split_parts():
  path = Path(__file__).resolve().parent.parent / "benchmarks" / "split_parts.py"
  spec = importlib.util.spec_from_file_location("split_parts", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_a_run_split_over_gpus_times_each_case_once_in_shares_of_like_cost(capsys):
  split = _split_parts()
  assert split.main(["3", "DAY-KIND-tune-rnn-bi", "tune", "rnn", "--only", " L2 bi "]) == 0
  lines = capsys.readouterr().out.splitlines()
  labels = []
  for gpu, line in enumerate(lines):
    assert line.startswith(f"{gpu}|python -m jaxfuse tune rnn ")
    argv = shlex.split(line.split("|", 1)[1])
    assert argv[-3:] == ["--json", f"benchmarks/results/DAY-KIND-tune-rnn-bi-p{gpu}.json",
                         "--resume"]
    labels += [argv[i + 1].strip() for i, a in enumerate(argv) if a == "--only"]
  wanted = [c.label for c in rnn_bench.tune_cases() if " L2 bi " in c.label]
  assert len(lines) == 3 and sorted(labels) == sorted(wanted)
  # No share costs more than another by more than the costliest case.
  cases = [c for c in rnn_bench.tune_cases() if " L2 bi " in c.label]
  largest = max(c.forward_work for c in cases)
  loads = [sum(1 + 4 * c.forward_work / largest for c in cases if c.label in share)
           for share in split.deal(cases, 3)]
  assert max(loads) - min(loads) <= 5
  # Softmax and cross-entropy rows share labels: each label goes to one GPU, once.
  parts = split.commands(3, "softmax", "tune", "softmax")
  labels = [argv[i + 1] for _, argv in parts for i, a in enumerate(argv) if a == "--only"]
  assert sorted(labels) == sorted({f" {c.label} " for c in softmax_bench.tune_cases()})
  # A grid's part asks only for the implementations its cases offer (here, on the CPU, no
  # comparator).
  parts = split.commands(2, "grid", "bench", "rnn", impl="default,torch")
  assert [argv[argv.index("--impl") + 1] for _, argv in parts] == ["default", "default"]
  # --skip leaves out what --only kept: the GRU's one-direction cases alone.
  parts = split.commands(2, "gru", "tune", "rnn", only=["GRU "], skip=[" L2 bi "])
  labels = [argv[i + 1].strip() for _, argv in parts for i, a in enumerate(argv) if a == "--only"]
  assert sorted(labels) == sorted(c.label for c in rnn_bench.tune_cases()
                                  if c.label.startswith("GRU ") and " L1 " in c.label)
  with pytest.raises(SystemExit):
    split.main(["2", "x", "tune", "rnn", "--impl", "cuda"])
  with pytest.raises(SystemExit):
    split.main(["2", "x", "bench", "rnn"])


def test_families_whose_kernels_are_built_run_first():
  ready = {"norm": False, "softmax": True, "attention": True}
  order = cli._ready_first(["norm", "softmax", "attention"], ready.get, poll_s=0.01)
  assert next(order) == "softmax"
  ready["norm"] = True
  assert list(order) == ["norm", "attention"]


def test_a_run_times_over_its_window_and_restores_the_default(monkeypatch):
  windows, timed = [], timing._timed
  monkeypatch.setattr(timing, "_timed", lambda *a, min_seconds, groups: windows.append(
      min_seconds) or timed(*a, min_seconds=min_seconds, groups=groups))
  default = timing.MIN_SECONDS.get()
  case = bench.Case(op="neg", label="x", size=8,
                    make_inputs=lambda key: (jax.random.normal(key, (8,)),),
                    forward=lambda impl: lambda a: -a, train=None, forward_work=64,
                    train_work=0, implementations=("xla",))
  bench.run([case], min_seconds=0.01, ceilings={"copy GB/s": 1.0})
  assert windows and set(windows) == {0.01}
  assert timing.MIN_SECONDS.get() == default


def test_clock_sampler_averages_the_samples_inside_a_window():
  """A fake nvidia-smi printing a GPU's clock and power (an unreadable line among them): the
  window's means; a window with no samples, and a sampler with no command, give None."""
  import sys
  from jaxfuse._core.clocks import ClockSampler
  fake = [sys.executable, "-u", "-c",
          "import time\nfor i in range(400):\n"
          "  print('[N/A], [N/A]' if i == 1 else f'{1500 + i % 2 * 100}, {300 + i % 2 * 10}')\n"
          "  time.sleep(0.005)"]
  with ClockSampler(fake) as sampler:
    while not sampler.over(0, time.perf_counter()):  # the fake's first line read
      time.sleep(0.01)
    start = time.perf_counter()
    time.sleep(0.5)
    end = time.perf_counter()
  means = sampler.over(start, end)
  assert 1540 < means["clock_mhz"] < 1560 and 304 < means["power_w"] < 306
  assert sampler.over(end + 100, end + 200) is None
  with ClockSampler([]) as idle:
    pass
  assert idle.over(0, time.perf_counter()) is None
