"""Tuned tables: every table's rows cite recorded runs, inheritance and the untuned fallback."""

import dataclasses
import json
import logging
import os
import math
import re
from pathlib import Path

import pytest

from jaxfuse._core import registry, tuned
from jaxfuse.ops.attention import api as attention_api
from jaxfuse.ops.linear_cross_entropy import api as linear_cross_entropy_api
from jaxfuse.ops.mlp import api as mlp_api
from jaxfuse.ops.norm import api as norm_api
from jaxfuse.ops.rnn import api as rnn_api
from jaxfuse.ops.softmax import api as softmax_api

ROOT = Path(__file__).resolve().parent.parent
UNTUNED = {"norm": norm_api._untuned, "softmax": softmax_api._untuned,
           "attention": attention_api._untuned, "rnn": rnn_api._untuned,
           "linear_cross_entropy": linear_cross_entropy_api._untuned, "mlp": mlp_api._untuned}
# Families tuned on an H200 alone: no H100 has been lent since they landed.
H200_ONLY = {"mlp"}
TABLES = sorted((ROOT / "jaxfuse" / "ops").glob("*/tuned/*.json"))
# The facts each family's rules may test (see its ``_fastest``), besides the length and element
# bounds.
FACTS = {"norm": {"op", "use", "direction", "itemsize", "out_itemsize", "cuda_short_rows"},
         "softmax": {"op", "use", "direction", "itemsize", "plain", "causal", "cuda_takes",
                     "triton"}}
BOUNDS = {"min_length", "max_length", "min_elements", "max_elements", "min_rows", "max_rows"}


def test_there_are_tables_for_the_h100_and_the_h200():
  stems = {(path.parent.parent.name, path.stem) for path in TABLES}
  for family in UNTUNED:
    gpus = {"nvidia_h200"} | ({"nvidia_h100_80gb_hbm3"} if family not in H200_ONLY else set())
    assert {(family, gpu) for gpu in gpus} <= stems


@pytest.mark.parametrize("path", TABLES, ids=lambda p: f"{p.parent.parent.name}/{p.stem}")
def test_a_table_names_its_gpu_and_cites_recorded_runs(path):
  family, table = path.parent.parent.name, json.loads(path.read_text())
  assert tuned.device_file(table["device"]) == path.stem
  assert set(table) == {"device", "inherits", "rows"}
  for name, row in table["rows"].items():
    assert set(row) == {"value", "source"}, name
    sources = [row["source"]] if isinstance(row["source"], str) else row["source"]
    for source in sources:
      assert source.startswith("benchmarks/results/") and (ROOT / source).is_file(), source
  rows = tuned.read_table(family, path.stem)
  # No row is read by nothing (a row a table lacks takes the built-in default).
  assert set(rows) <= set(UNTUNED[family]())
  for rule in rows.get("rules", {"value": []})["value"]:
    assert set(rule) == {"when", "use", "source"}, rule
    assert rule["use"] in ("xla", "triton", "cuda"), rule
    assert set(rule["when"]) <= FACTS[family] | BOUNDS, rule
    assert (ROOT / rule["source"]).is_file(), rule["source"]
  for name in ("mosaic_before_cudnn_forward", "mosaic_before_cudnn_step"):
    for key, most in rows.get(name, {"value": {}})["value"].items():
      assert re.fullmatch(r"(causal|full)/(64|128|256)", key) and most > 0, (name, key)
  for name in ("order", "forward_order", "step_order"):
    if name in rows:
      order = rows[name]["value"]
      assert len(set(order)) == len(order) and set(order) <= {"xla", "cuda"}, name
  for key, row in rows.items():
    if not key.startswith("fastest/"):
      continue
    grid = row["value"]
    assert set(grid) == {"batch", "hidden", "order"}, key
    assert len(grid["order"]) == len(grid["batch"]) > 0, key
    for orders in grid["order"]:
      assert len(orders) == len(grid["hidden"]) > 0, key
      assert any(orders), (key, "a grid row with no timed point")
      for order in filter(None, orders):  # '': a point the run did not time
        names = order.split(">")
        assert len(set(names)) == len(names) and set(names) <= {"cuda", "cudnn", "xla"}, key


@pytest.fixture
def tables(tmp_path, monkeypatch):
  """Tables of a family ``f`` written to a scratch tree."""
  monkeypatch.setattr(tuned, "_OPS", tmp_path)
  tuned._rows_for.cache_clear()
  tuned._merged.cache_clear()
  yield lambda stem, **table: _write(tmp_path / "f" / "tuned" / f"{stem}.json", table)
  tuned._rows_for.cache_clear()
  tuned._merged.cache_clear()


def _write(path, table):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(table))


def _row(value):
  return {"value": value, "source": "benchmarks/results/x.json"}


def test_a_table_inherits_rows_and_overrides_them(tables):
  tables("gpu_a", device="GPU A", inherits=None, rows={"a": _row(1), "b": _row(2)})
  tables("gpu_b", device="GPU B", inherits="gpu_a", rows={"b": _row(3)})
  assert {k: r["value"] for k, r in tuned.read_table("f", "gpu_b").items()} == {"a": 1, "b": 3}
  assert tuned.read_table("f", "gpu_c") is None


