"""Progress with fewer than R workers (TensorFlow issue 20342).

With ``min_replicas_to_aggregate`` and ``aggregation_deadline_secs`` the
chief applies what arrived once the deadline since the last update passed and
every accumulator holds at least the minimum; each such short update is
logged and counted in the statistics.
"""

import logging
import time

import numpy as np
import pytest
import tensorflow as tf

import sync_replicas
import support

pytestmark = pytest.mark.quick  # In ./tools/test --quick.

RUNNER_LOGGER = "sync_replicas._runner"


def test_no_update_below_the_minimum_then_a_short_one_after_the_deadline(
    caplog):
  caplog.set_level(logging.INFO, logger=RUNNER_LOGGER)
  cluster = sync_replicas.LocalCluster(num_workers=3, num_ps=1)
  workers = [support.ConstantWorker(
      support.OURS, cluster, t, replicas=3, total=3,
      min_replicas_to_aggregate=2, aggregation_deadline_secs=0.2)
             for t in range(3)]
  chief, other, _ = workers
  try:
    chief.session.run(chief.train_op)  # 1 of 3; an initial token lets it go.
    # Three deadlines pass with one gradient: below the minimum of 2.
    time.sleep(0.6)
    assert chief.session.run(chief.step) == 0
    other.session.run(other.train_op)
    support.wait_until(lambda: chief.session.run(chief.step) == 1, timeout=20,
                       what="the short update")
    # The mean of the two that arrived: ([1, 10] + [2, 20]) / 2.
    np.testing.assert_allclose(chief.session.run(chief.var), [-1.5, -15.0])
  finally:
    support.close_all(workers)
  short = [r.getMessage() for r in caplog.records
           if "with 2 of replicas_to_aggregate=3" in r.getMessage()]
  assert len(short) == 1, [r.getMessage() for r in caplog.records]
  assert "update to step 1" in short[0]


WORKERS, LAST_STEP, STOP_AT = 3, 16, 5


def _traced_worker(cluster, task, ready):
  """Worker 2 stops for good at local step STOP_AT; the others train on."""
  worker = support.TraceWorker(
      cluster, task, workers=WORKERS, rows=LAST_STEP + 2, replicas=WORKERS,
      one_gradient_per_worker=True, worker_index=task,
      min_replicas_to_aggregate=2, aggregation_deadline_secs=0.25,
      statistics=True, statistics_log_steps=None)
  assert "chief/deadline_updates" in worker.opt.statistics_tensors
  worker.train(ready, last_step=LAST_STEP,
               before_push=lambda local: task != 2 or local < STOP_AT)


@pytest.mark.timeout(200)
def test_training_goes_on_when_a_worker_stops_mid_run(caplog):
  caplog.set_level(logging.INFO, logger=RUNNER_LOGGER)
  cluster = sync_replicas.LocalCluster(num_workers=WORKERS, num_ps=1)
  support.run_chief_first(_traced_worker, cluster, WORKERS, timeout=150)

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
  # While all three ran an update could still be short (a worker slower
  # than the deadline, e.g. at start-up); from worker 2's stop on, every
  # update averages the two others.
  assert all(c >= 2 for c in counts[:STOP_AT]), counts
  assert all(c == 2 for c in counts[STOP_AT:]), counts
  assert np.count_nonzero(trace[:STOP_AT, 2]) >= 1, "worker 2 never counted"
  assert trace[STOP_AT:, 2].sum() == 0
  short = sum(c == 2 for c in counts)
  logged = [r for r in caplog.records
            if "with 2 of replicas_to_aggregate=3" in r.getMessage()]
  # Every short update was released by the deadline; a released one may
  # still average 3 when the third arrived between the chief's count and
  # its takes.
  assert short <= deadline_updates == len(logged) <= short + counts.count(3), (
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
