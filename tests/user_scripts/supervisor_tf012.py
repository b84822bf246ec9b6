"""Digits between-graph with Supervisor and TF 0.12's sync-replicas recipe.

The recipe TensorFlow 0.12 introduced for Supervisor: the chief's local init
op is the optimizer's ``chief_init_op``, the other workers' its
``local_step_init_op``, with its ``ready_for_local_init_op``; the chief runs
the init tokens first, then starts the chief queue runner through the
Supervisor. Non-chief workers look for the chief's init every second
(``recovery_wait_secs=1``). Training ends when the loop sees the target
step; the program then simply ends, without ``sv.stop()``.

  python supervisor_tf012.py --ps_hosts=H:P --worker_hosts=H:P,H:P \\
      --job_name=ps --task_index=0        # and worker 0 (chief), worker 1
"""

import argparse
import sys

import tensorflow.compat.v1 as tf

import digits_cluster

tf.disable_v2_behavior()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  digits_cluster.add_flags(parser, learning_rate=0.05)
  args = parser.parse_args(argv)
  server = digits_cluster.start_server(args)
  cluster = digits_cluster.cluster_spec(args)
  num_workers = cluster.num_tasks("worker")
  is_chief = args.task_index == 0
  images_np, labels_np = digits_cluster.shard(args)

  with tf.device(tf.train.replica_device_setter(
      worker_device=digits_cluster.worker_device(args), cluster=cluster)):
    global_step = tf.Variable(0, name="global_step", trainable=False)
    images = tf.placeholder(tf.float32, [None, 64], name="images")
    labels = tf.placeholder(tf.int64, [None], name="labels")
    loss = digits_cluster.softmax_loss(images, labels)
    opt = tf.train.SyncReplicasOptimizer(
        tf.train.AdamOptimizer(args.learning_rate),
        replicas_to_aggregate=num_workers, total_num_replicas=num_workers,
        name="digits_sync_replicas")
    digits_cluster.describe(opt)
    train_op = opt.minimize(loss, global_step=global_step)
    local_init_op = (opt.chief_init_op if is_chief
                     else opt.local_step_init_op)
    # No initial tokens: the first update waits for a gradient from each
    # worker (the default lets the chief make it, and more, alone).
    init_tokens_op = opt.get_init_tokens_op(num_tokens=0)
    chief_queue_runner = opt.get_chief_queue_runner()

  sv = tf.train.Supervisor(
      is_chief=is_chief, logdir=args.logdir,
      init_op=tf.global_variables_initializer(),
      local_init_op=local_init_op,
      ready_for_local_init_op=opt.ready_for_local_init_op,
      recovery_wait_secs=1, global_step=global_step)
  sess = sv.prepare_or_wait_for_session(
      server.target, config=digits_cluster.session_config(args))
  if is_chief:
    sess.run(init_tokens_op)
    sv.start_queue_runners(sess, [chief_queue_runner])

  feed = digits_cluster.batches(images_np, labels_np,
                                batch_size=args.batch_size,
                                seed=args.task_index)
  step = sess.run(global_step)
  while step < args.train_steps:
    x, y = next(feed)
    _, value = sess.run([train_op, loss], {images: x, labels: y})
    step = sess.run(global_step)
    digits_cluster.log_step(args, step, value)
  digits_cluster.log_final(args, step)
  return 0


if __name__ == "__main__":
  sys.exit(main())
