"""Smoke runs of every example as a real cluster of processes, tiny steps.

Each example trains between-graph (ps and replicas as separate processes on
127.0.0.1) for a few dozen steps and must learn: accuracy clearly above
chance. digits, sparse_clicks and digits_estimator run under tools/launch
(TF_CONFIG); digits_supervisor is started by hand with the TF1 flags. Every
wait is bounded and every process group is killed in a finally block.
"""

import importlib.metadata
import io
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import tensorflow as tf

from examples import _digits
from examples import _task
from examples import digits_estimator
import sync_replicas
from sync_replicas import cluster as cluster_lib
from sync_replicas.cli import status as status_tool
import support
from sync_replicas import timeline

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "tools" / "launch"
#: Where the examples this test imported live: the checkout, or
#: tools/knockout's patched copy, which the tasks (python -m from there)
#: must then run too.
IMPORTED_ROOT = pathlib.Path(_task.__file__).resolve().parents[1]
HAS_ESTIMATOR = digits_estimator.estimator_module() is not None
_FINAL = re.compile(r"final test accuracy (\d\.\d+)")


def _env():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
  env.pop("TF_CONFIG", None)
  env.pop("SYNC_REPLICAS_BACKUPS", None)
  return env



def _launch(cluster_args, module, *argv, timeout=150, env=None):
  """Runs ``module`` under tools/launch; returns its output, checks exit 0."""
  cmd = [sys.executable, str(LAUNCH), *cluster_args, "--timeout",
         str(timeout), "--", sys.executable, "-m", module, *argv]
  proc = subprocess.Popen(cmd, cwd=IMPORTED_ROOT, env=env or _env(),
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout + 30)
  finally:
    support.kill_group(proc)
  out = out.decode(errors="replace")
  assert proc.returncode == 0, "launcher exited %d:\n%s" % (
      proc.returncode, out[-6000:])
  return out


def _final_accuracy(out):
  found = _FINAL.findall(out)
  assert len(found) == 1, "expected one final accuracy line:\n" + out[-6000:]
  return float(found[0])


def _demo_env(**extra):
  env = dict(_env(), **extra)
  env.pop("SYNC_REPLICAS_UNCONFINED", None)
  # The demo's `python` is the one running these tests.
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
  return env


#: The demo's run (tools/_demo: ./tools/demo once its venv exists), with
#: the digits test's first run's arguments. Slowed steps (a 100 ms median
#: delay, sleeping) keep the job training from the chief's first progress
#: line (step 20) until the demo test holds the chief: 80 steps, about 8 s,
#: where the hold follows the line at once; once held, the hold keeps it
#: training, so the steps are not what must outlast the status read.
DEMO_ARGS = ("--steps", "100", "--log_every", "20", "--checkpoint_every",
             "50", "--slow_replica", "2", "--slow_ms", "30", "--delay_ms",
             "100")


