"""Fixtures shared by every test module."""

import datetime
import importlib.util
import json
import logging
import os
import pathlib
import re
import resource
import shutil
import sys
import threading

# Quiet TensorFlow's C++ start-up chatter; tests read Python-side logs only.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import _forkserver  # pylint: disable=g-import-not-at-top
import support  # pylint: disable=g-import-not-at-top
import sync_replicas  # pylint: disable=g-import-not-at-top

#: Where a failed test's tmp_path is copied, one folder per test: set by
#: tools/test to one folder per suite run; else ROOT/runs/failed-tests/<now>.
KEEP_ENV = "SYNC_REPLICAS_FAILED_TESTS_DIR"
#: Files larger than this are not copied (checkpoints of a big model).
KEEP_MAX_BYTES = 20 << 20
#: Lines of each kept log quoted in the failure report, and how many logs.
QUOTED_LINES, QUOTED_LOGS = 12, 8
#: tools/test sets it to a path: at the end of the session each test
#: file's peak threads are written there as JSON (tools/_run_tests.py
#: records them with the files' times after a green run).
THREADS_OUT_ENV = "SYNC_REPLICAS_FILE_THREADS_OUT"
#: .ci/run sets it to 1 for its older TensorFlow's suite: the tests marked
#: ``version_independent`` are skipped there, having run under the newest
#: (docs/testing.md says which and why). tools/_run_tests.py reads the
#: same name.
SKIP_VERSION_INDEPENDENT_ENV = "SYNC_REPLICAS_SKIP_VERSION_INDEPENDENT"
#: tools/test sets it to a path: at the end of the session each test's
#: CPU seconds (this process's and its reaped children's, setup to
#: teardown) are written there as JSON, test id -> seconds. Wall time
#: alone misleads on a shared machine: other programs' load stretches it,
#: while the CPU a test spends is what it costs the suite.
CPU_OUT_ENV = "SYNC_REPLICAS_TEST_CPU_OUT"
_ROOT = pathlib.Path(__file__).resolve().parents[1]
_RUN_STAMP = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + str(
    os.getpid())

#: Whether this process imported TensorFlow without Keras: tools/test starts
#: the pytest process of files not marked ``keras`` with the stub first on
#: its PYTHONPATH (tools/_run_tests.py).
_KERAS_SPEC = importlib.util.find_spec("keras")
_KERAS_HIDDEN_HERE = ("keras" not in sys.modules and _KERAS_SPEC is not None
                      and _KERAS_SPEC.origin is not None
                      and pathlib.Path(_KERAS_SPEC.origin).resolve().parent
                      .parent == support.TASKS_HIDDEN)

# Every process a test starts imports TensorFlow without Keras, which none of
# them uses (tests/_hidden_from_tasks says what that saves); a pytest process
# keeps it unless tools/test hid it.
support.hide_from_tasks()


def pytest_configure(config):
  # Registered here rather than in setup.cfg: tools/_env.sh reinstalls every
  # venv when setup.cfg changes.
  config.addinivalue_line(
      "markers", "quick: the inner loop's tests (./tools/test --quick): "
      "unit, validation, graph parity, hook and scenario tests, under a "
      "minute together; a module sets pytestmark = pytest.mark.quick")
  config.addinivalue_line(
      "markers", "wheel: builds the package's wheel and installs it into a "
      "fresh venv under the temporary directory (tests/test_wheel.py, about "
      "a minute on 2 cores, most of it the TensorFlow imports of a demo "
      "cluster; a few MB of disk)")
  config.addinivalue_line(
      "markers", "keras: the file uses Keras in pytest's own process (a "
      "module sets pytestmark): tools/test hides Keras from the other "
      "files' pytest processes, whose TensorFlow import it would slow "
      "(tools/_run_tests.py; SYNC_REPLICAS_TEST_KEEP_KERAS=1 keeps it)")
  config.addinivalue_line(
      "markers", "version_independent: what it proves runs no TensorFlow "
      "code of its own (the launcher, the Slurm wrapper, the emulated "
      "hosts, the tools' bookkeeping) and the TensorFlow its tasks run is "
      "tested under every version elsewhere: CI runs it under the newest "
      "TensorFlow only (SYNC_REPLICAS_SKIP_VERSION_INDEPENDENT=1 skips it)")
  config.addinivalue_line(
      "markers", "newest_only(reason): it runs TensorFlow code, but what "
      "TensorFlow does in it is proven under every version by other tests "
      "that run there, which the reason names: CI runs it under the newest "
      "TensorFlow only, as the version_independent ones (support."
      "newest_only_here does the same for one case of a parametrized test)")
  config.addinivalue_line(
      "markers", "scale(reason): a run at scale (16 workers, the soak, "
      "driving modes on emulated hosts, the benchmark tools' end-to-end "
      "runs), or a second proof, whose function tests in the default run "
      "prove at a small scale or apart, which the reason names: "
      "./tools/test skips it, ./tools/test --all runs it, and so does CI")
  # A thread that dies with an exception fails the test (but stock's
  # runner's expected death, _expect_stocks_cancelled_runner_threads).
  config.addinivalue_line(
      "filterwarnings", "error::pytest.PytestUnhandledThreadExceptionWarning")
  # Stock's apply_gradients makes a readiness tensor that a test building
  # its graph only never runs; TensorFlow logs "Object was never used" for
  # it as the process ends (ours marks it used, optimizer.py).
  logging.getLogger("tensorflow").addFilter(_StocksUnusedReadiness())


