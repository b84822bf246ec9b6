"""README's quick start program, extracted and run as 1 ps + 3 worker processes.

Issue 27, item 6: the quick start did not run as written (eager mode on,
undefined names, no ps branch), and a worker started after the chief had
finished waited for good in CreateSession (no ``device_filters``). The fenced
python block under README's "Quick start" heading is the single source: each
test writes it to a file and starts it once per task on 127.0.0.1, in a start
order, each task in a process group of its own, and every process, the ps
included, must exit 0 having seen the final global step.

A task counts as started once its gRPC server accepts connections, so in
"chief last" the other three were up, and waiting, before the chief's
process began.
"""

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

import support
from sync_replicas import _ports

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HEADING = "## Quick start"
#: Few steps: what is tested is how the tasks start and end, not learning.
STEPS = 20
#: Seconds for one start order to end: four TensorFlow imports (about 3
#: CPU-seconds each) on two cores that other tests share, a few seconds of
#: training, and the exits.
RUN_SECS = 150
#: Seconds for one task's server to come up (its TensorFlow import).
START_SECS = 60
_DONE = re.compile(r"^worker (\d) done: global step (\d+),", re.M)

#: Each entry starts once the one before it has its server up; an entry
#: ``(task, [others])`` starts only once ``others`` have exited.
ORDERS = [
    pytest.param(["ps", "worker0", "worker1",
                  ("worker2", ["worker0", "worker1"])],
                 id="chief_first_and_a_worker_after_the_others_ended"),
    pytest.param(["ps", "worker1", "worker2", "worker0"], id="chief_last"),
    pytest.param(["worker2", "worker0", "worker1", "ps"], id="ps_last"),
]


def quick_start_program(text):
  """The complete program in the python blocks under README's quick start."""
  parts = text.split("\n" + HEADING, 1)
  assert len(parts) == 2, "README.md has no heading starting %r" % HEADING
  section = parts[1].split("\n## ", 1)[0]
  blocks = re.findall(r"^```python\n(.*?)^```$", section, re.S | re.M)
  programs = [b for b in blocks if 'if __name__ == "__main__":' in b]
  assert len(programs) == 1, (
      "want one complete program (a ```python block with `if __name__ == "
      "\"__main__\":`) under README's %r heading, found %d among %d python "
      "blocks" % (HEADING, len(programs), len(blocks)))
  return programs[0]


def test_quick_start_is_one_program_with_device_filters():
  program = quick_start_program(README.read_text())
  compile(program, "README.md quick start", "exec")
  assert "device_filters" in program
  assert "disable_eager_execution()" in program


class _Tasks:
  """The quick start's processes: one ps and three workers on free ports."""

  def __init__(self, tmp_path):
    self._dir = tmp_path
    self._program = tmp_path / "train.py"
    self._program.write_text(quick_start_program(README.read_text()))
    ports = _ports.free_ports(4)
    self.ports = dict(zip(["ps", "worker0", "worker1", "worker2"], ports,
                          strict=True))
    self._hosts = ["--ps_host", "%s:%d" % (_ports.LOOPBACK, ports[0]),
                   "--worker_hosts", ",".join(
                       "%s:%d" % (_ports.LOOPBACK, p) for p in ports[1:])]
    self._env = dict(os.environ, PYTHONPATH=support.pythonpath(ROOT),
                     TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    self._env.pop("TF_CONFIG", None)
    self.procs = {}

  def start(self, name):
    """Starts task ``name`` ("ps", "worker0"...); returns once it serves."""
    job, index = ("ps", 0) if name == "ps" else ("worker", int(name[-1]))
    with open(self.log(name), "wb") as log:
      proc = subprocess.Popen(
          [sys.executable, str(self._program), "--job_name=%s" % job,
           "--task_index=%d" % index, "--steps=%d" % STEPS, *self._hosts],
          cwd=self._dir, env=self._env, stdout=log, stderr=subprocess.STDOUT,
          start_new_session=True)
    self.procs[name] = proc
    support.wait_until(
        lambda: proc.poll() is not None or _serves(self.ports[name]),
        timeout=START_SECS, interval=0.1,
        what="%s's server on port %d" % (name, self.ports[name]))
    assert proc.returncode is None, "%s exited %d before serving:\n%s" % (
        name, proc.returncode, self.tail(name))

  def wait_for_exit(self, names, timeout):
    def exited():
      return all(self.procs[n].poll() is not None for n in names)
    try:
      support.wait_until(exited, timeout=timeout, interval=0.1,
                         what="%s to exit" % ", ".join(names))
    except AssertionError as e:
      running = [n for n in names if self.procs[n].poll() is None]
      raise AssertionError("%s; still running: %s\n%s" % (
          e, running, "\n".join(self.tail(n) for n in running))) from None

  def log(self, name):
    return self._dir / ("%s.log" % name)

  def tail(self, name, chars=3000):
    return "--- %s:\n%s" % (name, self.log(name).read_text(
        errors="replace")[-chars:])

  def kill(self):
    for proc in self.procs.values():
      support.kill_group(proc)


def _serves(port):
  try:
    socket.create_connection((_ports.LOOPBACK, port), timeout=1).close()
  except OSError:
    return False
  return True


@pytest.mark.timeout(4 * START_SECS + RUN_SECS + 60)
@pytest.mark.parametrize("order", ORDERS)
def test_quick_start_runs_and_every_task_exits_0(tmp_path, order):
  tasks = _Tasks(tmp_path)
  try:
    for entry in order:
      name, after = entry if isinstance(entry, tuple) else (entry, [])
      if after:
        tasks.wait_for_exit(after, timeout=RUN_SECS)
      tasks.start(name)
    tasks.wait_for_exit(list(tasks.procs), timeout=RUN_SECS)
  finally:
    tasks.kill()
  failed = [n for n, p in tasks.procs.items() if p.returncode != 0]
  assert not failed, "exit codes %s\n%s" % (
      {n: p.returncode for n, p in tasks.procs.items()},
      "\n".join(tasks.tail(n) for n in failed))
  for index in range(3):
    out = tasks.log("worker%d" % index).read_text(errors="replace")
    done = _DONE.findall(out)
    assert len(done) == 1 and done[0][0] == str(index), tasks.tail(
        "worker%d" % index)
    # The chief stops at STEPS; an update the queue runner applies while it
    # stops may add one.
    assert STEPS <= int(done[0][1]) <= STEPS + 1, tasks.tail(
        "worker%d" % index)