@pytest.fixture(scope="module", name="demo")
def _demo(tmp_path_factory):
  """One run of the demo's cluster, confined, which two tests read: the
  demo test (its confinement, and its printed status command, run as
  printed while it trains and once it has ended) and the digits test (what
  the example learned and wrote, then its resumes in the same log
  directory). One run instead of two saves a cluster of four TensorFlow
  processes (about 35 CPU-seconds).

  The status command runs during the run and at once after its end, before
  the digits test's resumes rewrite the manifest: everything is gathered
  here and asserted by the tests. Where something outside listens on 2222,
  the demo's port, the demo still trains in its namespace (for the digits
  test), but the command it prints could reach that other server: it is
  not run, and the demo test skips saying so.
  """
  busy = support.listens(2222)
  logdir = tmp_path_factory.mktemp("demo")
  proc = subprocess.Popen(
      [str(ROOT / "tools" / "_demo"), *DEMO_ARGS], cwd=ROOT,
      env=_demo_env(SYNC_REPLICAS_DEMO_LOGDIR=str(logdir)),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
  try:
    output = support.OutputLines(proc.stdout)
    command = output.find(r"\[demo\] its sync state, from another terminal "
                          r"in \S+ while it trains \(from the chief's first "
                          r"step line on\): (.*)\n",
                          "the demo's status line", timeout=30).group(1)
    argv = shlex.split(command)
    if busy:
      proc.wait(timeout=300)
      return types.SimpleNamespace(
          logdir=logdir, returncode=proc.returncode, text=output.finish(),
          busy=busy)
    support.wait_until(
        lambda: (logdir / "sync_manifest.json").exists() or (
            proc.poll() is not None),
        timeout=180, what="the chief's sync_manifest.json", interval=0.2)
    # Something of this machine's may have started on 2222 since (README's
    # program, run by hand, listens there): then a connection proves
    # nothing of the demo's.
    busy = support.listens(2222)
    connected_from_outside = not busy and support.connects(2222)
    # The chief is held while tools/status runs, so that the job is still
    # training when it reads, however long its TensorFlow import takes on a
    # loaded machine (CI once saw the job end in the middle of the read).
    # The ps serves the read; the other workers wait for tokens. Held once
    # it trains (its first progress line): the model is initialized then.
    # In turns of 15 s with 1 s to step between them: one 60 s stop broke
    # the chief's session (support.HOLD_TURN_SECS), and 1 s is about 10
    # steps.
    output.find(r"\[chief0\] .*step +\d+ +loss", "the chief's first "
                "progress line", timeout=180)
    # tools/launch starts each task as the leader of a process group.
    chief = int(output.find(r"\[launch\] started chief0 \(pid (\d+)\)",
                            "the chief's pid", timeout=1).group(1))
    held_at = time.monotonic()
    with support.held_in_turns(lambda signum: os.killpg(chief, signum)):
      training_when_held = proc.poll() is None
      # The printed command, run as printed from outside the namespace.
      inside = _run_bounded(argv).finish(240) if training_when_held else None
      still_training = proc.poll() is None
    held_secs = time.monotonic() - held_at
    proc.wait(timeout=300)
    # The same command once the demo has ended (issue 46, item 2: it timed
    # out, then sent the user to --enter PID, a dead end): it says so, at
    # once, without TensorFlow's import.
    after_start = time.monotonic()
    after = _run_bounded(argv).finish(60)
    after_secs = time.monotonic() - after_start
  finally:
    support.kill_group(proc)
  return types.SimpleNamespace(
      logdir=logdir, returncode=proc.returncode, text=output.finish(),
      busy=busy, pid=proc.pid, command=command, argv=argv,
      connected_from_outside=connected_from_outside,
      training_when_held=training_when_held, inside=inside,
      still_training=still_training, held_secs=held_secs, after=after,
      after_secs=after_secs)


def _own_lines(text):
  """The output's lines but for tracebacks' frames and code (indented)."""
  return "\n".join(line for line in text.splitlines()
                   if not re.match(r"(\[\w+\] )?\s", line))


def _run_bounded(argv):
  thread = support.BoundedThread(
      lambda: subprocess.run(argv, cwd=ROOT, env=_demo_env(),
                             capture_output=True, text=True, timeout=200),
      name="run-" + os.path.basename(argv[0]))
  thread.start()
  return thread


def _demo_story(demo):
  """How long the chief was held (in turns), every task's own lines, then
  the end of the output."""
  return "chief held %.1f s in turns of %.0f s\n%s\n...\n%s" % (
      demo.held_secs, support.HOLD_TURN_SECS, _own_lines(demo.text)[-6000:],
      demo.text[-3000:])


@pytest.mark.timeout(720)
@pytest.mark.newest_only(reason=(
    "examples.digits under the launcher (MonitoredTrainingSession, read by "
    "the status tool) trains under every version in test_hosts' "
    "test_training_on_hosts_survives_a_cut_link_and_is_read_by_status, "
    "backup replicas in this file's sparse_clicks and Estimator tests, a "
    "resume from a checkpoint in test_recovery's killed-chief test; what "
    "this test adds (the example's resume and nothing-to-train lines, its "
    "plot, its timeline's runs, one numbering) is the example's and the "
    "tools' own bookkeeping (56 CPU-seconds on 2.15)"))
def test_digits_learns_on_1_ps_and_3_replicas_with_a_backup(demo):
  # Its first run is the demo's (tools/_demo: tools/launch --ps 1 --workers
  # 3 --backup 1, confined, examples.digits with DEMO_ARGS), in its logdir.
  logdir = demo.logdir
  out = demo.text
  assert demo.returncode == 0, "launcher exited %d:\n%s" % (
      demo.returncode, out[-6000:])
  assert "resuming" not in out
  assert _final_accuracy(out) > 0.8, out[-4000:]  # chance: 0.1
  assert re.search(r"\[chief0\] step +\d+  loss \d\.\d+  test accuracy "
                   r"\d\.\d+  \d+\.\d steps/s", out), out[-4000:]
  # One numbering: each task names itself as its label and TF_CONFIG do.
  # worker1 (slowed) is one of three replicas of which updates need two, so
  # nobody waits for it: in CI (2.15) its TensorFlow import outlasted the
  # chief's 100 steps (4.8 s), and it rightly said there was nothing left
  # to train, then exited 0. Either way it names itself.
  late = ("[worker1] worker1: nothing to train, the global step is 100 and "
          "--steps 100" in out)
  assert "[worker0] worker0 done after " in out, out[-4000:]
  assert late or "[worker1] worker1 done after " in out, out[-4000:]
  assert "[launch] worker1 exited 0" in out, out[-4000:]
  assert (logdir / "checkpoint").is_file()
  assert (logdir / "sync_manifest.json").is_file()  # For tools/status.
  assert list(logdir.glob("model.ckpt-*.index"))
  assert list(logdir.glob("events.out.tfevents.*"))
  plot = logdir / "training.png"
  assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # The timeline every task wrote, merged now that all have ended, and the
  # chief said where it is. The slowed replica (worker1, replica 2) waits
  # 30 ms for each batch, between its runs: that much at least, whatever
  # the load (which replicas train most, and whose pushes are stale, is
  # timing: the chief may train alone before the others join). How many
  # runs it gets is timing too: with the backup nobody waits for it, and
  # on a loaded machine it once joined so late that training ended after
  # its first run, which leaves no time between runs to measure. Finding
  # the slow worker from a trace, every time, is test_timeline's cluster
  # test (no backup there, so every update waits for it).
  assert "timeline written to %s" % (logdir / "timeline") in out
  rows, _ = timeline.merge(str(logdir / "timeline"),
                        out=str(logdir / "trace.json"),
                        png=str(logdir / "last.png"))
  # A replica that found nothing to train writes no timeline.
  assert set(rows) == {"chief0", "worker0"} | (set() if late else {
      "worker1"}), rows
  if not late:
    assert rows["worker1"]["steps"] >= 1, rows
  if not late and rows["worker1"]["steps"] >= 2:
    assert rows["worker1"]["median_between_runs_ms"] >= 30.0, rows
  assert (logdir / "last.png").read_bytes()[:4] == b"\x89PNG"
  # The same command again (issue 38: it resumed silently, and its timeline
  # mixed with the first run's): it says it resumes, and from which step,
  # and the merge takes its own run only unless told otherwise. This run
  # also serves the one-numbering check (_check_one_numbering): without a
  # backup and with worker1 slowed by 1 s a batch, updates mostly wait for
  # it while this process's status tool reads the job (hence unconfined);
  # the others may push for it, stock's rule, so it can also start late.
  first = sum(r["steps"] for r in rows.values())
  again, read, cluster = _launch_read_by_status(
      ["--unconfined", "--ps", "1", "--workers", "3"], "examples.digits",
      "--steps", "140", "--log_every", "20", "--checkpoint_every", "50",
      "--logdir", str(logdir), "--no_plot", "--slow_replica", "2",
      "--slow_ms", "1000", "--timeline_dir", str(logdir / "timeline"),
      logdir=logdir)
  assert re.search(r"\[chief0\] resuming from step 1\d\d: %s holds an "
                   r"earlier run's checkpoint" % re.escape(str(logdir)),
                   again), again[-4000:]
  # TensorFlow's note about its own deprecated call, on a restore: dropped.
  assert "get_checkpoint_mtimes" not in again, again[-4000:]
  latest, left_out = timeline.merge(str(logdir / "timeline"))
  both, none_left = timeline.merge(str(logdir / "timeline"), all_runs=True)
  assert left_out >= first and none_left == 0, (left_out, first)
  assert sum(r["steps"] for r in both.values()) == (
      sum(r["steps"] for r in latest.values()) + first)
  _check_one_numbering(again, read, cluster, latest)
  # Once more, with nothing left to train (issue 46, item 8: it trained one
  # more step, then overwrote the plot and the timeline with that step's).
  # Every replica says so and trains nothing; the plot and the latest
  # timeline are the earlier runs'.
  plot_before = plot.read_bytes()
  step = int(tf.train.load_variable(
      tf.train.latest_checkpoint(str(logdir)), "global_step"))
  idle = _launch(["--ps", "1", "--workers", "3", "--backup", "1"],
                 "examples.digits", "--steps", str(step), "--logdir",
                 str(logdir), "--timeline_dir", str(logdir / "timeline"))
  assert re.search(r"\[chief0\] resuming from step %d: .* so nothing is "
                   r"trained" % step, idle), idle[-4000:]
  for name in ("chief0", "worker0", "worker1"):
    assert "[%s] %s: nothing to train, the global step is %d and --steps " \
        "%d" % (name, name, step, step) in idle, idle[-4000:]
  assert "final test accuracy" not in idle, idle[-4000:]
  assert plot.read_bytes() == plot_before
  assert int(tf.train.load_variable(
      tf.train.latest_checkpoint(str(logdir)), "global_step")) == step
  assert timeline.merge(str(logdir / "timeline"))[0] == latest


def _launch_read_by_status(cluster_args, module, *argv, logdir,
                           timeout=240):
  """Runs ``module`` under tools/launch (``cluster_args`` must make it
  unconfined) and reads the job with the status tool, in this process, until
  it answers with a replicas line; then waits for the launch to exit 0.

  Returns the launch's output, the replicas lines of that read and the
  launch's cluster. The job must still train when the manifest appears:
  slow one replica and give no backup, so updates wait for it.
  """
  cmd = [sys.executable, str(LAUNCH), *cluster_args, "--timeout",
         str(timeout), "--", sys.executable, "-m", module, *argv]
  proc = subprocess.Popen(cmd, cwd=IMPORTED_ROOT, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True)
  try:
    output = support.OutputLines(proc.stdout)
    cluster = json.loads(output.find(r"\[launch\] cluster (\{.*\})",
                                     "the launch's cluster line",
                                     timeout=60).group(1))
    read = []

    def replicas_line():
      # In this process (TensorFlow is loaded): the job is unconfined. An
      # earlier run's manifest names an ended job: the tool says so (exit
      # 1) until this run's chief writes its own.
      if not (logdir / "sync_manifest.json").is_file():
        return False
      out = io.StringIO()
      if status_tool.main(["--manifest", str(logdir), "--ps",
                           cluster["ps"][0]], out=out) != 0:
        return False
      read[:] = re.findall(r"replicas: workers' local steps: ([^;\n]*)",
                           out.getvalue())
      return bool(read)

    support.wait_until(replicas_line, timeout=180, interval=0.5,
                       what="a status read while an update waits")
    assert proc.wait(timeout=timeout) == 0, output.text()[-6000:]
  finally:
    support.kill_group(proc)
  return output.finish(), read, cluster


def _check_one_numbering(text, read, cluster, rows):
  """One numbering: with a ``chief`` job (whose records on the ps key the
  chief 0 and worker N as N + 1), the launcher's labels, the programs' own
  lines (``text``), the status tool's replicas line (``read``) and the
  timeline's ``rows`` all say chief0, worker0, worker1."""
  assert sorted(cluster) == ["chief", "ps", "worker"], cluster
  names = ["chief0", "worker0", "worker1"]
  # The status tool: every replica by the name of its launcher's label.
  # (Each "NAME STEP" or "NAME not started", as the read found it.)
  assert [entry.split()[0] for entry in read[0].split(", ")] == names, read
  for name in names:
    assert "\n[%s] " % name in text, text[-4000:]
  # A worker that started after the others had trained every step (stock's
  # tokens let the two replicas up push for a third: seen at load, worker1
  # slowed by its 1 s batches) names itself in its "nothing to train" line
  # and writes no timeline; one that trained, in its "done" line.
  late = [name for name in names[1:] if "[%s] %s: nothing to train, " % (
      name, name) in text]
  for name in names[1:]:
    assert name in late or "[%s] %s done after " % (name, name) in text, \
        text[-4000:]
  assert sorted(rows) == [n for n in names if n not in late], rows
  assert "key " not in read[0] and "worker key" not in text, text[-4000:]


@pytest.mark.timeout(420)
# Version-independent (tests/conftest.py), as test_confine: the launcher's
# confinement and the status tool's way into the launch import no
# TensorFlow; the demo's program trains under every version elsewhere (this
# file's other examples, test_hosts' digits), and the run it reads is the
# digits test's, itself left to the newest TensorFlow.
@pytest.mark.version_independent
def test_demo_trains_confined_and_its_printed_status_command_reads_it(demo):
  if demo.busy:
    pytest.skip("something on this machine listened on 2222, the demo's "
                "port, while the demo ran")
  # The plain command (issue 38: README's line failed during a confined
  # launch): the venv's status tool, which finds the launch by itself.
  argv = demo.argv
  assert os.path.basename(argv[0]) == "sync-replicas-status", demo.command
  assert os.path.samefile(ROOT / argv[0], pathlib.Path(
      sys.executable).parent / "sync-replicas-status"), demo.command
  assert argv[1:] == ["--manifest", str(demo.logdir), "--ps",
                      "127.0.0.1:2222"], demo.command
  assert not demo.connected_from_outside, ("the demo's ps accepted a "
                                           "connection from outside its "
                                           "namespace")
  assert demo.training_when_held, "the demo ended before its chief was held"
  after = demo.after
  assert after.returncode == 1, (after.stdout, after.stderr)
  assert after.stderr.startswith(
      "sync-replicas-status: the job that wrote %s has ended: " % (
          demo.logdir / "sync_manifest.json")), after.stderr
  assert demo.after_secs < 10, "took %.1f s: %s" % (demo.after_secs,
                                                    after.stderr)
  inside = demo.inside
  assert inside.returncode == 0, (inside.stdout, inside.stderr)
  assert re.search(r"global_step: \d+", inside.stdout), inside.stdout
  assert "hidden/weights" in inside.stdout and "/2 " in inside.stdout
  assert demo.still_training, "training ended before tools/status returned"
  assert ("sync-replicas-status: reading inside the network namespace of "
          "sync-replicas-launch %d, where the job runs\n" % demo.pid
          ) == inside.stderr, inside.stderr
  story = _demo_story(demo)
  assert demo.returncode == 0, story
  assert re.search(r"\[chief0\] final test accuracy 0\.\d+ .* at step 100",
                   demo.text), story
  # Quiet as stock or quieter (issue 16): the demo once printed TensorFlow's
  # QueueRunner deprecation in every process, from our runner's constructor.
  package = str(ROOT / "sync_replicas") + os.sep
  ours = [line for line in demo.text.splitlines()
          if "deprecated" in line and package in line]
  assert not ours, "\n".join(ours)


@pytest.mark.timeout(240)
def test_supervisor_flow_learns_with_tf1_flags(tmp_path):
  # Its tasks are repeat runs of `python -m examples.MODULE` (the local
  # demo's test below is that command's fresh proof): forked.
  ps, chief, worker = ["127.0.0.1:%d" % p for p in cluster_lib.free_ports(3)]
  common = ["--ps_hosts", ps, "--worker_hosts", "%s,%s" % (chief, worker)]
  logs = tmp_path / "output"
  logs.mkdir()
  procs = {}
  try:
    for job, index in (("ps", 0), ("worker", 0), ("worker", 1)):
      with open(logs / ("%s%d.log" % (job, index)), "wb") as out:
        procs[job, index] = support.start_repeat_run(
            [sys.executable, "-m", "examples.digits_supervisor", "--job_name",
             job, "--task_index", str(index), "--steps", "100", "--logdir",
             str(tmp_path), *common],
            cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    outs = {}
    for job, index in (("worker", 0), ("worker", 1)):
      procs[job, index].wait(timeout=180)
      outs[job, index] = (logs / ("%s%d.log" % (job, index))).read_text(
          errors="replace")
      assert procs[job, index].returncode == 0, outs[job, index][-6000:]
  finally:
    for proc in procs.values():
      support.kill_group(proc)
  assert _final_accuracy(outs["worker", 0]) > 0.8, outs["worker", 0][-4000:]
  assert "worker1 done" in outs["worker", 1]
  assert list(tmp_path.glob("model.ckpt-*.index"))
  assert (tmp_path / "sync_manifest.json").is_file()


@pytest.mark.timeout(240)
def test_sparse_clicks_learns_through_sparse_accumulators(tmp_path):
  out = _launch(["--ps", "2", "--workers", "2", "--backup", "1"],
                "examples.sparse_clicks", "--steps", "100", "--log_every",
                "50", "--logdir", str(tmp_path))
  assert (tmp_path / "sync_manifest.json").is_file()
  assert "[chief0] accumulators: 4 SparseConditionalAccumulator" in out
  match = re.search(r"final test accuracy (\d\.\d+) .*majority class "
                    r"(\d\.\d+)", out)
  assert match, out[-4000:]
  accuracy, majority = map(float, match.groups())
  assert accuracy > majority + 0.15, out[-4000:]


@pytest.mark.timeout(240)
@pytest.mark.skipif(not HAS_ESTIMATOR, reason=(
    "TensorFlow %s has no tf.compat.v1.estimator (removed in 2.16); run "
    "with SYNC_REPLICAS_TF='tensorflow-cpu==2.15.*' SYNC_REPLICAS_VENV="
    ".venv-215" % tf.__version__))
def test_estimator_learns_with_the_hook_in_train(tmp_path):
  # The Estimator imports Keras, which the tests' children lack otherwise.
  out = _launch(["--ps", "1", "--workers", "2", "--backup", "1"],
                "examples.digits_estimator", "--steps", "100", "--logdir",
                str(tmp_path), env=support.with_keras(_env()))
  assert _final_accuracy(out) > 0.8, out[-4000:]
  assert "[worker0] worker0 done" in out
  assert (tmp_path / "sync_manifest.json").is_file()


@pytest.mark.skipif(HAS_ESTIMATOR, reason="this TensorFlow ships Estimator")
def test_estimator_example_explains_a_missing_estimator(monkeypatch):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  with pytest.raises(SystemExit, match=r"needs tf\.compat\.v1\.estimator, "
                     r"which TensorFlow .* does not ship.*2\.15"):
    digits_estimator.main([])


@pytest.mark.parametrize("module", [
    "digits", "digits_supervisor", "digits_estimator", "sparse_clicks"])
def test_example_parses_no_flags_at_import(module, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["pytest", "--no-such-flag"])
  mod = __import__("examples." + module, fromlist=["main"])
  assert callable(mod.main)
  assert "# sync_replicas:" in pathlib.Path(mod.__file__).read_text()


def test_digits_are_sklearns_own_bit_for_bit_without_importing_it(
    tmp_path, monkeypatch):
  """examples/_digits reads scikit-learn's bundled file itself, with no
  ``import sklearn`` (the suite hides it: tools/_run_tests.py). Its arrays
  must be exactly those of sklearn.datasets.load_digits, run here in a child
  process that imports the real scikit-learn."""
  reference = tmp_path / "sklearn_digits.npz"
  code = ("import sys\n"
          "import numpy as np\n"
          "import sklearn\n"
          "from sklearn import datasets\n"
          "data, target = datasets.load_digits(return_X_y=True)\n"
          "np.savez(sys.argv[1], data=data, target=target)\n"
          "print(sklearn.__file__)\n")
  proc = subprocess.run([sys.executable, "-c", code, str(reference)],
                        env=support.without_hidden(), capture_output=True,
                        text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  want = np.load(reference)
  # The same installation's file as sklearn's own loader read.
  sklearn_dir = pathlib.Path(proc.stdout.strip().splitlines()[-1]).parent
  assert pathlib.Path(_digits.digits_file()).resolve() == (
      sklearn_dir / "datasets" / "data" / "digits.csv.gz").resolve()

  monkeypatch.setitem(sys.modules, "sklearn", None)  # Any import now fails.
  data, target = _digits.load_digits()
  for got, expected in ((data, want["data"]), (target, want["target"])):
    assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
    assert got.tobytes() == expected.tobytes()
  assert data.shape == (1797, 64) and sorted(set(target)) == list(range(10))
  # load(), the examples' split, is what it was when it called sklearn.
  ours = _digits.load(replica_index=1, num_replicas=3)
  monkeypatch.setattr(_digits, "load_digits",
                      lambda: (want["data"], want["target"]))
  theirs = _digits.load(replica_index=1, num_replicas=3)
  for got, expected in zip(ours, theirs, strict=True):
    assert got.dtype == expected.dtype and np.array_equal(got, expected)


def test_digits_without_scikit_learn_say_how_to_install_it(monkeypatch):
  def missing(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "distribution", missing)
  with pytest.raises(SystemExit, match=r"need scikit-learn .*pip install "
                     r"scikit-learn"):
    _digits.load()


def _args(argv=()):
  import argparse  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser()
  _task.add_cluster_flags(parser)
  return parser.parse_args(list(argv))


def test_tf_config_with_a_chief_job_makes_it_replica_0():
  tf_config = ('{"cluster": {"chief": ["h:1"], "worker": ["h:2", "h:3"], '
               '"ps": ["h:4"]}, "task": {"type": "worker", "index": 1}}')
  task = _task.resolve(_args(["--backups", "1"]),
                       environ={"TF_CONFIG": tf_config})
  assert (task.job_name, task.task_index, task.replica_index,
          task.num_replicas, task.is_chief) == ("worker", 1, 2, 3, False)
  chief = _task.resolve(_args(), environ={
      "TF_CONFIG": tf_config.replace('"worker", "index": 1',
                                     '"chief", "index": 0')})
  assert chief.is_chief and chief.replica_index == 0


def test_flags_default_to_loopback_and_worker_0_is_chief():
  task = _task.resolve(_args(["--job_name", "worker", "--task_index", "0"]),
                       environ={})
  assert task.is_chief and task.num_replicas == 3
  hosts = task.cluster.as_dict()
  assert all(h.startswith("127.0.0.1:") for j in hosts.values() for h in j)


@pytest.mark.parametrize("argv,environ,message", [
    ([], {}, "No cluster given"),
    (["--job_name", "worker", "--task_index", "0"],
     {"TF_CONFIG": '{"cluster": {}, "task": {}}'}, "TF_CONFIG is set, and so "
     "are --job_name, --task_index"),
    ([], {"TF_CONFIG": "not json"}, "TF_CONFIG must be JSON like"),
    (["--job_name", "worker", "--task_index", "5"], {}, "worker:5"),
    (["--job_name", "worker", "--task_index", "0", "--backups", "3"], {},
     r"--backups must be in \[0, 3\) for 3 replicas, got 3"),
], ids=["nothing", "both", "bad-json", "bad-index", "too-many-backups"])
def test_bad_cluster_settings_say_how_to_fix_them(argv, environ, message):
  with pytest.raises(SystemExit, match=message):
    _task.resolve(_args(argv), environ=environ)


@pytest.mark.timeout(400)
def test_wait_for_chief_survives_a_ps_restart(tmp_path, monkeypatch):
  """Found by tools/soak (issue 20): a worker started while a ps restarted
  died with AbortedError ("Session handle is not found") in this wait."""
  ports = cluster_lib.free_ports(2)
  cluster = {"ps": ["127.0.0.1:%d" % ports[0]],
             "worker": ["127.0.0.1:%d" % ports[1]]}
  env = dict(os.environ, PYTHONPATH=support.pythonpath(ROOT))

  def start_ps():
    return support.start_crash_task_ps(cluster, env)

  ps = start_ps()
  try:
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster),
                                  job_name="worker", task_index=0)
    with tf.Graph().as_default() as graph:
      with tf.compat.v1.device("/job:ps/task:0"):
        var = tf.compat.v1.get_variable("v", [],
                                        initializer=tf.ones_initializer())
      uninitialized = tf.compat.v1.report_uninitialized_variables()
      config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=5_000)

      polled = threading.Event()
      session_run = tf.compat.v1.Session.run

      def noting_run(session, fetches, *args, **kwargs):
        result = session_run(session, fetches, *args, **kwargs)
        if (fetches is uninitialized
            and threading.current_thread().name == "wait_for_chief"):
          polled.set()
        return result

      monkeypatch.setattr(tf.compat.v1.Session, "run", noting_run)

      def wait():
        with graph.as_default():  # A thread starts with the global graph.
          _task.wait_for_chief(server.target, uninitialized, config,
                               timeout=300.0)

      waiter = support.BoundedThread(wait, name="wait_for_chief")
      # The waiter's session must exist on the ps before it restarts: one
      # poll of it answered by the first ps.
      support.wait_until(
          lambda: _ran(server.target, uninitialized, config), timeout=150,
          what="the ps serving", interval=0.2)
      waiter.start()
      assert polled.wait(60), "the waiter's first poll did not return"
      support.kill_group(ps)
      ps = start_ps()
      support.wait_until(
          lambda: _ran(server.target, var.initializer, config), timeout=150,
          what="the restarted ps initialized", interval=0.5)
      waiter.finish(timeout=60)  # Re-raises what the wait raised.
  finally:
    support.kill_group(ps)


