#!/usr/bin/env python3
"""How long ``sync-replicas-status`` lasts after its answer, side by side.

Reads a live in-process job (1 ps, 2 workers, the chief pushed once) with
the command as it ends now, ``status.console`` (B: its process ends once its
lines are out), and with ``status.main`` returned into Python's exit (A:
TensorFlow's teardown follows), interleaved A B A B ..., each a process of
its own, stdout unbuffered. Per run: the wall time, the time from its last
line to its exit, and its CPU time; then the medians and the medians of the
per-pair ratios B/A. The machine's load goes next to every run: report it
with the figures. Run from the clone's root with the venv's python:

  nice -n 5 .venv/bin/python tools/status_exit.py --reps 3
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import tensorflow as tf

import sync_replicas

_MAIN = ("import sys; from sync_replicas.cli import status; "
         "sys.exit(status.main())")


def _job(directory):
  """A live job: the chief pushed once (1 of 2 gradients, 1 token queued).

  Returns the cluster, the manifest's path and the open sessions.
  """
  tf.compat.v1.disable_eager_execution()
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  sessions, path, train = [], None, None
  for task in range(2):
    graph = tf.Graph()
    with graph.as_default():
      with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
          ps_tasks=1, worker_device="/job:worker/task:%d" % task)):
        step = tf.compat.v1.train.get_or_create_global_step()
        w = tf.compat.v1.get_variable("w", [4],
                                      initializer=tf.zeros_initializer())
        opt = sync_replicas.SyncReplicasOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1),
            replicas_to_aggregate=2, total_num_replicas=2, data_end="stock")
        op = opt.minimize(tf.reduce_sum(tf.square(w - 1.0)),
                          global_step=step)
      if task == 0:
        path, train = opt.write_sync_manifest(directory), op
      sessions.append(tf.compat.v1.train.MonitoredTrainingSession(
          master=cluster.worker_targets[task], is_chief=task == 0,
          hooks=[opt.make_session_run_hook(task == 0)],
          config=tf.compat.v1.ConfigProto(operation_timeout_in_ms=60_000)))
  sessions[0].run(train)
  return cluster, path, sessions


def _one(argv, env):
  """``(exit code, wall s, s from the last line to the exit, CPU s)``."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  start = time.monotonic()
  proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, env=env)
  last = start
  for _ in proc.stdout:
    last = time.monotonic()
  code = proc.wait(timeout=600)
  end = time.monotonic()
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  return code, end - start, end - last, cpu


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--reps", type=int, default=3)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as directory:
    cluster, path, sessions = _job(directory)
    ps = cluster.cluster_spec.job_tasks("ps")[0]
    tail = ["--manifest", path, "--ps", ps]
    commands = {"A": [sys.executable, "-c", _MAIN, *tail],
                "B": [sys.executable, "-m", "sync_replicas.cli.status", *tail]}
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    runs = {"A": [], "B": []}
    for rep in range(args.reps):
      for name in "AB":
        code, wall, after, cpu = _one(commands[name], env)
        runs[name].append((wall, after, cpu))
        print("%s run %d: exit %d, wall %.1f s, last line to exit %.1f s, "
              "CPU %.1f s, load %.1f" % (name, rep, code, wall, after, cpu,
                                         os.getloadavg()[0]), flush=True)
    for i, what in enumerate(["wall", "last line to exit", "CPU"]):
      ratios = [b[i] / a[i] for a, b in zip(runs["A"], runs["B"],
                                            strict=True)]
      print("%s: A median %.2f s, B median %.2f s; B/A per pair %s, median "
            "%.2f" % (what, statistics.median(r[i] for r in runs["A"]),
                      statistics.median(r[i] for r in runs["B"]),
                      " ".join("%.2f" % r for r in ratios),
                      statistics.median(ratios)), flush=True)
    # Its sessions' and servers' teardown is no part of the figures.
    del sessions
    os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  main()
