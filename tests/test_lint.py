"""The linter and the type checker over the checkout, as tests.

tools/check runs the same two before the quick tier, and .ci/run before any
suite; here the suite itself fails on a finding, with the finding in the
message. Their rules live in pyproject.toml, each with its reason.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

import support

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Measured: mypy takes 3 s of CPU on a cold cache (21 s of wall time on a
#: machine loaded 11 deep), ruff a fraction of a second. One that runs past
#: this hangs.
CHECKER_TIMEOUT_SECS = 240
_WHY = "tests/test_lint.py runs it over the checkout"

#: The public API that must carry type hints: for each module, the names
#: whose functions (and, for a class, its public methods and ``__init__``)
#: are annotated wholly, every parameter and the return. mypy then checks
#: their bodies; users' checkers read them through sync_replicas/py.typed.
TYPED_API = {
    "sync_replicas/optimizer.py": ["SyncReplicasOptimizer"],
    # The methods every sync optimizer inherits (get_chief_queue_runner, ...).
    "sync_replicas/_wrapped.py": ["WrappedOptimizer"],
    "sync_replicas/hook.py": ["SyncReplicasOptimizerHook"],
    # SyncReplicasOptimizer's announce_data_end, mixed in from here.
    "sync_replicas/_data_end.py": ["AnnouncesDataEnd"],
    "sync_replicas/cluster.py": ["LocalCluster", "loopback_cluster_spec"],
    "sync_replicas/errors.py": ["is_recoverable_error"],
    "sync_replicas/reads.py": ["read_packed"],
    "sync_replicas/ps_server.py": ["ps_server_config"],
    "sync_replicas/ps_wait.py": ["wait_for_job_end"],
    "sync_replicas/ready.py": ["wait_for_chief_init"],
    "sync_replicas/slim.py": ["slim_train"],
    "sync_replicas/patch/__init__.py": [
        "Installation", "is_installed", "stock_class", "replaced", "install",
        "uninstall", "install_when_tensorflow_is_imported", "built"],
    "sync_replicas/timeline.py": [
        "read", "clock_offsets", "aligned", "waited_for", "summary",
        "straggler", "chrome_trace", "render", "merge", "main", "last_start",
        "headline", "verdict"],
    # The command-line entry points (setup.cfg's console_scripts).
    "sync_replicas/patch/__main__.py": ["main"],
    "sync_replicas/cli/launch.py": ["main"],
    "sync_replicas/cli/slurm.py": ["main"],
    "sync_replicas/cli/status.py": ["main"],
}


def _run_checker(*args):
  """Runs ``python -m <args>`` in the checkout; returns (exit code, output)."""
  support.require(args[0], why=_WHY)
  try:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=CHECKER_TIMEOUT_SECS)
  except subprocess.TimeoutExpired as e:
    pytest.fail("%s ran past %d s; its output so far:\n%s"
                % (" ".join(args), CHECKER_TIMEOUT_SECS, e.output or ""))
  return proc.returncode, proc.stdout


def test_ruff_finds_nothing():
  rc, out = _run_checker("ruff", "check", "--output-format", "concise")
  assert rc == 0, (
      "ruff found what pyproject.toml's [tool.ruff] rules forbid:\n%s\n"
      "Fix each finding (`ruff check` in the venv shows them again); a rule "
      "that does not fit the house is turned off in pyproject.toml with its "
      "reason, not silenced line by line." % out)


def test_ruff_reads_every_python_program_in_tools():
  rc, out = _run_checker("ruff", "check", "--show-files")
  assert rc == 0, out
  # --show-files prints absolute paths; a program found by its shebang.
  listed = {pathlib.Path(line.strip()).resolve()
            for line in out.splitlines() if line.strip()}
  programs = [path for path in sorted((ROOT / "tools").iterdir())
              if path.is_file() and path.suffix != ".py"
              and path.read_bytes().startswith(b"#!/usr/bin/env python")]
  assert programs, "no Python program found in tools/: is ROOT right?"
  missing = [str(p.relative_to(ROOT)) for p in programs if p not in listed]
  assert not missing, (
      "ruff does not read %s: a Python program without a .py name must be "
      "listed in pyproject.toml's [tool.ruff] extend-include" % missing)


def test_mypy_finds_nothing():
  rc, out = _run_checker("mypy")
  assert rc == 0, (
      "mypy (pyproject.toml's [tool.mypy]) found:\n%s\nFix the annotation "
      "or the code; `mypy` in the venv shows the findings again." % out)


def _public_functions(tree, names):
  """(qualified name, def node) of each function ``names`` must annotate."""
  for node in tree.body:
    if getattr(node, "name", None) not in names:
      continue
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      yield node.name, node
    elif isinstance(node, ast.ClassDef):
      for item in node.body:
        if (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (not item.name.startswith("_") or item.name == "__init__")):
          yield "%s.%s" % (node.name, item.name), item


def _unannotated(func):
  """What of ``func``'s signature lacks a type hint (self and cls need none)."""
  args = func.args
  params = args.posonlyargs + args.args + args.kwonlyargs
  missing = [p.arg for i, p in enumerate(params)
             if p.annotation is None
             and not (i == 0 and p.arg in ("self", "cls"))]
  missing += [stars + a.arg for stars, a in (("*", args.vararg),
                                              ("**", args.kwarg))
              if a is not None and a.annotation is None]
  if func.returns is None:
    missing.append("the return")
  return missing


def test_public_api_is_annotated():
  found, seen = [], set()
  for path, names in TYPED_API.items():
    tree = ast.parse((ROOT / path).read_text())
    for qualified, func in _public_functions(tree, names):
      seen.add((path, qualified.split(".")[0]))
      missing = _unannotated(func)
      if missing:
        found.append("%s:%d %s: %s" % (path, func.lineno, qualified,
                                       ", ".join(missing)))
  absent = ["%s: %s" % (path, name) for path, names in TYPED_API.items()
            for name in names if (path, name) not in seen]
  assert not absent, (
      "TYPED_API names what these modules no longer define: %s" % absent)
  assert not found, (
      "The public API must carry type hints (users' type checkers read them "
      "through sync_replicas/py.typed); these lack some:\n%s\nAnnotate every "
      "parameter and the return."
      % "\n".join(found))
