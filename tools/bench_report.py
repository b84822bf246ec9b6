"""The report of tools/bench: what a run measured, and what the runs say.

Owns the benchmark's method once it has the workers' records: the measured
window of one run and its metrics (``metrics``), the medians over
repetitions and the median of per-repetition ratios (``summarize``), the
sign-test interval of that median and its verdict (``median_interval``,
``verdict``), their presentation (``table``, ``plot``), and reading saved
runs back for that presentation (``read_runs``: tools/bench --render). No
process, no TensorFlow: tests import it directly, and so can any tool that
wants the same statistics (tools/stats_overhead.py does). Import it with
tools/ on ``sys.path``::

  sys.path.insert(0, "tools")
  import bench_report

Why ratios and intervals: every implementation of a (scenario, W) cell runs
interleaved with the others, so machine noise hits them alike, and the
ratio within one repetition cancels most of it; yet per-repetition ratios
of two identical graphs still spread by +-20% on a shared 2-core machine,
so a median ratio is only called slower or faster when the whole interval
of that median is on one side of 1.0.
"""

import math
import os
import re
import statistics

import _runs_file
from _bench_protocol import ALL_IMPLS
from _bench_protocol import IMPLS
from _bench_protocol import PEERS
from _bench_protocol import SCENARIOS

#: A scenario whose model reads its variables with read_packed, and the one
#: with the same model reading them plainly: the summary also compares ours
#: on the first with stock on the second (what a user who adopts both gets).
PACKED_READS = {"many_packed_reads": "many"}
#: Seconds after the last worker's first step (which registers its graph)
#: before the window opens.
WARMUP = 0.2


class EmptyWindowError(ValueError):
  """A run's records hold no measured step: there is nothing to report."""


def metrics(records):
  """Throughput and latency over the measured window (after warm-up).

  Args:
    records: Every worker's record of one run (the chief's first), as
      tools/_bench_task.py answers with ``done``; the chief's also holds the
      driver's ``spawned_wall`` and ``run_secs``.

  Returns:
    A dict of the run's metrics (the keys of runs.jsonl's ``metrics``).

  Raises:
    EmptyWindowError: The chief took fewer than 2 steps, so no step falls
      in a window (e.g. ``--secs`` too short for a slow step).
  """
  chief = records[0]
  steps_at = chief["steps_at"]
  if len(steps_at) < 2:
    # A window needs a first and a last chief step; with fewer, the
    # percentiles below would index an empty list.
    raise EmptyWindowError(
        "no measured window: the chief took %d step(s), 2 or more needed; "
        "lengthen --secs" % len(steps_at))
  # The window opens WARMUP seconds after every worker finished its first
  # step (the one that registers its graph): before, the chief may be
  # stepping with fewer workers than W. It closes at the chief's last step.
  joined = max(r["steps_at"][0][0] for r in records if r["steps_at"])
  index = 0
  while (index < len(steps_at) - 2
         and steps_at[index][0] < joined + WARMUP):
    index += 1
  first = steps_at[index]
  last = steps_at[-1]
  window = max(last[0] - first[0], 1e-9)
  runs = sum(1 for r in records for t, _ in r["steps_at"]
             if first[0] < t <= last[0])
  lat = sorted(l for r in records
               for (t, _), l in zip(r["steps_at"], r["latencies"],
                                    strict=True)
               if first[0] < t <= last[0])
  pick = lambda q: lat[min(int(q * len(lat)), len(lat) - 1)] * 1000
  cpu_at = chief.get("cpu_at") or []
  updates = last[1] - first[1]
  chief_cpu_ms = (
      (cpu_at[-1] - cpu_at[index]) * 1000 / updates
      if len(cpu_at) == len(steps_at) and updates > 0 else None)
  job_cpu = chief.get("job_cpu_secs")
  span = steps_at[-1][1] - steps_at[0][1]
  return {
      # The job's updates per CPU-second of all its processes (ps, workers,
      # the chief's loop; a peer's workers), from the chief's first step to
      # its last: what the job costs on cores it shares.
      "updates_per_cpu_s": span / job_cpu if job_cpu and span > 0 else None,
      # The same CPU per update, per process (ps0, worker0 the chief, ...).
      "task_cpu_ms_per_update": (
          {task: secs * 1000 / span
           for task, secs in chief["task_cpu_secs"].items()}
          if chief.get("task_cpu_secs") and span > 0 else None),
      "window_s": window, "window_chief_steps": len(steps_at) - 1 - index,
      # The window's ends (time.monotonic(), one clock for every process of
      # the machine) and its updates: what tools/linkcost reads its link
      # counters over.
      "window_at": [first[0], last[0]], "window_updates": updates,
      "global_steps_per_s": (last[1] - first[1]) / window,
      "grads_per_s": runs / window,
      "step_ms_p50": pick(0.5), "step_ms_p95": pick(0.95),
      "first_step_s": chief["first_step_wall"] - chief["spawned_wall"],
      "chief_close_s": chief["close_secs"],
      "peak_rss_mb": max(r["peak_rss_mb"] for r in records),
      "ps_peak_rss_mb": chief.get("ps_peak_rss_mb"),
      # The chief process's CPU (its steps, its sync loop, the ops its
      # server runs) over the window, per update.
      "chief_cpu_ms_per_update": chief_cpu_ms,
      # Where the chief's wall time went (s): graph, cluster reset, session
      # creation, waiting for the others, steps, close; and the whole run as
      # the driver saw it.
      "chief_phases_s": {k: chief.get(k + "_secs") for k in (
          "build", "wait", "session", "start", "train", "close", "run")},
      "first_global_step": chief.get("first_global_step"),
      "read_ms_p50": chief.get("read_ms_p50"),
      "other_cores": chief.get("other_cores"),
  }


