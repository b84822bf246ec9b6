"""A digits classifier trained synchronously between-graph on a ps cluster.

The same program runs once per task: ps tasks serve the variables, the
replicas (chief and workers) each train on their own shard of scikit-learn's
bundled 8x8 digits and meet at every update through sync_replicas. The chief
writes checkpoints and summaries to --logdir, prints a progress line every
--log_every steps (step, loss, test accuracy, steps/s), the final test
accuracy, and plots loss and accuracy against time to <logdir>/training.png.
Lines specific to sync_replicas are marked ``# sync_replicas:``.

On one machine (1 ps, 3 replicas of which 1 is a backup):

  sync-replicas-launch --ps 1 --workers 3 --backup 1 -- \\
      python -m examples.digits

or by hand, one terminal per task (TF1 flags, 127.0.0.1:2222-2225 default):

  python -m examples.digits --job_name ps --task_index 0
  python -m examples.digits --job_name worker --task_index 0 --backups 1
  ...
"""

import argparse
import logging
import os
import sys
import time

import numpy as np
import tensorflow as tf

import sync_replicas  # sync_replicas:
from examples import _digits
from examples import _task

_LOG = logging.getLogger("examples.digits")


def _parse(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=_task.HelpFormatter)
  parser.add_argument("--steps", type=int, default=600,
                      help="global step at which training stops")
  parser.add_argument("--batch_size", type=int, default=32,
                      help="examples per replica per step")
  parser.add_argument("--learning_rate", type=float, default=0.01,
                      help="Adam's learning rate")
  parser.add_argument("--log_every", type=int, default=50,
                      help="progress line and summaries every this many steps")
  parser.add_argument("--checkpoint_every", type=int, default=200,
                      help="checkpoint every this many steps")
  parser.add_argument("--logdir", default=os.path.join("runs", "digits"),
                      help="the chief's checkpoints, summaries, plot and "
                      "sync_manifest.json (for sync-replicas-status); training "
                      "resumes from a checkpoint found here")
  parser.add_argument("--no_plot", action="store_true",
                      help="skip the PNG plot")
  parser.add_argument("--mode", choices=["sync", "async"], default="sync",
                      help="sync: SyncReplicasOptimizer; async: the plain "
                      "optimizer, every gradient applied on arrival")
  parser.add_argument("--delay_ms", type=float, default=0.0,
                      help="inject a heavy-tailed delay before each step: "
                      "log-normal with this median (ms), as stragglers in "
                      "Chen et al. 2016; 0 for none")
  parser.add_argument("--delay_sigma", type=float, default=1.0,
                      help="log-normal sigma of the injected delay")
  parser.add_argument("--slow_replica", type=int, default=-1,
                      help="this replica waits --slow_ms more for each "
                      "batch (a slow input pipeline); -1 for none")
  parser.add_argument("--slow_ms", type=float, default=100.0,
                      help="the slow replica's extra wait per batch (ms)")
  parser.add_argument("--timeline_dir", default=None,
                      help="where each task writes its sync timeline, e.g. "
                      "<logdir>/timeline (default: none; it costs small "
                      "steps like these a sizeable share of their speed, "
                      "docs/timeline.md); merge with sync-replicas-timeline "
                      "DIR --png F")
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


