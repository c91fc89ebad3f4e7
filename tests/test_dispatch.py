"""Which implementation each op runs, with the GPU faked on the CPU: the rules by which
``implementation=None`` chooses, and by which a named GPU implementation refuses a call, at
their thresholds.

The fake is what the rules consult: the platform, compute capability and device name
(``registry``), whether nvcc is found and each CUDA library loads (``jaxfuse._core.cuda.build``),
whether Pallas has its Triton backend, and for the RNN kernels the SMs and shared memory. The
ops are called on abstract arrays, their jitted entries replaced by spies that keep the
implementations chosen: no kernel is built, traced or run.
"""

import sys

import jax
import jax.numpy as jnp
import pytest

import jaxfuse
from jaxfuse._core import registry, tuned
from jaxfuse._core.cuda import build
from jaxfuse._core.testing import x64
from jaxfuse.ops.attention import api as attention_api
from jaxfuse.ops.linear_cross_entropy import api as linear_cross_entropy_api
from jaxfuse.ops.mlp import api as mlp_api
from jaxfuse.ops.mlp import cuda as mlp_cuda
from jaxfuse.ops.norm import api as norm_api
from jaxfuse.ops.norm import cuda as norm_cuda
from jaxfuse.ops.rnn import api as rnn_api
from jaxfuse.ops.rnn import cuda as rnn_cuda
from jaxfuse.ops.rnn import cudnn as rnn_cudnn
from jaxfuse.ops.softmax import api as softmax_api
from jaxfuse.ops.softmax import cuda as softmax_cuda

H100 = "NVIDIA H100 80GB HBM3"
H100_SMS, H100_SHARED_MEMORY = 132, 227 * 1024  # the opt-in shared memory of a CTA
# The longest dimension the Triton kernels index in int32, leaving room for the blocks that
# reach past its end.
MAX_EXTENT = 2**31 - 2**20
# Queries of attention() whose query holds 2^31 elements (batch 2, 4 heads, head dim 128).
QUERIES_OF_2_TO_THE_31 = 2**31 // (2 * 4 * 128)
Array = jax.ShapeDtypeStruct


class Machine:
  """The machine as the rules see it: an H100 with nvcc, whose CUDA libraries load, and
  Pallas's Triton backend, until a method takes a part away."""

  def __init__(self, monkeypatch):
    self._monkeypatch = monkeypatch
    monkeypatch.setattr(registry, "platform", lambda: "gpu")
    monkeypatch.setattr(registry, "device_kind", lambda: H100)
    self.capability((9, 0))
    monkeypatch.setattr(build, "_toolchain", lambda: build.Toolchain("/fake/bin/nvcc"))
    monkeypatch.setattr(build, "_vendor_flags", lambda vendor: (f"-l{vendor}",))
    for module in (norm_cuda, softmax_cuda, rnn_cuda, rnn_cudnn, mlp_cuda):
      library = build.Library(module.LIBRARY.source, module.LIBRARY.handlers,
                              module.LIBRARY.min_arch, module.LIBRARY.vendor)
      # The rules only ask whether a library loads; loading would run nvcc.
      monkeypatch.setattr(library, "_load", lambda: None)
      monkeypatch.setattr(module, "LIBRARY", library)
    monkeypatch.setattr(rnn_cuda, "_device", lambda: (H100_SMS, H100_SHARED_MEMORY))
    # jax.nn's own cuDNN checks trace its cuDNN path, which needs cuDNN: they accept here.
    monkeypatch.setattr(attention_api, "_cudnn_rejects", lambda call, shapes: None)

  def capability(self, capability):
    self._monkeypatch.setattr(registry, "cuda_compute_capability", lambda: capability)

  def kind(self, name):
    self._monkeypatch.setattr(registry, "device_kind", lambda: name)

  def platform(self, name):
    self._monkeypatch.setattr(registry, "platform", lambda: name)
    self.capability(None)

  def without_triton(self):
    self._monkeypatch.setattr(registry, "pallas_triton", None)

  def without_nvcc(self):
    self._monkeypatch.setattr(build, "_toolchain", lambda: None)

  def failing_builds(self, message):
    def fail():
      raise RuntimeError(message)
    for module in (norm_cuda, softmax_cuda, rnn_cuda):
      self._monkeypatch.setattr(module.LIBRARY, "_load", fail)

  def rnn_rows(self, rows):
    """The RNN's tuned rows in place of this GPU's table."""
    rows_of = tuned.rows
    self._monkeypatch.setattr(
        tuned, "rows", lambda family, untuned: rows if family == "rnn" else rows_of(family,
                                                                                     untuned))

  def cudnn_rejecting(self, reason):
    self._monkeypatch.setattr(attention_api, "_cudnn_rejects", lambda call, shapes: reason)


@pytest.fixture(autouse=True)
def x64_enabled():
  """float64 arrays keep their dtype (without x64 JAX takes them as float32)."""
  with x64():
    yield


@pytest.fixture
def gpu(monkeypatch):
  rnn_cuda.plan.cache_clear()
  yield Machine(monkeypatch)
  rnn_cuda.plan.cache_clear()  # its plans were made for the fake GPU


@pytest.fixture
def cpu(gpu):
  """The CPU as the rules see it, whatever runs the tests."""
  gpu.platform("cpu")
  return gpu


@pytest.fixture
def chosen(monkeypatch):
  """The ops' jitted entries replaced by spies; ``chosen()`` pops what the last call chose:
  (forward, backward) for the norms and softmaxes ((evaluated, forward, backward) where an
  evaluated call runs another kernel), (with its gradient, the loss alone) for the
  cross-entropy, (evaluated, differentiated) for attention and, where they differ, the RNN,
  one name for the others."""
  choices = []

  def spy(module, name, choice, result=None):
    def record(*args, **kwargs):
      choices.append(choice(*args))
      return result(*args) if result else None
    monkeypatch.setattr(module, name, record)

  def directions(*args):
    plan = args[-1].plan
    if plan.evaluated != plan.forward:  # chosen by the forward's times and the step's apart
      return plan.evaluated, plan.forward, plan.backward
    return plan.forward, plan.backward

  def one(plan):
    assert plan.evaluated == plan.forward == plan.backward
    return plan.forward

  spy(norm_api, "_norm_jit", directions)
  spy(softmax_api, "_softmax_jit", directions)
  spy(softmax_api, "_cross_entropy_jit",
      lambda *args: (args[-1].plan.forward, args[-1].plan.evaluated))
  spy(linear_cross_entropy_api, "_linear_cross_entropy_jit", lambda *args: one(args[-1].plan))
  spy(mlp_api, "_gelu_mlp_jit",
      lambda *args: (args[-1].plan.evaluated, args[-1].plan.forward, args[-1].plan.backward),
      lambda x, *rest: x)
  spy(attention_api, "_attention_jit", lambda *args: (args[-2].evaluated, args[-2].forward),
      lambda *args: (None, None))
  # The RNN picks among three calls, which return its output and final state; the weights
  # are abstract, so they are not unpacked.
  monkeypatch.setattr(rnn_api, "unpack", lambda *args: None)
  final_state = lambda x, initial_state, *rest: (None, initial_state)
  spy(rnn_api, "_fused_forward", lambda *args: "cuda", lambda cell, *args: final_state(*args))
  spy(rnn_api.reference, "forward", lambda *args: "xla", lambda cell, *args: final_state(*args))
  spy(rnn_api, "_cudnn", lambda *args: "cudnn",
      lambda call, x, initial_state, *rest: (None, initial_state))
  spy(rnn_api, "_cudnn_by_layer", lambda *args, **kwargs: "cudnn by layer",
      lambda cell, *args, **kwargs: final_state(*args))
  spy(rnn_api, "_by_use", lambda network, plan, *args: (plan.evaluated, plan.forward),
      lambda network, plan, x, initial_state, *rest: (None, initial_state))
  return choices.pop


# ---------------------------------------------------------------------------------- calls


def normalize(op, n, dtype="bfloat16", *, rows=1024, param_dtype=None, out_dtype=None,
              implementation=None):
  x = Array((rows, n), jnp.dtype(dtype))
  weight = Array((n,), jnp.dtype(param_dtype or dtype))
  return getattr(jaxfuse, op)(x, weight, out_dtype=out_dtype, implementation=implementation)


def softmax(n, dtype="bfloat16", *, rows=64, op="softmax", implementation=None, **kwargs):
  return getattr(jaxfuse, op)(Array((rows, n), jnp.dtype(dtype)), implementation=implementation,
                              **kwargs)


def cross_entropy(vocab, dtype="bfloat16", *, rows=64, implementation=None):
  return jaxfuse.softmax_cross_entropy(Array((rows, vocab), jnp.dtype(dtype)),
                                       Array((rows,), jnp.int32), implementation=implementation)


