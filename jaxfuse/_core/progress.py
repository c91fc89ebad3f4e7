"""What a long bench or tuning run is doing now, on stderr."""

from __future__ import annotations

import sys
import time


class Progress:
  """What is being checked or timed now: a bar on a terminal, else a line per step with the
  seconds since the start (so a redirected run's log shows where it is and where time went)."""

  def __init__(self, total):
    self.total, self.done = total, 0
    self.tty = sys.stderr.isatty()
    self.start = time.perf_counter()

  def show(self, text):
    """``text`` names work that precedes the next counted step (inputs, references)."""
    self._write(text)

  def step(self, text):
    self.done += 1
    self._write(text)

  def _write(self, text):
    if self.tty:
      filled = int(30 * self.done / self.total)
      sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                       f"{text[:60]:<60}")
    else:
      elapsed = time.perf_counter() - self.start
      sys.stderr.write(f"[{self.done}/{self.total} {elapsed:.0f}s] {text}\n")
    sys.stderr.flush()

  def close(self):
    if self.tty:
      sys.stderr.write("\n")
