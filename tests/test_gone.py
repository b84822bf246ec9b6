"""A worker lost for good, with ``worker_gone_secs`` (issue 44): real processes.

ps and workers are separate OS processes on 127.0.0.1 (``crash_task.py``,
``test_recovery.Job``): 1 ps, 3 workers, ``replicas_to_aggregate =
total_num_replicas = 3``. Everything is counted from the applied updates, on
the ps: each gradient applied at step s by worker t lands in cell (s, t) of
``trace`` (``R / k`` for an update of k gradients), so a row's non-zero cells
are the workers whose fresh gradient that update averaged; and adds 1 to
cell (g, s, t) of ``pushes`` (g: the restart generation it was pushed in),
so a row there says how many gradients of each worker that update took: a
survivor's two pushes for one update are a 2 there, where ``trace`` shows
them as one non-zero cell.
"""

import logging
import os
import re
import signal
import socket
import time
import types

import numpy as np
import pytest
import tensorflow as tf

import support
import sync_replicas
import test_data_end_protocol
import test_lost
import test_recovery
from sync_replicas import _diagnose
from sync_replicas import _gone
from sync_replicas import _lost
from sync_replicas import _ports

#: worker_gone_secs in these tests.
GONE_SECS = 2.0
#: What "a few seconds" past it may take on the shared 2-core machine: the
#: probe (at most 2 s connect plus a bounded read), the loop's switch to
#: polling, and the next update.
SLACK_SECS = 15.0
#: README's program's workers sleep this before each run in the test of
#: its ending (tests/lost_task.py's ``pause_secs``) ...
PAUSE_SECS = 0.05
#: ... so that its step limit lies at least this long past the kill: far
#: past worker_gone_secs and the probe, on a loaded machine too.
README_PAUSED_SECS = 12.0
#: Updates after a declaration that may still take a survivor's second
#: push: the token released for the lost worker before its mark (the
#: release before the declaration's look, and one in flight with it),
#: used up by one push each, counted in an update or stale.
TRANSIENT = 3
#: Restart generations that ``pushes`` keeps apart (later ones share the
#: last): the first chief's, and its restart with a recovered session or two.
GENERATIONS = 4


def _start(job):
  job.start("ps", 0)
  job.start("worker", 0)
  job.wait_ready("worker", 0)
  for task in range(1, job.workers):
    job.start("worker", task)
  for task in range(1, job.workers):
    job.wait_ready("worker", task)


def _running_job(gone_job, last_step):
  """1 ps and 3 workers, all up before any of them trains."""
  job = gone_job(last_step=last_step, delay=0.02)
  job.hold()  # Nobody trains before all three are up.
  _start(job)
  job.release()
  return job


def _lines(job, words):
  return [line for line in job.log("worker", 0).splitlines() if words in line]


def _wait_for_line(job, words, what, timeout):
  support.wait_until(lambda: _lines(job, words), timeout=timeout,
                     what="the chief's line " + what, interval=0.1)


def _gradients_per_update(job, until):
  """Row s: which workers' gradients the update to step s + 1 averaged."""
  return job.read_when_up("trace")[:until] != 0


def _not_one_of_each(pushes, live):
  """``[((generation, step), [gradients of each worker])]`` of the updates
  in ``pushes`` (``{(generation, step): row of job's pushes}``) that did not
  take exactly one gradient of each worker in ``live``, none of another's."""
  want = np.zeros(3)
  want[list(live)] = 1
  return [(at, row.astype(int).tolist()) for at, row in sorted(pushes.items())
          if not np.array_equal(row, want)]


def _finish(job, tasks, timeout=150):
  deadline = time.monotonic() + timeout
  for task in tasks:
    proc = job.procs[("worker", task)]
    proc.wait(timeout=max(deadline - time.monotonic(), 1))
    assert proc.returncode == 0, "worker%d exited %d:\n%s" % (
        task, proc.returncode, job.log_tail("worker", task))


