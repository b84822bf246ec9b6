"""sync-replicas-launch (sync_replicas.cli.launch): exit codes, log prefixes, and no process left behind.

The tasks are tiny Python programs (no TensorFlow) whose behaviour each test
picks per task, so every run takes a second or two. Each task writes its own
pid, and the pid of any child it starts, to a file, so that the tests can
check afterwards that none of them is still alive.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

import support
import sync_replicas

# Version-independent (tests/conftest.py): the launcher imports no
# TensorFlow and these tasks are tiny Python programs: CI runs this file
# under its newest TensorFlow only.
pytestmark = pytest.mark.version_independent

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The launcher as ``python -m`` runs it (tools/launch is a wrapper of it;
#: tests/test_confine.py runs that one).
LAUNCH = ["-m", "sync_replicas.cli.launch"]

# argv: piddir, then "name=behaviour" pairs; a task without one exits 0.
# Behaviours: exit:N (after 0.3 s), late (exits 0 0.3 s after the launcher
# has reaped every replica), forever, forever-child (also starts a child in its process
# group), stubborn (ignores SIGTERM).
_TASK = r"""
import json, os, signal, subprocess, sys, time
cfg = json.loads(os.environ["TF_CONFIG"])
name = "%s%d" % (cfg["task"]["type"], cfg["task"]["index"])
piddir = sys.argv[1]
plan = dict(a.split("=", 1) for a in sys.argv[2:])
what = plan.get(name, "exit:0")
pids = [os.getpid()]
if what == "forever-child":
  pids.append(subprocess.Popen([sys.executable, "-c",
                                "import time; time.sleep(600)"]).pid)
if what == "stubborn":
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("task %s backups=%s cluster=%s" % (
    name, os.environ.get("SYNC_REPLICAS_BACKUPS"),
    sorted(cfg["cluster"])), flush=True)
with open(os.path.join(piddir, name + ".pid"), "w") as f:
  f.write(" ".join(map(str, pids)))
if what.startswith("exit:"):
  time.sleep(0.3)
  sys.exit(int(what[5:]))
def gone(task):
  try:
    with open(os.path.join(piddir, task + ".pid")) as f:
      os.kill(int(f.read().split()[0]), 0)
  except ProcessLookupError:
    return True  # It ran, and the launcher has reaped it.
  except (OSError, ValueError, IndexError):
    pass  # Not started, or its file half written.
  return False
if what == "late":
  replicas = ["chief0"] + ["worker%d" % i
                           for i in range(len(cfg["cluster"].get("worker", [])))]
  end = time.time() + 30
  while not all(gone(r) for r in replicas) and time.time() < end:
    time.sleep(0.05)
  time.sleep(0.3)
  sys.exit(0)
