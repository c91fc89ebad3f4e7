"""jaxfuse's CUDA kernels: how rows are tiled over thread-block clusters (rows.cuh), and the
:class:`~jaxfuse._core.cuda.build.Library` each family's ``.cu`` source is built and
registered through (build.py). Nothing is built at import time, and nothing at all off a GPU.
"""

from __future__ import annotations

import dataclasses
import math

from jaxfuse._core.cuda.build import MAX_CLUSTER, Library, cluster_limit, unavailable

__all__ = ["GRID_WAVES", "Library", "Tiling", "cluster_limit", "holder", "longest_row",
           "persistent_clusters", "short_tiling", "tiling", "unavailable"]

UNIT = 8  # elements per 16-byte (or, for float32, 32-byte) vector
MAX_THREADS = 512
# Persistent row kernels launch several waves of the clusters resident at once, not exactly
# one: the block scheduler then hands the last rows to whichever SMs free up first, where one
# wave fixes every SM's share of the rows at launch (benchmarks/tune.py times the waves).
GRID_WAVES = 4
MAX_GRID = 2**31 - 1  # rows.cuh kMaxGridX: CUDA's limit on a grid's x dimension


def persistent_clusters(resident: int, n_rows: int, waves: int = GRID_WAVES) -> int:
  """Clusters a persistent row kernel launches: ``waves`` times the ``resident`` ones, and
  none without a row."""
  return max(1, min(n_rows, resident * waves))


def streamed_ctas(n_rows: int) -> int:
  """CTAs a streaming kernel launches: one a row (the block scheduler hands each SM its next
  row as one finishes), within CUDA's grid; each walks rows c, c + CTAs, ... past that."""
  return max(1, min(n_rows, MAX_GRID))


@dataclasses.dataclass(frozen=True)
class Tiling:
  """A row is held by ``cluster`` CTAs of ``threads`` threads, ``units`` 8-element units each,
  fed through ``stages`` shared-memory stages, or through registers when 0 (rows.cuh). With
  ``lanes`` (a power of two up to 32), a short row is held by that many lanes of one warp
  instead, and each CTA of ``threads`` holds ``threads // lanes`` rows (rows.cuh LaneSlice).
  With ``units=0`` (:meth:`streaming`, the cross-entropy's alone) no row is held: one CTA of
  ``threads`` walks each row of any length, one CTA a row."""
  cluster: int
  threads: int
  units: int
  stages: int = 0
  lanes: int = 0

  @classmethod
  def streaming(cls, threads: int) -> Tiling:
    return cls(1, threads, 0)

  @property
  def is_streaming(self) -> bool:
    return self.units == 0

  @property
  def capacity(self) -> int | float:
    if self.is_streaming:
      return math.inf
    if self.lanes:
      return self.lanes * self.units * UNIT
    return self.cluster * self.threads * self.units * UNIT

  def check(self, n_cols: int):
    if self.is_streaming and (self.cluster != 1 or self.stages or self.lanes):
      raise ValueError(f"{self}: a streaming tiling takes one CTA a row, no stages, no lanes")
    if self.lanes and (self.lanes & (self.lanes - 1) or self.lanes > 32 or self.cluster != 1
                       or self.threads % 32):
      raise ValueError(f"{self}: a short-row tiling takes a power of two up to 32 lanes, whole "
                       f"warps and no cluster")
    if self.capacity < n_cols:
      raise ValueError(f"{self} holds {self.capacity} elements of a row, fewer than its {n_cols}")


def holder(max_cluster: int) -> str:
  """What holds a long row, in words, for clusters of up to ``max_cluster`` CTAs."""
  return "cluster" if max_cluster > 1 else "CTA (no thread-block clusters before sm_90)"


def longest_row(units_choices, max_cluster: int = MAX_CLUSTER) -> int:
  """Elements of the longest row ``max_cluster`` CTAs of 512 threads hold at the widest of
  these slices."""
  return max_cluster * MAX_THREADS * max(units_choices) * UNIT


def tiling(n_cols: int, units_choices, *, min_cluster: int = 1, max_cluster: int = MAX_CLUSTER,
           max_threads: int = MAX_THREADS, stages: int = 0) -> Tiling | None:
  """The first ``units`` per thread at which ``max_cluster`` CTAs (at most the
  :func:`cluster_limit` of the kernels built here) of at most ``max_threads`` threads hold the
  row: the smallest such cluster of at least ``min_cluster`` CTAs, trimmed to the fewest
  threads (whole warps) that still cover it."""
  max_cluster = min(max_cluster, cluster_limit())
  n_units = math.ceil(n_cols / UNIT)
  for units in units_choices:
    cluster = min(max_cluster, max(min_cluster, math.ceil(n_units / (max_threads * units))))
    threads = 32 * math.ceil(n_units / (cluster * units) / 32)
    if threads <= max_threads:
      return Tiling(cluster, threads, units, stages)
  return None


def short_tiling(n_cols: int, units_choices, *, threads: int = 256) -> Tiling | None:
  """The first ``units`` per thread at which one warp holds the row, on the fewest lanes (a
  power of two) that cover it, then trimmed to the fewest of ``units_choices`` those lanes
  need, in CTAs of ``threads``."""
  n_units = math.ceil(n_cols / UNIT)
  for units in units_choices:
    lanes = 1 << max(0, math.ceil(n_units / units) - 1).bit_length()
    if lanes <= 32:
      units = min(u for u in units_choices if lanes * u >= n_units)
      return Tiling(1, threads, units, 0, lanes)
  return None