def linear_cross_entropy(vocab, dtype="bfloat16", *, implementation=None):
  x, weight = Array((64, 128), jnp.dtype(dtype)), Array((128, vocab), jnp.dtype(dtype))
  return jaxfuse.linear_cross_entropy(x, weight, Array((64,), jnp.int32),
                                      implementation=implementation)


def gelu_mlp(hidden=3072, dtype="bfloat16", *, approximate=True, implementation=None):
  shapes = [(64, 768), (768, hidden), (hidden,), (hidden, 768), (768,)]
  # Traced: the call casts its operands to their promoted dtype before its jitted entry.
  return jax.eval_shape(lambda *arrays: jaxfuse.gelu_mlp(
      *arrays, approximate=approximate, implementation=implementation),
      *(Array(s, jnp.dtype(dtype)) for s in shapes))


def recurrent(cell, hidden, dtype="bfloat16", *, batch=64, layers=1, bidirectional=False,
              implementation=None, on_host=False, **kwargs):
  """A call over whole sequences of 4 steps, their lengths on the device or (``on_host``)
  left out."""
  sizes = dict(input_size=8, hidden_size=hidden, num_layers=layers, bidirectional=bidirectional)
  count = (jaxfuse.lstm_weight_count if cell == "lstm" else jaxfuse.gru_weight_count)(**sizes)
  dtype = jnp.dtype(dtype)
  state = Array((layers * (2 if bidirectional else 1), batch, hidden), dtype)
  states = (state, state) if cell == "lstm" else (state,)
  return getattr(jaxfuse, cell)(Array((batch, 4, 8), dtype), *states, Array((count,), dtype),
                                None if on_host else jnp.full((batch,), 4, jnp.int32),
                                implementation=implementation,
                                **sizes, **kwargs)


def attention(t=2048, h=128, hv=None, dtype="bfloat16", *, batch=2, heads=4,
              segments=False, bias=False, implementation=None, **kwargs):
  q = Array((batch, t, heads, h), jnp.dtype(dtype))
  v = Array((batch, t, heads, hv or h), jnp.dtype(dtype))
  if segments:
    kwargs["segment_ids"] = jnp.zeros((batch, t), jnp.int32)
  if bias:
    kwargs["bias"] = jnp.zeros((1, 1, 1, 1), jnp.float32)
  return jaxfuse.attention(q, q, v, implementation=implementation, **kwargs)


# A call each 'cuda' implementation takes on a Hopper GPU.
CUDA_CALLS = {
    "rms_norm": lambda: normalize("rms_norm", 1024, implementation="cuda"),
    "layer_norm": lambda: normalize("layer_norm", 1024, implementation="cuda"),
    "softmax": lambda: softmax(1024, implementation="cuda"),
    "log_softmax": lambda: softmax(1024, op="log_softmax", implementation="cuda"),
    "softmax_cross_entropy": lambda: cross_entropy(1024, implementation="cuda"),
    "linear_cross_entropy": lambda: linear_cross_entropy(1024, implementation="cuda"),
    "lstm": lambda: recurrent("lstm", 64, implementation="cuda"),
    "gru": lambda: recurrent("gru", 64, implementation="cuda"),
}
# A call each 'triton' implementation takes.
TRITON_CALLS = {
    "rms_norm": lambda: normalize("rms_norm", 1024, implementation="triton"),
    "softmax": lambda: softmax(1024, implementation="triton"),
    "softmax_cross_entropy": lambda: cross_entropy(1024, implementation="triton"),
    "attention": lambda: attention(implementation="triton"),
}
# Every op, under None.
DEFAULT_CALLS = {
    "rms_norm": lambda: normalize("rms_norm", 32768),
    "layer_norm": lambda: normalize("layer_norm", 32768),
    "softmax": lambda: softmax(32768),
    "log_softmax": lambda: softmax(32768, op="log_softmax"),
    "softmax_cross_entropy": lambda: cross_entropy(32768),
    "linear_cross_entropy": lambda: linear_cross_entropy(1024),
    "lstm": lambda: recurrent("lstm", 64),
    "gru": lambda: recurrent("gru", 64),
    "attention": lambda: attention(),
}


def _each_direction(impl):
  return (impl, impl)


# ------------------------------------------------------------------- the machine as a whole


def test_cpu_takes_xla_under_none(cpu, chosen):
  for op, call in DEFAULT_CALLS.items():
    call()
    assert chosen() in ("xla", ("xla", "xla")), op


@pytest.mark.parametrize("op", CUDA_CALLS)
def test_cuda_runs_on_a_hopper_gpu_with_nvcc(gpu, chosen, op):
  CUDA_CALLS[op]()
  assert chosen() in ("cuda", ("cuda", "cuda"))


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_cuda_runs_from_compute_capability_9(gpu, chosen, capability):
  gpu.capability(capability)
  normalize("rms_norm", 1024, implementation="cuda")
  assert chosen() == ("cuda", "cuda")


# Each part of the machine the CUDA kernels need, taken away, and the reason they give.
CUDA_MISSING = {
    "cpu": (lambda gpu: gpu.platform("cpu"),
            "needs an NVIDIA GPU; the default backend here is 'cpu'"),
    "turing": (lambda gpu: gpu.capability((7, 5)),
               r"compute capability 8.0 \(Ampere\) or newer; found compute capability \(7, 5\)"),
    "no device": (lambda gpu: gpu.capability(None), "found no CUDA device"),
    "no nvcc": (lambda gpu: gpu.without_nvcc(), "built on first use and nvcc was not found"),
    "failed build": (lambda gpu: gpu.failing_builds("nvcc: unsupported gpu architecture"),
                     "RuntimeError: nvcc: unsupported gpu architecture"),
}


@pytest.mark.parametrize("missing", CUDA_MISSING)
@pytest.mark.parametrize("op", CUDA_CALLS)
def test_cuda_refuses_without_what_it_needs(gpu, chosen, op, missing):
  take_away, reason = CUDA_MISSING[missing]
  take_away(gpu)
  with pytest.raises(NotImplementedError,
                     match=rf"{op}\(implementation='cuda'\) cannot run here: .*{reason}"):
    CUDA_CALLS[op]()


@pytest.mark.parametrize("capability", [(8, 0), (8, 9)])
def test_cuda_on_ampere_and_ada_holds_a_row_in_one_cta(gpu, chosen, capability):
  """Without thread-block clusters the norm and softmax kernels take the rows one CTA holds;
  the RNN kernels, tested on Hopper only, refuse."""
  gpu.capability(capability)
  normalize("rms_norm", 8192, implementation="cuda")
  assert chosen() == ("cuda", "cuda")
  softmax(16384, implementation="cuda")
  assert chosen() == ("cuda", "cuda")
  with pytest.raises(NotImplementedError, match=r"no thread-block clusters before sm_90"):
    normalize("rms_norm", 8200, implementation="cuda")
  with pytest.raises(NotImplementedError, match=r"no thread-block clusters before sm_90"):
    softmax(16392, implementation="cuda")
  with pytest.raises(NotImplementedError, match=r"rnn.cu is built for sm_90 or newer, not sm_8"):
    recurrent("lstm", 64, implementation="cuda")


def test_cuda_forced_to_the_ampere_path_on_hopper(gpu, chosen, monkeypatch):
  monkeypatch.setenv(build.ARCH_VARIABLE, "compute_80")
  assert build.gpu_arch() == "compute_80" and build.cluster_limit() == 1
  with pytest.raises(NotImplementedError, match=r"no thread-block clusters before sm_90"):
    normalize("rms_norm", 8200, implementation="cuda")
  monkeypatch.setenv(build.ARCH_VARIABLE, "sm_100")
  with pytest.raises(NotImplementedError, match=r"JAXFUSE_CUDA_ARCH=sm_100 is newer than this"):
    normalize("rms_norm", 1024, implementation="cuda")
  monkeypatch.setenv(build.ARCH_VARIABLE, "sm_75")
  with pytest.raises(ValueError, match=r"JAXFUSE_CUDA_ARCH='sm_75': expected sm_XY or "):
    build.gpu_arch()


TRITON_MISSING = {
    "turing": (lambda gpu: gpu.capability((7, 5)),
               "needs compute capability 8.0 or newer; this GPU has 7.5"),
    "tpu": (lambda gpu: gpu.platform("tpu"),
            r"needs an NVIDIA GPU \(or the CPU.*the default backend here is 'tpu'"),
    "no pallas triton": (lambda gpu: gpu.without_triton(),
                         r"jax.experimental.pallas.triton cannot be imported"),
}


@pytest.mark.triton
@pytest.mark.parametrize("missing", TRITON_MISSING)
@pytest.mark.parametrize("op", TRITON_CALLS)
def test_triton_refuses_without_what_it_needs(gpu, chosen, op, missing):
  take_away, reason = TRITON_MISSING[missing]
  take_away(gpu)
  with pytest.raises(NotImplementedError,
                     match=rf"{op}\(implementation='triton'\) cannot run here: .*{reason}"):
    TRITON_CALLS[op]()