#: The coverage the report's interval for a median ratio aims at.
INTERVAL_CONFIDENCE = 0.9


def median_interval(values, confidence=INTERVAL_CONFIDENCE):
  """A distribution-free interval for the median of ``values``.

  The sign-test interval: the k-th smallest and the k-th largest of n values
  bracket the true median with probability 1 - 2 P(B < k), B ~ Binomial(n,
  1/2), whatever the distribution, so it assumes nothing about this
  machine's noise. Takes the narrowest one whose coverage reaches
  ``confidence``, or [min, max] when none does (n < 5 at 0.9).

  Returns (low, high, coverage), or None for fewer than 2 values.
  """
  n = len(values)
  if n < 2:
    return None
  xs = sorted(values)
  coverage = lambda k: 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
  k = 1
  while 2 * (k + 1) <= n and coverage(k + 1) >= confidence:
    k += 1
  return xs[k - 1], xs[n - k], coverage(k)


def verdict(interval):
  """How ours compares with stock, given the interval of their ratio."""
  if interval is None:
    return None
  low, high, _ = interval
  if low > 1:
    return "faster"
  if high < 1:
    return "slower"
  return "equal within noise"


def _judged(ratios):
  """``(median, [low, high], coverage, verdict)`` of per-rep ``ratios``.

  Nones for no ratios; interval, coverage and verdict None for one.
  """
  interval = median_interval(ratios)
  return (statistics.median(ratios) if ratios else None,
          list(interval[:2]) if interval else None,
          interval[2] if interval else None, verdict(interval))


def _fmt(value, form="%.2f"):
  """``value`` in ``form``, or "-" for None (a cell with nothing to show)."""
  return (form % value) if value is not None else "-"


def _vs_peer(reps, impls):
  """Each of ``impls``' updates/s over the better MultiWorkerMirroredStrategy
  communication's, per repetition: ``{impl: {"steps", "interval",
  "coverage", "verdict", "reps"}}`` (``verdict``: faster/slower than MWMS
  only when the whole interval is on one side of 1.0)."""
  out = {}
  for impl in impls:
    ratios = []
    for m in reps.values():
      peers = [m[p]["global_steps_per_s"] for p in PEERS if p in m]
      if impl in m and peers and max(peers) > 0:
        ratios.append(m[impl]["global_steps_per_s"] / max(peers))
    if ratios:
      out[impl] = dict(zip(("steps", "interval", "coverage", "verdict"),
                           _judged(ratios), strict=True), reps=len(ratios))
  return out


