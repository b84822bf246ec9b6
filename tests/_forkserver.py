"""A fork server (zygote) for the suite's task programs and user repeat runs.

Each task process the fault tests start (tests/crash_task.py,
tests/lost_task.py, tools/_data_end_task.py) spends 2.5-2.7 of its 3.5-7
CPU-seconds importing TensorFlow. The zygote imports it once per pytest
process and forks every task from there: a 1 ps + 3 worker cluster of 200
steps measured 1.4-1.8 CPU-seconds forked against 14.1-15.4 fresh.

What it forks: the project's OWN task programs (support.start_task), and
the REPEAT runs of a user's program (support.start_repeat_run). Each way a
user starts a program keeps one FRESH proof in the default tier: ``python
SCRIPT.py`` (README's program, the user scripts as written), ``python -m
sync_replicas.patch SCRIPT.py`` (the patch runner), ``python -m
examples.MODULE``, the launcher (whose children are its own: never
forked), and every test that checks what a process prints as it starts
(TensorFlow's start-up lines) or its import environment. Beyond that one
proof, a repeat run of a user's program (another start order, another
script under the same runner) is forked: it proves the program's sync
behaviour, not how a Python process starts, and the forked child still
runs the unmodified program as ``__main__`` with the same argv, env and
cwd. start_repeat_run's docstring names the fresh proof of each way.

How it works
------------
``spawn(argv, env=..., stdout=..., ...)`` returns a ``ForkedTask``, a
``subprocess.Popen`` look-alike, or a real ``Popen`` where forking would
not give what a fresh process gives (``fresh_reason`` says when). The
zygote is ``python tests/_forkserver.py`` with one end of a SOCK_SEQPACKET
socket pair; it imports ``PRELOAD`` (TensorFlow, without Keras, as the
tasks import it: tests/_hidden_from_tasks is on the PYTHONPATH the request
carries) and nothing else of the project, so that a task's
``import sync_replicas`` finds whatever its PYTHONPATH names first
(tools/knockout's patched copy included).

A request is a JSON message (argv, env, cwd) with four descriptors passed
by SCM_RIGHTS: a per-task socket, stdin, stdout and stderr. The zygote
forks from its main thread; the child calls setsid (start_new_session),
PR_SET_PDEATHSIG(SIGKILL) (so a killed zygote takes its tasks along),
dup2s the three streams onto 0-2, closes the zygote's descriptors, resets
the zygote's signal handlers, replaces os.environ with the request's
(putenv included), chdirs, reseeds numpy's global generator (``random``
reseeds itself after a fork), sets sys.argv and sys.path[0] as ``python
SCRIPT`` or ``python -m MODULE`` would (the script's folder, or the
working directory), and returns out of the zygote's loop to run the
script with ``runpy.run_path(..., run_name="__main__")``, or the module
with ``runpy.run_module(..., run_name="__main__", alter_sys=True)`` (which
sets sys.argv[0] to its file, as ``-m`` does), at the top level:
SystemExit, an uncaught exception's traceback and exit code 1, atexit
handlers and the interpreter's exit are those of a fresh process. (Under
``-m`` a fresh traceback shows two frames of runpy's before the module's,
which a forked one leaves out, and a module that is not found is an
ImportError's traceback, not the interpreter's one line; both exit 1.)

The per-task socket carries the task's pid, then, once it exited, its
status (the exit code, or minus the signal number as Popen gives it). The
zygote finds exits with ``waitid(WNOWAIT)`` and reaps a task only after
the test's side read the status and closed the socket: until then the
task is a zombie whose pid (its group's id) no other process can get, the
guarantee ``Popen`` gives and that support.kill_group's killpg relies on.

Lifetime: one zygote per pytest process and start-up environment
(``_startup_key``), started on first use, reused, ended at exit. If the
pytest process dies, the zygote reads end-of-file on its socket, SIGKILLs
its tasks' groups and exits; if the zygote dies, PR_SET_PDEATHSIG kills
its tasks. A zygote that cannot start (or died) makes ``spawn`` start a
fresh process instead, with one log line: never a hang, every wait bounded.

Fork with threads
-----------------
After ``import tensorflow`` the zygote has two OS threads (``threads_of``;
TensorFlow 2.21 on Python 3.11 and 3.13, seen with gdb): its main thread
and OpenBLAS's ``blas_thread_server`` (numpy's BLAS, which TensorFlow
imports), idle on a condition variable. OpenBLAS registers a
pthread_atfork handler that stops that thread before every fork and
starts it again when next needed, in parent or child; glibc holds
malloc's locks across a fork itself; TensorFlow's own pools start with
the servers and sessions the tasks build, in the child. So no thread
holds a lock the child needs, and Python 3.12+'s DeprecationWarning about
forking with threads does not come (CPython counts the threads after the
fork, when OpenBLAS's is gone: the zygote has one thread after its first
fork). It is not silenced: should a TensorFlow or numpy build keep a
thread across the fork, the warning goes to the zygote's log, and under
``-W error`` the zygote dies and the tasks start fresh (with the log's
end in the one line that says so). tests/test_forkserver.py runs a
TensorFlow session in a task forked by a zygote whose DeprecationWarnings
are errors.

What a forked task does not get fresh: its hash seed (PYTHONHASHSEED is
part of the start-up key, so an explicit one is honoured, but unseeded
runs share the zygote's random one), and modules the zygote imported
(TensorFlow, numpy and the standard library) come from the zygote's
sys.path: the start-up key holds every variable read as a process starts
or as TensorFlow loads (PYTHON*, TF_* but TF_CONFIG, LD_*, OMP_*, ...),
and a request whose key differs gets its own zygote (at most
``MAX_ZYGOTES``, then fresh processes). The zygote's own objects are
frozen (``gc.freeze``) before it forks: the garbage collector of a task
never looks at them (``gc.get_freeze_count`` is not 0), which changes no
program's result, only what its collections cost.

``SYNC_REPLICAS_FORKSERVER=0`` turns it off (every task fresh), for
side-by-side measurements.
"""

