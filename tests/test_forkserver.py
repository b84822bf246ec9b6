"""The fork server of the suite's own task programs (tests/_forkserver.py).

A forked task must be handled as the fresh process it replaces: its pid is
its own (os.kill and support.kill_group reach it and its group), its exit
code or signal comes back as Popen gives it, its streams, argv, env and cwd
are the ones asked for, its random generators are its own, it dies with a
killed zygote, and nothing outlives a killed pytest. Most tests use a
zygote that preloads nothing (a fork is then a fraction of a second); one
preloads TensorFlow, as the suite's zygotes do, and runs a session in the
forked task with DeprecationWarnings made errors (Python 3.12+ warns of a
fork in a process with threads).
"""

import json
import logging
import os
import pathlib
import resource
import signal
import subprocess
import sys
import textwrap

import pytest

import _forkserver
import support


@pytest.fixture(scope="module")
def zygote():
  z = _forkserver.Zygote(dict(os.environ), preload=())
  yield z
  z.stop()


def _script(tmp_path, body, name="task.py"):
  path = tmp_path / name
  path.write_text(textwrap.dedent(body))
  return path


def _spawn(zygote, argv, **kwargs):
  kwargs.setdefault("env", dict(os.environ))
  task = _forkserver.spawn(argv, zygote=zygote, **kwargs)
  assert isinstance(task, _forkserver.ForkedTask), task
  return task


def test_argv_env_cwd_stdout_and_exit_code_are_the_requests(zygote, tmp_path):
  script = _script(tmp_path, """
      import json, os, sys
      print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(),
                        "x": os.environ.get("FORKED_X"),
                        "gone": "FORKED_GONE" in os.environ,
                        "name": __name__, "path0": sys.path[0],
                        "pgid": os.getpgid(0), "pid": os.getpid()}))
      sys.exit(3)
      """)
  workdir = tmp_path / "work"
  workdir.mkdir()
  os.environ["FORKED_GONE"] = "1"  # In the zygote's environment, not the task's.
  try:
    env = dict(os.environ, FORKED_X="forty two")
    env.pop("FORKED_GONE")
    task = _spawn(zygote, [sys.executable, str(script), "a b", "c"], env=env,
                  cwd=workdir, stdout=subprocess.PIPE)
  finally:
    del os.environ["FORKED_GONE"]
  assert task.wait(timeout=30) == 3
  assert task.returncode == 3 and task.poll() == 3
  seen = json.loads(task.stdout.read())
  task.stdout.close()
  assert seen == {"argv": [str(script), "a b", "c"], "cwd": str(workdir),
                  "x": "forty two", "gone": False, "name": "__main__",
                  "path0": str(tmp_path), "pgid": task.pid,
                  "pid": task.pid}
  assert task.pid != zygote.proc.pid


#: What a ``-m`` task prints of itself, then its exit code (4).
_SHOW_MODULE = """
import json, sys
print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0],
                  "main": sys.modules["__main__"].__dict__ is globals()}))
sys.exit(4)
"""


@pytest.mark.parametrize("module", ["pkg.mod", "pkg"],
                         ids=["module", "package_main"])
def test_a_forked_dash_m_task_is_what_a_fresh_one_is(zygote, tmp_path,
                                                       module):
  """``python -m MODULE args``, as the patch runner (a package's __main__)
  and the examples start: sys.argv (the module's file first), sys.path[0]
  (the working directory), __name__, __main__ and the exit code are a
  fresh process's."""
  package = tmp_path / "pkg"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "mod.py").write_text(_SHOW_MODULE)
  (package / "__main__.py").write_text(_SHOW_MODULE)
  argv = [sys.executable, "-m", module, "a b", "--c=d"]
  fresh = subprocess.run(argv, cwd=tmp_path, env=dict(os.environ),
                         stdin=subprocess.DEVNULL, capture_output=True,
                         timeout=60, check=False)
  task = _spawn(zygote, argv, cwd=tmp_path, stdout=subprocess.PIPE)
  assert task.wait(timeout=30) == fresh.returncode == 4, fresh.stderr
  forked = json.loads(task.stdout.read())
  task.stdout.close()
  assert forked == json.loads(fresh.stdout), fresh.stdout
  file = "mod.py" if module == "pkg.mod" else "__main__.py"
  assert forked == {"argv": [str(package / file), "a b", "--c=d"],
                    "name": "__main__", "path0": str(tmp_path),
                    "main": True}


def test_an_uncaught_exception_exits_1_with_its_traceback(zygote, tmp_path):
  script = _script(tmp_path, """
      import sys
      print("to stdout", flush=True)
      raise ValueError("the task's own error")
      """)
  log = tmp_path / "task.log"
  with open(log, "wb") as out:
    task = _spawn(zygote, [sys.executable, str(script)], stdout=out,
                  stderr=subprocess.STDOUT)
  assert task.wait(timeout=30) == 1
  text = log.read_text()
  assert "to stdout" in text
  assert "ValueError: the task's own error" in text
  assert "_forkserver" not in text.split("Traceback")[1].split("\n")[1], text


