"""House rules and packaging, written as tests that say what to do instead."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

import support
import sync_replicas

pytestmark = pytest.mark.keras  # Its pytest process keeps Keras (a test says so).

PACKAGE = pathlib.Path(sync_replicas.__file__).parent
#: The package's modules the house rules apply to: the top level and the
#: command-line tools (sync_replicas/cli/, which print to their terminal
#: through _cli.say and their streams, never with print).
SOURCES = (sorted(PACKAGE.glob("*.py")) + sorted(PACKAGE.glob("cli/*.py"))
           + sorted(PACKAGE.glob("patch/*.py")))


def _offending_lines(pattern):
  found = []
  for path in SOURCES:
    for number, line in enumerate(path.read_text().splitlines(), 1):
      if re.search(pattern, line) and not line.lstrip().startswith("#"):
        found.append("%s:%d: %s" % (path.relative_to(PACKAGE), number, line.strip()))
  return found


def test_version_and_public_names():
  assert re.fullmatch(r"\d+\.\d+\.\d+", sync_replicas.__version__)
  for name in sync_replicas.__all__:
    assert hasattr(sync_replicas, name), name
  assert "SyncReplicasOptimizer" in sync_replicas.__all__
  assert "SyncReplicasOptimizerHook" in sync_replicas.__all__


def test_public_names_agree_in_all_three_lists():
  # __init__.py names each public name three times: in __all__ (a literal,
  # for linters), in _HOMES (the lazy loader) and in the TYPE_CHECKING
  # imports (for type checkers and readers). Parsed, not imported: the
  # loader would hide a name missing from the imports.
  tree = ast.parse((PACKAGE / "__init__.py").read_text())
  homes, typed = set(), set()
  for node in tree.body:
    if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
        and [t.id for t in node.targets] == ["_HOMES"]):
      homes = {key.value for key in node.value.keys}
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      typed = {alias.name for imp in node.body for alias in imp.names}
  public = set(sync_replicas.__all__) - {"__version__"}
  assert homes == public, (
      "_HOMES and __all__ in sync_replicas/__init__.py differ: only in "
      "_HOMES %s, only in __all__ %s; list each public name in both"
      % (sorted(homes - public), sorted(public - homes)))
  assert typed == public, (
      "The TYPE_CHECKING imports and __all__ in sync_replicas/__init__.py "
      "differ: only imported %s, only in __all__ %s; import each public "
      "name there too, so that type checkers see it"
      % (sorted(typed - public), sorted(public - typed)))


def test_package_never_uses_the_stock_class():
  # Parsed, not grepped: docstrings may name stock, code may not touch it.
  found = []
  for path in SOURCES:
    for node in ast.walk(ast.parse(path.read_text())):
      stock_attr = (isinstance(node, ast.Attribute)
                    and node.attr == "SyncReplicasOptimizer"
                    and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "train")
      stock_module = (isinstance(node, (ast.Import, ast.ImportFrom)) and any(
          "sync_replicas_optimizer" in (alias.name or "")
          for alias in node.names) or "sync_replicas_optimizer" in getattr(
              node, "module", "") or "")
      if stock_attr or stock_module:
        found.append("%s:%d" % (path.relative_to(PACKAGE), node.lineno))
  assert not found, (
      "The package must not import, wrap or subclass stock's "
      "SyncReplicasOptimizer (it is the reference in tests only): "
      + ", ".join(found))


def _scope_text_lines():
  """``patch/__init__.py:N`` for each line of the patch's ``SCOPE`` text,
  which names the private modules it patches for its users to read (the
  code reaches them through ``_compat``'s names)."""
  path = PACKAGE / "patch" / "__init__.py"
  for node in ast.parse(path.read_text()).body:
    if (isinstance(node, ast.Assign) and len(node.targets) == 1
        and getattr(node.targets[0], "id", None) == "SCOPE"):
      return {"patch/__init__.py:%d:" % n
              for n in range(node.lineno, node.end_lineno + 1)}
  raise AssertionError("sync_replicas/patch/__init__.py has no SCOPE text")


def test_only_compat_may_touch_tensorflow_internals():
  documented = _scope_text_lines()
  found = [line for line in _offending_lines(r"tensorflow\.python")
           if not line.startswith("_compat.py")
           and line.split(" ", 1)[0] not in documented]
  assert not found, (
      "Private TensorFlow modules change between versions; reach them only "
      "from _compat.py:\n" + "\n".join(found))


def test_no_print_in_the_package():
  found = _offending_lines(r"^\s*print\(")
  assert not found, ("Use the module logger, not print:\n" + "\n".join(found))


def test_import_makes_no_deprecation_warnings_of_its_own():
  script = (
      "import logging, warnings\n"
      "import tensorflow as tf\n"
      "records = []\n"
      "class Catch(logging.Handler):\n"
      "  def emit(self, r): records.append(r.getMessage())\n"
      "logging.getLogger('tensorflow').addHandler(Catch())\n"
      "with warnings.catch_warnings(record=True) as caught:\n"
      "  warnings.simplefilter('always')\n"
      "  import sync_replicas\n"
      # The public names load on first use (sync_replicas/__init__.py).
      "  sync_replicas.SyncReplicasOptimizer\n"
      "bad = [str(w.message) for w in caught] + "
      "[m for m in records if 'deprecat' in m.lower()]\n"
      "assert not bad, bad\n")
  # With Keras, as in a user's process (the tests' children lack it).
  result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=120, check=False,
                          env=support.with_keras())
  assert result.returncode == 0, result.stderr[-3000:]


