"""GPU time per kernel of the GPT example's training step, per variant: where the step goes.

    python benchmarks/profile_gpt.py [--packed] [--top 25] [--variants fused,unfused-cudnn]
"""

import collections
import glob
import pathlib
import re
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import gpt  # noqa: E402


def kernel_times(fn, calls=3):
  """Microseconds per call of each GPU kernel name, from a profiler trace."""
  fn()
  totals = collections.Counter()
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir):
      for _ in range(calls):
        fn()
    for path in glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True):
      for plane in jax.profiler.ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU"):
          for line in plane.lines:
            if line.name.startswith("Stream"):
              for e in line.events:
                totals[e.name] += e.duration_ns / 1e3 / calls
  return totals


def main(argv):
  packed = "--packed" in argv
  top = int(argv[argv.index("--top") + 1]) if "--top" in argv else 25
  variants = (argv[argv.index("--variants") + 1].split(",") if "--variants" in argv
              else ["fused", "unfused-cudnn"])
  cfg = gpt.dataclasses.replace(gpt.PRESETS["gpt2"], vocab=50257)
  mesh = gpt.make_mesh(None)
  for variant in variants:
    trainer = gpt.Trainer(cfg, variant, mesh, 1000)
    step = trainer.compiled(cfg.batch, packed)
    batch = trainer.device_batch(gpt.random_batch(np.random.default_rng(0), cfg, packed))

    def run():
      trainer.params, trainer.opt_state, loss = step(trainer.params, trainer.opt_state, batch)
      float(loss)

    totals = kernel_times(run)
    print(f"\n## {variant}{' packed' if packed else ''}: {sum(totals.values()) / 1e3:.2f} ms "
          f"of kernels per step")
    # Each fusion's defining instruction names the source op it came from (its metadata).
    defined = {m.group(1).replace(".", "_"): m.group(0) for m in
               re.finditer(r"%([\w.-]+) = [^\n]*?metadata=\{op_name=\"([^\"]*)\"", step.as_text())}
    for name, us in totals.most_common(top):
      source = re.search(r'op_name="([^"]*)"', defined.get(name, ""))
      print(f"{us:10.1f} us  {name[:60]:60}  {source.group(1)[-90:] if source else ''}")
    del trainer, step


if __name__ == "__main__":
  main(sys.argv[1:])
