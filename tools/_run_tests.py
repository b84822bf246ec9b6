"""Runs tests/test_*.py as parallel pytest processes; tools/test calls it.

Owns the whole-suite schedule: which files share a process, which run when,
the per-process output, the summary (slowest processes and tests, CPU and
threads per process) and the exit code.

Why processes, and which: TensorFlow cannot stop an in-process
tf.distribute.Server, and each keeps about 85 threads until its process
ends (the whole suite in one process once aborted in pthread_create at two
thirds; pid_max is 32768 here). A file that takes long runs in a process of
its own; the short ones share a few processes (packed so that their threads,
added up, stay under PROCESS_THREADS), which saves a TensorFlow import
(~5 s of CPU) per file. The processes run in parallel, the longest first,
because much of the suite waits on RPCs, deadlines and child processes; the
two cores are what bounds it, so fewer imports matter as much as overlap.

scikit-learn is hidden from every process: TESTS/_hidden, first on
PYTHONPATH (children inherit it), holds a stub ``sklearn`` that fails to
import, so that ``import tensorflow`` skips Keras 3's scikit-learn wrapper
(TensorFlow 2.21; 2.15's Keras 2 has none), which imports scikit-learn and
more of SciPy: measured, about 1.2 of the import's ~6 CPU-seconds, in each
TensorFlow process. No test needs it: the digits are read from
scikit-learn's file directly (examples/_digits.py).

Keras is hidden from every process whose files are not marked ``keras``
(``pytestmark = pytest.mark.keras``: the files that use it in pytest's own
process): TESTS/_hidden_from_tasks, which tests/conftest.py puts first on the
PYTHONPATH of the processes a test starts, comes first on that pytest
process's PYTHONPATH too, so its ``import tensorflow`` skips Keras: a
pytest process's start (``pytest --co`` of a small file, 2.21) took 3.6-3.7
CPU-seconds instead of 4.4-4.9 (on 2.15 the import saves about 0.35). pack()
keeps the marked files together, since Keras costs its import once per
process whatever the files. KEEP_KERAS_ENV=1 gives every process Keras, as before.

Each file's time and threads come from the last green run on this machine
(MEASURED, which every green full run rewrites for the files it ran; see
record_measured), else from EXPECTED, a green run's record committed in
tools/test_durations.json (``--save-expected`` writes it), which a clean
clone (CI) starts from. A new file needs nothing: the glob finds it and, until a
green run has measured it, it runs alone and starts first (as if it were the
slowest). Before starting a process the scheduler also checks the threads
the running ones hold (THREAD_BUDGET), so no pairing of files can push the
machine past its thread limit.
"""

import argparse
import datetime
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

import _by_path
import _proc

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
#: First on every pytest process's PYTHONPATH: its stub ``sklearn`` keeps
#: Keras from importing scikit-learn at ``import tensorflow``.
HIDDEN = TESTS / "_hidden"


#: Also first on the PYTHONPATH of a pytest process none of whose files is
#: marked ``keras``: its stub ``keras`` keeps ``import tensorflow`` from
#: importing Keras (tests/support.py's TASKS_HIDDEN, which tests/conftest.py
#: gives every process a test starts).
KERAS_HIDDEN = TESTS / "_hidden_from_tasks"
#: Set to 1, every pytest process keeps Keras, marked files or not: for a
#: file that uses Keras in-process but is not marked ``keras`` (yet).
KEEP_KERAS_ENV = "SYNC_REPLICAS_TEST_KEEP_KERAS"


def hiding_env(environ, *, keras=True):
  """A copy of ``environ`` with HIDDEN first on PYTHONPATH, and before it
  KERAS_HIDDEN unless ``keras``."""
  first = [str(HIDDEN)] if keras else [str(KERAS_HIDDEN), str(HIDDEN)]
  env = dict(environ)
  env["PYTHONPATH"] = os.pathsep.join(
      first + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
               if p and p not in first])
  return env


#: tests/conftest.py copies a failed test's tmp_path (its process clusters'
#: task logs) under this folder, and names the copy in the failure report:
#: pytest keeps only its last few temporary folders, and a suite makes many.
FAILED_DIR_ENV = "SYNC_REPLICAS_FAILED_TESTS_DIR"
FAILED_TESTS = ROOT / "runs" / "failed-tests"
#: tests/conftest.py writes each file's peak threads to this path (JSON).
THREADS_OUT_ENV = "SYNC_REPLICAS_FILE_THREADS_OUT"
#: tests/conftest.py writes each test's CPU seconds to this path (JSON).
CPU_OUT_ENV = "SYNC_REPLICAS_TEST_CPU_OUT"

