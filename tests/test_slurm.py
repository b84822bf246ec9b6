"""sync-replicas-slurm under a real single-node Slurm (issue 42).

The module's fixture starts Debian's Slurm daemons with ``tools/slurm``
(state in a temporary folder, stopped by pid at the end); each test runs a
job with srun or sbatch, every one bounded (a job Slurm cannot place stays
PENDING for good: the bound cancels it and says so). Where Slurm is not
installed the tests skip with the one line that enables them; with
SYNC_REPLICAS_REQUIRE_SLURM=1 (CI's .ci/run sets it, after installing Slurm)
they fail instead.

The parts that need no Slurm (the environment, the roles, the meeting
point) are tests/test_slurm_env.py's.
"""

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import uuid

import pytest

import support
import test_readme

ROOT = pathlib.Path(__file__).resolve().parents[1]
SLURM = support.load_tool("slurm")
BY_PATH = support.load_tool("_by_path.py")
DATA_END = support.load_tool("data_end")
REQUIRE_ENV = "SYNC_REPLICAS_REQUIRE_SLURM"
ENABLE = ("Slurm is not installed here: 'sudo tools/slurm install' (Debian, "
          "Ubuntu) installs it, and these tests then start their own")
#: A job's bound: a few TensorFlow imports and a short training, on two
#: loaded cores, take 20-50 s.
JOB_SECS = 240
#: After a task was killed or the job cancelled: every wrapper stops its
#: program within --grace (5 s) and Slurm kills what is left after KillWait
#: (10 s, tools/slurm).
STOP_SECS = 60

# Version-independent (tests/conftest.py): the Slurm wrapper and the
# launcher import no TensorFlow, and the programs their tasks run are tested
# under every TensorFlow elsewhere: CI runs this file under its newest only.
pytestmark = [pytest.mark.timeout(2 * JOB_SECS + 120),
              pytest.mark.version_independent]


class Slurm:
  """The running single-node Slurm: how to run jobs on it."""

  def __init__(self, directory):
    self.directory = directory

  def env(self, **more):
    """A job's environment: this checkout and venv, no outer Slurm job's."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env.update(SLURM.client_env(self.directory, {}))
    env.pop("TF_CONFIG", None)
    env.pop("SYNC_REPLICAS_BACKUPS", None)
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env["PATH"],
               # This checkout (tools/knockout's copy first, when set).
               PYTHONPATH=BY_PATH.child_pythonpath(env), PYTHONUNBUFFERED="1",
               TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0")
    env.update(more)
    return env

  def start(self, command, *, cwd, env=None):
    """Starts a client command (srun, sbatch); a ``Job`` to wait for."""
    name = "sr-test-%s" % uuid.uuid4().hex[:8]
    argv = [command[0], "--job-name", name, *command[1:]]
    proc = subprocess.Popen(argv, cwd=cwd, env=env or self.env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return Job(self, name, proc)

  def running(self):
    """The names of the jobs Slurm runs now."""
    out = subprocess.run(["squeue", "-h", "-t", "R", "-o", "%j"],
                         env=self.env(), capture_output=True, text=True,
                         timeout=30, check=False).stdout
    return set(out.split())

  def cancel(self, name):
    subprocess.run(["scancel", "--name", name], env=self.env(),
                   capture_output=True, timeout=30, check=False)


class Job:
  """One srun or sbatch --wait run, its output read as it comes."""

  def __init__(self, slurm, name, proc):
    self.slurm, self.name, self.proc = slurm, name, proc
    self.out = support.OutputLines(proc.stdout)

  def wait(self, timeout=JOB_SECS):
    """(exit code, output); cancels the job if it outlives ``timeout``."""
    try:
      self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.slurm.cancel(self.name)
      support.kill_group(self.proc)
      pytest.fail("job %s still ran after %d s (a job Slurm cannot place "
                  "stays PENDING): cancelled. Its output:\n%s"
                  % (self.name, timeout, self.out.finish()[-6000:]))
    finally:
      if self.proc.returncode is None:
        support.kill_group(self.proc)
    return self.proc.returncode, self.out.finish()

  def processes(self):
    """The pids of this job's tasks and their children, from /proc."""
    return _processes_with(b"SLURM_JOB_NAME=%s\0" % self.name.encode())


