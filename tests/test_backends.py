"""How implementations are chosen when some cannot run: a JAX without Pallas's Triton backend,
a CUDA build that fails, cuDNN refusing, and JAX's Triton deprecation warning."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jaxfuse
from jaxfuse._core import registry
from jaxfuse._core.cuda import build
from jaxfuse.ops.norm import api as norm_api
from jaxfuse.ops.norm import cuda as norm_cuda
from jaxfuse.ops.softmax import api as softmax_api
from jaxfuse.ops.softmax import cuda as softmax_cuda

ROOT = Path(__file__).resolve().parents[1]


def _run(program: str, *python_flags: str, env=None) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
  return subprocess.run([sys.executable, *python_flags, "-c", textwrap.dedent(program)],
                        env=env, capture_output=True, text=True, timeout=600)


# Every op under None on a JAX whose Pallas has no Triton backend (the import fails, as it will
# once JAX removes it), compared with 'xla'; naming 'triton' says why it cannot run.
# JAXFUSE_WITHOUT_TRITON=1 makes the same program run as the day it is gone.
WITHOUT_TRITON = """
    import sys
    sys.modules["jax.experimental.pallas.triton"] = None
    import jax, jax.numpy as jnp, numpy as np
    import jaxfuse
    from jaxfuse._core import registry
    assert registry.pallas_triton is None
    assert "jax.experimental.pallas.triton" in registry.triton_unavailable()
    k = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(k[0], (8, 4096), jnp.float32)
    w = jax.random.normal(k[1], (4096,), jnp.float32)
    labels = jax.random.randint(k[2], (8,), 0, 4096)
    q = jax.random.normal(k[3], (2, 64, 4, 32), jnp.float16)
    mask = x > 0
    calls = {
        "rms_norm": lambda impl: jaxfuse.rms_norm(x, w, implementation=impl),
        "layer_norm": lambda impl: jaxfuse.layer_norm(x, w, w, implementation=impl),
        "softmax": lambda impl: jaxfuse.softmax(x, mask=mask, implementation=impl),
        "log_softmax": lambda impl: jaxfuse.log_softmax(x, implementation=impl),
        "softmax_cross_entropy":
            lambda impl: jaxfuse.softmax_cross_entropy(x, labels, implementation=impl),
        "attention": lambda impl: jaxfuse.attention(q, q, q, is_causal=True, implementation=impl),
    }
    for name, call in calls.items():
        grad = jax.grad(lambda *a: jnp.sum(call(None).astype(jnp.float32) ** 2))
        got, want = np.asarray(call(None), np.float64), np.asarray(call("xla"), np.float64)
        assert np.allclose(got, want, rtol=2e-2, atol=2e-2), name
        try:
            call("triton")
        except NotImplementedError as e:
            assert "jax.experimental.pallas.triton" in str(e), (name, e)
        else:
            raise AssertionError(f"{name}(implementation='triton') ran without Triton")
    print("ok")