import array
import atexit
import errno
import gc
import json
import logging
import os
import pathlib
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

#: Set to 0: every task a fresh process.
ENV = "SYNC_REPLICAS_FORKSERVER"
#: What a zygote imports before it forks.
PRELOAD = ("tensorflow",)
#: Zygotes per pytest process (one per start-up environment). Three: the
#: suite's own tasks, a user's repeat runs (whose environment a test sets
#: its own way: test_examples has both) and Keras for the Estimator (2.15).
#: Each holds 2 OS threads and about 175 MB of its own memory (its other
#: 375 MB of 550 are TensorFlow's files, shared; measured 2026-11-29, TF
#: 2.21), against the 2.2-2.7 CPU-seconds of every fresh start it spares.
MAX_ZYGOTES = 3
#: How long a zygote may take to import PRELOAD (a loaded 2-core machine
#: took up to 30 s for a task's ``import tensorflow``).
START_SECS = 120.0
#: How long a zygote may take to answer a request with the task's pid.
REPLY_SECS = 30.0
#: How long a zygote gets to stop its tasks and exit at the end.
STOP_SECS = 10.0
#: Prefixes of the variables read as Python starts or TensorFlow loads: a
#: request whose values differ from a zygote's needs another zygote.
STARTUP_PREFIXES = ("PYTHON", "TF_", "LD_", "OMP_", "KMP_", "MKL", "CUDA",
                    "GRPC_", "MALLOC_", "LC_", "LANG")
#: TF_ variables read at run time only (cluster_resolver reads TF_CONFIG).
RUNTIME_ONLY = ("TF_CONFIG",)
_PR_SET_PDEATHSIG = 1
_MAX_MESSAGE = 1 << 20