def _processes_with(marker):
  found = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        environ = pathlib.Path("/proc/%s/environ" % entry).read_bytes()
      except OSError:
        continue
      if marker in environ and support.pid_runs(int(entry)):
        found.append(int(entry))
  return found


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
  if not SLURM.have_slurm() or not support.is_machine_root():
    why = ENABLE if not SLURM.have_slurm() else (
        "the single-node Slurm of these tests runs its daemons as root")
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
      pytest.fail("%s (%s=1 makes this a failure, not a skip)"
                  % (why, REQUIRE_ENV), pytrace=False)
    pytest.skip(why)
  directory = tmp_path_factory.mktemp("slurm")
  SLURM.start(directory)
  try:
    yield Slurm(directory)
  finally:
    SLURM.stop(directory)


def _assert_ok(code, out, what):
  assert code == 0, "%s exited %d:\n%s" % (what, code, out[-6000:])


# --------------------------------------------- README, examples/*.sbatch


def test_readme_under_srun_and_every_example_sbatch_share_the_node(
    slurm, tmp_path):
  # Two jobs at once on one node: README's program under srun (an
  # allocation of its own, as under salloc) and each examples/*.sbatch with
  # sbatch --wait. Each task's port is free on the node when it starts, so
  # the jobs cannot take each other's.
  (tmp_path / "train.py").write_text(test_readme.quick_start_program(
      test_readme.README.read_text()))
  readme = slurm.start(["srun", "-n", "4", "sync-replicas-slurm", "--ps", "1",
                        "--", "python", "train.py", "--steps=200"],
                       cwd=tmp_path)
  scripts = sorted((ROOT / "examples").glob("*.sbatch"))
  assert scripts, "no examples/*.sbatch"
  batches = []
  for script in scripts:
    folder = tmp_path / script.stem
    folder.mkdir()
    batches.append((script, folder, slurm.start(
        ["sbatch", "--wait", "--chdir", str(folder), "--output",
         str(folder / "job.out"), str(script)], cwd=ROOT)))
  # Both at once: the README job runs while the first sbatch job does.
  support.wait_until(
      lambda: {readme.name, batches[0][2].name} <= slurm.running(),
      timeout=JOB_SECS, what="both jobs running at once", interval=0.2)
  code, out = readme.wait()
  _assert_ok(code, out, "README's program under srun")
  # README's program names itself as its TF_CONFIG does, as the labels do.
  for job, index in (("chief", 0), ("worker", 0), ("worker", 1)):
    done = re.findall(r"^\[%s%d\] %s%d done: global step (\d+),"
                      % (job, index, job, index), out, re.M)
    assert len(done) == 1, out[-6000:]
    assert 200 <= int(done[0]) <= 201, out[-6000:]
  for script, folder, job in batches:
    code, out = job.wait()
    log = (folder / "job.out").read_text(errors="replace")
    _assert_ok(code, out + log, "sbatch --wait %s" % script.name)
  digits = (tmp_path / "digits" / "job.out").read_text(errors="replace")
  found = re.findall(r"^\[chief0\] final test accuracy (\d\.\d+) .* at step "
                     r"(\d+)", digits, re.M)
  assert len(found) == 1 and float(found[0][0]) > 0.8, digits[-4000:]
  # The ps, which serves until stopped, was stopped: the step ended.
  assert "[ps0] ps0 serving" in digits, digits[-4000:]


# ------------------------------------------------ a data-end job, sbatch


