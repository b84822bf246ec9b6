"""What every command a user types shows first: its help and its usage errors.

Each installed command (sync-replicas-launch, -slurm, -status, -run, -timeline) and
each example program: ``--help`` says every default once (issue 38 saw
"(default: 2222 when confined, else free ports) (default: None)"), and a
usage error is one line, answered before TensorFlow is imported (issue 38:
a missing manifest took 4 s to report, TensorFlow's import).
"""

import importlib
import re
import subprocess
import sys
import time

import pytest

import support

pytestmark = pytest.mark.quick

#: Every command's module with a ``main(argv)``; the examples' too.
COMMANDS = [
    "sync_replicas.cli.launch",
    "sync_replicas.cli.slurm",
    "sync_replicas.cli.status",
    "sync_replicas.timeline",
    "sync_replicas.patch.__main__",
    "examples.digits",
    "examples.digits_supervisor",
    "examples.sparse_clicks",
    "examples.local_demo",
]


def _entries(help_text):
  """The options' entries of an argparse help: each option with its text."""
  entries, current = [], None
  for line in help_text.splitlines():
    if re.match(r"^  -", line):
      current = [line]
      entries.append(current)
    elif current is not None and re.match(r"^\s{6,}\S", line):
      current.append(line)
    else:
      current = None
  return [" ".join(part.strip() for part in entry) for entry in entries]


@pytest.mark.parametrize("module", COMMANDS)
def test_help_shows_each_default_once(module, capsys):
  main = importlib.import_module(module).main
  try:
    code = main(["--help"])
  except SystemExit as e:
    code = e.code
  assert code in (0, None)
  entries = _entries(capsys.readouterr().out)
  assert entries, "no option found in %s --help" % module
  twice = [e for e in entries if e.lower().count("default") > 1]
  none = [e for e in entries if "(default: None)" in e
          or "(default: False)" in e or "(default: )" in e]
  assert not twice and not none, (twice, none)


#: (command line, what the one line of error says): each a usage error.
USAGE_ERRORS = [
    (["-m", "sync_replicas.cli.status", "--manifest", "no/such/dir", "--ps",
      "127.0.0.1:2222"], "No sync manifest at no/such/dir", 1),
    (["-m", "sync_replicas.cli.status", "--ps", "127.0.0.1:2222"],
     "the following arguments are required: --manifest", 2),
    (["-m", "sync_replicas.cli.launch", "--ps", "1"],
     "give the program to run after --", 2),
    (["-m", "sync_replicas.cli.slurm", "--ps", "1", "--", "true"],
     "not a task of a Slurm job step: SLURM_JOB_ID", 2),
    (["-m", "sync_replicas.cli.slurm", "--backup", "-1", "--", "true"],
     "need --ps >= 0 and --backup >= 0", 2),
    (["-m", "sync_replicas.timeline", "runs/x", "--last", "0"],
     "--last must be at least 1", 2),
    (["-m", "sync_replicas.patch", "--no-such-option"],
     "unknown option '--no-such-option'", 2),
]

#: Generous: a child that imports only the standard library and the package
#: answers in about 0.1 s; TensorFlow's import alone takes 2-4 s here, and
#: more on this shared 2-core machine under other suites' load, so the bound
#: is there to catch a hang while the sys.modules check is the real one.
USAGE_ERROR_SECS = 5.0

# The child reports whether TensorFlow was imported once the tool returned.
_CHILD = """
import runpy, sys
sys.argv = sys.argv[1:]
module = sys.argv.pop(1)
try:
  runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as e:
  code = e.code
else:
  code = 0
sys.stdout.write("tensorflow imported: %s\\n" % ("tensorflow" in sys.modules))
sys.exit(code)
"""


@pytest.mark.parametrize("argv, says, code", USAGE_ERRORS,
                         ids=[" ".join(a[1:3]) for a, _, _ in USAGE_ERRORS])
def test_a_usage_error_is_one_line_before_tensorflow(argv, says, code):
  start = time.monotonic()
  proc = subprocess.run([sys.executable, "-c", _CHILD, "-c"] + argv[1:],
                        cwd=support.TOOLS.parent, capture_output=True,
                        text=True, timeout=60)
  secs = time.monotonic() - start
  assert proc.returncode == code, proc
  assert proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
  assert "tensorflow imported: False" in proc.stdout, proc.stdout
  assert secs < USAGE_ERROR_SECS, "took %.1f s" % secs