LOG = logging.getLogger(__name__)


def _startup_key(env, executable):
  return json.dumps(
      [executable] + sorted(
          (k, v) for k, v in env.items()
          if k.startswith(STARTUP_PREFIXES) and k not in RUNTIME_ONLY))


def readable(watched, timeout):
  """Those of ``watched`` (sockets or descriptor numbers) that a read would
  not block on (data, end of file or an error, as select() counts them),
  waiting up to ``timeout`` seconds for one.

  poll(), not select(): select() refuses any descriptor numbered 1024 or
  more ("filedescriptor out of range in select()"), which a pytest process
  with many clusters' sockets and files open reaches, and the zygote with
  it (its control socket keeps the number it had there).
  """
  poller = select.poll()
  by_fd = {}
  for item in watched:
    fd = item if isinstance(item, int) else item.fileno()
    by_fd[fd] = item
    poller.register(fd, select.POLLIN)
  ready = []
  for fd, events in poller.poll(timeout * 1000.0):
    if events & select.POLLNVAL:
      # select() raises on a closed descriptor; so does this, rather than
      # report it readable for ever.
      raise OSError(errno.EBADF, "not an open descriptor: %d" % fd)
    ready.append(by_fd[fd])
  return ready


def threads_of(pid):
  """The names (``comm``) of the OS threads of process ``pid``."""
  names = []
  for task in sorted(pathlib.Path("/proc/%d/task" % pid).iterdir()):
    try:
      names.append((task / "comm").read_text().strip())
    except OSError:  # The thread ended meanwhile.
      pass
  return names


# ---------------------------------------------------------------- client


_cpu_secs = [0.0]
_cpu_lock = threading.Lock()


def _add_cpu(secs):
  with _cpu_lock:
    _cpu_secs[0] += secs


def cpu_secs():
  """CPU seconds of the forked tasks whose exit this process has seen,
  and of the zygotes' imports: tests/conftest.py adds them to a test's CPU
  (the tasks are the zygote's children, so RUSAGE_CHILDREN misses them
  until the zygote ends, after the last test)."""
  with _cpu_lock:
    return _cpu_secs[0]


class ForkedTask:
  """A task forked by a zygote, handled as ``subprocess.Popen`` handles
  its child: ``pid`` (the task's own, so os.kill and os.killpg on it reach
  it), ``poll``, ``wait(timeout)`` (raising subprocess.TimeoutExpired),
  ``returncode``, ``send_signal``, ``terminate``, ``kill``, ``args`` and
  ``stdout``/``stderr`` (files where PIPE was asked for)."""

  def __init__(self, args, pid, status_sock, stdout=None, stderr=None):
    self.args = args
    self.pid = pid
    self.stdin = None
    self.stdout = stdout
    self.stderr = stderr
    self._sock = status_sock
    self._returncode = None
    self._lock = threading.Lock()

  @property
  def returncode(self):
    """As Popen's, but the status is read as it arrives (non-blocking),
    so that a task the zygote saw exit is never signalled by pid."""
    self._read(0)
    return self._returncode

  def _read(self, timeout):
    with self._lock:
      if self._returncode is not None:
        return True
      if not readable([self._sock], timeout):
        return False
      data = self._sock.recv(256)
      if data:
        status = json.loads(data)
        self._returncode = int(status["status"])
        _add_cpu(status["cpu"])
      else:
        # The zygote died before the task (whose PR_SET_PDEATHSIG then
        # SIGKILLed it): no status can come.
        self._returncode = -signal.SIGKILL
      # Closing lets the zygote reap the task: only now may its pid go to
      # another process.
      self._sock.close()
      return True

  def poll(self):
    return self.returncode

  def wait(self, timeout=None):
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      left = None if deadline is None else deadline - time.monotonic()
      if left is not None and left <= 0:
        if self._read(0):
          return self._returncode
        raise subprocess.TimeoutExpired(self.args, timeout)
      if self._read(1.0 if left is None else min(left, 1.0)):
        return self._returncode

  def send_signal(self, sig):
    if self.returncode is None:
      os.kill(self.pid, sig)

  def terminate(self):
    self.send_signal(signal.SIGTERM)

  def kill(self):
    self.send_signal(signal.SIGKILL)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    for f in (self.stdout, self.stderr):
      if f is not None:
        f.close()
    self.wait()

  def __repr__(self):
    return "<ForkedTask pid=%d returncode=%r>" % (self.pid, self._returncode)


