"""Tuned tables: the measured choices of each op family on each GPU, kept as data.

A family's table for a GPU is ``jaxfuse/ops/<family>/tuned/<device>.json``, ``<device>`` the
GPU's name in lower case with runs of other characters as ``_`` (``nvidia_h100_80gb_hbm3``)::

  {"device": "NVIDIA H100 80GB HBM3",
   "inherits": null,
   "rows": {"<name>": {"value": ..., "source": "benchmarks/results/<file>.json"}}}

Every row names the recorded run it was read from. A table that ``inherits`` another takes
that table's rows under its own, so a GPU measured on a few shapes overrides only those; a row
is replaced whole (a table that overrides ``rules`` restates the inherited rules it keeps). A
GPU without a table, and a row a table lacks, take the family's built-in defaults
(``_untuned()`` in the family's ``api.py``: what the kernels' limits and the measured GPUs
agree on); for a GPU without a table the ``jaxfuse`` logger says so once per family.
``jaxfuse tune FAMILY --write`` (:mod:`jaxfuse._core.tune`) writes the rows it measures.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jaxfuse._core import registry

logger = logging.getLogger("jaxfuse")
_OPS = Path(__file__).resolve().parent.parent / "ops"


def device_file(kind: str) -> str:
  """The file stem of ``kind``'s tables: ``'NVIDIA H200'`` -> ``'nvidia_h200'``."""
  return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_")


def table_path(family: str, stem: str) -> Path:
  return _OPS / family / "tuned" / f"{stem}.json"


def read_table(family: str, stem: str, _seen: tuple[str, ...] = ()) -> dict[str, dict] | None:
  """``{name: {"value", "source"}}`` of ``family``'s table ``stem`` with what it inherits,
  or None where there is no such table."""
  path = table_path(family, stem)
  if not path.is_file():
    return None
  if stem in _seen:
    raise ValueError(f"tuned tables inherit in a cycle: {' -> '.join(_seen + (stem,))}")
  table = json.loads(path.read_text())
  rows = {}
  if table.get("inherits"):
    inherited = read_table(family, table["inherits"], _seen + (stem,))
    if inherited is None:
      raise ValueError(f"{path} inherits {table['inherits']!r}, which has no table")
    rows.update(inherited)
  rows.update(table["rows"])
  return rows


@functools.cache
def _rows_for(family: str, kind: str | None) -> dict[str, Any] | None:
  """Row values of ``family``'s table for ``kind``, read once."""
  table = None if kind is None else read_table(family, device_file(kind))
  return None if table is None else {name: row["value"] for name, row in table.items()}


def rows(family: str, untuned: Callable[[], Mapping[str, Any]]) -> dict[str, Any]:
  """The values of ``family``'s rows for the default GPU: from its table, else (a GPU never
  measured, a row its table lacks, or no GPU) ``untuned()``, the family's built-in defaults."""
  kind = registry.device_kind()
  if _rows_for(family, kind) is None and kind is not None:
    _log_untuned(family, kind)
  return _merged(family, kind, untuned)


@functools.cache
def _merged(family: str, kind: str | None, untuned: Callable[[], Mapping[str, Any]]):
  """``untuned()`` under the table's rows, built once per family, GPU and defaults."""
  return {**untuned(), **(_rows_for(family, kind) or {})}


@functools.cache
def _log_untuned(family: str, kind: str):
  logger.info("jaxfuse: no tuned %s table for %s (jaxfuse/ops/%s/tuned/%s.json); its choices "
              "are the built-in defaults", family, kind, family, device_file(kind))


# A rule's conditions: facts that must be equal (or one of a list), and bounds on the row
# length, the element count and the rows, their quotient (inclusive).
_MEASURES = {"length": lambda facts: facts["length"],
             "elements": lambda facts: facts["elements"],
             "rows": lambda facts: facts["elements"] // max(facts["length"], 1)}
_BOUNDS = {f"{bound}_{measure}": (_MEASURES[measure], sign)
           for measure in _MEASURES for bound, sign in (("min", 1), ("max", -1))}


def matches(when: Mapping[str, Any], facts: Mapping[str, Any]) -> bool:
  """Whether a rule's ``when`` holds for a call's ``facts``."""
  for key, wanted in when.items():
    if key in _BOUNDS:
      measure, sign = _BOUNDS[key]
      if sign * (measure(facts) - wanted) < 0:
        return False
    elif not (facts[key] in wanted if isinstance(wanted, list) else facts[key] == wanted):
      return False
  return True


def ruled(rules, facts: Mapping[str, Any], runs: Callable[[str], bool]) -> str | None:
  """The implementation of the first rule that holds for ``facts`` and whose implementation
  ``runs`` this call, or None: measured exceptions to a family's general rule, in order."""
  for rule in rules:
    if matches(rule["when"], facts) and runs(rule["use"]):
      return rule["use"]
  return None
