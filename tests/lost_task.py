"""One task of README's program, for tests/test_lost.py and test_gone.py.

``python tests/lost_task.py SPEC_JSON``: README's program (1 ps, 3 workers,
``device_filters``, ``wait_for_chief_init``, MonitoredTrainingSession with
the sync hook and StopAtStepHook, the ps's ``done`` queue), with the class
(``impl``: "stock" or "ours"), ``replicas_to_aggregate`` and
``operation_timeout_in_ms`` from the spec, and with ``batches`` a one-pass
input of that many batches per worker. One change to README's ending:
the chief puts one more item in ``done`` for each worker declared gone
(``worker_gone_secs``), which never puts its own, so that the ps ends with
the job. A task appends JSON lines to its ``out`` file: a worker ``ready``
once its session exists, ``step`` with the global step every 10 runs, and
at its end ``done`` (with the global step, and for the chief the workers
gone) or ``error`` (the exception's type, whether it is a
``DeadlineExceededError``, and its message); the ps ``done`` once every
replica is, or ``error`` when the chief stopped the job with one
(README's ``wait_for_job_end``; with ``"ps_waits": "done"`` in the spec it
waits only for the replicas' items, and serves a failed job on). With
``pause_secs`` in the spec a worker sleeps that long before each train
run, so that a step limit lies a known time past a step (no CPU spent on
the steps that only fill that time). The
test reads what the user of each process would have seen without parsing
tracebacks.
"""

import json
import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # pylint: disable=g-import-not-at-top

import sync_replicas  # pylint: disable=g-import-not-at-top

#: A ps serves until the test kills it; past this it leaves by itself
#: (longer than pytest-timeout, so only an orphan ever gets there).
PS_LIFETIME_SECS = 300


def _emit(path, **record):
  with open(path, "a") as f:
    f.write(json.dumps(dict(record, t=time.time())) + "\n")


def _done_queue(spec):
  with tf.compat.v1.device("/job:ps/task:0"):
    return tf.queue.FIFOQueue(len(spec["cluster"]["worker"]), tf.int32,
                              shapes=[[]], shared_name="done")


def _train(spec, server, cluster, index):
  me = "/job:worker/task:%d" % index
  is_chief = index == 0
  config = tf.compat.v1.ConfigProto(
      device_filters=["/job:ps", me],
      operation_timeout_in_ms=spec["op_timeout_ms"])
  replicas = len(spec["cluster"]["worker"])
  done = _done_queue(spec)
  cls = (tf.compat.v1.train.SyncReplicasOptimizer if spec["impl"] == "stock"
         else sync_replicas.SyncReplicasOptimizer)
  with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
      cluster=cluster, worker_device=me)):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    x = tf.random.normal([32])
    if spec.get("batches") is not None:
      # A one-pass input of that many batches: its end raises OutOfRange,
      # which ends this worker's MonitoredSession (data_end).
      with tf.compat.v1.device(me):
        batch = tf.compat.v1.data.make_one_shot_iterator(
            tf.data.Dataset.range(spec["batches"])).get_next()
      x += 0.0 * tf.cast(batch, tf.float32)
    y = 3.0 * x + 2.0 + tf.random.normal([32], stddev=0.1)
    w = tf.compat.v1.get_variable("w", [], initializer=tf.zeros_initializer())
    b = tf.compat.v1.get_variable("b", [], initializer=tf.zeros_initializer())
    loss = tf.reduce_mean(tf.square(w * x + b - y))
    opt = cls(tf.compat.v1.train.GradientDescentOptimizer(0.1),
              replicas_to_aggregate=spec["replicas"],
              total_num_replicas=replicas)
    train_op = opt.minimize(loss, global_step=global_step)
  tell_ps = done.enqueue(1)
  if not is_chief:
    sync_replicas.wait_for_chief_init(server.target,
                                      opt.ready_for_local_init_op,
                                      config=config)
  hooks = [opt.make_session_run_hook(is_chief),
           tf.compat.v1.train.StopAtStepHook(last_step=spec["steps"])]
  runs = 0
  pause = spec.get("pause_secs") or 0.0
  with tf.compat.v1.train.MonitoredTrainingSession(
      master=server.target, is_chief=is_chief, hooks=hooks, config=config,
      max_wait_secs=60, save_summaries_steps=None, save_summaries_secs=None,
      log_step_count_steps=None) as sess:
    _emit(spec["out"], event="ready")
    while not sess.should_stop():
      if pause:
        time.sleep(pause)
      sess.run(train_op)
      runs += 1
      if runs % 10 == 0:
        _emit(spec["out"], event="step", step=int(sess.run_step_fn(
            lambda step_context: step_context.session.run(global_step))))
  with tf.compat.v1.Session(server.target, config=config) as sess:
    final = int(sess.run(global_step))
    # The chief also tells the ps for each worker declared gone, which
    # never will (README's program puts only its own item).
    gone = (opt.workers_gone(sess)
            if is_chief and spec["impl"] == "ours" else [])
    for _ in range(1 + len(gone)):
      sess.run(tell_ps)
  return final, gone


def main(argv):
  spec = json.loads(argv[1])
  if spec.get("log_info"):
    # The package's INFO lines (a look repeated, a worker taken back) in
    # this task's log, where Python's default shows only warnings.
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sync_replicas").setLevel(logging.INFO)
  tf.compat.v1.disable_eager_execution()
  cluster = tf.train.ClusterSpec(spec["cluster"])
  server = tf.distribute.Server(cluster, job_name=spec["job"],
                                task_index=spec["task"])
  if spec["job"] == "ps":
    # Serves until every replica is done (README's ps), within a bound
    # longer than pytest-timeout: only an orphan ever reaches it.
    config = tf.compat.v1.ConfigProto(
        device_filters=["/job:ps"],
        operation_timeout_in_ms=PS_LIFETIME_SECS * 1000)
    replicas = len(spec["cluster"]["worker"])
    if spec.get("ps_waits") == "done":
      with tf.compat.v1.Session(server.target, config=config) as sess:
        sess.run(_done_queue(spec).dequeue_many(replicas))
    else:
      try:
        sync_replicas.wait_for_job_end(server.target, _done_queue(spec),
                                       replicas, config=config)
      except Exception as e:  # pylint: disable=broad-except
        _emit(spec["out"], event="error", type=type(e).__name__,
              message=str(e)[:4000])
        return 1
    _emit(spec["out"], event="done")
    return 0
  try:
    step, gone = _train(spec, server, cluster, spec["task"])
  except Exception as e:  # pylint: disable=broad-except
    _emit(spec["out"], event="error", type=type(e).__name__,
          deadline=isinstance(e, tf.errors.DeadlineExceededError),
          message=str(e)[:4000])
    return 1
  _emit(spec["out"], event="done", step=step, gone=gone)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