_QUIET_RUN = """
import tensorflow as tf
import sync_replicas
server = tf.distribute.Server.create_local_server()
with tf.Graph().as_default():
  gs = tf.compat.v1.train.get_or_create_global_step()
  v = tf.compat.v1.Variable([1.0, 2.0])
  for cls, name in ((sync_replicas.SyncReplicasOptimizer, "sync_replicas"),
                    (sync_replicas.SyncReplicasOptimizerV2, "legacy")):
    opt = cls(tf.compat.v1.train.GradientDescentOptimizer(0.1),
              replicas_to_aggregate=1, name=name)
    train_op = opt.minimize(tf.reduce_sum(v * v), global_step=gs)
    opt.get_chief_queue_runner()
  opt = sync_replicas.SyncReplicasOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1),
      replicas_to_aggregate=1, name="trained")
  train_op = opt.minimize(tf.reduce_sum(v * v), global_step=gs)
  with tf.compat.v1.train.MonitoredTrainingSession(
      master=server.target, is_chief=True, stop_grace_period_secs=1,
      hooks=[opt.make_session_run_hook(True)],
      config=tf.compat.v1.ConfigProto(operation_timeout_in_ms=30000)) as sess:
    for _ in range(3):
      sess.run(train_op)
"""


def test_our_code_paths_print_no_deprecation_warning():
  """Quiet as stock or quieter (issue 16): the demo printed TensorFlow's
  QueueRunner deprecation in every process, from our runner's constructor.
  A fresh process, since TensorFlow prints each warning once per process."""
  done = subprocess.run([sys.executable, "-c", _QUIET_RUN],
                        capture_output=True, text=True, timeout=240,
                        cwd=PACKAGE.parent, env=support.with_keras())
  assert done.returncode == 0, done.stderr[-3000:]
  ours = [line for line in done.stderr.splitlines()
          if "deprecated" in line and str(PACKAGE) in line]
  assert not ours, "\n".join(ours)
  # Stock's unused readiness tensor is logged as "never used" at exit.
  assert "Object was never used" not in done.stderr, done.stderr[-3000:]


def test_the_tests_children_import_tensorflow_without_keras():
  """tests/_hidden_from_tasks: what a test starts skips Keras, which no task
  uses; pytest's own process keeps it (test_keras and test_validation use
  it), and support.with_keras() gives it back to a child that needs it."""
  code = ("import sys\n"
          "import tensorflow as tf\n"
          "print(tf.compat.v1.train.GradientDescentOptimizer.__name__)\n"
          "try:\n"
          "  import keras\n"
          "except ImportError as e:\n"
          "  print(e)\n"
          "print('keras' in sys.modules)\n")
  run = lambda env: subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True,
      timeout=120, check=False, env=env)
  hidden, shown = run(None), run(support.with_keras())
  assert hidden.returncode == 0, hidden.stderr[-3000:]
  assert hidden.stdout.split("\n")[0] == "GradientDescentOptimizer"
  assert "keras is hidden in the processes the test suite starts" in (
      hidden.stdout)
  assert hidden.stdout.split()[-1] == "False", hidden.stdout
  assert shown.returncode == 0, shown.stderr[-3000:]
  assert shown.stdout.split()[-1] == "True", shown.stdout
  assert "keras" in sys.modules


#: Underscore names that are public API (namedtuples'; os._exit, which the
#: status tool's Ctrl-C uses).
_PUBLIC_UNDERSCORE = {"_asdict", "_replace", "_fields", "_make", "_exit"}


def _own_private_names():
  """Every private name the package itself defines or assigns."""
  own = set(_PUBLIC_UNDERSCORE)
  for path in SOURCES:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        own.add(node.name)
      elif isinstance(node, ast.Attribute) and isinstance(
          node.ctx, ast.Store):
        own.add(node.attr)
      elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        own.add(node.id)
  return own


def test_only_compat_may_touch_private_attributes_of_tensorflow_objects():
  """A private attribute the package never defines is TensorFlow's (or a
  library's): it changes between versions without notice (issue 17 found
  QueueRunner's ``_exceptions_raised`` and Optimizer's ``_name``)."""
  own = _own_private_names()
  found = []
  for path in SOURCES:
    if path.name == "_compat.py":
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
          and not node.attr.startswith("__") and node.attr not in own):
        found.append("%s:%d: .%s" % (path.relative_to(PACKAGE), node.lineno,
                                     node.attr))
  assert not found, (
      "Private attributes of TensorFlow objects change between versions; "
      "use the public API, or reach them in _compat.py with a version "
      "note:\n" + "\n".join(found))


#: The house's size limits (issue 17): a function longer than this, or a
#: class, no longer reads as one idea. Docstrings count.
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300


def test_no_function_or_class_in_the_package_is_too_long():
  found = []
  for path in SOURCES:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        limit = MAX_FUNCTION_LINES
      elif isinstance(node, ast.ClassDef):
        limit = MAX_CLASS_LINES
      else:
        continue
      size = node.end_lineno - node.lineno + 1
      if size > limit:
        found.append("%s:%d %s is %d lines (at most %d)"
                     % (path.relative_to(PACKAGE), node.lineno, node.name, size,
                        limit))
  assert not found, (
      "Split these into named steps (see docs/design.md's build stages):\n"
      + "\n".join(found))