@pytest.mark.parametrize("capability,expected", [((8, 0), "triton"), ((7, 5), "xla")])
def test_none_takes_triton_from_compute_capability_8(gpu, chosen, capability, expected):
  gpu.capability(capability)
  softmax(1024)
  assert chosen() == _each_direction(expected)


# --------------------------------------------------------------------------------- norms

# (op, features, x dtype, out_dtype, param dtype) -> (forward, backward) on the H100's table.
NORM_ON_HOPPER = [
    # Up to 16384 features Triton (RMSNorm's up to 24576), above CUDA, where CUDA takes the
    # rows.
    ("rms_norm", 16385, "bfloat16", None, None, ("triton", "triton")),
    ("rms_norm", 16392, "bfloat16", None, None, ("triton", "triton")),
    ("rms_norm", 24576, "bfloat16", None, None, ("triton", "triton")),
    ("rms_norm", 24584, "bfloat16", None, None, ("cuda", "cuda")),
    ("layer_norm", 16384, "bfloat16", None, None, ("triton", "triton")),
    ("layer_norm", 16392, "bfloat16", None, None, ("cuda", "cuda")),
    ("layer_norm", 16392, "float32", None, None, ("cuda", "cuda")),
    ("rms_norm", 32768, "bfloat16", None, "float32", ("cuda", "cuda")),
    ("rms_norm", 131072, "bfloat16", None, None, ("cuda", "cuda")),
    # But XLA for RMSNorm's float32 rows past Triton's.
    ("rms_norm", 16384, "float32", None, None, ("triton", "triton")),
    ("rms_norm", 16392, "float32", None, None, ("xla", "xla")),
    ("rms_norm", 65536, "float32", None, None, ("xla", "xla")),
    ("rms_norm", 65544, "float32", None, None, ("xla", "xla")),
    # Where CUDA refuses the rows: Triton's two-walk forward, XLA's backward.
    ("rms_norm", 24577, "bfloat16", None, None, ("triton", "xla")),
    ("layer_norm", 16385, "bfloat16", None, None, ("triton", "xla")),
    ("rms_norm", 131080, "bfloat16", None, None, ("triton", "xla")),
    ("layer_norm", 131080, "float16", None, None, ("triton", "xla")),
    ("layer_norm", 65544, "float32", None, None, ("triton", "xla")),
    ("rms_norm", 32768, "float64", None, None, ("triton", "xla")),
    ("rms_norm", 32768, "bfloat16", None, "float64", ("triton", "xla")),
    ("layer_norm", 32768, "bfloat16", "float16", None, ("triton", "xla")),
    # LayerNorm of 16-bit rows of 257 to 512 features, y of x's dtype: the CUDA short-row
    # kernels.
    ("layer_norm", 8, "bfloat16", None, None, ("triton", "triton")),
    ("layer_norm", 256, "bfloat16", None, None, ("triton", "triton")),
    ("layer_norm", 264, "bfloat16", None, None, ("cuda", "cuda")),
    ("layer_norm", 512, "bfloat16", None, None, ("cuda", "cuda")),
    ("layer_norm", 512, "float16", None, None, ("cuda", "cuda")),
    ("layer_norm", 520, "bfloat16", None, None, ("triton", "triton")),
    ("layer_norm", 500, "bfloat16", None, None, ("triton", "triton")),
    ("layer_norm", 512, "bfloat16", "float32", None, ("triton", "triton")),
    ("layer_norm", 512, "bfloat16", None, "float32", ("triton", "triton")),
    ("layer_norm", 256, "float32", None, None, ("triton", "triton")),
    ("rms_norm", 512, "bfloat16", None, None, ("triton", "triton")),
]


@pytest.mark.parametrize("op,n,dtype,out_dtype,param_dtype,expected", NORM_ON_HOPPER)
def test_norm_none_on_hopper(gpu, chosen, op, n, dtype, out_dtype, param_dtype, expected):
  normalize(op, n, dtype, out_dtype=out_dtype, param_dtype=param_dtype)
  assert chosen() == expected


@pytest.mark.parametrize("op,rows,n,expected", [
    ("rms_norm", 1, 4096, ("triton", "xla", "xla")), ("rms_norm", 1, 32768, ("xla", "xla")),
    ("rms_norm", 8, 12288, ("xla", "xla")), ("rms_norm", 64, 4096, ("triton", "triton")),
    ("layer_norm", 64, 4096, ("xla", "triton", "triton")),
    ("layer_norm", 8, 12288, ("xla", "triton", "triton")),
    ("layer_norm", 8, 32768, ("cuda", "xla", "xla")),
    ("layer_norm", 65, 32768, ("cuda", "cuda"))])
def test_norm_none_on_hopper_takes_xla_in_the_tables_few_rows_bands(gpu, chosen, op, rows, n,
                                                                     expected):
  normalize(op, n, rows=rows)
  assert chosen() == expected


@pytest.mark.parametrize("op,n,dtype,expected", [
    ("rms_norm", 8, "bfloat16", "cuda"),
    ("layer_norm", 1024, "bfloat16", "cuda"),
    ("rms_norm", 1020, "bfloat16", "xla"),
    ("rms_norm", 131072, "float16", "cuda"),
    ("rms_norm", 131080, "bfloat16", "xla"),
    ("layer_norm", 65536, "float32", "cuda"),
    ("layer_norm", 65544, "float32", "xla"),
    ("rms_norm", 1024, "float64", "xla"),
])
def test_norm_none_without_triton_takes_cuda_where_it_takes_the_rows(gpu, chosen, op, n, dtype,
                                                                     expected):
  gpu.without_triton()
  normalize(op, n, dtype)
  assert chosen() == _each_direction(expected)


def test_norm_none_without_triton_takes_xla_below_the_tables_length(gpu, chosen, monkeypatch):
  """Per norm and use, XLA's fusions below the length from which the table measured CUDA
  faster without Triton (None: never)."""
  gpu.without_triton()
  rows_of = tuned.rows
  lengths = {"rms/forward": 32768, "rms/step": 1024, "layer/forward": None, "layer/step": 0}
  monkeypatch.setattr(tuned, "rows", lambda family, untuned: (
      {**rows_of(family, untuned), "cuda_from_without_triton": lengths} if family == "norm"
      else rows_of(family, untuned)))
  normalize("rms_norm", 4096)
  assert chosen() == ("xla", "cuda", "cuda")
  normalize("rms_norm", 32768)
  assert chosen() == ("cuda", "cuda")
  normalize("layer_norm", 65536)
  assert chosen() == ("xla", "cuda", "cuda")


@pytest.mark.parametrize("rows,dtype,expected", [
    (MAX_EXTENT, "bfloat16", "triton"),
    (MAX_EXTENT + 1, "bfloat16", "cuda"),
    (MAX_EXTENT + 1, "float64", "xla"),
])
def test_norm_none_passes_over_triton_for_rows_past_int32(gpu, chosen, rows, dtype, expected):
  normalize("rms_norm", 8, dtype, rows=rows)
  assert chosen() == _each_direction(expected)


@pytest.mark.triton
def test_norm_none_without_cuda(gpu, chosen):
  gpu.without_nvcc()
  normalize("rms_norm", 32768)
  assert chosen() == ("triton", "xla")
  normalize("layer_norm", 512)
  assert chosen() == ("triton", "triton")
  gpu.without_triton()
  normalize("layer_norm", 512)
  assert chosen() == ("xla", "xla")


@pytest.mark.parametrize("op,n,dtype,out_dtype,param_dtype,reason", [
    ("rms_norm", 1020, "bfloat16", None, None,
     r"x bfloat16\[1024,1020\]: .*vectors; the normalized size 1020 is not a multiple of 8"),
    ("layer_norm", 131080, "bfloat16", None, None,
     "at most 131072 bfloat16 elements; the normalized size is 131080"),
    ("rms_norm", 131080, "float16", None, None,
     "at most 131072 float16 elements; the normalized size is 131080"),
    ("rms_norm", 65544, "float32", None, None,
     "at most 65536 float32 elements; the normalized size is 65544"),
    ("rms_norm", 1024, "float64", None, None, "take float16, bfloat16 and float32, not float64"),
    ("layer_norm", 1024, "bfloat16", None, "float64",
     "take float16, bfloat16 and float32, not float64"),
    ("layer_norm", 1024, "bfloat16", "float16", None,
     "write x's dtype or float32, not float16 for x of bfloat16"),
])
def test_norm_cuda_refuses_rows_it_cannot_hold(gpu, chosen, op, n, dtype, out_dtype,
                                               param_dtype, reason):
  with pytest.raises(NotImplementedError,
                     match=rf"{op}\(implementation='cuda'\) cannot take .*{reason}"):
    normalize(op, n, dtype, out_dtype=out_dtype, param_dtype=param_dtype,
              implementation="cuda")


