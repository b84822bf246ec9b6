"""sync-replicas-slurm's parts that need no Slurm: the step's environment,
the roles, and the meeting point of its tasks (in this process, on loopback).

tests/test_slurm.py runs the whole command under a real Slurm.
"""

import os
import socket
import subprocess
import sys
import threading

import pytest

from sync_replicas import _ports
from sync_replicas.cli import _rendezvous
from sync_replicas.cli import _slurm_env
from sync_replicas.cli import slurm

# Version-independent (tests/conftest.py): the Slurm wrapper's environment
# and meeting point import no TensorFlow: CI runs this file under its newest
# TensorFlow only.
pytestmark = [pytest.mark.quick, pytest.mark.version_independent]

Slot = _slurm_env.Slot


@pytest.mark.parametrize("text, hosts", [
    ("vm", ["vm"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("node[8-11],login1", ["node8", "node9", "node10", "node11", "login1"]),
    ("a[1-2],b,c[009-010]", ["a1", "a2", "b", "c009", "c010"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("gpu-[1,3]-x", ["gpu-1-x", "gpu-3-x"]),
], ids=["one", "ranges", "unpadded-and-plain", "mixed", "two-groups",
        "suffix"])
def test_hostlist_expands_as_slurm_does(text, hosts):
  assert _slurm_env.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, words", [
    ("node[01-03", r"unbalanced '\['"), ("node]1", "unbalanced '\\]'"),
    ("node[a-b]", "bad range"), ("node[3-1]", "descending"),
    ("a,,b", "empty host name"), ("n[[1]]", "nested"),
], ids=["open", "close", "letters", "descending", "empty", "nested"])
def test_bad_hostlist_says_what_is_wrong(text, words):
  with pytest.raises(_slurm_env.SlurmEnvError, match=words):
    _slurm_env.expand_hostlist(text)


@pytest.mark.parametrize("text, counts", [
    ("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]),
], ids=["one", "repeat-first", "repeat-last"])
def test_tasks_per_node_expand(text, counts):
  assert _slurm_env.expand_tasks_per_node(text) == counts


def test_bad_tasks_per_node_says_what_is_expected():
  with pytest.raises(_slurm_env.SlurmEnvError, match=r"expected N or N\(xR\)"):
    _slurm_env.expand_tasks_per_node("2(3)")


def test_layout_takes_local_id_0_of_every_node_first():
  nodes = ["n1", "n2", "n3"]
  assert _slurm_env.layout(nodes, [3, 1, 2]) == [
      Slot("n1", 0), Slot("n2", 0), Slot("n3", 0), Slot("n1", 1),
      Slot("n3", 1), Slot("n1", 2)]
  with pytest.raises(_slurm_env.SlurmEnvError, match="3 nodes .* 2 counts"):
    _slurm_env.layout(nodes, [1, 1])


def _env(procid, node_id, local_id, *, nodes="n[1-2]", per_node="2(x2)",
         tasks=4, **more):
  env = {"SLURM_JOB_ID": "17", "SLURM_STEP_ID": "0",
         "SLURM_PROCID": str(procid), "SLURM_NODEID": str(node_id),
         "SLURM_LOCALID": str(local_id), "SLURM_STEP_NUM_TASKS": str(tasks),
         "SLURM_STEP_NODELIST": nodes, "SLURM_STEP_TASKS_PER_NODE": per_node}
  env.update(more)
  return env


# Where Slurm puts procids 0..3 on two nodes of two tasks each: node id and
# local id, per distribution. Arbitrary: a hostfile's order n2, n1, n1, n2.
DISTRIBUTIONS = {
    "block": [(0, 0), (0, 1), (1, 0), (1, 1)],
    "cyclic": [(0, 0), (1, 0), (0, 1), (1, 1)],
    "arbitrary": [(1, 0), (0, 0), (0, 1), (1, 1)],
}


@pytest.mark.parametrize("distribution", sorted(DISTRIBUTIONS))
def test_every_distribution_gives_each_slot_to_exactly_one_task(distribution):
  steps = [_slurm_env.read_step(_env(procid, node, local))
           for procid, (node, local) in enumerate(DISTRIBUTIONS[distribution])]
  assert sorted(s.me for s in steps) == [0, 1, 2, 3]
  # Whoever has a slot, the slot is on the task's own node.
  for step, (node, local) in zip(steps, DISTRIBUTIONS[distribution],
                                 strict=True):
    assert step.slots[step.me] == Slot("n%d" % (node + 1), local)
    assert step.slots == steps[0].slots


def test_read_step_falls_back_to_the_jobs_variables():
  env = _env(0, 0, 0)
  del env["SLURM_STEP_NODELIST"], env["SLURM_STEP_TASKS_PER_NODE"]
  env.update(SLURM_JOB_NODELIST="n[1-2]", SLURM_TASKS_PER_NODE="2(x2)")
  assert _slurm_env.read_step(env).me == 0


@pytest.mark.parametrize("change, words", [
    ({"SLURM_NODEID": None, "SLURM_STEP_NODELIST": None},
     "SLURM_NODEID, SLURM_STEP_NODELIST unset. Start it with srun"),
    ({"SLURM_STEP_NUM_TASKS": "5"}, "add up to 4 tasks, but "
     "SLURM_STEP_NUM_TASKS is 5"),
    ({"SLURM_NODEID": "2"}, "outside the step's node list"),
    ({"SLURM_LOCALID": "2"}, "beyond the 2\\(x2\\) tasks on node n1"),
    ({"SLURMD_NODENAME": "n2"}, "SLURMD_NODENAME is n2 but node 0"),
    ({"SLURM_LOCALID": "x"}, "not a number"),
], ids=["not-srun", "count", "node-id", "local-id", "node-name", "number"])
def test_read_step_refuses_an_inconsistent_environment(change, words):
  env = _env(0, 0, 0)
  for name, value in change.items():
    if value is None:
      env.pop(name)
    else:
      env[name] = value
  with pytest.raises(_slurm_env.SlurmEnvError, match=words):
    _slurm_env.read_step(env)


def _roles(num_ps, tf1_flags, tasks=4):
  step = _slurm_env.read_step(_env(0, 0, 0, nodes="n1", per_node=str(tasks),
                                   tasks=tasks))
  return slurm.Roles(step, num_ps, tf1_flags)


def test_roles_are_ps_then_chief_then_workers():
  roles = _roles(1, False)
  assert [roles.of(i) for i in range(4)] == [
      ("ps", 0), ("chief", 0), ("worker", 0), ("worker", 1)]
  assert roles.command(["python", "x.py"], ["a:1", "b:2"], 1) == [
      "python", "x.py"]


def test_tf1_flags_make_worker_0_the_chief_and_name_every_host():
  roles = _roles(2, True)
  addresses = ["n1:1", "n1:2", "n1:3", "n1:4"]
  assert [roles.of(i) for i in range(4)] == [
      ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]
  assert roles.command(["python", "mnist_replica.py", "--x"], addresses,
                       3) == [
      "python", "mnist_replica.py", "--x", "--job_name", "worker",
      "--task_index", "1", "--ps_hosts", "n1:1,n1:2", "--worker_hosts",
      "n1:3,n1:4"]


def test_candidate_ports_are_the_same_in_every_task_and_differ_by_step(
    monkeypatch):
  monkeypatch.delenv("SYNC_REPLICAS_PORT_RANGE", raising=False)
  first = _rendezvous.candidate_ports("17.0")
  assert first == _rendezvous.candidate_ports("17.0")
  assert len(set(first)) == _rendezvous.CANDIDATES
  assert all(_rendezvous.PORT_LOW <= p < _rendezvous.PORT_HIGH for p in first)
  assert first != _rendezvous.candidate_ports("17.1")
  assert first != _rendezvous.candidate_ports("18.0")


def test_candidate_ports_keep_to_the_test_runners_port_range(monkeypatch):
  monkeypatch.setenv("SYNC_REPLICAS_PORT_RANGE", "20000-20100")
  assert all(20000 <= p < 20100 for p in _rendezvous.candidate_ports("17.0"))


def _meet(key, count, *, ps=1):
  """A service of step ``key`` and ``count`` clients that met there."""
  service = _rendezvous.Service(key, count, is_ps=[i < ps for i in range(count)],
                                names=["t%d" % i for i in range(count)])
  clients = [None] * count

  def connect(slot):
    clients[slot] = _rendezvous.Client.connect(
        "127.0.0.1", key, slot, "h:%d" % slot, timeout=20)

  threads = [threading.Thread(target=connect, args=(i,)) for i in range(count)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  assert all(clients), "not every client met the service"
  for c in clients:
    c.settimeout(20)
    assert c.receive() == {"cluster": ["h:%d" % i for i in range(count)]}
  return service, clients


def test_ps_tasks_are_told_to_stop_once_every_replica_ended_well():
  service, (ps, chief, worker) = _meet("t1.0", 3)
  try:
    chief.send_exit("ok")
    worker.send_exit("ok")
    assert ps.receive() == {"stop": "every replica finished"}
    ps.send_exit("ok")
    assert service.finished.wait(20)
  finally:
    service.close()


def test_a_failed_or_vanished_task_stops_every_other_one():
  service, (ps, chief, worker) = _meet("t2.0", 3)
  try:
    worker.send_exit("was killed by signal SIGKILL")
    why = "task t2 was killed by signal SIGKILL"
    assert ps.receive() == {"abort": why}
    assert chief.receive() == {"abort": why}
  finally:
    service.close()
  service, (ps, chief, worker) = _meet("t3.0", 3)
  try:
    chief.close()
    assert worker.receive()["abort"].startswith(
        "task t1 vanished: its wrapper (sync-replicas-slurm) was killed")
  finally:
    service.close()


def _squat_first_candidate(prefix):
  """``(key, listening socket)``: a step key whose first candidate port the
  socket holds and whose second was free a moment ago. The suite's other
  processes run beside this one, and their servers may hold any fixed
  port (a whole-suite run drew t4.0's first candidate): the key is drawn
  until its ports are ours to use."""
  for attempt in range(40):
    key = "%s.%d" % (prefix, attempt)
    first, second = _rendezvous.candidate_ports(key)[:2]
    squatter = socket.socket()
    # As the service binds: a port an earlier test's connections left in
    # TIME_WAIT (CI drew one) binds all the same.
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    probe = socket.socket()
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      squatter.bind(("", first))
      probe.bind(("", second))
    except OSError:
      squatter.close()
      continue
    finally:
      probe.close()
    squatter.listen(4)
    return key, squatter
  raise AssertionError("40 step keys %s.N had a candidate port held by "
                       "another process" % prefix)


def test_two_steps_on_one_node_meet_only_their_own_tasks(monkeypatch):
  # Another program (or another step's service) holds the step's first
  # candidate port: the service takes the next, and clients pass over the
  # one that does not welcome them (after a shorter wait than a real
  # step's, to keep the quick tier quick).
  monkeypatch.setattr(_rendezvous, "HELLO_SECS", 0.5)
  key, squatter = _squat_first_candidate("t4")
  try:
    service, clients = _meet(key, 2)
    assert service.port == _rendezvous.candidate_ports(key)[1]
    other, other_clients = _meet("t5.0", 2)
    for c in clients + other_clients:
      c.close()
    service.close()
    other.close()
  finally:
    squatter.close()


def test_meeting_point_and_program_ports_never_meet(tmp_path, monkeypatch):
  # CI saw it: worker0's wrapper drew a port for its program, slot 0's
  # wrapper then bound the same port for the meeting point (one of the
  # step's candidates), and the program failed with "Could not start gRPC
  # server". A wrapper never draws its step's candidates, and the service
  # never binds a port a live wrapper reserved.
  monkeypatch.setattr(_ports, "RESERVED_DIR", str(tmp_path))
  key = "t6.0"
  candidates = _rendezvous.candidate_ports(key)
  draws = iter(candidates[:3] + [candidates[0] + 1])
  real_free_ports = _ports.free_ports
  monkeypatch.setattr(_ports, "free_ports", lambda count: [next(draws)])
  port = _ports.reserve_free_port(exclude=candidates)
  assert port == candidates[0] + 1 and port not in candidates
  monkeypatch.setattr(_ports, "free_ports", real_free_ports)
  holder = subprocess.Popen([sys.executable, "-c", "import time; "
                             "time.sleep(60)"])
  try:
    (tmp_path / str(candidates[0])).write_text("%d\n" % holder.pid)
    service, clients = _meet(key, 2)
    try:
      assert service.port == candidates[1]
      assert (tmp_path / str(candidates[1])).read_text().split() == [
          str(os.getpid())]
    finally:
      for c in clients:
        c.close()
      service.close()
    # Closed: its reservation ends; the other holder's stays.
    assert not (tmp_path / str(candidates[1])).exists()
    assert (tmp_path / str(candidates[0])).exists()
  finally:
    holder.kill()
    holder.wait(timeout=30)
    _ports.release_port(port)


def test_a_port_reserved_by_a_live_wrapper_is_never_drawn_again(
    tmp_path, monkeypatch):
  # Two wrappers on one node each draw a port for a program that binds it
  # seconds later: the second must not get the first's. The draws are
  # forced (first 20001, then 20002, ...), the reservations are real files.
  monkeypatch.setattr(_ports, "RESERVED_DIR", str(tmp_path))
  draws = iter(range(20001, 20100))
  monkeypatch.setattr(_ports, "free_ports", lambda count: [next(draws)])
  other = subprocess.Popen([sys.executable, "-c", "import time; "
                            "time.sleep(60)"])
  try:
    (tmp_path / "20001").write_text("%d\n" % other.pid)
    dead = subprocess.run([sys.executable, "-c", "import os; "
                           "print(os.getpid())"], capture_output=True,
                          text=True, check=True, timeout=60)
    (tmp_path / "20002").write_text(dead.stdout)
    port = _ports.reserve_free_port()
    # 20001's holder lives: skipped. 20002's died: its reservation is
    # taken over on that draw.
    assert port == 20002
    assert (tmp_path / "20002").read_text().split() == [str(os.getpid())]
    assert (tmp_path / "20001").exists()
    _ports.release_port(20001)  # Not ours: left alone.
    assert (tmp_path / "20001").exists()
    _ports.release_port(port)
    assert not (tmp_path / "20002").exists()
  finally:
    other.kill()
    other.wait(timeout=30)
