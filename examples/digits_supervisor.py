"""The digits classifier in the Supervisor-era flow of the TF 0.12 docs.

Before MonitoredTrainingSession and the hook, SyncReplicasOptimizer was wired
by hand, as in TF 0.12's ``mnist_replica.py`` and Inception's distributed
trainer: the chief passes ``chief_init_op`` and the others
``local_step_init_op`` as the Supervisor's ``local_init_op``, every replica
passes ``ready_for_local_init_op``, and the chief enqueues the initial tokens
and starts the chief queue runner itself. This example keeps that flow, line
for line, so that such scripts can swap in sync_replicas unchanged. Lines
specific to sync_replicas are marked ``# sync_replicas:``.

  sync-replicas-launch --ps 1 --workers 3 --backup 1 -- \\
      python -m examples.digits_supervisor --steps 300
"""

import argparse
import logging
import os
import sys
import time

import tensorflow as tf

import sync_replicas  # sync_replicas:
from examples import _digits
from examples import _task

_LOG = logging.getLogger("examples.digits_supervisor")


def _parse(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=_task.HelpFormatter)
  parser.add_argument("--steps", type=int, default=300,
                      help="global step at which training stops")
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--learning_rate", type=float, default=0.01)
  parser.add_argument("--log_every", type=int, default=50)
  parser.add_argument("--logdir",
                      default=os.path.join("runs", "digits_supervisor"),
                      help="the chief's checkpoints")
  _task.add_cluster_flags(parser)
  return parser.parse_args(argv)


def main(argv=None):
  args = _parse(argv)
  _task.setup_logging()
  # The Supervisor's own threads (step counter, checkpoints) start outside
  # any graph context; in TF2's default eager mode they would try to read
  # the global step eagerly and fail. TF1 programs ran with eager off.
  tf.compat.v1.disable_eager_execution()
  task = _task.resolve(args)
  server = _task.start_server(task)
  if task.job_name == "ps":
    _task.serve_forever(server, task)
    return 0
  return _train(args, task, server)


def _train(args, task, server):
  is_chief = task.is_chief
  data = _digits.load(replica_index=task.replica_index,
                      num_replicas=task.num_replicas)
  batches = _digits.Batches(data.x_train, data.y_train,
                            batch_size=args.batch_size, seed=task.replica_index)
  with tf.Graph().as_default():
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        cluster=task.cluster, worker_device=_task.worker_device(task))):
      global_step = tf.compat.v1.Variable(0, name="global_step",
                                          trainable=False)
      x = tf.compat.v1.placeholder(tf.float32, [None, _digits.NUM_FEATURES])
      y = tf.compat.v1.placeholder(tf.int64, [None])
      loss, accuracy = _digits.loss_and_accuracy(_digits.logits_fn(x), y)
      opt = tf.compat.v1.train.AdamOptimizer(args.learning_rate)
      # sync_replicas: wrap the optimizer.
      opt = sync_replicas.SyncReplicasOptimizer(
          opt, replicas_to_aggregate=task.num_replicas - args.backups,
          total_num_replicas=task.num_replicas)
      train_op = opt.minimize(loss, global_step=global_step)
      # sync_replicas: tell sync-replicas-status where the sync state lives
      # (<logdir>/sync_manifest.json).
      if is_chief:
        tf.io.gfile.makedirs(args.logdir)
        opt.write_sync_manifest(args.logdir)

      # sync_replicas: the Supervisor runs the chief's or a replica's local
      # init once the chief's init_op has made ready_for_local_init_op empty.
      if is_chief:
        local_init_op = opt.chief_init_op
      else:
        local_init_op = opt.local_step_init_op
      ready_for_local_init_op = opt.ready_for_local_init_op
      # sync_replicas: the chief applies the averaged gradients in this
      # queue runner's thread and starts the workers with the initial tokens.
      chief_queue_runner = opt.get_chief_queue_runner()
      sync_init_op = opt.get_init_tokens_op()
      init_op = tf.compat.v1.global_variables_initializer()

    sv = tf.compat.v1.train.Supervisor(
        is_chief=is_chief, logdir=args.logdir if is_chief else None,
        init_op=init_op,
        local_init_op=local_init_op,  # sync_replicas:
        ready_for_local_init_op=ready_for_local_init_op,  # sync_replicas:
        # The stock 30 s would make a replica that started before the chief
        # nap that long; polling each second costs nothing here.
        recovery_wait_secs=1,
        global_step=global_step, summary_op=None, save_model_secs=600,
        # The chief queue runner can sit in a gradient take that no worker
        # will feed once training ends; stop() would wait 120 s for it.
        stop_grace_secs=2)
    config = _task.session_config(task)
    sess = sv.prepare_or_wait_for_session(server.target, config=config)
    if is_chief:
      # sync_replicas: the initial tokens, then the chief queue runner.
      sess.run(sync_init_op)
      sv.start_queue_runners(sess, [chief_queue_runner])

    start = time.monotonic()
    runs = step = 0
    try:
      while step < args.steps and not sv.should_stop():
        xs, ys = batches.next()
        _, step = sess.run([train_op, global_step], feed_dict={x: xs, y: ys})
        runs += 1
        if is_chief and runs % args.log_every == 0:
          _LOG.info("step %5d  %.1f steps/s", step,
                    step / max(time.monotonic() - start, 1e-9))
    except tf.errors.OutOfRangeError:
      # The chief closed the token queue when it stopped: training is over.
      pass
    final = None
    if is_chief:
      final = sess.run([loss, accuracy],
                       feed_dict={x: data.x_test, y: data.y_test})
      sv.saver.save(sess, sv.save_path, global_step=global_step)
    # The chief's queue runner outlives the grace period (see above).
    sv.stop(ignore_live_threads=True)
  if final is None:
    _LOG.info("%s done after %d train-op runs", _task.name(task),
              runs)
  else:
    _LOG.info("final test accuracy %.4f (test loss %.4f) at step %d after "
              "%.1f s", final[1], final[0], step,
              time.monotonic() - start)
  return 0


if __name__ == "__main__":
  sys.exit(main())
