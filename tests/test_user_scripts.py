"""Training scripts written as stock users write them, run as process clusters.

Each script under ``tests/user_scripts/`` drives the protocol one way a
public TF1 script does (docs/user_scripts.md names each pattern and the
public script it stands for; the project wrote every line). A script uses
stock's names only. Each test runs one script as a cluster of processes on
127.0.0.1 (1 ps, 2 workers) twice, the two clusters side by side: as written
(``python SCRIPT``: stock's class) and under ``python -m sync_replicas.patch
SCRIPT`` (ours), and checks what the docs promise:

* the class that ran is the one asked for (each script logs its optimizer's
  class, as a user might);
* both workers train, and every worker that ends ends at the target step,
  the same with stock's class and ours;
* the loss falls;
* with ours every process exits 0, the chief within PROMPT_SECS of the
  other worker. Stock's chief may wait out its grace period (120 s) where
  its runner is blocked at the stop, or not, as timing falls: it is killed
  once it logged its final step, and nothing about its exit is asserted.

How a cluster starts, without stopping any process: the ps, then worker 1,
then, once worker 1 logged its optimizer (TensorFlow imported, graph built),
the chief. Worker 1 then looks for the chief's init every second
(``recovery_wait_secs=1`` in the TF 0.12 recipe) or every 0.2 s (the
scripts' own poll in the others, as users write to skip the session
managers' 30 s naps), and every session sees only the ps and its own worker
(``device_filters``), so no session waits for another worker's server. The
chief could still train alone, and fast (about 170 steps/s on a quiet
machine, against about 0.7 s for worker 1 to join): its default init tokens
let one worker supply whole updates. So the scripts that make the init
tokens pass ``num_tokens=0`` (stock's API): the first update then waits for
a gradient from each worker, and both train from step 0 whatever the
timing. tf-slim makes its own init tokens (the default); there the chief's
longer start (its standard services, input queue runners, chief queue
runner, then the tokens) is what lets worker 1 join early (measured: from
step 0 in five runs of six, from step 50 of 200 in one on a machine loaded
six times over). Nothing can hang on it: every op is bounded, and the
token queue closes at the chief's stop (stock's runner and ours both close
it), which tf-slim takes as the end of training.

The ps serves until the harness kills it (``digits_cluster.serve``, a
bounded stand-in for stock scripts' ``server.join()``, which takes no
timeout), and every process dies with its Cluster, or at the latest after
TASK_LIFETIME_SECS (a fresh one) or with the pytest process (a forked one).

Fresh and forked: FRESH_SCRIPT's clusters start every task as a fresh
process (``python SCRIPT`` and ``python -m sync_replicas.patch SCRIPT``),
this file's proof of both entry points as a user starts them. The other
scripts are repeat runs of the same two commands: their tasks are forked
from the fork server (support.start_repeat_run), each still running the
unmodified script as ``__main__`` with the same argv, env and cwd, which
proves each script's sync behaviour at a fraction of the CPU.
"""

import math
import os
import pathlib
import re
import subprocess
import sys
import time
import warnings

import pytest
import tensorflow as tf

import support
from sync_replicas._ports import LOOPBACK
from sync_replicas._ports import free_ports

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "user_scripts"
#: Starting a process and importing TensorFlow takes seconds here; training
#: itself a few more. Every wait below is bounded by one of these.
START_SECS = 120
TRAIN_SECS = 150
#: Ours' chief exits within this of the other worker's exit.
PROMPT_SECS = 20
#: How long stock's chief may take to end after the other worker exited
#: before it is killed (see _let_stock_chief_finish).
LINGER_SECS = 10
#: No fresh task outlives this, even if pytest dies before the Cluster kills
#: it: the ps serves until it is killed. The longest test's timeout. (A
#: forked task cannot be wrapped in coreutils' timeout: it dies with the
#: pytest process at the latest, support.start_repeat_run.)
TASK_LIFETIME_SECS = 900
#: The script whose clusters start fresh processes, as a user does: the
#: MonitoredTrainingSession, the loop README's program and the examples
#: use (and the one most TF1 scripts use). The others are forked.
FRESH_SCRIPT = "monitored_session.py"
#: The global step at which every script stops.
TRAIN_STEPS = 200
#: The class each run must have used (each script logs ``optimizer:`` with
#: its optimizer's module and class).
CLASSES = {
    "stock": "tensorflow.python.training.sync_replicas_optimizer."
             "SyncReplicasOptimizer",
    "ours": "sync_replicas.optimizer.SyncReplicasOptimizer",
}
LN10 = math.log(10)


