"""One task of the crash-recovery tests, run as its own OS process.

``python tests/crash_task.py SPEC_JSON``: a ps serves forever; a worker
trains until ``last_step`` and appends JSON lines to its ``out`` file
(``ready`` once its session exists, ``session`` at each session's start,
``run`` after each train run that returned, ``done`` at a clean end), so the
test can follow it without parsing logs. The model is TF's linear toy plus a
``trace`` variable: each gradient adds 1 to cell (local step, task) when it
is applied, which is how the test checks that only fresh gradients were.
With ``count_pushes`` a sparse ``pushes`` variable also counts them, by
generation, step and task: how many gradients of each worker an update
took (``trace`` has only each worker's share of it).

With ``shards`` (batches per worker) a worker trains until its one-pass
input ends instead of to ``last_step`` (issue 36's ``data_end``): the input
is a ``py_func`` on the worker that gives the next batch of its shard and
raises StopIteration (OutOfRangeError in the run, the end of a one-pass
input to MonitoredSession) once the shard is trained. The batch advances
only when a train run returned, so a run that a ps restart failed, and
MonitoredSession (or the loop below) runs again, trains the same batch: the
worker's own count is the batches it trained, each once.
"""

import faulthandler
import functools
import json
import logging
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import sync_replicas  # pylint: disable=g-import-not-at-top

STEP_MASK = (1 << 32) - 1  # Plain step from a generation-encoded local step.
# A ps task serves until the test kills it; past this it leaves by itself
# (longer than pytest-timeout, so only an orphan ever gets there).
PS_LIFETIME_SECS = 600
HOLD_TIMEOUT_SECS = 150  # Longer than any restart the test waits for.
#: How often a worker's session manager looks again for the chief's init
#: (stock's default naps 30 s). A worker whose first look, or whose look
#: after a ps restart, comes before the chief (re)initialized the variables
#: naps that long while the chief trains on alone: the wait decided nothing
#: the tests check, it only took 30 s of wall time (and kept that worker out
#: of training). 1 s is TF 0.12's recipe (``recovery_wait_secs=1``).
RECOVERY_WAIT_SECS = 1


def _emit(path, **record):
  with open(path, "a") as f:
    f.write(json.dumps(dict(record, t=time.time())) + "\n")


class _Relabel(tf.compat.v1.train.SessionRunHook):
  """Sets the gradient label to the local step whenever a session starts,
  and says so (``session``, with that local step, generation-encoded:
  MonitoredSession's own recreations after a ps restart included, which no
  other event shows). A run MonitoredSession retries in the new session
  pushes with that label (``state["label"]``).

  Listed after the sync hook, so it runs after that hook's local init.
  """

  def __init__(self, relabel, out, state):
    self._relabel = relabel
    self._out = out
    self._state = state

  def after_create_session(self, session, coord):
    del coord
    self._state["label"] = int(session.run(self._relabel))
    _emit(self._out, event="session", label=self._state["label"])


def _wait_while_held(spec, state, timeout=HOLD_TIMEOUT_SECS, *,
                     path=None, event="held"):
  """Pauses between steps while the test holds this task (``hold_file``).

  The test holds the tasks that keep training while it restarts another, so
  that how long a restart takes never decides whether training ends first.
  Once paused it says so (``held``, with the batches trained), so that the
  test knows when no run of this task is in flight. ``path``: another file
  that holds it (``_HoldAtEnd``'s), said as ``event``.
  """
  path = path or spec.get("hold_file")
  deadline = time.monotonic() + timeout
  said = False
  while path and os.path.exists(path):
    if not said:
      _emit(spec["out"], event=event, runs=state["runs"])
      said = True
    if time.monotonic() > deadline:
      raise RuntimeError("still held by %s after %d s" % (path, timeout))
    time.sleep(0.05)


class _HoldAtEnd(tf.compat.v1.train.SessionRunHook):
  """With ``end_hold_file`` (a path with ``%d`` for the task): at the
  session's end, before the sync hook's (listed first), pauses while the
  test holds this task there (that file exists), saying so (``ending``).
  The run that ended the session already ran; the sync hook's ``end()``,
  which records a data end on the ps, comes after the pause: the test
  decides what that record meets (test_recovery: a ps task down).
  """

  def __init__(self, spec, state):
    self._spec = spec
    self._state = state

  def end(self, session):
    del session
    _wait_while_held(
        self._spec, self._state, event="ending",
        path=self._spec["end_hold_file"] % self._spec["task"])


