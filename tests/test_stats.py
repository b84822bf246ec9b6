"""Sync statistics: exact counts in real event files, log lines, zero cost off.

The scenario is TensorFlow's own (2 workers aggregating 2, from
test_tf_scenarios): round 1 makes update 1, round 2's two gradients carry
local step 0 after the global step reached 1 and are dropped, round 3 makes
update 2. So: 6 pushes, exactly 2 dropped (1 per worker, each 1 step stale),
6 tokens, 2 updates of 2 gradients each.
"""

import functools
import glob
import logging

import pytest
import tensorflow as tf

import support
import test_graph_parity

pytestmark = pytest.mark.quick  # In ./tools/test --quick.

STATS = functools.partial(support.OURS, statistics=True,
                          statistics_log_steps=1)


def _last_values(logdir):
  """The last value of every scalar tag in the event files under logdir."""
  values = {}
  files = sorted(glob.glob(logdir + "/events.out.tfevents.*"))
  assert files, "no event file in %s" % logdir
  for path in files:
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        values[value.tag] = value.simple_value
  return values


def _tf_scenario(monkeypatch, logdir):
  """Runs the 2-worker scenario; the chief writes summaries every step."""
  original = support.monitored_session

  def chief_writes_summaries(target, *, is_chief, hooks, **kwargs):
    if is_chief:
      # The scenario's global step is a plain variable named "global_step";
      # the summary saver finds it through the collection.
      graph = tf.compat.v1.get_default_graph()
      if not graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_STEP):
        step, = [v for v in tf.compat.v1.global_variables()
                 if v.op.name == "global_step"]
        graph.add_to_collection(tf.compat.v1.GraphKeys.GLOBAL_STEP, step)
      kwargs.update(checkpoint_dir=logdir, save_summaries_steps=1,
                    save_checkpoint_secs=None, save_checkpoint_steps=None)
    return original(target, is_chief=is_chief, hooks=hooks, **kwargs)

  monkeypatch.setattr(support, "monitored_session", chief_writes_summaries)
  workers = support.make_tf_test_workers(STATS, num_workers=2,
                                         replicas_to_aggregate=2)
  w0, w1 = workers
  try:
    w0.step()
    w1.step()
    support.wait_until(lambda: w1.read()[0] == 1, timeout=20,
                       what="global_step == 1")
    w0.step()
    w1.step()
    support.run_concurrently([(w0.step,), (w1.step,)])
    support.wait_until(lambda: w0.read()[0] == 2, timeout=20,
                       what="global_step == 2")
    # One more chief run after the last update, so its summary sees it.
    w0.read()
    return [w.session.run(w.opt.statistics_tensors) for w in workers]
  finally:
    support.close_all(workers)


def test_tf_scenario_counts_exactly_in_event_files(monkeypatch, tmp_path,
                                                   caplog):
  caplog.set_level(logging.INFO, logger="tensorflow.sync_replicas._stats")
  finals = _tf_scenario(monkeypatch, str(tmp_path))

  for values in finals:  # Each worker's own counters, fetched directly.
    assert values["worker/gradients_pushed"] == 3
    assert values["worker/gradients_dropped_stale"] == 1
    assert values["worker/tokens_taken"] == 3
    assert values["worker/staleness_max"] == 1
    assert values["worker/token_wait_secs"] >= 0

  events = _last_values(str(tmp_path))
  assert events["sync_replicas/cluster/gradients_dropped_stale"] == 2
  assert events["sync_replicas/cluster/gradients_pushed"] == 6
  assert events["sync_replicas/cluster/tokens_taken"] == 6
  assert events["sync_replicas/chief/updates_applied"] == 2
  assert events["sync_replicas/chief/gradients_per_update"] == 2.0
  assert events["sync_replicas/chief/staleness_mean"] == 1.0
  assert events["sync_replicas/chief/gradients_pending"] == 0
  assert events["sync_replicas/worker/gradients_dropped_stale"] == 1
  assert events["sync_replicas/worker/gradients_pushed"] == 3
  assert "sync_replicas/worker/token_wait_secs" in events

  lines = [r.getMessage() for r in caplog.records
           if r.getMessage().startswith("sync_replicas stats:")]
  assert lines, "no statistics line was logged"
  assert any("cluster: pushed=6 dropped_stale=2" in line for line in lines), (
      lines[-3:])


@pytest.mark.parametrize("use_resource", [True, False],
                         ids=["resource", "ref"])
def test_statistics_keep_stock_graph_and_add_only_status_ops(use_resource):
  stock, stock_train = test_graph_parity._build(  # pylint: disable=protected-access
      support.STOCK, use_resource=use_resource, variable_averages=True)
  ours, ours_train = test_graph_parity._build(  # pylint: disable=protected-access
      functools.partial(support.OURS, statistics=True),
      use_resource=use_resource, variable_averages=True)
  assert not sorted(stock - ours)
  extra = sorted(name for name, _, _ in ours - stock)
  assert all(n.startswith("sync_replicas_status/") for n in extra), [
      n for n in extra if not n.startswith("sync_replicas_status/")]
  assert any("/cluster/gradients_dropped_stale" in n for n in extra)
  assert (ours_train.name, ours_train.device) == (stock_train.name,
                                                   stock_train.device)


def test_statistics_off_builds_nothing(graph):
  off, _ = test_graph_parity._build(  # pylint: disable=protected-access
      support.OURS, use_resource=True, variable_averages=False)
  on, _ = test_graph_parity._build(  # pylint: disable=protected-access
      functools.partial(support.OURS, statistics=True), use_resource=True,
      variable_averages=False)
  names = {name for name, _, _ in off}
  assert not [n for n in names if "/cluster/" in n or "/worker/" in n
              or "pre_push" in n or "summaries" in n]
  # Outside our own scope, switching statistics on changes no op.
  outside = lambda ops: {n for n, _, _ in ops  # pylint: disable=g-long-lambda
                         if not n.startswith("sync_replicas_status/")}
  assert outside(off) == outside(on)
  with graph.as_default():
    opt = support.OURS(tf.compat.v1.train.GradientDescentOptimizer(0.1), 1)
    var = tf.compat.v1.Variable(1.0)
    opt.minimize(var * 2.0,
                 global_step=tf.compat.v1.train.get_or_create_global_step())
    assert opt.statistics_tensors == {}
    assert not tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.SUMMARIES)


@pytest.mark.parametrize("bad", [-1, 1.5, True], ids=["negative", "float",
                                                      "bool"])
def test_statistics_log_steps_is_validated(bad):
  with pytest.raises(ValueError, match="statistics_log_steps"):
    support.OURS(tf.compat.v1.train.GradientDescentOptimizer(0.1), 1,
                 statistics=True, statistics_log_steps=bad)
