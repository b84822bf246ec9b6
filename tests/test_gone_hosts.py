"""A worker lost for good on emulated hosts (issue 44, item 5).

The ps and three workers are processes (``crash_task.py``, as
test_recovery's), each on an emulated host of its own: a network namespace
with its own address and link on a bridge (``sync_replicas/cli/_hosts.py``,
what ``sync-replicas-launch --hosts`` builds), so a host can be cut off by
taking its link down, as a failed switch port does: its task lives on,
unreachable. ``worker_gone_secs`` is on; ``replicas_to_aggregate =
total_num_replicas = 3``.

One job goes through three losses, each proved from the applied updates on
the ps (``trace``: an update of k gradients adds ``R / k`` to the cell
(step, worker) of each, so a row's cells that are not 0 are the workers it
averaged, and equal cells of ``R / k`` mean one gradient of each):

1. worker 2's host cut off: declared gone, the job goes on with two; after
   N steps its link is mended: it is taken back, and every later update
   averages all three workers' gradients again;
2. worker 1 stopped (SIGSTOP) for good, alive but silent: declared gone,
   the job goes on with two;
3. worker 2's host cut off for good: declared gone, and the chief alone
   reaches the step limit within worker_gone_secs and a few seconds.
"""

import os
import signal
import time

import numpy as np
import pytest

import support
import test_recovery
from sync_replicas import _lost
from sync_replicas.cli import _hosts

#: worker_gone_secs here.
GONE_SECS = 2.0
#: What "a few seconds" past it may take on the shared 2-core machine: the
#: probe (a 2 s connect to a host cut off, then a bounded read), the loop's
#: switch to polling, and the next update.
SLACK_SECS = 15.0
#: Steps trained without the cut-off worker before its link is mended.
N_STEPS = 10
LAST_STEP = 250

pytestmark = [
    pytest.mark.skipif(
        not support.is_machine_root(), reason=(
            "emulated hosts need the machine's root here (network namespaces "
            "and a bridge in this machine's namespace)")),
    # CI runs this with its newest TensorFlow only (its time budget).
    pytest.mark.newest_only(reason=(
        "under every TensorFlow, test_hosts' test_training_on_hosts_"
        "survives_a_cut_link_and_is_read_by_status cuts a host's link, "
        "test_gone's test_sigkilled_worker_is_declared_gone_and_the_job_"
        "reaches_its_limit declares a lost process gone, test_lost's "
        "test_stall_line_names_each_worker_that_cannot_push_and_why probes "
        "a task that does not answer, and test_gone_interplay counts the "
        "updates with a worker gone and taken back")),
    # ./tools/test leaves it to --all (and CI): each of its losses is
    # proven apart by the default run.
    pytest.mark.scale(reason=(
        "a second proof (30-35 CPU-seconds in two loaded runs) of what "
        "default tests prove one loss each: test_gone's "
        "test_sigkilled_worker_is_declared_gone_"
        "and_the_job_reaches_its_limit (a lost process declared gone, the "
        "updates counted) and test_stopped_worker_is_gone_then_taken_back_"
        "and_every_update_has_all (a silent task gone, taken back, every "
        "later update counted), test_gone_interplay's updates with a worker "
        "gone and the chief training on, test_hosts' test_training_on_hosts_"
        "survives_a_cut_link_and_is_read_by_status (a host's link cut), and "
        "test_lost's test_probe_says_a_task_that_never_answers_the_connect_"
        "does_not_answer (the probe's word for a host cut off)")),
]


def _lines(job, words):
  return [line for line in job.log("worker", 0).splitlines() if words in line]


def _wait_for_lines(job, words, count, what, timeout):
  support.wait_until(lambda: len(_lines(job, words)) >= count,
                     timeout=timeout, what="the chief's line " + what,
                     interval=0.1)
  return int(job.read_when_up("global_step"))


def _check_rows(rows, workers, what):
  """Each row averaged one gradient of each of ``workers``, nobody else's."""
  want = np.zeros(rows.shape[1])
  want[list(workers)] = rows.shape[1] / len(workers)
  np.testing.assert_allclose(rows, np.tile(want, (len(rows), 1)), rtol=1e-5,
                             err_msg=what)
  assert len(rows) > 0, what


