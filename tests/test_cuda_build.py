"""The CUDA build machinery on the CPU: finding nvcc (NVIDIA wheel layouts included), the cache
key, the lock between processes, failures remembered, timeouts, no partial files, and
``jaxfuse build``. A fake nvcc (a shell script) stands in for the compiler, so these run
anywhere; one test compiles a tiny source with a real nvcc where one is installed."""

import importlib
import os
import shutil
import pkgutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import jaxfuse
from jaxfuse import cli
from jaxfuse._core import registry
from jaxfuse._core.cuda import build

ROOT = Path(__file__).resolve().parents[1]


def _script(path: Path, body: str) -> str:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
  path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
  return str(path)


# Writes its -o argument and counts its compiles in $FAKE_NVCC_LOG; --version prints a version,
# --help its options ($FAKE_NVCC_OPTIONS).
FAKE_NVCC = """\
if [ "$1" = "--version" ]; then echo "fake nvcc ${FAKE_NVCC_VERSION:-1}"; exit 0; fi
if [ "$1" = "--help" ]; then echo "${FAKE_NVCC_OPTIONS:-}"; exit 0; fi
echo compile >> "$FAKE_NVCC_LOG"
sleep "${FAKE_NVCC_SLEEP:-0}"
if [ -n "$FAKE_NVCC_FAIL" ]; then echo "error: $FAKE_NVCC_FAIL" >&2; exit 2; fi
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
echo library > "$out"
"""


@pytest.fixture
def toolchain(tmp_path, monkeypatch):
  """A fake nvcc, an empty cache and no other toolkit in sight."""
  nvcc = _script(tmp_path / "bin" / "nvcc", FAKE_NVCC)
  monkeypatch.setenv("JAXFUSE_CACHE", str(tmp_path / "cache"))
  monkeypatch.setenv("FAKE_NVCC_LOG", str(tmp_path / "compiles"))
  monkeypatch.delenv("JAXFUSE_BUILD_TIMEOUT", raising=False)
  monkeypatch.setattr(build, "_vendor_flags", lambda vendor: (f"-l{vendor}",))
  return build.Toolchain(nvcc)


@pytest.fixture
def source(tmp_path):
  path = tmp_path / "src" / "kernel.cu"
  path.parent.mkdir()
  path.write_text('#include "local.cuh"\n')
  (path.parent / "local.cuh").write_text("// v1\n")
  return path


def _compiles(tmp_path) -> int:
  log = tmp_path / "compiles"
  return len(log.read_text().split()) if log.exists() else 0


def _leftovers(tmp_path):
  return [p.name for p in (tmp_path / "cache" / "cuda").iterdir() if "partial" in p.name]


def test_builds_once_and_says_so(tmp_path, toolchain, source, capsys):
  first = build.build(source, "sm_90", toolchain)
  assert first.read_text() == "library\n"
  err = capsys.readouterr().err
  assert "building kernel.cu for sm_90" in err and "built kernel.cu in" in err
  assert build.build(source, "sm_90", toolchain) == first
  assert capsys.readouterr().err == ""
  assert _compiles(tmp_path) == 1


@pytest.mark.parametrize("change", ["header", "arch", "compiler", "flags"])
def test_cache_key_covers_what_goes_into_the_binary(tmp_path, toolchain, source, monkeypatch,
                                                    change):
  before = build.cache_key(source, "sm_90", toolchain)
  if change == "header":
    (source.parent / "local.cuh").write_text("// v2\n")
  elif change == "arch":
    assert build.cache_key(source, "sm_100", toolchain) != before
    return
  elif change == "compiler":
    monkeypatch.setenv("FAKE_NVCC_VERSION", "2")
    build._compiler_versions.cache_clear()
  else:
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + ("-lineinfo",))
  try:
    assert build.cache_key(source, "sm_90", toolchain) != before
  finally:
    build._compiler_versions.cache_clear()


def test_a_copy_of_the_sources_elsewhere_shares_the_cache(tmp_path, toolchain, source,
                                                         monkeypatch):
  before = build.cache_key(source, "sm_90", toolchain)
  copy = tmp_path / "elsewhere" / "jaxfuse" / "_core" / "cuda"
  shutil.copytree(build._HERE, copy)
  monkeypatch.setattr(build, "_HERE", copy)
  assert build.cache_key(source, "sm_90", toolchain) == before
  (copy / "rows.cuh").write_text("// changed\n")
  assert build.cache_key(source, "sm_90", toolchain) != before