# The scheduler needs no TensorFlow: the ports module is loaded by its path.
_PORTS = _by_path.ports()
PORT_RANGE_ENV = _PORTS.PORT_RANGE_ENV
draw_port_range = _PORTS.draw_range

#: Files sharing a process hold, together, at most this many threads: a
#: file's servers stay until the process ends, so a process's threads add up
#: file after file.
PROCESS_THREADS = 4_000
#: A file expected to take longer than this runs in a process of its own:
#: it is the suite's critical path already. Below it, files share: each
#: process costs IMPORT_SECS of CPU, and on 2 cores the suite is CPU-bound
#: (94-98% busy), so a process saved is time saved. At 45 s, 9 files ran
#: alone; at 90, 5 (the files of process clusters and the soak). At 150 the
#: default run's committed record runs none alone (its longest file,
#: test_examples, is 137 s) and packs 13 processes instead of 19, none
#: expected longer than 147 s against 142 (``tools/test --plan`` lists them).
ALONE_SECS = 150
#: Each lane's last process (``pack``) is about this long: short enough that
#: the processes started last end close together.
TAIL_SECS = 45
#: Seconds to import TensorFlow and start pytest: what sharing saves.
IMPORT_SECS = 5

#: Do not start another process while the running ones hold more threads
#: than this (all of them together). pid_max is 32768 and other programs
#: need pids too.
THREAD_BUDGET = 12_000
#: A process still running after this is killed and counted as failed
#: (pytest-timeout bounds each test; this bounds a stuck interpreter).
PROCESS_TIMEOUT_SECS = 1_500
#: A module's ``pytestmark = ...`` statement, its continuation lines too.
_PYTESTMARK = re.compile(r"^pytestmark\s*=.*(?:\n[ \t)\]].*)*", re.M)
#: .ci/run sets it to 1 for its older TensorFlow: the tests marked
#: ``version_independent`` skip (tests/conftest.py), and a file marked so
#: as a whole is not started at all, which saves its process's import.
SKIP_VERSION_INDEPENDENT_ENV = "SYNC_REPLICAS_SKIP_VERSION_INDEPENDENT"
#: ``--all`` sets it to 1 for every process (tests/support.py reads the
#: same name): the tests marked ``scale`` run; without it they skip.
ALL_TIERS_ENV = "SYNC_REPLICAS_ALL_TIERS"
#: The start of a scale test's skip reason (tests/support.py's SCALE_SKIP):
#: the skips counted in the one line that says how to run them.
SCALE_SKIP = "scale tier, not in the default run"
_POLL_SECS = 0.2


def module_marks(path):
  """The names of the marks a test file sets on all its tests, from its
  ``pytestmark`` statement (read, not imported: no TensorFlow here)."""
  found = _PYTESTMARK.search(path.read_text())
  return (set(re.findall(r"\bpytest\.mark\.(\w+)", found.group(0)))
          if found else set())


def is_quick(path):
  """Whether the file marks all its tests ``quick`` (the inner loop's)."""
  return "quick" in module_marks(path)


def is_version_independent(path):
  """Whether the file marks all its tests ``version_independent``."""
  return "version_independent" in module_marks(path)


def needs_keras(path):
  """Whether the file marks all its tests ``keras``: they use Keras in
  pytest's own process, which therefore keeps it."""
  return "keras" in module_marks(path)


def keeps_keras(files):
  """Whether the pytest process of ``files`` imports Keras: one of them
  needs it, or KEEP_KERAS_ENV is 1."""
  return (os.environ.get(KEEP_KERAS_ENV) == "1"
          or any(needs_keras(f) for f in files))