def test_inheriting_in_a_cycle_or_from_nothing_raises(tables):
  tables("gpu_a", device="GPU A", inherits="gpu_b", rows={})
  tables("gpu_b", device="GPU B", inherits="gpu_a", rows={})
  with pytest.raises(ValueError, match="cycle: gpu_a -> gpu_b -> gpu_a"):
    tuned.read_table("f", "gpu_a")
  tables("gpu_c", device="GPU C", inherits="gpu_d", rows={})
  with pytest.raises(ValueError, match="inherits 'gpu_d', which has no table"):
    tuned.read_table("f", "gpu_c")


def test_a_gpu_without_a_table_takes_the_computed_rows_and_says_so_once(tables, monkeypatch,
                                                                        caplog):
  tables("gpu_a", device="GPU A", inherits=None, rows={"a": _row(1)})
  monkeypatch.setattr(registry, "device_kind", lambda: "GPU A")
  assert tuned.rows("f", lambda: {"a": 7}) == {"a": 1}
  monkeypatch.setattr(registry, "device_kind", lambda: "GPU Z")
  tuned._log_untuned.cache_clear()
  with caplog.at_level(logging.INFO, logger="jaxfuse"):
    assert tuned.rows("f", lambda: {"a": 7}) == {"a": 7}
    assert tuned.rows("f", lambda: {"a": 7}) == {"a": 7}
  said = [r.getMessage() for r in caplog.records if "no tuned f table" in r.getMessage()]
  assert said == ["jaxfuse: no tuned f table for GPU Z (jaxfuse/ops/f/tuned/gpu_z.json); its "
                  "choices are the built-in defaults"]


def test_a_rule_holds_where_every_condition_does():
  facts = dict(op="rms", direction="forward", length=512, elements=512 * 64, itemsize=2)
  assert tuned.matches({}, facts)
  assert tuned.matches({"op": ["rms", "layer"], "min_length": 512, "max_length": 512}, facts)
  assert not tuned.matches({"op": "layer"}, facts)
  assert not tuned.matches({"min_length": 513}, facts)
  assert not tuned.matches({"max_elements": 512 * 64 - 1}, facts)
  assert tuned.matches({"min_rows": 64, "max_rows": 64}, facts)
  assert not tuned.matches({"max_rows": 63}, facts)
  rules = [{"when": {"itemsize": 4}, "use": "xla"}, {"when": {"op": "rms"}, "use": "cuda"},
           {"when": {}, "use": "triton"}]
  assert tuned.ruled(rules, facts, lambda name: True) == "cuda"
  assert tuned.ruled(rules, facts, lambda name: name != "cuda") == "triton"
  assert tuned.ruled(rules[:2], facts, lambda name: name != "cuda") is None


def test_off_the_gpu_the_computed_rows_serve_silently(tables, monkeypatch, caplog):
  monkeypatch.setattr(registry, "device_kind", lambda: None)
  with caplog.at_level(logging.INFO, logger="jaxfuse"):
    assert tuned.rows("f", lambda: {"a": 7}) == {"a": 7}
  assert not caplog.records


# ------------------------------------------------------------------- jaxfuse tune FAMILY

def _timed(op, label, size, impl, forward, step, note=""):
  from jaxfuse._core.bench import Row
  return Row(op=op, label=label, size=size, implementation=impl, unit="GB/s",
             forward_ms=forward, train_ms=step, note=note)


