"""Digits between-graph with tf-slim's ``learning.train`` and its sync_optimizer.

The pattern of the TF-slim model zoo's image classifier trainer: the model's
train tensor is the loss made to depend on the sync optimizer's
``apply_gradients``, and ``slim.learning.train`` gets the optimizer as
``sync_optimizer``. tf-slim then does the rest: the optimizer's
``chief_init_op`` / ``local_step_init_op`` and ``ready_for_local_init_op``
for its Supervisor, the input queue runners, then on the chief the chief
queue runner and the init tokens, and it stops at ``number_of_steps``.

  python slim_learning.py --ps_hosts=H:P --worker_hosts=H:P,H:P \\
      --job_name=ps --task_index=0        # and worker 0 (chief), worker 1
"""

import argparse
import sys

import tensorflow.compat.v1 as tf
import tf_slim as slim

import digits_cluster

tf.disable_v2_behavior()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  digits_cluster.add_flags(parser)
  args = parser.parse_args(argv)
  server = digits_cluster.start_server(args)
  tf.logging.set_verbosity(tf.logging.INFO)
  cluster = digits_cluster.cluster_spec(args)
  num_workers = cluster.num_tasks("worker")
  is_chief = args.task_index == 0
  images_np, labels_np = digits_cluster.shard(args)

  with tf.device(tf.train.replica_device_setter(
      worker_device=digits_cluster.worker_device(args), cluster=cluster)):
    global_step = tf.train.get_or_create_global_step()
    dataset = tf.data.Dataset.from_tensor_slices((images_np, labels_np))
    dataset = dataset.shuffle(len(images_np), seed=args.task_index).repeat()
    images, labels = tf.data.make_one_shot_iterator(
        dataset.batch(args.batch_size)).get_next()
    loss = digits_cluster.softmax_loss(images, labels)
    opt = tf.train.SyncReplicasOptimizer(
        tf.train.GradientDescentOptimizer(args.learning_rate),
        replicas_to_aggregate=num_workers, total_num_replicas=num_workers)
    digits_cluster.describe(opt)
    grads = opt.compute_gradients(loss)
    apply_op = opt.apply_gradients(grads, global_step=global_step)
    with tf.control_dependencies([apply_op]):
      train_tensor = tf.identity(loss, name="train_op")

  config = digits_cluster.session_config(args)
  if not is_chief:
    digits_cluster.wait_for_chief(server.target, config)
  slim.learning.train(
      train_tensor, logdir=args.logdir,
      master=server.target, is_chief=is_chief,
      number_of_steps=args.train_steps, log_every_n_steps=1,
      save_summaries_secs=600, save_interval_secs=600,
      session_config=config, sync_optimizer=opt)
  # learning.train closed its session; the variables live on on the ps.
  with tf.Session(server.target, config=config) as sess:
    digits_cluster.log_final(args, sess.run(global_step))
  return 0


if __name__ == "__main__":
  sys.exit(main())
