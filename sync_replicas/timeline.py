"""Merges the tasks' timeline files into one trace, a picture and a verdict.

Owns reading the files that tasks write when the optimizer has a
``timeline_dir`` (``<task>.worker.jsonl``, ``<task>.chief.jsonl``), putting
their clocks on the chief's, deciding which pushes were stale and which
worker each update waited for, and writing:

* a Chrome trace (``chrome://tracing``, Perfetto): one process row per task,
  its train steps (compute, push, wait for token) on one thread and, on the
  chief, the sync loop (wait for gradients, apply, release tokens) on
  another; every event carries its global step;
* optionally a PNG of the last N updates (matplotlib), one row per task;
* a summary: per worker, how many updates waited for it last and its
  median token wait; then each one's share of the updates, naming a
  straggler only when the others wait for it (``verdict``).

Clocks: every record is wall-clock time (``time.time`` and
``tf.timestamp``, the same clock) of the task that wrote it. Tasks on one
machine share that clock: their events line up exactly. Across machines the
clocks are taken as synchronized (NTP), and corrected only where causality
proves them wrong: a worker whose token arrived, on its clock, before the
chief began the sync run that released it runs behind by at least the
difference, and is moved forward by the largest such difference
(``clock_offsets``). What remains is the machines' own synchronization error,
up to how long a sync run lasts (a clock that runs ahead, or behind by less
than that, is not detected). The offsets are in the trace
(``otherData.clock_offsets_secs``) and in each task's row name.

Each task of the job, built with timeline_dir=DIR or run with
SYNC_REPLICAS_TIMELINE=DIR, wrote DIR/<task>.worker.jsonl (the chief also
DIR/<task>.chief.jsonl); once they have ended, on a machine that can read
DIR (also as python -m sync_replicas.timeline):

  sync-replicas-timeline DIR --png DIR/last.png
  # then open DIR/trace.json in chrome://tracing or ui.perfetto.dev

Exit code: 0; 1 if the files could not be read or written (the reason on
stderr, in one line); 2 for bad arguments, a DIRECTORY that does not exist
included.
"""

import collections
import glob
import json
import os
import statistics
import sys
import typing

from sync_replicas import _task_names
from sync_replicas.cli import _cli

#: Steps of one restart generation in int64 tokens (``_restart``); the
#: timeline labels plain steps.
_STRIDE = 1 << 32

Update = collections.namedtuple(
    "Update", "task began taken applied released step")
Step = collections.namedtuple(
    "Step", "task began grads pushed token step got stale")


def read(directory: str) -> "tuple[list[Update], list[Step], list[str]]":
  """Reads every task's records: ``(updates, steps, tasks)``.

  Raises:
    FileNotFoundError: no such directory, or no timeline file in it.
  """
  updates, steps, tasks = [], [], []
  if not os.path.isdir(directory):
    raise FileNotFoundError(
        "no such directory: %s. Pass the timeline_dir the job's tasks wrote "
        "to (the examples: their --timeline_dir)." % directory)
  paths = sorted(glob.glob(os.path.join(directory, "*.jsonl")))
  if not paths:
    raise FileNotFoundError(
        "no timeline files (*.jsonl) in %s: was the job built with "
        "timeline_dir=%r, or SYNC_REPLICAS_TIMELINE set?"
        % (directory, directory))
  for path in paths:
    task, role = os.path.basename(path).rsplit(".", 2)[:2]
    # Named as every line names a task (worker1), also in the files of
    # releases that wrote worker-1.
    task = _task_names.of_file_name(task)
    if task not in tasks:
      tasks.append(task)
    with open(path, encoding="utf-8") as lines:
      for line in lines:
        try:
          r = json.loads(line)
        except ValueError:
          continue  # A line cut by a killed task.
        if role == "chief" and r.get("kind") == "update":
          updates.append(Update(task, r["began"], r["taken"], r["applied"],
                                r["released"], r["step"] % _STRIDE))
        elif role == "worker" and r.get("kind") == "step":
          steps.append(Step(task, r["began"], r["grads"], r["pushed"],
                            r["token"], None if r["step"] is None
                            else r["step"] % _STRIDE, r["got"] % _STRIDE,
                            None))
  updates.sort(key=lambda u: u.applied)
  steps.sort(key=lambda s: s.began)
  return updates, steps, tasks