def _train(args, task, server):
  data = _digits.load(replica_index=task.replica_index,
                      num_replicas=task.num_replicas)
  batches = _digits.Batches(data.x_train, data.y_train,
                            batch_size=args.batch_size, seed=task.replica_index)
  with tf.Graph().as_default():
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        cluster=task.cluster, worker_device=_task.worker_device(task))):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      x = tf.compat.v1.placeholder(tf.float32, [None, _digits.NUM_FEATURES])
      y = tf.compat.v1.placeholder(tf.int64, [None])
      loss, accuracy = _digits.loss_and_accuracy(_digits.logits_fn(x), y)
      tf.compat.v1.summary.scalar("loss", loss)
      tf.compat.v1.summary.scalar("batch_accuracy", accuracy)
      opt = tf.compat.v1.train.AdamOptimizer(args.learning_rate)
      sync = args.mode == "sync"
      if sync:
        # sync_replicas: wrap the optimizer; each update averages the
        # gradients of the fastest (replicas - backups) replicas, the rest
        # are dropped.
        # The timeline: when every phase of every update happened, one
        # file per task (timeline_dir).
        opt = sync_replicas.SyncReplicasOptimizer(
            opt, replicas_to_aggregate=task.num_replicas - args.backups,
            total_num_replicas=task.num_replicas,
            timeline_dir=args.timeline_dir or None)
      train_op = opt.minimize(loss, global_step=global_step)
    # sync_replicas: tell sync-replicas-status where the sync state lives
    # (<logdir>/sync_manifest.json).
    if sync and task.is_chief:
      tf.io.gfile.makedirs(args.logdir)
      opt.write_sync_manifest(args.logdir)
    hooks = [tf.compat.v1.train.StopAtStepHook(last_step=args.steps)]
    if sync:
      # sync_replicas: the hook initializes the sync state; on the chief it
      # also enqueues the first tokens and starts the queue runner that
      # applies the averaged gradients.
      hooks.append(opt.make_session_run_hook(task.is_chief))
    chief_only_hooks, save_steps = None, args.checkpoint_every
    if sync and task.is_chief:
      # sync_replicas: the queue runner applies updates in a thread of its
      # own, so a plain save can catch half of one; the listener holds the
      # updates back while a save runs. MonitoredTrainingSession's own saver
      # (which takes no listener) is then off; it still restores from
      # --logdir.
      chief_only_hooks = [tf.compat.v1.train.CheckpointSaverHook(
          args.logdir, save_steps=args.checkpoint_every,
          listeners=[opt.make_checkpoint_saver_listener()])]
      save_steps = None
    if task.is_chief:
      _say_if_resuming(args)
    config = _task.session_config(task)
    delays = np.random.default_rng(1000 + task.replica_index)
    if not task.is_chief:
      # sync_replicas: ready_for_local_init_op lists what the chief has not
      # initialized yet; waiting on it here spares SessionManager's 30 s nap.
      ready = (opt.ready_for_local_init_op if sync else
               tf.compat.v1.report_uninitialized_variables())
      _task.wait_for_chief(server.target, ready, config)
    log = _Progress(args.log_every) if task.is_chief else None
    runs = 0
    with tf.compat.v1.train.MonitoredTrainingSession(
        master=server.target, is_chief=task.is_chief, hooks=hooks,
        chief_only_hooks=chief_only_hooks, config=config,
        checkpoint_dir=args.logdir if task.is_chief else None,
        save_checkpoint_steps=save_steps,
        save_checkpoint_secs=None,
        save_summaries_steps=args.log_every,
        log_step_count_steps=None,
        # The chief's queue runner can sit in a gradient take that no worker
        # will feed once training ends; without a short grace period close()
        # waits the default 120 s for it.
        stop_grace_period_secs=2) as sess:

      def evaluate():
        # run_step_fn's raw session skips the hooks: no summary or stop
        # check is triggered by the test batch.
        return sess.run_step_fn(lambda step_context: step_context.session.run(
            [loss, accuracy, global_step],
            feed_dict={x: data.x_test, y: data.y_test}))

      # A resume at or past --steps has nothing to train: stop before the
      # first train op (StopAtStepHook would stop only after one, stepping
      # past --steps), and leave the run's plot and timeline as they are.
      at = int(sess.run_step_fn(
          lambda step_context: step_context.session.run(global_step)))
      nothing_to_train = at >= args.steps
      while not nothing_to_train and not sess.should_stop():
        if args.delay_ms:
          time.sleep(delays.lognormal(np.log(args.delay_ms / 1000.0),
                                      args.delay_sigma))
        if task.replica_index == args.slow_replica:
          time.sleep(args.slow_ms / 1000.0)
        xs, ys = batches.next()
        _, step, value = sess.run([train_op, global_step, loss],
                                  feed_dict={x: xs, y: ys})
        runs += 1
        if log is not None:
          log.train(value)
          if log.due(step):
            log.test(*evaluate(), logdir=args.logdir)
      if log is not None and not nothing_to_train:
        final_loss, final_accuracy, final_step = evaluate()
    if nothing_to_train:
      # The chief's session creation still wrote a checkpoint and an
      # events file (MonitoredTrainingSession's hooks): the same step.
      _LOG.info("%s: nothing to train, the global step is %d and --steps %d "
                "(the plot and timeline in %s are left as they were; a "
                "larger --steps trains on)", _task.name(task), at, args.steps,
                args.logdir)
      return 0
    if log is None:
      _LOG.info("%s done after %d train-op runs", _task.name(task),
                runs)
      return 0
    _LOG.info("final test accuracy %.4f (test loss %.4f) at step %d after "
              "%.1f s", final_accuracy, final_loss, final_step,
              log.elapsed())
    log.test(final_loss, final_accuracy, final_step)
    if not args.no_plot:
      _LOG.info("plot written to %s", log.plot(
          os.path.join(args.logdir, "training.png")))
    if sync and args.timeline_dir:
      # sync_replicas: each task wrote its part; merged once all have ended.
      _LOG.info("timeline written to %s; once every task has ended: "
                "%s %s --png %s", args.timeline_dir,
                _task.command("sync-replicas-timeline"), args.timeline_dir,
                os.path.join(args.timeline_dir, "last.png"))
  return 0


