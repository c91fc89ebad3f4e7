"""The GPUs' SM clock and board power over a timed run, sampled by ``nvidia-smi`` in the
background. At its power cap a GPU lowers its clocks, so a program that draws more power per
step runs slower than its kernels timed alone would say; the samples show it beside the times.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
import time

import jax


def nvidia_smi_command(interval_ms: int = 100) -> list[str] | None:
  """``nvidia-smi`` sampling this process's GPUs every ``interval_ms``, a line per GPU
  (``clock MHz, power W``); None off a GPU or without ``nvidia-smi``."""
  if jax.default_backend() != "gpu" or shutil.which("nvidia-smi") is None:
    return None
  # nvidia-smi numbers every GPU of the machine (by PCI bus, as CUDA does with
  # CUDA_DEVICE_ORDER=PCI_BUS_ID; its default, fastest first, differs only among unlike GPUs);
  # CUDA numbers the visible ones.
  visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
             if v.strip()]
  ordinals = [d.local_hardware_id for d in jax.local_devices()]
  names = [visible[o] if o < len(visible) else str(o) for o in ordinals]
  return ["nvidia-smi", "-i", ",".join(names), "--query-gpu=clocks.sm,power.draw",
          "--format=csv,noheader,nounits", f"--loop-ms={interval_ms}"]


class ClockSampler:
  """While open, collects ``command``'s samples (lines ending ``clock, power``; default
  :func:`nvidia_smi_command`) with the ``time.perf_counter()`` of their arrival. ``over(start,
  end)`` gives the mean SM clock (MHz) and board power (W a GPU) sampled between two such
  readings, or None where nothing was (no GPU, no ``nvidia-smi``, a window shorter than the
  interval). The clock is the moment's; nvidia-smi's ``power.draw`` is, on recent drivers,
  an average over about a second, so a short window's power also holds what ran before it."""

  def __init__(self, command: list[str] | None = None):
    self._command = nvidia_smi_command() if command is None else command
    self._samples: list[tuple[float, float, float]] = []
    self._process = self._reader = None

  def __enter__(self) -> ClockSampler:
    if self._command:
      try:
        self._process = subprocess.Popen(self._command, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
      except OSError:
        return self
      self._reader = threading.Thread(target=self._read, daemon=True)
      self._reader.start()
    return self

  def _read(self):
    for line in self._process.stdout:
      try:
        clock, power = (float(v) for v in line.split(",")[-2:])
      except ValueError:  # "[N/A]" where a GPU does not report one
        continue
      self._samples.append((time.perf_counter(), clock, power))

  def __exit__(self, *exc):
    if self._process is not None:
      self._process.terminate()
      try:
        self._process.wait(timeout=5)
      except subprocess.TimeoutExpired:
        self._process.kill()
        self._process.wait()
      self._reader.join()
      self._process.stdout.close()

  def over(self, start: float, end: float) -> dict | None:
    inside = [s for s in self._samples if start <= s[0] <= end]
    if not inside:
      return None
    return dict(clock_mhz=statistics.fmean(s[1] for s in inside),
                power_w=statistics.fmean(s[2] for s in inside))