def summarize(rows):
  """Median ratios per (scenario, W) over repetitions.

  Args:
    rows: The runs, as runs.jsonl holds them: ``scenario``, ``workers``,
      ``impl``, ``rep`` and the run's ``metrics``.

  Returns:
    One dict per (scenario, W), in SCENARIOS order then by W: medians of
    every metric per implementation (``<impl>_<metric>``), medians of
    per-repetition ratios (``ours_vs_stock_grads`` and friends), the
    interval of ours/stock, its coverage and verdict; and for every variant
    (an ``impl`` not in ALL_IMPLS: ours with other options, tools/bench's
    --variant) ``variants[name]``, its ratios to ours the same way; with
    the peers run, ``vs_peer[impl]``: updates/s over the better
    MultiWorkerMirroredStrategy communication's, the same way.
  """
  out = []
  variants = sorted({r["impl"] for r in rows} - set(ALL_IMPLS))
  keys = sorted({(r["scenario"], r["workers"]) for r in rows},
                key=lambda k: (SCENARIOS.index(k[0]), k[1]))
  for scenario, workers in keys:
    reps = {}
    for r in rows:
      if (r["scenario"], r["workers"]) == (scenario, workers):
        reps.setdefault(r["rep"], {})[r["impl"]] = r["metrics"]
    entry = {"scenario": scenario, "workers": workers}
    for metric in ("global_steps_per_s", "grads_per_s", "step_ms_p50",
                   "step_ms_p95", "chief_close_s", "first_step_s",
                   "peak_rss_mb", "ps_peak_rss_mb", "read_ms_p50",
                   "chief_cpu_ms_per_update", "updates_per_cpu_s"):
      for impl in ALL_IMPLS + variants:
        vals = [m[impl][metric] for m in reps.values()
                if impl in m and m[impl].get(metric) is not None]
        if vals:
          entry["%s_%s" % (impl, metric)] = statistics.median(vals)

    for impl in ALL_IMPLS + variants:
      by_task = [m[impl]["task_cpu_ms_per_update"] for m in reps.values()
                 if impl in m and m[impl].get("task_cpu_ms_per_update")]
      if by_task:
        entry["%s_task_cpu_ms_per_update" % impl] = {
            task: statistics.median(t[task] for t in by_task if task in t)
            for task in sorted({k for t in by_task for k in t})}

    def ratios(a, b, metric, reps=reps):
      return [m[a][metric] / m[b][metric] for m in reps.values()
              if a in m and b in m and m[b][metric] > 0]

    def ratio(a, b, metric):
      vals = ratios(a, b, metric)
      return statistics.median(vals) if vals else None
    reads = [m[impl]["read_ms_p50"] for m in reps.values() for impl in m
             if m[impl].get("read_ms_p50") is not None]
    entry["read_ms_p50"] = statistics.median(reads) if reads else None
    other = [m[impl]["other_cores"] for m in reps.values() for impl in m
             if m[impl].get("other_cores") is not None]
    entry["other_cores"] = statistics.median(other) if other else None
    entry["other_cores_max"] = max(other) if other else None
    entry["ours_vs_stock_steps"] = ratio("ours", "stock", "global_steps_per_s")
    # Where the median ratio lies, and so whether a cell under 1.0 is a
    # regression or this machine's noise (per-rep ratios of identical graphs
    # spread +-20% here).
    (entry["ours_vs_stock_grads"], entry["ours_vs_stock_grads_interval"],
     entry["ours_vs_stock_grads_coverage"],
     entry["ours_vs_stock_verdict"]) = _judged(
         ratios("ours", "stock", "grads_per_s"))
    entry["ours_sync_vs_async_grads"] = ratio("ours", "async", "grads_per_s")
    entry["stock_sync_vs_async_grads"] = ratio("stock", "async",
                                               "grads_per_s")
    entry["variants"] = {}
    for name in variants:
      vs_ours = ratios(name, "ours", "grads_per_s")
      if not vs_ours:
        continue
      variant = dict(zip(("vs_ours_grads", "vs_ours_grads_interval",
                          "vs_ours_grads_coverage", "vs_ours_verdict"),
                         _judged(vs_ours), strict=True))
      variant["vs_ours_steps"] = ratio(name, "ours", "global_steps_per_s")
      variant["vs_stock_grads"] = ratio(name, "stock", "grads_per_s")
      variant["reps"] = len(vs_ours)
      entry["variants"][name] = variant
    entry["vs_peer"] = _vs_peer(reps, IMPLS + variants)
    plain = PACKED_READS.get(scenario)
    if plain is not None:
      # Same rep, same W: the two scenarios' runs are minutes apart at most.
      vals = [r["metrics"]["grads_per_s"] / p["metrics"]["grads_per_s"]
              for r in rows for p in rows
              if (r["scenario"], r["workers"], r["impl"]) == (
                  scenario, workers, "ours")
              and (p["scenario"], p["workers"], p["impl"]) == (
                  plain, workers, "stock")
              and p["rep"] == r["rep"] and p["metrics"]["grads_per_s"] > 0]
      if vals:
        entry["ours_vs_stock_plain_reads_grads"] = statistics.median(vals)
    out.append(entry)
  return out