@pytest.mark.parametrize("n,dtype,out_dtype", [
    (8, "bfloat16", None), (131072, "bfloat16", None), (131072, "float16", "float32"),
    (65536, "float32", None),
])
def test_norm_cuda_takes_rows_up_to_its_limits(gpu, chosen, n, dtype, out_dtype):
  normalize("layer_norm", n, dtype, out_dtype=out_dtype, implementation="cuda")
  assert chosen() == ("cuda", "cuda")


@pytest.mark.parametrize("kind,dtype,n,per_sm", [
    ("rms", "bfloat16", 1032, 7), ("rms", "bfloat16", 2048, 4), ("rms", "float16", 4096, 2),
    ("rms", "bfloat16", 1024, None), ("rms", "bfloat16", 8192, None),
    ("rms", "float32", 1024, None), ("layer", "bfloat16", 2048, None),
])
def test_norm_cuda_backward_grid_holds_the_h200_tables_partials(gpu, monkeypatch, kind, dtype, n,
                                                                per_sm):
  """The H200's table caps the RMSNorm backward's grid at about 8192 partial elements per SM
  for 16-bit rows of 1032 to 4096 (up to 1024, a warp's lanes hold a row); elsewhere (and on the
  H100) the resident clusters launch."""
  monkeypatch.setattr(registry, "num_multiprocessors", lambda: 132)
  gpu.kind("NVIDIA H200")
  cap = norm_api._cuda_backward_clusters(kind, jnp.dtype(dtype), n)
  assert cap == (None if per_sm is None else 132 * per_sm)
  gpu.kind(H100)
  assert norm_api._cuda_backward_clusters(kind, jnp.dtype(dtype), n) is None


# ------------------------------------------------------------------------------- softmax

# (row length, dtype) -> ([evaluated,] forward, backward) on the H100's table: CUDA's
# evaluated forward from 24576, its differentiated forward and its backward from 12288
# (Triton's forward for float32 rows), each where the kernels of that direction hold the row;
# XLA for rows of up to 256 and for 16-bit rows too long for a Triton tile that CUDA cannot
# take.
SOFTMAX_ON_HOPPER = [
    (256, "bfloat16", ("xla", "xla")),
    (264, "bfloat16", ("triton", "triton")),
    (12280, "bfloat16", ("triton", "triton")),
    (12288, "bfloat16", ("triton", "cuda", "cuda")),
    (16384, "bfloat16", ("triton", "cuda", "cuda")),
    (24568, "bfloat16", ("triton", "cuda", "cuda")),
    (24576, "bfloat16", ("cuda", "cuda")),
    (32760, "bfloat16", ("cuda", "cuda")),
    (32769, "bfloat16", ("xla", "xla")),
    (262144, "bfloat16", ("cuda", "cuda")),
    (262152, "bfloat16", ("cuda", "xla")),
    (524288, "bfloat16", ("cuda", "xla")),
    (524296, "bfloat16", ("xla", "xla")),
    (16376, "float32", ("triton", "cuda")),
    (16384, "float32", ("triton", "cuda")),
    (32768, "float32", ("triton", "cuda")),
    (131072, "float32", ("triton", "cuda")),
    (131080, "float32", ("triton", "triton")),
    (262152, "float32", ("triton", "triton")),
    (65536, "float64", ("triton", "triton")),
]


# The H200's own rows over the H100's: Triton's LayerNorm of float32 rows up to 5120, past its
# step limit measured on 16-bit rows; XLA for rows with float32 outputs past 16384 (CUDA's
# evaluated LayerNorm of 16-bit rows up to 65536 with float32 outputs), and for
# RMSNorm's evaluated forward of float32 rows from 5120 and of 16-bit rows up to 128; CUDA's
# RMSNorm step and LayerNorm of 16-bit rows up to 512 from 2^26 elements, and LayerNorm's
# backward of 16-bit short rows from 2^22 elements; Triton's
# evaluated RMSNorm up to 24576 and LayerNorm's step up to 8192; CUDA's LayerNorm of 16-bit
# rows up to 128 and Triton's evaluated one of few rows past 65536; the softmax's evaluated
# forward from 8192 (Triton's up to 2^23 elements of rows up to 16384), a differentiated
# call's CUDA kernels from 1024, and Triton's step where neither CUDA's kernels nor a Triton
# tile hold 16-bit rows up to 50257; the cross-entropy's CUDA kernels from 2048 classes, XLA
# for an evaluated loss of up to 128 rows from 32768 and for any call of up to 32 from 65536.
@pytest.mark.parametrize("call,expected", [
    (lambda: normalize("rms_norm", 32768, param_dtype="float32"), ("xla", "xla")),
    (lambda: normalize("layer_norm", 32768, param_dtype="float32"), ("cuda", "xla", "xla")),
    (lambda: normalize("layer_norm", 16392, param_dtype="float32"), ("cuda", "xla", "xla")),
    (lambda: normalize("layer_norm", 65536, param_dtype="float32"), ("cuda", "xla", "xla")),
    (lambda: normalize("layer_norm", 65544, param_dtype="float32"), ("xla", "xla")),
    (lambda: normalize("layer_norm", 32768, "float32"), ("xla", "xla")),
    (lambda: normalize("layer_norm", 5120, "float32"), ("triton", "triton")),
    (lambda: normalize("layer_norm", 32768), ("cuda", "cuda")),
    (lambda: normalize("layer_norm", 512), ("cuda", "triton")),
    (lambda: normalize("layer_norm", 512, rows=8192), ("cuda", "cuda")),
    (lambda: normalize("rms_norm", 8192, "float32"), ("xla", "triton", "triton")),
    (lambda: normalize("rms_norm", 128), ("xla", "triton", "triton")),
    (lambda: normalize("rms_norm", 16392), ("triton", "cuda", "cuda")),
    (lambda: normalize("layer_norm", 12288), ("cuda", "cuda")),
    (lambda: normalize("layer_norm", 8192), ("triton", "cuda", "cuda")),
    (lambda: normalize("layer_norm", 128), ("cuda", "cuda")),
    (lambda: normalize("layer_norm", 131072, rows=256), ("triton", "cuda", "cuda")),
    (lambda: normalize("layer_norm", 131072), ("cuda", "cuda")),
    (lambda: normalize("layer_norm", 256), ("triton", "triton")),
    (lambda: normalize("layer_norm", 256, rows=16384), ("triton", "cuda")),
    (lambda: normalize("layer_norm", 256, rows=262144), ("cuda", "cuda")),
    (lambda: normalize("rms_norm", 512, rows=131072), ("triton", "cuda", "cuda")),
    (lambda: softmax(1024), ("triton", "cuda", "cuda")),
    (lambda: softmax(2048), ("triton", "cuda", "cuda")),
    (lambda: softmax(12288), ("triton", "cuda", "cuda")),
    (lambda: softmax(16376), ("triton", "cuda", "cuda")),
    (lambda: softmax(16376, rows=1024), ("cuda", "cuda")),
    (lambda: softmax(50257), ("xla", "triton", "triton")),
    (lambda: softmax(50264), ("cuda", "cuda")),
    (lambda: softmax(65545), ("xla", "xla")),
    (lambda: cross_entropy(131072), ("cuda", "xla")),
    (lambda: cross_entropy(131072, rows=129), ("cuda", "cuda")),
    (lambda: cross_entropy(131072, rows=32), ("xla", "xla")),
    (lambda: cross_entropy(1024, rows=4096), ("triton", "triton")),
], ids=["rms f32 out", "layer f32 out", "layer f32 out past 16384", "layer f32 out at 65536",
        "layer f32 out past 65536", "layer f32", "layer f32 5120", "layer", "layer short",
        "layer short many rows", "rms f32 evaluated", "rms shortest", "rms 16392",
        "layer 12288", "layer 8192", "layer shortest", "layer few long rows", "layer long rows",
        "layer 256", "layer 256 more rows", "layer 256 many rows", "rms 512 many rows",
        "softmax 1024", "softmax 2048", "softmax 12288", "softmax 16376",
        "softmax 16376 many rows", "softmax 50257", "softmax 50264", "softmax 65545",
        "cross-entropy", "cross-entropy rows", "cross-entropy few rows",
        "cross-entropy short rows"])
def test_none_on_the_h200_takes_its_own_rows(gpu, chosen, call, expected):
  gpu.kind("NVIDIA H200")
  call()
  assert chosen() == expected


def test_norm_none_without_triton_on_the_h200_takes_xla_for_short_evaluated_rms(gpu, chosen):
  gpu.kind("NVIDIA H200")
  gpu.without_triton()
  normalize("rms_norm", 256)
  assert chosen() == ("xla", "cuda", "cuda")
  normalize("rms_norm", 512)
  assert chosen() == ("cuda", "cuda")