class _StocksUnusedReadiness(logging.Filter):
  """Drops TensorFlow's "never used" record for stock's readiness tensor,
  made in stock's sync_replicas_optimizer.py; every other record passes."""

  def filter(self, record):
    message = record.getMessage()
    return not ("Object was never used" in message
                and "sync_replicas_optimizer.py" in message)


@pytest.fixture(params=["stock", "ours"])
def impl(request):
  """Each side-by-side test runs once with stock's class and once with ours."""
  return {"stock": support.STOCK, "ours": support.OURS}[request.param]


@pytest.fixture
def graph():
  """A fresh default graph for building-only tests."""
  g = tf.Graph()
  with g.as_default():
    yield g


@pytest.fixture
def half_way(tmp_path):
  """A live job: the chief pushed once, 1 of 2 gradients, 1 token queued.

  Yields ``(cluster, manifest path, state, workers, sessions)``; ``state()``
  reads ``[global step, tokens queued, [gradients per accumulator]]``, which
  tools that must change nothing are checked against.
  """
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  # Stock's start: the chief's lone push returns on an initial token.
  workers = [support.LinearWorker(support.OURS, cluster, t, replicas=2,
                                  total=2, opt_kwargs={"data_end": "stock"})
             for t in range(2)]
  chief, other = workers
  with chief.graph.as_default():
    # Built before the session: a finalized graph takes no new ops.
    reads = [chief.global_step, chief.opt.token_queue.size(),
             [a.num_accumulated() for a, _ in chief.opt.accumulators]]
  path = chief.opt.write_sync_manifest(str(tmp_path))
  sessions = [chief.session()]
  try:
    sessions.append(other.session())
    sessions[0].run(chief.train_op)
    state = lambda: sessions[0].run(reads)  # pylint: disable=unnecessary-lambda
    assert state() == [0, 1, [1]]
    yield cluster, path, state, workers, sessions
  finally:
    for s in reversed(sessions):
      s.close()


def _kept_dir(nodeid):
  base = os.environ.get(KEEP_ENV) or str(
      _ROOT / "runs" / "failed-tests" / _RUN_STAMP)
  name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", nodeid)[:150]
  return pathlib.Path(base) / name


def _keep(tmp_path, nodeid):
  """Copies ``tmp_path`` (task logs, checkpoints) out of pytest's reach.

  pytest keeps only the last few base temporary directories, and tools/test
  runs many pytest processes, so a failed test's tmp_path was often gone by
  the end of the suite. Returns the report section's text.
  """
  dest = _kept_dir(nodeid)
  skipped = []

  def too_big(folder, names):
    big = [n for n in names if os.path.isfile(os.path.join(folder, n))
           and os.path.getsize(os.path.join(folder, n)) > KEEP_MAX_BYTES]
    skipped.extend(os.path.join(folder, n) for n in big)
    return big

  if dest.exists():
    shutil.rmtree(dest)
  shutil.copytree(tmp_path, dest, ignore=too_big, symlinks=True)
  lines = ["tmp_path (the task logs of its process clusters) kept in %s"
           % dest]
  lines += ["not copied (over %d MB): %s" % (KEEP_MAX_BYTES >> 20, path)
            for path in skipped]
  logs = sorted(p for p in dest.rglob("*") if p.is_file() and p.suffix in (
      ".log", ".out", ".err", ".jsonl"))
  for log in logs[:QUOTED_LOGS]:
    tail = log.read_text(errors="replace").splitlines()[-QUOTED_LINES:]
    lines.append("--- %s, last %d lines:" % (log.relative_to(dest),
                                               len(tail)))
    lines.extend(tail)
  if len(logs) > QUOTED_LOGS:
    lines.append("(%d more logs there)" % (len(logs) - QUOTED_LOGS))
  return "\n".join(lines)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """On a failure, keeps the test's tmp_path and says where in the report."""
  del call
  outcome = yield
  report = outcome.get_result()
  tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
  if (not report.failed or report.when == "teardown" or tmp_path is None
      or not tmp_path.is_dir() or not any(tmp_path.iterdir())):
    return
  try:
    text = _keep(tmp_path, item.nodeid)
  except OSError as e:
    text = "keeping tmp_path %s failed: %s" % (tmp_path, e)
  report.sections.append(("task logs", text))


#: tools/_proc.py, which the test scheduler reads its processes' threads with.
_threads_now = support.load_tool("_proc.py").threads


#: file name -> [threads when its first test began, peak after any test].
_FILE_THREADS = {}
#: test id -> CPU seconds (CPU_OUT_ENV).
_TEST_CPU = {}
_SESSION_THREADS = []