@pytest.fixture(name="gone_job")
def _gone_job(tmp_path):
  jobs = []

  def make(**kwargs):
    job = test_recovery.Job(tmp_path, workers=3, replicas=3,
                            count_pushes=GENERATIONS, **kwargs)
    job.base["opt_kwargs"] = {"worker_gone_secs": GONE_SECS}
    jobs.append(job)
    return job

  yield make
  for job in jobs:
    job.close()


@pytest.mark.timeout(240)
def test_sigkilled_worker_is_declared_gone_and_the_job_reaches_its_limit(
    gone_job):
  """Worker 2 SIGKILLed for good: declared gone (refused), and the two
  survivors train to the step limit, every update after the declaration's
  transient taking exactly one gradient of each (counted push by push).

  Until it is declared, the job either waits for worker 2's gradient (its
  last token went to its killed run: seen on TensorFlow 2.21) or goes on,
  a survivor pushing twice for each update with the token released for
  worker 2 (its killed run's dequeue cancelled on the ps: seen on 2.15,
  where it is declared by the quiet look, "updates went on without it").
  """
  last_step = 100
  job = _running_job(gone_job, last_step)
  support.wait_until(lambda: job.read("trace")[:, 2].sum() > 0, timeout=90,
                     what="worker 2's first applied gradient", interval=0.1)
  job.wait_step(10)
  support.kill_group(job.procs[("worker", 2)])
  killed = time.monotonic()
  killed_at = int(job.read_when_up("global_step"))
  assert killed_at < last_step - 10, "trained too far before the kill"
  job.wait_step(last_step, timeout=GONE_SECS + SLACK_SECS + 60)
  took = time.monotonic() - killed
  _finish(job, [0, 1])
  gone = _lines(job, "is gone")
  assert len(gone) == 1, job.log("worker", 0)[-4000:]
  assert "worker2 at %s is gone" % (
      job.cluster["worker"][2]) in gone[0], gone
  assert "refuses connections" in gone[0], gone
  assert "updates now need 2 gradients (2 of 3 workers live)" in gone[0], gone
  declared_at = _declared_at(gone[0])
  assert declared_at + TRANSIENT < last_step - 10, (
      "trained too far before the declaration: %s" % gone[0])
  # Counted from the updates, push by push: none of worker 2's after the
  # kill; after the declaration, once the tokens released for worker 2
  # before its mark are used up, exactly one fresh gradient of each
  # survivor. A survivor's second push for an update fails this, where
  # counting the workers with a share of the update would not.
  pushes = job.read_when_up("pushes")
  assert not pushes[1:].any(), "the chief started again: generation > 0"
  assert not pushes[0, killed_at + 1:, 2].any(), pushes[0, killed_at + 1:]
  wrong = _not_one_of_each(
      {(0, s): pushes[0, s]
       for s in range(declared_at + TRANSIENT, last_step)}, live=(0, 1))
  assert not wrong, (
      "updates after worker 2's declaration at step %d that did not take "
      "one gradient of each live worker ((generation, step), gradients of "
      "workers 0-2): %s" % (declared_at, wrong))
  # The stall lasted about worker_gone_secs, and the rest trained at speed.
  assert took < GONE_SECS + SLACK_SECS + (last_step - killed_at) * 0.5, took
  print("killed at step %d, declared at step %d; step %d reached %.1f s "
        "later; updates from the kill on (gradients of workers 0-2): %s" % (
            killed_at, declared_at, last_step, took,
            sorted(set(map(tuple, pushes[0, killed_at + 1:last_step]
                           .astype(int).tolist())))))


#: The global step when the chief declared a worker gone, from its line.
_DECLARED = re.compile(r"the update to step (\d+) waits for it|"
                       r"updates went on without it to step (\d+)")


def _declared_at(line):
  """The global step when ``line`` (the chief's "is gone" line) was
  logged: the update it names waited at the step before it, or the updates
  had gone on to it."""
  found = _DECLARED.search(line)
  assert found, line
  waited, went_on = found.groups()
  return int(waited) - 1 if waited else int(went_on)