def test_data_end_job_under_sbatch_trains_every_batch(slurm, tmp_path):
  # Uneven shards (issue 36): replicas whose inputs end at different times;
  # ours' default trains every batch and every process exits 0. The chief
  # reads the ps's record of trained batches once its session closed.
  shards = [5, 2, 8]
  args = DATA_END.parse(["--impl", "ours", "--shards", ",".join(
      map(str, shards)), "--init-tokens", "0", "--deadline", "120"])
  spec = DATA_END.spec(args, tmp_path)
  (tmp_path / "go").touch()  # No harness: every replica starts at once.
  events = tmp_path / "events"
  events.mkdir()
  script = tmp_path / "data_end.sbatch"
  script.write_text(
      "#!/bin/bash\n#SBATCH --ntasks=%d\nset -eu\n"
      "srun sync-replicas-slurm --ps 1 -- python %s\n"
      % (len(shards) + 1, ROOT / "tools" / "_data_end_task.py"))
  job = slurm.start(["sbatch", "--wait", "--output",
                     str(tmp_path / "job.out"), str(script)], cwd=tmp_path,
                    env=slurm.env(DATA_END_SPEC=json.dumps(spec),
                                  DATA_END_EVENTS=str(events)))
  code, out = job.wait()
  log = (tmp_path / "job.out").read_text(errors="replace")
  _assert_ok(code, out + log, "the data-end job")
  records = {}
  for path in events.glob("*.jsonl"):
    records[path.stem] = [json.loads(line) for line in
                          path.read_text().splitlines()]
  assert sorted(records) == ["chief0", "worker0", "worker1"], log[-4000:]
  for name, events_of in records.items():
    ended = [e for e in events_of if e["event"] == "ended"]
    assert [e.get("by") for e in ended] == ["data"], (name, events_of[-3:])
  final = [e for e in records["chief0"] if e["event"] == "final"]
  assert final and final[0]["trained"] == list(range(sum(shards))), (
      final, log[-4000:])


# -------------------------------------- TF1 flags, the unchanged script


def test_tf1_flags_run_an_unchanged_script_under_the_patch_runner(
    slurm, tmp_path):
  # A TF1 script that takes mnist_replica.py's flags and uses stock's class
  # (Supervisor, TF 0.12's recipe), run unchanged under sync-replicas-run:
  # the flags come from the wrapper, the class from the runner.
  script = ROOT / "tests" / "user_scripts" / "supervisor_tf012.py"
  # Cyclic: on one node the tasks land as under block, but the step says
  # cyclic, which the roles do not depend on.
  job = slurm.start(["srun", "-n", "3", "--distribution", "cyclic",
                     "sync-replicas-slurm", "--ps", "1", "--tf1-flags", "--", "sync-replicas-run", str(script),
                     "--train_steps=60", "--logdir=%s" % (tmp_path / "logs")],
                    cwd=tmp_path)
  code, out = job.wait()
  _assert_ok(code, out, "the TF1 script")
  for name in ("worker0", "worker1"):
    assert re.search(r"^\[%s\] optimizer: "
                     r"sync_replicas\.optimizer\.SyncReplicasOptimizer"
                     % name, out, re.M), out[-4000:]
    assert re.search(r"^\[%s\] .*final global step 60\b" % name, out,
                     re.M), out[-4000:]


# ------------------------------------------------- a task killed, scancel


def _digits_until_it_trains(slurm, tmp_path):
  job = slurm.start(["srun", "-n", "4", "sync-replicas-slurm", "--ps", "1",
                     "--", "python", "-m", "examples.digits", "--steps",
                     "1000000", "--log_every", "10", "--no_plot", "--logdir",
                     str(tmp_path / "logs")], cwd=ROOT)
  job.out.find(r"\[chief0\] step +11 ", "the chief's step 11",
               timeout=JOB_SECS)
  return job