class Job:
  """One pytest process over one file, or over all the quick files."""

  def __init__(self, name, files, pytest_args, tmp, kept=None):
    self.name = name
    # Where a failed test's tmp_path is kept (FAILED_DIR_ENV).
    self.kept = kept
    self.files = files
    self.xml = tmp / (name.replace("/", "_") + ".xml")
    self.threads_out = tmp / (name.replace("/", "_") + ".threads.json")
    self.cpu_out = tmp / (name.replace("/", "_") + ".cpu.json")
    self.log = tmp / (name.replace("/", "_") + ".log")
    # A file that fails to import fails its process (exit 1) but does not
    # keep the files it shares the process with from running: without the
    # flag pytest stops after collecting, with exit 2, as if interrupted.
    self.cmd = [sys.executable, "-m", "pytest", *pytest_args,
                "--continue-on-collection-errors",
                "--junitxml=%s" % self.xml, *[str(f) for f in files]]
    self.proc = None
    # (low, high): the ports its tests draw from, none another job draws.
    self.ports = None
    self.start = self.end = None
    self.peak_threads = 0
    self.cpu_secs = 0.0
    self.rc = None

  @property
  def expected_secs(self):
    return IMPORT_SECS + sum(expected(f)[0] for f in self.files)

  def launch(self):
    self.start = time.monotonic()
    env = self.environment()
    with open(self.log, "wb") as out:
      # Its own session: a kill reaches pytest and whatever it started in
      # its group.
      self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=out,
                                   stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)

  def environment(self):
    """The process's environment: ours, sklearn hidden (and Keras, unless
    ``keeps_keras``), its ports."""
    env = hiding_env(os.environ, keras=keeps_keras(self.files))
    if self.kept is not None:
      env[FAILED_DIR_ENV] = str(self.kept)
    env[THREADS_OUT_ENV] = str(self.threads_out)
    env[CPU_OUT_ENV] = str(self.cpu_out)
    if self.ports is not None:
      env[PORT_RANGE_ENV] = "%d-%d" % self.ports
    return env

  def threads(self):
    """The process's current thread count (0 once it has exited)."""
    return _proc.threads(self.proc.pid)

  def poll(self):
    """Samples threads; returns True once the process has ended."""
    if not self._reap(block=False):
      self.peak_threads = max(self.peak_threads, self.threads())
      if time.monotonic() - self.start < PROCESS_TIMEOUT_SECS:
        return False
      self.kill()
      with open(self.log, "ab") as out:
        out.write(b"\ntools/test: killed after %d s\n" % PROCESS_TIMEOUT_SECS)
      self._reap(block=True)
    self.end = time.monotonic()
    self.rc = self.proc.returncode
    return True

  def _reap(self, *, block):
    # wait4 rather than Popen.poll: it also says how much CPU the process
    # (and the children it reaped) used, which decides what may share one.
    pid, status, usage = os.wait4(self.proc.pid, 0 if block else os.WNOHANG)
    if pid == 0:
      return False
    self.proc.returncode = os.waitstatus_to_exitcode(status)
    self.cpu_secs = usage.ru_utime + usage.ru_stime
    return True

  def kill(self):
    # Only while not reaped: after that the group id may be someone else's.
    if self.proc is not None and self.proc.returncode is None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass

  @property
  def secs(self):
    return self.end - self.start

  def test_cpu(self):
    """Test id -> CPU seconds (tests/conftest.py's record; {} if none)."""
    try:
      return {k: float(v) for k, v in
              json.loads(self.cpu_out.read_text()).items()}
    except (OSError, ValueError, AttributeError):
      return {}

  def scale_skipped(self):
    """How many of this job's tests skipped as the scale tier's."""
    try:
      root = ET.parse(self.xml).getroot()
    except (OSError, ET.ParseError):
      return 0
    return sum(SCALE_SKIP in (skip.get("message") or "")
               for skip in root.iter("skipped"))

  def skipped_whole(self):
    """The files of this job whose every test skipped, none as the scale
    tier's: what this machine cannot run (test_slurm's tests without Slurm),
    whose time here is not the file's time where it runs."""
    try:
      root = ET.parse(self.xml).getroot()
    except (OSError, ET.ParseError):
      return set()
    skipped, ran = set(), set()
    for case in root.iter("testcase"):
      name = file_of(case.get("classname", ""))
      skip = case.find("skipped")
      if skip is None or SCALE_SKIP in (skip.get("message") or ""):
        ran.add(name)
      else:
        skipped.add(name)
    return skipped - ran

  def test_times(self):
    """(seconds, test id) of every test case in this job's JUnit XML."""
    try:
      root = ET.parse(self.xml).getroot()
    except (OSError, ET.ParseError):
      return []
    return [(float(case.get("time", 0)),
             "%s::%s" % (case.get("classname", ""), case.get("name", "")))
            for case in root.iter("testcase")]