#: Under every TensorFlow, what these process-cluster tests add is proven
#: apart; CI runs them with its newest only (their time), the SIGKILL test
#: above on both. Each reason names the tests that run under 2.15 too.
DECLARED_GONE_ON_EVERY_VERSION = (
    "this file's test_sigkilled_worker_is_declared_gone_and_the_job_reaches_"
    "its_limit declares a lost process gone and counts the updates on the ps")
TAKEN_BACK_ON_EVERY_VERSION = (
    "test_gone_interplay's test_a_restarted_worker_left_without_a_token_is_"
    "taken_back_at_its_push takes a gone worker back at its push")


@pytest.mark.newest_only(reason=(
    "under every TensorFlow, " + DECLARED_GONE_ON_EVERY_VERSION + ", "
    "test_lost's test_stall_line_names_each_worker_that_cannot_push_and_why "
    "probes a task that accepts connections but never answers (a stopped "
    "one's), and " + TAKEN_BACK_ON_EVERY_VERSION))
@pytest.mark.timeout(300)
def test_stopped_worker_is_gone_then_taken_back_and_every_update_has_all(
    gone_job):
  """SIGSTOP (alive but silent): declared gone, the job goes on with two;
  SIGCONT after N steps: taken back at its push, and from then on every
  update averages all three workers' gradients again."""
  last_step = 200
  job = _running_job(gone_job, last_step)
  job.wait_step(10)
  stopped = job.procs[("worker", 2)]
  os.killpg(stopped.pid, signal.SIGSTOP)
  try:
    _wait_for_line(job, "is gone", "declaring worker 2 gone",
                   timeout=GONE_SECS + SLACK_SECS + 30)
    gone_at = int(job.read_when_up("global_step"))
    job.wait_step(gone_at + 10)  # N steps without it.
  finally:
    os.killpg(stopped.pid, signal.SIGCONT)
  _wait_for_line(job, "is back", "taking worker 2 back", timeout=60)
  back_at = int(job.read_when_up("global_step"))
  assert back_at < last_step - 20, "trained too far before the return"
  for task in range(3):
    job.procs[("worker", task)].wait(timeout=150)
  gone, back = _lines(job, "is gone"), _lines(job, "is back")
  assert len(gone) == 1 and "worker2 at " in gone[0], gone
  assert "accepts connections but does not answer" in gone[0], gone
  assert len(back) == 1 and "worker2 is back (it pushed again" in (
      back[0]), back
  assert "updates need 3 gradients again from the next update" in back[0]
  rows = _gradients_per_update(job, last_step)
  # While gone, the updates averaged the two live workers' gradients.
  np.testing.assert_array_equal(rows[gone_at + 1:gone_at + 10].sum(axis=1),
                                2)
  # Taken back: every later update averages W = 3 gradients again.
  np.testing.assert_array_equal(rows[back_at + 2:].sum(axis=1), 3)


@pytest.mark.newest_only(reason=(
    "under every TensorFlow, " + DECLARED_GONE_ON_EVERY_VERSION + ", "
    "test_recovery's test_killed_backup_worker_rejoins_and_contributes "
    "restarts a killed worker's process into a running job, and "
    + TAKEN_BACK_ON_EVERY_VERSION))
@pytest.mark.scale(reason=(
    "a second proof (18-26 CPU-seconds in two loaded runs) of what three "
    "default tests prove apart: " + DECLARED_GONE_ON_EVERY_VERSION + ", "
    "test_recovery's "
    "test_killed_backup_worker_rejoins_and_contributes restarts a killed "
    "worker's process into a running job, and test_gone_interplay's "
    "test_a_restarted_worker_left_without_a_token_is_taken_back_at_its_push "
    "sees a restarted gone worker's hook start, does not take it back "
    "then, and takes it back at its push, counting every later update"))