@pytest.mark.parametrize("rows,n,dtype,expected", [
    (8, 12288, "bfloat16", ("xla", "triton", "triton")), (1, 8192, "bfloat16", ("xla", "xla")),
    (1, 2048, "bfloat16", ("triton", "triton")), (9, 12288, "bfloat16", ("triton", "triton")),
    (8, 4096, "bfloat16", ("triton", "triton")), (1, 8192, "float32", ("triton", "triton")),
    (8, 32768, "bfloat16", ("cuda", "cuda")), (4, 12288, "bfloat16", ("xla", "triton", "triton")),
    (8, 12289, "bfloat16", ("triton", "triton")), (1, 8191, "bfloat16", ("triton", "xla", "xla"))])
def test_norm_none_takes_xla_in_the_tuned_bands_of_few_rows(gpu, chosen, monkeypatch,
                                                            rows, n, dtype, expected):
  """Evaluated calls by the forward's steps; both directions of a differentiated call by the
  training step's, where XLA runs the whole step."""
  gpu.kind("NVIDIA GPU without a table")
  untuned = norm_api._untuned()
  monkeypatch.setattr(norm_api, "_untuned", lambda: untuned | {
      "rules": [],
      "xla_few_rows": {"rms/forward": [[8, 8192, 12288]], "rms/step": [[1, 4096, 8192], [8]]}})
  normalize("rms_norm", n, dtype, rows=rows)
  assert chosen() == expected


@pytest.mark.triton
def test_none_takes_no_triton_kernel_with_triton_switched_off(gpu, chosen, monkeypatch):
  calls = [lambda: normalize("rms_norm", 4096), lambda: normalize("layer_norm", 1024),
           lambda: softmax(1024), lambda: softmax(4096, op="log_softmax"),
           lambda: cross_entropy(32768)]

  def plans():
    for call in calls:
      call()
      yield chosen()

  assert all("triton" in plan for plan in plans())
  monkeypatch.setenv(registry.WITHOUT_TRITON_VARIABLE, "1")
  assert not any("triton" in plan for plan in plans())


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("n,dtype,expected", SOFTMAX_ON_HOPPER)
def test_softmax_none_on_hopper(gpu, chosen, op, n, dtype, expected):
  softmax(n, dtype, op=op)
  assert chosen() == expected


@pytest.mark.triton
def test_softmax_none_takes_triton_where_cuda_cannot(gpu, chosen):
  jaxfuse.softmax(Array((65536, 64), jnp.bfloat16), axis=0)
  assert chosen() == ("triton", "triton")


@pytest.mark.parametrize("n", [1024, 65536])
@pytest.mark.parametrize("kwargs", [dict(is_causal=True, causal_offset=5),
                                    dict(mask=jnp.ones((1, 65536), bool))],
                         ids=["causal", "mask"])
def test_softmax_none_takes_masked_rows_as_plain_ones(gpu, chosen, n, kwargs):
  jaxfuse.softmax(Array((64, n), jnp.bfloat16))
  plain = chosen()
  if "mask" in kwargs:
    kwargs = dict(mask=jnp.ones((1, n), bool))
  jaxfuse.softmax(Array((64, n), jnp.bfloat16), **kwargs)
  assert chosen() == plain


@pytest.mark.parametrize("n,dtype,kwargs,expected", [
    (8184, "bfloat16", {}, ("xla", "xla")),
    (8192, "bfloat16", {}, ("xla", "cuda", "cuda")),
    (12288, "bfloat16", {}, ("cuda", "cuda")),
    (16384, "bfloat16", dict(mask=jnp.ones((1, 16384), bool)), ("cuda", "cuda")),
    (16384, "bfloat16", dict(axis=0), ("xla", "xla")),
    (262152, "bfloat16", {}, ("cuda", "xla")),
    (16384, "float64", {}, ("xla", "xla")),
])
def test_softmax_none_without_triton_takes_cuda_from_its_row(gpu, chosen, n, dtype, kwargs,
                                                            expected):
  gpu.without_triton()
  softmax(n, dtype, **kwargs)
  assert chosen() == expected


@pytest.mark.parametrize("kwargs", [dict(is_causal=True), dict(mask=jnp.ones((1, 2048), bool))],
                         ids=["causal", "mask"])
def test_softmax_none_without_triton_takes_cuda_for_masked_rows_on_h200(gpu, chosen, kwargs):
  # Masked rows cost XLA a select over the logits: CUDA takes them wherever it takes plain ones.
  gpu.kind("NVIDIA H200")
  gpu.without_triton()
  softmax(2048, "bfloat16", **kwargs)
  assert chosen() == ("cuda", "cuda")


@pytest.mark.triton
@pytest.mark.parametrize("n", [2048, 8192])
def test_softmax_none_takes_cuda_for_causal_backwards_on_h200(gpu, chosen, n):
  # The CUDA backward reads causal rows only up to each query's last key.
  gpu.kind("NVIDIA H200")
  softmax(n, "bfloat16", is_causal=True)
  assert chosen()[-1] == "cuda"
  softmax(n, "bfloat16", mask=jnp.ones((1, n), bool))
  assert chosen()[-1] == "cuda"


@pytest.mark.parametrize("rows,n,expected", [
    (MAX_EXTENT, 16368, ("triton", "cuda", "cuda")),
    (MAX_EXTENT + 1, 16384, ("cuda", "cuda")),
    (MAX_EXTENT + 1, 8184, ("xla", "xla")),
])
def test_softmax_none_passes_over_triton_for_rows_past_int32(gpu, chosen, rows, n, expected):
  softmax(n, rows=rows)
  assert chosen() == expected


@pytest.mark.triton
def test_softmax_none_without_cuda(gpu, chosen):
  gpu.without_nvcc()
  softmax(65536)
  assert chosen() == ("triton", "triton")
  gpu.without_triton()
  softmax(65536)
  assert chosen() == ("xla", "xla")


@pytest.mark.parametrize("n,dtype,kwargs,reason", [
    (1024, "bfloat16", dict(axis=0),
     r"x bfloat16\[64,1024\] over axis 0: the 'cuda' kernels take the softmax over the last "
     r"axis"),
    (1020, "bfloat16", {}, "the row length 1020 is not a multiple of 8"),
    (262152, "bfloat16", {}, "at most 262144 bfloat16 elements; the row length is 262152"),
    (262152, "float16", {}, "at most 262144 float16 elements"),
    (131080, "float32", {}, "at most 131072 float32 elements; the row length is 131080"),
    (1024, "float64", {}, "take float16, bfloat16 and float32, not float64"),
])
def test_softmax_cuda_refuses(gpu, chosen, n, dtype, kwargs, reason):
  with pytest.raises(NotImplementedError,
                     match=rf"softmax\(implementation='cuda'\) cannot take .*{reason}"):
    softmax(n, dtype, implementation="cuda", **kwargs)


@pytest.mark.parametrize("n,dtype", [(8, "bfloat16"), (262144, "bfloat16"),
                                     (131072, "float32")])
def test_softmax_cuda_takes_rows_up_to_its_limits(gpu, chosen, n, dtype):
  softmax(n, dtype, implementation="cuda")
  assert chosen() == ("cuda", "cuda")
  softmax(n, dtype, implementation="cuda", is_causal=True, causal_offset=3)
  assert chosen() == ("cuda", "cuda")
  softmax(n, dtype, implementation="cuda", mask=jnp.ones((64, 1), bool))
  assert chosen() == ("cuda", "cuda")


# ------------------------------------------------------------------------- cross-entropy

# (classes, dtype) -> (with its gradient, the loss alone) on the H100's table, 64 rows:
# Triton wherever it runs, but CUDA for float32 rows over 16384 classes it takes, and XLA for
# the gradient of 16-bit rows too long for a Triton tile that CUDA cannot take. (Problems of
# up to 2^19 logits go to XLA: see test_cross_entropy_none_takes_xla_for_few_logits.)
CROSS_ENTROPY_ON_HOPPER = [
    (16384, "bfloat16", ("triton", "triton")),
    (16392, "bfloat16", ("triton", "triton")),
    (131072, "bfloat16", ("triton", "triton")),
    (262152, "bfloat16", ("xla", "triton")),
    (16384, "float32", ("triton", "triton")),
    (16392, "float32", ("cuda", "cuda")),
    (131072, "float32", ("cuda", "cuda")),
    (131080, "float32", ("triton", "triton")),
    (32768, "float64", ("triton", "triton")),
]


@pytest.mark.parametrize("rows,vocab,expected", [
    (8, 50264, ("xla", "xla")), (8, 65536, ("xla", "xla")), (8, 65544, ("triton", "triton")),
    (1, 2**19, ("xla", "xla"))])
def test_cross_entropy_none_takes_xla_for_few_logits(gpu, chosen, rows, vocab, expected):
  cross_entropy(vocab, rows=rows)
  assert chosen() == expected


@pytest.mark.parametrize("vocab,dtype,expected", CROSS_ENTROPY_ON_HOPPER)
def test_cross_entropy_none_on_hopper(gpu, chosen, vocab, dtype, expected):
  cross_entropy(vocab, dtype)
  assert chosen() == expected