time.sleep(600)
"""


def _launch(tmp_path, plan, *launch_args, timeout=60):
  """Runs the launcher to its end; returns (exit code, output)."""
  cmd = [sys.executable, *LAUNCH, *launch_args, "--",
         sys.executable, "-c", _TASK, str(tmp_path)] + [
             "%s=%s" % kv for kv in plan.items()]
  # From tmp_path, with the package this test imported first on the path:
  # tools/knockout's patched copy, when it runs these tests (from the
  # checkout, python -m would import the checkout's).
  env = dict(os.environ, PYTHONPATH=support.pythonpath(
      pathlib.Path(sync_replicas.__file__).resolve().parents[1]))
  proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode()
  finally:
    support.kill_group(proc)



def _task_pids(tmp_path):
  pids = {}
  for f in tmp_path.glob("*.pid"):
    pids[f.stem] = [int(p) for p in f.read_text().split()]
  return pids


def _assert_none_left(tmp_path, expected_tasks):
  pids = _task_pids(tmp_path)
  assert sorted(pids) == sorted(expected_tasks), pids
  flat = [p for group in pids.values() for p in group]
  support.wait_until(lambda: not any(support.pid_runs(p) for p in flat), timeout=5,
                     what="no task process alive of %s" % pids)


@pytest.mark.timeout(60)
def test_success_stops_ps_and_exits_zero(tmp_path):
  code, out = _launch(tmp_path, {"ps0": "stubborn"},
                      "--ps", "1", "--workers", "3", "--backup", "1",
                      "--grace", "1")
  assert code == 0, out
  assert "every replica finished" in out
  # Every task's lines carry its name; each got the backups and a cluster
  # with chief, worker and ps jobs.
  for name in ("ps0", "chief0", "worker0", "worker1"):
    assert ("[%s] task %s backups=1 cluster=['chief', 'ps', 'worker']"
            % (name, name)) in out, out
  assert "ps0 ignored SIGTERM" in out
  # Each ps's end is reported: this one was stopped, as it serves forever.
  assert "[launch] every replica finished: stopping ps0, which serves until " \
      "stopped" in out, out
  assert "[launch] ps0 stopped (signal SIGKILL)" in out, out
  _assert_none_left(tmp_path, ["ps0", "chief0", "worker0", "worker1"])


@pytest.mark.timeout(60)
def test_a_ps_that_ends_by_itself_is_reported_not_stopped(tmp_path):
  # README's program: its ps exits 0 once every replica is done. The
  # launcher lets it, and says so, instead of stopping it.
  code, out = _launch(tmp_path, {"ps0": "late", "ps1": "forever"},
                      "--ps", "2", "--workers", "2")
  assert code == 0, out
  assert "[launch] ps0 exited 0" in out, out
  assert "[launch] every replica finished: stopping ps1, which serves " \
      "until stopped" in out, out
  assert "[launch] ps1 stopped (signal SIGTERM)" in out, out
  assert "ps0 stopped" not in out, out
  _assert_none_left(tmp_path, ["ps0", "ps1", "chief0", "worker0"])


@pytest.mark.timeout(60)
def test_failing_task_stops_all_and_exits_with_its_code(tmp_path):
  code, out = _launch(
      tmp_path,
      {"ps0": "stubborn", "chief0": "forever-child", "worker0": "exit:3",
       "worker1": "forever"},
      "--ps", "1", "--workers", "3", "--grace", "1")
  assert code == 3, out
  assert "worker0 failed with exit code 3" in out
  _assert_none_left(tmp_path, ["ps0", "chief0", "worker0", "worker1"])


@pytest.mark.timeout(60)
def test_timeout_stops_all_and_exits_124(tmp_path):
  code, out = _launch(tmp_path, {"ps0": "forever", "chief0": "forever-child",
                                 "worker0": "forever"},
                      "--ps", "1", "--workers", "2", "--timeout", "3",
                      "--grace", "1")
  assert code == 124, out
  assert "timed out after 3 s" in out
  _assert_none_left(tmp_path, ["ps0", "chief0", "worker0"])


@pytest.mark.timeout(60)
def test_ctrl_c_stops_all_and_exits_130(tmp_path):
  cmd = [sys.executable, *LAUNCH, "--ps", "1", "--workers", "2",
         "--grace", "1", "--", sys.executable, "-c", _TASK, str(tmp_path),
         "ps0=forever", "chief0=forever-child", "worker0=stubborn"]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True)
  try:
    support.wait_until(lambda: len(_task_pids(tmp_path)) == 3, timeout=30,
                       what="3 tasks started")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
  finally:
    support.kill_group(proc)
  assert proc.returncode == 130, out.decode()
  assert "interrupted: stopping every task" in out.decode()
  assert "Traceback" not in out.decode(), out.decode()
  _assert_none_left(tmp_path, ["ps0", "chief0", "worker0"])


@pytest.mark.timeout(30)
def test_missing_program_exits_127(tmp_path):
  proc = subprocess.run(
      [sys.executable, *LAUNCH, "--ps", "1", "--workers", "1", "--",
       str(tmp_path / "no-such-program")],
      cwd=ROOT, capture_output=True, text=True, timeout=20)
  assert proc.returncode == 127, proc.stdout + proc.stderr
  assert "could not start" in proc.stdout


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv,message", [
    (["--workers", "2", "--backup", "2", "--", "true"],
     "--backup must be in [0, --workers)"),
    (["--workers", "0", "--", "true"], "need --ps >= 0 and --workers >= 1"),
    (["--ps", "1"], "give the program to run after --"),
], ids=["backup-too-large", "no-workers", "no-command"])
def test_bad_arguments_are_refused(argv, message):
  proc = subprocess.run([sys.executable, *LAUNCH, *argv], cwd=ROOT,
                        capture_output=True, text=True, timeout=20)
  assert proc.returncode == 2
  assert message in proc.stderr


def test_tf_config_names_chief_workers_and_ps_on_loopback():
  from sync_replicas.cli import launch  # pylint: disable=g-import-not-at-top
  cluster = launch.cluster_spec(num_ps=2, num_workers=3)
  assert [len(cluster[j]) for j in ("chief", "worker", "ps")] == [1, 2, 2]
  addresses = [a for hosts in cluster.values() for a in hosts]
  assert all(a.startswith("127.0.0.1:") for a in addresses), cluster
  assert len(set(addresses)) == 5
  json.dumps(cluster)


def test_launcher_imports_no_tensorflow_and_starts_no_thread():
  """Issue 28: the launcher is a module of the package now, and must stay
  confinable (unshare refuses a process with threads, and TensorFlow's
  import starts some) and quick to start. The status tool answers --help
  without TensorFlow too.

  The OS threads are counted after the imports, which is what confinement
  needs. The status tool itself starts its Ctrl-C thread and joins it when
  it returns; after a join the OS may list the ended thread in
  /proc/self/task for a moment longer (CI saw "threads 2" once), so after
  --help the probe asks Python which of its threads are still alive, which
  the join decides."""
  probe = ("import os, sys, threading\n"
           "from sync_replicas.cli import launch, status\n"
           "print('threads', len(os.listdir('/proc/self/task')))\n"
           "try:\n"
           "  status.main(['--help'])\n"
           "except SystemExit:\n"
           "  pass\n"
           "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n"
           "print('alive', [t.name for t in threading.enumerate()])\n")
  done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 0, done.stderr
  lines = done.stdout.splitlines()
  assert lines[0] == "threads 1", done.stdout
  assert lines[-1] == "alive ['MainThread']", done.stdout
