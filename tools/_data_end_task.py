"""One task of a ``tools/data_end`` cluster, started by it as its own process.

Owns what one process of that cluster does: a ps task serves; a replica
trains its own one-pass shard of batches under one driver
(MonitoredTrainingSession, a TF 2.15 Estimator or a Supervisor) until its
input ends, as a user's script would, and records what happened, one JSON
line per event in ``$DATA_END_EVENTS/<task>.jsonl``:

  ``ready``  the session exists (the chief's init tokens and sync loop are
             up); the replica then waits for the harness's ``go`` file, so
             that every replica starts training together;
  ``go``     it starts training;
  ``batch``  a batch was trained: its global id, the global step after it;
  ``ended``  the training loop ended, and why (``data``: the input raised
             OutOfRangeError; ``token queue closed``: the token dequeue did;
             ``stop``: the session asked to stop; for the Estimator, whose
             loop is not the script's: ``data`` when its session ended
             normally with the whole shard trained, else ``returned``);
  ``final``  the global step once the session was closed;
  ``error``  anything else ended it (the process then exits 1).

The model: a small linear regression on features of the example ids, and a
recorder variable ``seen`` of shape [total batches] on the ps. Batch ``b``
(a global id: replica i's batches are ``offset_i .. offset_i + shard_i - 1``)
pushes ``-onehot(b) / learning_rate`` as the gradient of ``seen``; an applied
update averages its n gradients, so with SGD every batch that was in an
applied update leaves ``seen[b] = 1/n`` and a dropped one leaves 0. The
harness reads ``seen`` from the ps: trained batches are counted from the
updates applied, not from the replicas' own counts.

The spec comes as JSON in $DATA_END_SPEC (see tools/data_end), the place in
the cluster from TF_CONFIG (``examples/_task.py``).
"""

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

#: Features of the regression; its true weights.
TRUE_W = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
#: How often a replica looks for the harness's ``go`` file.
GO_POLL_SECS = 0.05


class Events:
  """This task's JSON lines, one per event, flushed as they are written."""

  def __init__(self, folder, name):
    self._file = open(os.path.join(folder, "%s.jsonl" % name), "a")

  def emit(self, event, **record):
    self._file.write(json.dumps(dict(record, event=event, t=time.time()))
                     + "\n")
    self._file.flush()


def shard_range(spec, replica):
  """(first global batch id, batches) of replica ``replica``'s shard."""
  shards = spec["shards"]
  return sum(shards[:replica]), shards[replica]


def wait_for_go(spec, events):
  """Reports ``ready``, then waits (bounded) for the harness's go."""
  events.emit("ready")
  deadline = time.monotonic() + spec["start_secs"]
  while not os.path.exists(spec["go_file"]):
    if time.monotonic() > deadline:
      raise SystemExit("no go from the harness within %s s of this replica's "
                       "session" % spec["start_secs"])
    time.sleep(GO_POLL_SECS)
  events.emit("go")


class _GoHook(tf.compat.v1.train.SessionRunHook):
  """``wait_for_go`` once the session exists (after the sync hook's init)."""

  def __init__(self, spec, events):
    self._spec, self._events = spec, events

  def after_create_session(self, session, coord):
    del session, coord
    wait_for_go(self._spec, self._events)


class _BatchHook(tf.compat.v1.train.SessionRunHook):
  """Records every trained batch and the loop's end, for the Estimator,
  whose loop is not the script's.

  ``end`` runs when the session ends normally, before its close waits for
  its threads (stock's chief may wait out its grace there): the loop ended
  then. Any normal end calls it, the token queue's close included (the
  token dequeue fails after its batch was read), so the end is the data's
  only when every batch of the shard was trained.
  """

  def __init__(self, batch_id, step_after, events, *, shard):
    self._fetches = {"id": batch_id, "step": step_after}
    self._events, self._shard = events, shard
    self.count = 0

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs(self._fetches)

  def after_run(self, run_context, run_values):
    self.count += 1
    self._events.emit("batch", id=int(run_values.results["id"]),
                      step=int(run_values.results["step"]))

  def end(self, session):
    del session
    self._events.emit("ended", by="data" if self.count == self._shard
                      else "returned")


