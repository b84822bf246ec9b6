#!/usr/bin/env python3
"""Prints the live sync state of a running sync_replicas job, read-only.

  tools/status --manifest ckpt/sync_manifest.json --ps 10.0.0.5:2222
  tools/status --manifest ckpt/ --watch --interval 5      # TF_CONFIG's ps

Shows the global step, the tokens in ``sync_token_q``, and for every
accumulator how many fresh gradients it holds against the
``replicas_to_aggregate`` an update needs, then what the next update waits
for. ``--watch`` refreshes every ``--interval`` seconds (until ``--count``
snapshots or Ctrl-C) and flags the job as stuck once the global step has not
moved for ``--stall-secs``. While an update waits, it also reads every
replica's ``sync_rep_local_step`` on its own task (one bounded read each) and
says which replicas' pushes are stale, with the chief's stall log line's
words.

The job's layout comes from its sync manifest: the chief writes it with
``opt.write_sync_manifest(checkpoint_dir)`` (TensorFlow has no public way to
list a ps task's resources). The tool connects a session to one task of the
cluster (``--target``, else the first ``--ps`` address, else TF_CONFIG's
first ps task), sees only the jobs that hold sync state, and runs nothing but
``num_accumulated``, the queues' ``size`` and reads of the global and local
steps: it never takes, dequeues or assigns, so it cannot change training.

Exit code: 0, or 1 if the state could not be read (the reason on stderr).
"""

import argparse
import datetime
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # pylint: disable=g-import-not-at-top

from sync_replicas import _diagnose  # pylint: disable=g-import-not-at-top
from sync_replicas import _manifest  # pylint: disable=g-import-not-at-top


def _parse(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--manifest", required=True,
                      help="the job's sync_manifest.json, or the directory "
                      "(e.g. the chief's checkpoint_dir) holding it")
  parser.add_argument("--target", help="session target, e.g. "
                      "grpc://10.0.0.5:2222 (default: the first ps)")
  parser.add_argument("--ps", default="",
                      help="comma-separated ps addresses host:port")
  parser.add_argument("--worker", default="",
                      help="comma-separated worker addresses (used as the "
                      "target when there is no ps)")
  parser.add_argument("--watch", action="store_true",
                      help="refresh until --count snapshots or Ctrl-C")
  parser.add_argument("--interval", type=float, default=2.0,
                      help="seconds between --watch snapshots")
  parser.add_argument("--count", type=int, default=0,
                      help="with --watch, stop after this many snapshots "
                      "(0: until Ctrl-C)")
  parser.add_argument("--stall-secs", type=float, default=60.0,
                      help="with --watch, call the job stuck when the global "
                      "step has not moved for this long")
  parser.add_argument("--timeout", type=float, default=10.0,
                      help="seconds any read may take")
  args = parser.parse_args(argv)
  if args.interval <= 0 or args.count < 0 or args.timeout <= 0:
    parser.error("--interval and --timeout must be > 0 and --count >= 0, got "
                 "%s, %s and %s" % (args.interval, args.timeout, args.count))
  return args


def _target(args):
  """The session target: --target, --ps, --worker, then TF_CONFIG."""
  if args.target:
    return args.target
  for addresses in (args.ps, args.worker):
    first = [a for a in addresses.split(",") if a]
    if first:
      return "grpc://" + first[0]
  cluster = json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {})
  for job in ("ps", "chief", "worker"):
    if cluster.get(job):
      return "grpc://" + cluster[job][0]
  raise ValueError(
      "No cluster to connect to: pass --target grpc://host:port, --ps "
      "host:port[,...] or set TF_CONFIG (got none of them).")


def snapshot(sess, ops, manifest):
  """Reads the state once: a dict with step, tokens, counts and starts."""
  step, tokens, counts = sess.run(
      [ops.global_step, ops.tokens, ops.num_accumulated])
  starts = None if ops.starts is None else int(sess.run(ops.starts))
  return {"global_step": int(step), "tokens": int(tokens),
          "counts": [int(c) for c in counts], "starts": starts,
          "needed": manifest["replicas_to_aggregate"]}