def test_tune_reads_wins_from_the_timings():
  from jaxfuse._core import tune
  # The first wins at 1 and 4, ties at 2 and loses at 3: using it everywhere costs 1.5x at
  # 3, stopping before 4 costs 2x there.
  points = [(1, 1.0, 2.0), (2, 1.0, 1.0), (3, 3.0, 2.0), (4, 1.0, 2.0)]
  assert tune.least_regret_prefix(points) == 4
  assert tune.least_regret_suffix(points) == 1
  # Ties go to the first.
  assert tune.least_regret_prefix([(1, 1.0, 2.0), (2, 1.0, 1.0), (3, 5.0, 2.0)]) == 2
  assert tune.least_regret_suffix([(1, 5.0, 2.0), (2, 1.0, 1.0), (3, 1.0, 2.0)]) == 2
  # One loss at the smallest size no longer hides the wins above it.
  assert tune.least_regret_prefix([(1, 1.1, 1.0), (2, 1.0, 2.0), (3, 1.0, 2.0),
                                   (4, 3.0, 1.0)]) == 3
  assert tune.least_regret_suffix([(1, 1.0, 1.1), (2, 2.0, 1.0), (3, 2.0, 1.0)]) is None
  assert tune.least_regret_prefix([(1, 2.0, 1.0)]) is None
  assert tune.least_regret_suffix([(1, 1.0, 2.0), (2, 3.0, 1.0)]) is None
  assert tune.least_regret_suffix([(1, 1.0, 2.0), (2, 1.0, 2.0)]) == 1
  # Several cases of one size: it is used there only where that costs least over all of them.
  assert tune.least_regret_prefix([(1, 1.0, 2.0), (1, 3.0, 1.0)]) is None
  rows = [_timed("op", "a", 8, "cuda", 1.0, 3.0), _timed("op", "a", 8, "xla", 2.0, 3.5),
          _timed("op", "b", 16, "cuda", 1.0, 4.0), _timed("op", "b", 16, "xla", 1.0, 1.5),
          _timed("op", "c", 32, "cuda", 1.0, 1.0), _timed("op", "c", 32, "xla", 0.1, 0.1,
                                                           note="FAILED: relative error")]
  # The backward alone is the step less the forward; a failed check is infinitely slow.
  assert tune.times_by_size(rows, "backward", "cuda", "xla") == [
      (8, 2.0, 1.5), (16, 3.0, 0.5), (32, 0.0, math.inf)]
  assert tune.times_by_size(rows, "forward", "xla", "cuda")[-1] == (32, math.inf, 1.0)
  # A failed check is never chosen, whatever it would save elsewhere.
  assert tune.least_regret_prefix([(1, 1.0, 2.0), (2, math.inf, 1.0), (3, 1.0, 2.0)]) == 1
  assert tune.least_regret_prefix([(1, math.inf, math.inf), (2, 1.0, 2.0)]) == 2
  assert tune.order_by_geometric_mean(rows, "step", ("cuda", "xla")) == ["xla", "cuda"]
  assert tune.order_by_geometric_mean(rows[:2], "step", ("xla", "cuda")) == ["cuda", "xla"]
  assert tune.order_by_geometric_mean([], "step", ("xla", "cuda")) == ["xla", "cuda"]


def test_each_family_reads_its_rows_from_a_tuning_run():
  from jaxfuse.ops.attention import bench as attention_bench
  from jaxfuse.ops.norm import bench as norm_bench
  from jaxfuse.ops.softmax import bench as softmax_bench
  attention = [_timed("attention", f"{16384 // t}x{t}x16x{h} {mask}", t, impl, f, s)
               for t, h, mask, impl, f, s in [
                   (2048, 64, "causal", "mosaic", 1.0, 1.0), (2048, 64, "causal", "cudnn", 2, 2),
                   (4096, 64, "causal", "mosaic", 1.0, 3.0), (4096, 64, "causal", "cudnn", 2, 2),
                   (2048, 128, "full", "mosaic", 3.0, 3.0), (2048, 128, "full", "cudnn", 2, 2)]]
  assert attention_bench.tuned_rows(attention) == {
      "mosaic_before_cudnn_forward": {"causal/64": 4096},
      "mosaic_before_cudnn_step": {"causal/64": 2048}}
  # Small grids (work tiles 64 and 128): Triton's forward wins on the smallest and Mosaic's
  # on the larger, the bound between them at their geometric mean; cuDNN's step wins both.
  step = {"triton": 1.5, "cudnn": 1.0, "mosaic": 2.0}
  small = [_timed("attention", f"1x{t}x8x64 causal", t, impl, f, step[impl])
           for t, impl, f in [(1024, "triton", 1.0), (1024, "cudnn", 2.0), (1024, "mosaic", 3.0),
                              (2048, "triton", 3.0), (2048, "cudnn", 2.0), (2048, "mosaic", 1.5)]]
  rows = attention_bench.tuned_rows(attention + small)
  assert (rows["triton_most_tiles_forward"], rows["mosaic_least_tiles_forward"]) == (90, 91)
  # Mosaic's step losing on both: from past the largest small grid.
  assert (rows["triton_most_tiles_step"], rows["mosaic_least_tiles_step"]) == (0, 129)
  # A part run of the small grids gives their rows alone.
  assert attention_bench.tuned_rows(small) == {
      k: v for k, v in rows.items() if not k.startswith("mosaic_before")}
  # CUDA's forward slower at 1024 but its step faster: a differentiated call goes with the
  # step.
  softmax = [_timed(op, f"{n}", n, impl, f, s) for op in ("softmax", "cross_entropy")
             for n, impl, f, s in [(1024, "triton", 1.0, 2.0), (1024, "cuda", 1.5, 1.9),
                                   (1024, "xla", 1.0, 2.0), (16384, "triton", 2.0, 5.0),
                                   (16384, "cuda", 1.0, 3.5), (16384, "xla", 3.0, 9.0)]]
  assert softmax_bench.tuned_rows(softmax) == {
      "cuda_from_forward": 16384, "cuda_from_step": 1024, "cuda_from_cross_entropy": 1024,
      "cuda_from_cross_entropy_loss": 16384, "cuda_from_forward_without_triton": 16384,
      "cuda_from_step_without_triton": 1024, "cuda_from_cross_entropy_without_triton": 1024,
      "cuda_from_cross_entropy_loss_without_triton": 16384}
  # Per norm and use: RMSNorm's forward Triton's at both lengths, its step and LayerNorm's
  # forward and step CUDA's at the longer.
  norm = [_timed(op, f"{n}", n, impl, f, s) for op in ("rms_norm", "layer_norm")
          for n, impl, f, s in [(1024, "triton", 1.0, 1.0), (1024, "cuda", 2.0, 2.0),
                                (8192, "triton", 1.0, 1.0),
                                (8192, "cuda", 1.5 if op == "rms_norm" else 0.5, 0.5)]]
  longest = {"rms/forward": 8192, "rms/step": 1024, "layer/forward": 1024, "layer/step": 1024}
  few = [_timed("rms_norm", f"{rows}x{n} bfloat16", n, impl, f, f + 1.0)
         for rows, n, xla_ms in [(1, 4096, 2.0), (8, 12288, 1.0), (8, 1024, 2.0), (1, 12288, 1.0),
                                 (64, 12288, 2.0)]
         for impl, f in [("xla", xla_ms), ("triton", 1.5), ("cuda", 3.0)]]
  # XLA wins at 12288 (the longest length measured) on 1 and 8 rows: from the geometric mean
  # with the length below; the 1-row band up to the geometric mean with 8 rows.
  bands = [[2, 7095, 12288], [22, 3548, 12288], [64]]
  few_rows = {"rms/forward": bands, "rms/step": bands, "layer/forward": None, "layer/step": None}
  assert norm_bench.tuned_rows(norm + few) == {"triton_max_features": longest,
                                               "xla_few_rows": few_rows}
  assert norm_bench.tuned_rows(few) == {"xla_few_rows": few_rows}
  assert norm_bench.tuned_rows(norm) == {"triton_max_features": longest}
  # XLA timed beside them (for the GPU without Triton): RMSNorm's forward faster than CUDA's
  # at both lengths, every step slower; LayerNorm's forward faster at 1024 only.
  xla = [_timed(op, f"{n}", n, "xla", 1.0 if op == "rms_norm" or n == 1024 else 2.0, 3.0)
         for op in ("rms_norm", "layer_norm") for n in (1024, 8192)]
  assert norm_bench.tuned_rows(norm + xla)["cuda_from_without_triton"] == {
      "rms/forward": None, "rms/step": 1024, "layer/forward": 8192, "layer/step": 1024}