@pytest.mark.timeout(300)
def test_killed_worker_restarted_is_taken_back_at_its_first_push(gone_job):
  """Its hook's start is seen (one line), but the chief takes it back at
  its first train run that gets a token, which balances the release cut
  to the others (tests/test_gone_interplay.py's schedule shows the stall
  a take-back at the start could make)."""
  last_step = 200
  job = _running_job(gone_job, last_step)
  job.wait_step(10)
  support.kill_group(job.procs[("worker", 2)])
  _wait_for_line(job, "is gone", "declaring worker 2 gone",
                 timeout=GONE_SECS + SLACK_SECS + 30)
  # The live workers wait while it restarts (a TensorFlow import on a
  # loaded machine must not decide whether training ends first).
  job.hold()
  job.start("worker", 2)
  job.wait_ready("worker", 2, count=2, timeout=90)
  _wait_for_line(job, "worker2's hook started again",
                 "seeing worker 2's start", timeout=30)
  assert not _lines(job, "is back"), _lines(job, "worker2")
  job.release()
  _wait_for_line(job, "is back", "taking worker 2 back", timeout=60)
  back_at = int(job.read_when_up("global_step"))
  assert back_at < last_step - 20, "trained too far before the take-back"
  _finish(job, [0, 1, 2])
  back = _lines(job, "is back")
  assert len(back) == 1, back
  assert "worker2 is back (it pushed again" in back[0], back
  rows = _gradients_per_update(job, last_step)
  np.testing.assert_array_equal(rows[back_at + 2:].sum(axis=1), 3)


# test_lost's cluster: a ps and the chief in process, worker 1 silent,
# worker 2 down.
_lost_cluster = test_lost.lost_cluster_fixture


@pytest.mark.timeout(120)
def test_the_chief_never_declares_itself_gone(lost_cluster, caplog):
  """Workers 1 and 2 are declared gone and the chief trains on alone; its
  own key is never probed, so never declared, even with its recorded
  address a port where nothing listens (where a probe of it would say
  "refuses connections" on every version)."""
  caplog.set_level(logging.INFO, logger="sync_replicas")
  chief = support.LinearWorker(
      support.OURS, lost_cluster, 0, replicas=3, total=3,
      opt_kwargs={"worker_gone_secs": 1.0})
  closed = "127.0.0.1:%d" % _ports.free_ports(1)[0]
  last_step = 5
  with chief.graph.as_default(), \
      tf.compat.v1.train.MonitoredTrainingSession(
          master=lost_cluster.target, is_chief=True,
          hooks=[chief.hook,
                 tf.compat.v1.train.StopAtStepHook(last_step=last_step)],
          config=test_lost.session_config(), stop_grace_period_secs=1,
          save_summaries_steps=None, save_summaries_secs=None,
          log_step_count_steps=None) as sess:
    test_lost.record_addresses(lost_cluster.target, {
        0: closed, 1: lost_cluster.spec["worker"][1],
        2: lost_cluster.spec["worker"][2]})
    while not sess.should_stop():
      sess.run(chief.train_op)
  with tf.compat.v1.Session(lost_cluster.target, graph=chief.graph,
                            config=test_lost.session_config()) as sess:
    assert chief.opt.workers_gone(sess) == [1, 2]
    assert sess.run(chief.global_step) >= last_step
  gone = [r.getMessage() for r in caplog.records
          if " is gone (worker_gone_secs" in r.getMessage()]
  assert len(gone) == 2, gone
  assert not [x for x in gone if x.startswith("sync_replicas: worker0")], gone


#: The chief's line when it restores the checkpoint of its previous life.
_RESTORED = re.compile(r"Restoring parameters from \S*model\.ckpt-(\d+)")