def parse_args(argv):
  parser = argparse.ArgumentParser(
      prog="tools/test", add_help=False,
      description="Arguments it does not know go to every pytest process.")
  parser.add_argument("--quick", action="store_true",
                      help="only the files marked quick")
  parser.add_argument("--all", action="store_true",
                      help="every tier: also the tests marked scale, which "
                           "the default run skips (CI runs --all)")
  parser.add_argument("--save-expected", action="store_true",
                      help="after a green run of whole files, also write "
                           "its times and threads to tools/test_durations.json"
                           ", the schedule a clean clone starts from (a "
                           "default run's to its default part)")
  parser.add_argument("--plan", action="store_true",
                      help="print the processes the run would start, in "
                           "order, with their files and expected seconds, "
                           "and start none")
  parser.add_argument("--jobs", type=int,
                      default=int(os.environ.get("SYNC_REPLICAS_TEST_JOBS",
                                                 "4")),
                      help="pytest processes at a time (default 4, or "
                           "$SYNC_REPLICAS_TEST_JOBS)")
  return parser.parse_known_args(argv)


#: Where the last green run's measurements are kept: per checkout (runs/ is
#: gitignored) and per venv, whose TensorFlow sets the times. Not in git: the
#: figures are this machine's and change with every green run.
MEASURED_DIR = ROOT / "runs" / "test-durations"
#: Arguments after which a run's per-file times are not whole files' times.
SELECTING = ("-k", "-m", "--deselect", "--lf", "--last-failed", "-x",
             "--exitfirst", "--maxfail", "--sw", "--stepwise", "--co",
             "--collect-only")


def measured_path(prefix=sys.prefix, *, every_tier=True):
  """This venv's record of the last green run: MEASURED_DIR/<venv>.json
  for runs of every tier (--all), <venv>-default.json for the default run,
  whose files are shorter by their skipped scale tests."""
  name = pathlib.Path(prefix).name.lstrip(".")
  return MEASURED_DIR / (name + ("" if every_tier else "-default") + ".json")


def load_measured(path, part="files"):
  """file name -> (seconds, threads) from a record's ``part``; {} if there
  is none."""
  try:
    files = json.loads(path.read_text())[part]
    return {name: (float(f["secs"]), int(f["threads"]))
            for name, f in files.items()}
  except (OSError, ValueError, KeyError, TypeError):
    return {}


#: The last green run's (seconds, threads) per file, on this machine: a run
#: of every tier's; the default run puts its own over it (use_tier).
MEASURED = load_measured(measured_path())
#: The committed record's figures for this run's tier, between MEASURED and
#: EXPECTED: the default run's part of it (DEFAULT_PART) for a default run,
#: nothing for --all (use_tier).
TIER_EXPECTED = {}


def use_tier(every_tier):
  """Schedules by the record of this tier's runs: the default run by the
  last green default run's figures where it has them, else by a run of
  every tier's (longer: a file's scale tests counted), else by the
  committed record's default part, else by its whole-suite part; --all by
  its own, else by the committed whole-suite part."""
  global MEASURED, TIER_EXPECTED
  MEASURED = load_measured(measured_path())
  TIER_EXPECTED = {}
  if not every_tier:
    MEASURED.update(load_measured(measured_path(every_tier=False)))
    TIER_EXPECTED = load_measured(EXPECTED_PATH, DEFAULT_PART)


#: The schedule a checkout without a green run of its own (CI's clean
#: clone) starts from: a green whole-suite run's record, committed. Written
#: by ``tools/test --save-expected`` (the run must be green and of whole
#: files), never by hand, so it cannot drift from what a run measured; each
#: entry says when it was recorded.
EXPECTED_PATH = ROOT / "tools" / "test_durations.json"
#: file name -> (seconds, threads), from EXPECTED_PATH.
EXPECTED = load_measured(EXPECTED_PATH)
#: EXPECTED_PATH's record of a default run (``tools/test --save-expected``
#: without --all), beside its whole-suite one ("files", CI's): a file whose
#: scale tests skip is shorter there, and a clean clone's default run (the
#: README's ``./tools/test``) packs its processes by it.
DEFAULT_PART = "default"


def expected(path):
  """(seconds, threads) of a file: the last green run's, else the committed
  record's for this tier (TIER_EXPECTED), else EXPECTED's; unknown files as
  slow as can be."""
  if path.name in MEASURED:
    return MEASURED[path.name]
  if path.name in TIER_EXPECTED:
    return TIER_EXPECTED[path.name]
  return EXPECTED.get(path.name, (10_000, PROCESS_THREADS))