class ZygoteDied(Exception):
  """The zygote did not start, or stopped answering."""


class Zygote:
  """One zygote process and the control socket to it."""

  def __init__(self, env, *, preload=PRELOAD, executable=None):
    self.executable = executable or sys.executable
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    self._sock = ours
    self._lock = threading.Lock()
    # Its own output (a warning, a traceback) goes to a file: a pipe that
    # nobody reads until the end could fill and block it.
    self._errors = tempfile.TemporaryFile()
    try:
      self.proc = subprocess.Popen(
          [self.executable, str(pathlib.Path(__file__).resolve()),
           str(theirs.fileno()), ",".join(preload)],
          env=env, stdin=subprocess.DEVNULL, stdout=self._errors,
          stderr=self._errors, pass_fds=[theirs.fileno()],
          start_new_session=True)
    finally:
      theirs.close()
    ready = readable([ours], START_SECS)
    message = ours.recv(_MAX_MESSAGE) if ready else b""
    if message != b"ready":
      self.stop()
      raise ZygoteDied(
          "the zygote did not start within %.0f s (%s)" % (
              START_SECS, self.error_tail() or "no output"))
    # Its import, counted to the test that first needed it (cpu_secs).
    _add_cpu(_stat_cpu_secs(self.proc.pid, reaped=False))

  def error_tail(self):
    """The end of what the zygote printed (nothing, while it works)."""
    self._errors.seek(0)
    return self._errors.read()[-2000:].decode(errors="replace").strip()

  def spawn(self, argv, *, env, cwd, stdin, stdout, stderr):
    status_ours, status_theirs = socket.socketpair(
        socket.AF_UNIX, socket.SOCK_SEQPACKET)
    request = json.dumps({"argv": list(argv), "env": env,
                          "cwd": cwd}).encode()
    fds = [status_theirs.fileno(), stdin, stdout, stderr]
    try:
      with self._lock:
        try:
          self._sock.sendmsg(
              [request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                           array.array("i", fds))])
        except OSError as e:
          raise ZygoteDied("the zygote's socket: %s" % e) from None
    finally:
      status_theirs.close()
    ready = readable([status_ours], REPLY_SECS)
    reply = status_ours.recv(_MAX_MESSAGE) if ready else b""
    if not reply:
      status_ours.close()
      raise ZygoteDied("the zygote gave no pid within %.0f s (%s)" % (
          REPLY_SECS, "it is alive but did not answer" if not ready
          else self.error_tail() or "it ended without output"))
    answer = json.loads(reply)
    if "error" in answer:
      status_ours.close()
      raise OSError(answer["error"])
    return answer["pid"], status_ours

  def alive(self):
    return self.proc.poll() is None

  def stop(self):
    """Ends the zygote and its tasks (bounded)."""
    self._sock.close()
    try:
      self.proc.wait(timeout=STOP_SECS)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait(timeout=STOP_SECS)
    finally:
      self._errors.close()


_zygotes = {}
_zygotes_lock = threading.Lock()
_given_up = set()


def _stop_all():
  with _zygotes_lock:
    for zygote in _zygotes.values():
      if zygote is not None:
        zygote.stop()
    _zygotes.clear()


atexit.register(_stop_all)