"""


SWITCHED_OFF = (WITHOUT_TRITON
                .replace('sys.modules["jax.experimental.pallas.triton"] = None', "")
                .replace("registry.pallas_triton is None", "registry.pallas_triton is not None")
                .replace('"jax.experimental.pallas.triton" in', '"JAXFUSE_WITHOUT_TRITON" in'))


@pytest.mark.parametrize("program,switch", [(WITHOUT_TRITON, "0"), (SWITCHED_OFF, "1")],
                         ids=["gone", "switched off"])
def test_every_op_runs_without_pallas_triton(program, switch):
  result = _run(program, env={registry.WITHOUT_TRITON_VARIABLE: switch})
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("program,switch", [(WITHOUT_TRITON, "0"), (SWITCHED_OFF, "1")],
                         ids=["gone", "switched off"])
def test_every_op_runs_without_pallas_triton_on_the_gpu(program, switch):
  result = _run(program, env={registry.WITHOUT_TRITON_VARIABLE: switch})
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.skipif(registry.pallas_triton is None, reason="needs Pallas Triton")
def test_without_triton_switches_triton_off_inside_only(monkeypatch):
  monkeypatch.delenv(registry.WITHOUT_TRITON_VARIABLE, raising=False)
  x = jnp.linspace(-1.0, 1.0, 96).reshape(3, 32)
  assert registry.triton_unavailable() is None
  with jaxfuse.without_triton():
    with jaxfuse.without_triton():
      assert "switched off" in registry.triton_unavailable()
    with pytest.raises(NotImplementedError, match="JAXFUSE_WITHOUT_TRITON"):
      jaxfuse.softmax(x, implementation="triton")
  assert registry.triton_unavailable() is None
  monkeypatch.setenv(registry.WITHOUT_TRITON_VARIABLE, "0")
  assert registry.triton_unavailable() is None
  jaxfuse.softmax(x, implementation="triton")


@pytest.mark.triton
@pytest.mark.gpu
def test_none_shows_no_triton_deprecation_warning():
  # The softmax of 1024-element rows, the norms up to 16384 features and attention where cuDNN
  # refuses (segment ids) run Triton kernels under None; JAX warns as it lowers them.
  program = """
      import warnings
      import jax, jax.numpy as jnp
      import jaxfuse
      x = jax.random.normal(jax.random.key(0), (64, 1024), jnp.bfloat16)
      q = jax.random.normal(jax.random.key(1), (1, 256, 2, 64), jnp.bfloat16)
      ids = jnp.repeat(jnp.arange(2), 128)[None]
      def loss(x, q):
          y = jaxfuse.layer_norm(jaxfuse.softmax(x), x[0], x[0])
          o = jaxfuse.attention(q, q, q, segment_ids=ids)
          return jnp.sum(y.astype(jnp.float32)) + jnp.sum(o.astype(jnp.float32))
      jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1)))(x, q))
      with warnings.catch_warnings(record=True) as caught:
          warnings.simplefilter("always", DeprecationWarning)
          jaxfuse.rms_norm(x, implementation="triton")
      assert any("implementation='triton'" in str(w.message) for w in caught), caught
      print("ok")
  """
  result = _run(program, "-W", "error::DeprecationWarning")
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.fixture
def failing_build(tmp_path, monkeypatch):
  """A GPU that could run the CUDA kernels, whose nvcc fails every build; Triton runs."""
  nvcc = tmp_path / "nvcc"
  nvcc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\n"
                  "echo \"$*\" >> " + str(tmp_path / "compiles") + "\n"
                  "echo 'error: unsupported GPU' >&2; exit 1\n")
  nvcc.chmod(0o755)
  monkeypatch.setenv("JAXFUSE_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(registry, "platform", lambda: "gpu")
  monkeypatch.setattr(registry, "triton_unavailable", lambda: None)
  monkeypatch.setattr(build, "unavailable", lambda: None)
  monkeypatch.setattr(build, "gpu_arch", lambda: "sm_90")
  monkeypatch.setattr(build, "_toolchain", lambda: build.Toolchain(str(nvcc)))
  for module in (norm_cuda, softmax_cuda):
    monkeypatch.setattr(module, "LIBRARY",
                        build.Library(module.LIBRARY.source, module.LIBRARY.handlers))
  return tmp_path / "compiles"


def _rows(rows, n):
  return jax.ShapeDtypeStruct((rows, n), jnp.bfloat16)


def _norm_directions(*args):
  plan = norm_api._plan(*args)
  return plan.forward, plan.backward


def test_none_moves_on_from_a_failed_build(failing_build):
  for _ in range(3):
    assert _norm_directions("rms_norm", "rms", None, 32768, 64, jnp.bfloat16, jnp.bfloat16,
                            [jnp.bfloat16], lambda: "x") == ("triton", "xla")
    assert softmax_api._fastest("softmax", "evaluated", "forward", 131072, _rows(64, 131072),
                                lambda: None, (1, 131072, 64)) == "triton"
  # Each source was built once, the failure remembered.
  assert len(failing_build.read_text().splitlines()) == 2
  for op, library in (("rms_norm", norm_cuda), ("softmax", softmax_cuda)):
    backends = norm_api._BACKENDS if op == "rms_norm" else softmax_api._BACKENDS
    with pytest.raises(NotImplementedError, match="(?s)cannot run here.*unsupported GPU"):
      registry.resolve(op, "cuda", backends, ("xla",))


def test_none_without_triton_takes_cuda_then_xla(failing_build, monkeypatch):
  monkeypatch.setattr(registry, "triton_unavailable", lambda: "no Triton here")
  assert _norm_directions("layer_norm", "layer", None, 1024, 64, jnp.bfloat16, jnp.bfloat16,
                          [jnp.bfloat16], lambda: "x") == ("xla", "xla")
  assert softmax_api._fastest("softmax", "evaluated", "forward", 1024, _rows(64, 1024),
                              lambda: None, (64, 1024, 1)) == "xla"
  monkeypatch.setattr(norm_cuda, "unavailable", lambda: None)
  assert _norm_directions("layer_norm", "layer", None, 1024, 64, jnp.bfloat16, jnp.bfloat16,
                          [jnp.bfloat16], lambda: "x") == ("cuda", "cuda")


def test_none_passes_over_triton_for_a_dimension_past_int32(failing_build):
  assert softmax_api._fastest("softmax", "evaluated", "forward", 8, _rows(2**31, 8),
                              lambda: None, (1, 8, 2**31)) == "xla"
  assert _norm_directions("rms_norm", "rms", None, 8, 2**31, jnp.bfloat16, jnp.bfloat16, [],
                          lambda: "x") == ("xla", "xla")


def test_cudnn_refusal_of_any_kind_is_a_reason(monkeypatch):
  from jaxfuse.ops.attention import api as attention_api
  monkeypatch.setattr(attention_api, "_cudnn_call",
                      lambda *a: (_ for _ in ()).throw(RuntimeError("cuDNN is not installed")))
  attention_api._cudnn_rejects.cache_clear()
  try:
    reason = attention_api._cudnn_rejects(
        attention_api._Call(attention_api.MaskSpec(False, 0, None, None), 1.0, None, False,
                            False, False, False, False, False, jnp.dtype(jnp.bfloat16)),
        (((1, 128, 2, 64), jnp.dtype(jnp.bfloat16)),) * 3 + (None,) * 4)
  finally:
    attention_api._cudnn_rejects.cache_clear()
  assert "RuntimeError: cuDNN is not installed" in reason


def test_a_plan_names_one_implementation_per_use(monkeypatch):
  """A named implementation runs every use; None takes the first of its preference that runs,
  or on a GPU the family's fastest per use."""
  from jaxfuse._core import op
  backends = {"xla": registry.xla_available, "cuda": lambda: "no CUDA here",
              "triton": lambda: None}
  assert op.resolve_plan("f", "xla", backends, ("triton", "xla")) == op.Plan("xla", "xla", "xla")
  assert "triton" in op.resolve_plan("f", None, backends, ("cuda", "triton", "xla"))
  with pytest.raises(NotImplementedError, match=r"f\(implementation='cuda'\) .*no CUDA here"):
    op.resolve_plan("f", "cuda", backends, ("xla",))
  by_use = {"evaluated": "triton", "forward": "xla", "backward": "xla"}
  fastest = by_use.__getitem__
  assert op.resolve_plan("f", None, backends, ("xla",), fastest) == op.Plan("xla", "xla", "xla")
  monkeypatch.setattr(registry, "platform", lambda: "gpu")
  assert op.resolve_plan("f", None, backends, ("xla",), fastest) == op.Plan(**by_use)
  assert op.resolve_plan("f", "xla", backends, ("xla",), fastest) == op.Plan("xla", "xla", "xla")