def test_norm_thresholds_leave_out_the_points_the_tables_rules_decide(monkeypatch):
  """A tuning point whose calls a rule of the GPU's table decides (here LayerNorm's training
  step of 256-512 features at 2^26 elements, on CUDA) never reaches the thresholds, so its
  times do not move them; CUDA's start without Triton still reaches down past it."""
  from jaxfuse._core import tune
  from jaxfuse.ops.norm import bench as norm_bench
  rule = {"when": {"op": "layer", "use": ["forward", "backward"], "max_length": 512,
                   "min_elements": 2**26}, "use": "cuda"}
  monkeypatch.setattr(tuned, "read_table",
                      lambda family, stem: {"rules": {"value": [rule], "source": []}})
  # Triton's forward wins up to 4096; its step loses three-fold at 256-512, wins at 1024-4096;
  # CUDA wins at 8192 and beats XLA everywhere.
  times = {"triton": lambda n: (1.0, 6.0 if n <= 512 else 1.0),
           "cuda": lambda n: (2.0 if n <= 4096 else 0.5, 2.0 if n <= 512 else
                              1.5 if n <= 4096 else 0.5),
           "xla": lambda n: (4.0, 4.0)}
  rows = [_timed(op, f"{2**26 // n}x{n} bfloat16", n, impl, *time(n))
          for op in ("rms_norm", "layer_norm") for n in (256, 512, 1024, 4096, 8192)
          for impl, time in times.items()]
  ruled = tune.ruled_by("norm", "Some GPU")
  # LayerNorm's rows of 256 and 512 features, three implementations each: their steps alone.
  assert [ruled(row, use) for row in rows[15:21] for use in ("forward", "step")] == [False,
                                                                                     True] * 6
  assert not any(ruled(row, use) for row in rows[:15] + rows[21:] for use in ("forward", "step"))
  blind = norm_bench.tuned_rows(rows)
  derived = norm_bench.tuned_rows(rows, ruled)
  assert blind["triton_max_features"] == {"rms/forward": 4096, "rms/step": 0,
                                          "layer/forward": 4096, "layer/step": 0}
  assert derived["triton_max_features"] == {"rms/forward": 4096, "rms/step": 0,
                                            "layer/forward": 4096, "layer/step": 4096}
  assert derived["cuda_from_without_triton"] == dict.fromkeys(
      ("rms/forward", "rms/step", "layer/forward", "layer/step"), 256)
  assert tune.derive("norm", rows, "Some GPU") == derived