def example_ids(spec, replica):
  """This replica's shard as a one-pass tf.data pipeline of batches of ids.

  No repeat: the iterator raises OutOfRangeError after the last batch.
  """
  first, count = shard_range(spec, replica)
  size = spec["batch_size"]
  return tf.data.Dataset.range(first * size, (first + count) * size).batch(
      size)


def make_optimizer(spec, num_replicas):
  """Stock's class or ours, wrapping plain SGD, R as the spec says."""
  sgd = tf.compat.v1.train.GradientDescentOptimizer(spec["learning_rate"])
  replicas = spec["replicas"] or num_replicas
  if spec["impl"] == "stock":
    return tf.compat.v1.train.SyncReplicasOptimizer(
        sgd, replicas_to_aggregate=replicas, total_num_replicas=num_replicas)
  options = {} if spec["policy"] is None else {"data_end": spec["policy"]}
  return sync_replicas.SyncReplicasOptimizer(
      sgd, replicas_to_aggregate=replicas, total_num_replicas=num_replicas,
      **options)


def model(ids, *, global_step, opt, spec):
  """The regression's loss on ``ids`` and the recorder; returns the ops.

  Returns:
    (train_op, batch id, the global step read after train_op in its run,
    the loss).
  """
  size, total = spec["batch_size"], sum(spec["shards"])
  batch_id = tf.cast(ids[0] // size, tf.int32)
  x = tf.sin(tf.cast(ids, tf.float32)[:, None] * 0.01 *
             tf.range(1.0, len(TRUE_W) + 1.0)[None, :])
  y = tf.linalg.matvec(x, tf.constant(TRUE_W))
  w = tf.compat.v1.get_variable("w", [len(TRUE_W)],
                                initializer=tf.zeros_initializer())
  seen = tf.compat.v1.get_variable("seen", [total], trainable=False,
                                   initializer=tf.zeros_initializer())
  loss = tf.reduce_mean(tf.square(tf.linalg.matvec(x, w) - y))
  # SGD moves ``seen`` by -rate times the update's average: 1/n at every
  # batch the update averaged.
  seen_grad = -tf.one_hot(batch_id, total) / spec["learning_rate"]
  grads = opt.compute_gradients(loss, var_list=[w]) + [(seen_grad, seen)]
  train_op = opt.apply_gradients(grads, global_step=global_step)
  with tf.control_dependencies([train_op]):
    step_after = tf.identity(global_step.read_value())
  return train_op, batch_id, step_after, loss


def state_graph(task, spec):
  """A graph of the job's global variables only, as every driver makes them.

  For a non-chief's wait for the chief's init, and the final state.
  Returns (graph, global step, recorder ``seen``).
  """
  graph = tf.Graph()
  with graph.as_default(), tf.compat.v1.device(
      tf.compat.v1.train.replica_device_setter(
          cluster=task.cluster, worker_device=_task.worker_device(task))):
    step = tf.compat.v1.train.get_or_create_global_step()
    tf.compat.v1.get_variable("w", [len(TRUE_W)])
    seen = tf.compat.v1.get_variable("seen", [sum(spec["shards"])],
                                     trainable=False)
  return graph, step, seen


def wait_for_chief(task, server, spec, config):
  """Polls for the chief's init (SessionManager would nap 30 s)."""
  graph, _, _ = state_graph(task, spec)
  with graph.as_default():
    _task.wait_for_chief(server.target,
                         tf.compat.v1.report_uninitialized_variables(),
                         config, timeout=spec["start_secs"])


def final_state(task, server, spec, config):
  """The ``final`` event's fields: the global step and, for the chief, the
  batches the recorder ``seen`` marks as trained.

  The chief's count, read once its session has closed (it closes after the
  other replicas' data ended, unless ``stop_together`` stopped it), is the
  job's: a run whose ps is stopped as soon as every replica exited (under
  sync-replicas-slurm, tests/test_slurm.py) leaves nothing for the harness
  to read at the end.
  """
  graph, step, seen = state_graph(task, spec)
  with tf.compat.v1.Session(server.target, graph=graph, config=config) as sess:
    found = {"step": int(sess.run(step))}
    if task.is_chief:
      found["trained"] = [int(i) for i in np.flatnonzero(sess.run(seen) > 1e-6)]
  return found


def ended_by(error):
  """Which input an OutOfRangeError came from: the data or the token queue."""
  text = error.message
  if "End of sequence" in text or "IteratorGetNext" in text:
    return "data"
  if "sync_token_q" in text:
    return "token queue closed"
  if "is closed and has insufficient elements" in text:
    return "data"  # The Supervisor's input queue (the token queue is named).
  return "OutOfRangeError: " + text.splitlines()[0][:120]


def run_mts(task, server, spec, events, config):
  """MonitoredTrainingSession with the optimizer's hook, until the data ends."""
  replica = task.replica_index
  with tf.Graph().as_default():
    with tf.compat.v1.device(_task.worker_device(task)):
      ids = tf.compat.v1.data.make_one_shot_iterator(
          example_ids(spec, replica)).get_next()
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        cluster=task.cluster, worker_device=_task.worker_device(task))):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      opt = make_optimizer(spec, task.num_replicas)
      train_op, batch_id, step_after, _ = model(ids, global_step=global_step,
                                             opt=opt, spec=spec)
    if not task.is_chief:
      wait_for_chief(task, server, spec, config)
    hooks = [opt.make_session_run_hook(task.is_chief,
                                       num_tokens=spec["init_tokens"]),
             _GoHook(spec, events)]
    why = "stop"
    with tf.compat.v1.train.MonitoredTrainingSession(
        master=server.target, is_chief=task.is_chief, hooks=hooks,
        config=config, stop_grace_period_secs=spec["grace_secs"],
        save_checkpoint_steps=None, save_checkpoint_secs=None,
        save_summaries_steps=None, save_summaries_secs=None,
        log_step_count_steps=None) as sess:
      try:
        while not sess.should_stop():
          _, b, step = sess.run([train_op, batch_id, step_after])
          events.emit("batch", id=int(b), step=int(step))
      except tf.errors.OutOfRangeError as e:
        why = ended_by(e)
        events.emit("ended", by=why)
        # As a user's loop: MonitoredSession ends normally on it.
        raise
      events.emit("ended", by=why)