@pytest.mark.parametrize("vocab,expected", [
    (2040, ("xla", "xla")), (2048, ("cuda", "xla")), (4096, ("cuda", "cuda")),
    (131080, ("cuda", "cuda")), (262152, ("xla", "xla")),
])
def test_cross_entropy_none_without_triton_takes_cuda_from_its_row(gpu, chosen, vocab, expected):
  gpu.without_triton()
  cross_entropy(vocab, rows=1024)  # past the rule that leaves tiny problems to XLA
  assert chosen() == expected


@pytest.mark.parametrize("rows,expected", [(MAX_EXTENT, ("triton", "triton")),
                                           (MAX_EXTENT + 1, ("cuda", "cuda"))])
def test_cross_entropy_none_takes_cuda_where_triton_cannot_index(gpu, chosen, rows, expected):
  cross_entropy(131080, rows=rows)
  assert chosen() == expected


@pytest.mark.triton
def test_cross_entropy_none_without_cuda(gpu, chosen):
  gpu.without_nvcc()
  cross_entropy(65536)
  assert chosen() == ("triton", "triton")


@pytest.mark.parametrize("vocab,dtype,reason", [
    (1020, "bfloat16", r"logits bfloat16\[64,1020\]: .*the row length 1020 is not a multiple"),
    (262152, "bfloat16", "at most 262144 bfloat16 elements; the row length is 262152"),
    (131080, "float32", "at most 131072 float32 elements"),
    (1024, "float64", "not float64"),
])
def test_cross_entropy_cuda_refuses(gpu, chosen, vocab, dtype, reason):
  with pytest.raises(NotImplementedError,
                     match=rf"softmax_cross_entropy\(implementation='cuda'\) cannot take "
                           rf".*{reason}"):
    cross_entropy(vocab, dtype, implementation="cuda")


# ------------------------------------------------------------------ linear cross-entropy


@pytest.mark.parametrize("vocab,dtype,expected", [
    (262144, "bfloat16", "cuda"),
    (262100, "bfloat16", "cuda"),  # padded to 262144 columns
    (262145, "bfloat16", "xla"),  # padded to 262272
    (262144, "float32", "cuda"),
    (1024, "float64", "xla"),
])
def test_linear_cross_entropy_none_on_hopper(gpu, chosen, vocab, dtype, expected):
  linear_cross_entropy(vocab, dtype)
  assert chosen() == expected


def test_linear_cross_entropy_none_says_why_it_passes_over_cuda(gpu, chosen, caplog):
  registry._passed_over.cache_clear()
  with caplog.at_level("INFO", logger="jaxfuse"):
    linear_cross_entropy(262145)
  assert chosen() == "xla"
  assert any("linear_cross_entropy(implementation=None) passed over 'cuda'" in r.getMessage()
             and "262272 columns are more than it holds" in r.getMessage()
             for r in caplog.records)


@pytest.mark.parametrize("take_away", [Machine.without_nvcc, lambda gpu: gpu.platform("cpu")],
                         ids=["no nvcc", "cpu"])
def test_linear_cross_entropy_none_without_cuda(gpu, chosen, take_away):
  take_away(gpu)
  linear_cross_entropy(1024)
  assert chosen() == "xla"


@pytest.mark.parametrize("vocab,dtype,reason", [
    (262145, "bfloat16", "262272 columns are more than it holds"),
    (1024, "float64", "float16, bfloat16 and float32 operands, not float64"),
])
def test_linear_cross_entropy_cuda_refuses(gpu, chosen, vocab, dtype, reason):
  with pytest.raises(NotImplementedError,
                     match=rf"linear_cross_entropy\(implementation='cuda'\) cannot take x .*"
                           rf"{reason}"):
    linear_cross_entropy(vocab, dtype, implementation="cuda")


# ------------------------------------------------------------------------------------ MLP

def test_gelu_mlp_none_on_the_h200_takes_the_epilogues_for_inference_only(gpu, chosen):
  gpu.kind("NVIDIA H200")
  gelu_mlp()
  assert chosen() == ("cuda", "xla", "xla")


@pytest.mark.parametrize("call", [
    dict(dtype="float32"), dict(approximate=False), dict(hidden=36), dict(hidden=0)], ids=str)
def test_gelu_mlp_none_passes_over_what_the_epilogues_refuse(gpu, chosen, call):
  gpu.kind("NVIDIA H200")
  gelu_mlp(**call)
  assert chosen() == ("xla", "xla", "xla")


def test_gelu_mlp_none_keeps_xla_on_a_gpu_without_a_table(gpu, chosen):
  gelu_mlp()
  assert chosen() == ("xla", "xla", "xla")


@pytest.mark.parametrize("call,reason", [
    (dict(hidden=0), "positive multiples of 8"), (dict(approximate=False), "tanh")], ids=str)
def test_gelu_mlp_cuda_refuses_by_name(gpu, chosen, call, reason):
  with pytest.raises(NotImplementedError, match=rf"gelu_mlp\(implementation='cuda'\).*{reason}"):
    gelu_mlp(implementation="cuda", **call)


# ------------------------------------------------------------------------------------ RNN

# The largest hidden sizes the H100 holds, as the docs quote them (batch 64).
RNN_LARGEST = [("lstm", "bfloat16", 1644), ("lstm", "float16", 1644),
               ("lstm", "float32", 1056), ("gru", "bfloat16", 2112), ("gru", "float32", 1096)]


def measured(*grids):
  """Tuned RNN rows of measured grids: ``(key, batches, hidden sizes, orders by batch)``."""
  return {f"fastest/{key}": {"batch": list(b), "hidden": list(h), "order": order}
          for key, b, h, order in grids}


def both_uses(cell_and_dtype, batches, hidden, order):
  """One grid for the evaluated forward and the training step."""
  return [(f"{cell_and_dtype}/{use}", batches, hidden, order) for use in ("forward", "step")]


@pytest.mark.parametrize("cell,dtype,largest", RNN_LARGEST)
def test_rnn_none_takes_cuda_up_to_the_largest_hidden_size(gpu, chosen, cell, dtype, largest):
  gpu.rnn_rows(measured(*(grid for key in ("lstm/float32", "lstm/bfloat16")
                          for grid in both_uses(key, [64], [64], [["cuda>xla"]]))))
  recurrent(cell, largest, dtype)
  assert chosen() == "cuda"
  recurrent(cell, largest + 1, dtype)
  assert chosen() == "xla"


def test_rnn_none_takes_the_order_measured_at_the_nearest_point_of_its_grid(gpu, chosen):
  gpu.rnn_rows(measured(*both_uses("lstm/bfloat16", [64, 128], [64, 1024],
                                   [["cuda>xla", "xla>cuda"], ["xla>cuda", "xla>cuda"]])))
  recurrent("lstm", 64, batch=64)
  assert chosen() == "cuda"
  recurrent("lstm", 64, batch=90)  # nearer 64 than 128 by ratio
  assert chosen() == "cuda"
  recurrent("lstm", 64, batch=91)
  assert chosen() == "xla"
  recurrent("lstm", 250, batch=64)
  assert chosen() == "cuda"
  recurrent("lstm", 260, batch=64)
  assert chosen() == "xla"
  # A point the run did not time: the nearest it did.
  gpu.rnn_rows(measured(*both_uses("lstm/bfloat16", [64, 128], [64, 1024],
                                   [["cuda>xla", ""], ["xla>cuda", "xla>cuda"]])))
  recurrent("lstm", 1024, batch=64)
  assert chosen() == "xla"
  recurrent("lstm", 64, batch=64)
  assert chosen() == "cuda"
  # A grid the run timed nowhere: the shared bounds on the work per step.
  gpu.rnn_rows(measured(*both_uses("lstm/bfloat16", [64], [64], [[""]])))
  recurrent("lstm", 64, batch=2048, on_host=True)
  assert chosen() == "cudnn"
  gpu.rnn_rows(measured(*both_uses("lstm/bfloat16", [64, 128], [64, 1024],
                                   [["cuda>xla", ""], ["xla>cuda", "xla>cuda"]])))
  # Both directions' rows count: each is a recurrence beside the other.
  recurrent("lstm", 64, batch=64, bidirectional=True)
  assert chosen() == "xla"
  # float32 has no grid (nor has GRU's): the shared bounds on the work per step.
  recurrent("lstm", 64, "float32", batch=91)
  assert chosen() == "cuda"
  recurrent("lstm", 64, batch=91, implementation="cuda")
  assert chosen() == "cuda"