def test_a_part_run_picks_cases_by_the_start_of_their_labels():
  from jaxfuse import cli
  from jaxfuse.ops.attention import bench as attention_bench
  from jaxfuse.ops.norm import bench as norm_bench
  cases = norm_bench.tune_cases()
  few = cli._only(cases, [f" {rows}x" for rows in norm_bench.FEW_ROWS])
  assert {c.label.split()[0] for c in few} == {f"{r}x{n}" for r in norm_bench.FEW_ROWS
                                              for n in norm_bench.FEW_ROWS_LENGTHS}
  assert len(cli._only(cases, ["8x32768"])) > len(cli._only(cases, [" 8x32768"]))
  small = cli._only(attention_bench.tune_cases(), [f" {b}x{t}x{n}x"
                                                   for b, t, n in attention_bench.TUNE_SMALL_GRIDS])
  assert len(small) == 2 * 2 * len(attention_bench.TUNE_SMALL_GRIDS)


def test_a_table_file_holds_a_list_of_numbers_or_strings_on_one_line():
  from jaxfuse._core import tune
  table = {"rows": {"bands": {"value": [[1, 4096, 32768], [64, -2.5, 1e+20, None]],
                              "source": ["runs[1,2].json", 'a "[nul]" \\ [e]']},
                    "grid": {"value": {"order": [["cuda>xla", ""]]}, "source": "run.json"}}}
  text = tune.table_text(table)
  assert json.loads(text) == table
  assert "[1, 4096, 32768]" in text and "[64, -2.5, 1e+20, null]" in text
  assert '["runs[1,2].json", "a \\"[nul]\\" \\\\ [e]"]' in text
  assert '[\n' in text and '["cuda>xla", ""]' in text


def test_the_winning_bands_hold_per_row_count_the_lengths_the_first_wins():
  from jaxfuse._core import tune
  at = lambda rows, n, first, second: ((rows, n), first, second)
  # Bounds between measurements at their geometric mean, the outermost at the measurement.
  assert tune.winning_bands([at(1, 1024, 2.0, 1.0), at(1, 8192, 1.0, 2.0),
                             at(64, 8192, 2.0, 1.0)]) == [[8, 2897, 8192], [64]]
  # A win between losses at 8 rows.
  assert tune.winning_bands([at(1, 1024, 1.0, 2.0), at(1, 4096, 2.0, 1.0),
                             at(8, 1024, 2.0, 1.0), at(8, 4096, 1.0, 2.0),
                             at(8, 8192, 1.0, 2.0), at(8, 32768, 2.0, 1.0)]
                            ) == [[2, 1024, 2048], [8, 2048, 16384]]
  # Ties go to the second, at either edge of a band.
  assert tune.winning_bands([at(1, 1024, 1.0, 1.0), at(1, 4096, 1.0, 2.0),
                             at(1, 12288, 1.0, 1.0)]) == [[1, 2048, 7094]]
  # Wins on both sides of a loss: two bands.
  assert tune.winning_bands([at(1, 1024, 1.0, 2.0), at(1, 4096, 2.0, 1.0),
                             at(1, 8192, 1.0, 2.0)]) == [[1, 1024, 2048, 5793, 8192]]
  assert tune.winning_bands([at(1, 1024, 2.0, 1.0), at(8, 8192, 2.0, 1.0)]) is None
  assert tune.winning_bands([]) is None


def test_the_tuning_grids_labels_read_back_into_rows():
  """Every case of the norm and attention tuning grids, timed by a fake clock that favours
  XLA's norms on one row and Triton's attention on the smallest grids, gives the rows."""
  from jaxfuse.ops.attention import bench as attention_bench
  from jaxfuse.ops.norm import bench as norm_bench
  norm = [_timed(c.op, c.label, c.size, impl,
                 0.5 if impl == "xla" and c.label.startswith("1x") else 1.0 + (impl == "xla"),
                 3.0)
          for c in norm_bench.tune_cases() for impl in ("xla", "triton", "cuda")]
  few_rows = norm_bench.tuned_rows(norm)["xla_few_rows"]
  one, eight, _ = norm_bench.FEW_ROWS
  assert few_rows["rms/forward"] == few_rows["layer/forward"] == [
      [math.isqrt(one * eight), min(norm_bench.FEW_ROWS_LENGTHS),
       max(norm_bench.FEW_ROWS_LENGTHS)], [math.isqrt(8 * 64)], [64]]
  attention = [_timed(c.op, c.label, c.size, impl,
                      1.0 if (impl == "triton") == c.label.startswith("1x512x") else 2.0, 2.0)
               for c in attention_bench.tune_cases() for impl in ("cudnn", "mosaic", "triton")]
  rows = attention_bench.tuned_rows(attention)
  assert rows["triton_most_tiles_forward"] == math.isqrt(attention_bench.work_tiles(1, 512, 8)
                                                        * attention_bench.work_tiles(1, 1024, 8))