def _session_loop(spec, session_kwargs, train_op, relabel, rng, state):
  """Trains in one MonitoredTrainingSession until it says stop (or, with
  ``shards``, until its input ends)."""
  with tf.compat.v1.train.MonitoredTrainingSession(**session_kwargs) as sess:
    _emit(spec["out"], event="ready")
    while not sess.should_stop():
      _wait_while_held(spec, state)
      # Random delays shuffle who arrives last, so that with backups no
      # worker is dropped every time.
      time.sleep(rng.uniform(0, 2 * spec.get("delay", 0.0)))
      sess.run(train_op)
      state["runs"] += 1  # The input's next batch (shards) is the next one.
      pushed = state["label"]
      if not sess.should_stop():
        # The step of the token just taken.
        state["label"] = int(sess.run(relabel))
      # The local steps (generation-encoded) this run pushed with and the
      # next run will: the test accounts for every push (test_recovery).
      _emit(spec["out"], event="run", pushed=pushed, next=state["label"])


def _shard_input(state, batches):
  """This worker's one-pass input of ``batches`` batches (the module doc):
  the id of the batch the next train run trains; StopIteration, which a
  run raises as OutOfRangeError, once ``state["runs"]`` trained them all."""

  def next_batch():
    if state["runs"] >= batches:
      raise StopIteration
    return np.int64(state["runs"])

  return tf.compat.v1.py_func(next_batch, [], tf.int64, stateful=True,
                              name="shard_input")


def _push_count(label, task, workers, rows, generations):
  """The gradient that adds 1 to cell (generation, step, task) of
  ``pushes`` (rows of ``rows`` steps per generation, the last generation
  also counting any later ones), at rate 1 and summed
  (``sparse_reduction="sum"``): the generation and step of ``label``, the
  generation-encoded local step the run pushes with, so that a restarted
  chief's updates, which start again from its checkpoint's step, never
  share a cell with its previous life's."""
  generation = tf.minimum(tf.bitwise.right_shift(label, 32), generations - 1)
  step = tf.bitwise.bitwise_and(label, STEP_MASK)
  index = tf.cast(generation * rows + step, tf.int32)
  return tf.IndexedSlices(-tf.reshape(tf.one_hot(task, workers), [1, workers]),
                          tf.reshape(index, [1]),
                          tf.constant([generations * rows, workers]))