@pytest.mark.timeout(300)
def test_killed_chief_keeps_the_mark_of_a_worker_gone_for_good(gone_job):
  """Gone-ness survives a chief restart as done-ness does (issue 44 item 3).

  Worker 1 is SIGKILLed for good and declared gone; then the chief is
  SIGKILLed and started again (same task, same checkpoint directory). The
  mark lives in the record on the ps, not in the chief: the restarted chief
  reads it back (one line naming worker 1), declares nobody gone again, and
  its updates need the two live workers' gradients from the first one, so
  no update waits worker_gone_secs for worker 1 again. Its initial tokens
  are what the live workers lack (one: worker 2's; the chief's first push
  needs none), not stock's R, whose two spare tokens let worker 2 push two
  or three times for the restarted chief's first update, often without the
  chief's push, and twice for some later ones. Counted push by push from
  the updates the restarted chief applied (every update of its restart
  generations, from the step it restored on): each took exactly one
  gradient of the chief and one of worker 2, none of worker 1's, and the
  job reaches its step limit.
  """
  last_step = 120
  job = _running_job(gone_job, last_step)
  job.wait_step(10)
  support.kill_group(job.procs[("worker", 1)])
  _wait_for_line(job, "is gone", "declaring worker 1 gone",
                 timeout=GONE_SECS + SLACK_SECS + 30)
  gone_at = int(job.read_when_up("global_step"))
  # A checkpoint (every 5 steps) made after the declaration.
  killed_at = job.wait_step(gone_at + 6)
  assert killed_at < last_step - 30, "trained too far before the kill"
  first_life = len(job.log("worker", 0))
  first_records = len(job.records("worker", 0))
  job.kill("worker", 0)
  job.start("worker", 0)
  job.wait_ready("worker", 0, count=2, timeout=90)
  _finish(job, [0, 2], timeout=180)
  second = job.log("worker", 0)[first_life:]
  said = [l for l in second.splitlines() if "sync_replicas:" in l]
  read_back = [l for l in said if "gone mark(s)" in l]
  assert len(read_back) == 1, "\n".join(said[-30:])
  assert ("read back 1 gone mark(s) from the record on the ps, made before "
          "this chief process started (worker_gone_secs): worker1 at %s "
          "(since its last train run, for step " % job.cluster["worker"][1]
          in read_back[0]), read_back
  assert "updates need 2 gradients (2 of 3 workers live)" in read_back[0]
  assert not [l for l in said if "is gone" in l], "\n".join(said[-30:])
  restored = [int(m) for m in _RESTORED.findall(second)]
  assert restored, second[-4000:]
  final = int(job.read_when_up("global_step"))
  assert final >= last_step
  # The restarted chief's generation: its first session's local step
  # carries it (crash_task's ``session`` event).
  sessions = [r["label"] for r in job.records("worker", 0)[first_records:]
              if r["event"] == "session"]
  assert sessions, job.records("worker", 0)[first_records:]
  generation = sessions[0] >> 32
  assert generation >= 1, sessions
  pushes = job.read_when_up("pushes")
  later = {(g, s): pushes[g, s]
           for g in range(min(generation, GENERATIONS - 1), GENERATIONS)
           for s in np.flatnonzero(pushes[g].any(axis=1)).tolist()}
  missing = sorted(set(range(restored[0], final)) - {s for _, s in later})
  assert not missing, "no applied update counted at steps %s" % missing
  wrong = _not_one_of_each(later, live=(0, 2))
  assert not wrong, (
      "the restarted chief's updates (it restored step %d) that did not "
      "take one gradient of the chief and one of worker 2 ((generation, "
      "step), gradients of workers 0-2): %s" % (restored[0], wrong))
  print("worker 1 gone at step %d; chief killed at %d, restored %d "
        "(generation %d); %d updates after it, each one gradient of the "
        "chief's and one of worker 2's" % (
            gone_at, killed_at, restored[0], generation, len(later)))


