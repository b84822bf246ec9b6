"""One task of a ``tools/soak`` cluster, started by it through tools/launch.

Reads its place from TF_CONFIG (``examples/_task.py``). A ps task serves
until the soak stops or kills it. A replica (the chief, then the workers)
trains a traced model: next to a small linear model it pushes, for the local
step ``s`` its token carried, a gradient that adds 1 to cell
``(s mod ROWS, replica)`` of a ``trace`` variable when it is applied. Each
update therefore adds ``R`` to exactly one row, the row of the step it
applies, when every one of its ``R`` gradients was fresh; a stale gradient
lands in another row. ``trace`` is checkpointed with the rest of the model,
so a restore rolls it back together with the global step.

Structured events go, one JSON line each, to ``$SOAK_EVENTS/<task>.jsonl``
(appended across restarts): ``ready`` when a session exists (with the global
step then), ``checkpoint`` after the chief saved one (with its step),
``done`` at a clean end. The run ends when ``$SOAK_EVENTS/stop.json`` names a
target step and the global step reached it.
"""

import argparse
import faulthandler
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import sync_replicas  # pylint: disable=g-import-not-at-top
from examples import _task  # pylint: disable=g-import-not-at-top

#: Rows of ``trace``; a step's row is its number modulo this. A stale
#: gradient would have to be exactly a multiple of it behind to go unseen.
ROWS = 1024
#: The plain step of a generation-encoded local step (see _restart.py).
STEP_MASK = (1 << 32) - 1
#: How often the chief logs what an update waits for while none lands.
STALL_LOG_SECS = 5.0


#: How often a replica reports that it is stepping, at most, in seconds.
ALIVE_SECS = 0.5


def _emit(event, **record):
  path = os.path.join(os.environ["SOAK_EVENTS"], "%s.jsonl" % _NAME)
  with open(path, "a") as f:
    f.write(json.dumps(dict(record, event=event, t=time.time())) + "\n")


_NAME = "?"


def _stop_target():
  """The target step once the soak wrote it, else None."""
  try:
    with open(os.path.join(os.environ["SOAK_EVENTS"], "stop.json")) as f:
      return int(json.load(f)["target"])
  except (OSError, ValueError, KeyError):
    return None  # Not written yet, or being written.


class _StopAtTarget(tf.compat.v1.train.SessionRunHook):
  """Requests a stop once the global step reaches the soak's target.

  ``step_after`` reads the global step once the run's token is in.
  """

  def __init__(self, step_after):
    self._step_after = step_after

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs(self._step_after)

  def after_run(self, run_context, run_values):
    target = _stop_target()
    if target is not None and run_values.results >= target:
      run_context.request_stop()


class _AfterCreate(tf.compat.v1.train.SessionRunHook):
  """Relabels the gradient and reports ``ready`` whenever a session starts.

  Listed after the sync hook, so it runs after that hook's local init: the
  label is then the local step the new session starts from.
  """

  def __init__(self, relabel, global_step):
    self._relabel, self._global_step = relabel, global_step

  def after_create_session(self, session, coord):
    del coord
    session.run(self._relabel)
    _emit("ready", step=int(session.run(self._global_step)))


