"""The barrier's timeline: when each phase of each update happened, per task.

Owns, when the optimizer is built with ``timeline_dir`` (or the environment
variable ``SYNC_REPLICAS_TIMELINE``), the timestamps the protocol's runs
fetch and the records each task writes:

* a worker's train-op run: when the hook handed the run over (its compute
  starts), when its gradients existed, when its pushes had landed on the ps,
  when its token arrived, and the local step it pushed at and the token's
  step;
* the chief's sync-loop run: when it began waiting for gradients, when every
  take returned (``replicas_to_aggregate`` had arrived), when the wrapped
  optimizer's update was applied, when the tokens were released, and the
  new global step.

The timestamps are ``tf.timestamp`` ops in our own name scope that nothing
depends on: only the runs that fetch them (the hook's, the chief's loop)
compute them, each after what it follows, on the device that waits for it
(this worker's, for its pushes and token). Nothing is added to the train
op or the sync op, so every op of stock's graph is unchanged. Each record is
handed to a ``TimelineWriter`` (``_timeline_writer``), which writes it off
the step's path. ``sync_replicas.timeline`` merges the tasks' files.

With no directory, ``NoTimeline`` stands in and builds nothing.
"""

import os
import time

import tensorflow as tf

from sync_replicas import _task_names
from sync_replicas import _timeline_writer

#: Read by the optimizer's constructor when ``timeline_dir`` is None, so that
#: a script run unchanged (``python -m sync_replicas.patch``) can turn it on.
ENV = "SYNC_REPLICAS_TIMELINE"


def directory_from(timeline_dir, environ=None):
  """``timeline_dir``, else the environment's, else None; checked.

  Raises:
    ValueError: ``timeline_dir`` is neither None nor a path.
  """
  if timeline_dir is None:
    timeline_dir = (os.environ if environ is None else environ).get(ENV) or None
    if timeline_dir is None:
      return None
  if not isinstance(timeline_dir, (str, os.PathLike)) or not str(timeline_dir):
    raise ValueError(
        "timeline_dir must be a directory path (str or os.PathLike) or None, "
        "got %r. Pass where each task writes its timeline file, e.g. the "
        "job's checkpoint_dir + '/timeline'." % (timeline_dir,))
  return os.fspath(timeline_dir)


def task_name(device):
  """The task's name (``_task_names``: ``worker1``), file-name-safe, from a
  device string; ``pid<N>`` for an unplaced one."""
  return _task_names.of_device(device) or "pid%d" % os.getpid()