def peers_table(summary):
  """Updates/s of every implementation and each one's ratio to the better
  MultiWorkerMirroredStrategy (a Markdown table), or no lines without peers.
  """
  cells = [e for e in summary if e.get("vs_peer")]
  if not cells:
    return []
  impls = [i for i in ALL_IMPLS + sorted(
      {v for e in cells for v in e["vs_peer"] if v not in ALL_IMPLS})
           if any(e.get("%s_global_steps_per_s" % i) is not None
                  for e in cells)]
  mine = [i for i in impls if i not in PEERS]
  lines = ["", "updates/s (global steps/s, medians), and each / the better "
           "MultiWorkerMirroredStrategy per repetition [interval]:", "",
           "| model | W | " + " | ".join(impls) + " | " + " | ".join(
               "%s / MWMS" % i for i in mine) + " |",
           "|---|---|" + "---|" * (len(impls) + len(mine))]
  for e in cells:
    ratios = []
    for i in mine:
      r = e["vs_peer"].get(i)
      ratios.append("%s [%s]" % (_fmt(r["steps"]), "%.2f-%.2f" % tuple(
          r["interval"]) if r["interval"] else "-") if r else "-")
    lines.append("| %s | %d | %s | %s |" % (
        e["scenario"], e["workers"], " | ".join(
            _fmt(e.get("%s_global_steps_per_s" % i), "%.1f") for i in impls),
        " | ".join(ratios)))
  lines += ["", "updates per CPU-second of the whole job (every process of "
            "it; medians):", "", "| model | W | " + " | ".join(impls) + " |",
            "|---|---|" + "---|" * len(impls)]
  for e in cells:
    lines.append("| %s | %d | %s |" % (e["scenario"], e["workers"], " | ".join(
        _fmt(e.get("%s_updates_per_cpu_s" % i), "%.1f") for i in impls)))
  split = [(e, i, e["%s_task_cpu_ms_per_update" % i]) for e in cells
           for i in impls if e.get("%s_task_cpu_ms_per_update" % i)]
  if not split:
    return lines
  # One column per process of any cell (a peer has no ps; W = 4 has two
  # workers more than W = 2), and their sum: the whole job's CPU per update
  # split, so a lever's "before and after" reads along a column.
  tasks = sorted({t for _, _, by_task in split for t in by_task},
                 key=_task_order)
  lines += ["", "CPU ms per update, by process (worker0 is the chief; "
            "medians), and their sum:", "",
            "| model | W | impl | " + " | ".join(tasks) + " | sum |",
            "|---|---|---|" + "---|" * (len(tasks) + 1)]
  for e, i, by_task in split:
    lines.append("| %s | %d | %s | %s | %.2f |" % (
        e["scenario"], e["workers"], i,
        " | ".join(_fmt(by_task.get(t)) for t in tasks),
        sum(by_task.values())))
  return lines


def _task_order(task):
  """``ps0`` before ``worker0``, ``worker2`` before ``worker10``."""
  job, index = re.fullmatch(r"(\D+)(\d+)", task).groups()
  return job != "ps", job, int(index)


