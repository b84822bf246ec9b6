"""One task of tests/test_timeline.py's process cluster, as its own process.

``python tests/timeline_task.py SPEC_JSON JOB TASK``: the ps serves until
the test kills it; a worker trains a small linear model with
``timeline_dir`` until the global step reaches ``last_step``, and exits 0.
A worker whose task is ``slow_task`` sleeps ``delay_secs`` inside its input
(a ``tf.py_function`` the loss depends on): a fixed delay in the step, as a
slow input pipeline would add.

Every update aggregates all workers, one gradient each
(``one_gradient_per_worker``): with stock's shared token queue the fast
workers would fill the slow one's slots and no update would wait for it.
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import sync_replicas  # pylint: disable=g-import-not-at-top

#: A ps that the test did not kill leaves by itself after this (an orphan).
PS_LIFETIME_SECS = 300
OP_TIMEOUT_MS = 60_000


class _Ready(tf.compat.v1.train.SessionRunHook):
  """Creates ``path`` once the session exists: the test starts the other
  workers after the chief's, so that none finds the model uninitialized and
  naps SessionManager's 30 s recovery wait."""

  def __init__(self, path):
    self._path = path

  def after_create_session(self, session, coord):
    del session, coord
    with open(self._path, "w"):
      pass


def main(spec_path, job, task):
  with open(spec_path) as f:
    spec = json.load(f)
  cluster = tf.train.ClusterSpec(spec["cluster"])
  config = tf.compat.v1.ConfigProto(
      operation_timeout_in_ms=OP_TIMEOUT_MS,
      device_filters=["/job:ps", "/job:%s/task:%d" % (job, task)])
  server = tf.distribute.Server(cluster, job_name=job, task_index=task,
                                config=config)
  if job == "ps":
    time.sleep(PS_LIFETIME_SECS)
    return 0
  tf.compat.v1.disable_eager_execution()
  workers = len(spec["cluster"]["worker"])
  delay = spec["delay_secs"] if task == spec["slow_task"] else 0.0
  rng = np.random.default_rng(task)
  with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
      cluster=cluster, worker_device="/job:worker/task:%d" % task)):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    w = tf.compat.v1.get_variable("w", [4], initializer=tf.zeros_initializer())
    x = tf.constant(rng.normal(size=(16, 4)).astype(np.float32))
    # The input arrives after `delay` seconds, every step.
    ready = tf.py_function(lambda: time.sleep(delay) or np.float32(1.0), [],
                           tf.float32)
    loss = tf.reduce_mean(tf.square(tf.linalg.matvec(x * ready, w) - 1.0))
    opt = sync_replicas.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.05),
        replicas_to_aggregate=workers, total_num_replicas=workers,
        one_gradient_per_worker=True, worker_index=task,
        timeline_dir=spec["timeline_dir"])
    train_op = opt.minimize(loss, global_step=global_step)
  hooks = [opt.make_session_run_hook(task == 0),
           tf.compat.v1.train.StopAtStepHook(last_step=spec["last_step"]),
           _Ready(os.path.join(spec["ready_dir"], "worker-%d" % task))]
  with tf.compat.v1.train.MonitoredTrainingSession(
      master=server.target, is_chief=task == 0, hooks=hooks, config=config,
      stop_grace_period_secs=2, log_step_count_steps=None) as sess:
    while not sess.should_stop():
      sess.run(train_op)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