def test_a_restarted_chief_says_which_gone_marks_it_read_back(caplog):
  """A chief process that did not declare worker 2 gone finds its mark in
  the record on the ps (here written from a graph of its own, as the
  chief's previous process did) and logs one line at its session's start
  naming it, its address and its last local step; its next session (a
  run aborted as by a ps restart: MonitoredSession creates it again), whose
  record holds nothing it has not seen, logs none."""
  cluster = sync_replicas.LocalCluster(num_workers=3, num_ps=1)
  chief = test_data_end_protocol.ShardWorker(
      cluster, 0, workers=3, batches=4, worker_gone_secs=60.0)
  # pylint: disable-next=protected-access
  abort = test_data_end_protocol._AbortWhenAsked()
  chief.hooks.append(abort)
  _write_a_previous_chiefs_mark(
      cluster.worker_targets[0], key=2, step=(1 << 32) + 41,
      address="10.0.0.7:2225")
  caplog.set_level(logging.INFO, logger="sync_replicas")

  def lines():
    return [r.getMessage() for r in caplog.records
            if "gone mark(s)" in r.getMessage()]

  with chief.graph.as_default(), support.monitored_session(
      chief.target, is_chief=True, hooks=chief.hooks) as sess:
    assert len(lines()) == 1, lines()
    abort.ask()
    # Aborted before the run; the recovered session runs it: a push and
    # the one initial token of that new chief start (worker 2 is gone:
    # what worker 1 lacks; the chief's own first push needs none).
    sess.run(chief.train_op)
    assert abort.raised
  assert lines() == [
      "sync_replicas: the chief read back 1 gone mark(s) from the record on "
      "the ps, made before this chief process started (worker_gone_secs): "
      "worker2 at 10.0.0.7:2225 (since its last train run, for step 41); "
      "updates need 2 gradients (2 of 3 workers live); each is taken back "
      "when its task starts again"], lines()


def _write_a_previous_chiefs_mark(target, *, key, step, address):
  """Marks worker ``key`` gone in the done record on ps 0, with its last
  local step and its address, through the tables' shared names."""
  with tf.Graph().as_default():
    with tf.compat.v1.device("/job:ps/task:0"):
      writes = []
      for name, value_dtype, value in [
          ("sync_replicas_done", tf.int64, _gone.GONE),
          ("sync_replicas_local_steps", tf.int64, step),
          ("sync_replicas_local_steps_addresses", tf.string, address)]:
        table = tf.raw_ops.MutableHashTableV2(
            shared_name=name, use_node_name_sharing=False,
            key_dtype=tf.int64, value_dtype=value_dtype)
        writes.append(tf.raw_ops.LookupTableInsertV2(
            table_handle=table, keys=tf.constant([key], tf.int64),
            values=tf.constant([value], value_dtype)))
    with tf.compat.v1.Session(target, config=support.session_config()) as s:
      s.run(writes)


def test_status_lines_list_the_gone_workers_apart_from_the_done_ones():
  from sync_replicas.cli import _job_state  # pylint: disable=g-import-not-at-top
  # A chief job's layout: key 0 is chief0, keys 1 and 2 worker0 and worker1.
  manifest = {"tokens_per_step": 3, "total_num_replicas": 3,
              "accumulators": [{"variable": "w", "device": "/job:ps/task:0",
                                "sparse": False}],
              "local_step": {"device": "/job:chief/replica:0/task:0"}}
  state = {"global_step": 7, "tokens": 0, "counts": [1], "starts": 1,
           "needed": 1, "done": [0, 2], "gone": [2], "addresses": {}}
  lines = _job_state.render(state, manifest)
  assert ("  data end: 1 of 3 workers done, their input ended: chief0"
          in lines), lines
  assert "  lost: 1 of 3 workers gone (worker_gone_secs): worker1" in lines


@pytest.mark.newest_only(reason=(
    "under every TensorFlow, " + DECLARED_GONE_ON_EVERY_VERSION + ", "
    "test_readme's test_quick_start_runs_and_every_task_exits_0 runs "
    "README's program, and test_lost's test_a_failed_job_ends_failed_on_"
    "every_surviving_worker runs it (tests/lost_task.py) with worker 2 "
    "SIGKILLed"))