def test_by_use_evaluates_one_implementation_and_differentiates_by_another():
  """A call only evaluated runs the plan's evaluated implementation; a differentiated one runs
  the forward's, with that implementation's own derivatives (here a deliberately different
  one), under jit and vmap too; the arrays past the differentiated ones take no gradient."""
  from jaxfuse._core import op
  traced = []

  @jax.custom_vjp
  def doubled_gradient(x):
    return jnp.sin(x)

  doubled_gradient.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (2 * jnp.cos(x) * g,))

  def implementation(scale, impl, x, shift):
    traced.append(impl)
    return scale * (jnp.sin(x) if impl == "plain" else doubled_gradient(x)) + shift

  f = op.by_use(implementation, static=1, differentiated=1)
  plan = op.Plan("plain", "doubled", "doubled")
  x, shift = jnp.array([0.3, -1.2, 2.0]), jnp.array([1, 2, 3])
  assert jnp.allclose(f(3.0, plan, x, shift), 3 * jnp.sin(x) + shift)
  assert traced == ["plain"]
  loss = lambda x: jnp.sum(f(3.0, plan, x, shift))
  assert jnp.allclose(jax.jit(jax.grad(loss))(x), 6 * jnp.cos(x))
  assert traced == ["plain", "doubled"]
  batched = jax.vmap(jax.grad(loss))(jnp.stack([x, 2 * x]))
  assert jnp.allclose(batched, 6 * jnp.cos(jnp.stack([x, 2 * x])))


def test_jaxfuse_nn_without_flax_says_how_to_install_it():
  code = ("import sys; sys.modules['flax'] = None\n"
          "try:\n  import jaxfuse.nn\nexcept ModuleNotFoundError as e:\n  print(e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300).stdout
  assert 'pip install "jaxfuse[nn]"' in out