def test_the_rnn_tuning_run_gives_the_order_measured_at_each_point_per_cell_dtype_and_use():
  from jaxfuse.ops.rnn import bench as rnn_bench
  # (batch, hidden): cuda, cudnn, xla times (forward, step); None: did not run.
  times = {(1, 256): ((1.0, 2.0), (3.0, 6.0), (2.0, 3.0)),
           (1, 2048): (None, (9.0, 20.0), (8.0, 30.0)),
           (64, 256): ((1.0, 3.0), (2.0, 2.0), (1.5, 4.0)),
           (64, 2048): (None, (5.0, 10.0), (6.0, 12.0))}
  rows = [_timed("lstm", f"LSTM {b}x64x{h}x{h} L1 float32", b, impl, *time)
          for (b, h), by_impl in times.items()
          for impl, time in zip(("cuda", "cudnn", "xla"), by_impl) if time is not None]
  # A failed check counts as not run; GRU, bfloat16 and the comparators were not timed.
  rows[5] = _timed("lstm", "LSTM 64x64x256x256 L1 float32", 64, "cuda", 0.1, 0.1,
                   note="FAILED: error")
  rows.append(_timed("lstm", "LSTM 64x64x256x256 L1 float32", 64, "torch", 0.1, 0.1))
  assert rnn_bench.tuned_rows(rows) == {
      "fastest/lstm/float32/forward": {"batch": [1, 64], "hidden": [256, 2048],
                               "order": [["cuda>xla>cudnn", "xla>cudnn"],
                                         ["xla>cudnn", "cudnn>xla"]]},
      "fastest/lstm/float32/step": {"batch": [1, 64], "hidden": [256, 2048],
                                    "order": [["cuda>xla>cudnn", "cudnn>xla"],
                                              ["cudnn>xla", "cudnn>xla"]]}}
  # A point the run did not time has no order.
  assert rnn_bench.tuned_rows(rows[:3] + rows[-4:])[
      "fastest/lstm/float32/forward"]["order"] == [["cuda>xla>cudnn", ""], ["xla", "cudnn>xla"]]


def test_the_rnn_tuning_run_gives_a_bidirectional_grid_apart():
  from jaxfuse.ops.rnn import bench as rnn_bench
  # One direction: cuda fastest; two (timed at two layers): cudnn; GRU's one direction only.
  rows = [_timed("lstm", f"LSTM 4x64x256x256 {layout} bfloat16", 4, impl, t, 2 * t)
          for layout, times in (("L1", (1.0, 2.0, 3.0)), ("L2 bi", (5.0, 4.0, 6.0)))
          for impl, t in zip(("cuda", "cudnn", "xla"), times)]
  rows += [_timed("gru", "GRU 4x64x256x256 L1 bfloat16", 4, impl, t, t)
           for impl, t in (("cuda", 2.0), ("xla", 1.0))]
  # A layout the tuning grid does not hold is left out.
  rows.append(_timed("lstm", "LSTM 4x64x256x256 L2 bfloat16", 4, "xla", 0.1, 0.1))
  grid = lambda order: {"batch": [4], "hidden": [256], "order": [[order]]}
  assert rnn_bench.tuned_rows(rows) == {
      "fastest/lstm/bfloat16/forward": grid("cuda>cudnn>xla"),
      "fastest/lstm/bfloat16/step": grid("cuda>cudnn>xla"),
      "fastest/lstm/bfloat16/forward/bidirectional": grid("cudnn>cuda>xla"),
      "fastest/lstm/bfloat16/step/bidirectional": grid("cudnn>cuda>xla"),
      "fastest/gru/bfloat16/forward": grid("xla>cuda"),
      "fastest/gru/bfloat16/step": grid("xla>cuda")}