@pytest.mark.parametrize("options,expected", [
    ("--split-compile <number>  (-split-compile)", ["--split-compile=4"]), ("--threads", [])])
def test_device_compilation_split_where_nvcc_can(toolchain, source, monkeypatch, options,
                                                 expected):
  monkeypatch.setenv("FAKE_NVCC_OPTIONS", options)
  build.splits_compilation.cache_clear()
  try:
    split = lambda threads: [f for f in build._command(toolchain, source, "sm_90", "out.so",
                                                       threads=threads) if f.startswith("--split")]
    assert split(4) == expected and split(1) == []
    assert not build.splits_compilation("/no/such/nvcc")
    # The same binary either way: a cache built on a machine of other CPUs still serves.
    key = build.cache_key(source, "sm_90", toolchain)
    monkeypatch.setattr(build, "compile_threads", lambda: 64)
    assert build.cache_key(source, "sm_90", toolchain) == key
  finally:
    build.splits_compilation.cache_clear()


def test_a_failed_build_raises_and_leaves_nothing(tmp_path, toolchain, source, monkeypatch):
  monkeypatch.setenv("FAKE_NVCC_FAIL", "no such intrinsic")
  with pytest.raises(RuntimeError, match="(?s)building kernel.cu failed.*no such intrinsic"):
    build.build(source, "sm_90", toolchain)
  assert _leftovers(tmp_path) == []
  assert not list((tmp_path / "cache" / "cuda").glob("*.so"))


def test_a_build_past_its_time_is_stopped(tmp_path, toolchain, source, monkeypatch):
  monkeypatch.setenv("FAKE_NVCC_SLEEP", "30")
  monkeypatch.setenv("JAXFUSE_BUILD_TIMEOUT", "0.5")
  with pytest.raises(RuntimeError, match="longer than 0 s|longer than 1 s"):
    build.build(source, "sm_90", toolchain)
  assert _leftovers(tmp_path) == []


def test_bad_timeout_is_named(toolchain, source, monkeypatch):
  monkeypatch.setenv("JAXFUSE_BUILD_TIMEOUT", "soon")
  with pytest.raises(ValueError, match="JAXFUSE_BUILD_TIMEOUT"):
    build.build(source, "sm_90", toolchain)