@pytest.mark.timeout(240)
def test_readme_program_ends_every_process_with_a_worker_gone(tmp_path):
  """README's program with the chief's item for each gone worker
  (``tests/lost_task.py``) and worker_gone_secs from the environment, as an
  unchanged script gets it: worker 2 SIGKILLed, the chief and worker 1 reach
  the step limit, and the ps, which waits for an item from every replica,
  exits once they are done.

  The step limit lies far enough past the kill that worker_gone_secs runs
  out before it in either way the job goes on: the update stalls (worker
  2 died holding its token), or the survivors train on, one pushing twice
  per update with the token worker 2 never took (as stock's do). Both end
  with worker 2 declared gone; at 150 steps the second once reached the
  limit 1.9 s after the kill, gone never declared, and the ps waited for
  worker 2's item. So far is a time, not a number of steps: each worker
  pauses PAUSE_SECS before each run, which puts the limit about
  README_PAUSED_SECS of pauses past the kill (at step 20 or a few later)
  however fast the machine steps. The limit was 1,000 unpaused steps: the
  980 after the kill took 15 s at load average 15, at full speed on every
  task, for nothing the test reads."""
  last_step = 20 + int(README_PAUSED_SECS / PAUSE_SECS)
  job = test_lost.Readme(tmp_path, "ours", steps=last_step,
                         env={"SYNC_REPLICAS_WORKER_GONE_SECS": "%g" % GONE_SECS},
                         pause_secs=PAUSE_SECS)
  try:
    support.wait_until(lambda: job.step() >= 20, timeout=120,
                       what="the chief past step 20", interval=0.1)
    support.kill_group(job.procs[("worker", 2)])
    killed = time.monotonic()
    for task, job_name in [(0, "worker"), (1, "worker"), (0, "ps")]:
      support.wait_until(lambda t=task, j=job_name: job.end(t, j) is not None,
                         timeout=120, what="%s%d to end" % (job_name, task),
                         interval=0.1)
      end = job.end(task, job_name)
      assert end["event"] == "done", (end, job.log(task, job_name)[-3000:])
      if job_name == "worker":
        assert end["step"] >= last_step, end
      if (job_name, task) == ("worker", 0):
        # Before the ps's wait, which a missing mark would make time out.
        assert end["gone"] == [2], (
            "the chief ended %.1f s after the kill without declaring worker "
            "2 gone: %r; its log: %s"
            % (time.monotonic() - killed, end, job.log(0)[-3000:]))
    assert job.procs[("ps", 0)].wait(timeout=30) == 0
  finally:
    job.close()


def test_stall_line_lists_the_gone_workers_apart_from_the_done_ones():
  from sync_replicas import _data_end  # pylint: disable=g-import-not-at-top
  from sync_replicas import _diagnose  # pylint: disable=g-import-not-at-top
  from sync_replicas import _lost  # pylint: disable=g-import-not-at-top
  ends = _data_end.DataEnd(
      _data_end.TRAIN_ALL, replicas_to_aggregate=3, total_num_replicas=3,
      tokens_per_step=3, shared_prefix="")
  ends.devices = _lost.key_devices("/job:worker/task:0", 3)
  needed, text = _data_end.stall_part([0, 2], ends, 3, gone=[2])
  # The status tool's two lines' words (the test above), joined.
  assert needed == 1
  assert text == ("; 1 of 3 workers done, their input ended: worker0; 1 of 3 "
                  "workers gone (worker_gone_secs): worker2"), text
  steps = _diagnose.replicas_clause(
      [_diagnose.LocalStep("/job:worker/replica:0/task:0", 7, None,
                           done=True),
       _diagnose.LocalStep("/job:worker/replica:0/task:1", 6, None),
       _diagnose.LocalStep("key 2", 5, None, done=_diagnose.GONE)],
      global_step=7, tokens=0, starts=None, generations=False, waiting=True)
  assert steps.startswith(
      "workers' local steps: worker0 7 (done), worker1 6, key 2 5 (gone); "
      "every push from worker1 is stale"), steps