def measurements(done):
  """file name -> (seconds, threads) measured in this run's jobs.

  Seconds: the file's tests' time in pytest (the import excluded, as
  EXPECTED's). Threads: what the file added to its process, plus the
  process's own (tests/conftest.py writes them); for a file alone in its
  process, at least the process's sampled peak.
  """
  found = {}
  for job in done:
    # Skipped tests (a version-independent file's, CI's older TensorFlow)
    # would record a file as costing nothing.
    if os.environ.get(SKIP_VERSION_INDEPENDENT_ENV) == "1":
      continue
    try:
      threads = json.loads(job.threads_out.read_text())
    except (OSError, ValueError):
      threads = {}
    skipped = job.skipped_whole()
    for secs, _, name in per_file(job.test_times()):
      if name in skipped:
        continue
      count = int(threads.get(name, 0))
      if len(job.files) == 1:
        count = max(count, job.peak_threads)
      if count:
        found[name] = (round(secs, 1), count)
  return found


def load_stretch(done, busy):
  """How much other programs stretched this run's wall times: the
  machine's busy CPU seconds over the run (``machine_busy_secs``'
  difference) divided by the CPU of the run's own processes and the
  children they reaped; at least 1, and 1 where either is unknown.

  The suite is bound by the cores, so a file's wall time under others'
  load is about this many times its time with the machine to itself.
  Recorded as measured, a loaded run's times make more files look long to
  the next run's pack, which then starts more processes, each a pytest and
  TensorFlow import (about 6 CPU-seconds: the default run's test_soak and
  test_slurm processes, whose tests cost nothing). Replayed: the committed
  record with every time doubled packs 33 processes instead of 24; the
  default run's record of a run at a stretch of 1.42 packs 25, divided by
  it 21. The CPU a run spends is what others' load does not stretch, and
  what this is computed from.
  """
  own = sum(job.cpu_secs for job in done)
  if busy is None or own <= 0:
    return 1.0
  return max(1.0, busy / own)


def record_measured(done, pytest_args, path=None, *, every_tier=True,
                    stretch=1.0, part="files"):
  """After a run of whole files, stores what its green processes measured.

  Files this run did not measure, or measured in a process that failed,
  keep their earlier figures: on a loaded machine a run seldom has no
  failure at all, and a green process measured its files whole. Each file's
  CPU seconds are stored beside its time (tests/conftest.py's record; the
  schedule does not read them). Its time is stored as the wall time
  measured divided by ``stretch`` (``load_stretch``): the schedule's
  seconds are the machine's own, whatever load the run that measured them
  had; the wall time measured and the stretch are stored beside it.
  ``part`` is the record's part to write (EXPECTED_PATH's DEFAULT_PART for
  a default run's); the others are kept as they are.
  Returns the number of files recorded (0: no process was green, or the
  run selected tests).
  """
  path = measured_path(every_tier=every_tier) if path is None else path
  if any(a.split("=")[0] in SELECTING for a in pytest_args):
    return 0
  green = [j for j in done if j.rc in (0, 5)]
  found = measurements(green)
  if not found:
    return 0
  try:
    record = json.loads(path.read_text())
  except (OSError, ValueError):
    record = {}
  files = record.get(part, {})
  now = datetime.datetime.now().isoformat(timespec="seconds")
  cpu = file_cpu(green)
  files.update({name: dict({"secs": round(secs / stretch, 1),
                            "threads": threads, "recorded": now},
                           **({"cpu": cpu[name]} if name in cpu else {}),
                           **({"wall": secs, "stretch": round(stretch, 2)}
                              if stretch != 1.0 else {}))
                for name, (secs, threads) in found.items()})
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp")
  record[part] = files
  tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
  tmp.replace(path)
  return len(found)