def fresh_reason(argv, *, env, start_new_session, preexec_fn=None):
  """Why ``argv`` gets a fresh process, or None when it may be forked."""
  if env.get(ENV, os.environ.get(ENV, "1")) == "0":
    return "%s=0" % ENV
  if preexec_fn is not None:
    return "a preexec_fn runs in the parent's copy, not the zygote's"
  if not start_new_session:
    return "without start_new_session the task would join the zygote's group"
  if len(argv) < 2 or argv[0] != sys.executable or not (
      str(argv[1]).endswith(".py") or (argv[1] == "-m" and len(argv) > 2)):
    return "not `%s SCRIPT.py ...` nor `%s -m MODULE ...`" % (
        sys.executable, sys.executable)
  return None


def _zygote_for(env):
  key = _startup_key(env, sys.executable)
  with _zygotes_lock:
    zygote = _zygotes.get(key)
    if zygote is not None and zygote.alive():
      return zygote
    if key in _given_up:
      return None
    if zygote is None and len(_zygotes) >= MAX_ZYGOTES:
      _given_up.add(key)
      LOG.warning("fork server: %d zygotes already run, so tasks with "
                  "another start-up environment start fresh processes",
                  MAX_ZYGOTES)
      return None
    if zygote is not None:
      _given_up.add(key)
      LOG.warning("fork server: the zygote died (%s); tasks start fresh "
                  "processes from now on", zygote.error_tail() or "no output")
      return None
    try:
      zygote = Zygote(env)
    except (OSError, ZygoteDied) as e:
      _given_up.add(key)
      LOG.warning("fork server: no zygote (%s); tasks start fresh "
                  "processes", e)
      return None
    _zygotes[key] = zygote
    return zygote


def _fd_of(stream, default_fd, opened, *, stdout_fd=None):
  """The descriptor to pass for a Popen-style ``stream`` argument."""
  if stream is None:
    return default_fd, None
  if stream == subprocess.DEVNULL:
    fd = os.open(os.devnull, os.O_RDWR)
    opened.append(fd)
    return fd, None
  if stream == subprocess.STDOUT:
    return stdout_fd, None
  if stream == subprocess.PIPE:
    read_end, write_end = os.pipe()
    opened.append(write_end)
    return write_end, os.fdopen(read_end, "rb")
  if isinstance(stream, int):
    return stream, None
  return stream.fileno(), None


def spawn(argv, *, env=None, cwd=None, stdin=None,
          stdout=None, stderr=None, start_new_session=True, preexec_fn=None,
          zygote=None):
  """Starts ``argv`` (``[sys.executable, SCRIPT.py, *args]`` or
  ``[sys.executable, "-m", MODULE, *args]``) forked from a
  zygote where it may be (``fresh_reason``), else as ``subprocess.Popen``
  would; the other arguments are Popen's. ``zygote``: this one instead of
  the pytest process's own for ``env`` (tests/test_forkserver.py's, which
  preloads nothing). Returns a ForkedTask or a Popen."""
  env = dict(os.environ if env is None else env)
  argv = [str(a) for a in argv]
  reason = fresh_reason(argv, env=env, start_new_session=start_new_session,
                        preexec_fn=preexec_fn)
  if stdin == subprocess.PIPE:  # No task of the suite writes to one.
    reason = "stdin=PIPE"
  if reason is not None:
    zygote = None
  elif zygote is None:
    zygote = _zygote_for(env)
  if zygote is not None:
    opened = []
    try:
      stdin_fd, _ = _fd_of(stdin, 0, opened)
      stdout_fd, out_file = _fd_of(stdout, 1, opened)
      stderr_fd, err_file = _fd_of(stderr, 2, opened, stdout_fd=stdout_fd)
      try:
        pid, status = zygote.spawn(
            argv, env=env, cwd=str(cwd) if cwd is not None else os.getcwd(),
            stdin=stdin_fd, stdout=stdout_fd, stderr=stderr_fd)
      except ZygoteDied as e:
        LOG.warning("fork server: %s; starting %s fresh", e,
                    " ".join(argv[1:3]) if argv[1] == "-m" else argv[1])
        for f in (out_file, err_file):
          if f is not None:
            f.close()
      else:
        return ForkedTask(argv, pid, status, stdout=out_file,
                          stderr=err_file)
    finally:
      for fd in opened:
        os.close(fd)
  return subprocess.Popen(argv, env=env, cwd=cwd, stdin=stdin, stdout=stdout,
                          stderr=stderr, start_new_session=start_new_session,
                          preexec_fn=preexec_fn)


