"""A running job's sync state, read through its manifest, as status lines.

Owns what ``sync-replicas-status`` does once its arguments are checked: the
read-only session to one task of the job, the check that the task holds the
manifest's sync state, each snapshot (the global step, the tokens queued, each
accumulator's fresh gradients, and, while an update waits, every replica's
local step) and its text. It runs only ``num_accumulated``, the queues'
``size`` and reads of the global and local steps: no take, no dequeue, no
assign. Separate from ``status`` so that the tool's ``--help`` and argument
errors come before TensorFlow's import.
"""

import datetime
import time

import tensorflow as tf

from sync_replicas import _data_end
from sync_replicas import _diagnose
from sync_replicas import _gone
from sync_replicas import _lost
from sync_replicas import _manifest
from sync_replicas.cli import _cli
from sync_replicas.cli import launch


def snapshot(sess, ops, manifest):
  """Reads the state once: a dict with step, tokens, counts and starts."""
  step, tokens, counts = sess.run(
      [ops.global_step, ops.tokens, ops.num_accumulated])
  starts = None if ops.starts is None else int(sess.run(ops.starts))
  done = gone = None
  if ops.done_workers is not None:
    keys, values = sess.run(ops.done_workers)
    done = sorted(int(k) for k in keys)  # As the updates count them.
    gone = _gone.gone_keys(keys, values)
  addresses = {}
  if ops.addresses is not None:
    keys, values = sess.run(ops.addresses)
    addresses = {int(k): v.decode("utf-8")
                 for k, v in zip(keys, values, strict=True)}
  needed = manifest["replicas_to_aggregate"]
  if done:
    # What the chief's loop asks once workers are done (_data_end.need).
    needed = max(0, min(needed, manifest["tokens_per_step"] - len(done)))
  return {"global_step": int(step), "tokens": int(tokens),
          "counts": [int(c) for c in counts], "starts": starts,
          "needed": needed, "done": done, "gone": gone,
          "addresses": addresses}


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
      operation_timeout_in_ms=int(timeout * 1000)), addresses=_lost.by_device(
          state.get("addresses") or {}, dict(enumerate(devices))))
  # The chief's stall line's words on the workers that cannot push, from
  # the readings above and a probe of each recorded address.
  by_device = dict(zip(devices, found, strict=True))
  lost = _lost.lacking(
      keys=set(range(len(devices))) - set(state["done"] or ()),
      addresses=state.get("addresses") or {}, devices=dict(enumerate(devices)),
      read_steps=lambda wanted: [by_device[d] for d in wanted],
      # One look: the readings above are the ones the replicas' line shows,
      # and a status command a user runs again is its own second look.
      wait=None)
  return _diagnose.replicas_clause(
      found, global_step=state["global_step"], tokens=state["tokens"],
      starts=state["starts"],
      generations=manifest["global_step"]["dtype"] == "int64",
      waiting=True) + _lost.clause(
          lost, missing=state["needed"] - min(state["counts"] or [0]))


def render(state, manifest, *, stalled_secs=None, stall_secs=None,
           replicas_line=None):
  """The snapshot as text lines."""
  needed = state["needed"]
  lines = ["sync state at %s" % datetime.datetime.now().strftime("%H:%M:%S"),
           "  global_step: %d" % state["global_step"],
           "  tokens queued: %d (each update releases %d)"
           % (state["tokens"], manifest["tokens_per_step"]),
           "  accumulators (fresh gradients / needed):"]
  for entry, count in zip(manifest["accumulators"], state["counts"],
                          strict=True):
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
  if state.get("done") is not None:
    # The chief's stall line's words, each on a line of its own; no
    # "lost:" line without a gone worker (the shorter list wins).
    # Named by task (chief0, worker1), as the chief's lines name them.
    devices = dict(enumerate(_diagnose.manifest_devices(
        (manifest.get("local_step") or {}).get("device"),
        manifest["total_num_replicas"])))
    for label, clause in zip(["data end", "lost"], _data_end.out_clauses(
        state["done"], state.get("gone"),
        total_num_replicas=manifest["total_num_replicas"],
        devices=devices), strict=False):
      lines.append("  %s: %s" % (label, clause))
  if replicas_line:
    lines.append("  replicas: " + replicas_line)
  if stalled_secs is not None and stall_secs and stalled_secs >= stall_secs:
    lines.append("  STUCK: global step %d has not moved for %.0f s (fewer "
                 "than %d workers pushing fresh gradients?)"
                 % (state["global_step"], stalled_secs, needed))
  return lines