def test_rnn_none_takes_a_bidirectional_call_by_the_grid_of_two_directions(gpu, chosen):
  one_direction = both_uses("lstm/bfloat16", [64, 128], [64], [["cuda>xla"], ["xla>cuda"]])
  two_directions = [(f"{key}/bidirectional", *rest) for key, *rest in
                    both_uses("lstm/bfloat16", [64, 128], [64], [["cudnn>cuda"], ["cuda>xla"]])]
  gpu.rnn_rows(measured(*one_direction, *two_directions))
  # At its own batch in the grid of two directions, not at twice it in the other.
  recurrent("lstm", 64, batch=64, bidirectional=True, on_host=True)
  assert chosen() == "cudnn"
  recurrent("lstm", 64, batch=128, bidirectional=True, on_host=True)
  assert chosen() == "cuda"
  recurrent("lstm", 64, batch=64, on_host=True)
  assert chosen() == "cuda"
  # GRU has no grid of two directions: the LSTM's, before its own of one direction.
  gpu.rnn_rows(measured(*one_direction, *two_directions,
                        *both_uses("gru/bfloat16", [64, 128], [64], [["cuda"], ["xla"]])))
  recurrent("gru", 64, batch=64, bidirectional=True, on_host=True)
  assert chosen() == "cudnn"
  # Its one-direction grid where no cell has one of two, at twice the batch.
  gpu.rnn_rows(measured(*one_direction,
                        *both_uses("gru/bfloat16", [64, 128], [64], [["cuda"], ["xla"]])))
  recurrent("gru", 64, batch=64, bidirectional=True, on_host=True)
  assert chosen() == "xla"
  # Without a grid of two directions: the one-direction grid at twice the batch.
  gpu.rnn_rows(measured(*one_direction))
  recurrent("lstm", 64, batch=64, bidirectional=True, on_host=True)
  assert chosen() == "xla"


@pytest.mark.parametrize("cell,dtype,largest", RNN_LARGEST)
def test_rnn_cuda_refuses_a_hidden_size_that_does_not_fit(gpu, chosen, cell, dtype, largest):
  recurrent(cell, largest, dtype, implementation="cuda")
  assert chosen() == "cuda"
  with pytest.raises(NotImplementedError,
                     match=rf"{cell}\(implementation='cuda'\) cannot run here: the 'cuda' "
                           rf"{cell.upper()} keeps W_hh \(. \* {largest + 1} x {largest + 1}, "
                           r".* MiB a direction.*does not fit on this GPU"):
    recurrent(cell, largest + 1, dtype, implementation="cuda")


def test_rnn_cuda_refuses_float64(gpu, chosen):
  recurrent("lstm", 64, "float64")
  assert chosen() == "xla"
  with pytest.raises(NotImplementedError,
                     match="take float16, bfloat16 and float32, not float64"):
    recurrent("lstm", 64, "float64", implementation="cuda")


def test_rnn_cuda_takes_an_empty_batch_of_any_hidden_size(gpu, chosen):
  # No step to run: nothing is held, and XLA returns the initial state.
  recurrent("lstm", 4096, batch=0, implementation="cuda")
  assert chosen() == "xla"


def test_rnn_none_takes_cudnn_where_its_grid_measured_it_fastest(gpu, chosen):
  gpu.rnn_rows(measured(*both_uses("lstm/bfloat16", [32, 64], [64],
                                   [["cuda>cudnn>xla"], ["cudnn>cuda>xla"]])))
  recurrent("lstm", 64, batch=32, on_host=True)
  assert chosen() == "cuda"
  recurrent("lstm", 64, batch=64, on_host=True)
  assert chosen() == "cudnn"
  # Lengths on the device: a cuDNN call per layer and direction.
  recurrent("lstm", 64, batch=64)
  assert chosen() == "cudnn by layer"
  recurrent("lstm", 64, batch=129)
  assert chosen() == "cudnn by layer"
  # A pair the run did not time takes the nearest it did: GRU and float16 LSTM's bfloat16
  # grid; float32, timed for neither cell, the shared bounds.
  recurrent("gru", 64, batch=64, on_host=True)
  assert chosen() == "cudnn"
  recurrent("gru", 64, "float16", batch=64, on_host=True)
  assert chosen() == "cudnn"
  recurrent("gru", 64, "float32", batch=64, on_host=True)
  assert chosen() == "cuda"


def test_rnn_none_chooses_for_inference_and_training_apart(gpu, chosen):
  batches = [64, 128, 256, 512]
  gpu.rnn_rows(measured(
      ("lstm/float32/forward", batches, [64],
       [["cuda>xla>cudnn"], ["xla>cudnn>cuda"], ["cudnn>xla>cuda"], ["cudnn>xla>cuda"]]),
      ("lstm/float32/step", batches, [64],
       [["cuda>xla>cudnn"], ["cuda>xla>cudnn"], ["cuda>cudnn>xla"], ["cudnn>cuda>xla"]])))
  recurrent("lstm", 64, "float32", batch=64, on_host=True)
  assert chosen() == "cuda"
  recurrent("lstm", 64, "float32", batch=128, on_host=True)
  assert chosen() == ("xla", "cuda")  # (evaluated, differentiated)
  recurrent("lstm", 64, "float32", batch=256, on_host=True)
  assert chosen() == ("cudnn", "cuda")
  recurrent("lstm", 64, "float32", batch=512, on_host=True)
  assert chosen() == "cudnn"
  # GRU takes LSTM's grids; a named implementation runs both.
  recurrent("gru", 64, "float32", batch=128, on_host=True)
  assert chosen() == ("xla", "cuda")
  recurrent("lstm", 64, "float32", batch=128, implementation="cuda")
  assert chosen() == "cuda"


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_rnn_none_without_a_grid_takes_cudnn_from_the_shared_bounds(gpu, chosen, cell, dtype):
  gpu.rnn_rows({})
  recurrent(cell, 64, dtype, on_host=True)
  assert chosen() == "cuda"
  recurrent(cell, 64, dtype, batch=2048, on_host=True)
  assert chosen() == "cudnn"
  recurrent(cell, 64, dtype, on_host=True, implementation="cudnn")
  assert chosen() == "cudnn"


def test_rnn_cudnn_runs_per_layer_for_device_lengths_or_dropout(gpu, chosen):
  recurrent("gru", 64, "float32", on_host=True, implementation="cudnn")
  assert chosen() == "cudnn"
  recurrent("gru", 64, "float32", implementation="cudnn")
  assert chosen() == "cudnn by layer"
  recurrent("lstm", 64, "float32", layers=2, dropout=0.1, dropout_key=jax.random.key(0),
            on_host=True, implementation="cudnn")
  assert chosen() == "cudnn by layer"


def test_rnn_cudnn_refuses_float64(gpu, chosen):
  with pytest.raises(NotImplementedError, match=r"lstm\(implementation='cudnn'\) cannot run "
                     r"here: .*takes float32, float16 and bfloat16, not float64"):
    recurrent("lstm", 64, "float64", on_host=True, implementation="cudnn")


def test_rnn_cudnn_refuses_without_nvcc_or_off_the_gpu(gpu, chosen):
  gpu.without_nvcc()
  with pytest.raises(NotImplementedError, match="nvcc was not found"):
    recurrent("lstm", 64, "float32", on_host=True, implementation="cudnn")
  gpu.platform("cpu")
  with pytest.raises(NotImplementedError, match="needs an NVIDIA GPU"):
    recurrent("lstm", 64, "float32", on_host=True, implementation="cudnn")


# ----------------------------------------------------------------------------- attention

# (machine, call) -> (evaluated, differentiated): cuDNN where it takes the call, then
# 'mosaic' on Hopper, then 'triton', then 'xla'.
ATTENTION_FALLS_THROUGH = [
    ("h100", dict(t=8192), "cudnn"),
    ("h100", dict(segments=True), "mosaic"),
    ("h100", dict(segments=True, h=32), "triton"),
    ("h100", dict(segments=True, hv=96), "triton"),
    ("h100", dict(segments=True, dtype="float32"), "triton"),
    # Past the queries for which the H100 tries 'mosaic' first.
    ("h100", dict(t=32768, causal_offset=1, is_causal=True), "mosaic"),
    ("h100", dict(t=8192, return_lse=True), "mosaic"),
    ("h100", dict(bias=True), "cudnn"),
    ("h100", dict(bias=True, dtype="float32"), "xla"),
    ("ampere", dict(t=8192), "cudnn"),
    ("ampere", dict(segments=True), "triton"),
    ("blackwell", dict(segments=True), "triton"),
    ("ampere without triton", dict(segments=True), "xla"),
]
MACHINES = {
    "h100": lambda gpu: None,
    "ampere": lambda gpu: gpu.capability((8, 0)),
    "blackwell": lambda gpu: gpu.capability((10, 0)),
    "ampere without triton": lambda gpu: (gpu.capability((8, 0)), gpu.without_triton()),
}


@pytest.mark.parametrize("machine,kwargs,expected", ATTENTION_FALLS_THROUGH)
def test_attention_none_falls_through_in_order(gpu, chosen, machine, kwargs, expected):
  MACHINES[machine](gpu)
  attention(**kwargs)
  assert chosen() == _each_direction(expected)


