"""Synchronous training of a linear model on an in-process cluster.

One ps and three workers (one of them a backup) run as threads of this
process, each with its own graph and MonitoredTrainingSession, exactly as
separate processes would. Lines specific to sync_replicas are marked.

  python -m examples.local_demo --steps 200
"""

import argparse
import logging
import os
import sys
import threading
import time

import numpy as np
import tensorflow as tf

import sync_replicas  # sync_replicas:
from examples import _task

_LOG = logging.getLogger("examples.local_demo")


def _parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200,
                      help="global steps to train")
  parser.add_argument("--workers", type=int, default=3)
  parser.add_argument("--backups", type=int, default=1,
                      help="workers whose gradients an update may go without")
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--log-every", type=int, default=50)
  parser.add_argument("--logdir", default=os.path.join("runs", "local_demo"),
                      help="where the chief writes sync_manifest.json, for "
                      "sync-replicas-status")
  return parser.parse_args(argv)


def _worker(args, cluster, task, true_w, results, chief_ready):
  is_chief = task == 0
  rng = np.random.default_rng(task)
  with tf.Graph().as_default():
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        cluster=cluster.cluster_spec,
        worker_device="/job:worker/task:%d" % task)):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      x = tf.compat.v1.placeholder(tf.float32, [None, true_w.size])
      y = tf.compat.v1.placeholder(tf.float32, [None])
      w = tf.compat.v1.get_variable("w", [true_w.size],
                                    initializer=tf.zeros_initializer())
      loss = tf.reduce_mean(tf.square(tf.linalg.matvec(x, w) - y))
      opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
      # sync_replicas: wrap the optimizer; each update averages the
      # gradients of (workers - backups) replicas.
      opt = sync_replicas.SyncReplicasOptimizer(
          opt, replicas_to_aggregate=args.workers - args.backups,
          total_num_replicas=args.workers)
      train_op = opt.minimize(loss, global_step=global_step)
      # sync_replicas: tell sync-replicas-status where the sync state lives
      # (<logdir>/sync_manifest.json).
      if is_chief:
        tf.io.gfile.makedirs(args.logdir)
        opt.write_sync_manifest(args.logdir)
    hooks = [opt.make_session_run_hook(is_chief),  # sync_replicas:
             tf.compat.v1.train.StopAtStepHook(last_step=args.steps)]
    config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=60_000)
    start = time.monotonic()
    runs = 0
    with tf.compat.v1.train.MonitoredTrainingSession(
        master=cluster.worker_targets[task], is_chief=is_chief, hooks=hooks,
        config=config, stop_grace_period_secs=2,
        log_step_count_steps=None) as sess:
      if is_chief:
        chief_ready.set()
      while not sess.should_stop():
        xs = rng.normal(size=(args.batch, true_w.size)).astype(np.float32)
        ys = xs @ true_w + rng.normal(scale=0.01, size=args.batch)
        _, step, value = sess.run([train_op, global_step, loss],
                                  feed_dict={x: xs, y: ys})
        runs += 1
        if is_chief and step % args.log_every == 0:
          _LOG.info("step %d loss %.5f (%.1f steps/s)", step, value,
                    step / max(time.monotonic() - start, 1e-9))
    results[task] = (runs, float(value))


def main(argv=None):
  args = _parse(argv)
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  if not 0 <= args.backups < args.workers:
    raise SystemExit("--backups must be in [0, --workers), got %d with "
                     "--workers %d" % (args.backups, args.workers))
  cluster = sync_replicas.LocalCluster(num_workers=args.workers, num_ps=1)
  # Of use only while it trains (a few seconds); run later, the tool says
  # that the job has ended.
  _LOG.info("its sync state, from another terminal while it trains: %s "
            "--manifest %s --ps %s", _task.command("sync-replicas-status"),
            args.logdir, cluster.cluster_spec.task_address("ps", 0))
  true_w = np.linspace(-1.0, 1.0, 8).astype(np.float32)
  results = {}
  chief_ready = threading.Event()
  threads = [threading.Thread(target=_worker, daemon=True, name="worker%d" % t,
                              args=(args, cluster, t, true_w, results,
                                    chief_ready))
             for t in range(args.workers)]
  # The chief starts first: a worker that finds the model uninitialized
  # sleeps SessionManager's 30 s recovery wait before looking again.
  threads[0].start()
  if not chief_ready.wait(120):
    raise SystemExit("the chief did not create its session within 120 s")
  for t in threads[1:]:
    t.start()
  deadline = time.monotonic() + 600
  for t in threads:
    t.join(max(deadline - time.monotonic(), 0))
  stuck = [t.name for t in threads if t.is_alive()]
  if stuck:
    raise SystemExit("workers still running after 600 s: %s" % stuck)
  for task in sorted(results):
    runs, last_loss = results[task]
    _LOG.info("worker%d: %d train-op runs, last loss %.5f", task, runs,
              last_loss)
  final_loss = results.get(0, (0, float("nan")))[1]
  _LOG.info("final chief loss %.5f", final_loss)
  return 0 if final_loss < 0.01 else 1


if __name__ == "__main__":
  sys.exit(main())