def pytest_collection_modifyitems(config, items):
  """Skips the version-independent and newest-only tests where .ci/run says
  so, and the scale tier outside ``./tools/test --all``; a newest_only or
  scale mark without its reason is refused, anywhere."""
  del config
  every_tier = os.environ.get(support.ALL_TIERS_ENV) == "1"
  for item in items:
    newest = item.get_closest_marker("newest_only")
    if newest is not None:
      support.newest_only_reason(newest, item.nodeid)
    scale = item.get_closest_marker("scale")
    if scale is not None:
      reason = support.scale_reason(scale, item.nodeid)
      if not every_tier:
        item.add_marker(pytest.mark.skip(reason=support.scale_skip(reason)))
  if os.environ.get(SKIP_VERSION_INDEPENDENT_ENV) != "1":
    return
  skip = pytest.mark.skip(reason=(
      "version-independent: CI runs it under its newest TensorFlow only "
      "(%s=1 here, TensorFlow %s; docs/testing.md)"
      % (SKIP_VERSION_INDEPENDENT_ENV, tf.__version__)))
  for item in items:
    if item.get_closest_marker("version_independent") is not None:
      item.add_marker(skip)
    newest = item.get_closest_marker("newest_only")
    if newest is not None:
      item.add_marker(pytest.mark.skip(reason=support.newest_only_skip(
          support.newest_only_reason(newest, item.nodeid))))


def pytest_runtest_setup(item):
  """Fails a test marked ``keras`` in a process that hid Keras, saying why,
  before it fails on the stub's ImportError or a missing module."""
  if _KERAS_HIDDEN_HERE and item.get_closest_marker("keras") is not None:
    pytest.fail(
        "%s is marked keras, but this pytest process imported TensorFlow "
        "without Keras: %s is first on its PYTHONPATH (tools/test puts it "
        "there for files not marked keras). Run it with tools/test, or "
        "take that folder off PYTHONPATH." % (item.nodeid,
                                              support.TASKS_HIDDEN),
        pytrace=False)


def pytest_sessionstart(session):
  del session
  _SESSION_THREADS.append(_threads_now())
  _expect_stocks_cancelled_runner_threads()


def _expect_stocks_cancelled_runner_threads():
  """Lets stock's chief QueueRunner threads die of CancelledError quietly.

  A thread that dies with an exception fails the test it dies in
  (pytest_configure turns pytest's warning into an error): a passing run
  prints no traceback. One death is expected, stock's: its chief runner
  thread blocks in a gradient take that no worker feeds once training
  ended, and closing the session cancels it ("Step was cancelled by an
  explicit call to Session::Close()"), a traceback in every stock job.
  The side-by-side tests run stock's class, and ours makes stock's threads
  when given no coordinator; our own runner ends without one
  (sync_replicas/_runner.py). Installed over pytest's own hook, which gets
  every other death. Those threads are named by stock's QueueRunner.
  The same close can catch the thread between two enqueues instead: its
  next run then fails with FailedPreconditionError "Session is closed",
  which stock's runner also raises when it has no coordinator (seen in CI,
  test_drive_modes' runner threads made without one). Which of the two
  a close meets is a matter of timing; both are the close, nothing else.
  """
  previous = threading.excepthook

  def hook(args):
    if (args.thread is not None
        and args.thread.name.startswith("QueueRunnerThread-")
        and (issubclass(args.exc_type, tf.errors.CancelledError)
             or (issubclass(args.exc_type, tf.errors.FailedPreconditionError)
                 and "Session is closed" in str(args.exc_value)))):
      return
    previous(args)

  threading.excepthook = hook


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Notes the threads each file adds: its servers stay until the process
  ends, so the files sharing a process add up (tools/_run_tests.py)."""
  del nextitem
  seen = _FILE_THREADS.setdefault(item.path.name, [_threads_now(), 0])
  cpu = _cpu_secs()
  yield
  seen[1] = max(seen[1], _threads_now())
  _TEST_CPU[item.nodeid] = round(_cpu_secs() - cpu, 2)


def _cpu_secs():
  """CPU seconds of this process and of the children it has reaped: a
  process a test starts and waits for counts, grandchildren only if their
  parent waited for them (Slurm's tasks are Slurm's children: not counted).
  Tasks forked by the fork server count as they are waited for, as fresh
  ones would (``_forkserver.cpu_secs``)."""
  return _forkserver.cpu_secs() + sum(u.ru_utime + u.ru_stime for u in (
      resource.getrusage(resource.RUSAGE_SELF),
      resource.getrusage(resource.RUSAGE_CHILDREN)))


def pytest_sessionfinish(session):
  del session
  cpu_out = os.environ.get(CPU_OUT_ENV)
  if cpu_out:
    with open(cpu_out, "w") as f:
      json.dump(_TEST_CPU, f)
  out = os.environ.get(THREADS_OUT_ENV)
  if not out or not _SESSION_THREADS:
    return
  # As if the file ran alone: the process's own threads plus the file's.
  base = _SESSION_THREADS[0]
  with open(out, "w") as f:
    json.dump({name: base + max(0, peak - start)
               for name, (start, peak) in _FILE_THREADS.items()}, f)
