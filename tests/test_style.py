"""Comments and docstrings in jaxfuse/ say why and quote no measured figure: numbers live in
benchmarks/results/, in tuned tables and in commit messages, where they can be re-recorded."""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_RULE = ("comments and docstrings say why, not what was measured: move the figure to "
         "benchmarks/results/, a tuned table or the commit message")

# A percentage (`95.6%`, `+4.9 %`), a decimal ratio (`1.05x`; not `16384x256` or `4x the L2`)
# and a timing or rate with a decimal number (`0.94 ms`, `3.1 TB/s`). A spaced `%` before an
# operand is the modulo operator (`7 % 4`), not a percentage.
_MEASURED = re.compile(r"""
    \d+(?:\.\d+)?(?:%|\ %(?!\ ?[\w(]))
  | \b\d+\.\d+x\b
  | \d+\.\d+\ ?(?:ms|us|µs|ns|GB/s|TB/s|TFLOP/s)(?![\w/])
""", re.X)


def _python_lines(text):
  """(line, text) of every `#` comment and every docstring line of a Python source."""
  for token in tokenize.generate_tokens(io.StringIO(text).readline):
    if token.type == tokenize.COMMENT:
      yield token.start[0], token.string
  source = text.splitlines()
  for node in ast.walk(ast.parse(text)):
    if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    first = node.body[0] if node.body else None
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)):
      for line in range(first.lineno, first.end_lineno + 1):
        yield line, source[line - 1].strip()


def _c_lines(text):
  """(line, text) of every `//` and `/* */` comment line of a C, C++ or CUDA source; string and
  character literals are skipped so that a `//` inside one is not taken for a comment."""
  line, i, n = 1, 0, len(text)
  while i < n:
    c = text[i]
    if c == "\n":
      line += 1
    elif c in "\"'":
      i += 1
      while i < n and text[i] != c and text[i] != "\n":
        i += 2 if text[i] == "\\" else 1
    elif text.startswith("//", i):
      end = text.find("\n", i)
      end = n if end < 0 else end
      yield line, text[i:end]
      i = end
      continue
    elif text.startswith("/*", i):
      end = text.find("*/", i + 2)
      end = n if end < 0 else end + 2
      for offset, part in enumerate(text[i:end].split("\n")):
        yield line + offset, part.strip()
      line += text.count("\n", i, end)
      i = end
      continue
    i += 1


def measured_figures(root):
  """`path:line: text` for every comment or docstring line under root/jaxfuse that quotes a
  measured figure, paths relative to root."""
  found = []
  for path in sorted((Path(root) / "jaxfuse").rglob("*")):
    relative = path.relative_to(root).as_posix()
    if path.suffix == ".py":
      lines = _python_lines(path.read_text())
    elif path.suffix in (".cu", ".cuh", ".h"):
      lines = _c_lines(path.read_text())
    else:
      continue
    found += [f"{relative}:{line}: {text.strip()}" for line, text in lines
              if _MEASURED.search(text)]
  return found


def _report(found):
  return f"{_RULE}:\n" + "\n".join(found)


def test_comments_and_docstrings_quote_no_measured_figures():
  found = measured_figures(ROOT)
  assert not found, _report(found)


def test_the_scan_reports_planted_figures_and_passes_shapes(tmp_path):
  package = tmp_path / "jaxfuse" / "ops"
  package.mkdir(parents=True)
  (package / "bad.py").write_text(
    '"""A kernel.\n\nIts tiles run at 0.94x of the copy."""\n'
    "x = 1  # 95.6% of the copy\n"
    "def f():\n"
    '  """+4.9% on 16k rows."""\n'
    "  return x % 32  # rows of 16384x256, 4x the L2, below 2^31, masks 0x7f\n")
  (package / "bad.cu").write_text(
    '#include "rows.cuh"\n'
    'const char* s = "// 1.5 ms in a string";  // H100: 0.94 against 0.98 ms\n'
    "/* one block per row:\n   3.1 TB/s on 16384x256 */\n"
    "int m = 7 % 4;  // a warp has 32 lanes; 2^31 elements\n")
  (package / "good.py").write_text("# rows of 16384x256\n")
  assert measured_figures(tmp_path) == [
    "jaxfuse/ops/bad.cu:2: // H100: 0.94 against 0.98 ms",
    "jaxfuse/ops/bad.cu:4: 3.1 TB/s on 16384x256 */",
    "jaxfuse/ops/bad.py:4: # 95.6% of the copy",
    "jaxfuse/ops/bad.py:3: Its tiles run at 0.94x of the copy.\"\"\"",
    "jaxfuse/ops/bad.py:6: \"\"\"+4.9% on 16k rows.\"\"\"",
  ]
  assert _report(["a:1: b"]).startswith(_RULE)


def test_custom_vjp_is_written_only_in_the_op_layer():
  """Every op's derivative is declared through jaxfuse/_core/op.py."""
  writers = sorted(path.relative_to(ROOT).as_posix()
                   for path in (ROOT / "jaxfuse").rglob("*.py")
                   if "custom_vjp" in path.read_text())
  assert writers == ["jaxfuse/_core/op.py"]


def test_vmap_rules_are_declared_only_in_the_op_layer():
  """Every kernel call JAX cannot batch by itself gets its rule through op.vmappable."""
  writers = sorted(path.relative_to(ROOT).as_posix()
                   for path in (ROOT / "jaxfuse").rglob("*.py")
                   if "custom_vmap" in path.read_text())
  assert writers == ["jaxfuse/_core/op.py"]


def test_no_python_file_in_jaxfuse_passes_700_lines():
  long = {path.relative_to(ROOT).as_posix(): n for path in (ROOT / "jaxfuse").rglob("*.py")
          if (n := len(path.read_text().splitlines())) > 700}
  assert not long
