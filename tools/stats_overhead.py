#!/usr/bin/env python3
"""Measures what ``statistics=True`` costs: steps/s on and off, same run.

  .venv/bin/python tools/stats_overhead.py --secs 10 --rounds 3
  .venv/bin/python tools/stats_overhead.py --on '{"timeline_dir": "/tmp/t"}'

``--on`` names other options to measure the same way (the timeline's cost
in docs/timeline.md was measured so); "on" is then those options, "off"
the defaults.

Each round trains the same small model on a fresh in-process cluster
(1 ps, --workers replicas aggregating all of them, every task on 127.0.0.1)
once with statistics off and once on, in alternating order so that drift in
machine load hits both sides alike. It prints each run's steps/s, and then
measures as tools/bench does, with its report module (tools/bench_report.py):
the median over rounds of the per-round ratio on/off (1.00: free; 0.95: 5%
slower), the sign-test interval of that median, and the verdict (slower or
faster only when the whole interval is on one side of 1.0). Three rounds
give the range of the ratios at 75% coverage, five a 94% interval.
Summaries are not written (the chief's summary saver costs the same with or
without us); the hook's log line is off, as it runs once per 100 steps by
default.
"""

import argparse
import json
import os
import statistics as pystats
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_TOOLS = os.path.dirname(os.path.abspath(__file__))
# The package from this checkout, and the bench's report next to this file.
sys.path.insert(0, os.path.dirname(_TOOLS))
sys.path.insert(0, _TOOLS)

import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import bench_report  # pylint: disable=g-import-not-at-top
import sync_replicas  # pylint: disable=g-import-not-at-top


def _worker_graph(cluster, task, *, workers, options):
  graph = tf.Graph()
  with graph.as_default():
    setter = tf.compat.v1.train.replica_device_setter(
        ps_tasks=1, worker_device="/job:worker/task:%d" % task)
    with tf.compat.v1.device(setter):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      rng = np.random.default_rng(task)
      xs = tf.constant(rng.normal(size=(32, 16)).astype(np.float32))
      w = tf.compat.v1.get_variable("w", [16, 8])
      b = tf.compat.v1.get_variable("b", [8],
                                    initializer=tf.zeros_initializer())
      loss = tf.reduce_mean(tf.square(tf.matmul(xs, w) + b))
      opt = sync_replicas.SyncReplicasOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.01),
          replicas_to_aggregate=workers, total_num_replicas=workers,
          statistics_log_steps=0, **options)
      train_op = opt.minimize(loss, global_step=global_step)
    hook = opt.make_session_run_hook(task == 0)
    session = tf.compat.v1.train.MonitoredTrainingSession(
        master=cluster.worker_targets[task], is_chief=task == 0, hooks=[hook],
        config=tf.compat.v1.ConfigProto(operation_timeout_in_ms=60_000),
        save_summaries_steps=None, save_summaries_secs=None,
        log_step_count_steps=None, stop_grace_period_secs=1)
  return session, train_op, global_step, opt


def run_once(*, workers, secs, options):
  """Global steps per second of one fresh cluster, over ``secs`` seconds."""
  cluster = sync_replicas.LocalCluster(num_workers=workers, num_ps=1)
  built = [_worker_graph(cluster, t, workers=workers, options=options)
           for t in range(workers)]
  stop = threading.Event()
  errors = []

  def train(session, train_op, *_):
    try:
      while not stop.is_set():
        session.run(train_op)
    except tf.errors.OutOfRangeError:
      pass  # The token queue was closed below: the end of the measurement.
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=train, args=b, daemon=True)
             for b in built]
  chief_session, _, global_step, chief_opt = built[0]
  for t in threads:
    t.start()
  time.sleep(min(2.0, secs / 4))  # Warm-up: first steps build caches.
  first, began = chief_session.run(global_step), time.monotonic()
  time.sleep(secs)
  last, elapsed = chief_session.run(global_step), time.monotonic() - began
  stop.set()
  # Closing the token queue wakes every worker still waiting for a token.
  with tf.compat.v1.Session(cluster.worker_targets[0],
                            graph=chief_session.graph,
                            config=tf.compat.v1.ConfigProto(
                                operation_timeout_in_ms=10_000)) as closer:
    closer.run(chief_opt.get_chief_queue_runner().cancel_op)
  for t in threads:
    t.join(60)
  for b in reversed(built):
    b[0].close()
  if errors:
    raise errors[0]
  return (last - first) / elapsed


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--secs", type=float, default=10.0,
                      help="measured seconds per run")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--on", type=json.loads,
                      default={"statistics": True},
                      help="JSON options of the measured side")
  args = parser.parse_args(argv)
  rates = {False: [], True: []}
  ratios = []
  for r in range(args.rounds):
    for stats in ((False, True) if r % 2 == 0 else (True, False)):
      rate = run_once(workers=args.workers, secs=args.secs,
                      options=args.on if stats else {})
      rates[stats].append(rate)
      print("round %d %s=%-5s %7.1f steps/s" % (r, "on" , stats, rate))
    # Within a round both runs saw about the same machine: their ratio is
    # the evidence, as the bench's per-repetition ratios are.
    ratios.append(rates[True][-1] / rates[False][-1])
  off, on = pystats.median(rates[False]), pystats.median(rates[True])
  print("median steps/s: off %.1f, on %.1f" % (off, on))
  interval = bench_report.median_interval(ratios)
  if interval is None:
    print("ratio on/off %.3f (one round: no interval)" % ratios[0])
    return 0
  low, high, coverage = interval
  print("ratio on/off %.3f, median of %d per-round ratios; interval "
        "%.3f-%.3f (sign test, %d%% coverage): %s on is %s" % (
            pystats.median(ratios), len(ratios), low, high,
            round(coverage * 100), json.dumps(args.on), {
                "slower": "slower than off", "faster": "faster than off",
                "equal within noise": "equal to off within noise"}[
                    bench_report.verdict(interval)]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