def test_kill_group_kills_the_task_and_its_children(zygote, tmp_path):
  script = _script(tmp_path, """
      import subprocess, sys, time
      child = subprocess.Popen(["sleep", "120"])
      print(child.pid, flush=True)
      time.sleep(120)
      """)
  task = _spawn(zygote, [sys.executable, str(script)], stdout=subprocess.PIPE)
  grandchild = int(task.stdout.readline())
  task.stdout.close()
  assert task.poll() is None and task.returncode is None
  with pytest.raises(subprocess.TimeoutExpired):
    task.wait(timeout=0.1)
  support.kill_group(task)
  assert task.returncode == -signal.SIGKILL
  support.wait_until(lambda: not support.pid_runs(grandchild), timeout=10,
                     what="the task's own child to die with its group")


def test_a_tasks_cpu_counts_once_its_exit_is_read(zygote, tmp_path):
  """As a fresh child's counts in RUSAGE_CHILDREN once it is reaped
  (tests/conftest.py's CPU per test adds ``cpu_secs``)."""
  script = _script(tmp_path, """
      import time
      end = time.process_time() + 0.5
      while time.process_time() < end:
        pass
      """)
  before = _forkserver.cpu_secs()
  task = _spawn(zygote, [sys.executable, str(script)])
  assert task.wait(timeout=60) == 0
  assert 0.45 <= _forkserver.cpu_secs() - before < 5, (
      before, _forkserver.cpu_secs())


def test_a_signal_the_task_dies_of_is_minus_its_number(zygote, tmp_path):
  script = _script(tmp_path, """
      import os, signal
      os.kill(os.getpid(), signal.SIGTERM)
      """)
  task = _spawn(zygote, [sys.executable, str(script)])
  assert task.wait(timeout=30) == -signal.SIGTERM


def test_a_task_is_not_reaped_before_its_status_is_read(zygote, tmp_path):
  """Until the handle read the status, the pid stays the task's (a zombie):
  a killpg by it cannot reach another process, as with Popen."""
  script = _script(tmp_path, "pass\n")
  task = _spawn(zygote, [sys.executable, str(script)])
  support.wait_until(lambda: not support.pid_runs(task.pid), timeout=30,
                     what="the task to exit")
  state = pathlib.Path("/proc/%d/stat" % task.pid).read_text()
  assert state.rsplit(")", 1)[1].split()[0] == "Z", state
  assert task.wait(timeout=30) == 0
  support.wait_until(
      lambda: not pathlib.Path("/proc/%d" % task.pid).exists(), timeout=30,
      what="the zygote to reap the task once its status was read")


def test_forked_tasks_draw_their_own_random_numbers(zygote, tmp_path):
  # numpy is imported in the zygote here as TensorFlow imports it there.
  script = _script(tmp_path, """
      import random
      import numpy
      print(random.random(), numpy.random.random())
      """)
  drawn = []
  for _ in range(2):
    task = _spawn(zygote, [sys.executable, str(script)],
                  stdout=subprocess.PIPE)
    assert task.wait(timeout=30) == 0
    drawn.append(task.stdout.read().split())
    task.stdout.close()
  assert drawn[0][0] != drawn[1][0] and drawn[0][1] != drawn[1][1], drawn


def test_a_killed_zygote_takes_its_tasks_and_spawn_falls_back(
    tmp_path, caplog):
  zygote = _forkserver.Zygote(dict(os.environ), preload=("numpy",))
  script = _script(tmp_path, "import time; print('up', flush=True); "
                   "time.sleep(120)\n")
  try:
    task = _spawn(zygote, [sys.executable, str(script)],
                  stdout=subprocess.PIPE)
    assert task.stdout.readline() == b"up\n"
    task.stdout.close()
    os.kill(zygote.proc.pid, signal.SIGKILL)
    assert task.wait(timeout=30) == -signal.SIGKILL
    support.wait_until(lambda: not support.pid_runs(task.pid), timeout=10,
                       what="PR_SET_PDEATHSIG to kill the task")
    with caplog.at_level(logging.WARNING, logger=_forkserver.LOG.name):
      fresh = _forkserver.spawn([sys.executable, str(script)],
                                zygote=zygote, stdout=subprocess.PIPE)
    assert isinstance(fresh, subprocess.Popen)
    assert fresh.stdout.readline() == b"up\n"
    support.kill_group(fresh)
    fresh.stdout.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "starting %s fresh" % script in lines[0], lines
  finally:
    zygote.stop()


#: select() takes descriptors below this number only (glibc's FD_SETSIZE).
FD_SETSIZE = 1024