def pack(files, workers):
  """Groups files into processes: the long alone, the rest sharing, the
  shortest processes last.

  The files (a long one alone; the short ones marked ``keras`` first put
  together, first fit within ALONE_SECS and the thread cap, so that Keras
  costs its import once) go longest first into ``workers`` lanes, each to
  the lane expected to end first. Each lane is then cut into processes: at
  its end the shortest of its files share one of about TAIL_SECS (its
  tail), the rest fill processes of about ALONE_SECS at most (below) and
  PROCESS_THREADS. The run starts the longest processes first, so the tails
  come last: as the cores free up one by one, short processes fill them. Cut
  into equal processes instead, ten of 141 s at 4 at a time left the last
  two running alone for their last 100 s (a quiet run, 2026-11-29).
  """
  secs = lambda group: sum(expected(f)[0] for f in group)
  threads = lambda group: sum(expected(f)[1] for f in group)
  fits = lambda group, more: (secs(group) + secs(more) <= ALONE_SECS and
                              threads(group) + threads(more)
                              <= PROCESS_THREADS)
  alone, keras, items = [], [], []
  for f in sorted(files, key=lambda f: (-expected(f)[0], f.name)):
    if expected(f)[0] > ALONE_SECS or expected(f)[1] >= PROCESS_THREADS:
      alone.append([f])
    elif needs_keras(f):
      unit = next((u for u in keras if fits(u, [f])), None)
      if unit is None:
        keras.append([f])
      else:
        unit.append(f)
    else:
      items.append([f])
  lanes = [[] for _ in range(max(1, workers))]
  for item in sorted(alone + keras + items, key=lambda i: -secs(i)):
    min(lanes, key=lambda lane: sum(secs(i) for i in lane)).append(item)
  groups = []
  for lane in lanes:
    shared = [i for i in lane if i not in alone]
    tail = []
    for item in reversed(shared):  # The shortest first.
      if secs(tail) >= TAIL_SECS:
        break
      if fits(tail, item):
        tail += item
    shared = [i for i in shared if not set(i) & set(tail)]
    # The rest in as few processes as ALONE_SECS allows (10 % over it rather
    # than one process more: 304 s are two of 152, not three of 101), each
    # file (longest first) to the least loaded one with room for its
    # threads.
    cut = [[] for _ in range(
        math.ceil(secs(sum(shared, [])) / ALONE_SECS - 0.1))]
    for item in shared:
      room = [g for g in cut if threads(g) + threads(item) <= PROCESS_THREADS]
      if room:
        min(room, key=secs).extend(item)
      else:
        cut.append(list(item))
    groups += [i for i in lane if i in alone] + [g for g in cut if g] + (
        [tail] if tail else [])
  return groups


def workers(args):
  """Pytest processes at a time: ``--jobs``; with ``--quick`` at most two
  (its files are short: two processes, one per core here, cost two imports,
  not four)."""
  return max(1, min(args.jobs, 2) if args.quick else args.jobs)


def make_jobs(args, pytest_args, tmp, kept=None):
  files = sorted(TESTS.glob("test_*.py"))
  if args.quick:
    files = [f for f in files if is_quick(f)]
  if os.environ.get(SKIP_VERSION_INDEPENDENT_ENV) == "1":
    skipped = [f for f in files if is_version_independent(f)]
    if skipped:
      print("tools/test: %s=1: not run, version-independent as a whole: %s"
            % (SKIP_VERSION_INDEPENDENT_ENV,
               ", ".join(f.name for f in skipped)))
    files = [f for f in files if f not in skipped]
  jobs = []
  for group in pack(files, workers(args)):
    name = ("tests/" + group[0].name if len(group) == 1 else
            "group %d" % (sum(len(j.files) > 1 for j in jobs) + 1))
    jobs.append(Job(name, sorted(group), pytest_args, tmp, kept))
  jobs.sort(key=lambda j: -j.expected_secs)
  # Disjoint port ranges: processes running side by side never draw the
  # same port between the check that it is free and the server's bind.
  low, high = draw_port_range()
  size = (high - low) // max(len(jobs), 1)
  for i, job in enumerate(jobs):
    job.ports = (low + i * size, low + (i + 1) * size)
  return jobs


def run(jobs, *, workers, stop_early):
  """Runs the jobs, at most ``workers`` at a time; returns those that ran."""
  pending, running, done = list(jobs), [], []
  stop = False
  began = time.monotonic()
  try:
    while (pending and not stop) or running:
      for job in list(running):
        if job.poll():
          running.remove(job)
          done.append(job)
          report(job, len(done), len(jobs), began=began)
          # 2: interrupted; 4: a usage error, which every file would repeat.
          if job.rc in (2, 4) or (stop_early and job.rc not in (0, 5)):
            stop = True
      held = sum(j.threads() for j in running)
      if (pending and not stop and len(running) < workers
          and (not running or held < THREAD_BUDGET)):
        job = pending.pop(0)
        job.launch()
        running.append(job)
        continue
      time.sleep(_POLL_SECS)
  finally:
    for job in running:
      job.kill()
  return done


def plan(jobs, workers):
  """Lines listing the processes ``jobs`` would start, in their order,
  with their expected seconds (the import's included), threads and files,
  and which keep Keras."""
  lines = ["tools/test --plan: %d pytest processes, at most %d at a time, "
           "started in this order (seconds expected: m, measured in the last "
           "green run here; e, the committed record's):" % (len(jobs), workers)]
  for job in jobs:
    origin = "".join(sorted({"m" if f.name in MEASURED else "e"
                             for f in job.files}))
    lines.append("  %-32s %5.0f s %-2s %5d threads%s  %s" % (
        job.name, job.expected_secs, origin,
        sum(expected(f)[1] for f in job.files),
        "  keras" if keeps_keras(job.files) else "",
        " ".join(f.stem for f in job.files)))
  lines.append(keras_line(jobs))
  return lines