class Timeline:
  """The timestamps of one optimizer's graph, and where they are written."""

  enabled = True

  def __init__(self, directory, *, scope, local_anchor):
    self.directory = directory
    # One absolute scope, re-entered as is: "timeline", not "timeline_1"...
    with tf.compat.v1.name_scope(scope), \
        tf.compat.v1.name_scope("timeline") as own:
      self._scope = own
    self._worker_device = local_anchor.device
    self.task = task_name(self._worker_device)
    #: What the hook fetches with every train-op run (set by ``worker``).
    self.worker_fetches = None
    #: What the chief's loop fetches with every sync op (set by ``chief``).
    self.chief_fetches = None
    #: This worker's local step, read once per session (set by ``worker``).
    self.local_step_read = None

  def _stamp(self, after, name, device):
    """A timestamp on ``device`` taken once everything in ``after`` ran.

    What ``after`` runs on other devices is first grouped there, one no-op
    per device: every cross-device control edge is a transfer of its own,
    and one per device is all a mark needs.
    """
    by_device = {}
    for item in after:
      op = getattr(item, "op", item)
      by_device.setdefault(op.device, []).append(op)
    with tf.compat.v1.name_scope(self._scope):
      deps = by_device.pop(device, [])
      for where, ops in sorted(by_device.items()):
        with tf.compat.v1.device(where):
          deps.append(tf.group(*ops, name=name + "_after") if len(ops) > 1
                      else ops[0])
      with tf.compat.v1.device(device), tf.control_dependencies(deps):
        return tf.timestamp(name=name)

  def worker(self, gradients, pushes, token, local_step, *, train_runs):
    """The worker's marks: gradients computed, pushes landed, token in.

    The hook adds them only to runs that run the train op (``train_runs``,
    the optimizer's ``_train_runs.TrainRuns``): fetched in any other run,
    they would run a push and take a token.

    The step a run pushes at is the local step when it began: the token the
    previous run got, or, for a session's first run, ``local_step_read``
    run once after the local init. Read in the run itself it would race the
    run's own assignment of the new token.
    """
    device = self._worker_device
    with tf.compat.v1.name_scope(self._scope), tf.compat.v1.device(device):
      self.local_step_read = tf.cast(local_step.read_value(), tf.int64,
                                     name="local_step")
      # The token's value crosses to this worker anyway (the train op
      # stores it); a mark that follows this local copy adds no transfer.
      got = tf.cast(token, tf.int64, name="token")
    # Each mark also follows the one before, so that two marks whose ops
    # finish together are never read in the wrong order.
    grads = self._stamp(gradients, "gradients_at", device)
    pushed = self._stamp(list(pushes) + [grads], "pushed_at", device)
    self.worker_fetches = {
        "grads": grads,
        "pushed": pushed,
        "token": self._stamp([got, pushed], "token_at", device),
        "got": got,
    }
    self._train_runs = train_runs

  def runs_train_op(self, fetches):
    """Whether a run of ``fetches`` runs the train op
    (``_train_runs.TrainRuns``)."""
    return self._train_runs.runs_train_op(fetches)

  def chief(self, aggregated, update_op, released, global_step):
    """The chief's marks: takes returned, update applied, tokens released."""
    device = self._worker_device
    with tf.compat.v1.name_scope(self._scope), \
        tf.compat.v1.device(global_step.device), \
        tf.control_dependencies([update_op]):
      step = tf.cast(global_step.read_value(), tf.int64, name="applied_step")
    taken = self._stamp(aggregated, "taken_at", device)
    applied = self._stamp([update_op, taken], "applied_at", device)
    self.chief_fetches = {
        "taken": taken,
        "applied": applied,
        "released": self._stamp([released, applied], "released_at", device),
        "step": step,
    }

  def writer(self, role):
    """The task's writer for ``role`` ("worker" or "chief")."""
    return _timeline_writer.for_path(
        os.path.join(self.directory, "%s.%s.jsonl" % (self.task, role)))


class NoTimeline:
  """No ``timeline_dir``: ``Timeline``'s methods, building nothing."""

  enabled = False
  worker_fetches = None
  chief_fetches = None
  local_step_read = None

  def worker(self, gradients, pushes, token, local_step, *, train_runs):
    del gradients, pushes, token, local_step, train_runs

  def chief(self, aggregated, update_op, released, global_step):
    del aggregated, update_op, released, global_step

  def writer(self, role):
    del role


def chief_callable(timeline, sess, sync_op, *, feed_list=None):
  """``sess.make_callable(sync_op)``, recording each run on ``timeline``.

  With a timeline, the same run also fetches the chief's marks, and the
  callable hands them to the chief's writer with the time the run began
  (when the chief started waiting for gradients).
  """
  marks = timeline.chief_fetches if timeline is not None else None
  if not marks:
    return sess.make_callable(sync_op, feed_list=feed_list)
  names = sorted(marks)
  run = sess.make_callable([sync_op] + [marks[n] for n in names],
                           feed_list=feed_list)
  writer = timeline.writer("chief")

  def run_and_record(*feeds):
    began = time.time()
    _, *values = run(*feeds)
    writer.record(kind="update", began=began,
                  **{n: v.item() for n, v in zip(names, values, strict=True)})
  return run_and_record


def build(directory, **kwargs):
  """``Timeline(directory, **kwargs)``, or ``NoTimeline`` for None."""
  return Timeline(directory, **kwargs) if directory else NoTimeline()


def gradient_tensors(grads_and_vars):
  """The tensors a worker's gradients-computed mark must follow."""
  found = []
  for grad, _ in grads_and_vars:
    if grad is None:
      continue
    found.append(grad.values if isinstance(grad, tf.IndexedSlices) else grad)
  return found