def last_start(directory: str) -> "float | None":
  """When the chief's process of the latest run in ``directory`` began, or
  None (no chief's file, or files written before start records existed).

  Runs that appended to one directory are told apart by the ``start``
  record each process writes first in each of its files: the chief task's
  latest begins the latest run, in either of its files (a run that applies
  no update, a resume past its last step, writes only its train steps).
  (A chief restarted within a job begins a new one too: merge with
  ``all_runs`` to see across it.)
  """
  began = None
  chiefs = [os.path.basename(p)[:-len(".chief.jsonl")] for p in
            glob.glob(os.path.join(directory, "*.chief.jsonl"))]
  for path in [p for task in chiefs for p in glob.glob(
      os.path.join(glob.escape(directory), glob.escape(task) + ".*.jsonl"))]:
    with open(path, encoding="utf-8") as lines:
      for line in lines:
        if '"start"' not in line:
          continue
        try:
          r = json.loads(line)
        except ValueError:
          continue
        if r.get("kind") == "start":
          began = max(began or r["began"], r["began"])
  return began


def clock_offsets(updates: "typing.Sequence[Update]",
                  steps: "typing.Sequence[Step]") -> "dict[str, float]":
  """Seconds to add to each task's clock to put it on the chief's.

  Only what causality proves: a token for step S cannot arrive before the
  chief began the sync run that released it, so a worker whose token
  arrived earlier, on its clock, runs behind by at least the difference,
  and is moved forward by the largest such difference. On one machine, and
  with clocks synchronized better than a sync run lasts, nothing is moved.
  """
  began = collections.defaultdict(list)
  for u in updates:
    began[u.step].append(u.began)
  chief = {u.task for u in updates}
  offsets: "collections.defaultdict[str, float]" = (
      collections.defaultdict(float))
  for s in steps:
    if s.task in chief or s.got not in began:
      continue
    # The run that released this token: the last that began before it
    # arrived, or the first, on a clock that runs behind.
    before = [t for t in began[s.got] if t <= s.token]
    start = max(before) if before else min(began[s.got])
    offsets[s.task] = max(offsets[s.task], start - s.token)
  return {task: secs for task, secs in offsets.items() if secs > 0}


def aligned(
    updates: "list[Update]", steps: "typing.Sequence[Step]"
) -> "tuple[list[Update], list[Step], dict[str, float]]":
  """The records on the chief's clock, with each push judged stale or not.

  A push at local step L is stale when the global step was already past L
  when it began (an update to a step above L had been applied): its
  ``pushed`` mark is taken when the worker learns the push landed, which
  may follow the update that push itself completed. A push that began
  before an update and landed after it is judged fresh: the one race this
  reading cannot see.
  """
  offsets = clock_offsets(updates, steps)
  shifted = []
  applied = [(u.applied, u.step) for u in updates]
  for s in steps:
    d = offsets.get(s.task, 0.0)
    s = s._replace(began=s.began + d, grads=s.grads + d,
                   pushed=s.pushed + d, token=s.token + d)
    past = max((step for t, step in applied if t <= s.grads), default=0)
    shifted.append(s._replace(stale=s.step is not None and past > s.step))
  return updates, shifted, offsets


def waited_for(updates: "typing.Sequence[Update]",
               steps: "typing.Sequence[Step]") -> "dict[int, str]":
  """For each update, the worker whose push the chief waited for last.

  Update to step S averages fresh pushes at local step S - 1; of those that
  began before its takes returned, the last to begin is what it waited for.
  (A push's start, not its ``pushed`` mark: the worker learns its push
  landed one hop after the ps, so the mark of the push an update waited
  for can follow the chief's own mark of the takes returning.)

  Returns:
    ``{step: task}``.
  """
  by_step = collections.defaultdict(list)
  for s in steps:
    if not s.stale and s.step is not None:
      by_step[s.step].append(s)
  verdict = {}
  for u in updates:
    began = [s for s in by_step.get(u.step - 1, ()) if s.grads <= u.taken]
    if began:
      verdict[u.step] = max(began, key=lambda s: s.grads).task
  return verdict


