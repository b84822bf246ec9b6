"""A click-through model with embeddings: sparse gradients, synchronously.

Synthetic click logs (user, item, clicked) come from a hidden model: each user
and item has its own click propensity, and user groups like or dislike item
categories. The model learns a bias and a small embedding per user and per
item. Its gradients are ``tf.IndexedSlices`` (only the looked-up rows), so
sync_replicas aggregates them in SparseConditionalAccumulators on the ps
tasks, each update averaging the rows the replicas touched. The chief prints
how many accumulators are sparse, a progress line every --log_every steps and
the final test accuracy next to the majority-class baseline. Lines specific to
sync_replicas are marked ``# sync_replicas:``.

  sync-replicas-launch --ps 2 --workers 3 --backup 1 -- \\
      python -m examples.sparse_clicks
"""

import argparse
import collections
import logging
import os
import sys
import time

import numpy as np
import tensorflow as tf

import sync_replicas  # sync_replicas:
from examples import _task

_LOG = logging.getLogger("examples.sparse_clicks")

Clicks = collections.namedtuple("Clicks", ["users", "items", "clicked"])


def make_clicks(*, num_users, num_items, num_events, seed=0):
  """Synthetic click logs; the same ``seed`` gives the same logs anywhere.

  The click probability is ``sigmoid(user_bias + item_bias +
  affinity[user_group, item_category])``.
  """
  rng = np.random.default_rng(seed)
  groups = rng.integers(4, size=num_users)
  categories = rng.integers(4, size=num_items)
  affinity = rng.choice([-2.0, 2.0], size=(4, 4))
  user_bias = rng.normal(0.0, 1.5, num_users)
  item_bias = rng.normal(0.0, 1.5, num_items)
  users = rng.integers(num_users, size=num_events)
  items = rng.integers(num_items, size=num_events)
  logit = (user_bias[users] + item_bias[items]
           + affinity[groups[users], categories[items]])
  clicked = rng.random(num_events) < 1.0 / (1.0 + np.exp(-logit))
  return Clicks(users, items, clicked.astype(np.float32))


def _parse(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=_task.HelpFormatter)
  parser.add_argument("--steps", type=int, default=400,
                      help="global step at which training stops")
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--learning_rate", type=float, default=1.0,
                      help="Adagrad's learning rate")
  parser.add_argument("--num_users", type=int, default=100)
  parser.add_argument("--num_items", type=int, default=50)
  parser.add_argument("--dim", type=int, default=4, help="embedding size")
  parser.add_argument("--log_every", type=int, default=50)
  parser.add_argument("--logdir", default=os.path.join("runs", "sparse_clicks"),
                      help="where the chief writes sync_manifest.json, for "
                      "sync-replicas-status")
  _task.add_cluster_flags(parser)
  return parser.parse_args(argv)


def main(argv=None):
  args = _parse(argv)
  _task.setup_logging()
  task = _task.resolve(args)
  server = _task.start_server(task)
  if task.job_name == "ps":
    _task.serve_forever(server, task)
    return 0
  return _train(args, task, server)


def _model(users, items, *, num_users, num_items, dim):
  """Logit of a click: two biases and a dot product of embeddings."""
  init = tf.random_normal_initializer(stddev=0.1, seed=1)
  user_emb = tf.compat.v1.get_variable("user_embedding", [num_users, dim],
                                       initializer=init)
  item_emb = tf.compat.v1.get_variable("item_embedding", [num_items, dim],
                                       initializer=init)
  user_bias = tf.compat.v1.get_variable("user_bias", [num_users],
                                        initializer=tf.zeros_initializer())
  item_bias = tf.compat.v1.get_variable("item_bias", [num_items],
                                        initializer=tf.zeros_initializer())
  # Lookups (gathers) make IndexedSlices gradients: the sparse path.
  lookup = tf.nn.embedding_lookup
  return (tf.reduce_sum(lookup(user_emb, users) * lookup(item_emb, items), 1)
          + lookup(user_bias, users) + lookup(item_bias, items))