def run_supervisor(task, server, spec, events, config):
  """Supervisor with TF 0.12's recipe and an input queue that closes.

  The input is a FIFOQueue of example ids fed by a QueueRunner for one epoch
  (``range_input_producer(num_epochs=1)``) and batched by another
  (``tf.compat.v1.train.batch``): the dequeue raises OutOfRangeError once the
  epoch is read. The loop is the user's; with ours (when the optimizer has
  it) the script announces its data end, the one line Supervisor needs.
  """
  replica = task.replica_index
  first, count = shard_range(spec, replica)
  size = spec["batch_size"]
  with tf.Graph().as_default():
    with tf.compat.v1.device(_task.worker_device(task)):
      # The input pipeline on the replica's own device: its epoch counter is
      # a local variable, which replica_device_setter would put on the ps,
      # shared by every replica.
      one = tf.compat.v1.train.range_input_producer(
          count * size, num_epochs=1, shuffle=False).dequeue()
      ids = tf.compat.v1.train.batch(
          [tf.cast(one, tf.int64) + first * size], batch_size=size)
      input_init = tf.compat.v1.local_variables_initializer()
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        cluster=task.cluster, worker_device=_task.worker_device(task))):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      opt = make_optimizer(spec, task.num_replicas)
      train_op, batch_id, step_after, _ = model(ids, global_step=global_step,
                                             opt=opt, spec=spec)
      local_init_op = tf.group(
          opt.chief_init_op if task.is_chief else opt.local_step_init_op,
          input_init)
      init_tokens_op = opt.get_init_tokens_op(num_tokens=spec["init_tokens"])
      chief_queue_runner = opt.get_chief_queue_runner()
    sv = tf.compat.v1.train.Supervisor(
        is_chief=task.is_chief, logdir=None,
        init_op=tf.compat.v1.global_variables_initializer(),
        local_init_op=local_init_op,
        ready_for_local_init_op=opt.ready_for_local_init_op,
        recovery_wait_secs=1, global_step=global_step,
        stop_grace_secs=spec["grace_secs"])
    announce = getattr(opt, "announce_data_end", None)
    with sv.managed_session(server.target, config=config) as sess:
      if task.is_chief:
        sess.run(init_tokens_op)
        sv.start_queue_runners(sess, [chief_queue_runner])
      wait_for_go(spec, events)
      why = "stop"
      try:
        while not sv.should_stop():
          _, b, step = sess.run([train_op, batch_id, step_after])
          events.emit("batch", id=int(b), step=int(step))
      except tf.errors.OutOfRangeError as e:
        why = ended_by(e)
        events.emit("ended", by=why)
        if why == "data" and announce is not None:
          announce(sess)  # sync_replicas: the Supervisor loop's one line.
        raise  # managed_session takes it as a clean stop.
      events.emit("ended", by=why)