def test_wait_for_chief_gives_up_saying_what_it_last_saw(caplog):
  """A ps that serves, a variable nobody initializes: the wait logs that it
  still waits, then gives up naming what its last poll saw."""
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  with tf.Graph().as_default():
    with tf.compat.v1.device("/job:ps/task:0"):
      tf.compat.v1.get_variable("never", [], initializer=tf.ones_initializer())
    uninitialized = tf.compat.v1.report_uninitialized_variables()
    with caplog.at_level("INFO", logger="sync_replicas.ready"), pytest.raises(
        SystemExit) as gave_up, pytest.MonkeyPatch.context() as patch:
      patch.setattr(_task, "WAIT_LOG_SECS", 0.5)
      _task.wait_for_chief(cluster.worker_targets[0], uninitialized,
                           support.session_config(), timeout=1.5)
  message = str(gave_up.value)
  assert ("did not initialize the model within 2 s (last poll: 1 "
          "variable(s) not initialized)") in message, message
  assert any("still waiting for the chief" in r.getMessage()
             for r in caplog.records), caplog.text


def _ran(target, fetch, config):
  """Runs ``fetch`` in a new session; False while the ps cannot serve it."""
  try:
    with tf.compat.v1.Session(target, config=config) as sess:
      sess.run(fetch)
    return True
  except (tf.errors.UnavailableError, tf.errors.AbortedError,
          tf.errors.DeadlineExceededError):
    return False


