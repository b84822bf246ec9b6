"""Shared test helpers: bounded waits, bounded sessions, the reference model.

Every wait here has a deadline and names what it waited for, so a hang fails
the test with a message instead of stalling CI.
"""

import contextlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import _forkserver
import sync_replicas

STOCK = tf.compat.v1.train.SyncReplicasOptimizer
OURS = sync_replicas.SyncReplicasOptimizer

def sgd(rate=1.0):
  """The plain v1 optimizer most tests wrap (rate 1.0: updates are sums)."""
  return tf.compat.v1.train.GradientDescentOptimizer(rate)


#: The project's tools/ folder.
TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"
#: What tools/_run_tests.py puts first on PYTHONPATH: a stub ``sklearn`` that
#: fails to import, so that ``import tensorflow`` skips Keras's scikit-learn
#: wrapper (see tools/_run_tests.py).
HIDDEN = pathlib.Path(__file__).resolve().parent / "_hidden"


def pythonpath(*dirs, environ=None):
  """PYTHONPATH for a child: ``dirs`` first, then the inherited entries.

  Keeps what the test runner put there (HIDDEN), so that the child's
  ``import tensorflow`` is as cheap as this process's.
  """
  environ = os.environ if environ is None else environ
  inherited = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep)
               if p]
  return os.pathsep.join([str(d) for d in dirs] + inherited)


#: What conftest.py puts first on the PYTHONPATH of every process a test
#: starts (not on pytest's own): a stub ``keras`` that fails to import, so
#: that a task's ``import tensorflow`` skips Keras, which no task uses.
TASKS_HIDDEN = pathlib.Path(__file__).resolve().parent / "_hidden_from_tasks"


def hide_from_tasks():
  """Puts TASKS_HIDDEN first on the PYTHONPATH this process's children get.

  Only children: this process has imported TensorFlow, and Keras with it,
  already. Called once, by conftest.py.
  """
  kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
          if p and pathlib.Path(p).resolve() != TASKS_HIDDEN]
  os.environ["PYTHONPATH"] = os.pathsep.join([str(TASKS_HIDDEN)] + kept)


def _off_pythonpath(folder, environ):
  env = dict(os.environ if environ is None else environ)
  kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
          if p and pathlib.Path(p).resolve() != folder]
  if kept:
    env["PYTHONPATH"] = os.pathsep.join(kept)
  else:
    env.pop("PYTHONPATH", None)
  return env


def without_hidden(environ=None):
  """A copy of the environment with HIDDEN off PYTHONPATH: real sklearn."""
  return _off_pythonpath(HIDDEN, environ)


def with_keras(environ=None):
  """A copy of the environment with TASKS_HIDDEN off PYTHONPATH: real Keras.

  For a child that needs Keras: the Estimator (TensorFlow 2.15) imports it.
  """
  return _off_pythonpath(TASKS_HIDDEN, environ)


#: A stock script's model, unchanged (stock's class, none of our options),
#: that ``run_unchanged_script`` follows with the lines printing what a test
#: checks.
UNCHANGED_SCRIPT = """
import tensorflow as tf
tf.compat.v1.disable_eager_execution()
with tf.compat.v1.device("/job:ps/task:0"):
  step = tf.compat.v1.train.get_or_create_global_step()
  w = tf.compat.v1.get_variable("w", [3])
  b = tf.compat.v1.get_variable("b", [2])
with tf.compat.v1.device("/job:worker/task:0"):
  loss = tf.reduce_sum(w * w) + tf.reduce_sum(b * b)
  opt = tf.compat.v1.train.SyncReplicasOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1),
      replicas_to_aggregate=2)
  opt.minimize(loss, global_step=step)
"""


def run_unchanged_script(tmp_path, prints, *, env, unset=()):
  """Builds ``UNCHANGED_SCRIPT`` + ``prints`` under ``python -m
  sync_replicas.patch`` with the variables ``env`` set and ``unset``
  removed (the options an unchanged script gets from the environment);
  returns the finished process, checked to exit 0."""
  script = tmp_path / "train.py"
  script.write_text(UNCHANGED_SCRIPT + prints)
  environ = dict(os.environ, PYTHONPATH=pythonpath(TOOLS.parent),
                 TF_CPP_MIN_LOG_LEVEL="2", **env)
  for name in unset:
    environ.pop(name, None)
  done = subprocess.run(
      [sys.executable, "-m", "sync_replicas.patch", str(script)],
      capture_output=True, text=True, env=environ, timeout=120,
      stdin=subprocess.DEVNULL, check=False)
  assert done.returncode == 0, done.stderr[-4000:]
  return done


