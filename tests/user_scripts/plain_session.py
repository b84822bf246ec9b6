"""Digits between-graph with a plain Session and every sync op run by hand.

No Supervisor, no MonitoredTrainingSession: the chief initializes the
variables, runs ``chief_init_op``, starts the chief queue runner's threads
under its own Coordinator and adds the init tokens; the other workers wait
for the chief's init and run ``local_step_init_op``. At the end the chief
asks the Coordinator to stop and joins its threads (Coordinator's default
grace period).

  python plain_session.py --ps_hosts=H:P --worker_hosts=H:P,H:P \\
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
  v1 = tf.compat.v1
  cluster = digits_cluster.cluster_spec(args)
  num_workers = cluster.num_tasks("worker")
  is_chief = args.task_index == 0
  images_np, labels_np = digits_cluster.shard(args)

  with v1.device(v1.train.replica_device_setter(
      worker_device=digits_cluster.worker_device(args), cluster=cluster)):
    global_step = v1.train.get_or_create_global_step()
    images = v1.placeholder(tf.float32, [None, 64], name="images")
    labels = v1.placeholder(tf.int64, [None], name="labels")
    loss = digits_cluster.softmax_loss(images, labels)
    opt = v1.train.SyncReplicasOptimizer(
        v1.train.GradientDescentOptimizer(args.learning_rate),
        replicas_to_aggregate=num_workers, total_num_replicas=num_workers)
    digits_cluster.describe(opt)
    train_op = opt.minimize(loss, global_step=global_step)
    init_op = v1.global_variables_initializer()
    local_init_op = v1.local_variables_initializer()
    # No initial tokens: the first update waits for a gradient from each
    # worker (the default lets the chief make it, and more, alone).
    init_tokens_op = opt.get_init_tokens_op(num_tokens=0)
    chief_queue_runner = opt.get_chief_queue_runner()

  config = digits_cluster.session_config(args)
  coord = v1.train.Coordinator()
  threads = []
  if not is_chief:
    digits_cluster.wait_for_chief(server.target, config)
  with v1.Session(server.target, config=config) as sess:
    if is_chief:
      sess.run([init_op, local_init_op])
      sess.run(opt.chief_init_op)
      threads = chief_queue_runner.create_threads(sess, coord=coord,
                                                  start=True)
      sess.run(init_tokens_op)
    else:
      sess.run(local_init_op)
      sess.run(opt.local_step_init_op)

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
    coord.request_stop()
    coord.join(threads)
  return 0


if __name__ == "__main__":
  sys.exit(main())