# ---------------------------------------------------------------- zygote


def _stat_cpu_secs(pid, *, reaped):
  """CPU seconds of process ``pid`` from /proc (OSError where it cannot be
  read), with the children it reaped when ``reaped``."""
  fields = pathlib.Path("/proc/%d/stat" % pid).read_text().rsplit(
      ")", 1)[1].split()
  # utime, stime (then cutime, cstime): fields 14-17 of proc(5), in ticks.
  ticks = fields[11:15] if reaped else fields[11:13]
  return sum(int(f) for f in ticks) / os.sysconf("SC_CLK_TCK")


def _zombie_cpu_secs(pid):
  """CPU seconds of an exited, unreaped task and of the children it reaped
  (what its parent's RUSAGE_CHILDREN would gain by reaping it)."""
  try:
    return _stat_cpu_secs(pid, reaped=True)
  except OSError:
    return 0.0


def _exit_status(info):
  if info.si_code == os.CLD_EXITED:
    return info.si_status
  return -info.si_status  # CLD_KILLED, CLD_DUMPED.


class _Child:
  def __init__(self, pid, sock):
    self.pid, self.sock = pid, sock
    self.reported = False
    self.released = False


def _serve(control):
  """The zygote's loop. Returns a request in a forked child (the caller
  runs it), None when the test's process has gone."""
  wake_r, wake_w = os.pipe()
  os.set_blocking(wake_w, False)
  signal.signal(signal.SIGCHLD, lambda *_: None)
  signal.set_wakeup_fd(wake_w)
  children = {}
  control.sendall(b"ready")
  while True:
    watched = [control, wake_r] + [c.sock for c in children.values()
                                   if not c.released]
    ready = readable(watched, 5.0)
    if wake_r in ready:
      os.read(wake_r, 4096)
    if control in ready:
      message, ancdata, _, _ = control.recvmsg(
          _MAX_MESSAGE, socket.CMSG_SPACE(4 * array.array("i").itemsize))
      if not message:
        _stop_children(children)
        return None
      fds = array.array("i")
      for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
          fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
      status_fd, stdin_fd, stdout_fd, stderr_fd = fds
      status = socket.socket(fileno=status_fd)
      request = json.loads(message)
      sys.stdout.flush()
      sys.stderr.flush()
      # Not silenced: Python 3.12+'s warning about forking with threads
      # would be a real one here (the module docstring says why none comes).
      pid = os.fork()
      if pid == 0:
        # Socket objects are closed as objects: closing only their numbers
        # would let their finalizers close whatever later reuses them.
        for sock in [control, status] + [c.sock for c in children.values()]:
          sock.close()
        os.close(wake_r)
        os.close(wake_w)
        _become_child(request, stdin_fd, stdout_fd, stderr_fd)
        return request
      for fd in (stdin_fd, stdout_fd, stderr_fd):
        os.close(fd)
      status.sendall(json.dumps({"pid": pid}).encode())
      children[pid] = _Child(pid, status)
    for child in list(children.values()):
      if child.sock in ready and not child.released:
        # The test's side closed its handle (it read the status, or
        # dropped the task): the task may be reaped once it exits.
        child.released = True
      if not child.reported:
        info = os.waitid(os.P_PID, child.pid,
                         os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None and info.si_pid:
          child.reported = True
          if not child.released:
            try:
              child.sock.sendall(json.dumps(
                  {"status": _exit_status(info),
                   "cpu": _zombie_cpu_secs(child.pid)}).encode())
            except OSError:
              child.released = True
      if child.reported and child.released:
        os.waitpid(child.pid, 0)
        child.sock.close()
        del children[child.pid]


def _stop_children(children):
  for child in children.values():
    # Unreaped, so the group's id is still this task's.
    try:
      os.killpg(child.pid, signal.SIGKILL)
    except OSError:
      pass
  deadline = time.monotonic() + STOP_SECS
  for child in children.values():
    while time.monotonic() < deadline:
      if os.waitpid(child.pid, os.WNOHANG)[0]:
        break
      time.sleep(0.01)


def _become_child(request, stdin_fd, stdout_fd, stderr_fd):
  """Turns the forked zygote into the task a fresh process would be."""
  import ctypes  # pylint: disable=g-import-not-at-top
  os.setsid()
  libc = ctypes.CDLL(None, use_errno=True)
  libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
  if os.getppid() == 1:  # The zygote died before the line above.
    os._exit(128 + signal.SIGKILL)  # pylint: disable=protected-access
  signal.set_wakeup_fd(-1)
  signal.signal(signal.SIGCHLD, signal.SIG_DFL)
  for target, fd in ((0, stdin_fd), (1, stdout_fd), (2, stderr_fd)):
    os.dup2(fd, target)
  for fd in {stdin_fd, stdout_fd, stderr_fd} - {0, 1, 2}:
    os.close(fd)
  env = request["env"]
  os.environ.clear()
  os.environ.update(env)
  os.chdir(request["cwd"])
  numpy = sys.modules.get("numpy")
  if numpy is not None:
    numpy.random.seed()
  argv = request["argv"]
  # sys.path[0] as the interpreter sets it (none under -P/PYTHONSAFEPATH,
  # part of the start-up key: then the zygote's own path has none either).
  if argv[1] == "-m":
    # `python -m` puts the working directory first, and "-m" in argv[0]
    # until runpy replaces it with the module's file (alter_sys, in main).
    first = os.getcwd()
    sys.argv = ["-m"] + argv[3:]
  else:
    first = os.path.dirname(os.path.abspath(argv[1]))
    sys.argv = argv[1:]
  if not getattr(sys.flags, "safe_path", False):
    sys.path[0] = first


def main(argv):
  control = socket.socket(fileno=int(argv[1]))
  for name in filter(None, argv[2].split(",")):
    __import__(name)
  # TensorFlow's modules, hundreds of thousands of objects, live as long as
  # the zygote: frozen, a task's collections and its exit skip them instead
  # of walking them (and touching, so copying, their pages) every time.
  # Measured, a forked task building and running a small graph: 0.36
  # CPU-seconds frozen against 0.77.
  gc.collect()
  gc.freeze()
  request = _serve(control)
  if request is None:
    return 0
  import runpy  # pylint: disable=g-import-not-at-top
  argv = request["argv"]
  try:
    if argv[1] == "-m":
      # As `python -m`: the module (a package's __main__) runs as
      # __main__, sys.argv[0] its file while it runs.
      runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
      runpy.run_path(argv[1], run_name="__main__")
  except (SystemExit, KeyboardInterrupt):
    raise
  except BaseException as e:  # pylint: disable=broad-except
    # A fresh process's traceback starts at the script: leave out the
    # zygote's and runpy's frames (the module docstring says what a fresh
    # `-m` one shows).
    tb = e.__traceback__
    ours = (main.__code__.co_filename, runpy.__file__, "<frozen runpy>")
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
      tb = tb.tb_next
    if tb is not None:
      # Set on the exception too: the excepthook prints __traceback__.
      e = e.with_traceback(tb)
    sys.excepthook(type(e), e, e.__traceback__)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