def load_tool(name):
  """tools/<name>, a script without a .py suffix, imported as a module."""
  loader = importlib.machinery.SourceFileLoader(name, str(TOOLS / name))
  spec = importlib.util.spec_from_loader(name, loader)
  module = importlib.util.module_from_spec(spec)
  loader.exec_module(module)
  return module


#: Set to 1 by tools/test (and so by CI, which runs it): a test dependency
#: that setup.cfg's test extra pins must import, or the test fails.
REQUIRE_TEST_DEPS_ENV = "SYNC_REPLICAS_REQUIRE_TEST_DEPS"


#: How a module of setup.cfg's test extra is installed.
TEST_EXTRA = "setup.cfg's test extra pins it: pip install -e '.[test]'"


def require(module, *, why, install=TEST_EXTRA):
  """Imports ``module``, a test dependency that tools/_env.sh installs.

  In place of ``pytest.importorskip``: under tools/test, which installs the
  test extra and sets $SYNC_REPLICAS_REQUIRE_TEST_DEPS=1, a module that does
  not import is a broken install, and a skip would hide it (CI would pass
  without ever running the tests that need it). There the import error fails
  the test, or the module's collection when called at module level, with
  ``why`` and pip's command. Without the variable (a bare ``pytest`` run) it
  skips, as importorskip does.

  Args:
    module: The dotted name to import, e.g. ``"kubeflow.training"``.
    why: What needs it, for the message, e.g. ``"tests/test_tfjob.py checks
      examples/tfjob.yaml against its models"``.
    install: Where it is pinned and how to install it, for the message;
      tools/_env.sh installs every such module.

  Returns:
    The imported module.
  """
  # pytest then reports the skip or failure at the caller's line.
  __tracebackhide__ = True  # pylint: disable=unused-variable
  try:
    return importlib.import_module(module)
  except ImportError as e:
    error = "%s: %s" % (type(e).__name__, e)
  # Outside the except block: the message, not a chained traceback.
  message = "%s does not import (%s); %s. %s" % (module, error, why, install)
  if os.environ.get(REQUIRE_TEST_DEPS_ENV, "") not in ("", "0"):
    pytest.fail("%s. %s=1 (tools/test sets it) makes a missing test "
                "dependency a failure, not a skip" % (
                    message, REQUIRE_TEST_DEPS_ENV), pytrace=False)
  pytest.skip(message, allow_module_level=True)


#: .ci/run sets it to 1 for its older TensorFlow's suite (tests/conftest.py
#: reads the same name): the tests marked version_independent or
#: newest_only skip there.
OLDER_SUITE_ENV = "SYNC_REPLICAS_SKIP_VERSION_INDEPENDENT"


def _marks_reason(mark, nodeid, needs):
  """A mark's reason (its ``reason=`` or first argument), refused where it
  is not a sentence: ``needs`` says what the sentence must name."""
  reason = mark.kwargs.get("reason") or (mark.args[0] if mark.args else "")
  if not isinstance(reason, str) or len(reason.split()) < 5:
    raise pytest.UsageError(
        "%s: pytest.mark.%s needs reason=\"...\", a sentence naming %s; "
        "got %r" % (nodeid, mark.name, needs, reason))
  return reason


def newest_only_reason(mark, nodeid):
  """The reason of a ``newest_only`` mark; a mark without one is refused:
  leaving a test to the newest TensorFlow needs the tests that prove its
  TensorFlow part under every version named."""
  return _marks_reason(
      mark, nodeid,
      "the tests that prove its TensorFlow part under every version")


def newest_only_skip(reason):
  """The skip reason of a newest-only test in CI's older suite."""
  return ("newest TensorFlow only in CI (%s=1 here, TensorFlow %s): %s"
          % (OLDER_SUITE_ENV, tf.__version__, reason))


#: tools/test --all sets it to 1 (and CI runs --all): the tests marked
#: ``scale`` run; without it they skip (tests/conftest.py).
ALL_TIERS_ENV = "SYNC_REPLICAS_ALL_TIERS"


def scale_reason(mark, nodeid):
  """The reason of a ``scale`` mark; a mark without one is refused: leaving
  a test out of the default run needs the tests that prove its function at
  a small scale named."""
  return _marks_reason(
      mark, nodeid,
      "the tests that prove its function at a small scale in the default run")


#: The start of a scale test's skip reason: tools/_run_tests.py counts the
#: skips that carry it.
SCALE_SKIP = "scale tier, not in the default run"


def scale_skip(reason):
  """The skip reason of a scale test outside ``./tools/test --all``."""
  return ("%s (./tools/test --all runs it, as CI does; %s=1 for a bare "
          "pytest): %s" % (SCALE_SKIP, ALL_TIERS_ENV, reason))


