"""Training ends when the data ends (issue 36), in process.

Workers are threads, each with its own graph and MonitoredSession on a
``LocalCluster`` worker, reading a one-pass ``tf.data`` shard of its own:
the shard's end raises OutOfRangeError, which ends that worker's
MonitoredSession normally. Each gradient also pushes a one-row sparse
gradient into a ``trained`` variable on the ps, summed (not averaged) by
``sparse_reduction="sum"``, with SGD at rate -1: every gradient an applied
update took adds 1 to its worker's cell. So the cells count, from the
updates themselves, which workers' batches were trained.
"""

import contextlib
import io
import json
import logging
import re

import numpy as np
import pytest
import tensorflow as tf

import support
from sync_replicas import _data_end
from sync_replicas import _runner
from sync_replicas import _timeline_writer
from sync_replicas.cli import status as status_tool

#: Bound on a whole job of a few dozen steps on a loaded machine.
JOB_SECS = 120


class _Clusters:
  """One ``support.SharedCluster`` per shape (workers, ps tasks), made on
  its first use and reset before each: with a LocalCluster per job the
  file's process ended with some 9,500 threads (tools/test_durations.json),
  each job's servers kept to the end."""

  def __init__(self):
    self._shared = {}

  def use(self, num_workers, num_ps=1):
    """``SharedCluster.use`` of the cluster of that shape."""
    key = (num_workers, num_ps)
    if key not in self._shared:
      self._shared[key] = support.SharedCluster(num_workers=num_workers,
                                                num_ps=num_ps)
    return self._shared[key].use()


_SHARED = _Clusters()


class ShardWorker:
  """Worker ``task`` trains on ``batches`` batches, then its input ends."""

  def __init__(self, cluster, task, *, workers, batches, replicas=None,
               cls=support.OURS, last_step=None, averages=False,
               **opt_kwargs):
    self.task = task
    self.is_chief = task == 0
    self.target = cluster.worker_targets[task]
    self.graph = tf.Graph()
    self.runs = 0
    self.last_step = last_step
    with self.graph.as_default():
      with tf.compat.v1.device("/job:ps/task:0"):
        self.step = tf.compat.v1.train.get_or_create_global_step()
        self.w = tf.compat.v1.get_variable(
            "w", [2], initializer=tf.zeros_initializer())
        self.trained = tf.compat.v1.get_variable(
            "trained", [workers], initializer=tf.zeros_initializer())
      with tf.compat.v1.device("/job:worker/task:%d" % task):
        data = tf.data.Dataset.range(batches)
        x = tf.cast(tf.compat.v1.data.make_one_shot_iterator(data).get_next(),
                    tf.float32)
        loss = tf.reduce_sum(tf.square(self.w - x))
        grad_w = tf.gradients(loss, self.w)[0]
        # Depends on the batch, so a run whose input ended pushes nothing.
        row = tf.IndexedSlices(tf.reshape(1.0 + 0.0 * x, [1, 1]),
                               tf.constant([task]), tf.constant([workers, 1]))
        opt_kwargs.setdefault("sparse_reduction", "sum")
        if averages:
          opt_kwargs.update(
              variable_averages=tf.train.ExponentialMovingAverage(0.5),
              variables_to_average=[self.w])
        self.opt = cls(tf.compat.v1.train.GradientDescentOptimizer(-1.0),
                       replicas_to_aggregate=replicas or workers,
                       total_num_replicas=workers, **opt_kwargs)
        # Rate -1 on ``w`` too: only ``trained`` matters here.
        self.train_op = self.opt.apply_gradients(
            [(-0.0 * grad_w, self.w),
             (tf.IndexedSlices(tf.reshape(row.values, [1]), row.indices,
                               tf.constant([workers])), self.trained)],
            global_step=self.step)
      self.hooks = [self.opt.make_session_run_hook(self.is_chief)]
      if last_step is not None:
        self.hooks.append(
            tf.compat.v1.train.StopAtStepHook(last_step=last_step))

  def train(self, ready, *, reads=False):
    """Trains until the input ends (or the step limit); returns the runs.
    With ``reads``, also reads the global step in a run of its own before
    each train run, as a script that logs it does."""
    with self.graph.as_default(), support.monitored_session(
        self.target, is_chief=self.is_chief, hooks=self.hooks) as sess:
      if self.is_chief:
        ready.set()
      while not sess.should_stop():
        if reads:
          sess.run(self.step)
        sess.run(self.train_op)
        self.runs += 1
    return self.runs


