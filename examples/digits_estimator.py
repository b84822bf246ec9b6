"""The digits classifier as a TF1 Estimator trained with sync_replicas.

Estimator programs keep their model_fn; the sync optimizer is made once per
process, its hook is passed to every replica's ``train()``, and the model_fn
calls its ``minimize``. The chief evaluates the final checkpoint on the test
set. Lines specific to sync_replicas are marked ``# sync_replicas:``.

TensorFlow ships Estimator up to 2.15 only (``tf.compat.v1.estimator``); on a
later TensorFlow this program exits with a message saying so. With the
project's tools, a 2.15 environment is one variable away:

  SYNC_REPLICAS_TF='tensorflow-cpu==2.15.*' SYNC_REPLICAS_VENV=.venv-215 \\
      ./tools/test tests/test_examples.py -k estimator

  sync-replicas-launch --ps 1 --workers 3 --backup 1 -- \\
      python -m examples.digits_estimator --steps 300
"""

import argparse
import json
import logging
import os
import sys
import time

import tensorflow as tf

import sync_replicas  # sync_replicas:
from examples import _digits
from examples import _task

_LOG = logging.getLogger("examples.digits_estimator")


def _parse(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=_task.HelpFormatter)
  parser.add_argument("--steps", type=int, default=300,
                      help="global step at which training stops")
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--learning_rate", type=float, default=0.01)
  parser.add_argument("--log_every", type=int, default=50,
                      help="Estimator's loss/step-rate log every this many "
                      "steps")
  parser.add_argument("--logdir",
                      default=os.path.join("runs", "digits_estimator"),
                      help="the Estimator's model_dir")
  _task.add_cluster_flags(parser)
  return parser.parse_args(argv)


def estimator_module():
  """``tf.compat.v1.estimator``, or None on a TensorFlow without it."""
  try:
    return getattr(tf.compat.v1, "estimator", None)
  except ImportError:  # A 2.15 install whose tensorflow-estimator is missing.
    return None


def main(argv=None):
  args = _parse(argv)
  _task.setup_logging()
  estimator = estimator_module()
  if estimator is None:
    raise SystemExit(
        "examples.digits_estimator needs tf.compat.v1.estimator, which "
        "TensorFlow %s does not ship (Estimator was removed in 2.16). Run it "
        "with TensorFlow 2.15, e.g. a venv made by "
        "SYNC_REPLICAS_TF='tensorflow-cpu==2.15.*' SYNC_REPLICAS_VENV="
        ".venv-215 ./tools/test; the other examples run on every supported "
        "TensorFlow." % tf.__version__)
  task = _with_chief_job(_task.resolve(args))
  server = _task.start_server(task)
  if task.job_name == "ps":
    _task.serve_forever(server, task)
    return 0
  return _train(args, task, server, estimator)


def _with_chief_job(task):
  """The same task in a cluster with a ``chief`` job, as Estimator demands.

  TF1 flags make worker 0 the chief; Estimator's RunConfig refuses a cluster
  without a ``chief`` job, so worker 0 becomes chief 0 and the other workers
  move down one index. The server and RunConfig then agree on device names.
  """
  jobs = task.cluster.as_dict()
  if "chief" in jobs:
    return task
  workers = jobs.pop("worker")
  jobs["chief"] = workers[:1]
  if workers[1:]:
    jobs["worker"] = workers[1:]
  job_name, task_index = task.job_name, task.task_index
  if job_name == "worker":
    job_name, task_index = (("chief", 0) if task_index == 0
                            else ("worker", task_index - 1))
  return task._replace(cluster=tf.train.ClusterSpec(jobs), job_name=job_name,
                       task_index=task_index)


def _train(args, task, server, estimator):
  data = _digits.load(replica_index=task.replica_index,
                      num_replicas=task.num_replicas)
  # RunConfig reads the cluster and this task from TF_CONFIG only.
  os.environ["TF_CONFIG"] = json.dumps({
      "cluster": task.cluster.as_dict(),
      "task": {"type": task.job_name, "index": task.task_index}})
  config = estimator.RunConfig(
      model_dir=args.logdir, session_config=_task.session_config(task),
      save_checkpoints_steps=args.steps, save_summary_steps=args.log_every,
      log_step_count_steps=args.log_every)
  # RunConfig names the session target; this process's server must be it.
  if config.master != server.target:
    raise SystemExit("RunConfig's master %s is not this task's server %s."
                     % (config.master, server.target))

  # sync_replicas: one sync optimizer per process, made before the model_fn
  # so that its hook can be handed to train(); model_fn builds its ops.
  sync_opt = sync_replicas.SyncReplicasOptimizer(
      tf.compat.v1.train.AdamOptimizer(args.learning_rate),
      replicas_to_aggregate=task.num_replicas - args.backups,
      total_num_replicas=task.num_replicas)
  sync_hook = sync_opt.make_session_run_hook(task.is_chief)  # sync_replicas:

  def model_fn(features, labels, mode):
    logits = _digits.logits_fn(features["x"])
    loss, _ = _digits.loss_and_accuracy(logits, labels)
    train_op = None
    if mode == estimator.ModeKeys.TRAIN:
      # sync_replicas: minimize with the sync optimizer.
      train_op = sync_opt.minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
      # sync_replicas: tell sync-replicas-status where the sync state lives
      # (<logdir>/sync_manifest.json).
      if task.is_chief:
        tf.io.gfile.makedirs(args.logdir)
        sync_opt.write_sync_manifest(args.logdir)
    return estimator.EstimatorSpec(
        mode, loss=loss, train_op=train_op,
        eval_metric_ops={"accuracy": tf.compat.v1.metrics.accuracy(
            labels, tf.argmax(logits, axis=1))})

  def train_input_fn():
    dataset = tf.data.Dataset.from_tensor_slices(
        ({"x": data.x_train}, data.y_train))
    return dataset.shuffle(len(data.x_train), seed=task.replica_index).repeat(
    ).batch(args.batch_size)

  def test_input_fn():
    return tf.data.Dataset.from_tensor_slices(
        ({"x": data.x_test}, data.y_test)).batch(len(data.x_test))

  model = estimator.Estimator(model_fn=model_fn, config=config)
  if not task.is_chief:
    _wait_for_global_step(task, server)
  start = time.monotonic()
  model.train(train_input_fn, hooks=[sync_hook],  # sync_replicas: the hook
              max_steps=args.steps)
  if not task.is_chief:
    _LOG.info("%s done", _task.name(task))
    return 0
  # Evaluation restores the final checkpoint into a local session.
  metrics = model.evaluate(test_input_fn, steps=1)
  _LOG.info("final test accuracy %.4f (test loss %.4f) at step %d after "
            "%.1f s", metrics["accuracy"], metrics["loss"],
            metrics["global_step"], time.monotonic() - start)
  return 0


def _wait_for_global_step(task, server):
  """Waits until the chief has initialized the global step on the ps.

  The Estimator builds its graph inside train(), so the model's own
  readiness op is out of reach here; the global step, first of the model's
  variables and initialized in the same run as the others, stands in for it.
  Without the wait a replica that starts before the chief naps 30 s.
  """
  with tf.Graph().as_default():
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        cluster=task.cluster, worker_device=_task.worker_device(task))):
      step = tf.compat.v1.train.get_or_create_global_step()
    _task.wait_for_chief(
        server.target,
        tf.compat.v1.report_uninitialized_variables([step]),
        _task.session_config(task))


if __name__ == "__main__":
  sys.exit(main())