def _worker(spec):
  task, workers = spec["task"], len(spec["cluster"]["worker"])
  cluster = tf.train.ClusterSpec(spec["cluster"])
  server = tf.distribute.Server(cluster, job_name="worker", task_index=task)
  rows = spec["last_step"] + 64
  replicas = spec["replicas"]
  with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
      cluster=cluster, worker_device="/job:worker/task:%d" % task)):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    trace = tf.compat.v1.get_variable("trace", [rows, workers],
                                      initializer=tf.zeros_initializer())
    w = tf.compat.v1.get_variable("w", [4], initializer=tf.zeros_initializer())
    # With ``count_pushes`` (G generations), also the count of every
    # gradient an update applied: ``trace`` has each worker's share of an
    # update, which cannot tell one push from two of the same worker.
    generations = spec.get("count_pushes")
    if generations:
      pushes = tf.compat.v1.get_variable(
          "pushes", [generations * rows, workers],
          initializer=tf.zeros_initializer())
    # The step a gradient is labelled with lives in a worker-local variable
    # rather than a feed: MonitoredSession retries a run that hit a ps
    # failure in a recreated session, whose local step is re-initialized,
    # and a fed label would then be the old session's.
    with tf.compat.v1.device("/job:worker/task:%d" % task):
      label = tf.compat.v1.get_variable(
          "trace_label", [], tf.int64, initializer=tf.zeros_initializer(),
          collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
          trainable=False)
    step_cell = tf.cast(tf.bitwise.bitwise_and(label, STEP_MASK), tf.int32)
    xs = np.random.default_rng(task).normal(size=(8, 4)).astype(np.float32)
    state = {"runs": 0}
    shards = spec.get("shards")
    if shards is not None:
      xs = xs + 0.0 * tf.cast(_shard_input(state, shards[task]), tf.float32)
    loss = tf.reduce_mean(tf.square(tf.linalg.matvec(xs, w) - 1.0))
    # lr 1 on -R * e[step, task]: the mean of R of them adds 1 per gradient.
    trace_grad = -replicas * tf.tensordot(tf.one_hot(step_cell, rows),
                                          tf.one_hot(task, workers), axes=0)
    opt_kwargs = dict(spec.get("opt_kwargs", {}))
    if generations:
      opt_kwargs["sparse_reduction"] = "sum"  # Counts, not a mean.
    opt = sync_replicas.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0),
        replicas_to_aggregate=replicas, total_num_replicas=workers,
        # With shards, the chief's stall line says who is done and every
        # worker's local step, should the job wait for a worker.
        stall_log_secs=10 if shards is not None else None,
        # A test's own options (test_gone: worker_gone_secs).
        **opt_kwargs)
    grads = [(trace_grad, trace), (tf.gradients(loss, w)[0], w)]
    if generations:
      grads.append((_push_count(label, task, workers, rows, generations),
                    pushes))
    train_op = opt.apply_gradients(grads, global_step=global_step)
  is_chief = task == 0
  with tf.compat.v1.device("/job:worker/task:%d" % task):
    relabel = tf.compat.v1.assign(label, opt.local_step)
  hooks = [opt.make_session_run_hook(is_chief),
           _Relabel(relabel, spec["out"], state)]
  if spec.get("end_hold_file"):
    hooks.insert(0, _HoldAtEnd(spec, state))
  if shards is None:
    hooks.append(tf.compat.v1.train.StopAtStepHook(
        last_step=spec["last_step"]))
  config = tf.compat.v1.ConfigProto(
      operation_timeout_in_ms=spec.get("op_timeout_ms", 90_000),
      device_filters=["/job:ps", "/job:worker/task:%d" % task])
  session_kwargs = dict(
      master=server.target, is_chief=is_chief, hooks=hooks, config=config,
      checkpoint_dir=spec["checkpoint_dir"] if is_chief else None,
      save_checkpoint_steps=spec.get("checkpoint_steps", 5),
      save_checkpoint_secs=None, save_summaries_steps=None,
      save_summaries_secs=None, log_step_count_steps=None)
  rng = np.random.default_rng()
  while True:
    try:
      _session_loop(spec, session_kwargs, train_op, relabel, rng, state)
      break
    except tf.errors.CancelledError as e:
      # A ps restart that TensorFlow reports as a cancel (the restarted ps
      # aborted the step while this worker's partition waited on a
      # transfer): MonitoredSession recovers from the abort but not from
      # this, and would end the process. A new session recovers, as
      # docs/operations.md ("A restart reported as CancelledError") tells
      # users to; CI met it once in the killed-ps test.
      if not sync_replicas.is_recoverable_error(e):
        raise
      _emit(spec["out"], event="recreated",
            error=(e.message or "").splitlines()[-3:])
  runs = state["runs"]
  _emit(spec["out"], event="done", runs=runs)


def main(argv):
  spec = json.loads(argv[1])
  # The test sends SIGUSR1 to a task that hangs: every thread's stack goes
  # to the task's log.
  faulthandler.register(signal.SIGUSR1, all_threads=True)
  tf.get_logger().setLevel("INFO")
  # The package's own lines (the data end's and the chief's restore), which
  # the tests read in the task's log.
  logging.basicConfig(format="%(levelname)s:%(name)s:%(message)s")
  logging.getLogger("sync_replicas").setLevel(logging.INFO)
  # MonitoredTrainingSession needs graph mode; a TF2 program starts eager.
  tf.compat.v1.disable_eager_execution()
  # MonitoredTrainingSession gives no way to pass recovery_wait_secs to the
  # session manager its worker session creator builds (at every session,
  # the recreated ones included): this changes the default it uses.
  manager = tf.compat.v1.train.SessionManager
  manager.__init__ = functools.partialmethod(
      manager.__init__, recovery_wait_secs=RECOVERY_WAIT_SECS)
  if spec["job"] == "ps":
    cluster = tf.train.ClusterSpec(spec["cluster"])
    tf.distribute.Server(cluster, job_name="ps", task_index=spec["task"])
    # The server serves from its own threads. The test kills this task; the
    # bound (beyond pytest-timeout's) ends it should the test not get to.
    time.sleep(PS_LIFETIME_SECS)
    print("ps: still running after %d s, leaving" % PS_LIFETIME_SECS,
          file=sys.stderr)
    return 3
  else:
    _worker(spec)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