def _assert_nothing_left(job):
  try:
    support.wait_until(lambda: not job.processes(), timeout=STOP_SECS,
                       what="every process of job %s to end" % job.name,
                       interval=0.2)
  except AssertionError:
    left = job.processes()
    for pid in left:  # Not left behind by a failed test either.
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    raise AssertionError("still running after the step ended: %s" % ", ".join(
        "%d (%s)" % (pid, _cmdline(pid).replace(b"\0", b" ").decode(
            errors="replace").strip()) for pid in left)) from None


def test_a_killed_task_stops_the_step_with_a_line_naming_it(slurm, tmp_path):
  job = _digits_until_it_trains(slurm, tmp_path)
  worker = [pid for pid in job.processes() if b'"type": "worker", "index": 0'
            in pathlib.Path("/proc/%d/environ" % pid).read_bytes()]
  assert len(worker) == 1, "expected one program of worker0: %s" % worker
  os.kill(worker[0], signal.SIGKILL)
  code, out = job.wait(timeout=STOP_SECS)
  assert code != 0, out[-4000:]
  said = "task worker0 on %s was killed by signal SIGKILL" % (
      SLURM.node_name())
  for task in (0, 1, 3):  # ps0, chief0, worker1
    assert re.search(r"^sync-replicas-slurm: task %d \(\w+ on \S+\): stopping:"
                     r" %s" % (task, re.escape(said)), out, re.M), out[-4000:]
  assert re.search(r"^sync-replicas-slurm: task 2 \(worker0 on \S+\): its "
                   r"program was killed by signal SIGKILL: stopping the step",
                   out, re.M), out[-4000:]
  _assert_nothing_left(job)


def test_scancel_stops_every_task_in_order(slurm, tmp_path):
  job = _digits_until_it_trains(slurm, tmp_path)
  slurm.cancel(job.name)
  code, out = job.wait(timeout=STOP_SECS)
  assert code != 0, out[-4000:]
  assert re.search(r"\*\*\* STEP \d+\.0 ON \S+ CANCELLED", out), out[-4000:]
  for task in range(4):
    assert re.search(r"^sync-replicas-slurm: task %d \(\w+ on \S+\): got "
                     r"SIGTERM \(scancel" % task, out, re.M), out[-4000:]
  _assert_nothing_left(job)


def test_a_killed_wrapper_takes_its_program_along(slurm, tmp_path):
  # kill -9 of a wrapper (the OOM killer's choice, say): its program must
  # not run on, orphaned, after the step; the other tasks stop, naming it.
  job = slurm.start(["srun", "-n", "3", "sync-replicas-slurm", "--ps", "1",
                     "--", "sleep", "600"], cwd=tmp_path)
  job.out.find(r"cluster \{", "the step's cluster", timeout=JOB_SECS)
  support.wait_until(lambda: len(_programs(job)) == 3, timeout=JOB_SECS,
                     what="three programs (sleep 600) running")
  wrapper = [pid for pid in job.processes()
             if b"SLURM_PROCID=1\0" in _environ(pid)
             and b"sync-replicas-slurm" in _cmdline(pid)]
  assert len(wrapper) == 1, "expected task 1's wrapper: %s" % wrapper
  os.kill(wrapper[0], signal.SIGKILL)
  code, out = job.wait(timeout=STOP_SECS)
  assert code != 0, out[-4000:]
  for task in (0, 2):
    assert re.search(r"^sync-replicas-slurm: task %d \(\w+ on \S+\): stopping: "
                     r"task chief0 on \S+ vanished" % task, out, re.M), out
  _assert_nothing_left(job)


def _environ(pid):
  try:
    return pathlib.Path("/proc/%d/environ" % pid).read_bytes()
  except OSError:
    return b""


def _cmdline(pid):
  try:
    return pathlib.Path("/proc/%d/cmdline" % pid).read_bytes()
  except OSError:
    return b""


def _programs(job):
  return [pid for pid in job.processes()
          if _cmdline(pid).startswith(b"sleep\x00600")]