def table(summary):
  """The summary as text: one line per cell, then the verdicts and noise."""
  head = ("%-17s %2s %10s %10s %10s %8s %11s %8s %8s %14s %12s %8s" % (
      "scenario", "W", "stock g/s", "ours g/s", "async g/s", "ours/stk",
      "interval", "o/s stps", "ours/asy", "p50 stk/ours", "close stk/o",
      "reads ms"))
  lines = [head, "-" * len(head)]
  for e in summary:
    interval = e.get("ours_vs_stock_grads_interval")
    lines.append("%-17s %2d %10s %10s %10s %8s %11s %8s %8s %14s %12s %8s" % (
        e["scenario"], e["workers"],
        _fmt(e.get("stock_grads_per_s"), "%.1f"),
        _fmt(e.get("ours_grads_per_s"), "%.1f"),
        _fmt(e.get("async_grads_per_s"), "%.1f"),
        _fmt(e["ours_vs_stock_grads"]),
        "%.2f-%.2f" % tuple(interval) if interval else "-",
        _fmt(e["ours_vs_stock_steps"]),
        _fmt(e["ours_sync_vs_async_grads"]),
        "%s/%s" % (_fmt(e.get("stock_step_ms_p50"), "%.1f"),
                   _fmt(e.get("ours_step_ms_p50"), "%.1f")),
        "%s/%s" % (_fmt(e.get("stock_chief_close_s"), "%.1f"),
                   _fmt(e.get("ours_chief_close_s"), "%.2f")),
        _fmt(e.get("read_ms_p50"), "%.1f")))
  for e in summary:
    if e.get("ours_vs_stock_plain_reads_grads") is not None:
      lines.append(
          "ours on %s / stock on %s, W=%d: %.2f (gradients/s)" % (
              e["scenario"], PACKED_READS[e["scenario"]], e["workers"],
              e["ours_vs_stock_plain_reads_grads"]))
  lines += _variant_lines(summary)
  lines += peers_table(summary)
  judged = [e for e in summary if e.get("ours_vs_stock_verdict")]
  if judged:
    coverages = sorted({round(e["ours_vs_stock_grads_coverage"] * 100)
                        for e in judged})
    lines.append(
        "interval: where the median of ours/stock lies (sign test, %s%% "
        "coverage), whatever the noise's distribution" %
        "/".join(str(c) for c in coverages))
    for name, label in (("slower", "ours slower than stock"),
                        ("faster", "ours faster than stock"),
                        ("equal within noise", "equal within noise")):
      cells = ["%s W=%d" % (e["scenario"], e["workers"]) for e in judged
               if e["ours_vs_stock_verdict"] == name]
      lines.append("%s: %s" % (label, ", ".join(cells) or "none"))
  other = [e["other_cores"] for e in summary
           if e.get("other_cores") is not None]
  if other:
    lines.append(
        "(other processes used %.2f cores of %d during a run's steps, median "
        "over (scenario, W); up to %.2f in one run)" % (
            statistics.median(other), os.cpu_count(),
            max(e["other_cores_max"] for e in summary
                if e.get("other_cores_max") is not None)))
  return "\n".join(lines)


def _variant_lines(summary):
  """The variants against ours, a line per (variant, scenario, W)."""
  rows = [(name, e, v) for e in summary
          for name, v in sorted(e.get("variants", {}).items())]
  if not rows:
    return []
  head = "%-12s %-17s %2s %10s %11s %5s %9s %10s %-18s" % (
      "variant", "scenario", "W", "var/ours", "interval", "cover",
      "v/o steps", "var/stock", "verdict vs ours")
  lines = ["", head, "-" * len(head)]
  for name, e, v in rows:
    interval = v["vs_ours_grads_interval"]
    lines.append("%-12s %-17s %2d %10s %11s %5s %9s %10s %-18s" % (
        name, e["scenario"], e["workers"], _fmt(v["vs_ours_grads"]),
        "%.2f-%.2f" % tuple(interval) if interval else "-",
        ("%d%%" % round(v["vs_ours_grads_coverage"] * 100)
         if v["vs_ours_grads_coverage"] else "-"),
        _fmt(v["vs_ours_steps"]), _fmt(v["vs_stock_grads"]),
        v["vs_ours_verdict"] or "(one repetition)"))
  return lines + [""]


def plot(summary, path):
  """Plots the median ratios (ours/stock with intervals, sync/async).

  Args:
    summary: ``summarize``'s entries.
    path: The PNG to write.

  Returns:
    False when matplotlib is not installed (nothing written), else True.
  """
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  # One word a line: long scenario names would overlap their neighbours.
  labels = ["%s\nW=%d" % (e["scenario"].replace("_", "\n"), e["workers"])
            for e in summary]
  xs = range(len(summary))
  fig, ax = plt.subplots(figsize=(max(6, len(summary) * 0.7), 4))
  width = 0.4
  medians = [e["ours_vs_stock_grads"] or 0 for e in summary]
  # The interval of each median (none for a single repetition).
  spans = [e.get("ours_vs_stock_grads_interval") or (m, m)
           for e, m in zip(summary, medians, strict=True)]
  ax.bar([x - width / 2 for x in xs], medians, width,
         yerr=[[max(m - lo, 0)
                for m, (lo, _) in zip(medians, spans, strict=True)],
               [max(hi - m, 0)
                for m, (_, hi) in zip(medians, spans, strict=True)]],
         capsize=2, label="ours / stock (gradients/s), with interval")
  ax.bar([x + width / 2 for x in xs],
         [e["ours_sync_vs_async_grads"] or 0 for e in summary], width,
         label="ours sync / async (gradients/s)")
  ax.axhline(1.0, color="k", linewidth=0.8)
  ax.set_xticks(list(xs))
  ax.set_xticklabels(labels, fontsize=7)
  ax.set_ylabel("median ratio")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True



