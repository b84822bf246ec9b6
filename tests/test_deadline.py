"""Progress with fewer than R workers (TensorFlow issue 20342).

With ``min_replicas_to_aggregate`` and ``aggregation_deadline_secs`` the
chief applies what arrived once the deadline since the last update passed and
every accumulator holds at least the minimum; each such short update is
logged and counted in the statistics.
"""

import contextlib
import logging
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import support

pytestmark = pytest.mark.quick  # In ./tools/test --quick.

RUNNER_LOGGER = "sync_replicas._runner"


class _TestClock:
  """The chief runner's clock, moved only by the test; counts its reads.

  The deadline loop reads the clock once per poll (and once more after an
  update), so ``wait_for_polls`` tells when the loop has looked at the
  accumulators after a push and made its decision: no sleep stands in for
  "the loop had its chance", and no machine is too slow or too fast for the
  deadline.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._now = 0.0
    self._reads = 0

  def __call__(self):
    with self._lock:
      self._reads += 1
      return self._now

  def advance(self, secs):
    with self._lock:
      self._now += secs

  def wait_for_polls(self, what):
    """Returns once the loop has polled and acted on what it saw since the
    call: its third read from now follows a whole poll that began after this
    call (the first may belong to a poll already under way) and the update
    that poll decided, if any."""
    with self._lock:
      start = self._reads
    support.wait_until(lambda: self._reads >= start + 3, timeout=20,
                       what="the deadline loop's polls after " + what)


DEADLINE_SECS = 5.0
SHARED = support.SharedCluster(num_workers=3, num_ps=1)


@contextlib.contextmanager
def _constant_workers(clock):
  """Three ConstantWorkers on the shared cluster, the chief's runner on
  ``clock``; closed after the block, and the cluster discarded if it
  raised."""
  with SHARED.use() as cluster:
    workers = []
    try:
      workers.extend(support.ConstantWorker(
          support.OURS, cluster, t, replicas=3, total=3,
          min_replicas_to_aggregate=2,
          aggregation_deadline_secs=DEADLINE_SECS, stall_log_secs=None,
          runner_clock=clock if t == 0 else None,
          # Stock's start, whose spare initial tokens let a lone push
          # return: these tests step the workers one push at a time.
          data_end="stock")
                     for t in range(3))
      yield workers
    finally:
      support.close_all(workers)


def _short_updates(caplog):
  return [r.getMessage() for r in caplog.records
          if "with 2 of replicas_to_aggregate=3" in r.getMessage()]


def test_a_push_before_the_deadline_makes_no_update(caplog):
  caplog.set_level(logging.INFO, logger=RUNNER_LOGGER)
  clock = _TestClock()
  with _constant_workers(clock) as workers:
    chief, other, _ = workers
    chief.session.run(chief.train_op)  # 1 of 3; an initial token lets it go.
    other.session.run(other.train_op)  # 2 of 3: the minimum, in time.
    clock.wait_for_polls("the second push")
    assert chief.session.run([chief.step, chief.pending]) == [0, 2], (
        "an update went ahead with the minimum before the deadline")
    clock.advance(DEADLINE_SECS * 0.99)
    clock.wait_for_polls("the clock moved to just before the deadline")
    assert chief.session.run([chief.step, chief.pending]) == [0, 2], (
        "an update went ahead before the deadline")
    clock.advance(DEADLINE_SECS * 0.02)
    support.wait_until(lambda: chief.session.run(chief.step) == 1, timeout=20,
                       what="the short update, once past the deadline")
    # The mean of the two that arrived: ([1, 10] + [2, 20]) / 2.
    np.testing.assert_allclose(chief.session.run(chief.var), [-1.5, -15.0])
  short = _short_updates(caplog)
  assert len(short) == 1, [r.getMessage() for r in caplog.records]
  assert "update to step 1" in short[0]


def test_no_update_below_the_minimum_however_late(caplog):
  caplog.set_level(logging.INFO, logger=RUNNER_LOGGER)
  clock = _TestClock()
  with _constant_workers(clock) as workers:
    chief, other, _ = workers
    chief.session.run(chief.train_op)  # 1 of 3, below the minimum of 2.
    clock.advance(DEADLINE_SECS * 3)
    clock.wait_for_polls("three deadlines passed with one gradient")
    assert chief.session.run([chief.step, chief.pending]) == [0, 1]
    other.session.run(other.train_op)  # The minimum, long after the deadline.
    support.wait_until(lambda: chief.session.run(chief.step) == 1, timeout=20,
                       what="the short update")
    np.testing.assert_allclose(chief.session.run(chief.var), [-1.5, -15.0])
  short = _short_updates(caplog)
  assert len(short) == 1 and "update to step 1" in short[0], short


WORKERS, LAST_STEP, STOP_AT = 3, 16, 5


def _traced_worker(cluster, task, ready, stopped_at):
  """Worker 2 stops for good at local step STOP_AT; the others train on.

  The chief's runner clock stands still until worker 2 stops, so no update
  before that can go ahead on the deadline (all three push, at their own
  pace); from then on it is the real clock.
  """
  worker = support.TraceWorker(
      cluster, task, workers=WORKERS, rows=LAST_STEP + 2, replicas=WORKERS,
      one_gradient_per_worker=True, worker_index=task,
      min_replicas_to_aggregate=2, aggregation_deadline_secs=0.25,
      statistics=True, statistics_log_steps=None)
  assert "chief/deadline_updates" in worker.opt.statistics_tensors
  if task == 0:
    worker.opt.get_chief_queue_runner().clock = lambda: (
        0.0 if not stopped_at else time.monotonic() - stopped_at[0])

  def before_push(local):
    if task == 2 and local >= STOP_AT:
      stopped_at.append(time.monotonic())
      return False
    return True

  worker.train(ready, last_step=LAST_STEP, before_push=before_push)


@pytest.mark.timeout(200)
def test_training_goes_on_when_a_worker_stops_mid_run(caplog):
  caplog.set_level(logging.INFO, logger=RUNNER_LOGGER)
  stopped_at = []
  with SHARED.use() as cluster:
    support.run_chief_first(_traced_worker, cluster, WORKERS, stopped_at,
                            timeout=150)

  def counters(graph):
    # The cluster counters are resource variables on the ps under the
    # optimizer's status scope; they outlive the chief's session.
    del graph
    return [tf.raw_ops.ReadVariableOp(
        resource=tf.raw_ops.VarHandleOp(
            dtype=tf.int64, shape=[],
            shared_name="sync_replicas_status/cluster/" + name),
        dtype=tf.int64) for name in ("deadline_updates", "updates_applied")]

  step, trace, (deadline_updates, updates) = support.read_trace(
      cluster, rows=LAST_STEP + 2, workers=WORKERS, extra=counters)
  assert step >= LAST_STEP
  assert updates == step
  # The workers can land one more update while they notice the last step.
  assert step <= LAST_STEP + 1
  counts = []
  for s in range(step):
    cells = trace[s][trace[s] != 0]
    counts.append(len(cells))
    # Only fresh gradients of distinct workers, each weighted R / k.
    np.testing.assert_allclose(cells, WORKERS / len(cells),
                               err_msg="step %d: %s" % (s, trace[s]))
  # Until worker 2 stopped the deadline could not pass: every update waited
  # for all three. From its stop on, every update averages the two others.
  assert counts[:STOP_AT] == [3] * STOP_AT, counts
  assert all(c == 2 for c in counts[STOP_AT:]), counts
  assert trace[STOP_AT:, 2].sum() == 0
  # Each of those was released by the deadline, counted and logged once.
  logged = _short_updates(caplog)
  assert deadline_updates == len(logged) == step - STOP_AT, (
      deadline_updates, len(logged), counts)


@pytest.mark.parametrize("kwargs, words", [
    (dict(min_replicas_to_aggregate=2), "go together"),
    (dict(aggregation_deadline_secs=1.0), "go together"),
    (dict(min_replicas_to_aggregate=4, aggregation_deadline_secs=1.0),
     r"int in \[1, replicas_to_aggregate=3\], got 4"),
    (dict(min_replicas_to_aggregate=0, aggregation_deadline_secs=1.0),
     "got 0"),
    (dict(min_replicas_to_aggregate=2, aggregation_deadline_secs=0),
     "> 0, got 0"),
    (dict(min_replicas_to_aggregate=2, aggregation_deadline_secs=True),
     "got True"),
    (dict(min_replicas_to_aggregate=2, aggregation_deadline_secs=1.0,
          prompt_stop=False), "needs prompt_stop=True"),
])
def test_bad_deadline_options_are_refused_at_construction(kwargs, words):
  with pytest.raises(ValueError, match=words):
    support.OURS(support.sgd(), replicas_to_aggregate=3, **kwargs)


def test_without_a_deadline_the_takes_wait_for_a_constant():
  graph = tf.Graph()
  with graph.as_default():
    step = tf.compat.v1.train.get_or_create_global_step()
    var = tf.compat.v1.get_variable("w", [2])
    support.OURS(support.sgd(), replicas_to_aggregate=3).apply_gradients(
        [(tf.ones([2]), var)], global_step=step)
  assert not [op for op in graph.get_operations()
              if op.type == "PlaceholderWithDefault"]