def _trained(cluster, workers):
  with tf.Graph().as_default():
    with tf.compat.v1.device("/job:ps/task:0"):
      step = tf.compat.v1.train.get_or_create_global_step()
      trained = tf.compat.v1.get_variable("trained", [workers])
    with tf.compat.v1.Session(cluster.worker_targets[0],
                              config=support.session_config()) as sess:
      return sess.run([step, trained])


def _run(shards, *, kept=None, **kwargs):
  """Runs one job; returns (global step, trained per worker, runs).

  ``kept``, a list, gets the cluster and the workers.
  """
  workers = len(shards)
  with _SHARED.use(workers) as cluster:
    per_worker_index = kwargs.pop("per_worker_index", False)
    reads = kwargs.pop("reads", False)
    jobs = [ShardWorker(cluster, t, workers=workers, batches=n,
                        **(dict(kwargs, worker_index=t) if per_worker_index
                           else kwargs))
            for t, n in enumerate(shards)]

    def work(cluster, task, ready):
      del cluster
      jobs[task].train(ready, reads=reads)

    support.run_chief_first(work, cluster, workers, timeout=JOB_SECS)
    step, trained = _trained(cluster, workers)
    if kept is not None:
      kept.extend([cluster, jobs])
    return int(step), trained, [j.runs for j in jobs]


@pytest.mark.parametrize("shards", [(12, 4, 12), (4, 12, 12), (8, 8, 8)],
                         ids=["non_chief_first", "chief_first", "equal"])
def test_every_process_ends_and_every_batch_after_the_start_is_trained(
    shards):
  step, trained, runs = _run(shards)
  assert runs == list(shards), runs
  print("trained", trained, "step", step)
  np.testing.assert_array_equal(trained, shards)


@pytest.mark.parametrize("shards, kwargs, exact", [
    ((8, 3, 8), dict(one_gradient_per_worker=True), True),
    ((8, 3, 8), dict(fuse_dense_gradients=True, statistics=True), True),
    ((9, 3), dict(replicas=3), True),
    ((8, 3, 8), dict(replicas=2), False),
    ((8, 3, 8), dict(min_replicas_to_aggregate=2,
                     aggregation_deadline_secs=30.0), True),
    ((8, 3, 8), dict(averages=True), True),
], ids=["one_gradient_per_worker", "fused_statistics", "multi_batch",
        "backups", "deadline", "variable_averages"])
def test_every_process_ends_with_other_options(shards, kwargs, exact):
  """Backups drop their slowest gradients by design: there only every
  process ending is checked."""
  if kwargs.get("one_gradient_per_worker"):
    kwargs = dict(kwargs, per_worker_index=True)
  _, trained, runs = _run(shards, **kwargs)
  assert runs == list(shards), runs
  if exact:
    np.testing.assert_array_equal(trained, shards)
  else:
    assert np.all(trained <= shards) and trained.sum() > 0, trained


@pytest.mark.parametrize("shards", [(0, 6, 6), (6, 0, 6)],
                         ids=["chief_has_no_data", "a_worker_has_no_data"])
def test_a_shard_of_no_batches_ends_cleanly(shards):
  _, trained, runs = _run(shards)
  assert runs == list(shards), runs
  np.testing.assert_array_equal(trained, shards)


def test_each_worker_logs_one_line_when_its_data_ends(caplog):
  with caplog.at_level("INFO", logger="sync_replicas"):
    _run((6, 2, 6))
  lines = [r.getMessage() for r in caplog.records
           if "its data ended" in r.getMessage()]
  assert len(lines) == 3, lines
  by_worker = {line.split(":")[1].strip(): line for line in lines}
  assert "after 2 train steps; 1 of 3 workers done" in by_worker["worker1"]
  assert "each update now needs 2 gradients" in by_worker["worker1"]
  assert "every worker is done" in "".join(lines), lines


def test_the_data_end_line_counts_train_steps_not_the_scripts_reads(
    caplog):
  """Each worker also reads the global step before every train run: the
  line counts its shard's batches, not every run of its session (it once
  said 49 train steps for a shard of 24)."""
  with caplog.at_level("INFO", logger="sync_replicas"):
    _, trained, _ = _run((6, 2, 6), reads=True)
  np.testing.assert_array_equal(trained, (6, 2, 6))
  lines = [r.getMessage() for r in caplog.records
           if "its data ended" in r.getMessage()]
  by_worker = {line.split(":")[1].strip(): line for line in lines}
  assert sorted(by_worker) == ["worker0", "worker1", "worker2"], lines
  for task, batches in enumerate((6, 2, 6)):
    assert "its data ended after %d train steps;" % batches in (
        by_worker["worker%d" % task]), by_worker