#: What the report reads of every line of runs.jsonl.
RUN_KEYS = ("scenario", "workers", "impl", "rep", "metrics")

RunsFileError = _runs_file.RunsFileError


def read_runs(paths):
  """The runs of one or more saved runs.jsonl files, as one list of rows.

  Several files make one report (a W = 2 run and a later W = 4 run) when
  every (scenario, W) cell comes from one file, because a cell's ratios pair
  its implementations' runs of one repetition, which only one bench ran
  interleaved; and when an implementation's name stands for one build
  (options, ps config) in all of them, because it is one column
  (``_runs_file.read``).

  Args:
    paths: runs.jsonl files, as tools/bench writes them into its --out.

  Returns:
    Their rows, file by file, as ``summarize`` takes them.

  Raises:
    RunsFileError: A file is missing or is not a runs.jsonl of tools/bench,
      or files disagree: a cell in two of them, one name built two ways.
  """
  rows = []
  cells = {}  # (scenario, W): the file that holds it.
  for path, own in _runs_file.read(paths, BENCH_RUNS):
    lines = {}  # (scenario, W, impl, rep): its line number.
    for number, row in own:
      cell = (row["scenario"], row["workers"])
      if cells.get(cell, path) != path:
        raise RunsFileError(
            "%s and %s both hold runs of %s at W = %d: a cell's ratios pair "
            "its implementations' runs of one repetition, interleaved by "
            "one bench, and would pair runs of two; render the files apart, "
            "or remove the cell's lines from one of them" % (
                cells[cell], path, *cell))
      cells[cell] = path
      key = (*cell, row["impl"], row["rep"])
      if key in lines:
        raise RunsFileError(
            "%s line %d and line %d are both the run of %s at W = %d, %s, "
            "repetition %d, which a bench makes once: if the file joins two "
            "benches' runs.jsonl, give them to --render as two files" % (
                path, number, lines[key], *key))
      lines[key] = number
      rows.append(row)
  return rows


def _build_fields(row):
  """``(impl, field)`` of each field of ``row`` that says how its
  implementation was built: its ps config, and for ours and a variant its
  options (stock, async and a peer take none; rows of a bench older than a
  field lack it)."""
  fields = ["ps_config"]
  if row["impl"] == "ours" or row["impl"] not in ALL_IMPLS:
    fields.append("options")
  return [(row["impl"], f) for f in fields if f in row]


def _check_run(row, where):
  """RunsFileError unless ``row`` (an object) is a run as tools/bench
  writes it."""
  what = ("a runs.jsonl line is one run of tools/bench: an object with %s"
          % ", ".join(RUN_KEYS))
  if "link_rate" in row:
    raise RunsFileError(
        "%s is a run of tools/linkcost (it has a link_rate), whose table "
        "is another: render it with tools/linkcost --render" % where)
  missing = [k for k in RUN_KEYS if k not in row]
  if missing:
    if "records" in row:
      hint = ("this looks like tasks/records.jsonl (the workers' raw "
              "records): give the runs.jsonl of the folder above it")
    elif "vs_peer" in row or "variants" in row:
      hint = ("this looks like summary.jsonl (a report's medians, not its "
              "runs): give the runs.jsonl beside it")
    else:
      hint = "give the runs.jsonl of a bench's --out folder"
    raise RunsFileError("%s has no %s: %s; %s" % (
        where, ", ".join(missing), what, hint))
  metrics = row["metrics"]
  _runs_file.check_fields(row, where, (
      (row["scenario"] in SCENARIOS, "scenario",
       "one of this bench's scenarios (%s)" % ", ".join(SCENARIOS)),
      (_runs_file.is_count(row["workers"], 1), "workers", "an int, 1 or more"),
      (isinstance(row["impl"], str), "impl", "a name"),
      (_runs_file.is_count(row["rep"], 0), "rep", "an int, 0 or more"),
      (isinstance(metrics, dict)
       and all(_runs_file.is_number(metrics.get(k))
               for k in ("global_steps_per_s", "grads_per_s")), "metrics",
       "an object with the numbers global_steps_per_s and grads_per_s")),
      tool="tools/bench")


#: tools/bench's runs.jsonl, for ``_runs_file.read``.
BENCH_RUNS = _runs_file.Kind(
    tool="tools/bench", example="runs/bench/runs.jsonl", check=_check_run,
    builds=_build_fields)