def _say_if_resuming(args):
  """Says so when --logdir holds a checkpoint: training resumes from it."""
  found = tf.train.latest_checkpoint(args.logdir)
  if not found:
    return
  step = int(tf.train.load_variable(found, "global_step"))
  _LOG.info("resuming from step %d: %s holds an earlier run's checkpoint%s "
            "(another --logdir starts afresh)", step, args.logdir,
            "; --steps %d is reached already, so nothing is trained"
            % args.steps if step >= args.steps else "")


class _Progress:
  """The chief's progress lines, test summaries and plot data."""

  def __init__(self, every):
    self._every = every
    self._start = self._last_time = time.monotonic()
    self._last_logged = None
    self._last_logged_step = 0
    self._train = []  # (seconds, loss)
    self._test = []   # (seconds, loss, accuracy)

  def elapsed(self):
    return time.monotonic() - self._start

  def train(self, value):
    self._train.append((self.elapsed(), float(value)))

  def due(self, step):
    # With backups the chief may see the global step jump, so compare
    # buckets instead of testing step % every == 0.
    bucket = step // self._every
    if bucket == self._last_logged:
      return False
    self._last_logged = bucket
    return True

  def test(self, test_loss, test_accuracy, step, logdir=None):
    now = time.monotonic()
    rate = (step - self._last_logged_step) / max(now - self._last_time, 1e-9)
    self._last_time, self._last_logged_step = now, step
    self._test.append((self.elapsed(), float(test_loss),
                       float(test_accuracy)))
    if logdir is None:
      return
    _LOG.info("step %5d  loss %.4f  test accuracy %.4f  %.1f steps/s  "
              "%.1f s", step, self._train[-1][1], test_accuracy, rate,
              self.elapsed())
    writer = tf.compat.v1.summary.FileWriterCache.get(logdir)
    writer.add_summary(tf.compat.v1.Summary(value=[
        tf.compat.v1.Summary.Value(tag="test/loss", simple_value=test_loss),
        tf.compat.v1.Summary.Value(tag="test/accuracy",
                                   simple_value=test_accuracy)]), step)

  def plot(self, path):
    """Writes loss and accuracy against wall time to ``path`` (PNG)."""
    try:
      import matplotlib  # pylint: disable=g-import-not-at-top
    except ImportError:
      return "nowhere: matplotlib is missing (pip install matplotlib)"
    matplotlib.use("Agg")  # No display: render straight to the file.
    from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
    train = np.array(self._train).reshape(-1, 2)
    test = np.array(self._test).reshape(-1, 3)
    fig, (top, bottom) = pyplot.subplots(2, 1, sharex=True, figsize=(7, 6))
    top.plot(train[:, 0], train[:, 1], lw=0.6, alpha=0.6,
             label="training batch (chief)")
    top.plot(test[:, 0], test[:, 1], "o-", label="test set")
    top.set_ylabel("cross-entropy loss")
    top.set_yscale("log")
    top.legend()
    bottom.plot(test[:, 0], test[:, 2], "o-", color="C2")
    bottom.set_ylabel("test accuracy")
    bottom.set_xlabel("seconds since the chief's session started")
    bottom.set_ylim(0, 1)
    bottom.grid(alpha=0.3)
    fig.suptitle("digits, synchronous replicas")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    pyplot.close(fig)
    return path


if __name__ == "__main__":
  sys.exit(main())
