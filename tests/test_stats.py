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
import sync_replicas
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


def _device(op):
  """Where ``op`` runs: an op on a resource runs beside it (the placer's
  rule), so a read of a worker's local step is on the worker."""
  for t in op.inputs:
    if t.dtype == tf.resource:
      return _device(t.op)
  return op.device.split("/device:")[0]


def _cross_device_hops(graph):
  """Each op's most device changes along a path from a root (data or
  control edges): 2 for a push fed by a gradient computed on the worker
  from a variable read on the ps."""
  hops = {}
  for op in graph.get_operations():  # Built in topological order.
    hops[op] = max([hops[i] + (_device(i) != _device(op))
                    for i in [t.op for t in op.inputs] + op.control_inputs],
                   default=0)
  return hops


def _pushes_and_dequeue(graph):
  return [op for op in graph.get_operations()
          if "ApplyGradient" in op.type or op.type == "QueueDequeueV2"]


def _waited_for(ops):
  """Every op that ``ops`` wait for, through data and control edges."""
  waits, todo = set(), list(ops)
  while todo:
    op = todo.pop()
    for i in [t.op for t in op.inputs] + op.control_inputs:
      if i not in waits:
        waits.add(i)
        todo.append(i)
  return waits


@pytest.mark.parametrize("options", [
    {}, dict(fuse_dense_gradients=True), dict(pack_gradient_transfers=False),
    dict(one_gradient_per_worker=True, worker_index=1)],
                         ids=["packed", "fused", "unpacked", "per_worker"])
def test_statistics_add_no_round_trip_before_pushes_or_dequeue(options):
  """Issue 31: the counting runs inside the round trips the protocol makes.
  With statistics on, no push and no token dequeue is further from the
  step's start, in device changes, than with statistics off, and none waits
  for an op of ours on the worker that itself waited for the ps."""
  def built(**more):
    graph, _ = test_graph_parity._build_graph(  # pylint: disable=protected-access
        functools.partial(support.OURS, **options, **more),
        use_resource=True, variable_averages=False)
    hops = _cross_device_hops(graph)
    return graph, {op.name: hops[op] for op in _pushes_and_dequeue(graph)}

  _, off = built()
  graph, on = built(statistics=True)
  assert on == off
  hops = _cross_device_hops(graph)
  waits = _waited_for(_pushes_and_dequeue(graph))
  ours_on_worker_after_ps = sorted(
      op.name for op in waits if op.name.startswith("sync_replicas_status/")
      and "/job:worker" in _device(op) and hops[op] > 0
      and "packed_transfers/" not in op.name)  # The gradients' own packing.
  assert not ours_on_worker_after_ps


def _transfers(graph, train_op):
  """What a run of ``train_op`` moves between tasks: each (tensor or control
  edge, destination task) once, as TensorFlow sends a tensor once per
  device that needs it."""
  element = graph.as_graph_element(train_op)
  root = getattr(element, "op", element)
  seen = {root} | _waited_for([root])
  moved = set()
  for op in seen:
    for t in op.inputs:
      if _device(t.op) != _device(op):
        moved.add((t.name, _device(op)))
    for c in op.control_inputs:
      if _device(c) != _device(op):
        moved.add(("^" + c.name, _device(op)))
  return moved


@pytest.mark.parametrize("options", [
    {}, dict(fuse_dense_gradients=True), dict(pack_gradient_transfers=False),
    dict(one_gradient_per_worker=True, worker_index=1)],
                         ids=["packed", "fused", "unpacked", "per_worker"])
def test_statistics_add_no_transfer_to_the_worker(options):
  """Issue 31: the token and the worker's counts come back as one tensor,
  which replaces the token's own transfer, so the worker sends and receives
  as many tensors with statistics on as off. The one transfer statistics
  add is between ps tasks: the pushes on the other ps task (this model has
  two) wait for the global step's read on its own, one control edge (a
  counted drop is certain only for a push that followed the read)."""
  def moved(**more):
    graph, train_op = test_graph_parity._build_graph(  # pylint: disable=protected-access
        functools.partial(support.OURS, **options, **more),
        use_resource=True, variable_averages=False)
    return _transfers(graph, train_op)

  off, on = moved(), moved(statistics=True)
  worker = "/job:worker/task:1"
  assert [to for _, to in off - on] == [worker], sorted(off - on)
  assert sorted(on - off) == [
      ("^sync_replicas_status/with_generation", "/job:ps/task:1"),
      ("sync_replicas_status/token_and_counts:0", worker)], sorted(on - off)


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


def _chief(cluster):
  """A one-replica chief with statistics, in a graph of its own (as a
  restarted process builds)."""
  return support.LinearWorker(
      support.OURS, cluster, 0, replicas=1, total=1,
      opt_kwargs=dict(statistics=True, statistics_log_steps=None,
                      stall_log_secs=None))


def _wait_for_updates(sess, chief, count):
  updates = chief.opt.statistics_tensors["chief/updates_applied"]
  support.wait_until(lambda: sess.run(updates) >= count, timeout=20,
                     what="%d updates counted" % count)


