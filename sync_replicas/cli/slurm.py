"""Runs one between-graph program as a Slurm job step: one task per process.

  sync-replicas-slurm --ps 1 -- python train.py       # in every task, through srun:
  srun -n 4 sync-replicas-slurm --ps 1 --backup 1 -- python -m examples.digits
  srun -n 4 sync-replicas-slurm --ps 1 --tf1-flags -- python mnist_replica.py
  srun -n 4 sync-replicas-slurm --ps 1 -- sync-replicas-run train.py

Run under srun, inside an allocation (sbatch, salloc): every Slurm task of
the step runs this command, which makes it one task of the TensorFlow
cluster and runs the program after -- as that task. The first --ps tasks are
the ps tasks, the next the chief, the rest workers, taking local task 0 of
every node first, then local task 1, and so on (the ps tasks land on
different nodes while there are nodes left), whatever distribution srun
used. The program gets TF_CONFIG as sync-replicas-launch and Kubernetes
TFJob give it (jobs ``ps``, ``chief``, ``worker``), SYNC_REPLICAS_BACKUPS
(--backup) and, unless set, TF_CPP_MIN_LOG_LEVEL=2; with --tf1-flags it gets
no TF_CONFIG but the flags of TF1 scripts such as mnist_replica.py instead,
appended to its command: --job_name ps|worker --task_index N --ps_hosts
--worker_hosts (worker 0 is the chief). Every line it prints is prefixed
with its task's name.

Ports: each task takes a port that is free on its node when the step
starts, and the tasks learn each other's from a meeting point that the
first task's wrapper keeps for the step's life, on a port derived from the
job and step ids (the first free of 8 candidates): two jobs sharing a node
never meet each other's tasks. Addresses use Slurm's node names. TensorFlow
listens on all of a node's interfaces, without authentication
(docs/security.md).

The end: once every replica (chief and workers) has exited 0, the ps tasks,
which serve until stopped, get SIGTERM and the step ends with exit code 0.
When any task fails, is killed, or its wrapper vanishes, every other task is
stopped with one line naming it, and the step ends. scancel (or the job's
time limit) stops each task's program in order too.

Exit code of each task: 0 done; the program's own code when it failed (128+N
for signal N); 1 stopped because another task failed; 128+N when this
wrapper got signal N (SIGTERM: 143); 2 bad arguments or not inside a Slurm
step; 127 the command cannot be started. Only the standard library is used.
docs/slurm.md has the sbatch script and more.
"""

import ctypes
import json
import os
import queue
import shutil
import signal
import sys
import threading
import typing

from sync_replicas import _ports
from sync_replicas.cli import _cli
from sync_replicas.cli import _rendezvous
from sync_replicas.cli import _slurm_env
from sync_replicas.cli import launch

PROG = "sync-replicas-slurm"
EXIT_STOPPED = 1
EXIT_CANNOT_RUN = launch.EXIT_CANNOT_RUN
#: How often the wrapper looks at its program and its signals.
POLL_SECS = 0.1


def _parse(argv):
  parser = _cli.parser(PROG, __doc__,
                       usage="%(prog)s [options] -- command [args...]")
  parser.add_argument("--ps", type=int, default=1, help="ps tasks")
  parser.add_argument("--backup", type=int, default=0,
                      help="backup replicas, exported as "
                      "SYNC_REPLICAS_BACKUPS to every task")
  parser.add_argument("--tf1-flags", action="store_true",
                      help="append --job_name, --task_index, --ps_hosts and "
                      "--worker_hosts to the command instead of setting "
                      "TF_CONFIG")
  parser.add_argument("--start-timeout", type=float, default=300.0,
                      help="seconds for every task to reach the meeting "
                      "point")
  parser.add_argument("--grace", type=float, default=5.0,
                      help="seconds between SIGTERM and SIGKILL when a task's "
                      "program is stopped")
  _cli.add_command(parser)
  args = parser.parse_args(argv)
  _cli.command_given(parser, args)
  if args.ps < 0 or args.backup < 0:
    parser.error("need --ps >= 0 and --backup >= 0, got --ps %d --backup %d"
                 % (args.ps, args.backup))
  if args.start_timeout <= 0 or args.grace < 0:
    parser.error("need --start-timeout > 0 and --grace >= 0")
  return args, parser