def run_estimator(task, server, spec, events, config):
  """A TF 2.15 Estimator with a finite input_fn and the optimizer's hook."""
  replica = task.replica_index
  estimator = tf.compat.v1.estimator
  opt = make_optimizer(spec, task.num_replicas)

  def model_fn(features, labels, mode):
    del labels
    global_step = tf.compat.v1.train.get_global_step()
    train_op, batch_id, step_after, loss = model(
        features, global_step=global_step, opt=opt, spec=spec)
    return estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                   training_hooks=[_BatchHook(
                                       batch_id, step_after, events,
                                       shard=shard_range(spec, replica)[1])])

  run_config = estimator.RunConfig(
      model_dir=spec["model_dir"], session_config=config,
      save_checkpoints_steps=None, save_checkpoints_secs=None,
      save_summary_steps=None, log_step_count_steps=None)
  model_ = estimator.Estimator(model_fn=model_fn, config=run_config)
  if not task.is_chief:
    wait_for_chief(task, server, spec, config)
  model_.train(lambda: example_ids(spec, replica),
               hooks=[opt.make_session_run_hook(
                   task.is_chief, num_tokens=spec["init_tokens"]),
                      _GoHook(spec, events)])


DRIVERS = {"mts": run_mts, "supervisor": run_supervisor,
           "estimator": run_estimator}


def main():
  spec = json.loads(os.environ["DATA_END_SPEC"])
  # SIGUSR1 prints every thread's stack (how the harness asks a hung task
  # where it is), and no task outlives the harness's whole-run bound.
  faulthandler.register(signal.SIGUSR1, all_threads=True)
  faulthandler.dump_traceback_later(spec["lifetime_secs"], exit=True)
  _task.setup_logging(name="sync_replicas",
                      fmt="%(levelname)s:%(name)s:%(message)s")
  tf.get_logger().setLevel("INFO")
  tf.compat.v1.disable_eager_execution()
  task = _task.resolve(_task_flags())
  name = "%s%d" % (task.job_name, task.task_index)
  server = _task.start_server(task)
  if task.job_name == "ps":
    _task.serve_forever(server, task)
    return 0
  events = Events(os.environ["DATA_END_EVENTS"], name)
  config = _task.session_config(task, op_timeout_ms=spec["op_timeout_ms"])
  try:
    DRIVERS[spec["driver"]](task, server, spec, events, config)
    events.emit("final", **final_state(task, server, spec, config))
  except BaseException as e:
    events.emit("error", error="%s: %s" % (type(e).__name__, (
        str(e).splitlines() or [""])[0][:300]))
    raise
  return 0


def _task_flags():
  import argparse  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser()
  _task.add_cluster_flags(parser)
  return parser.parse_args([])


if __name__ == "__main__":
  sys.exit(main())