def test_a_step_limit_ends_the_job_as_before(caplog):
  with caplog.at_level("INFO", logger="sync_replicas"):
    step, trained, runs = _run((40, 40, 40), last_step=5)
  assert step >= 5
  assert not [r for r in caplog.records if "its data ended" in r.getMessage()]
  assert all(r < 40 for r in runs), runs


def test_the_chiefs_loop_blocks_as_stocks_until_a_worker_is_done(
    monkeypatch, caplog):
  # Polling cost the small model a third of its updates (tools/bench):
  # until a worker is done every update gets its full count, so the loop
  # runs stock's blocking takes, and polls only once the first worker is
  # done (its blocked take cancelled, the gradients it waited for kept).
  polled = []
  poll = _runner.PollingLoop._poll

  def spy(loop, runner, sess, coord):
    polled.append(int(sess.run(runner.global_step)))
    return poll(loop, runner, sess, coord)

  monkeypatch.setattr(_runner.PollingLoop, "_poll", spy)
  with caplog.at_level("INFO", logger="sync_replicas"):
    _run((40, 40, 40), last_step=5)
  assert polled == []  # Nobody done: never polled.
  with caplog.at_level("INFO", logger="sync_replicas"):
    step, trained, runs = _run((12, 4, 12))
  # Worker 1's fourth batch went into update 3: the switch came after it.
  assert len(polled) == 1 and polled[0] >= 4, polled
  np.testing.assert_array_equal(trained, (12, 4, 12))
  switches = [r for r in caplog.records
              if "leaves its blocked take" in r.getMessage()]
  assert len(switches) == 1, switches


def test_stop_together_ends_every_worker_at_the_first_end(caplog):
  with caplog.at_level("INFO", logger="sync_replicas"):
    step, trained, runs = _run((12, 4, 12), data_end="stop_together")
  # Every update averaged exactly 3 gradients: no batch of worker 1 was
  # left out, and nothing was applied after its end.
  assert trained[1] == 4
  assert sum(trained) == 3 * step, (trained, step)
  assert runs[0] < 12 and runs[2] < 12, runs
  text = "\n".join(r.getMessage() for r in caplog.records)
  assert "every worker stops at global step %d" % step in text, text


def test_stock_policy_builds_nothing_of_it(graph):
  opt = support.OURS(support.sgd(), replicas_to_aggregate=2,
                     data_end="stock")
  step = tf.compat.v1.train.get_or_create_global_step()
  var = tf.compat.v1.get_variable("v", [2])
  opt.apply_gradients([(tf.ones([2]), var)], global_step=step)
  opt.get_init_tokens_op()
  names = [op.name for op in graph.get_operations()]
  assert not [n for n in names if "done" in n or "_count/" in n], names


@pytest.mark.parametrize("kwargs, match", [
    (dict(data_end="bogus"), r"data_end must be one of 'train_all', "
     r"'stop_together', 'stock', got 'bogus'"),
    (dict(data_end="stop_together", prompt_stop=False),
     r"data_end='stop_together' needs prompt_stop=True"),
    (dict(prompt_stop=False), r"data_end='train_all' needs prompt_stop=True"),
], ids=["unknown", "stop_together_without_prompt_stop",
        "default_without_prompt_stop"])
def test_bad_data_end_is_a_clear_error_at_construction(kwargs, match):
  with pytest.raises(ValueError, match=match):
    support.OURS(support.sgd(), replicas_to_aggregate=2, **kwargs)


def _data_end_record(workers, replicas):
  """A ``DataEnd`` built in the default graph, for an in-process session."""
  ends = _data_end.DataEnd(
      _data_end.TRAIN_ALL, replicas_to_aggregate=replicas,
      total_num_replicas=workers,
      tokens_per_step=max(workers, replicas), shared_prefix="counts/")
  local = tf.compat.v1.Variable(0, dtype=tf.int64, name="local")
  ends.build(device="", scope="counts_status/",
             token_queue=tf.queue.FIFOQueue(-1, tf.int64, shapes=()),
             local_step=local)
  return ends


@pytest.mark.parametrize(
    "workers, replicas, first, release_after_one_done, restart_after_one_done",
    [(3, 3, 0, 2, 1), (4, 2, 0, 3, 2), (2, 4, 2, 3, 2)],
    ids=["plain", "backups", "multi_batch"])