class _Checkpoints(tf.compat.v1.train.CheckpointSaverListener):
  """Reports every checkpoint, and whether it agrees with itself.

  The file just written is read back: a checkpoint whose ``trace`` holds a
  different number of updates than its global step says was saved while an
  update was being applied, and a restore from it redoes or skips that one.
  """

  def __init__(self, checkpoint_dir, replicas):
    self._dir, self._replicas = checkpoint_dir, replicas

  def after_save(self, session, global_step_value):
    del session, global_step_value  # The file's own step is what counts.
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(self._dir))
    step = int(reader.get_tensor("global_step"))
    found = np.rint(reader.get_tensor("trace").sum(axis=1)).astype(np.int64)
    want = np.full(ROWS, step // ROWS, np.int64)
    want[:step % ROWS] += 1
    want *= self._replicas
    bad = [(int(r), int(found[r]), int(want[r]))
           for r in np.nonzero(found != want)[0][:5]]
    _emit("checkpoint", step=step, bad_rows=bad)


def _session_loop(session_kwargs, step_op, delay, rng, state):
  """Trains in one MonitoredTrainingSession until the soak's target."""
  with tf.compat.v1.train.MonitoredTrainingSession(**session_kwargs) as sess:
    while not sess.should_stop():
      # Random pauses shuffle who arrives last, so that the backup is not
      # always the same replica.
      time.sleep(rng.uniform(0, 2 * delay))
      sess.run(step_op)
      state["runs"] += 1
      if time.monotonic() - state["alive_at"] > ALIVE_SECS:
        # The soak sets the target step only once every replica stepped
        # after the last fault (tools/soak).
        state["alive_at"] = time.monotonic()
        _emit("alive", runs=state["runs"])


def _train(task, server, spec):
  replicas = task.num_replicas - spec["backups"]
  index = task.replica_index
  with tf.Graph().as_default():
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        cluster=task.cluster, worker_device=_task.worker_device(task))):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      trace = tf.compat.v1.get_variable(
          "trace", [ROWS, task.num_replicas],
          initializer=tf.zeros_initializer())
      w = tf.compat.v1.get_variable("w", [4],
                                    initializer=tf.zeros_initializer())
      # The label lives in a replica-local variable, not a feed: a run that
      # MonitoredSession retries in a recreated session must push the new
      # session's local step, not the one fed to the failed run.
      with tf.compat.v1.device(_task.worker_device(task)):
        label = tf.compat.v1.get_variable(
            "trace_label", [], tf.int64, initializer=tf.zeros_initializer(),
            collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
            trainable=False)
      row = tf.cast(tf.math.floormod(tf.bitwise.bitwise_and(label, STEP_MASK),
                                     ROWS), tf.int32)
      xs = np.random.default_rng(index).normal(size=(8, 4)).astype(np.float32)
      loss = tf.reduce_mean(tf.square(tf.linalg.matvec(xs, w) - 1.0))
      # Learning rate 1 on -R * e[row, replica]: the mean of R such
      # gradients adds 1 to each contributor's cell.
      trace_grad = -replicas * tf.tensordot(
          tf.one_hot(row, ROWS), tf.one_hot(index, task.num_replicas), axes=0)
      opt = sync_replicas.SyncReplicasOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(1.0),
          replicas_to_aggregate=replicas, total_num_replicas=task.num_replicas,
          stall_log_secs=STALL_LOG_SECS, **spec["options"])
      train_op = opt.apply_gradients(
          [(trace_grad, trace), (tf.gradients(loss, w)[0], w)],
          global_step=global_step)
    with tf.compat.v1.device(_task.worker_device(task)):
      relabel = tf.compat.v1.assign(label, opt.local_step)
      # Each step relabels in its own run, once its token is taken: the
      # push read the label before train_op ended, the assign runs after.
      # A second run per step for the relabel cost 20% more CPU per update
      # (a whole MonitoredSession run, hooks and a ps read included).
      with tf.control_dependencies([train_op]):
        step_op = tf.compat.v1.assign(label, opt.local_step)
        # The stop reads the global step once the token is in, as the
        # relabel's own run did: read at the step's start, it can miss the
        # update that reached the target, and the replicas push one more.
        step_after = tf.identity(global_step.read_value())
    hooks = [opt.make_session_run_hook(task.is_chief),
             _AfterCreate(relabel, global_step), _StopAtTarget(step_after)]
    config = _task.session_config(task, op_timeout_ms=spec["op_timeout_ms"])
    chief_hooks = []
    if task.is_chief:
      listeners = [_Checkpoints(spec["checkpoint_dir"], replicas)]
      if spec["save_pause"]:
        # First: every save waits for the update being applied, if any.
        listeners.insert(0, opt.make_checkpoint_saver_listener())
      chief_hooks.append(tf.compat.v1.train.CheckpointSaverHook(
          spec["checkpoint_dir"], save_steps=spec["checkpoint_steps"],
          listeners=listeners))
    else:
      _task.wait_for_chief(server.target, opt.ready_for_local_init_op, config)
    session_kwargs = dict(
        master=server.target, is_chief=task.is_chief, hooks=hooks,
        chief_only_hooks=chief_hooks, config=config,
        checkpoint_dir=spec["checkpoint_dir"] if task.is_chief else None,
        save_checkpoint_steps=None, save_checkpoint_secs=None,
        save_summaries_steps=None, save_summaries_secs=None,
        log_step_count_steps=None, stop_grace_period_secs=2)
    rng = np.random.default_rng()
    state = {"runs": 0, "alive_at": 0.0}
    while True:
      try:
        _session_loop(session_kwargs, step_op, spec["delay"], rng, state)
        break
      except tf.errors.CancelledError as e:
        # A restart that TensorFlow reports as a cancel: MonitoredSession
        # would end the process; a new one recovers, as for an abort
        # (docs/operations.md, "A restart reported as CancelledError").
        if not sync_replicas.is_recoverable_error(e):
          raise
        _emit("recreated", error=e.message.splitlines()[-3:])
    runs = state["runs"]
  _emit("done", runs=runs)
  return 0


def main(argv=None):
  global _NAME
  del argv
  # SIGUSR1 prints every thread's stack: how the soak asks a hung task why.
  faulthandler.register(signal.SIGUSR1, all_threads=True)
  # Our INFO lines (what a stop decided) in tasks.log: with no handler of
  # its own, Python prints only warnings and above. And the shared
  # plumbing's (wait_for_chief's).
  _task.setup_logging(name="sync_replicas",
                      fmt="%(levelname)s:%(name)s:%(message)s")
  _task.setup_logging()
  tf.get_logger().setLevel("INFO")
  tf.compat.v1.disable_eager_execution()
  spec = json.loads(os.environ["SOAK_SPEC"])
  parser = argparse.ArgumentParser()
  _task.add_cluster_flags(parser)
  task = _task.resolve(parser.parse_args([]))
  _NAME = "%s%d" % (task.job_name, task.task_index)
  server = _task.start_server(task)
  if task.job_name == "ps":
    _emit("ready")
    _task.serve_forever(server, task)
    return 0
  return _train(task, server, spec)


if __name__ == "__main__":
  sys.exit(main())