@pytest.mark.timeout(420)
def test_a_host_cut_off_is_gone_then_back_then_a_stop_and_a_cut_for_good(
    tmp_path):
  tag = os.getpid()
  hosts = _hosts.Hosts(4, prefix="sync-gone-%d-" % tag, bridge="sgb%d" % tag,
                       link_prefix="sgb%dv" % tag)
  # Host of worker t: the ps is on host 0.
  host_of = {1: 2, 2: 3}
  job = test_recovery.Job(tmp_path, workers=3, replicas=3, delay=0.03,
                          last_step=LAST_STEP, hosts=hosts)
  job.base["opt_kwargs"] = {"worker_gone_secs": GONE_SECS}
  cut = set()
  try:
    job.hold()  # Nobody trains before all three are up.
    job.start("ps", 0)
    job.start("worker", 0)
    job.wait_ready("worker", 0)
    for task in (1, 2):
      job.start("worker", task)
    for task in (1, 2):
      job.wait_ready("worker", task)
    job.release()
    job.wait_step(10)

    # 1. Worker 2's host cut off, then mended after N steps.
    cut_at = int(job.read_when_up("global_step"))
    hosts.cut(host_of[2])
    cut.add(host_of[2])
    gone_at = _wait_for_lines(job, "is gone", 1, "declaring worker 2 gone",
                              timeout=GONE_SECS + SLACK_SECS + 30)
    mended_at = job.wait_step(gone_at + N_STEPS)
    hosts.mend(host_of[2])
    cut.discard(host_of[2])
    back_at = _wait_for_lines(job, "is back", 1, "taking worker 2 back",
                              timeout=120)
    job.wait_step(back_at + 20)

    # 2. Worker 1 stopped for good: alive but silent.
    stopped_at = int(job.read_when_up("global_step"))
    os.killpg(job.procs[("worker", 1)].pid, signal.SIGSTOP)
    stopped_gone_at = _wait_for_lines(
        job, "is gone", 2, "declaring worker 1 gone",
        timeout=GONE_SECS + SLACK_SECS + 30)
    job.wait_step(stopped_gone_at + 10)

    # 3. Worker 2's host cut off for good: the chief goes on alone.
    last_cut_at = int(job.read_when_up("global_step"))
    hosts.cut(host_of[2])
    cut.add(host_of[2])
    lost = time.monotonic()
    assert last_cut_at < LAST_STEP - 20, "trained too far before the last cut"
    # Within worker_gone_secs and a few seconds the chief trains on alone
    # (the update right after the cut may have had every push already).
    job.wait_step(last_cut_at + 3, timeout=GONE_SECS + SLACK_SECS)
    stalled = time.monotonic() - lost
    last_gone_at = _wait_for_lines(job, "is gone", 3,
                                   "declaring worker 2 gone for good",
                                   timeout=30)
    job.wait_step(LAST_STEP, timeout=120)
    took = time.monotonic() - lost
    chief = job.procs[("worker", 0)]
    chief.wait(timeout=60)
    assert chief.returncode == 0, job.log_tail("worker", 0)
    trace = job.read_when_up("trace")
  finally:
    try:
      job.close()
    finally:
      for host in cut:
        hosts.mend(host)
      hosts.close()

  gone = _lines(job, "is gone")
  back = _lines(job, "is back")
  cluster = job.cluster["worker"]
  assert len(gone) == 3 and len(back) == 1, (gone, back)
  # A host cut off does not answer; a stopped task accepts but is silent.
  assert "worker2 at %s is gone" % (
      cluster[2]) in gone[0], gone
  assert _lost.NO_ANSWER in gone[0], gone
  assert "worker1 at %s is gone" % (
      cluster[1]) in gone[1], gone
  assert _lost.SILENT in gone[1], gone
  assert "worker2 at " in gone[2] and _lost.NO_ANSWER in gone[2], gone
  assert "updates now need 1 gradients (1 of 3 workers live)" in gone[2]
  assert "worker2 is back" in back[0], back
  print("cut at %d, gone at %d, mended at %d, back at %d; stopped at %d, "
        "gone at %d; cut for good at %d, trained on alone %.1f s later, "
        "gone at %d; step %d reached %.1f s after the last cut" % (
            cut_at, gone_at, mended_at, back_at, stopped_at, stopped_gone_at,
            last_cut_at, stalled, last_gone_at, LAST_STEP, took))
  # Counted from the updates on the ps (rows: a few updates of transient
  # after each event are left out).
  _check_rows(trace[:cut_at], (0, 1, 2), "before the first cut")
  _check_rows(trace[gone_at + 3:mended_at], (0, 1),
              "worker 2 cut off and gone")
  _check_rows(trace[back_at + 3:stopped_at], (0, 1, 2),
              "worker 2 taken back: all three again")
  _check_rows(trace[stopped_gone_at + 3:last_cut_at], (0, 2),
              "worker 1 stopped and gone")
  _check_rows(trace[last_gone_at + 3:LAST_STEP], (0,),
              "worker 2 cut off for good: the chief alone")
