"""tf-slim's ``train`` with a logdir, as a ported TF1 script runs it.

``python tests/slim_logdir_task.py LOGDIR``: eager execution off for the
whole process, as ported zoo scripts do (with a logdir, the Supervisor's
service threads build on the default graph, which under TF 2's eager
default they cannot: stock and ours alike then stop with a TypeError). One
chief on an in-process LocalCluster (1 ps) trains ``NUMBER_OF_STEPS`` steps
with our optimizer through ``sync_replicas.slim_train``, and prints one
JSON line: the global step reached and the seconds ``train()`` took after
the last step (the Supervisor's ``stop()``, twice: tf-slim's and
``managed_session``'s).
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # pylint: disable=g-import-not-at-top
import tf_slim  # pylint: disable=g-import-not-at-top

import sync_replicas  # pylint: disable=g-import-not-at-top

NUMBER_OF_STEPS = 3


def main(argv):
  tf.compat.v1.disable_eager_execution()
  logdir = argv[1]
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
      ps_tasks=1, worker_device="/job:worker/task:0")):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    v = tf.compat.v1.get_variable("v", initializer=tf.constant([1.0, 2.0]))
    opt = sync_replicas.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.25),
        replicas_to_aggregate=1, total_num_replicas=1)
    train_op = tf_slim.learning.create_train_op(tf.reduce_sum(v * v), opt)
  last_step_at = []

  def step_fn(sess, op, step, kwargs):
    loss, should_stop = tf_slim.learning.train_step(sess, op, step, kwargs)
    if should_stop:
      last_step_at.append(time.monotonic())
    return loss, should_stop

  sync_replicas.slim_train(
      train_op, logdir, train_step_fn=step_fn,
      master=cluster.worker_targets[0], number_of_steps=NUMBER_OF_STEPS,
      sync_optimizer=opt, log_every_n_steps=0,
      session_config=tf.compat.v1.ConfigProto(operation_timeout_in_ms=30000))
  stop_secs = time.monotonic() - last_step_at[0]
  with tf.compat.v1.Session(cluster.worker_targets[0]) as sess:
    step = int(sess.run(global_step))
  print(json.dumps({"global_step": step, "stop_secs": stop_secs}))


if __name__ == "__main__":
  main(sys.argv)