def test_token_counts_follow_the_workers_not_done(
    graph, workers, replicas, first, release_after_one_done,
    restart_after_one_done):
  # A white-box check of the two cuts (release, initial fill) that
  # the protocol tests above only see through their timing.
  del graph
  ends = _data_end_record(workers, replicas)
  per_step = max(workers, replicas)
  steps = tf.fill([per_step], tf.constant(7, tf.int64))
  released = ends.release_steps(steps)
  at_zero = tf.fill([per_step], tf.constant(0, tf.int64))
  # The job's first start (the ps's first, at global step 0) is cut; a
  # restarted chief's, and a first start on a ps at a restored global step
  # (a ps restarted under a living chief, a resumed job), are not: its
  # init clears the accumulators, and a worker whose push it ate needs a
  # token.
  initial = [ends.initial_steps(at_zero, starts=tf.constant(1)),
             ends.initial_steps(at_zero, starts=tf.constant(2)),
             ends.initial_steps(steps, starts=tf.constant(1))]
  # A restarted chief's fill of stock's count (get_init_tokens_op's -1:
  # replicas_to_aggregate) stays stock's while no worker is done or gone;
  # after that it is what the live workers but the chief lack (their
  # release less the chief's first push, which needs no token), and what
  # every live worker lacks once the chief's own input ended (``ends`` is
  # the chief's: its key is the one ``announce`` records).
  restart = ends.initial_steps(tf.fill([replicas], tf.constant(7, tf.int64)),
                               starts=tf.constant(2))
  with tf.compat.v1.Session() as sess:
    assert len(sess.run(released)) == per_step
    assert [len(x) for x in sess.run(initial)] == [first, per_step,
                                                   per_step]
    assert len(sess.run(restart)) == replicas
    ends.gone_marks.declare(sess, 99)  # Another worker, gone.
    assert len(sess.run(released)) == release_after_one_done
    assert ends.need(1) == min(replicas, per_step - 1)
    assert len(sess.run(restart)) == restart_after_one_done
    assert ends.announce(sess, batches=5) == 2
    assert ends.announce(sess, batches=5) == 2, "a second announce counts"
    assert len(sess.run(released)) == release_after_one_done - 1
    assert len(sess.run(restart)) == min(replicas, per_step - 2)


def _supervised_train(job, ready):
  """The TF 0.12 Supervisor recipe, ending with ``announce_data_end``."""
  opt = job.opt
  with job.graph.as_default():
    init_tokens = opt.get_init_tokens_op() if job.is_chief else None
    sv = tf.compat.v1.train.Supervisor(
        is_chief=job.is_chief, logdir=None,
        init_op=tf.compat.v1.global_variables_initializer(),
        local_init_op=(opt.chief_init_op if job.is_chief
                       else opt.local_step_init_op),
        ready_for_local_init_op=opt.ready_for_local_init_op,
        recovery_wait_secs=0.2, global_step=job.step, save_model_secs=0,
        save_summaries_secs=0, stop_grace_secs=5)
    sess = sv.prepare_or_wait_for_session(
        job.target, config=support.session_config(), max_wait_secs=60)
    if job.is_chief:
      sv.start_queue_runners(sess, [opt.get_chief_queue_runner()])
      sess.run(init_tokens)
      ready.set()
    try:
      while not sv.should_stop():
        sess.run(job.train_op)
        job.runs += 1
    except tf.errors.OutOfRangeError:
      opt.announce_data_end(sess, batches=job.runs)
    sv.stop()


@pytest.mark.parametrize("shards", [(8, 3, 8), (3, 8, 8)],
                         ids=["non_chief_first", "chief_first"])
def test_a_supervisor_loop_announces_its_end_with_one_call(shards):
  workers = len(shards)
  with _SHARED.use(workers) as cluster:
    jobs = [ShardWorker(cluster, t, workers=workers, batches=n)
            for t, n in enumerate(shards)]

    def work(cluster, task, ready):
      del cluster
      _supervised_train(jobs[task], ready)

    support.run_chief_first(work, cluster, workers, timeout=JOB_SECS)
    _, trained = _trained(cluster, workers)
    assert [j.runs for j in jobs] == list(shards)
    np.testing.assert_array_equal(trained, shards)


def test_statistics_count_the_workers_done():
  kept = []
  _run((4, 2, 4), statistics=True, statistics_log_steps=None, kept=kept)
  cluster, jobs = kept
  chief = jobs[0]
  with chief.graph.as_default(), tf.compat.v1.Session(
      cluster.worker_targets[0], config=support.session_config()) as sess:
    done = sess.run(chief.opt.statistics_tensors["chief/workers_done"])
  assert done == 3


