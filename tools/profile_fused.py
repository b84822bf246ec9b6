#!/usr/bin/env python3
"""Where a step's time goes, op by op, with and without fused accumulators.

  .venv/bin/python tools/profile_fused.py                    # medium, W=1
  .venv/bin/python tools/profile_fused.py --scenario many --steps 40
  .venv/bin/python tools/profile_fused.py --scenario mlp --variant default={} \
      --variant 'fused_packed={"fuse_dense_gradients": true,
                               "pack_variable_reads": true}'

Fusing copies every dense gradient of a ps task into one tensor on the
worker (ConcatV2), pushes that tensor into one accumulator, and on the ps
splits the averaged tensor back (Split/SplitV, Reshape). On many small
variables that copy is cheap and the transfers it saves are not; on large
ones the copy is bandwidth of its own. This tool measures those costs from
TensorFlow's own step stats (``RunOptions.FULL_TRACE``: every op's start
and end on every task of the run) instead of guessing them.

One in-process cluster (1 ps, 1 worker on 127.0.0.1) per option set, the
model of tools/bench's scenario (tools/_bench_task.py's ``build_model``),
a plain session: the worker's train op (compute, push, token) runs in one
thread and the chief's sync op (take, average, apply, release) in another,
as the hook's queue runner would run it, each traced. Printed per option
set: the median untraced step (train op) time, the process's CPU per
untraced step (every task of the cluster is in it), then per op category the
median over traced steps of the summed op time on each task, for the train
op and for the sync op. The categories:

  read       the model's reads on the ps (ReadVariableOp, Identity), and
             every op of packed variable reads (pack_variable_reads)
  pack       ConcatV2 and Reshape of the gradients (the worker's copy)
  unpack     Split, SplitV, Slice, Reshape on the ps (the split back)
  push       AccumulatorApplyGradient (the copy into the accumulator)
  take       AccumulatorTakeGradient: the average, and the wait for the
             gradients to arrive (an op's time is from its start to its end)
  apply      the wrapped optimizer's Apply* ops
  other      everything else (the model's compute, token queue, steps, ...)

The transfers between tasks are not ops in step stats (gRPC moves tensors
through the rendezvous, outside any op): they are in the untraced step's
time, not in any category; their count is, as "tensors received" per task
(the RecvTensor entries of the trace). "no-op session.run" is the floor
of any run from Python here: a session.run of a no-op on the worker.

The absolute times here are one machine's; the question answered is the
share each category takes, fused against default, in the same process.
The op times are wall intervals (an op preempted by another process is
longer), the CPU per step is the process's CPU (``time.process_time``),
which load does not inflate: on a loaded machine compare the CPU.

Every wait is bounded without a per-run deadline that load could
overrun (the first runs register the graphs on every task, seconds on a
loaded machine): each run by the session's operation timeout
(--op-timeout), the whole of one option set's profile by --budget.
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_TOOLS))
sys.path.insert(0, _TOOLS)

import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import _bench_protocol  # pylint: disable=g-import-not-at-top
import _bench_task  # pylint: disable=g-import-not-at-top
import sync_replicas  # pylint: disable=g-import-not-at-top

CATEGORIES = ("read", "pack", "unpack", "push", "take", "apply", "other")


def category(node, device):
  """The category (see the module's docstring) of one traced op."""
  op = node.timeline_label.split(" = ")[-1].split("(")[0] if (
      node.timeline_label) else ""
  name = node.node_name
  kind = op or name
  if "AccumulatorApplyGradient" in kind:
    return "push"
  if "AccumulatorTakeGradient" in kind:
    return "take"
  if kind.startswith("Apply") or kind.startswith("ResourceApply"):
    return "apply"
  on_ps = "/job:ps" in device
  if "packed_reads/" in name or (on_ps and kind in ("ReadVariableOp",
                                                    "Identity")):
    return "read"
  if kind in ("ConcatV2", "Concat") or (kind == "Reshape" and not on_ps
                                         and "gradients" in name):
    return "pack"
  if on_ps and kind in ("Split", "SplitV", "Slice", "Reshape",
                        "StridedSlice"):
    return "unpack"
  return "other"


def summed(run_metadata):
  """{(task, category): microseconds} of one traced run, and
  ``(task, "tensors received")``: the tensors that crossed to that task."""
  out = {}
  for dev in run_metadata.step_stats.dev_stats:
    task = "ps" if "/job:ps" in dev.device else "worker"
    for node in dev.node_stats:
      if node.node_name.startswith("RecvTensor"):
        key = (task, "tensors received")
        out[key] = out.get(key, 0) + 1
        continue
      micros = node.all_end_rel_micros or (
          node.op_end_rel_micros - node.op_start_rel_micros)
      key = (task, category(node, dev.device))
      out[key] = out.get(key, 0) + micros
  return out


def profile(scenario, options, *, steps, warmup, op_timeout, budget):
  """Median step time and per-category op time of ``steps`` traced steps.

  Bounded without a deadline on any one run that load could exceed: the
  chief's loop runs exactly one sync op per train step (one worker, one
  replica to aggregate: each push is one update, each update the token of
  a later step), so no run of it is left waiting for a gradient that never
  comes, and every run, either thread's, is bounded by the session's
  ``operation_timeout_in_ms`` (``op_timeout``). ``budget`` bounds the whole
  profile: past it the worker stops between steps and the profile fails
  with how far it got.
  """
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  graph = tf.Graph()
  with graph.as_default(), tf.compat.v1.device(
      tf.compat.v1.train.replica_device_setter(
          cluster=cluster.cluster_spec, worker_device="/job:worker/task:0")):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    loss = _bench_task.build_model(scenario, np.random.default_rng(0))
    opt = sync_replicas.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.001),
        replicas_to_aggregate=1, total_num_replicas=1, **options)
    train_op = opt.minimize(loss, global_step=global_step)
    sync_op = opt.get_chief_queue_runner().enqueue_ops[0]
    init = tf.compat.v1.global_variables_initializer()
    # prefetch_variable_reads' copies are local variables.
    local_init = tf.compat.v1.local_variables_initializer()
    tokens = opt.get_init_tokens_op()
  config = tf.compat.v1.ConfigProto(
      operation_timeout_in_ms=int(op_timeout * 1000))
  trace = tf.compat.v1.RunOptions(
      trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
  plain = tf.compat.v1.RunOptions()
  results = {"train": [], "sync": []}
  step_secs = []
  errors = []
  total = warmup + 2 * steps  # Untraced, then traced.
  tracing = threading.Event()
  stop = threading.Event()
  deadline = time.monotonic() + budget
  with tf.compat.v1.Session(cluster.worker_targets[0], graph=graph,
                            config=config) as sess:
    sess.run(init)
    sess.run(local_init)
    sess.run(opt.local_step_init_op)
    sess.run(opt.chief_init_op)
    sess.run(tokens)

    def chief():
      for _ in range(total):
        if stop.is_set():
          return
        meta = tf.compat.v1.RunMetadata()
        traced = tracing.is_set()
        try:
          sess.run(sync_op, options=trace if traced else plain,
                   run_metadata=meta)
        except Exception as e:  # pylint: disable=broad-except
          errors.append(e)
          return
        if traced:
          results["sync"].append(summed(meta))

    # The floor of any session.run from Python: a no-op on the worker.
    noop = sess.make_callable(tf.no_op())
    floor = []
    for _ in range(warmup + steps):
      began = time.perf_counter()
      noop()
      floor.append(time.perf_counter() - began)
    thread = threading.Thread(target=chief, daemon=True)
    thread.start()
    done = 0
    try:
      for i in range(total):
        if errors:
          break
        if time.monotonic() > deadline:
          raise RuntimeError(
              "profiling %r took more than its budget of %.0f s after %d "
              "of %d steps: give --budget more (a loaded machine), or "
              "--steps fewer" % (options, budget, i, total))
        if i == warmup:
          cpu_began = time.process_time()
        if i == warmup + steps:
          # Every task and the chief's loop live in this process: its CPU
          # over the untraced steps is the whole cluster's, per step.
          cpu_per_step = (time.process_time() - cpu_began) / steps
          tracing.set()
        meta = tf.compat.v1.RunMetadata()
        began = time.perf_counter()
        sess.run(train_op, options=trace if tracing.is_set() else plain,
                 run_metadata=meta)
        done += 1
        if tracing.is_set():
          results["train"].append(summed(meta))
        elif i >= warmup:
          step_secs.append(time.perf_counter() - began)
    finally:
      stop.set()
      # The chief's last sync op follows the worker's last push at once;
      # after a failure its pending run ends by the operation timeout.
      thread.join(timeout=op_timeout + 10)
    if errors or thread.is_alive() or done < total:
      raise RuntimeError(
          "the chief's sync op failed or hung after %d of %d steps: %r" % (
              done, total, errors))
  medians = {}
  for run, samples in results.items():
    for key in {k for s in samples for k in s}:
      medians["%s/%s/%s" % (run, key[0], key[1])] = statistics.median(
          s.get(key, 0) for s in samples)
  return {"step_ms_p50": statistics.median(step_secs) * 1000,
          "noop_run_ms_p50": statistics.median(floor[warmup:]) * 1000,
          "cpu_ms_per_step": cpu_per_step * 1000,
          "op_micros": medians}


def table(results):
  """The profiles side by side: one line per (run, task, category)."""
  names = list(results)
  lines = ["%-26s" % "untraced train step ms p50" + "".join(
      "%14.2f" % results[n]["step_ms_p50"] for n in names)]
  lines.append("%-26s" % "no-op session.run ms p50" + "".join(
      "%14.2f" % results[n]["noop_run_ms_p50"] for n in names))
  lines.append("%-26s" % "cluster CPU ms per step" + "".join(
      "%14.2f" % results[n]["cpu_ms_per_step"] for n in names))
  lines.append("%-26s" % "op time, us (median)" + "".join(
      "%14s" % n for n in names))
  for run in ("train", "sync"):
    for task in ("worker", "ps"):
      for cat in CATEGORIES + ("tensors received",):
        key = "%s/%s/%s" % (run, task, cat)
        vals = [results[n]["op_micros"].get(key, 0) for n in names]
        if any(vals):
          lines.append("%-26s" % key + "".join("%14.0f" % v for v in vals))
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--scenario", default="medium",
                      choices=["small", "many", "flat"] + sorted(
                          _bench_task.MLPS) + sorted(_bench_task.STACKED))
  parser.add_argument("--steps", type=int, default=30,
                      help="untraced steps timed, then as many traced")
  parser.add_argument("--warmup", type=int, default=10)
  parser.add_argument(
      "--variant", action="append", default=[], metavar="NAME=JSON",
      help="option sets to profile (default: default={} and "
      "fused={\"fuse_dense_gradients\": true})")
  parser.add_argument(
      "--op-timeout", type=float, default=120,
      help="seconds any one session.run may take (operation_timeout_in_ms)")
  parser.add_argument(
      "--budget", type=float, default=900,
      help="seconds one option set's profile may take in all")
  parser.add_argument("--json", help="also write the results here")
  args = parser.parse_args(argv)
  variants = {}
  for text in args.variant or ['default={}',
                               'fused={"fuse_dense_gradients": true}']:
    try:
      name, options = _bench_protocol.parse_variant(text)
    except ValueError as e:
      parser.error(str(e))
    variants[name] = options
  if args.steps < 1 or args.warmup < 0 or args.op_timeout <= 0 or (
      args.budget <= 0):
    parser.error("--steps must be >= 1, --warmup >= 0, --op-timeout and "
                 "--budget > 0; got %s, %s, %s, %s" % (
                     args.steps, args.warmup, args.op_timeout, args.budget))
  results = {name: profile(args.scenario, options, steps=args.steps,
                           warmup=args.warmup, op_timeout=args.op_timeout,
                           budget=args.budget)
             for name, options in variants.items()}
  print("scenario %s, W=1, %d traced steps each" % (args.scenario,
                                                    args.steps))
  print(table(results))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