def test_tune_writes_the_rows_citing_its_run(tmp_path, monkeypatch, capsys):
  from jaxfuse import cli
  from jaxfuse._core import bench, tune
  from jaxfuse.ops.linear_cross_entropy import bench as lce_bench
  ops, results = tmp_path / "ops", tmp_path / "benchmarks" / "results"
  results.mkdir(parents=True)
  monkeypatch.setattr(tuned, "_OPS", ops)
  monkeypatch.setattr(tune, "results_dir", lambda: results)
  monkeypatch.setattr(registry, "device_kind", lambda: "NVIDIA Test GPU")
  monkeypatch.setenv("XLA_FLAGS", "")
  rows = [_timed("linear_cross_entropy", "a", 1, "cuda", 1.0, 3.0),
          _timed("linear_cross_entropy", "a", 1, "xla", 1.0, 2.0)]
  monkeypatch.setattr(bench, "run", lambda cases, **_: (rows, {}))
  run = results / "run.json"
  assert cli.main(["tune", "linear_cross_entropy", "--json", str(run), "--write"]) == 0
  assert json.loads(run.read_text())["tuned_rows"] == {"order": ["xla", "cuda"]}
  # Timed as a model's step runs: every program a CUDA graph.
  assert os.environ["XLA_FLAGS"] == "--xla_gpu_graph_min_graph_size=1"
  path = ops / "linear_cross_entropy" / "tuned" / "nvidia_test_gpu.json"
  table = {"device": "NVIDIA Test GPU", "inherits": None,
           "rows": {"order": {"value": ["xla", "cuda"], "source": "benchmarks/results/run.json"}}}
  assert json.loads(path.read_text()) == table
  assert 'order: ["xla", "cuda"] (not in the table)' in capsys.readouterr().out
  # A saved run gives the same rows again without a GPU, for its own family only.
  path.unlink()
  monkeypatch.setattr(registry, "device_kind", lambda: None)
  assert cli.main(["tune", "linear_cross_entropy", "--from", str(run), "--write"]) == 0
  assert json.loads(path.read_text()) == table
  assert cli.main(["tune", "norm", "--from", str(run)]) == 2
  # A run saved before records named their family: known by its rows, some of a family's
  # (its grid grew since) only where no other family's rows hold them too.
  old = json.loads(run.read_text())
  del old["tune_family"]
  run.write_text(json.dumps(old))
  assert cli.main(["tune", "linear_cross_entropy", "--from", str(run)]) == 0
  assert cli.main(["tune", "rnn", "--from", str(run)]) == 2
  old["tuned_rows"] = {"triton_max_features": 0}
  older = results / "older.json"
  older.write_text(json.dumps(old))
  assert cli.main(["tune", "norm", "--from", str(older)]) == 0
  # A run split by --only: each part saved as it goes, the rows derived from the parts together.
  monkeypatch.setattr(registry, "device_kind", lambda: "NVIDIA Test GPU")
  seen = []
  # The part times the point again, CUDA's step faster now.
  again = [_timed("linear_cross_entropy", "a", 1, "cuda", 1.0, 1.0), rows[1]]
  monkeypatch.setattr(bench, "run", lambda cases, **_: (seen.extend(cases), (again, {}))[1])
  part, label = results / "part.json", lce_bench.tune_cases()[-1].label
  assert cli.main(["tune", "linear_cross_entropy", "--only", label, "--json", str(part)]) == 0
  assert [c.label for c in seen] == [label]
  with pytest.raises(SystemExit):  # a part's rows would replace the table's whole rows
    cli.main(["tune", "linear_cross_entropy", "--only", label, "--write"])
  assert json.loads(part.read_text())["tune_family"] == "linear_cross_entropy"
  monkeypatch.setattr(registry, "device_kind", lambda: None)
  assert cli.main(["tune", "linear_cross_entropy", "--from", str(run), "--from", str(part),
                   "--write"]) == 0
  assert json.loads(path.read_text())["rows"]["order"] == {
      # The later run's times of a point timed twice, citing that run alone: the first
      # run's rows of it were all timed again.
      "value": ["cuda", "xla"], "source": "benchmarks/results/part.json"}
  path.write_text(json.dumps(table))
  monkeypatch.setattr(registry, "device_kind", lambda: "NVIDIA Test GPU")
  monkeypatch.setattr(bench, "run", lambda cases, **_: (rows, {}))
  # A run a table could not cite, or one with a failed check, is not written.
  assert cli.main(["tune", "linear_cross_entropy", "--json", str(tmp_path / "x.json"),
                   "--write"]) == 2
  rows[1] = _timed("linear_cross_entropy", "a", 1, "xla", 0.5, 0.5, note="FAILED: error")
  assert cli.main(["tune", "linear_cross_entropy", "--json", str(run), "--write"]) == 1
  assert json.loads(path.read_text()) == table
  said = capsys.readouterr()
  assert "not written" in said.err and 'order: ["cuda", "xla"] (the table\'s: ["xla", ' in said.out
  monkeypatch.setattr(registry, "device_kind", lambda: None)
  assert cli.main(["tune", "norm"]) == 2


def _saved_part(path, family, rows) -> list[str]:
  """``--from PATH`` of a tuning run of ``family`` holding ``rows``, saved at ``path``."""
  path.write_text(json.dumps({"tune_family": family, "device_kind": "NVIDIA Test GPU",
                              "device": "test", "jax_version": "0", "date": "today",
                              "rows": [dataclasses.asdict(r) for r in rows]}))
  return ["--from", str(path)]