@pytest.mark.parametrize("crash", [False, True], ids=["input_ends", "crash"])
def test_a_worker_that_crashes_is_not_done(crash):
  """MonitoredSession calls the hooks' end() only on a normal end: a run
  that fails otherwise leaves the worker not done, for recovery."""
  with _SHARED.use(1) as cluster:
    job = ShardWorker(cluster, 0, workers=1, batches=3, statistics=True,
                      statistics_log_steps=None)
    with pytest.raises(RuntimeError, match="crash") if crash else (
        contextlib.nullcontext()):
      with job.graph.as_default(), support.monitored_session(
          job.target, is_chief=True, hooks=job.hooks) as sess:
        while not sess.should_stop():
          sess.run(job.train_op)
          job.runs += 1
          if crash and job.runs == 2:
            raise RuntimeError("crash")
    with job.graph.as_default(), tf.compat.v1.Session(
        job.target, config=support.session_config()) as sess:
      done = sess.run(job.opt.statistics_tensors["chief/workers_done"])
    assert done == (0 if crash else 1)


def test_the_timeline_records_a_job_that_ends_with_its_data(tmp_path):
  step, trained, runs = _run((6, 2, 6), timeline_dir=str(tmp_path))
  _timeline_writer.close_all()
  assert runs == [6, 2, 6]
  np.testing.assert_array_equal(trained, [6, 2, 6])

  def records(name, kind):
    lines = (tmp_path / name).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]

  # One step record per train step that returned (the run the input ended
  # in trained nothing), and one update record per update the chief applied
  # (each file also opens with its process's start record).
  assert [len(records("worker%d.worker.jsonl" % t, "step"))
          for t in range(3)] == runs
  assert len(records("worker0.chief.jsonl", "update")) == step


def test_the_status_tool_says_which_workers_are_done(tmp_path):
  kept = []
  _run((4, 2, 4), kept=kept)
  cluster, jobs = kept
  path = jobs[0].opt.write_sync_manifest(str(tmp_path))
  out = io.StringIO()
  code = status_tool.main(
      ["--manifest", path, "--ps", cluster.cluster_spec.job_tasks("ps")[0]],
      out=out)
  text = out.getvalue()
  assert code == 0, text
  assert ("data end: 3 of 3 workers done, their input ended: worker0, worker1, "
          "worker2"
          in text), text


def _step_then_end_the_last(sessions, jobs):
  """Every worker trains one step together; then the last one's input
  ends, a normal end of its session, whose hook records it done."""
  support.run_concurrently([(s.run, j.train_op)
                            for s, j in zip(sessions, jobs, strict=True)])
  with pytest.raises(tf.errors.OutOfRangeError):
    sessions[-1].run(jobs[-1].train_op)
  sessions[-1].close()


@contextlib.contextmanager
def _stalled_by_worker1(caplog, open_session):
  """Three workers on the shared cluster, their sessions from
  ``open_session(job)``, one train run each, then worker 2's input ends;
  the chief's next run waits for worker 1, which stops pushing without
  ending (as a crashed worker would). Yields while the chief waits, its
  stall lines (every 0.3 s) in ``caplog``; then worker 1 is back: the
  update lands and the chief's run returns."""
  with _SHARED.use(3) as cluster:
    jobs = [ShardWorker(cluster, t, workers=3, batches=n, stall_log_secs=0.3)
            for t, n in enumerate((5, 5, 1))]
    sessions, chief = [], None
    caplog.set_level(logging.WARNING, logger="sync_replicas")
    try:
      for job in jobs:
        with job.graph.as_default():
          sessions.append(open_session(job))
      _step_then_end_the_last(sessions, jobs)
      chief = support.BoundedThread(sessions[0].run, jobs[0].train_op,
                                    name="chief-step")
      chief.start()
      yield
    finally:
      if chief is not None:
        sessions[1].run(jobs[1].train_op)
        chief.finish(timeout=30)
      for sess in reversed(sessions[:2]):
        sess.close()


def test_the_stall_line_names_the_workers_done(caplog):
  """Worker 2's input ends, worker 1 stops pushing without ending: the
  update waits for it, and the stall line says that only worker 2 is
  done."""
  with _stalled_by_worker1(caplog, lambda job: support.monitored_session(
      job.target, is_chief=job.is_chief, hooks=job.hooks)):
    # A line logged before the chief's push landed says "w 0/2": wait
    # for one with it in (seen once at load 8-9).
    lines = lambda: [
        r.getMessage() for r in caplog.records
        if "1 of 3 workers done, their input ended: worker2" in
        r.getMessage() and re.search(r"\bw 1/\d", r.getMessage())]
    support.wait_until(lines, timeout=30, what=(
        "a stall line naming worker 2 done, the chief's gradient in"))
    assert "w 1/2" in lines()[-1], lines()  # min(R=3, 3 - 1 done) = 2.


