"""Digits between-graph with MonitoredTrainingSession and the optimizer's hook.

The most common TF1 pattern of the 2017-2019 era: the sync optimizer's
``make_session_run_hook`` and a StopAtStepHook go to
MonitoredTrainingSession; the chief writes checkpoints to --logdir. The loop
is ``while not sess.should_stop()``, and the session closes as the ``with``
block ends. One program for every task of the cluster:

  python monitored_session.py --ps_hosts=H:P --worker_hosts=H:P,H:P \\
      --job_name=ps --task_index=0        # and worker 0 (chief), worker 1
"""

import argparse
import sys

import tensorflow as tf

import digits_cluster


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  digits_cluster.add_flags(parser)
  args = parser.parse_args(argv)
  server = digits_cluster.start_server(args)
  tf.compat.v1.disable_eager_execution()
  cluster = digits_cluster.cluster_spec(args)
  num_workers = cluster.num_tasks("worker")
  is_chief = args.task_index == 0
  images_np, labels_np = digits_cluster.shard(args)

  with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
      worker_device=digits_cluster.worker_device(args), cluster=cluster)):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    images = tf.compat.v1.placeholder(tf.float32, [None, 64], name="images")
    labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
    loss = digits_cluster.softmax_loss(images, labels)
    opt = tf.compat.v1.train.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate),
        replicas_to_aggregate=num_workers, total_num_replicas=num_workers)
    digits_cluster.describe(opt)
    train_op = opt.minimize(loss, global_step=global_step)

  config = digits_cluster.session_config(args)
  if not is_chief:
    digits_cluster.wait_for_chief(server.target, config)
  # No initial tokens: the first update waits for a gradient from each
  # worker (the default lets the chief make it, and more, alone).
  hooks = [opt.make_session_run_hook(is_chief, num_tokens=0),
           tf.compat.v1.train.StopAtStepHook(last_step=args.train_steps)]
  feed = digits_cluster.batches(images_np, labels_np,
                                batch_size=args.batch_size,
                                seed=args.task_index)
  with tf.compat.v1.train.MonitoredTrainingSession(
      master=server.target, is_chief=is_chief, hooks=hooks, config=config,
      checkpoint_dir=args.logdir if is_chief else None,
      save_summaries_steps=None, save_summaries_secs=None,
      log_step_count_steps=None) as sess:
    while not sess.should_stop():
      x, y = next(feed)
      _, value, step = sess.run([train_op, loss, global_step],
                                {images: x, labels: y})
      digits_cluster.log_step(args, step, value)
  # The session is closed (MonitoredSession runs nothing once it should
  # stop); the variables live on on the ps.
  with tf.compat.v1.Session(server.target, config=config) as sess:
    digits_cluster.log_final(args, sess.run(global_step))
  return 0


if __name__ == "__main__":
  sys.exit(main())