@pytest.mark.timeout(300)
def test_local_demo_trains_and_its_status_hint_says_when_the_job_ended(
    tmp_path):
  # Issue 46, item 2: the demos' status hints were a dead end once the job
  # had ended. local_demo prints its hint first; run after the end, as
  # printed, it says at once that the job has ended.
  logdir = tmp_path / "local_demo"
  done = subprocess.run(
      [sys.executable, "-m", "examples.local_demo", "--steps", "40",
       "--log-every", "10",
       "--logdir", str(logdir)], cwd=ROOT, env=_env(), capture_output=True,
      text=True, timeout=240)
  assert done.returncode == 0, done.stderr[-4000:]
  hint = re.search(r"^its sync state, from another terminal while it trains: "
                   r"(.*)$", done.stderr, re.M)
  assert hint and hint.start() < done.stderr.find("step "), done.stderr
  argv = hint.group(1).split()
  assert os.path.basename(argv[0]) == "sync-replicas-status", argv
  assert argv[1:3] == ["--manifest", str(logdir)], argv
  start = time.monotonic()
  after = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=60)
  secs = time.monotonic() - start
  assert after.returncode == 1, after
  assert after.stderr.startswith(
      "sync-replicas-status: the job that wrote %s has ended: its chief "
      "(pid " % (logdir / "sync_manifest.json")), after.stderr
  assert secs < 10, "took %.1f s" % secs