def _train(args, task, server):
  logs = make_clicks(num_users=args.num_users, num_items=args.num_items,
                     num_events=40_000)
  num_test = 5_000
  test = Clicks(*(a[:num_test] for a in logs))
  train = Clicks(*(a[num_test + task.replica_index::task.num_replicas]
                   for a in logs))
  rng = np.random.default_rng(task.replica_index)
  with tf.Graph().as_default():
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        cluster=task.cluster, worker_device=_task.worker_device(task))):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      users = tf.compat.v1.placeholder(tf.int64, [None])
      items = tf.compat.v1.placeholder(tf.int64, [None])
      clicked = tf.compat.v1.placeholder(tf.float32, [None])
      logits = _model(users, items, num_users=args.num_users,
                      num_items=args.num_items, dim=args.dim)
      loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
          labels=clicked, logits=logits))
      accuracy = tf.reduce_mean(tf.cast(
          tf.equal(tf.cast(logits > 0, tf.float32), clicked), tf.float32))
      opt = tf.compat.v1.train.AdagradOptimizer(args.learning_rate)
      # sync_replicas: wrap the optimizer; IndexedSlices gradients get
      # sparse accumulators.
      opt = sync_replicas.SyncReplicasOptimizer(
          opt, replicas_to_aggregate=task.num_replicas - args.backups,
          total_num_replicas=task.num_replicas)
      train_op = opt.minimize(loss, global_step=global_step)
      # sync_replicas: tell sync-replicas-status where the sync state lives
      # (<logdir>/sync_manifest.json).
      if task.is_chief:
        tf.io.gfile.makedirs(args.logdir)
        opt.write_sync_manifest(args.logdir)
    # sync_replicas: count the accumulator kinds (an addition of ours).
    kinds = collections.Counter(type(a).__name__ for a, _ in opt.accumulators)
    hooks = [opt.make_session_run_hook(task.is_chief),  # sync_replicas:
             tf.compat.v1.train.StopAtStepHook(last_step=args.steps)]
    config = _task.session_config(task)
    if not task.is_chief:
      # sync_replicas: skip SessionManager's 30 s nap (see examples.digits).
      _task.wait_for_chief(server.target, opt.ready_for_local_init_op, config)
    test_feed = {users: test.users, items: test.items, clicked: test.clicked}
    start = time.monotonic()
    runs = 0
    last_logged = None
    with tf.compat.v1.train.MonitoredTrainingSession(
        master=server.target, is_chief=task.is_chief, hooks=hooks,
        config=config, log_step_count_steps=None,
        # Short: the chief's queue runner may sit in a gradient take that no
        # worker will feed once training ends (default: 120 s).
        stop_grace_period_secs=2) as sess:
      if task.is_chief:
        _LOG.info("accumulators: %s", ", ".join(
            "%d %s" % (n, kind) for kind, n in sorted(kinds.items())))
      while not sess.should_stop():
        pick = rng.integers(len(train.users), size=args.batch_size)
        _, step = sess.run([train_op, global_step], feed_dict={
            users: train.users[pick], items: train.items[pick],
            clicked: train.clicked[pick]})
        runs += 1
        if task.is_chief and step // args.log_every != last_logged:
          last_logged = step // args.log_every
          value, acc = sess.run_step_fn(
              lambda step_context: step_context.session.run(
                  [loss, accuracy], feed_dict=test_feed))
          _LOG.info("step %5d  test loss %.4f  test accuracy %.4f  "
                    "%.1f steps/s", step, value, acc,
                    step / max(time.monotonic() - start, 1e-9))
      if task.is_chief:
        value, acc, step = sess.run_step_fn(
            lambda step_context: step_context.session.run(
                [loss, accuracy, global_step], feed_dict=test_feed))
  if not task.is_chief:
    _LOG.info("%s done after %d train-op runs", _task.name(task),
              runs)
    return 0
  majority = max(test.clicked.mean(), 1.0 - test.clicked.mean())
  _LOG.info("final test accuracy %.4f (test loss %.4f; majority class %.4f) "
            "at step %d after %.1f s", acc, value, majority, step,
            time.monotonic() - start)
  return 0


if __name__ == "__main__":
  sys.exit(main())