def summary(steps: "typing.Sequence[Step]",
            last: "dict[int, str]") -> "dict[str, dict[str, float]]":
  """Per task: updates waited for it last, steps, stale pushes, median wait.

  ``last`` is ``waited_for``'s answer, computed once for this and the trace.
  """
  counts = collections.Counter(last.values())
  rows = {}
  for task in sorted({s.task for s in steps}):
    mine = [s for s in steps if s.task == task]
    rows[task] = {
        "waited_for_last": counts.get(task, 0),
        "steps": len(mine),
        "stale_pushes": sum(1 for s in mine if s.stale),
        "median_token_wait_ms": round(
            1000 * statistics.median(s.token - s.pushed for s in mine), 3),
        "median_compute_ms": round(
            1000 * statistics.median(s.grads - s.began for s in mine), 3),
        # From a token to the next run: the task's input and Python.
        # Each step with the next (strict=False: the last has none).
        "median_between_runs_ms": round(1000 * statistics.median(
            [b.began - a.token
             for a, b in zip(mine, mine[1:], strict=False)] or [0.0]), 3),
    }
  return rows


def straggler(rows: "dict[str, dict[str, float]]") -> "str | None":
  """The task most updates waited for last, or None for no updates."""
  if not rows or not any(r["waited_for_last"] for r in rows.values()):
    return None
  return max(rows, key=lambda t: rows[t]["waited_for_last"])


def chrome_trace(updates: "typing.Sequence[Update]",
                 steps: "typing.Sequence[Step]",
                 offsets: "dict[str, float]",
                 last: "dict[int, str]") -> "dict[str, typing.Any]":
  """The trace as a dict, ready for ``json.dump`` (``last``: ``waited_for``'s
  answer, put in each update's ``args.waited_for``)."""
  tasks = sorted({s.task for s in steps} | {u.task for u in updates})
  pid = {t: i + 1 for i, t in enumerate(tasks)}
  zero = min([s.began for s in steps] + [u.began for u in updates] or [0])
  us = lambda t: round((t - zero) * 1e6, 1)  # pylint: disable=unnecessary-lambda-assignment
  events = []
  chief = {u.task for u in updates}
  for t in tasks:
    label = t + (" (chief)" if t in chief else "")
    events.append({"ph": "M", "name": "process_name", "pid": pid[t],
                   "args": {"name": label}})
    events.append({"ph": "M", "name": "process_sort_index", "pid": pid[t],
                   "args": {"sort_index": pid[t]}})
    events.append({"ph": "M", "name": "thread_name", "pid": pid[t], "tid": 0,
                   "args": {"name": "train steps (clock +%.6f s)"
                                    % offsets.get(t, 0.0)}})
    if t in chief:
      events.append({"ph": "M", "name": "thread_name", "pid": pid[t],
                     "tid": 1, "args": {"name": "sync loop"}})

  def span(name, task, tid, start, end, args):
    events.append({"ph": "X", "name": name, "cat": "sync_replicas",
                   "pid": pid[task], "tid": tid, "ts": us(start),
                   "dur": max(us(end) - us(start), 0.0), "args": args})
  previous: "dict[str, float]" = {}
  for s in steps:
    args = {"global_step": s.step, "token_step": s.got, "stale": s.stale}
    if s.task in previous:
      span("between runs (input, Python)", s.task, 0, previous[s.task],
           s.began, {})
    previous[s.task] = s.token
    span("step %s" % s.step, s.task, 0, s.began, s.token, args)
    span("compute", s.task, 0, s.began, s.grads, args)
    span("push (stale, dropped)" if s.stale else "push", s.task, 0, s.grads,
         s.pushed, args)
    span("wait for token", s.task, 0, s.pushed, s.token, args)
  for u in updates:
    args = {"global_step": u.step, "waited_for": last.get(u.step)}
    span("update to step %d" % u.step, u.task, 1, u.began, u.released, args)
    span("wait for gradients", u.task, 1, u.began, u.taken, args)
    span("apply", u.task, 1, u.taken, u.applied, args)
    span("release tokens", u.task, 1, u.applied, u.released, args)
  return {"traceEvents": events, "displayTimeUnit": "ms",
          "otherData": {"clock_offsets_secs": dict(offsets),
                        "zero_unix_secs": zero}}


#: One colour per phase, the two waits apart: a worker's wait for its token
#: and the chief's wait for gradients are different questions.
_COLORS = {"between runs": "#f3e3a0", "compute": "#4c72b0",
           "push": "#dd8452", "stale": "#c44e52",
           "wait for token": "#c7c7c7", "wait for gradients": "#8fbcd4",
           "apply": "#55a868", "release tokens": "#8172b3"}