def keras_line(jobs):
  """The line saying which processes keep Keras, and how to give it to all."""
  kept = sum(keeps_keras(j.files) for j in jobs)
  return ("tools/test: Keras hidden from %d of %d pytest processes, kept by "
          "the files marked keras (pytestmark = pytest.mark.keras); %s=1 keeps "
          "it in all" % (len(jobs) - kept, len(jobs), KEEP_KERAS_ENV))


def report(job, index, total, *, began):
  """Prints a finished job's whole output at once, under a header: when it
  ran, counted from the run's start (``began``), says where a schedule left
  cores idle (few processes left at the end)."""
  sys.stdout.write("\n%s\n[%d/%d] %s: exit %d in %.0f s (from %.0f to %.0f "
                   "s of the run)\n%s\n"
                   % ("=" * 78, index, total, job.name, job.rc, job.secs,
                      job.start - began, job.end - began, "=" * 78))
  sys.stdout.write(job.log.read_text(errors="replace"))
  sys.stdout.flush()


def machine_busy_secs():
  """CPU seconds all cores have spent not idle since boot, or None.

  The difference over the run says whether the suite is bound by the
  cores (busy close to cores x wall) or by waiting; the per-process CPU
  below misses processes a test started but did not reap itself.
  """
  try:
    with open("/proc/stat") as f:
      ticks = [int(x) for x in f.readline().split()[1:]]
  except (OSError, ValueError):
    return None
  return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def kept_report(kept):
  """Lines naming the failed tests whose tmp_path was kept under ``kept``."""
  if kept is None or not kept.is_dir():
    return []
  return (["Failed tests' tmp_path (their task logs), kept under %s:" % kept]
          + ["  %s" % d.name for d in sorted(kept.iterdir())])


def scale_line(done):
  """The one line on the scale tests this run skipped, or None."""
  skipped = sum(job.scale_skipped() for job in done)
  if not skipped:
    return None
  return ("tools/test: %d tests of the scale tier skipped (16 workers, the "
          "soak, driving modes on emulated hosts, the benchmark tools' "
          "end-to-end runs, second proofs of what the default run proves): "
          "./tools/test --all runs them, as CI does" % skipped)


def summary(done, not_run, wall, busy=None, kept=None):
  print("\n%s\ntools/test: %d pytest processes, %.0f s wall time"
        % ("=" * 78, len(done), wall))
  if busy is not None:
    cores = os.cpu_count() or 1
    print("Machine CPU: %.0f s busy of %.0f s (%d cores x wall), %.0f%%; "
          "other programs included" % (busy, cores * wall, cores,
                                       100 * busy / max(cores * wall, 1e-9)))
  print("Processes, slowest first (CPU: the process and the children it "
        "reaped; threads: the pytest process's peak):")
  for job in sorted(done, key=lambda j: -j.secs):
    files = ("" if job.files[0].name in job.name else
             " (%s)" % ", ".join(f.stem for f in job.files))
    print("  %-36s exit %3d in %4.0f s, CPU %4.0f s, %5d threads%s"
          % (job.name, job.rc, job.secs, job.cpu_secs, job.peak_threads,
             files))
  for job in not_run:
    print("  %-36s not run (stopped early)" % job.name)
  tests = sorted((t for job in done for t in job.test_times()), reverse=True)
  if tests:
    print("Files, slowest first (their tests' time in pytest, and how many; "
          "the seconds expected: m, measured in the last green run; e, "
          "EXPECTED's):")
    cpu = {}
    for job in done:
      cpu.update(job.test_cpu())
    cpu_of = file_cpu(done)
    for secs, count, name in per_file(tests):
      if name in MEASURED:
        was = "%.0f s m" % MEASURED[name][0]
      else:
        was = "%s s e" % EXPECTED.get(name, ("none",))[0]
      print("  %-36s %6.1f s  %4d tests  CPU %6.1f s  (expected %s)"
            % (name, secs, count, cpu_of.get(name, 0.0), was))
    print("Slowest tests (setup + call + teardown):")
    for secs, name in tests[:15]:
      print("  %6.1f s  %s" % (secs, name))
    if cpu:
      print("Costliest tests in CPU (the pytest process and the children "
            "it reaped, setup to teardown):")
      for test_id, secs in sorted(cpu.items(), key=lambda kv: -kv[1])[:15]:
        print("  %6.1f s  %s" % (secs, test_id))
  for line in kept_report(kept):
    print(line)


