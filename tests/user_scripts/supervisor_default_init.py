"""Digits between-graph with Supervisor's default local init (Inception style).

The pattern of the distributed Inception trainer: the Supervisor gets no
local init op, so its default (local variables and tables) runs and the
optimizer's ``chief_init_op`` never does; batches come from input queue
runners that ``sv.start_queue_runners`` starts on every worker; the chief
then starts the chief queue runner and only after it runs the init tokens.
The optimizer keeps moving averages of the weights (``variable_averages``).
Training ends when the loop sees the target step; then ``sv.stop()``, and the
chief saves a checkpoint.

  python supervisor_default_init.py --ps_hosts=H:P --worker_hosts=H:P,H:P \\
      --job_name=ps --task_index=0        # and worker 0 (chief), worker 1
"""

import argparse
import os
import sys

import tensorflow.compat.v1 as tf

import digits_cluster

tf.disable_v2_behavior()


def input_batches(images_np, labels_np, *, batch_size, seed):
  """A batch queue fed by one queue runner, a whole batch per enqueue."""
  count = len(images_np)
  rows = tf.random.uniform([batch_size], maxval=count, dtype=tf.int32,
                           seed=seed)
  images = tf.gather(tf.constant(images_np), rows)
  labels = tf.gather(tf.constant(labels_np), rows)
  return tf.train.batch([images, labels], batch_size=batch_size,
                        enqueue_many=True, capacity=4 * batch_size,
                        num_threads=1)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  digits_cluster.add_flags(parser, learning_rate=0.1)
  args = parser.parse_args(argv)
  server = digits_cluster.start_server(args)
  cluster = digits_cluster.cluster_spec(args)
  num_workers = cluster.num_tasks("worker")
  is_chief = args.task_index == 0
  images_np, labels_np = digits_cluster.shard(args)

  with tf.device(tf.train.replica_device_setter(
      worker_device=digits_cluster.worker_device(args), cluster=cluster)):
    global_step = tf.train.get_or_create_global_step()
    images, labels = input_batches(images_np, labels_np,
                                   batch_size=args.batch_size,
                                   seed=args.task_index + 1)
    loss = digits_cluster.softmax_loss(images, labels)
    averages = tf.train.ExponentialMovingAverage(0.99, global_step)
    opt = tf.train.SyncReplicasOptimizer(
        tf.train.RMSPropOptimizer(args.learning_rate, decay=0.9,
                                  momentum=0.9, epsilon=1.0),
        replicas_to_aggregate=num_workers, total_num_replicas=num_workers,
        variable_averages=averages,
        variables_to_average=tf.trainable_variables())
    digits_cluster.describe(opt)
    grads = opt.compute_gradients(loss)
    apply_op = opt.apply_gradients(grads, global_step=global_step)
    with tf.control_dependencies([apply_op]):
      train_op = tf.identity(loss, name="train_op")
    chief_queue_runners = [opt.get_chief_queue_runner()]
    # No initial tokens: the first update waits for a gradient from each
    # worker (the default lets the chief make it, and more, alone).
    init_tokens_op = opt.get_init_tokens_op(num_tokens=0)
    saver = tf.train.Saver()

  config = digits_cluster.session_config(args)
  if not is_chief:
    digits_cluster.wait_for_chief(server.target, config)
  sv = tf.train.Supervisor(
      is_chief=is_chief, logdir=args.logdir,
      init_op=tf.global_variables_initializer(), summary_op=None,
      global_step=global_step, saver=saver, save_model_secs=600)
  sess = sv.prepare_or_wait_for_session(server.target, config=config)
  sv.start_queue_runners(sess, tf.get_collection(tf.GraphKeys.QUEUE_RUNNERS))
  if is_chief:
    sv.start_queue_runners(sess, chief_queue_runners)
    sess.run(init_tokens_op)

  step = sess.run(global_step)
  while not sv.should_stop() and step < args.train_steps:
    value = sess.run(train_op)
    step = sess.run(global_step)
    digits_cluster.log_step(args, step, value)
  digits_cluster.log_final(args, step)
  sv.stop()
  if is_chief:
    path = saver.save(sess, os.path.join(args.logdir, "model.ckpt"),
                      global_step=global_step)
    print("saved %s" % path, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