class _AbortWhenAsked(tf.compat.v1.train.SessionRunHook):
  """Raises AbortedError before the next run once ``ask()`` was called, as
  a run whose ps restarted does: MonitoredSession then creates the session
  again and runs it there. Listed after the optimizer's hook, whose
  ``before_run`` then saw a run begin that did not return (as when the
  run itself raised): the chief's runner keeps the token queue open."""

  def __init__(self):
    self._asked = self.raised = False

  def ask(self):
    self._asked = True

  def before_run(self, run_context):
    del run_context
    if self._asked and not self.raised:
      self.raised = True
      raise tf.errors.AbortedError(None, None, "a ps restarted (test)")


def _forget_the_workers_done(target, shared_name="sync_replicas_done"):
  """Empties the done record on the ps, as a restart of its task would;
  returns its size afterwards."""
  with tf.Graph().as_default():
    with tf.compat.v1.device("/job:ps/task:0"):
      table = tf.raw_ops.MutableHashTableV2(
          shared_name=shared_name, use_node_name_sharing=False,
          key_dtype=tf.int64, value_dtype=tf.int64)
      keys, _ = tf.raw_ops.LookupTableExportV2(
          table_handle=table, Tkeys=tf.int64, Tvalues=tf.int64)
      with tf.control_dependencies([tf.raw_ops.LookupTableRemoveV2(
          table_handle=table, keys=keys)]):
        size = tf.raw_ops.LookupTableSizeV2(table_handle=table)
    with tf.compat.v1.Session(target, config=support.session_config()) as s:
      return int(s.run(size))


@contextlib.contextmanager
def _pending_gradients(target):
  """A callable: the fresh gradients ``w``'s accumulator holds (stock's
  shared name, ours too), read from a graph of the test's own."""
  graph = tf.Graph()
  with graph.as_default(), tf.compat.v1.device("/job:ps/task:0"):
    count = tf.compat.v1.ConditionalAccumulator(
        tf.float32, shape=[2], shared_name="w:0/grad_accum").num_accumulated()
  with tf.compat.v1.Session(target, graph=graph,
                            config=support.session_config()) as sess:
    yield lambda: int(sess.run(count))


def _run_in_graph(job, session):
  """One train run of ``job`` in ``session`` (a recovery builds a Scaffold
  in the job's graph)."""
  with job.graph.as_default():
    return session.run(job.train_op)


def test_the_chief_puts_back_the_workers_done_that_a_ps_forgot(caplog):
  """Worker 2's input ends; the record on the ps is then emptied, as a
  restart of its task does. The chief's next session (MonitoredSession
  recovering) puts worker 2 back before its first token, so an update needs
  2 gradients again: without that, it would wait for worker 2's for good."""
  with _SHARED.use(3) as cluster:
    jobs = [ShardWorker(cluster, t, workers=3, batches=n)
            for t, n in enumerate((20, 20, 1))]
    abort = _AbortWhenAsked()
    jobs[0].hooks.append(abort)
    runner = jobs[0].opt.get_chief_queue_runner()
    caplog.set_level(logging.INFO, logger="sync_replicas")
    sessions = []
    try:
      for job in jobs:
        with job.graph.as_default():
          sessions.append(support.monitored_session(
              job.target, is_chief=job.is_chief, hooks=job.hooks))
      _step_then_end_the_last(sessions, jobs)
      # The chief's loop sees the count grow and remembers the key.
      support.wait_until(lambda: runner.data_end.seen_done() == {2: 1},
                         timeout=30, what="the chief to see worker 2 done")
      assert _forget_the_workers_done(jobs[0].target) == 0
      abort.ask()
      # Worker 1 pushes (at a step of the chief's previous generation, which
      # the recovered chief's init clears) and waits in its dequeue, as the
      # survivors of a restart do, for the one initial token it lacks.
      stale = support.BoundedThread(sessions[1].run, jobs[1].train_op,
                                    name="worker1-stale")
      stale.start()
      with _pending_gradients(jobs[1].target) as pending:
        support.wait_until(lambda: pending() == 1, timeout=30,
                           what="worker 1's push before the chief's recovery")
      # The chief's run aborts; the recovered session runs it: a fresh push
      # (the chief's local step is of its new generation), then it waits for
      # the update's release.
      chief = support.BoundedThread(_run_in_graph, jobs[0], sessions[0],
                                    name="chief-recovered")
      chief.start()
      stale.finish()
      assert abort.raised
      assert any("put back worker2" in r.getMessage() for r in caplog.records)
      assert runner.data_end.seen_done() == {2: 1}
      # The recovered session initialized the model again (no checkpoint),
      # as after a real ps restart without one: global step 0. Worker 1's
      # token is of the new generation: with worker 2 put back, its push
      # completes the update (2 of 2 needed), which averages its and the
      # chief's.
      support.run_concurrently([(sessions[1].run, jobs[1].train_op)])
      chief.finish()
      support.wait_until(lambda: _trained(cluster, 3)[0] == 1, timeout=30,
                         what="an update of 2 gradients")
      np.testing.assert_array_equal(_trained(cluster, 3)[1], [1, 1, 0])
    finally:
      for sess in sessions[:2]:
        sess.close()