def render(path: str, updates: "typing.Sequence[Update]",
           steps: "typing.Sequence[Step]", *, last: int = 20,
           title: str = "") -> None:
  """A PNG of the last ``last`` updates: one row per task (matplotlib)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  from matplotlib import patches  # pylint: disable=g-import-not-at-top
  shown = updates[-last:]
  if shown:
    lo, hi = shown[0].began, shown[-1].released
    steps = [s for s in steps if s.token >= lo and s.began <= hi]
  else:
    lo = min([s.began for s in steps] or [0])
    hi = max([s.token for s in steps] or [1])
  tasks = sorted({s.task for s in steps})
  rows = tasks + (["chief sync loop"] if shown else [])
  fig, ax = pyplot.subplots(figsize=(12, 1.0 + 0.6 * len(rows)))
  for y, task in enumerate(tasks):
    previous = None
    for s in (s for s in steps if s.task == task):
      if previous is not None:
        ax.broken_barh([(previous - lo, s.began - previous)],
                       (y - 0.35, 0.7), color=_COLORS["between runs"])
      previous = s.token
      for start, end, kind in ((s.began, s.grads, "compute"),
                               (s.grads, s.pushed,
                                "stale" if s.stale else "push"),
                               (s.pushed, s.token, "wait for token")):
        ax.broken_barh([(start - lo, end - start)], (y - 0.35, 0.7),
                       color=_COLORS[kind])
  y = len(tasks)
  for u in shown:
    for start, end, kind in ((u.began, u.taken, "wait for gradients"),
                             (u.taken, u.applied, "apply"),
                             (u.applied, u.released, "release tokens")):
      ax.broken_barh([(start - lo, end - start)], (y - 0.35, 0.7),
                     color=_COLORS[kind])
  _label_steps(ax, shown, y, lo, hi)
  ax.set_yticks(range(len(rows)))
  ax.set_yticklabels(rows)
  ax.set_ylim(len(rows) - 0.25, -0.6)  # Inverted: the first task on top.
  ax.set_xlabel("seconds (chief's clock)")
  ax.set_title(title, fontsize=10)
  ax.legend(handles=[patches.Patch(color=c, label=k)
                     for k, c in _COLORS.items()],
            loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=8,
            fontsize=8, frameon=False)
  fig.tight_layout()
  # Cropped to what is drawn: the legend below the axes left a blank band
  # under it otherwise.
  fig.savefig(path, dpi=100, bbox_inches="tight", pad_inches=0.1)
  pyplot.close(fig)


def _label_steps(ax, shown, y, lo, hi):
  """Each update's step beside its bar on row ``y``, from the last back.

  Two tiers, above and below the row: a label that would touch its
  neighbour above goes below, so that none goes missing unless both are
  taken (a picture once lacked one update's step; labels at each end ran
  together, "29993000", before any was skipped).
  """
  gap, placed = (hi - lo) / 30, [None, None]
  for u in reversed(shown):
    at = (u.began + u.released) / 2 - lo
    for tier, (dy, va) in enumerate(((-0.4, "bottom"), (0.4, "top"))):
      if placed[tier] is None or placed[tier] - at >= gap:
        ax.text(at, y + dy, str(u.step), fontsize=7, ha="center", va=va)
        placed[tier] = at
        break


def headline(rows: "dict[str, dict[str, float]]", shown: int,
             updates: int) -> str:
  """The picture's title: what it shows, then ``verdict``'s lines."""
  return "\n".join(["last %d of %d updates" % (shown, updates)]
                   + verdict(rows, updates))


def verdict(rows: "dict[str, dict[str, float]]", updates: int) -> "list[str]":
  """Whose push the updates waited for last, and whose pushes were mostly
  dropped as stale: the picture's title and the command's last lines.

  The name alone misled: with a backup, a healthy run's updates wait last
  for whichever fast replica pushed second, often the chief, while the slow
  replica's pushes arrive stale and are dropped. So the title gives each
  replica's share of the updates it completed, and names a straggler only
  when one completed over two thirds and no replica's pushes were mostly
  stale.

  Args:
    rows: ``summary``'s rows.
    updates: Updates in the run (the rows count over all of them).

  Returns:
    Up to two lines: the shares (none without updates), the stale pushes.
  """
  lines = []
  slow = straggler(rows)
  stale = [(task, row) for task, row in sorted(rows.items())
           if row["steps"] and 2 * row["stale_pushes"] > row["steps"]]
  if slow is not None:
    # Whoever pushes last of the gradients an update needs completes it.
    # In a healthy run that is any of the fast replicas, often the chief
    # (it also evaluates and logs): a share, not a verdict. A straggler is
    # named only when it completes most updates by far and no replica's
    # pushes were mostly dropped (with backups nobody waits for the slow).
    shares = sorted(((row["waited_for_last"], task)
                     for task, row in rows.items() if row["waited_for_last"]),
                    reverse=True)
    lines.append("each update's last needed push came from " + ", ".join(
        "%s in %d" % (task, count) for count, task in shares)
                 + " of %d" % updates)
    if 3 * shares[0][0] > 2 * updates and not stale:
      lines[-1] += ": %s is the straggler the others wait for" % slow
  if stale:
    lines.append("too late and dropped, which backups allow: most pushes of "
                 + ", ".join("%s (%d of %d)" % (task, row["stale_pushes"],
                                                row["steps"])
                             for task, row in stale))
  return lines


def merge(
    directory: str, *, out: "str | None" = None, png: "str | None" = None,
    last: int = 20, all_runs: bool = False
) -> "tuple[dict[str, dict[str, float]], int]":
  """Reads ``directory``, writes the trace (and PNG).

  Only the latest run (``last_start``) unless ``all_runs``.

  Returns:
    ``(summary rows, records left out as earlier runs')``.
  """
  updates, steps, _ = read(directory)
  since = None if all_runs else last_start(directory)
  left_out = 0
  if since is not None:
    kept_updates = [u for u in updates if u.began >= since]
    kept_steps = [s for s in steps if s.began >= since]
    left_out = (len(updates) - len(kept_updates)
                + len(steps) - len(kept_steps))
    updates, steps = kept_updates, kept_steps
  updates, steps, offsets = aligned(updates, steps)
  waited = waited_for(updates, steps)
  rows = summary(steps, waited)
  if out:
    with open(out, "w", encoding="utf-8") as f:
      json.dump(chrome_trace(updates, steps, offsets, waited), f)
  if png:
    render(png, updates, steps, last=last,
           title=headline(rows, min(last, len(updates)), len(updates)))
  return rows, left_out


PROG = "sync-replicas-timeline"


def main(argv: "typing.Sequence[str] | None" = None) -> int:
  """The console script ``sync-replicas-timeline``; returns the exit code."""
  # Ctrl-C ends it at once: it only reads the records and writes its files.
  return _cli.run(_main, argv, prog=PROG, exit_at_once=True)


def _main(argv):
  parser = _cli.parser(PROG, __doc__)
  parser.add_argument("directory", help="the timeline_dir the tasks wrote")
  parser.add_argument("--out", help="trace file to write (default: "
                      "DIRECTORY/trace.json)")
  parser.add_argument("--png", help="also draw the last updates here")
  parser.add_argument("--last", type=int, default=20,
                      help="updates in the PNG")
  parser.add_argument("--all", action="store_true",
                      help="merge every run that wrote to DIRECTORY, not "
                      "only the latest (the chief's last start)")
  args = parser.parse_args(argv)
  if args.last < 1:
    parser.error("--last must be at least 1, got %d" % args.last)
  if not os.path.isdir(args.directory):  # A bad argument, as status's.
    _cli.say(PROG, "no such directory: %s. Pass the timeline_dir the job's "
             "tasks wrote to (the examples: their --timeline_dir)."
             % args.directory)
    return _cli.EXIT_USAGE
  out = args.out or os.path.join(args.directory, "trace.json")
  try:
    rows, left_out = merge(args.directory, out=out, png=args.png,
                           last=args.last, all_runs=args.all)
  except (OSError, ValueError) as e:
    sys.stderr.write("%s: %s\n" % (PROG, e))
    return _cli.EXIT_FAILED
  if left_out:
    sys.stdout.write("the latest run only: %d records of earlier runs in %s "
                     "left out (--all merges them)\n"
                     % (left_out, args.directory))
  sys.stdout.write("trace: %s\n" % out)
  if args.png:
    sys.stdout.write("picture: %s\n" % args.png)
  for task, row in rows.items():
    sys.stdout.write("%s: %s\n" % (task, ", ".join(
        "%s=%s" % kv for kv in row.items())))
  # The picture's words, not the bare name of whoever completed the most
  # updates: in a healthy run that is often the chief, and no fault. The
  # updates counted are those whose last push was found (every one, when
  # each task recorded its steps).
  waited = sum(int(row["waited_for_last"]) for row in rows.values())
  sys.stdout.write("\n".join(verdict(rows, waited)
                             or ["no update waited for a push"]) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