def scale_here(reason):
  """Skips the running case outside ``./tools/test --all``, as a ``scale``
  mark does a whole test: for one case of a parametrized test (call it
  first). ``reason`` names the default tests that prove what it proves."""
  if len(reason.split()) < 5:
    raise pytest.UsageError(
        "scale_here needs a sentence naming the tests that prove its "
        "function at a small scale in the default run; got %r" % reason)
  if os.environ.get(ALL_TIERS_ENV) != "1":
    pytest.skip(scale_skip(reason))


def newest_only_here(reason):
  """Skips the running case in CI's older suite, as ``newest_only`` does a
  whole test: for one case of a parametrized test (call it first)."""
  if os.environ.get(OLDER_SUITE_ENV) == "1":
    pytest.skip(newest_only_skip(reason))


def is_machine_root():
  """Whether this process is root of the machine, not only of a namespace.

  uid 0 in the initial user namespace (whose uid map is the identity over
  every id). uid 0 of a user namespace of its own, as under ``unshare -r``,
  holds its capabilities over that namespace only: it cannot mount, so
  ``ip netns add`` fails, nor become any user the namespace does not map.
  """
  if not hasattr(os, "geteuid") or os.geteuid() != 0:
    return False
  try:
    with open("/proc/self/uid_map") as f:
      return f.read().split() == ["0", "0", "4294967295"]
  except OSError:  # A kernel without user namespaces: root is root.
    return True


#: No single op in these tests may block longer than this.
OP_TIMEOUT_MS = 30_000

#: The grace period of the prompt-stop tests' closes: stock's default
#: (MonitoredSession's stop_grace_period_secs, Supervisor's
#: stop_grace_secs), which a close that is not prompt waits out whole.
STOCK_GRACE_SECS = 120


def prompt_secs(op_timeout_ms=OP_TIMEOUT_MS):
  """A close or stop that took longer than this was not prompt.

  A close that is not prompt waits until the grace period ends or, sooner,
  until the op timeout ends the take its runner is blocked in (a lone
  chief's knocked-out prompt stop closed in 30 s, not 120). Half the shorter
  of the two: a prompt close takes well under a second on a quiet machine
  and a few seconds on a loaded 2-core one, so the bound is far from both
  what a loaded machine needs and what a wait takes. (Bounds of 5 s were
  within reach of a loaded machine.)
  """
  return min(STOCK_GRACE_SECS, op_timeout_ms / 1000) / 2


#: ``prompt_secs()`` for sessions with OP_TIMEOUT_MS: 15 s.
PROMPT_SECS = prompt_secs()


def session_config(timeout_ms=OP_TIMEOUT_MS):
  return tf.compat.v1.ConfigProto(operation_timeout_in_ms=timeout_ms)


