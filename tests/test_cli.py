"""What every command a user types shows first: its help and its usage errors.

Each installed command (sync-replicas-launch, -slurm, -status, -run, -timeline) and
each example program: ``--help`` says every default once (issue 38 saw
"(default: 2222 when confined, else free ports) (default: None)"), and a
usage error is one line, answered before TensorFlow is imported (issue 38:
a missing manifest took 4 s to report, TensorFlow's import).
"""

import importlib
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

import support
from sync_replicas import _ports
from sync_replicas import _process
from sync_replicas import patch

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


@pytest.mark.parametrize("module", COMMANDS[:3])
def test_help_shows_the_options_early_and_no_rst(module, capsys):
  # Issue 46: 45 lines of prose, with RST's ``double backticks``, came
  # before the options. The prose now follows them.
  with pytest.raises(SystemExit):
    importlib.import_module(module).main(["--help"])
  text = capsys.readouterr().out
  lines = text.splitlines()
  first = next(i for i, line in enumerate(lines)
               if line in ("options:", "positional arguments:"))
  assert first < 15, "\n".join(lines[:first + 1])
  assert "``" not in text, text
  # Nothing lost: the prose that followed the examples is still there.
  doc = importlib.import_module(module).__doc__.replace("``", "")
  last_paragraph = " ".join(doc.strip().split("\n\n")[-1].split())
  assert last_paragraph in " ".join(text.split()), last_paragraph


def test_runner_help_shows_the_options_early_and_then_what_it_replaces(
    capsys):
  # Issue 46, item 9: sync-replicas-run's help had 30 lines of prose before
  # its options. The options and the example now follow the one-paragraph
  # summary; what the patch replaces (the text docs/patch.md shows) after.
  assert importlib.import_module("sync_replicas.patch.__main__").main(
      ["--help"]) == 0
  text = capsys.readouterr().out
  lines = text.splitlines()
  assert lines.index("options:") < 15, "\n".join(lines[:20])
  assert text.index("example:") < text.index(patch.SCOPE), text
  assert text.endswith(patch.SCOPE), text