def test_rows_written_from_parts_cite_the_parts_that_timed_them(tmp_path, monkeypatch):
  from jaxfuse import cli
  from jaxfuse._core import bench, tune
  ops, results = tmp_path / "ops", tmp_path / "benchmarks" / "results"
  results.mkdir(parents=True)
  monkeypatch.setattr(tuned, "_OPS", ops)
  monkeypatch.setattr(tune, "results_dir", lambda: results)
  monkeypatch.setattr(registry, "device_kind", lambda: None)
  parts = []
  for cell in ("LSTM", "GRU"):
    label = f"{cell} 4x64x256x256 L1 float32"
    parts += _saved_part(results / f"{cell.lower()}.json", "rnn", [
        bench.Row(cell.lower(), label, 1, impl, "TFLOP/s", forward_ms=t, train_ms=t)
        for impl, t in (("cuda", 1.0), ("xla", 2.0))])
  assert cli.main(["tune", "rnn", *parts, "--write"]) == 0
  table = json.loads((ops / "rnn" / "tuned" / "nvidia_test_gpu.json").read_text())
  assert {name: row["source"] for name, row in table["rows"].items()} == {
      f"fastest/{cell}/float32/{use}": f"benchmarks/results/{cell}.json"
      for cell in ("lstm", "gru") for use in ("forward", "step")}
  # A point whose float64 reference did not fit the GPU is a hole in the rows, not a failure.
  unchecked = [bench.Row("lstm", "LSTM 16x64x256x256 L1 float32", 16, impl, "TFLOP/s",
                         note=f"FAILED: {bench.NO_REFERENCE}: RESOURCE_EXHAUSTED: 74 GiB")
               for impl in ("cuda", "xla")]
  parts = _saved_part(results / "lstm.json", "rnn", [
      bench.Row("lstm", "LSTM 4x64x256x256 L1 float32", 4, impl, "TFLOP/s", forward_ms=t,
                train_ms=t) for impl, t in (("cuda", 1.0), ("xla", 2.0))] + unchecked)
  assert cli.main(["tune", "rnn", *parts, "--write"]) == 0
  table = json.loads((ops / "rnn" / "tuned" / "nvidia_test_gpu.json").read_text())
  assert table["rows"]["fastest/lstm/float32/step"]["value"] == {
      "batch": [4], "hidden": [256], "order": [["cuda>xla"]]}
  # A reference that broke otherwise is a failure.
  unchecked[0].note = f"FAILED: {bench.NO_REFERENCE}: FloatingPointError: reference broke"
  parts = _saved_part(results / "lstm.json", "rnn", unchecked)
  assert cli.main(["tune", "rnn", *parts, "--write"]) == 1
  # A family whose rows are all derived from any run (None where it has no data): each row
  # cites the run with data for it.
  parts = []
  for op in ("softmax", "cross_entropy"):
    parts += _saved_part(results / f"{op}.json", "softmax", [
        bench.Row(op, f"{op} {n}", n, impl, "GB/s", forward_ms=t, train_ms=t)
        for n in (1024, 4096) for impl, t in (("cuda", 1.0), ("triton", 2.0))])
  assert cli.main(["tune", "softmax", *parts, "--write"]) == 0
  table = json.loads((ops / "softmax" / "tuned" / "nvidia_test_gpu.json").read_text())
  cited = {name: row["source"] for name, row in table["rows"].items()}
  assert cited["cuda_from_forward"] == "benchmarks/results/softmax.json"
  assert cited["cuda_from_cross_entropy"] == "benchmarks/results/cross_entropy.json"


def test_a_tuning_run_cut_short_is_resumed_where_it_stopped(tmp_path, monkeypatch, capsys):
  from jaxfuse import cli
  from jaxfuse._core import bench
  from jaxfuse.ops.rnn import bench as rnn_bench
  monkeypatch.setattr(registry, "device_kind", lambda: "NVIDIA Test GPU")
  monkeypatch.setenv("XLA_FLAGS", "")
  cases = rnn_bench.tune_cases()
  asked = []

  given_ceilings = []

  def run(todo, on_case=None, ceilings=None):
    # Times the first case, then the run is cut short (a time limit, say).
    asked.append([c.label for c in todo])
    given_ceilings.append(ceilings)
    rows = [bench.Row(todo[0].op, todo[0].label, 1, impl, "TFLOP/s", forward_ms=1.0,
                      train_ms=1.0) for impl in todo[0].implementations]
    on_case(rows, {"matmul TFLOP/s": 900.0})
    if len(asked) == 1:
      raise KeyboardInterrupt
    return rows, ceilings

  monkeypatch.setattr(bench, "run", run)
  path = tmp_path / "run.json"
  assert not path.exists()
  with pytest.raises(KeyboardInterrupt):
    cli.main(["tune", "rnn", "--json", str(path), "--resume"])
  assert "no run at" in capsys.readouterr().out
  assert cli.main(["tune", "rnn", "--json", str(path), "--resume"]) == 0
  assert asked == [[c.label for c in cases], [c.label for c in cases[1:]]]
  assert f"1 cases timed, {len(cases) - 1} left" in capsys.readouterr().out
  # The ceilings the run measured are the ones its rows' rates were quoted against.
  assert given_ceilings == [{}, {"matmul TFLOP/s": 900.0}]
  saved = json.loads(path.read_text())
  assert [r["label"] for r in saved["rows"]] == [cases[0].label] * 3 + [cases[1].label] * 3
  assert saved["ceilings"] == {"matmul TFLOP/s": 900.0}
  # Not a run of this family on this GPU: nothing is timed into it.
  monkeypatch.setattr(registry, "device_kind", lambda: "NVIDIA Other GPU")
  assert cli.main(["tune", "rnn", "--json", str(path), "--resume"]) == 2
  assert len(asked) == 2
  # The default path is dated: a resumed run names its file.
  with pytest.raises(SystemExit):
    cli.main(["tune", "rnn", "--resume"])


def test_a_table_may_leave_rows_to_the_built_in_defaults(tables, monkeypatch):
  tables("gpu_a", device="GPU A", inherits=None, rows={"a": _row(1)})
  monkeypatch.setattr(registry, "device_kind", lambda: "GPU A")
  assert tuned.rows("f", lambda: {"a": 7, "b": 8}) == {"a": 1, "b": 8}