def test_cluster_counters_survive_a_chief_restart():
  """The cluster counters live on the ps and the chief's init keeps what is
  there (docs/operations.md): a chief that dies and starts again, running
  every init from scratch (no checkpoint), counts on from the dead chief's
  figures, while a replica's own counters start again at zero."""
  cluster = sync_replicas.LocalCluster(num_workers=1, num_ps=1)
  first = _chief(cluster)
  with first.graph.as_default():
    init = [tf.compat.v1.global_variables_initializer(),
            tf.compat.v1.local_variables_initializer()]
    init_tokens = first.opt.get_init_tokens_op()
  sess = tf.compat.v1.Session(first.target, graph=first.graph,
                              config=support.session_config())
  sess.run(init)
  sess.run(first.opt.chief_init_op)
  sess.run(init_tokens)
  coord = tf.compat.v1.train.Coordinator()
  threads = first.opt.get_chief_queue_runner().create_threads(
      sess, coord=coord, daemon=True, start=True)
  for _ in range(3):
    sess.run(first.train_op)
  # (Which pushes are stale and how many updates follow depends on when
  # each update lands: one replica aggregates alone.)
  _wait_for_updates(sess, first, 1)
  before = sess.run(first.opt.statistics_tensors)
  # The chief dies: its session goes without a stop request, so the token
  # queue stays open, and its sync loop follows its session.
  sess.close()
  for t in threads:
    t.join(timeout=20)
    assert not t.is_alive(), "the dead chief's thread %s still runs" % t.name

  second = _chief(cluster)
  with second.session() as restarted:
    for _ in range(2):
      restarted.run(second.train_op)
    _wait_for_updates(restarted, second, before["chief/updates_applied"] + 1)
    after = restarted.run(second.opt.statistics_tensors)
  assert (before["cluster/gradients_pushed"],
          before["cluster/tokens_taken"]) == (3, 3), before
  assert after["worker/gradients_pushed"] == 2, after  # The new replica's.
  assert after["cluster/gradients_pushed"] == 3 + 2, after
  assert after["cluster/tokens_taken"] == 3 + 2, after
  assert after["cluster/gradients_dropped_stale"] >= before[
      "cluster/gradients_dropped_stale"], (before, after)
  assert after["chief/updates_applied"] > before["chief/updates_applied"], (
      before, after)


class _RecordingSession:
  """Stands for the session a hook's run context carries: records each run
  the hook makes of its own, and answers zeros."""

  def __init__(self):
    self.runs = []

  def run(self, fetches):
    if not isinstance(fetches, dict):
      return None  # The local init op; and no name is uninitialized.
    self.runs.append(sorted(fetches))
    return {k: 0 for k in fetches}


def test_the_log_line_reads_the_statistics_in_a_run_of_its_own(graph,
                                                               caplog):
  """A training run never carries the statistics: added to its fetches they
  made a new signature, the whole graph set up again on every task, which
  cost 4-9% of the small model's steps in a bench window (0.98 of off's
  steps/s without the log line, 0.89-0.94 with it). The hook reads them
  after every statistics_log_steps-th run, in a run of their own, whose
  signature it sets up once when the session is created."""
  with graph.as_default():
    gs = tf.compat.v1.train.get_or_create_global_step()
    var = tf.compat.v1.Variable(1.0, use_resource=True)
    opt = support.OURS(tf.compat.v1.train.GradientDescentOptimizer(0.1), 1,
                       statistics=True, statistics_log_steps=2)
    train_op = opt.minimize(var * 2.0, global_step=gs)
    hook = opt.make_session_run_hook(is_chief=False)
    hook.begin()
  session = _RecordingSession()
  context = tf.compat.v1.train.SessionRunContext(
      tf.compat.v1.train.SessionRunArgs(train_op), session)
  values = tf.compat.v1.train.SessionRunValues(None, None, None)
  caplog.set_level(logging.INFO)
  hook.after_create_session(session, coord=None)
  stats = set(opt.statistics_tensors.values())
  added = []
  for _ in range(5):
    args = hook.before_run(context)
    # What a training run carries is the same on every run (one signature,
    # set up once): with data_end's default only the op that records the
    # worker's local step on the ps (issue 36), never a statistic.
    added.append(None if args is None else sorted(args.fetches))
    assert args is None or not stats & set(args.fetches.values())
    hook.after_run(context, values)
  assert len(set(map(repr, added))) == 1, added
  # A non-chief reads its own counters only: worker-local, no ps to wait
  # for.
  own = sorted(k for k in opt.statistics_tensors if k.startswith("worker/"))
  assert len(own) == 6 and session.runs == [own] * 3
  assert [r.getMessage() for r in caplog.records
          if "sync_replicas stats:" in r.getMessage()] == [
              "sync_replicas stats: worker: pushed=0 dropped_stale=0 tokens=0 "
              "token_wait=0.000s (last 0.000s) max_staleness=0"] * 2


@pytest.mark.parametrize("data_end", ["train_all", "stock"])
def test_the_log_line_comes_every_n_train_steps_not_every_n_runs(
    data_end, caplog):
  """statistics_log_steps counts train runs (fetches that reach the train
  op), the hook's one rule for a step: a script that reads the global step
  between its train runs logs after train steps 2, 4 and 6, where counting
  every run logged six lines, after each step. With data_end="stock" too,
  which records no local step."""
  server = tf.distribute.Server.create_local_server()
  with tf.Graph().as_default():
    gs = tf.compat.v1.train.get_or_create_global_step()
    var = tf.compat.v1.Variable(1.0, use_resource=True)
    opt = support.OURS(tf.compat.v1.train.GradientDescentOptimizer(0.1), 1,
                       statistics=True, statistics_log_steps=2,
                       data_end=data_end)
    train_op = opt.minimize(var * 2.0, global_step=gs)
    caplog.set_level(logging.INFO)
    with support.monitored_session(
        server.target, is_chief=True,
        hooks=[opt.make_session_run_hook(is_chief=True)]) as sess:
      for _ in range(6):
        sess.run(train_op)
        sess.run(gs)  # The script's own read: not a step.
  pushed = [r.getMessage().split("pushed=")[1].split()[0]
            for r in caplog.records
            if "sync_replicas stats:" in r.getMessage()]
  assert pushed == ["2", "4", "6"], pushed