def test_demo_help_is_its_own_and_starts_nothing():
  # Issue 46's walk through README: ./tools/demo --help went to the example
  # under the launcher, a cluster of four tasks that printed the example's
  # help four times (64 s at load 30). It now prints its own help at once
  # and points to the example's.
  start = time.monotonic()
  proc = subprocess.Popen([str(support.TOOLS / "demo"), "--steps", "5",
                           "--help"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  try:
    out, err = proc.communicate(timeout=USAGE_ERROR_SECS)
  finally:
    support.kill_group(proc)
  assert proc.returncode == 0, (out, err)
  assert out.startswith("usage: ./tools/demo [EXAMPLE OPTIONS...]"), out
  assert "python -m examples.digits --help" in out, out
  assert not err, err  # no venv check, no launch
  assert time.monotonic() - start < USAGE_ERROR_SECS


#: (command line, what the one line of error says): each a usage error.
USAGE_ERRORS = [
    (["-m", "sync_replicas.cli.status", "--manifest", "no/such/dir", "--ps",
      "127.0.0.1:2222"], "No sync manifest at no/such/dir", 2),
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

# The child reports whether TensorFlow was imported once the tool returned,
# or as it ends its process on the spot (sync-replicas-status's console()
# does, after flushing, to skip TensorFlow's teardown).
_CHILD = """
import os, runpy, sys
sys.argv = sys.argv[1:]
module = sys.argv.pop(1)

def report():
  sys.stdout.write("tensorflow imported: %s\\n" % ("tensorflow" in sys.modules))
  sys.stdout.write("keras imported: %s\\n" % bool(sys.modules.get("keras")))
  sys.stdout.flush()

exit_now = os._exit
def _exit(code):
  report()
  exit_now(code)
os._exit = _exit
try:
  runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as e:
  code = e.code
else:
  code = 0
report()
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


# ------------------------------------- sync-replicas-status on an ended job


def _manifest_of_an_ended_job(tmp_path, **fields):
  """A sync manifest whose writer (a chief, here a child that ran) has
  exited, with ``fields`` on top; the tool stops before reading the rest."""
  child = subprocess.Popen([sys.executable, "-c", "import time; "
                            "time.sleep(60)"])
  try:
    writer = _process.identity()
    writer.update(pid=child.pid, started=_process.started(child.pid))
  finally:
    child.kill()
    child.wait(timeout=30)
  manifest = {"format": "sync_replicas.manifest/1", "writer": writer,
              "network_namespace": os.stat("/proc/self/ns/net").st_ino,
              **fields}
  (tmp_path / "sync_manifest.json").write_text(json.dumps(manifest))
  return writer["pid"]


def _status_child(tmp_path, port, env=None):
  start = time.monotonic()
  proc = subprocess.run(
      [sys.executable, "-c", _CHILD, "-c", "sync_replicas.cli.status",
       "--manifest", str(tmp_path), "--ps", "127.0.0.1:%d" % port],
      # Not the checkout: `-c` puts the working directory first on sys.path,
      # and tools/knockout's patched copy must come first.
      cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
  return proc, time.monotonic() - start


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_status_says_at_once_that_the_job_has_ended(tmp_path):
  # Issue 46, item 2: run after the demo ended, the status tool waited out
  # its timeout, then pointed to `--enter PID`, which said "no process".
  # The manifest names its chief: gone, with nothing on the port, the job
  # has ended, said in one line before TensorFlow's import.
  pid = _manifest_of_an_ended_job(tmp_path)
  port = _ports.free_ports(1)[0]
  proc, secs = _status_child(tmp_path, port)
  assert proc.returncode == 1, proc
  assert proc.stderr == (
      "sync-replicas-status: the job that wrote %s has ended: its chief "
      "(pid %d) has exited, and nothing listens on port %d any more. Its "
      "sync state ended with it; its checkpoints, logs and timeline (if it "
      "recorded one: sync-replicas-timeline DIR) remain.\n" % (
          tmp_path / "sync_manifest.json", pid, port)), proc.stderr
  assert "tensorflow imported: False" in proc.stdout, proc.stdout
  assert secs < USAGE_ERROR_SECS, "took %.1f s" % secs


def test_status_says_to_run_again_when_the_manifest_is_not_written_yet(
    tmp_path):
  # README's walk: the demo prints the status command before its launch,
  # and run at once it found no manifest (the chief writes it once its
  # graph is built) and said to pass another file.
  proc, secs = _status_child(tmp_path, _ports.free_ports(1)[0])
  assert proc.returncode == 2, proc
  assert proc.stderr.count("\n") == 1, proc.stderr
  assert proc.stderr.startswith("sync-replicas-status: No sync manifest at "
                                "%s." % (tmp_path / "sync_manifest.json")), (
                                    proc.stderr)
  assert "for a job that is starting, run this again in a few seconds" in (
      proc.stderr), proc.stderr
  assert "tensorflow imported: False" in proc.stdout, proc.stdout
  assert secs < USAGE_ERROR_SECS, "took %.1f s" % secs


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_status_reads_on_when_the_chief_is_gone_but_the_port_serves(
    tmp_path):
  # A chief that died while its ps serves on: the sync state is still
  # there to read, so the tool does not call the job ended.
  _manifest_of_an_ended_job(tmp_path)
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    # With Keras importable, as in a user's venv (the tests' children hide
    # it): the tool, a reader, keeps TensorFlow from importing it. Run
    # while README's demo trained, the tool had spent 48 of the 110 s of
    # TensorFlow's import in Keras and the scikit-learn and SciPy it pulls.
    proc, _ = _status_child(tmp_path, server.getsockname()[1],
                            env=support.with_keras())
  # It reads on, with TensorFlow: this manifest has nothing else to read,
  # and says so in one line.
  assert "has ended" not in proc.stderr, proc.stderr
  assert "tensorflow imported: True" in proc.stdout, proc.stdout
  assert "keras imported: False" in proc.stdout, proc.stdout
  assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
  assert "is a sync manifest without replicas_to_aggregate" in proc.stderr, (
      proc.stderr)