def test_the_stall_line_lists_every_worker_that_device_filters_hide(caplog):
  """Each worker's session sees only the ps and itself (README's
  device_filters), so the chief cannot read the others' local steps from
  their tasks. The stall line still names every worker's, from the record
  on the ps that each train run writes, and which are done: worker 2's
  input ended, worker 1 stops pushing without ending (as a crashed worker
  would) and keeps its last step."""

  def filtered_session(job):
    config = support.session_config()
    config.device_filters.extend(
        ["/job:ps", "/job:worker/task:%d" % job.task])
    return tf.compat.v1.train.MonitoredTrainingSession(
        master=job.target, is_chief=job.is_chief, hooks=job.hooks,
        config=config, stop_grace_period_secs=1, save_summaries_steps=None,
        save_summaries_secs=None, log_step_count_steps=None)

  with _stalled_by_worker1(caplog, filtered_session):
    # Every worker took the token of step 1 (its local step) in its one
    # train run; the chief's second run waits for its next token.
    expected = "workers' local steps: worker0 1, worker1 1, worker2 1 (done)"
    support.wait_until(
        lambda: any(expected in r.getMessage() for r in caplog.records),
        timeout=30, what="a stall line naming every worker")


class _TwoPsWorker:
  """A worker whose first gradient does not depend on its input: ``trained``
  (on ps 1, summed, rate -1: each applied gradient adds 1 to its worker's
  cell) gets a constant, ``w`` (on ps 0, with the global step) one of the
  batch. A run whose input ended computes the first and not the second."""

  def __init__(self, cluster, task, *, workers, batches):
    self.task, self.runs = task, 0
    self.target = cluster.worker_targets[task]
    self.graph = tf.Graph()
    with self.graph.as_default():
      with tf.compat.v1.device("/job:ps/task:0"):
        step = tf.compat.v1.train.get_or_create_global_step()
        w = tf.compat.v1.get_variable(
            "w", [2], initializer=tf.zeros_initializer())
      with tf.compat.v1.device("/job:ps/task:1"):
        trained = tf.compat.v1.get_variable(
            "trained", [workers], initializer=tf.zeros_initializer())
      with tf.compat.v1.device("/job:worker/task:%d" % task):
        data = tf.data.Dataset.range(batches)
        x = tf.cast(tf.compat.v1.data.make_one_shot_iterator(data).get_next(),
                    tf.float32)
        opt = support.OURS(tf.compat.v1.train.GradientDescentOptimizer(-1.0),
                           replicas_to_aggregate=workers,
                           total_num_replicas=workers,
                           sparse_reduction="sum")
        self.train_op = opt.apply_gradients(
            [(tf.IndexedSlices(tf.constant([1.0]), tf.constant([task]),
                               tf.constant([workers])), trained),
             (0.0 * x + tf.zeros([2]), w)],
            global_step=step)
      self.hooks = [opt.make_session_run_hook(task == 0)]

  def train(self, ready):
    with self.graph.as_default(), support.monitored_session(
        self.target, is_chief=self.task == 0, hooks=self.hooks) as sess:
      if self.task == 0:
        ready.set()
      while not sess.should_stop():
        sess.run(self.train_op)
        self.runs += 1


def test_a_run_whose_input_ended_pushes_no_gradient():
  """The hang at 16 workers and 2 ps (tests/test_recovery.py): a worker's
  last run, whose input ended, pushed ``trained``'s gradient and not
  ``w``'s; ``trained``'s take then completed alone (in the cancelled take
  of the chief's blocking loop, or in an update the chief's count of
  ``trained`` released) and every later push to it was stale: the job
  waited until the op timeout. Now no push runs before every gradient of
  the run is computed: every process ends, and ``trained`` counts exactly
  the batches of each worker. Workers with no data fail without the gate
  (a hang, or cells counting runs that never trained)."""
  shards = (8, 0, 3, 0)
  workers = len(shards)
  with _SHARED.use(workers, num_ps=2) as cluster:
    jobs = [_TwoPsWorker(cluster, t, workers=workers, batches=n)
            for t, n in enumerate(shards)]
    support.run_chief_first(lambda cluster, task, ready: jobs[task].train(ready),
                            cluster, workers, timeout=JOB_SECS)
    assert [j.runs for j in jobs] == list(shards)
    with tf.Graph().as_default():
      with tf.compat.v1.device("/job:ps/task:1"):
        trained = tf.compat.v1.get_variable("trained", [workers])
      with tf.compat.v1.Session(cluster.worker_targets[0],
                                config=support.session_config()) as sess:
        np.testing.assert_array_equal(sess.run(trained), shards)