def traced_worker_recvs(target, g, fetch, init):
  """Tensors a worker received from other tasks in one traced run of
  ``fetch`` (its RecvTensor nodes), after ``init`` and one untraced run
  that registers the graph (a graph's first run is not a steady step)."""
  with tf.compat.v1.Session(target, graph=g, config=session_config()) as sess:
    sess.run(init)
    sess.run(fetch)
    options = tf.compat.v1.RunOptions(
        trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    sess.run(fetch, options=options, run_metadata=metadata)
  return sum(1 for dev in metadata.step_stats.dev_stats
             if "/job:worker/" in dev.device
             for node in dev.node_stats if node.node_name.startswith(
                 "RecvTensor"))


def wait_until(predicate, *, timeout, what, interval=0.01):
  """Polls ``predicate`` until true; fails naming ``what`` after ``timeout`` s."""
  deadline = time.monotonic() + timeout
  while True:
    if predicate():
      return
    if time.monotonic() > deadline:
      raise AssertionError("timed out after %.1fs waiting for %s"
                           % (timeout, what))
    time.sleep(interval)


def _session_run_frame(thread):
  """``thread``'s innermost ``Session.run`` frame (the call into TF), or None."""
  frame = sys._current_frames().get(thread.ident)  # pylint: disable=protected-access
  while frame is not None:
    if frame.f_code.co_name == "_call_tf_sessionrun":
      return frame
    frame = frame.f_back
  return None


#: How long one run must last for wait_for_stock_runner_to_block to take it
#: as the blocked one; a run whose C call has returned leaves its frame
#: within a GIL switch (milliseconds), so a second is a wide margin.
RUN_SETTLED_SECS = 1.0


def wait_for_stock_runner_to_block(threads, timeout=30):
  """Waits until stock's queue-runner thread among ``threads`` is blocked
  in the run after the last update's.

  Call it once the last update is seen (its global step, or its token).
  Stock's QueueRunner checks ``coord.should_stop()`` before each run of its
  sync op. Once inside the run it blocks in take_grad whatever happens to
  the coordinator; a thread still between two runs when the stop is
  requested sees it and ends at once. A test that shows stock's blocked
  stop calls this first, or a loaded machine can give it the other
  schedule (CI did). Only a thread's stack tells the two apart, hence
  ``sys._current_frames``.

  A stack inside ``Session.run`` is not enough: the last update's run keeps
  its frame until its thread gets the GIL back after the C call returned,
  and a stop requested then is seen before the next run (CI once had this
  schedule). So the run counts only when it is a new one (its frame
  replaced the one first seen) or when it outlasts ``RUN_SETTLED_SECS``.
  """
  runners = [t for t in threads if t.name.startswith("QueueRunnerThread-")
             and not t.name.endswith("-close_on_stop")]
  assert len(runners) == 1, "want one stock runner thread, found %s" % (
      [t.name for t in threads])
  first = _session_run_frame(runners[0])
  first_seen = time.monotonic()

  def blocked():
    frame = _session_run_frame(runners[0])
    if frame is None:
      return False
    if first is None or frame is not first:
      return True
    return time.monotonic() - first_seen >= RUN_SETTLED_SECS

  wait_until(blocked, timeout=timeout,
             what="stock's queue runner to start its next (blocking) run")


@contextlib.contextmanager
def held(send_signal):
  """A process stopped (SIGSTOP) for the block and resumed (SIGCONT) after
  it, whatever happened in it. ``send_signal(signum)`` signals the process
  (or its group)."""
  send_signal(signal.SIGSTOP)
  try:
    yield
  finally:
    send_signal(signal.SIGCONT)


#: The longest single stop of ``held_in_turns``. A demo chief stopped mid-step
#: for 60 s found its in-flight RunGraph retried by TensorFlow on resuming
#: ("The same RunGraph (Worker) request was received twice", an AbortedError:
#: its session started over at step 0 and its workers timed out); 30 s went
#: through, and so did 150 s of 15 s stops with 1 s between them.
HOLD_TURN_SECS = 15.0
RELEASE_TURN_SECS = 1.0


@contextlib.contextmanager
def held_in_turns(send_signal, hold_secs=HOLD_TURN_SECS,
                  release_secs=RELEASE_TURN_SECS):
  """As ``held``, for a block of unknown length: stopped at once, then let go
  for ``release_secs`` after every ``hold_secs``, and resumed after it."""
  stop = threading.Event()

  def turns():
    while not stop.wait(hold_secs):
      send_signal(signal.SIGCONT)
      if stop.wait(release_secs):
        return
      send_signal(signal.SIGSTOP)

  send_signal(signal.SIGSTOP)
  thread = BoundedThread(turns, name="held-in-turns")
  thread.start()
  try:
    yield
  finally:
    stop.set()
    try:
      thread.finish(timeout=30)
    finally:
      send_signal(signal.SIGCONT)


class BoundedThread(threading.Thread):
  """A daemon thread whose ``finish`` joins with a deadline and re-raises."""

  def __init__(self, target, *args, name=None):
    super().__init__(daemon=True, name=name)
    self._fn, self._args = target, args
    self.error = None
    self.result = None

  def run(self):
    try:
      self.result = self._fn(*self._args)
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e

  def finish(self, timeout=30):
    self.join(timeout)
    if self.is_alive():
      raise AssertionError("thread %s still running after %.1fs"
                           % (self.name, timeout))
    if self.error is not None:
      raise self.error
    return self.result


class OutputLines:
  """A process's output stream, read line by line in a bounded thread.

  ``find`` waits (bounded) for a pattern and, when it times out, shows the
  output so far; ``finish`` joins the reader once the stream has ended.
  """

  def __init__(self, stream):
    self.lines = []
    self._thread = BoundedThread(self._read, stream, name="output")
    self._thread.start()

  def _read(self, stream):
    for line in iter(stream.readline, b""):
      self.lines.append(line.decode(errors="replace"))

  def text(self):
    return "".join(self.lines)

  def find(self, pattern, what, *, timeout):
    try:
      wait_until(lambda: re.search(pattern, self.text()), timeout=timeout,
                 what=what, interval=0.1)
    except AssertionError as e:
      raise AssertionError("%s; the output so far:\n%s"
                           % (e, self.text()[-4000:])) from None
    return re.search(pattern, self.text())

  def finish(self):
    self._thread.finish(timeout=30)
    return self.text()


def run_concurrently(calls, timeout=30):
  """Runs each ``(fn, *args)`` in its own thread; returns results in order."""
  threads = [BoundedThread(c[0], *c[1:], name="call-%d" % i)
             for i, c in enumerate(calls)]
  for t in threads:
    t.start()
  return [t.finish(timeout) for t in threads]


def pid_runs(pid):
  """True if ``pid`` runs (a zombie waiting for a reaper does not)."""
  try:
    stat = pathlib.Path("/proc/%d/stat" % pid).read_text()
  except (FileNotFoundError, ProcessLookupError):
    return False
  return stat.rsplit(")", 1)[1].split()[0] != "Z"


def listens(port, pid="self"):
  """True if a socket listens on ``port`` in the network namespace of pid
  (test_confine's and the demo's checks of a launch's confinement)."""
  for table in ("tcp", "tcp6"):
    path = pathlib.Path("/proc/%s/net/%s" % (pid, table))
    if not path.exists():
      continue
    for row in path.read_text().splitlines()[1:]:
      local, state = row.split()[1], row.split()[3]
      if int(local.rsplit(":", 1)[1], 16) == port and state == "0A":
        return True
  return False


def connects(port):
  """True if 127.0.0.1:``port`` accepts a connection from this process."""
  try:
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    return True
  except OSError:
    return False


def kill_group(proc, timeout=30):
  """SIGKILLs the process group ``proc`` leads, then reaps ``proc``.

  ``proc`` must have been started with ``start_new_session=True``. The group
  is signalled only while ``proc`` is not reaped (``returncode`` is None):
  until then its pid, which is the group's id, cannot be given to another
  process. After reaping, a kill by that number can hit an unrelated process
  that got the recycled pid (pid_max is 32768 here and every TensorFlow
  thread takes a pid); one such stale kill once took down a worker of
  another test.
  """
  if proc.returncode is None:
    try:
      leads_group = os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:  # ended, not yet reaped: nothing to signal
      leads_group = True
    if not leads_group:
      # killpg would find no group by this number (or someone else's): the
      # process would live on and the wait below would time out, hiding the
      # test's own failure behind a TimeoutExpired. Kill it, then say why.
      proc.kill()
      proc.wait(timeout=timeout)
      raise AssertionError(
          "kill_group needs a process started with start_new_session=True; "
          "pid %d of %r is in its parent's group, so only it was killed "
          "(its children, if any, were not)" % (proc.pid, proc.args))
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  proc.wait(timeout=timeout)


def start_task(argv, **popen_kwargs):
  """Starts one of the suite's OWN task programs (tests/crash_task.py,
  tests/lost_task.py, tools/_data_end_task.py): ``argv`` is
  ``[sys.executable, SCRIPT.py, *args]``, the keyword arguments are
  ``subprocess.Popen``'s (``start_new_session=True`` by default, as
  ``kill_group`` needs).

  The task is forked from this pytest process's zygote, which imported
  TensorFlow once (tests/_forkserver.py), and handled as a Popen; it
  starts fresh where forking would not be the same (another command, as
  the emulated hosts' wrapper, or SYNC_REPLICAS_FORKSERVER=0). Not for
  what a user runs (README's program, examples/, tests/user_scripts/):
  its first run proves the user's path and starts fresh, its repeat runs
  go through ``start_repeat_run``; the launcher's children are its own.
  """
  popen_kwargs.setdefault("start_new_session", True)
  return _forkserver.spawn(argv, **popen_kwargs)


def start_repeat_run(argv, **popen_kwargs):
  """Starts a REPEAT run of a user's program, forked (tests/_forkserver.py)
  where a fresh run of the same entry point is proven elsewhere in the
  default tier; ``argv`` and the keyword arguments are as ``start_task``'s
  (``start_new_session=True`` by default), ``argv`` the user's command:
  ``[sys.executable, SCRIPT.py, *args]`` or ``[sys.executable, "-m",
  MODULE, *args]``. Give it the environment the test gives a fresh run
  (TF_CPP_MIN_LOG_LEVEL, ``with_keras``): a start-up environment of its
  own gets its own zygote.

  A repeat run (another start order, another script under the same runner,
  another of an example's tasks) proves what the program does as a job,
  not how a Python process starts: the forked child runs the unmodified
  program as ``__main__`` with the same argv, env and cwd, but TensorFlow
  was imported before the fork (so the patch runner installs at once, not
  at the program's import: the fresh proofs below take that path). Each
  entry point's FRESH proof:

  * ``python SCRIPT.py``: README's program in test_readme's start order at
    TensorFlow's own log level (every line a task prints from its start)
    and under the launcher; test_user_scripts' FRESH_SCRIPT as written.
  * ``python -m sync_replicas.patch SCRIPT.py``: test_user_scripts'
    FRESH_SCRIPT under the patch, and test_patch's runner tests.
  * ``python -m examples.MODULE``: test_examples' local_demo test, and the
    launches of test_examples and test_hosts.
  * The launcher's children: never forked (the launcher starts them).

  No wrapper such as coreutils' ``timeout`` can sit in front of a forked
  run: its lifetime is the test's (``kill_group`` in its finally block)
  and, at most, the pytest process's (the zygote kills its tasks when
  that process's socket closes, and a task dies with its zygote).
  """
  popen_kwargs.setdefault("start_new_session", True)
  return _forkserver.spawn(argv, **popen_kwargs)


def start_crash_task_ps(cluster, env):
  """ps task 0 of ``cluster`` as tests/crash_task.py, a process group of its
  own (``kill_group`` stops it); call it again to restart that ps. Forked
  from the fork server (``start_task``): the suite's own task program, as
  test_recovery's and test_gone's tasks."""
  spec = json.dumps({"job": "ps", "task": 0, "cluster": cluster})
  return start_task(
      [sys.executable, str(pathlib.Path(__file__).with_name("crash_task.py")),
       spec],
      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


class SharedCluster:
  """One LocalCluster for all of a module's tests, reset before each use.

  A server keeps its ~85 threads until the process ends, so a module that
  made a cluster per test held thousands of them (test_parity peaked at
  about 14,000), which ruled out running files side by side. A reused
  cluster is as clean as a fresh one: ``Session.reset`` on every worker
  closes the sessions connected to it and clears every resource container
  on every task (variables, accumulators, the token queue, whose shared
  names are fixed), as tools/bench does between runs.

  Usage, in place of ``cluster = LocalCluster(...)``::

    with SHARED.use() as cluster:
      ...
  """

  def __init__(self, *, num_workers, num_ps):
    self._shape = dict(num_workers=num_workers, num_ps=num_ps)
    self._cluster = None

  def acquire(self):
    """The cluster, with every container empty and no session open."""
    if self._cluster is None:
      self._cluster = sync_replicas.LocalCluster(**self._shape)
    else:
      for target in self._cluster.worker_targets:
        tf.compat.v1.Session.reset(target)
    return self._cluster

  def discard(self):
    """After a failed use: a thread may still be blocked in one of its runs
    (a timed-out worker), so the next use gets a fresh cluster."""
    self._cluster = None

  @contextlib.contextmanager
  def use(self):
    """``acquire``'s cluster for a ``with`` block, discarded (``discard``)
    if the block raises, a failed assertion or a skip included."""
    cluster = self.acquire()
    try:
      yield cluster
    except BaseException:
      self.discard()
      raise


def run_chief_first(worker_fn, cluster, count, *args, timeout):
  """Runs ``worker_fn(cluster, task, ready, *args)`` for every task.

  The chief (task 0) starts first and sets ``ready`` once its session is up;
  the others start then, so they find the model initialized instead of
  sleeping SessionManager's recovery wait. A chief that fails before that
  fails the test with its own error.
  """
  ready = threading.Event()
  threads = [BoundedThread(worker_fn, cluster, t, ready, *args,
                           name="worker-%d" % t) for t in range(count)]
  threads[0].start()
  wait_until(lambda: ready.is_set() or not threads[0].is_alive(),
             timeout=60, what="the chief's session")
  if not ready.is_set():
    threads[0].finish(timeout=1)  # Raises the chief's error.
  for t in threads[1:]:
    t.start()
  for t in threads:
    t.finish(timeout=timeout)


def monitored_session(target, *, is_chief, hooks, checkpoint_dir=None,
                      timeout_ms=OP_TIMEOUT_MS, **kwargs):
  """MonitoredTrainingSession with bounded ops and a short close grace."""
  kwargs.setdefault("stop_grace_period_secs", 1)
  kwargs.setdefault("save_summaries_steps", None)
  kwargs.setdefault("save_summaries_secs", None)
  kwargs.setdefault("log_step_count_steps", None)
  return tf.compat.v1.train.MonitoredTrainingSession(
      master=target, is_chief=is_chief, hooks=hooks,
      checkpoint_dir=checkpoint_dir, config=session_config(timeout_ms),
      **kwargs)


class TFTestWorker:
  """One worker of TensorFlow's own sync_replicas test, in its own graph.

  Variables: ``global_step`` and ``v0`` (0.0) on ps 0, ``v1`` (1.0) and
  ``v_sparse`` ([[3], [4]]) on ps 1. Worker ``i`` pushes the constant
  gradients ``0.1 + 0.2 i`` to v0, ``0.9 + 0.2 i`` to v1 and a sparse row
  ``0.1 + 0.2 i`` at index 1 to v_sparse; SGD with learning rate 2.0.
  ``v0_pending`` counts the gradients in v0's accumulator.
  """

  def __init__(self, opt_cls, cluster, worker_id, *, replicas_to_aggregate,
               total_num_replicas, num_tokens=None):
    self.graph = tf.Graph()
    is_chief = worker_id == 0
    with self.graph.as_default():
      with tf.compat.v1.device("/job:ps/task:0"):
        self.global_step = tf.compat.v1.Variable(
            0, name="global_step", trainable=False)
        self.v0 = tf.compat.v1.Variable(0.0, name="v0")
      with tf.compat.v1.device("/job:ps/task:1"):
        self.v1 = tf.compat.v1.Variable(1.0, name="v1")
        self.v_sparse = tf.compat.v1.Variable([[3.0], [4.0]],
                                              name="v_sparse")
      with tf.compat.v1.device("/job:worker/task:%d" % worker_id):
        g0 = tf.constant(0.1 + worker_id * 0.2)
        g1 = tf.constant(0.9 + worker_id * 0.2)
        g_sparse = tf.IndexedSlices(
            tf.constant([0.1 + worker_id * 0.2], shape=[1, 1]),
            tf.constant([1]), tf.constant([2, 1]))
        self.opt = opt_cls(
            tf.compat.v1.train.GradientDescentOptimizer(2.0),
            replicas_to_aggregate=replicas_to_aggregate,
            total_num_replicas=total_num_replicas)
        self.train_op = self.opt.apply_gradients(
            zip([g0, g1, g_sparse], [self.v0, self.v1, self.v_sparse],
                strict=True),
            global_step=self.global_step)
        hook = self.opt.make_session_run_hook(
            is_chief,
            num_tokens=total_num_replicas if num_tokens is None else num_tokens)
        self.local_step = local_step_variable(self.graph)
      with tf.compat.v1.device("/job:ps/task:0"):
        # A second handle on v0's accumulator (stock's shared name, ours
        # too), as any task can make: how many fresh gradients it holds.
        self.v0_pending = tf.compat.v1.ConditionalAccumulator(
            tf.float32, shape=[], shared_name=self.v0.name + "/grad_accum",
            name="v0_pending").num_accumulated()
      self.session = monitored_session(cluster.worker_targets[worker_id],
                                       is_chief=is_chief, hooks=[hook])

  def step(self):
    self.session.run(self.train_op)

  def read(self):
    """(global_step, v0, v1, v_sparse, local_step) as numpy values."""
    return self.session.run([self.global_step, self.v0, self.v1,
                             self.v_sparse, self.local_step])

  def close(self):
    self.session.close()


def local_step_variable(graph):
  """The worker's ``sync_rep_local_step``, found the way a user would."""
  found = [v for v in graph.get_collection(
      tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
           if v.op.name == "sync_rep_local_step"]
  assert len(found) == 1, "expected one sync_rep_local_step, got %r" % found
  return found[0]


def make_tf_test_workers(opt_cls, *, num_workers, replicas_to_aggregate):
  cluster = sync_replicas.LocalCluster(num_workers=num_workers, num_ps=2)
  return [TFTestWorker(opt_cls, cluster, i,
                       replicas_to_aggregate=replicas_to_aggregate,
                       total_num_replicas=num_workers)
          for i in range(num_workers)]


def close_all(workers):
  # Non-chiefs first: the chief's queue runner is the last to need the ps.
  for w in reversed(workers):
    w.close()


class LinearWorker:
  """A worker graph training ``y = x . w`` by SGD, on any cluster target.

  ``opt_cls`` is stock's or our class; ``opt_kwargs`` go to its constructor.
  The chief is task 0.
  """

  def __init__(self, opt_cls, cluster, task, *, replicas, total,
               opt_kwargs=None, num_ps=1, target=None):
    self.task = task
    self.is_chief = task == 0
    self.graph = tf.Graph()
    self.target = cluster.worker_targets[task] if target is None else target
    rng = np.random.default_rng(task)
    self.xs = rng.normal(size=(16, 4)).astype(np.float32)
    self.ys = self.xs @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    with self.graph.as_default():
      setter = (tf.compat.v1.train.replica_device_setter(
          ps_tasks=num_ps, worker_device="/job:worker/task:%d" % task)
                if num_ps else None)
      with tf.compat.v1.device(setter):
        self.global_step = tf.compat.v1.train.get_or_create_global_step()
        self.w = tf.compat.v1.get_variable(
            "w", [4], initializer=tf.zeros_initializer())
        loss = tf.reduce_mean(tf.square(
            tf.linalg.matvec(tf.constant(self.xs), self.w) - self.ys))
        self.loss = loss
        self.opt = opt_cls(
            tf.compat.v1.train.GradientDescentOptimizer(0.05),
            replicas_to_aggregate=replicas, total_num_replicas=total,
            **(opt_kwargs or {}))
        self.train_op = self.opt.minimize(loss, global_step=self.global_step)
      self.hook = self.opt.make_session_run_hook(self.is_chief)

  def session(self, *, hooks=(), **kwargs):
    with self.graph.as_default():
      return monitored_session(self.target, is_chief=self.is_chief,
                               hooks=[self.hook, *hooks], **kwargs)


class TraceWorker:
  """A worker whose gradients record who pushed at which local step.

  Worker ``task`` pushes ``R * e[s, task]`` into row ``s`` (its local step)
  of a ``[rows, workers]`` ``trace`` variable on ps 0, with SGD at learning
  rate -1: an update adds ``R / k`` to the cell of each of the k gradients it
  averages, so a row shows which workers an update counted, and how often.
  """

  def __init__(self, cluster, task, *, workers, rows, replicas, **opt_kwargs):
    self.task = task
    self.target = "grpc://" + cluster.cluster_spec.task_address("worker", task)
    self.rows = rows
    self.graph = tf.Graph()
    with self.graph.as_default():
      with tf.compat.v1.device("/job:ps/task:0"):
        self.step = tf.compat.v1.train.get_or_create_global_step()
        trace = tf.compat.v1.get_variable(
            "trace", [rows, workers], initializer=tf.zeros_initializer())
      with tf.compat.v1.device("/job:worker/task:%d" % task):
        self.opt = OURS(tf.compat.v1.train.GradientDescentOptimizer(-1.0),
                        replicas_to_aggregate=replicas,
                        total_num_replicas=workers, **opt_kwargs)
        self.row = tf.compat.v1.placeholder(tf.int32, [])
        grad = tf.tensordot(tf.one_hot(self.row, rows),
                            tf.one_hot(task, workers) * replicas, axes=0)
        self.train_op = self.opt.apply_gradients([(grad, trace)],
                                                 global_step=self.step)

  def train(self, ready, *, last_step, before_push=None):
    """Trains to ``last_step``; returns how many pushes this worker made.

    ``before_push(local_step)`` runs before each push: it may sleep, or
    return False to stop this worker for good.
    """
    runs = 0
    hooks = [self.opt.make_session_run_hook(self.task == 0),
             tf.compat.v1.train.StopAtStepHook(last_step=last_step)]
    with self.graph.as_default(), monitored_session(
        self.target, is_chief=self.task == 0, hooks=hooks) as sess:
      if self.task == 0:
        ready.set()
      while not sess.should_stop():
        local = int(sess.run(self.opt.local_step))
        if sess.should_stop():  # That read may have seen the last step.
          break
        if before_push is not None and before_push(local) is False:
          break
        sess.run(self.train_op,
                 feed_dict={self.row: min(local, self.rows - 1)})
        runs += 1
    return runs


def read_trace(cluster, *, rows, workers, extra=None):
  """The global step and the ``trace`` of TraceWorker jobs, from ps 0.

  ``extra(graph)`` may build more tensors to read in the same run (under
  ps 0's device); their values come third.
  """
  with tf.Graph().as_default() as graph:
    with tf.compat.v1.device("/job:ps/task:0"):
      step = tf.compat.v1.train.get_or_create_global_step()
      trace = tf.compat.v1.get_variable("trace", [rows, workers])
      fetches = [step, trace] + ([extra(graph)] if extra else [])
    with tf.compat.v1.Session(cluster.worker_targets[0],
                              config=session_config()) as sess:
      return sess.run(fetches)


class ConstantWorker:
  """Worker ``task`` pushes the gradient ``[task + 1, 10 * (task + 1)]``.

  One variable ``w`` ([2], zeros) on ps 0, SGD at rate 1, a
  MonitoredSession per worker (task 0 is the chief) driven step by step.
  With our class, ``pending`` counts the gradients in ``w``'s accumulator;
  ``runner_clock``, if given, becomes the chief's runner's clock before its
  session starts (its deadline and stall timings then move only as the test
  moves that clock).
  """

  def __init__(self, cls, cluster, task, *, replicas, total, runner_clock=None,
               **opt_kwargs):
    self.graph = tf.Graph()
    with self.graph.as_default():
      with tf.compat.v1.device("/job:ps/task:0"):
        self.step = tf.compat.v1.train.get_or_create_global_step()
        self.var = tf.compat.v1.get_variable(
            "w", [2], initializer=tf.zeros_initializer())
      with tf.compat.v1.device("/job:worker/task:%d" % task):
        self.opt = cls(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                       replicas_to_aggregate=replicas,
                       total_num_replicas=total, **opt_kwargs)
        grad = tf.constant([1.0, 10.0]) * (task + 1)
        self.train_op = self.opt.apply_gradients([(grad, self.var)],
                                                 global_step=self.step)
        self.pending = None
        if cls is OURS:
          self.pending = self.opt.accumulators[0][0].num_accumulated()
      if runner_clock is not None:
        self.opt.get_chief_queue_runner().clock = runner_clock
      self.session = monitored_session(
          cluster.worker_targets[task], is_chief=task == 0,
          hooks=[self.opt.make_session_run_hook(task == 0)])

  def close(self):
    self.session.close()