def watch(args, *, find_target, out, clock, prog, started=None,
          ended=None):
  """Prints the state of the job; returns the exit code.

  Once, or with ``args.watch`` every ``args.interval`` s until
  ``args.count`` snapshots. A failure is one line on stderr and exit code 1;
  Ctrl-C (KeyboardInterrupt) passes through to the caller.

  Args:
    args: The tool's parsed arguments.
    find_target: Returns the session target; raises ValueError, with what
      to pass instead, when there is none. Asked once the manifest is read:
      a file that is no manifest is the first thing to report.
    out: Where the snapshots go.
    clock: Seconds, for ``args.stall_secs``.
    prog: The tool's name, in front of an error.
    started: When the tool started (``time.monotonic()``), for the time an
      error says it took (default: now).
    ended: Returns why the job has ended, or None: asked when the job does
      not answer, as it may have ended while the tool started.
  """
  started = time.monotonic() if started is None else started
  try:
    manifest = _manifest.read(args.manifest)
    target = find_target()
  except (ValueError, OSError, tf.errors.OpError) as e:
    _cli.say(prog, str(e))
    return _cli.EXIT_FAILED
  graph = tf.Graph()
  with graph.as_default():
    # Built first, run first: read_ops would create what it does not find.
    checks = _manifest.presence_ops(manifest)
    ops = _manifest.read_ops(manifest)
  # Only the jobs holding sync state: a dead worker must not hold us up.
  config = tf.compat.v1.ConfigProto(
      operation_timeout_in_ms=int(args.timeout * 1000),
      device_filters=_manifest.jobs(manifest))
  try:
    with tf.compat.v1.Session(target, graph=graph, config=config) as sess:
      found = sess.run([check for _, check in checks])
      missing = [what for (what, _), ok in zip(checks, found, strict=True)
                 if not ok]
      if missing:
        _cli.say(prog, "%s holds no %s. The manifest is from another job or "
                 "run, the address is another job's, or the job's chief has "
                 "not initialized the model yet. Nothing was read or created."
                 % (target, "; no ".join(missing)))
        return _cli.EXIT_FAILED
      _show(sess, ops, manifest, args, target=target, out=out, clock=clock)
      return _cli.EXIT_OK
  except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError) as e:
    _cli.say(prog, (ended() if ended is not None else None) or _unreachable(
        e, target=target, timeout=args.timeout, started=started, prog=prog))
    return _cli.EXIT_FAILED
  except tf.errors.OpError as e:
    _cli.say(prog, "could not read the sync state from %s: %s: %s"
             % (target, type(e).__name__, _gist(e.message)))
    return _cli.EXIT_FAILED


def _unreachable(error, *, target, timeout, started, prog):
  """The line for a job that did not answer (and has not ended, as far as
  the tool can tell: it may have ended while TensorFlow loaded, which
  ``ended`` answers first). The time it says is the time it took,
  TensorFlow's start included (a user once counted 15.9 s against a stated
  10)."""
  return ("could not reach the job at %s: no answer within --timeout %.0f s "
          "(%.0f s since the tool started; %s: %s). Is the job running and "
          "the address right?%s" % (
              target, timeout, time.monotonic() - started,
              type(error).__name__, _gist(error.message),
              _launches_hint(prog)))


def _launches_hint(prog):
  """Where the job may be instead: the confined launches running now, whose
  clusters only a tool inside their namespace reaches; none, nothing."""
  pids = launch.confined_launches()
  if not pids:
    return ""
  return (" A cluster that sync-replicas-launch confined is reachable only "
          "inside its namespace; launches running now: %s. Run this through "
          "sync-replicas-launch --enter PID -- %s ..." % (
              ", ".join(map(str, pids)), prog))


def _show(sess, ops, manifest, args, *, target, out, clock):
  """Writes snapshots to ``out``: one, or ``--watch``'s series."""
  shown, last_step, since = 0, None, clock()
  spec = manifest.get("local_step")
  reader = (_diagnose.LocalStepReader(_diagnose.LocalStepSpec(**spec),
                                      timeout_secs=args.timeout)
            if spec else None)
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
      return
    time.sleep(args.interval)


def _gist(message):
  """The first informative line of a TensorFlow error, for one line of ours.

  TensorFlow 2.21 starts a failed run's message with "Graph execution
  error:" and a blank line; what went wrong follows.
  """
  lines = [line.strip() for line in message.splitlines()]
  useful = [line for line in lines
            if line and line != "Graph execution error:"]
  return (useful or lines or [""])[0][:200]
