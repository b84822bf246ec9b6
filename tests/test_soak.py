"""tools/soak end to end: a short chaos soak, and its checks on their own.

The soak (``-m soak`` selects it) is what CI runs of issue 20's soak: 60 s
or more of random SIGKILLs and network cuts (root only) across every role of
a 2-ps, 4-replica process cluster, at least 3 of each, with every invariant
the tool checks. The other tests feed the tool's checks
crafted traces and step series, so a check that can never fail would show
here.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import support

ROOT = pathlib.Path(__file__).resolve().parents[1]
soak = support.load_tool("soak")
root_only = pytest.mark.skipif(
    not support.is_machine_root(),
    reason="network namespaces and veth links need the machine's root (uid "
    "0 of a user namespace, as under unshare -r, cannot mount /run/netns)")
#: The replicas' mean pause before a step, in seconds (the tool's default is
#: 0.02). The soak trains for fixed windows, so its pace, not its length,
#: sets its CPU: it was the suite's largest (116-140 of 750-800
#: CPU-seconds). Since each step became one run instead of two (the relabel
#: joined the step's run), 0.03 gives about 85% of the updates per second
#: the two-run step did at 0.02, for about 77% of its training CPU
#: (docs/testing.md, "Where the CPU goes").
DELAY_SECS = 0.03
#: The soak's chief saves with make_checkpoint_saver_listener() (its
#: default), so a checkpoint holding half an update is a violation here:
#: fault 3 of docs/operations-soak.md, fixed by that listener.


def _trace(step, replicas, num_replicas=4):
  """A trace after ``step`` fresh updates, contributors spread by step."""
  trace = np.zeros((soak.ROWS, num_replicas), np.float32)
  for s in range(step):
    for k in range(replicas):
      trace[s % soak.ROWS, (s + k) % num_replicas] += 1
  return trace


def test_a_violation_quotes_the_tasks_last_lines(tmp_path):
  log = soak.Log(tmp_path / "tasks.log")
  for i in range(20):
    log.write(b"[worker0] line %d\n" % i)
    log.write(b"[worker10] other %d\n" % i)
  tail = log.tail("worker0", lines=3).splitlines()
  # worker10's lines are not worker0's, though "worker0" is in their name.
  assert [l.split("] ", 1)[1] for l in tail] == ["line 17", "line 18",
                                                 "line 19"]
  log.close()


def test_a_snapshot_read_across_a_restore_is_excused_only_then():
  short = [(341, 0, 3), (342, 0, 3)]
  restore = [(101.0, 356, 340, 340)]  # (time, from, to, checkpoint)
  assert soak.read_across_restore(100.0, short, restore)
  # Not long before the restore, not after it, not rows with too much.
  assert not soak.read_across_restore(90.0, short, restore)
  assert not soak.read_across_restore(102.0, short, restore)
  assert not soak.read_across_restore(100.0, [(341, 6, 3)], restore)
  assert not soak.read_across_restore(100.0, short, [])


def test_min_faults_extends_the_fault_phase_boundedly():
  parse, faulting = soak._parse, soak._faulting  # pylint: disable=protected-access
  args = parse(["--seconds", "45", "--min-faults", "3"])
  assert faulting(44.9, ["kill"], args)
  # Past --seconds only while a kind is short of --min-faults, and never
  # past MIN_FAULTS_LIMIT times --seconds.
  assert faulting(50, ["kill"], args)
  assert not faulting(50, [], args)
  assert not faulting(45 * soak.MIN_FAULTS_LIMIT, ["kill"], args)
  assert not faulting(45, [], parse(["--seconds", "45"]))


def test_min_faults_counts_each_kind_and_then_draws_only_the_short_ones():
  short, kinds = soak._short, soak._kinds  # pylint: disable=protected-access
  # As --faults kill,cut parses them (which needs root, for the cuts).
  args = argparse.Namespace(seconds=45.0, faults=["kill", "cut"],
                            min_faults=2)
  faults = [{"kind": "kill"}] * 3 + [{"kind": "cut"}]
  assert short(faults, args) == ["cut"]
  assert short(faults + [{"kind": "cut"}], args) == []
  # Both kinds until --seconds, then only what is short.
  assert kinds(44.9, ["cut"], args) == ["kill", "cut"]
  assert kinds(45.1, ["cut"], args) == ["cut"]
  assert kinds(45.1, [], args) == ["kill", "cut"]


def test_row_check_accepts_fresh_updates_across_the_wrap():
  step = soak.ROWS + 37
  assert soak.row_errors(_trace(step, 3), step, 3, in_flight=False) == []


def test_row_check_reports_a_stale_gradient_in_its_row():
  trace = _trace(100, 3)
  trace[98, 0] -= 1  # Update 98 counted a gradient labelled 95.
  trace[95, 0] += 1
  assert soak.row_errors(trace, 100, 3, in_flight=False) == [
      (95, 4, 3), (98, 2, 3)]


def test_row_check_reports_an_update_applied_twice():
  trace = _trace(100, 3)
  trace[99] += trace[99]  # Applied twice; the step moved on once more.
  assert soak.row_errors(trace, 101, 3, in_flight=False) == [
      (99, 6, 3), (100, 0, 3)]


@pytest.mark.parametrize("applied,read_step,ok", [
    (51, 50, True), (50, 51, True), (52, 50, False)],
                         ids=["trace_ahead", "step_ahead", "two_ahead"])
def test_snapshot_tolerates_only_the_update_in_flight(applied, read_step, ok):
  errors = soak.row_errors(_trace(applied, 3), read_step, 3, in_flight=True)
  assert (errors == []) == ok, errors
  assert soak.row_errors(_trace(applied, 3), read_step, 3, in_flight=False)


def test_restore_behind_the_last_checkpoint_is_found():
  series = [(1.0, 10), (2.0, 25), (3.0, None), (4.0, 20), (5.0, 30),
            (6.0, 12)]
  checkpoints = [(0.5, 0), (1.5, 20), (5.5, 30)]
  assert soak._restores(series, checkpoints) == [  # pylint: disable=protected-access
      (4.0, 25, 20, 20), (6.0, 30, 12, 30)]


def test_longest_gap_counts_unreadable_time_as_no_update():
  series = [(0.0, 1), (1.0, 2), (2.0, None), (9.0, None), (10.0, 3),
            (11.0, 4)]
  assert soak._gaps(series, 0.0, 11.0) == (1.0, 10.0)  # pylint: disable=protected-access


@pytest.mark.soak
@pytest.mark.timeout(900)
@pytest.mark.scale(reason=(
    "a minute of random faults (about 65 CPU-seconds): each fault alone is "
    "in the default run, test_recovery's kill of every role and test_hosts' "
    "cut link, and the soak's checks on made-up rows in this file's other "
    "tests"))
@pytest.mark.newest_only(reason=(
    "its faults' TensorFlow parts are proven under every version apart: "
    "test_recovery kills each role (chief, worker, each ps) and resumes, "
    "test_hosts' test_training_on_hosts_survives_a_cut_link_and_is_read_"
    "by_status cuts the ps's link, "
    "test_checkpoint_saves holds the saver listener; the soak adds their "
    "random mix over a minute, the tool's bookkeeping (72 CPU-seconds on "
    "2.15)"))
def test_short_soak_trains_through_random_kills_and_cuts_of_every_role(
    tmp_path):
  # One cluster takes both kinds of fault, at least 3 of each (--min-faults
  # counts each kind): two soaks, one of kills and one of cuts, cost the
  # suite 86 + 54 CPU-seconds, most of it their tasks' training for two
  # fixed windows and one more cluster's start. Without the machine's root
  # (no network namespaces) it is a soak of kills alone.
  cuts = support.is_machine_root()
  out = tmp_path / "soak"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "tools" / "soak"), "--seconds", "60",
       "--faults", "kill,cut" if cuts else "kill",
       "--kill-every", "4,10", "--down", "1,3", "--cut-for", "2,8",
       "--out", str(out),
       # From the restart, not from the next update: a restarted chief or
       # ps takes 20-40 s to start on a loaded 2-core machine, and the
       # issue asks for at least 3 kills in 60 s. CI once drew only 2 cuts
       # in 45 s: the counts must not depend on the draws.
       "--no-settle", "--min-faults", "3", "--delay", str(DELAY_SECS)],
      capture_output=True, text=True, timeout=840, check=False)
  report = proc.stdout[-4000:] + proc.stderr[-2000:]
  summary = _summary(out, report)
  assert summary["violations"] == [], report
  assert proc.returncode == 0, report
  assert summary["kills_total"] >= 3, report
  assert summary["final_step"] == summary["target"], report
  assert summary["updates_applied"] > summary["kills_total"], report
  assert summary["processes_left"] == [], report
  assert summary["checkpoints"] > 0 and summary["checkpoints_torn"] == 0, report
  if cuts:
    assert summary["cuts_total"] >= 3, report
    assert "sync-soak-" not in _ip_names()


def _summary(out, report):
  """The soak's summary.json; a soak that ended without one failed in
  itself, and its output says how."""
  path = out / "summary.json"
  assert path.exists(), "tools/soak wrote no %s:\n%s" % (path, report)
  return json.loads(path.read_text())


def _ip_names():
  """Every network namespace and link name on this machine."""
  namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True,
                              text=True, timeout=30, check=True).stdout
  links = subprocess.run(["ip", "-o", "link"], capture_output=True,
                         text=True, timeout=30, check=True).stdout
  return namespaces + links


@root_only
def test_network_cut_makes_a_task_unreachable_and_close_removes_everything():
  before = _ip_names()
  network = soak.Network([("ps", 0), ("chief", 0)])
  try:
    address = network.addresses["ps0"].split(":")[0]
    server = subprocess.Popen(
        network.command("ps0", [sys.executable, "-c", (
            "import socket, sys\n"
            "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
            "socket.SO_REUSEADDR, 1)\n"
            "s.bind(('0.0.0.0', 7001)); s.listen(); s.settimeout(60)\n"
            "print('up', flush=True)\n"
            "while True:\n  c, _ = s.accept(); c.send(b'ok'); c.close()\n")]),
        stdout=subprocess.PIPE, start_new_session=True)
    try:
      assert server.stdout.readline() == b"up\n"

      def reach():
        probe = subprocess.run(network.command("chief0", [
            sys.executable, "-c",
            "import socket; print(socket.create_connection((%r, 7001), "
            "timeout=2).recv(2))" % address]), capture_output=True,
                               text=True, timeout=30, check=False)
        return "b'ok'" in probe.stdout

      assert reach(), "chief0 cannot reach ps0 before any cut"
      network.cut("ps0")
      assert not reach(), "ps0 still reachable while its link is down"
      network.mend("ps0")
      support.wait_until(reach, timeout=20, what="ps0 reachable after mend",
                         interval=0.5)
    finally:
      support.kill_group(server)
  finally:
    network.close()
  after = _ip_names()
  assert "sync-soak-%d" % os.getpid() not in after
  assert "srb%d" % os.getpid() not in after
  assert len(after.splitlines()) == len(before.splitlines()), after
