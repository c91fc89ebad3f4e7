"""GPU time per kernel of the GPT example's training step, per variant: where the step goes.

    python benchmarks/profile_gpt.py [--packed] [--top 25] [--gaps 12] [--variants fused,...]

``--gaps N`` also traces steps enqueued back to back, as the bench runs them, and prints the
GPU's idle time a step (no kernel on any stream) and the N longest idle gaps between kernels.
"""

import collections
import functools
import glob
import pathlib
import re
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import gpt  # noqa: E402


def kernel_events(fn):
  """(start_ns, end_ns, name) of every GPU kernel that ``fn`` runs, from a profiler trace."""
  fn()
  events = []
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir):
      fn()
    for path in glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True):
      for plane in jax.profiler.ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU"):
          for line in plane.lines:
            if line.name.startswith("Stream"):
              events += [(e.start_ns, e.end_ns, e.name) for e in line.events]
  return sorted(events)


def kernel_times(fn, calls=3):
  """Microseconds per call of each GPU kernel name."""
  totals = collections.Counter()
  for start, end, name in kernel_events(lambda: [fn() for _ in range(calls)]):
    totals[name] += (end - start) / 1e3 / calls
  return totals


GAP_STEPS = 5
HOST_STALL_NS = 1_000_000


def print_gaps(events, steps, top):
  """The GPU's idle time per step over back-to-back steps, and the longest idle gaps."""
  gaps, busy_until, before = [], events[0][1], events[0][2]
  for start, end, name in events[1:]:
    if start > busy_until:
      gaps.append((start - busy_until, before, name))
    if end > busy_until:
      busy_until, before = end, name
  idle = sum(g for g, _, _ in gaps)
  # Gaps of a millisecond or more are the host's (the profiler slows its dispatch), not the
  # step's own: counted apart so that one cannot hide the many short ones.
  stalls = sum(g for g, _, _ in gaps if g >= HOST_STALL_NS)
  span = busy_until - events[0][0]
  print(f"idle {(idle - stalls) / steps / 1e3:.1f} us a step in gaps under "
        f"{HOST_STALL_NS / 1e6:.0f} ms ({len(gaps) / steps:.0f} gaps a step), "
        f"{stalls / steps / 1e3:.1f} us in longer ones, of {span / steps / 1e3:.1f} us; "
        "longest:")
  for gap, before, after in sorted(gaps, reverse=True)[:top]:
    print(f"{gap / 1e3:10.1f} us  after {before[:50]:50}  before {after[:50]}")


def main(argv):
  packed = "--packed" in argv
  top = int(argv[argv.index("--top") + 1]) if "--top" in argv else 25
  gaps = int(argv[argv.index("--gaps") + 1]) if "--gaps" in argv else 0
  variants = (argv[argv.index("--variants") + 1].split(",") if "--variants" in argv
              else ["fused", "unfused-cudnn"])
  cfg = gpt.dataclasses.replace(gpt.PRESETS["gpt2"], vocab=50257)
  mesh = gpt.make_mesh(None)
  for variant in variants:
    trainer = gpt.Trainer(cfg, variant, mesh, 1000)
    step = trainer.compiled(cfg.batch, packed)
    batch = trainer.device_batch(gpt.random_batch(np.random.default_rng(0), cfg, packed))

    def run_back_to_back(steps):
      for _ in range(steps):
        trainer.params, trainer.opt_state, loss = step(trainer.params, trainer.opt_state, batch)
      float(loss)

    run = functools.partial(run_back_to_back, 1)

    totals = kernel_times(run)
    print(f"\n## {variant}{' packed' if packed else ''}: {sum(totals.values()) / 1e3:.2f} ms "
          f"of kernels per step")
    # Each fusion's defining instruction names the source op it came from (its metadata).
    defined = {m.group(1).replace(".", "_"): m.group(0) for m in
               re.finditer(r"%([\w.-]+) = [^\n]*?metadata=\{op_name=\"([^\"]*)\"", step.as_text())}
    for name, us in totals.most_common(top):
      source = re.search(r'op_name="([^"]*)"', defined.get(name, ""))
      print(f"{us:10.1f} us  {name[:60]:60}  {source.group(1)[-90:] if source else ''}")
    if gaps:
      print_gaps(kernel_events(functools.partial(run_back_to_back, GAP_STEPS)), GAP_STEPS, gaps)
    del trainer, step


if __name__ == "__main__":
  main(sys.argv[1:])