def replicas(state, manifest, reader, target, timeout):
  """The replicas' line (their local steps, which pushes are stale), or None.

  Read only while an update waits; a manifest without a local step (older,
  or an in-process job) gives None.
  """
  spec = manifest.get("local_step")
  if reader is None or not spec or min(state["counts"] or [0]) >= (
      state["needed"]):
    return None
  devices = _diagnose.manifest_devices(spec["device"],
                                       manifest["total_num_replicas"])
  if not devices:
    return None
  found = reader.read(target, devices, config=tf.compat.v1.ConfigProto(
      operation_timeout_in_ms=int(timeout * 1000)))
  return _diagnose.replicas_clause(
      found, global_step=state["global_step"], tokens=state["tokens"],
      starts=state["starts"],
      generations=manifest["global_step"]["dtype"] == "int64", waiting=True)


def render(state, manifest, *, stalled_secs=None, stall_secs=None,
           replicas_line=None):
  """The snapshot as text lines."""
  needed = state["needed"]
  lines = ["sync state at %s" % datetime.datetime.now().strftime("%H:%M:%S"),
           "  global_step: %d" % state["global_step"],
           "  tokens queued: %d (each update releases %d)"
           % (state["tokens"], manifest["tokens_per_step"]),
           "  accumulators (fresh gradients / needed):"]
  for entry, count in zip(manifest["accumulators"], state["counts"]):
    lines.append("    %-40s %d/%d  %s%s" % (
        entry["variable"], count, needed, entry["device"] or "(local)",
        "  sparse" if entry["sparse"] else ""))
  # The chief's stall log line's own words (one text, in _diagnose); the
  # replicas' clause follows on a line of its own.
  verdict = _diagnose.verdict(
      names=[entry["variable"] for entry in manifest["accumulators"]],
      counts=state["counts"], tokens=state["tokens"],
      replicas_to_aggregate=needed, global_step=state["global_step"])
  lines.append("  next: " + verdict)
  if replicas_line:
    lines.append("  replicas: " + replicas_line)
  if stalled_secs is not None and stall_secs and stalled_secs >= stall_secs:
    lines.append("  STUCK: global step %d has not moved for %.0f s (fewer "
                 "than %d workers pushing fresh gradients?)"
                 % (state["global_step"], stalled_secs, needed))
  return lines


def main(argv=None, *, out=None, clock=time.monotonic):
  out = out or sys.stdout
  args = _parse(argv)
  try:
    manifest = _manifest.read(args.manifest)
    target = _target(args)
  except (ValueError, OSError, tf.errors.OpError) as e:
    print("status: %s" % e, file=sys.stderr)
    return 1
  graph = tf.Graph()
  with graph.as_default():
    # Built first, run first: read_ops would create what it does not find.
    checks = _manifest.presence_ops(manifest)
    ops = _manifest.read_ops(manifest)
  # Only the jobs holding sync state: a dead worker must not hold us up.
  config = tf.compat.v1.ConfigProto(
      operation_timeout_in_ms=int(args.timeout * 1000),
      device_filters=_manifest.jobs(manifest))
  shown, last_step, since = 0, None, clock()
  spec = manifest.get("local_step")
  reader = (_diagnose.LocalStepReader(_diagnose.LocalStepSpec(**spec),
                                      timeout_secs=args.timeout)
            if spec else None)
  try:
    with tf.compat.v1.Session(target, graph=graph, config=config) as sess:
      found = sess.run([check for _, check in checks])
      missing = [what for (what, _), ok in zip(checks, found) if not ok]
      if missing:
        print("status: %s holds no %s. The manifest is from another job or "
              "run, the address is another job's, or the job's chief has not "
              "initialized the model yet. Nothing was read or created."
              % (target, "; no ".join(missing)), file=sys.stderr)
        return 1
      while True:
        state = snapshot(sess, ops, manifest)
        now = clock()
        if state["global_step"] != last_step:
          last_step, since = state["global_step"], now
        out.write("\n".join(render(
            state, manifest, stalled_secs=now - since if args.watch else None,
            stall_secs=args.stall_secs,
            replicas_line=replicas(state, manifest, reader, target,
                                   args.timeout))) + "\n")
        out.flush()
        shown += 1
        if not args.watch or (args.count and shown >= args.count):
          return 0
        time.sleep(args.interval)
  except KeyboardInterrupt:
    return 0
  except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError) as e:
    print("status: could not reach the job at %s within %.0f s (%s: %s). Is "
          "the job running and the address right? A cluster started by "
          "tools/launch is reachable only inside its namespace: run this "
          "through tools/launch --enter PID -- ..." % (
              target, args.timeout, type(e).__name__,
              e.message.splitlines()[0][:200]), file=sys.stderr)
    return 1
  except tf.errors.OpError as e:
    print("status: could not read the sync state from %s: %s"
          % (target, e.message), file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