def test_concurrent_processes_build_once(tmp_path, toolchain, source, monkeypatch):
  monkeypatch.setenv("FAKE_NVCC_SLEEP", "2")
  program = textwrap.dedent(f"""
      from jaxfuse._core.cuda import build
      print(build.build({str(source)!r}, "sm_90", build.Toolchain({toolchain.nvcc!r})))
  """)
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  procs = [subprocess.Popen([sys.executable, "-c", program], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
  outs = [p.communicate(timeout=120) for p in procs]
  assert all(p.returncode == 0 for p in procs), outs
  assert outs[0][0] == outs[1][0]
  assert _compiles(tmp_path) == 1
  assert any("waiting for another process building kernel.cu" in err for _, err in outs)


def test_library_remembers_a_failed_build(tmp_path, toolchain, source, monkeypatch):
  monkeypatch.setenv("FAKE_NVCC_FAIL", "broken toolchain")
  monkeypatch.setattr(build, "unavailable", lambda: None)
  monkeypatch.setattr(build, "gpu_arch", lambda: "sm_90")
  monkeypatch.setattr(build, "_toolchain", lambda: toolchain)
  library = build.Library(source, {"target": "Handler"})
  for _ in range(3):
    reason = library.unavailable()
    assert "building kernel.cu failed" in reason and "broken toolchain" in reason
  with pytest.raises(NotImplementedError, match="broken toolchain"):
    library.load()
  assert _compiles(tmp_path) == 1
  # `implementation=None` passes over it, with the reason logged.
  assert not registry.runs("op", "cuda", library.unavailable)


def _wheel(site: Path, layout: str, static_runtime: bool = True) -> Path:
  nvcc = {"cu13": "nvidia/cu13/bin/nvcc", "cu12": "nvidia/cu12/bin/nvcc",
          "components": "nvidia/cuda_nvcc/bin/nvcc"}[layout]
  _script(site / nvcc, FAKE_NVCC)
  if layout == "components":
    include, lib = site / "nvidia/cuda_runtime/include", site / "nvidia/cuda_runtime/lib"
  else:
    include, lib = site / f"nvidia/{layout}/include", site / f"nvidia/{layout}/lib"
  include.mkdir(parents=True)
  (include / "cuda_runtime.h").write_text("")
  lib.mkdir(parents=True)
  (lib / ("libcudart_static.a" if static_runtime else "libcudart.so.12")).write_text("")
  return site / nvcc


@pytest.fixture
def no_toolkit(monkeypatch, tmp_path):
  monkeypatch.delenv("JAXFUSE_NVCC", raising=False)
  monkeypatch.delenv("CUDA_HOME", raising=False)
  monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
  monkeypatch.setattr(build, "DEFAULT_TOOLKIT", str(tmp_path / "no-toolkit"))


@pytest.mark.parametrize("layout", ["cu13", "cu12", "components"])
def test_nvcc_found_in_nvidia_wheels(tmp_path, no_toolkit, layout):
  site = tmp_path / "site-packages"
  nvcc = _wheel(site, layout)
  found = build.find_toolchain([tmp_path / "elsewhere", site])
  assert found.nvcc == str(nvcc)
  assert any(Path(d, "cuda_runtime.h").exists() for d in found.include_dirs)
  flags = build._command(found, Path("k.cu"), "sm_90", "out.so")
  assert any(f.startswith("-I") and f.endswith("include") for f in flags)
  assert "--cudart=none" not in flags


def test_wheel_runtime_without_static_library_links_the_shared_one(tmp_path, no_toolkit):
  site = tmp_path / "site-packages"
  _wheel(site, "components", static_runtime=False)
  found = build.find_toolchain([site])
  flags = found.link_flags()
  assert "--cudart=none" in flags and flags[-1].endswith("libcudart.so.12")


def test_explicit_nvcc_comes_first(tmp_path, no_toolkit, monkeypatch):
  _wheel(tmp_path / "site-packages", "cu13")
  mine = _script(tmp_path / "mine" / "nvcc", FAKE_NVCC)
  monkeypatch.setenv("JAXFUSE_NVCC", mine)
  assert build.find_toolchain([tmp_path / "site-packages"]) == build.Toolchain(mine)


def test_no_nvcc_anywhere(tmp_path, no_toolkit):
  assert build.find_toolchain([tmp_path]) is None


def test_cli_build_builds_every_library(tmp_path, toolchain, monkeypatch, capsys):
  monkeypatch.setattr(build, "_toolchain", lambda: toolchain)
  assert cli.main(["build", "--arch", "sm_90"]) == 0
  out = capsys.readouterr().out
  assert "norm.cu for sm_90:" in out and "softmax.cu for sm_90:" in out
  assert _compiles(tmp_path) == len(cli.cuda_libraries())


@pytest.mark.parametrize("missing,source,message", [
    ("cudnn", "rnn_cudnn.cu", "cuDNN 9 was not found"),
    ("cublaslt", "gelu_gemm.cu", "cuBLASLt was not found")])
def test_cli_build_leaves_out_what_links_a_vendor_library_it_lacks(tmp_path, toolchain,
                                                                   monkeypatch, capsys, missing,
                                                                   source, message):
  monkeypatch.setattr(build, "_toolchain", lambda: toolchain)
  monkeypatch.setattr(build, "_vendor_flags",
                      lambda vendor: None if vendor == missing else (f"-l{vendor}",))
  assert cli.main(["build", "--arch", "sm_90"]) == 0
  assert f"{source} left out: {message}" in capsys.readouterr().err
  assert _compiles(tmp_path) == len(cli.cuda_libraries()) - 1


@pytest.mark.parametrize("layout,library", [("nvidia/cudnn", "libcudnn.so.9"),
                                            ("nvidia/cu13", "libcublasLt.so.13"),
                                            ("nvidia/cublas", "libcublasLt.so.12")])
def test_vendor_libraries_are_found_in_the_wheels_jax_brings(tmp_path, layout, library):
  home = tmp_path / layout
  (home / "include").mkdir(parents=True)
  (home / "lib").mkdir()
  (home / "include" / ("cudnn.h" if "cudnn" in library else "cublasLt.h")).write_text("")
  (home / "lib" / library).write_text("")
  find = build.find_cudnn if "cudnn" in library else build.find_cublaslt
  flags = find([tmp_path])
  assert flags[:3] == (f"-I{home / 'include'}", f"-L{home / 'lib'}", f"-l:{library}")
  assert f"-rpath={home / 'lib'}" in flags


@pytest.mark.parametrize("arch", ["sm_75", "90", "hopper"])
def test_cli_build_refuses_an_architecture_before_ampere_at_once(toolchain, monkeypatch, capsys,
                                                                 arch):
  monkeypatch.setattr(build, "_toolchain", lambda: toolchain)
  assert cli.main(["build", "--arch", arch]) == 2
  assert "need sm_80 (Ampere) or newer" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["sm_80", "compute_80"])
def test_cli_build_for_ampere_leaves_out_what_only_hopper_runs(tmp_path, toolchain, monkeypatch,
                                                               capsys, arch):
  monkeypatch.setattr(build, "_toolchain", lambda: toolchain)
  assert cli.main(["build", "--arch", arch]) == 0
  out = capsys.readouterr().out
  assert f"norm.cu for {arch}:" in out and "rnn.cu" not in out
  assert _compiles(tmp_path) == len(cli.cuda_libraries()) - 1


def test_the_families_name_every_library_the_build_makes():
  defined = set()
  for module in pkgutil.walk_packages(jaxfuse.__path__, "jaxfuse."):
    if module.name != "jaxfuse.__main__":
      if isinstance(vars(importlib.import_module(module.name)).get("LIBRARY"), build.Library):
        defined.add(module.name)
  assert defined == set(cli.cuda_libraries())


@pytest.mark.parametrize("implementations, wanted", [
    (None, ["jaxfuse._core.cuda.copies", "jaxfuse.ops.rnn.cuda", "jaxfuse.ops.rnn.cudnn",
            "jaxfuse.ops.softmax.cuda"]),
    (["xla", "torch"], ["jaxfuse._core.cuda.copies"]),
])
def test_the_bench_loads_its_families_libraries_side_by_side(monkeypatch, implementations,
                                                             wanted):
  """Each library waits for the others at a barrier: loaded one after another, the first
  would wait alone until the barrier breaks. Implementations that run no CUDA code need only
  the ceilings' copies."""
  barrier, loaded = threading.Barrier(len(wanted), timeout=20), []

  def load(module):
    loaded.append(module)
    barrier.wait()

  for module in cli.cuda_libraries():
    monkeypatch.setattr(importlib.import_module(module).LIBRARY, "unavailable",
                        lambda module=module: load(module))
  cli._load_libraries({"rnn", "linear_cross_entropy", "attention"}, implementations)
  assert sorted(loaded) == wanted


def test_the_bench_builds_in_the_background_and_says_which_families_are_ready(monkeypatch):
  """A family waits for its own libraries and the ceilings' copies only: with the norm
  library's build held back, attention and softmax are ready, the norms once it ends."""
  release = threading.Event()
  for module in cli.cuda_libraries():
    held = module == "jaxfuse.ops.norm.cuda"
    monkeypatch.setattr(importlib.import_module(module).LIBRARY, "unavailable",
                        (lambda: release.wait(20) and None) if held else (lambda: None))
  built = cli._load_libraries({"norm", "softmax", "attention"}, wait=False)
  for _ in range(200):
    if built("softmax"):
      break
    time.sleep(0.05)
  assert built("softmax") and built("attention") and not built("norm")
  release.set()
  for _ in range(200):
    if built("norm"):
      break
    time.sleep(0.05)
  assert built("norm")


def test_architectures_read_as_numbers():
  assert [build.arch_number(a) for a in ("sm_90", "sm_90a", "compute_80", "sm_100", "ampere",
                                         "sm90")] == [90, 90, 80, 100, None, None]


def test_cli_build_without_gpu_or_arch_says_why(capsys):
  if registry.platform() == "gpu":
    pytest.skip("this machine has a GPU")
  assert cli.main(["build"]) == 1
  assert "--arch" in capsys.readouterr().err


def test_real_nvcc_builds_a_tiny_source(tmp_path, monkeypatch):
  real = build.find_toolchain()
  if real is None:
    pytest.skip("no nvcc here")
  monkeypatch.setenv("JAXFUSE_CACHE", str(tmp_path / "cache"))
  source = tmp_path / "tiny.cu"
  source.write_text('extern "C" __global__ void jaxfuse_probe(float* x) { x[threadIdx.x] = 1; }\n')
  library = build.build(source, "sm_90", real)
  assert library.stat().st_size > 0 and _leftovers(tmp_path) == []


def test_cli_build_without_nvcc_says_why(monkeypatch, capsys):
  monkeypatch.setattr(build, "_toolchain", lambda: None)
  assert cli.main(["build", "--arch", "sm_90"]) == 1
  assert "nvcc was not found" in capsys.readouterr().err