def file_cpu(done):
  """File name -> its tests' CPU seconds, added up, in these jobs."""
  tests = []
  for job in done:
    # Test ids are paths ("tests/test_x.py::test_y"); per_file reads JUnit's
    # dotted module names.
    tests += [(secs, test_id.replace("/", ".").replace(".py::", "::"))
              for test_id, secs in job.test_cpu().items()]
  return {name: round(secs, 1) for secs, _, name in per_file(tests)}


def per_file(tests):
  """(seconds, test count, file name) per file, slowest first.

  ``tests`` holds (seconds, "tests.test_x::test_name") pairs, as
  ``Job.test_times`` returns them: JUnit's class name is the module's
  dotted path, followed by a test class's name (``Test...``) if any.
  """
  files = {}
  for secs, name in tests:
    module = file_of(name)
    total, count = files.get(module, (0.0, 0))
    files[module] = (total + secs, count + 1)
  return sorted(((secs, count, module)
                 for module, (secs, count) in files.items()), reverse=True)


def file_of(test_id):
  """The file name of a "tests.test_x::test_name" id (per_file's)."""
  parts = test_id.split("::")[0].split(".")
  return next((m for m in parts if m.startswith("test_")), parts[-1]) + ".py"


def main(argv):
  args, pytest_args = parse_args(argv)
  # tools/test passes --all on as the variable (for the files it runs
  # itself too); the processes inherit it, tests/conftest.py reads it.
  every_tier = args.all or os.environ.get(ALL_TIERS_ENV) == "1"
  if every_tier:
    os.environ[ALL_TIERS_ENV] = "1"
  use_tier(every_tier)
  # A CI timeout's SIGTERM unwinds like Ctrl-C: run() kills what it started.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
  stop_early = any(a in ("-x", "--exitfirst") or a.startswith("--maxfail")
                   for a in pytest_args)
  start = time.monotonic()
  busy_at_start = machine_busy_secs()
  kept = FAILED_TESTS / time.strftime("%Y%m%d-%H%M%S")
  with tempfile.TemporaryDirectory(prefix="sync_replicas_tests_") as tmp:
    jobs = make_jobs(args, pytest_args, pathlib.Path(tmp), kept)
    if not jobs:
      print("tools/test: no test file under %s" % TESTS, file=sys.stderr)
      return 5
    if args.plan:
      print("\n".join(plan(jobs, workers(args))))
      return 0
    done = run(jobs, workers=workers(args), stop_early=stop_early)
    busy_at_end = machine_busy_secs()
    summary(done, [j for j in jobs if j not in done],
            time.monotonic() - start,
            None if None in (busy_at_start, busy_at_end)
            else busy_at_end - busy_at_start, kept)
    # Inside the block: the JUnit files and thread counts are in tmp.
    skipped = scale_line(done)
    if skipped:
      print(skipped)
    print(keras_line(done))
    if len(done) == len(jobs):
      stretch = load_stretch(
          done, None if None in (busy_at_start, busy_at_end)
          else busy_at_end - busy_at_start)
      if stretch > 1.0:
        print("tools/test: the machine was busy %.2f times this run's own "
              "CPU: each file's time is recorded divided by that"
              % stretch)
      recorded = record_measured(done, pytest_args, every_tier=every_tier,
                                 stretch=stretch)
      if recorded:
        print("tools/test: times and threads of %d files recorded in %s for "
              "the next run's schedule" % (
                  recorded, measured_path(every_tier=every_tier)))
      if args.save_expected:
        saved = record_measured(
            done, pytest_args, path=EXPECTED_PATH, stretch=stretch,
            part="files" if every_tier else DEFAULT_PART)
        print("tools/test: %s" % (
            "times and threads of %d files saved in %s (%s), a clean "
            "clone's schedule" % (
                saved, EXPECTED_PATH, "every tier" if every_tier else
                "the default run's part") if saved else
            "--save-expected saved nothing: only a green run of whole "
            "files is saved"))
  if any(j.rc not in (0, 5) for j in done) or len(done) < len(jobs):
    return 1
  if all(j.rc == 5 for j in done):
    print("tools/test: no test was collected in any file", file=sys.stderr)
    return 5
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