def test_descriptors_numbered_past_select_s_limit_are_waited_on(tmp_path):
  """select() fails ("filedescriptor out of range") on a descriptor numbered
  1024 or more, which a pytest process running several clusters reached
  (TensorFlow 2.15, three files in one process). With every lower number
  taken, the zygote's control socket (on both sides: the zygote keeps the
  number it is passed), the task's status socket and the task's pipe all
  get higher numbers, and every wait on them still works."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  need = FD_SETSIZE + 200
  if hard != resource.RLIM_INFINITY and hard < need:
    pytest.skip("the hard limit on open files (%d) is under %d" % (hard, need))
  resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
  fillers = []
  try:
    # os.open returns the lowest free number: once it returns one past
    # FD_SETSIZE, every number below is taken, so all later ones are higher.
    while not fillers or fillers[-1] <= FD_SETSIZE:
      fillers.append(os.open(os.devnull, os.O_RDONLY))
    script = _script(tmp_path, """
        import sys
        print(sys.stdin.fileno(), sys.stdout.fileno(), flush=True)
        sys.exit(5)
        """)
    zygote = _forkserver.Zygote(dict(os.environ), preload=())
    try:
      task = _spawn(zygote, [sys.executable, str(script)],
                    stdout=subprocess.PIPE)
      assert task.stdout.fileno() > FD_SETSIZE, task.stdout.fileno()
      # The task's streams are 0-2 as ever; what it prints proves it ran.
      assert task.stdout.readline() == b"0 1\n"
      task.stdout.close()
      assert task.wait(timeout=30) == 5
      assert task.returncode == 5
      # The zygote still serves: its loop waits on the high number too.
      again = _spawn(zygote, [sys.executable, str(script)],
                     stdout=subprocess.DEVNULL)
      assert again.wait(timeout=30) == 5
    finally:
      zygote.stop()
  finally:
    for fd in fillers:
      os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_nothing_outlives_a_killed_pytest(tmp_path):
  """The test's process SIGKILLed: the zygote sees its socket close, kills
  its tasks and exits."""
  script = _script(tmp_path, "import time; time.sleep(120)\n")
  parent = _script(tmp_path, """
      import os, subprocess, sys, time
      sys.path.insert(0, %r)
      import _forkserver
      zygote = _forkserver.Zygote(dict(os.environ), preload=())
      task = _forkserver.spawn([sys.executable, %r], zygote=zygote)
      print(zygote.proc.pid, task.pid, flush=True)
      time.sleep(120)
      """ % (str(pathlib.Path(__file__).parent), str(script)), "parent.py")
  proc = subprocess.Popen([sys.executable, str(parent)],
                          stdout=subprocess.PIPE, start_new_session=True)
  try:
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(support.pid_runs(p) for p in pids), pids
  finally:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
  for pid in pids:
    support.wait_until(lambda p=pid: not support.pid_runs(p), timeout=30,
                       what="process %d to end with the test's process" % pid)


def test_what_a_zygote_cannot_serve_starts_fresh(zygote, tmp_path):
  script = _script(tmp_path, "pass\n")
  for argv, kwargs in [
      (["sh", "-c", "exit 0"], {}),
      ([sys.executable, "-c", "pass"], {}),
      ([sys.executable, str(script)], {"start_new_session": False}),
      ([sys.executable, str(script)], {"preexec_fn": os.getpid}),
      ([sys.executable, str(script)], {"stdin": subprocess.PIPE}),
      ([sys.executable, str(script)],
       {"env": dict(os.environ, **{_forkserver.ENV: "0"})})]:
    proc = _forkserver.spawn(argv, zygote=zygote, **kwargs)
    assert isinstance(proc, subprocess.Popen), argv
    assert proc.wait(timeout=30) == 0


@pytest.mark.timeout(180)
def test_a_task_forked_after_tensorflow_runs_a_session(tmp_path):
  """As the suite's zygotes: TensorFlow preloaded (so the zygote has more
  than one OS thread), DeprecationWarnings errors, Keras hidden."""
  env = dict(os.environ, PYTHONWARNINGS="error::DeprecationWarning",
             TF_CPP_MIN_LOG_LEVEL="2")
  zygote = _forkserver.Zygote(env)
  try:
    threads = _forkserver.threads_of(zygote.proc.pid)
    script = _script(tmp_path, """
        import json, sys
        import tensorflow as tf
        tf.compat.v1.disable_eager_execution()
        server = tf.distribute.Server.create_local_server()
        with tf.compat.v1.Session(server.target) as sess:
          value = sess.run(tf.reduce_sum(tf.range(10)))
        print(json.dumps({"sum": int(value),
                          "keras": "keras" in sys.modules}))
        """)
    log = tmp_path / "task.log"
    with open(log, "wb") as err:
      task = _spawn(zygote, [sys.executable, str(script)], env=env,
                    stdout=subprocess.PIPE, stderr=err)
    assert task.wait(timeout=120) == 0, log.read_text()
    assert json.loads(task.stdout.read()) == {"sum": 45, "keras": False}
    task.stdout.close()
    assert "Warning" not in log.read_text(), log.read_text()
  finally:
    zygote.stop()
  assert len(threads) > 1, threads