# (GPU, call of 2 x 16 heads: past the tables' small-grid bounds) -> (evaluated,
# differentiated) where the GPU's tuned table puts 'mosaic' before cuDNN: the H200's own rows
# override the H100's it inherits; a GPU without a table takes cuDNN first.
ATTENTION_BY_TABLE = [
    ("NVIDIA H200", dict(t=3072, is_causal=False), ("cudnn", "cudnn")),
    ("NVIDIA H100 80GB HBM3", dict(t=4096, is_causal=True), ("mosaic", "mosaic")),
    ("NVIDIA H200", dict(t=4096, is_causal=True), ("mosaic", "mosaic")),
    ("NVIDIA H200", dict(t=16384, is_causal=True), ("mosaic", "cudnn")),
    ("NVIDIA H200", dict(t=8192, h=256, is_causal=False), ("cudnn", "mosaic")),
    ("NVIDIA H100 80GB HBM3", dict(t=6144, h=64, is_causal=True), ("mosaic", "mosaic")),
    ("NVIDIA H100 80GB HBM3", dict(t=8192, h=64, is_causal=True), ("mosaic", "mosaic")),
    ("NVIDIA H100 80GB HBM3", dict(t=16384, h=64, is_causal=True), ("mosaic", "cudnn")),
    ("NVIDIA H100 80GB HBM3", dict(t=16384, h=64, is_causal=False), ("mosaic", "cudnn")),
    ("NVIDIA H100 80GB HBM3", dict(t=3072, is_causal=False), ("cudnn", "cudnn")),
    ("NVIDIA H100 80GB HBM3", dict(t=1024, is_causal=False), ("cudnn", "mosaic")),
    ("NVIDIA H100 PCIe", dict(t=4096, is_causal=True), ("cudnn", "cudnn")),
    # A grid of 64 work tiles: Triton's forward, cuDNN's step, below Mosaic's least tiles.
    ("NVIDIA H100 80GB HBM3", dict(t=1024, h=64, batch=1, heads=8), ("triton", "cudnn")),
    ("NVIDIA H200", dict(t=1024, h=64, batch=1, heads=8), ("triton", "cudnn")),
]


@pytest.mark.parametrize("kind,kwargs,expected", ATTENTION_BY_TABLE)
def test_attention_none_follows_the_gpus_table(gpu, chosen, kind, kwargs, expected):
  gpu.kind(kind)
  attention(**{"heads": 16, **kwargs})
  assert chosen() == expected


# (batch, queries, heads) -> (evaluated, differentiated) under a table whose small grids take
# Triton's forward up to 64 work tiles and Mosaic only from 256 (its query rows say Mosaic).
ATTENTION_BY_TILES = [((1, 1024, 8), ("triton", "cudnn")), ((1, 2048, 8), ("cudnn", "cudnn")),
                      ((2, 2048, 8), ("mosaic", "mosaic")), ((1, 1000, 8), ("triton", "cudnn"))]


@pytest.mark.parametrize("shape,expected", ATTENTION_BY_TILES, ids=str)
def test_attention_none_follows_the_tables_work_tiles(gpu, chosen, monkeypatch, shape,
                                                      expected):
  gpu.kind("NVIDIA GPU without a table")
  monkeypatch.setattr(attention_api, "_untuned", lambda: {
      "mosaic_before_cudnn_forward": {"causal/128": 4096},
      "mosaic_before_cudnn_step": {"causal/128": 4096},
      "mosaic_least_tiles_forward": 256, "mosaic_least_tiles_step": 256,
      "triton_most_tiles_forward": 64, "triton_most_tiles_step": 0})
  batch, t, heads = shape
  attention(t, batch=batch, heads=heads, is_causal=True)
  assert chosen() == expected


def test_attention_none_moves_on_where_cudnn_rejects_the_shapes(gpu, chosen):
  gpu.cudnn_rejecting("jax.nn.dot_product_attention(implementation='cudnn') refuses these "
                      "shapes: ValueError: head dim")
  attention(t=8192)
  assert chosen() == ("mosaic", "mosaic")
  with pytest.raises(NotImplementedError, match="cannot run here: .*refuses these shapes"):
    attention(t=8192, implementation="cudnn")


@pytest.mark.parametrize("t,expected", [(QUERIES_OF_2_TO_THE_31 - 1, "cudnn"),
                                        (QUERIES_OF_2_TO_THE_31, "mosaic")])
def test_attention_none_passes_over_cudnn_from_2_to_the_31_elements(gpu, chosen, t, expected):
  attention(t=t)
  assert chosen() == _each_direction(expected)


@pytest.mark.parametrize("implementation,machine,kwargs,reason", [
    ("cudnn", "h100", dict(is_causal=True, causal_offset=1), "has no causal_offset"),
    ("cudnn", "h100", dict(segments=True), "has no segment_ids"),
    ("cudnn", "h100", dict(logits_soft_cap=30.0), "has no logits_soft_cap"),
    ("cudnn", "h100", dict(return_lse=True), "has no return_lse"),
    ("cudnn", "h100", dict(precision=jax.lax.Precision.HIGHEST), "has no precision"),
    ("cudnn", "h100", dict(dtype="float32"), "needs float16 or bfloat16, got float32"),
    ("cudnn", "h100", dict(t=QUERIES_OF_2_TO_THE_31),
     "2\\^31 elements or more .*the largest has 2147483648"),
    ("mosaic", "ampere", {}, r"written for Hopper \(sm_90\) wgmma; this device is gpu \(8, 0\)"),
    ("mosaic", "blackwell", {}, r"for Hopper \(sm_90\) wgmma; this device is gpu \(10, 0\)"),
    ("mosaic", "h100", dict(dtype="float32"), "takes float16 and bfloat16, not float32"),
    ("mosaic", "h100", dict(h=96), r"a query/key head dim in \(64, 128, 256\), not 96"),
    ("mosaic", "h100", dict(hv=32), r"a value head dim in \(64, 128, 256\), not 32"),
    ("mosaic", "h100", dict(bias=True), "bias and mask arrays are not supported"),
    ("mosaic", "h100", dict(precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32),
     "precision .* is not supported"),
    ("triton", "h100", dict(bias=True), "bias and mask arrays are not supported"),
    ("triton", "h100", dict(dtype="float64"), "dtype float64 is not supported"),
    ("triton", "h100", dict(precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32),
     "precision .* is not supported"),
])
def test_attention_named_implementation_refuses(gpu, chosen, implementation, machine, kwargs,
                                                reason):
  MACHINES[machine](gpu)
  with pytest.raises(NotImplementedError,
                     match=rf"attention\(implementation='{implementation}'\) cannot run here: "
                           rf".*{reason}"):
    attention(implementation=implementation, **kwargs)


@pytest.mark.triton
def test_attention_mosaic_refuses_without_pallas_mosaic_gpu(gpu, chosen, monkeypatch):
  monkeypatch.setitem(sys.modules, "jax.experimental.pallas.mosaic_gpu", None)
  monkeypatch.delattr(jax.experimental.pallas, "mosaic_gpu", raising=False)
  with pytest.raises(NotImplementedError, match="has no Pallas Mosaic GPU"):
    attention(implementation="mosaic")
  attention(segments=True)
  assert chosen() == ("triton", "triton")


@pytest.mark.parametrize("implementation,reason", [
    ("cudnn", "the 'cudnn' implementation needs an NVIDIA GPU"),
    ("mosaic", r"written for Hopper \(sm_90\) wgmma; this device is cpu None"),
])
def test_attention_refuses_off_the_gpu(cpu, chosen, implementation, reason):
  with pytest.raises(NotImplementedError, match=reason):
    attention(implementation=implementation)


def test_explain_tells_what_runs_for_each_use_and_what_was_passed_over(gpu, chosen, capsys,
                                                                      caplog):
  gpu.without_triton()  # the ops' entries are spies (chosen): the kernels are never traced
  with caplog.at_level("DEBUG", logger="jaxfuse"):
    (choice,) = jaxfuse.explain(jaxfuse.softmax, Array((64, 65536), jnp.bfloat16))
  assert (choice.op, choice.implementation, choice.evaluated, choice.forward,
          choice.backward) == ("softmax", None, "cuda", "cuda", "cuda")
  assert "Triton" in choice.passed_over["triton"]
  said = capsys.readouterr().out
  assert said.startswith("softmax(implementation=None): cuda\n  passed over 'triton': ")
  assert "softmax(implementation=None) runs Plan(evaluated='cuda'" in caplog.text
  # Every jaxfuse op a function calls, in order, each use where they differ.
  choices = jaxfuse.explain(
      lambda x, w: (jaxfuse.rms_norm(x, w, implementation="xla"), jaxfuse.softmax(x)),
      Array((64, 8192), jnp.bfloat16), Array((8192,), jnp.bfloat16))
  assert [(c.op, c.implementation, c.evaluated, c.forward) for c in choices] == [
      ("rms_norm", "xla", "xla", "xla"), ("softmax", None, "xla", "cuda")]