class Task:
  """One process of a cluster, its output in a file (no pipe to fill)."""

  def __init__(self, name, argv, *, impl, log_dir, keras=False,
               fresh=True):
    self.name = name
    self.log = log_dir / ("%s-%s.log" % (impl, name))
    # The project's root for ``examples._digits``; a script finds its
    # helper module next to it, as ``python SCRIPT`` and the patch's runner
    # both put the script's folder first on sys.path.
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=support.pythonpath(ROOT))
    if keras:  # The Estimator imports Keras, hidden from the tests' children.
      env = support.with_keras(env)
    with open(self.log, "wb") as out:
      if fresh:
        # coreutils' timeout stays in the task's process group: a kill of
        # the group (kill_group) reaches both; it exits with the task's code.
        self.proc = subprocess.Popen(
            ["timeout", "--signal=KILL", str(TASK_LIFETIME_SECS),
             sys.executable, *argv], cwd=ROOT, env=env, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
      else:
        self.proc = support.start_repeat_run(
            [sys.executable, *argv], cwd=ROOT, env=env, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    self.exited_at = None

  def text(self):
    return self.log.read_text(errors="replace")

  def poll(self):
    if self.exited_at is None and self.proc.poll() is not None:
      self.exited_at = time.monotonic()
    return self.proc.returncode

  def wait_for_line(self, pattern, *, timeout):
    """Waits until the task logged a line matching ``pattern``.

    Ends when the line appears, when the task exits (failing, with its log),
    or after ``timeout`` seconds.
    """
    support.wait_until(
        lambda: re.search(pattern, self.text(), re.M) or self.poll() is not None,
        timeout=timeout, what="%s to log %r" % (self.name, pattern),
        interval=0.2)
    assert re.search(pattern, self.text(), re.M), (
        "%s exited %s before logging %r:\n%s"
        % (self.name, self.poll(), pattern, self.text()[-4000:]))

  def kill(self):
    support.kill_group(self.proc)


class _ClusterTaskFailed(Exception):
  """A task of the cluster exited non-zero while others were waited for."""


class Cluster:
  """Processes started in order; every one is killed on exit, whatever happened."""

  def __init__(self, impl, log_dir, *, keras=False, fresh=True):
    self.impl, self.log_dir, self.tasks = impl, log_dir, {}
    self.keras, self.fresh = keras, fresh
    log_dir.mkdir(parents=True, exist_ok=True)

  def start(self, name, *argv):
    self.tasks[name] = Task(name, argv, impl=self.impl, log_dir=self.log_dir,
                             keras=self.keras, fresh=self.fresh)
    return self.tasks[name]

  def wait_exit(self, names, *, timeout):
    """Waits for every task in ``names`` to exit; returns their exit codes.

    Ends when they all exited, or fails after ``timeout`` seconds with the
    logs of those still running, or at once with every log when another
    task of the cluster failed (a chief that could not start leaves the
    others waiting for its init until the timeout).
    """
    tasks = [self.tasks[n] for n in names]

    def done():
      # Every task is polled, so each one's exit time is recorded when it
      # happens (to within the poll interval), not when it is first asked.
      codes = {n: t.poll() for n, t in self.tasks.items()}
      failed = {n: c for n, c in codes.items()
                if n not in names and c not in (None, 0)}
      if failed:
        raise _ClusterTaskFailed("%s failed while waiting for %s to exit" % (
            failed, ", ".join(names)))
      return all(codes[t.name] is not None for t in tasks)
    try:
      support.wait_until(done,
                         timeout=timeout, what="%s to exit" % ", ".join(names),
                         interval=0.2)
    except _ClusterTaskFailed as e:
      raise AssertionError("%s\n%s" % (e, self.logs())) from None
    except AssertionError as e:
      raise AssertionError("%s\n%s" % (e, self.logs(names))) from None
    return {t.name: t.poll() for t in tasks}

  def logs(self, names=None):
    return "\n".join("----- %s (%s):\n%s" % (t.name, t.poll(), t.text()[-3000:])
                     for n, t in self.tasks.items()
                     if names is None or n in names)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    for task in reversed(list(self.tasks.values())):
      task.kill()


def _hosts(count):
  return ",".join("%s:%d" % (LOOPBACK, p) for p in free_ports(count))


def _command(impl, script, *args):
  """How a user runs ``script``: as written, or under our patch."""
  path = str(SCRIPTS / script)
  if impl == "stock":
    return (path, *args)
  return ("-m", "sync_replicas.patch", path, *args)


#: A worker's line per training run (the Estimator's comes through
#: LoggingTensorHook, tf-slim's is its own) and its last line.
_STEP = re.compile(r"global step (\d+)[:,] loss =? ?([\d.]+)")
_FINAL = re.compile(r"final global step (\d+)")


class Run:
  """What one cluster run left in its workers' logs."""

  def __init__(self, impl, chief, worker1):
    self.impl = impl
    self.texts = {"worker0": chief.text(), "worker1": worker1.text()}

  def steps(self, name):
    """``(global step, loss)`` per training run of worker ``name``."""
    return [(int(s), float(l)) for s, l in _STEP.findall(self.texts[name])]

  def final(self, name):
    found = _FINAL.findall(self.texts[name])
    return int(found[-1]) if found else None

  def optimizer(self, name):
    found = re.findall(r"^optimizer: (\S+)", self.texts[name], re.M)
    return found[-1] if found else None


def _let_stock_chief_finish(chief):
  """Gives stock's chief LINGER_SECS to end on its own; the Cluster kills it.

  Stock's chief waits its grace period (120 s) at the stop when its runner
  is blocked then, which depends on timing here, as in any free-running
  script; the scripts that read the final step after the stop log it only
  after that wait. So the wait ends when the chief exited or logged its
  final step, or after LINGER_SECS, and nothing about it is asserted:
  test_shutdown, test_supervisor and test_tf_slim show stock's wait
  deterministically.
  """
  try:
    support.wait_until(
        lambda: chief.poll() is not None or _FINAL.search(chief.text()),
        timeout=LINGER_SECS, what="stock's chief to end", interval=0.2)
  except AssertionError:
    pass  # Still in its grace period, not asserted: the Cluster kills it.


#: The scripts whose processes need Keras (the Estimator imports it).
KERAS_SCRIPTS = {"estimator_hook.py"}


def _run_cluster(script, impl, tmp_path):
  """Runs ``script`` as 1 ps and 2 workers with ``impl``; returns a Run."""
  flags = ["--ps_hosts=" + _hosts(1), "--worker_hosts=" + _hosts(2),
           "--train_steps=%d" % TRAIN_STEPS,
           "--logdir=%s" % (tmp_path / "logdir")]
  with Cluster(impl, tmp_path, keras=script in KERAS_SCRIPTS,
               fresh=script == FRESH_SCRIPT) as cluster:
    ps = cluster.start("ps", *_command(impl, script, "--job_name=ps",
                                       "--task_index=0", *flags))
    worker1 = cluster.start("worker1", *_command(
        impl, script, "--job_name=worker", "--task_index=1", *flags))
    # Worker 1 is up: next it looks for the chief's init, every fraction of
    # a second, so it joins the chief's training from its first second.
    worker1.wait_for_line(r"^optimizer: ", timeout=START_SECS)
    chief = cluster.start("worker0", *_command(
        impl, script, "--job_name=worker", "--task_index=0", *flags))
    codes = cluster.wait_exit(["worker1"], timeout=START_SECS + TRAIN_SECS)
    assert codes == {"worker1": 0}, cluster.logs()
    if impl == "ours":
      codes = cluster.wait_exit(["worker0"], timeout=PROMPT_SECS)
      assert codes == {"worker0": 0}, cluster.logs()
      assert chief.exited_at - worker1.exited_at < PROMPT_SECS
    else:
      _let_stock_chief_finish(chief)
    # The ps serves until it is killed (by the Cluster's exit).
    assert ps.poll() is None, cluster.logs(["ps"])
    return Run(impl, chief, worker1)


def _check(run):
  """What each run must show, stock's class or ours."""
  for name in ("worker0", "worker1"):
    text = run.texts[name][-3000:]
    assert run.optimizer(name) == CLASSES[run.impl], (run.impl, name, text)
    # Both workers trained; each ended at the target step (stock's chief:
    # if it got to say so before it was killed).
    assert run.steps(name), (run.impl, name, text)
    if run.impl == "ours" or name == "worker1" or run.final(name) is not None:
      assert run.final(name) == TRAIN_STEPS, (run.impl, name, text)
  runs = sorted(run.steps("worker0") + run.steps("worker1"))
  # The model starts at zero, where every class is equally likely: the
  # first run of either worker, before any update, logs ln(10) exactly.
  assert any(abs(loss - LN10) < 1e-3 for _, loss in runs), (run.impl,
                                                            runs[:5])
  last = [loss for _, loss in runs[-10:]]
  assert sum(last) / len(last) < 0.5 * LN10, (run.impl, runs[-10:])


#: TensorFlow's own fault, whatever the optimizer (seen here with stock's and
#: ours): a step aborted with this names a request id that collided, not a
#: retried request. Each master step runs on a fresh thread whose request-id
#: generator (tsl ThreadLocalNew64) is seeded from 32 random bits, so a task
#: that serves thousands of steps sees two equal ids now and then.
#: docs/operations.md says more; MonitoredTrainingSession recovers from it
#: (AbortedError), a Supervisor script dies.
TF_REQUEST_ID_COLLISION = "request was received twice"


def _rerun_once_on_tf_request_id_collision(run, impl, tmp_path):
  """``run(impl, tmp_path)``, run once more if TensorFlow's collision broke it.

  Only that message, only once, and said in a warning: any other failure, or
  the same one twice, fails the test.
  """
  try:
    return run(impl, tmp_path)
  except AssertionError:
    logs = "".join(p.read_text(errors="replace")
                   for p in sorted(tmp_path.glob("*.log")))
    if TF_REQUEST_ID_COLLISION not in logs:
      raise
  # A warning, so that pytest's summary shows it even when the test passes.
  warnings.warn("%s: a task died of TensorFlow's request-id collision (%r); "
                "ran it once more" % (impl, TF_REQUEST_ID_COLLISION),
                stacklevel=2)
  return run(impl, tmp_path / "rerun")


#: The longest a cluster run takes, its rerun included: every wait in it is
#: bounded by one of the constants above.
RUN_SECS = 2 * (2 * START_SECS + TRAIN_SECS + PROMPT_SECS + LINGER_SECS)


def _stock_and_ours(script, tmp_path):
  """Runs ``script`` with stock's class and with ours, the two clusters side
  by side (the suite is bound by CPU, not by these runs' waits); checks and
  returns both runs."""
  threads = {impl: support.BoundedThread(
      _rerun_once_on_tf_request_id_collision,
      lambda i, p: _run_cluster(script, i, p), impl, tmp_path / impl,
      name=impl) for impl in ("stock", "ours")}
  for thread in threads.values():
    thread.start()
  runs, errors = {}, []
  for impl, thread in threads.items():
    # Both are finished before either's failure is raised: no cluster
    # outlives its test.
    try:
      runs[impl] = thread.finish(timeout=RUN_SECS)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)
  if errors:
    raise errors[0]
  for run in runs.values():
    _check(run)
  # The same final global step with either class (_check: the target).
  assert runs["stock"].final("worker1") == runs["ours"].final("worker1")
  return runs


@pytest.mark.timeout(900)
def test_supervisor_tf012_recipe_trains_to_the_same_step(tmp_path):
  _stock_and_ours("supervisor_tf012.py", tmp_path)


@pytest.mark.timeout(900)
def test_supervisor_default_init_ours_stops_and_saves(tmp_path):
  runs = _stock_and_ours("supervisor_default_init.py", tmp_path)
  # Ours' sv.stop() returns promptly, so the chief's save after it ran, at
  # the last step (stock's raises after its grace period, before the save).
  assert re.search(r"^saved .*model\.ckpt-%d$" % TRAIN_STEPS,
                   runs["ours"].texts["worker0"], re.M), (
                       runs["ours"].texts["worker0"][-3000:])


@pytest.mark.timeout(900)
def test_monitored_training_session_ours_closes_promptly(tmp_path):
  _stock_and_ours("monitored_session.py", tmp_path)


@pytest.mark.timeout(900)
def test_slim_learning_train_ours_closes_promptly(tmp_path):
  support.require("tf_slim", why="tests/user_scripts/slim_learning.py trains "
                  "with tf_slim.learning.train")
  _stock_and_ours("slim_learning.py", tmp_path)


def _estimator_module():
  try:
    return getattr(tf.compat.v1, "estimator", None)
  except ImportError:  # A 2.15 install whose tensorflow-estimator is missing.
    return None


@pytest.mark.skipif(_estimator_module() is None, reason=(
    "TensorFlow %s has no tf.compat.v1.estimator (removed in 2.16); CI runs "
    "this test on 2.15 (.ci/run), or by hand: SYNC_REPLICAS_TF="
    "'tensorflow-cpu==2.15.* numpy<2' SYNC_REPLICAS_VENV=.venv-215 "
    "./tools/test tests/test_user_scripts.py" % tf.__version__))
@pytest.mark.timeout(900)
def test_estimator_with_the_hook_ours_returns_promptly(tmp_path):
  _stock_and_ours("estimator_hook.py", tmp_path)


@pytest.mark.timeout(900)
def test_plain_session_by_hand_ours_joins_promptly(tmp_path):
  _stock_and_ours("plain_session.py", tmp_path)


# ------------------------------------------ the request-id collision rerun


def _failing_run(messages):
  """A run that logs and fails with each of ``messages``, then returns 7."""
  calls = []

  def run(impl, tmp_path):
    calls.append(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    if len(calls) <= len(messages):
      log = tmp_path / ("%s-worker1.log" % impl)
      log.write_text(messages[len(calls) - 1])
      raise AssertionError("worker1 exited 1")
    return 7
  return run, calls


def test_a_run_broken_by_the_collision_runs_once_more_with_a_warning(
    tmp_path):
  run, calls = _failing_run(["AbortedError: The same RunGraph (Worker) "
                             "request was received twice. graph_handle"])
  with pytest.warns(UserWarning, match="request-id collision"):
    assert _rerun_once_on_tf_request_id_collision(run, "ours", tmp_path) == 7
  assert calls == [tmp_path, tmp_path / "rerun"]


def test_any_other_failure_or_a_second_collision_fails(tmp_path):
  run, _ = _failing_run(["OutOfRangeError: 'sync_token_q' is closed"])
  with pytest.raises(AssertionError, match="worker1 exited"):
    _rerun_once_on_tf_request_id_collision(run, "ours", tmp_path / "a")
  twice = "The same RunGraph (Worker) request was received twice."
  run, calls = _failing_run([twice, twice])
  with pytest.warns(UserWarning), pytest.raises(AssertionError):
    _rerun_once_on_tf_request_id_collision(run, "ours", tmp_path / "b")
  assert len(calls) == 2