class Roles:
  """Which TensorFlow task each slot of the step is."""

  def __init__(self, step, num_ps, tf1_flags):
    self.step, self.num_ps, self.tf1_flags = step, num_ps, tf1_flags
    self.count = len(step.slots)

  def of(self, slot):
    """(job, index) of ``slot``: ps tasks, the chief, then the workers."""
    if slot < self.num_ps:
      return "ps", slot
    if self.tf1_flags:
      return "worker", slot - self.num_ps
    if slot == self.num_ps:
      return "chief", 0
    return "worker", slot - self.num_ps - 1

  def name(self, slot):
    job, index = self.of(slot)
    return "%s%d on %s" % (job, index, self.step.slots[slot].node)

  def command(self, base, addresses, slot):
    """The program's command: with the TF1 flags appended, under --tf1-flags."""
    if not self.tf1_flags:
      return list(base)
    job, index = self.of(slot)
    return [*base, "--job_name", job, "--task_index", str(index),
            "--ps_hosts", ",".join(addresses[:self.num_ps]),
            "--worker_hosts", ",".join(addresses[self.num_ps:])]


#: prctl's option: the signal this process gets when its parent exits.
_PR_SET_PDEATHSIG = 1


def _libc():
  """The C library, for prctl; None where there is none to load."""
  try:
    return ctypes.CDLL(None, use_errno=True)
  except OSError:
    return None


_LIBC = _libc()


def _die_with_wrapper():
  """In the program's process, before it starts: SIGKILL when the wrapper
  dies.

  A wrapper killed outright (kill -9, the OOM killer) cannot stop its
  program, which then runs on in a session of its own, outside the step
  as far as a process tracker that follows parents (proctrack/linuxproc)
  knows: a ps task would serve forever on a node the job has left. Little
  work here, one call into the C library: the wrapper has threads. The
  signal comes when the thread that started the program ends: the main
  thread, which lives as long as the wrapper.
  """
  if _LIBC is not None:
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != _WRAPPER_PID:
      os._exit(EXIT_STOPPED)  # The wrapper died before the prctl: no signal.


#: This process, as its programs see their parent (``_die_with_wrapper``).
_WRAPPER_PID = os.getpid()


class _Signalled(Exception):
  def __init__(self, signum):
    super().__init__(signum)
    self.signum = signum


def _on_signal(signum, frame):
  del frame
  raise _Signalled(signum)


