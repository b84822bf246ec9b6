"""Digits between-graph with a TF1 Estimator and the optimizer's hook.

The Estimator pattern (TensorFlow up to 2.15; Estimator is gone from 2.16):
the sync optimizer is made before the model_fn, which calls its
``minimize``; its ``make_session_run_hook`` goes to ``train(hooks=...)``
with ``max_steps``. The cluster comes from TF_CONFIG, where Estimator wants
a ``chief`` job: worker 0 of the flags becomes the chief, the others the
workers. The chief writes checkpoints to --logdir.

  python estimator_hook.py --ps_hosts=H:P --worker_hosts=H:P,H:P \\
      --job_name=ps --task_index=0        # and worker 0 (chief), worker 1
"""

import argparse
import json
import os
import sys

import tensorflow as tf

import digits_cluster


def estimator_config(args):
  """TF_CONFIG for this task, with worker 0 as the ``chief`` job."""
  workers = args.worker_hosts.split(",")
  jobs = {"ps": args.ps_hosts.split(","), "chief": workers[:1]}
  if workers[1:]:
    jobs["worker"] = workers[1:]
  if args.job_name == "ps":
    task = {"type": "ps", "index": args.task_index}
  elif args.task_index == 0:
    task = {"type": "chief", "index": 0}
  else:
    task = {"type": "worker", "index": args.task_index - 1}
  return {"cluster": jobs, "task": task}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  digits_cluster.add_flags(parser)
  args = parser.parse_args(argv)
  v1 = tf.compat.v1
  estimator = v1.estimator
  tf_config = estimator_config(args)
  os.environ["TF_CONFIG"] = json.dumps(tf_config)
  cluster = tf.train.ClusterSpec(tf_config["cluster"])
  job, index = tf_config["task"]["type"], tf_config["task"]["index"]
  server = tf.distribute.Server(cluster, job_name=job, task_index=index)
  if job == "ps":
    digits_cluster.serve(server, index)
  v1.logging.set_verbosity(v1.logging.INFO)
  is_chief = job == "chief"
  num_workers = len(args.worker_hosts.split(","))
  images_np, labels_np = digits_cluster.shard(args)
  device = "/job:%s/task:%d" % (job, index)
  session_config = v1.ConfigProto(
      device_filters=["/job:ps", device],
      operation_timeout_in_ms=digits_cluster.OP_TIMEOUT_MS)
  run_config = estimator.RunConfig(
      model_dir=args.logdir, session_config=session_config,
      save_checkpoints_steps=args.train_steps, save_summary_steps=None,
      log_step_count_steps=None)

  opt = v1.train.SyncReplicasOptimizer(
      v1.train.GradientDescentOptimizer(args.learning_rate),
      replicas_to_aggregate=num_workers, total_num_replicas=num_workers)
  digits_cluster.describe(opt)
  # No initial tokens: the first update waits for a gradient from each
  # worker (the default lets the chief make it, and more, alone).
  sync_hook = opt.make_session_run_hook(is_chief, num_tokens=0)

  def model_fn(features, labels, mode):
    loss = digits_cluster.softmax_loss(features, labels)
    global_step = v1.train.get_global_step()
    train_op = opt.minimize(loss, global_step=global_step)
    logging_hook = v1.train.LoggingTensorHook(
        {"step": global_step, "loss": loss}, every_n_iter=1,
        formatter=lambda v: "worker %d: global step %d, loss %.4f" % (
            args.task_index, v["step"], v["loss"]))
    return estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                   training_hooks=[logging_hook])

  def input_fn():
    dataset = tf.data.Dataset.from_tensor_slices((images_np, labels_np))
    return dataset.shuffle(len(images_np), seed=args.task_index).repeat(
    ).batch(args.batch_size)

  # The global step on the ps, in a graph of its own: the Estimator builds
  # the model's graph inside train(), where this script cannot wait.
  with tf.Graph().as_default():
    with v1.device(v1.train.replica_device_setter(cluster=cluster,
                                                  worker_device=device)):
      global_step = v1.train.get_or_create_global_step()
    if not is_chief:
      digits_cluster.wait_for_chief(server.target, session_config)
    model = estimator.Estimator(model_fn=model_fn, config=run_config)
    model.train(input_fn, hooks=[sync_hook], max_steps=args.train_steps)
    with v1.Session(server.target, config=session_config) as sess:
      digits_cluster.log_final(args, sess.run(global_step))
  return 0


if __name__ == "__main__":
  sys.exit(main())