class _Looks:
  """A coordinator for ``GoneWatch.run`` that stops after ``looks`` looks."""

  def __init__(self, looks):
    self.left = looks

  def wait_for_stop(self, timeout):
    del timeout
    self.left -= 1
    return self.left < 0

  def should_stop(self):
    return False


class _Record:
  """The chief's side of the done record, as ``GoneWatch`` uses it: the
  global step never moves, every worker's local step neither, and a
  declaration marks the worker gone there (which the next look reads)."""

  total_num_replicas = 3
  key = 0  # The chief's.

  def __init__(self, addresses, reader):
    self.devices = _lost.key_devices("/job:worker/task:0", 3)
    self.record, self.declared = {}, []
    self._reader = reader
    self.local_steps = types.SimpleNamespace(
        read_addresses=lambda sess: dict(addresses))
    self.gone_marks = types.SimpleNamespace(read=self._read,
                                            declare=self._declare)

  def _read(self, sess, global_step):
    del sess, global_step
    return 7, dict(self.record), {0: 7, 1: 7, 2: 7}

  def _declare(self, sess, key):
    del sess
    self.record[key] = _gone.GONE
    self.declared.append((key, self._reader.reads))

  def need(self, out):
    return max(0, min(3, 3 - out))


class _Reads:
  """Worker 1's local step as the chief's bounded reads find it, one
  answer per look: None is a read that missed its bound."""

  spec = types.SimpleNamespace(device="/job:worker/task:0")

  def __init__(self, answers):
    self._answers = list(answers)
    self.reads = 0

  def read(self, target, devices, *, config=None, addresses=None):
    del target, config
    assert devices == ["/job:worker/replica:0/task:1"], devices
    # Read through its own server (its recorded address), where every call
    # is bounded: not through the chief's master (issue 46).
    assert devices[0] in (addresses or {}), addresses
    self.reads += 1
    step = self._answers.pop(0)
    return [_diagnose.LocalStep(devices[0], step,
                                None if step is not None else "unreachable")]


def test_a_task_that_misses_one_read_is_looked_at_again_before_it_is_gone(
    caplog):
  """Worker 1's task accepts connections (a listening socket) but its read
  misses the bound at the first look that probes it, as a live task
  starved of CPU can: not declared gone there, since the second look a
  pause later (``_lost.lacking``) finds it answering; at the next probing
  look it misses both reads (the third and fourth): declared gone at the
  fourth. Worker 2's task refuses connections: declared gone at the first
  probing look, with no second look at it. The global step never moves,
  and the clock is 10 s ahead at each reading of it: every look from the
  second on is past worker_gone_secs, and probes."""
  caplog.set_level(logging.INFO, logger="sync_replicas")
  listening = socket.socket()
  listening.bind(("127.0.0.1", 0))
  listening.listen(8)
  closed = "127.0.0.1:%d" % _ports.free_ports(1)[0]
  try:
    reads = _Reads([None, 7, None, None])
    record = _Record({1: "127.0.0.1:%d" % listening.getsockname()[1],
                      2: closed}, reads)
    ticks = iter(range(0, 1000, 10))
    watch = _gone.GoneWatch(GONE_SECS, ends=record, global_step=None,
                            reader=reads, clock=lambda: float(next(ticks)))
    watch.run(types.SimpleNamespace(sess_str="grpc://127.0.0.1:1"),
              _Looks(5))
  finally:
    listening.close()
  # (key, the reads of worker 1 made by then): worker 2 at the first
  # probing look, after worker 1's two reads there; worker 1 at its fourth
  # read, the second silent one of one look.
  assert record.declared == [(2, 2), (1, 4)], record.declared
  again = [r.getMessage() for r in caplog.records
           if "looked at again" in r.getMessage()]
  assert len(again) == 2 and all(
      l.startswith("sync_replicas: worker1 at 127.0.0.1:") for l in again), again
  gone = [r.getMessage() for r in caplog.records
          if " is gone (worker_gone_secs" in r.getMessage()]
  assert "accepts connections but does not answer" in gone[1], gone