class Wrapper:
  """One Slurm task's wrapper: meets the others, runs and watches its program."""

  def __init__(self, args, roles, environ):
    self._args, self._roles = args, roles
    step = roles.step
    self._slot = step.me
    self._job, self._index = roles.of(self._slot)
    self._key = "%s.%s" % (step.job_id, step.step_id)
    self._env = dict(environ, SYNC_REPLICAS_BACKUPS=str(args.backup))
    self._env.pop("TF_CONFIG", None)
    self._env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    self._prefix = "%s: task %s (%s)" % (PROG, step.procid,
                                         roles.name(self._slot))
    self._service = None
    self._client = None
    self._task = None
    self._port = None
    self._messages = queue.Queue()

  def say(self, fmt, *args):
    _cli.say(self._prefix, fmt % args)

  def run(self):
    try:
      return self._run()
    except _Signalled as e:
      # A second signal must not cut the stop short.
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
      signal.signal(signal.SIGINT, signal.SIG_IGN)
      name = signal.Signals(e.signum).name
      self.say("got %s (scancel, the job's time limit, or srun interrupted): "
               "stopping", name)
      self._stop_program()
      self._report("was stopped by %s (scancel, the time limit, or srun "
                   "interrupted)" % name)
      return 128 + e.signum
    except _rendezvous.RendezvousError as e:
      self.say("%s", e)
      self._stop_program()
      return EXIT_STOPPED
    finally:
      if self._client is not None:
        self._client.close()
      if self._service is not None:
        self._service.close()
      if self._port is not None:
        _ports.release_port(self._port)

  def _run(self):
    roles, step = self._roles, self._roles.step
    # Reserved on this node until the wrapper exits: another task's
    # wrapper (this step's or another job's) then cannot draw it too in
    # the seconds before the program's server binds it.
    # Not one of the step's meeting-point candidates either: slot 0's
    # wrapper may bind one of them after this draw.
    self._port = _ports.reserve_free_port(
        exclude=_rendezvous.candidate_ports(self._key))
    address = "%s:%d" % (step.slots[self._slot].node, self._port)
    if self._slot == 0:
      self._service = _rendezvous.Service(
          self._key, roles.count,
          is_ps=[roles.of(i)[0] == "ps" for i in range(roles.count)],
          names=[roles.name(i) for i in range(roles.count)])
    self._client = _rendezvous.Client.connect(
        step.slots[0].node, self._key, self._slot, address,
        timeout=self._args.start_timeout)
    self._client.settimeout(self._args.start_timeout)
    try:
      message = self._client.receive()
    except OSError:
      message = {}
    if "cluster" not in message:
      raise _rendezvous.RendezvousError(
          "the step's tasks did not all reach the meeting point on %s within "
          "%.0f s: %s" % (step.slots[0].node, self._args.start_timeout,
                          message.get("abort", "no cluster came")))
    self._client.settimeout(None)
    addresses = message["cluster"]
    if self._slot == 0:
      self.say("cluster %s", json.dumps(launch.cluster_of(addresses,
                                              num_ps=roles.num_ps)))
    threading.Thread(target=self._listen, daemon=True,
                     name="rendezvous-listen").start()
    cluster = (None if roles.tf1_flags else
               launch.cluster_of(addresses, num_ps=roles.num_ps))
    try:
      self._task = launch.Task(
          self._job, self._index, cluster,
          roles.command(self._args.command, addresses, self._slot),
          self._env, sys.stdout.buffer, threading.Lock(),
          preexec_fn=_die_with_wrapper)
    except OSError as e:
      self.say("could not start %r: %s", " ".join(self._args.command), e)
      self._report("could not start its program (%s)" % e)
      return EXIT_CANNOT_RUN
    return self._watch()

  def _listen(self):
    while True:
      try:
        message = self._client.receive()
      except (OSError, ValueError):
        message = {}
      self._messages.put(message)
      if not message:
        return

  def _watch(self):
    while True:
      rc = self._task.poll()
      if rc is not None:
        return self._ended(rc)
      try:
        message = self._messages.get(timeout=POLL_SECS)
      except queue.Empty:
        continue
      if "stop" in message:
        self._stop_program()
        self._report("ok")
        return self._finish(0)
      if "abort" in message:
        self.say("stopping: %s", message["abort"])
        self._stop_program()
        self._report("was stopped after another task failed")
        return self._finish(EXIT_STOPPED)
      if not message:
        self.say("stopping: the step's meeting point, kept by the wrapper of "
                 "%s, is gone (that task was killed, or its node lost)",
                 self._roles.name(0))
        self._stop_program()
        return EXIT_STOPPED

  def _ended(self, rc):
    if rc == 0:
      self._report("ok")
      return self._finish(0)
    how = ("exited with code %d" % rc if rc > 0 else
           "was killed by %s" % launch.describe(rc))
    self.say("its program %s: stopping the step", how)
    self._report(how)
    return self._finish(rc if rc > 0 else 128 - rc)

  def _finish(self, code):
    """``code``, once the meeting point is no longer needed.

    The first task's wrapper keeps it until every task has ended (bounded:
    the others stop within their grace).
    """
    if self._service is not None:
      self._service.finished.wait(self._args.grace + 30)
    return code

  def _report(self, how):
    if self._client is not None:
      self._client.send_exit(how)

  def _stop_program(self):
    if self._task is not None:
      launch.stop_tasks([self._task], grace=self._args.grace, say=self.say)


def main(argv: "typing.Sequence[str] | None" = None) -> int:
  """The console script ``sync-replicas-slurm``; returns the exit code."""
  return _cli.run(_main, argv, prog=PROG)


def _main(argv):
  args, parser = _parse(argv)
  try:
    step = _slurm_env.read_step(os.environ)
  except _slurm_env.SlurmEnvError as e:
    _cli.say(PROG, str(e))
    return _cli.EXIT_USAGE
  count = len(step.slots)
  if not args.ps < count or not args.backup < count - args.ps:
    parser.error(
        "the step has %d tasks: --ps %d leaves %d replicas, and --backup must "
        "leave at least one (got --backup %d); change srun's -n or the "
        "options" % (count, args.ps, count - args.ps, args.backup))
  if shutil.which(args.command[0]) is None:
    _cli.say(PROG, "could not start %r: no such program (%s is not an "
             "executable file, nor one on PATH)" % (" ".join(args.command),
                                                    args.command[0]))
    return EXIT_CANNOT_RUN
  wrapper = Wrapper(args, Roles(step, args.ps, args.tf1_flags), os.environ)
  # SIGTERM is how Slurm stops a task (scancel, time limit); SIGINT how srun
  # passes on a Ctrl-C. Either stops the program in order.
  signal.signal(signal.SIGTERM, _on_signal)
  signal.signal(signal.SIGINT, _on_signal)
  return wrapper.run()


if __name__ == "__main__":
  sys.exit(main())