_PUSH_TYPES = {"ResourceAccumulatorApplyGradient", "AccumulatorApplyGradient",
               "SparseAccumulatorApplyGradient"}


def _push_gates(model, **options):
  """What holds every training push that ``model()`` (returning the loss, in
  a two-ps graph) gets from our optimizer: {push name: sorted list of the
  gates among its ancestors, each as the sorted types of what it groups}."""
  with tf.Graph().as_default() as graph:
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        ps_tasks=2, worker_device="/job:worker/task:0")):
      step = tf.compat.v1.train.get_or_create_global_step()
      loss = model()
      opt = support.OURS(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                         replicas_to_aggregate=2, total_num_replicas=2,
                         **options)
      opt.minimize(loss, global_step=step)
  gates = {}
  for op in graph.get_operations():
    # The status tool's drain pushes are not a run's.
    if op.type not in _PUSH_TYPES or "drain_push" in op.name:
      continue
    found, seen, stack = [], set(), [op]
    while stack:
      node = stack.pop()
      if node.name in seen:
        continue
      seen.add(node.name)
      if node.type == "NoOp" and node.name.rsplit("/", 1)[-1].startswith(
          ("input_read", "gradients_computed")):
        found.append(sorted(c.type for c in node.control_inputs))
        continue
      stack.extend(t.op for t in node.inputs)
      stack.extend(node.control_inputs)
    gates[op.name] = sorted(found)
  assert gates, "no push in the graph"
  return gates


def _two_variables(x):
  w = tf.compat.v1.get_variable("w", [3], initializer=tf.ones_initializer())
  b = tf.compat.v1.get_variable("b", [3], initializer=tf.ones_initializer())
  # b's gradient does not depend on the input: the run whose input ended
  # computes it, and only the gate keeps it from being pushed.
  return tf.reduce_sum(w * x) + tf.reduce_sum(b * b)


def test_every_push_waits_for_the_runs_input_and_nothing_else():
  """The gate is the run's input op: it runs first in a step, so no push
  waits for the backward pass (the gate on every gradient cost up to 45% of
  the updates of tools/bench's many model); a graph without an input op
  has no gate, and one with control flow on the way keeps the whole group."""
  def from_dataset():
    data = tf.data.Dataset.from_tensors(tf.ones([3])).repeat(4)
    return _two_variables(
        tf.compat.v1.data.make_one_shot_iterator(data).get_next())

  def from_queue():
    queue = tf.queue.FIFOQueue(4, [tf.float32], shapes=[[3]])
    return _two_variables(queue.dequeue())

  def fed():
    return _two_variables(tf.compat.v1.placeholder_with_default(
        tf.ones([3]), [3]))

  def through_cond():
    x = tf.compat.v1.placeholder_with_default(tf.ones([3]), [3])
    data = tf.data.Dataset.from_tensors(tf.ones([3])).repeat(4)
    read = tf.compat.v1.data.make_one_shot_iterator(data).get_next()
    return _two_variables(tf.cond(tf.reduce_sum(x) > 0, lambda: read * 2.0,
                                  lambda: read))

  for model, gate, options in (
      (from_dataset, ["IteratorGetNext"], {}),
      (from_dataset, ["IteratorGetNext"], {"fuse_dense_gradients": True}),
      (from_queue, ["QueueDequeueV2"], {})):
    gates = _push_gates(model, **options)
    assert set(map(str, gates.values())) == {str([gate])}, (model, gates)
  assert set(map(str, _push_gates(fed).values())) == {"[]"}
  # Control flow: the gate groups every gradient (w's and b's).
  cond_gates = _push_gates(through_cond)
  assert all(len(g) == 1 and len(g[0]) == 2 for g in cond_gates.values()), (
      cond_gates)
  # data_end="stock" builds no gate, as stock.
  stock = _push_gates(from_dataset, data_end="stock")
  assert set(map(str, stock.values())) == {"[]"}
