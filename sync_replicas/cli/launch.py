"""Runs one between-graph program as a whole cluster on this machine.

  sync-replicas-launch --ps 1 --workers 3 --backup 1 -- python -m examples.digits

Starts every task of the cluster as its own process on 127.0.0.1 with free
ports: the ps tasks, then the chief (replica 0, job ``chief``), then the
other replicas (job ``worker``). Each process gets its TF_CONFIG, as
Kubernetes TFJob sets it, SYNC_REPLICAS_BACKUPS (``--backup``), which the
examples use as the default of their ``--backups``, and, unless already set,
TF_CPP_MIN_LOG_LEVEL=2 (TensorFlow's C++ errors only). Every line a task
prints is streamed with the task's name in front.

The run ends when every replica has exited: a ps task that does not exit by
itself within 3 s (the examples' serve until stopped) is then terminated,
and the launcher says how each ended. It ends early, stopping every task, on Ctrl-C,
on --timeout, or as soon as any task exits with a non-zero code. Every task
runs in its own process group, which is sent SIGTERM, then SIGKILL after
--grace seconds, so no task or child of one outlives the launcher.

Confined by default: the launcher first moves itself into a private network
namespace that has only loopback, so every task's port, which TensorFlow
opens on all interfaces without authentication, is reachable only by the
cluster's own processes (docs/security.md). The tasks then use the ports from
--port on (2222, as on Kubernetes: nothing else lives in the namespace).
Where the platform cannot make the namespace the launcher stops with one line
saying why; --unconfined (or SYNC_REPLICAS_UNCONFINED=1) runs the cluster on
the machine's network instead, on free ports unless --port is given. Run a
tool inside a confined cluster's namespace from another terminal with the
launcher's pid, which it prints (sync-replicas-status finds the launch of
the job whose manifest it reads by itself):

  sync-replicas-launch --enter PID -- sync-replicas-status --manifest runs/x --ps 127.0.0.1:2222

With --hosts N the tasks run on N emulated hosts inside the launch's
namespace: each host a network namespace of its own with its own address
(10.231.x.1, .2, ...) on one bridge, every host's link shaped to --link-rate
both ways (unshaped without it), tasks placed round-robin in start order (ps
tasks first) or by --place; every task listens on port 2222 of its host
(--port), the next ones of a host on the ports after it. No route leads out
of the namespace; --enter and sync-replicas-status reach the hosts through
the bridge (docs/hosts.md):

  sync-replicas-launch --hosts 3 --link-rate 200mbit -- python -m examples.digits

Exit code: 0 if every replica exited 0; otherwise the first failed task's
code (1 if it died by a signal), 124 on timeout, 130 on Ctrl-C or SIGTERM,
127 if the command cannot be started, 2 for bad arguments, a port in use or
a cluster that cannot be confined. Only the standard library is used, and
not TensorFlow: the launcher starts in milliseconds.
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import typing

from sync_replicas import _ports
from sync_replicas.cli import _cli
from sync_replicas.cli import _confine
from sync_replicas.cli import _hosts

PROG = "sync-replicas-launch"
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = _cli.EXIT_INTERRUPTED
EXIT_CANNOT_RUN = 127
EXIT_USAGE = _cli.EXIT_USAGE
#: The first task's port in a confined cluster, the TFJob convention.
CONFINED_BASE_PORT = 2222
#: Seconds a ps task gets to exit by itself once every replica is done,
#: before it is stopped: a program whose ps ends with training (README's)
#: then reports its own exit code. README's ps exits about 0.5 s after its
#: last replica (each spends some 4 s in TensorFlow's teardown, measured on
#: 2 loaded cores); the examples' ps tasks are stopped 3 s later than before.
PS_OWN_EXIT_SECS = 3.0


def _parse(argv):
  parser = _cli.parser(PROG, __doc__,
                       usage="%(prog)s [options] -- command [args...]")
  parser.add_argument("--ps", type=int, default=1, help="ps tasks")
  parser.add_argument("--workers", type=int, default=3,
                      help="replicas, the chief included")
  parser.add_argument("--backup", type=int, default=0,
                      help="backup replicas, exported as "
                      "SYNC_REPLICAS_BACKUPS to every task")
  parser.add_argument("--timeout", type=float, default=1800.0,
                      help="seconds before every task is stopped")
  parser.add_argument("--grace", type=float, default=5.0,
                      help="seconds between SIGTERM and SIGKILL")
  parser.add_argument("--port", type=int, default=None,
                      help="the first task's port, the others follow it "
                      "(default: %d when confined, else free ports)"
                      % CONFINED_BASE_PORT)
  parser.add_argument("--unconfined", action="store_true",
                      default=bool(os.environ.get("SYNC_REPLICAS_UNCONFINED")),
                      help="run on the machine's network, every port open to "
                      "any host that reaches it (default: a private network "
                      "namespace; also set by SYNC_REPLICAS_UNCONFINED=1)")
  parser.add_argument("--enter", type=int, metavar="PID",
                      help="run the command inside the network namespace of "
                      "the confined launch with this pid, and nothing else")
  parser.add_argument("--hosts", type=int, metavar="N",
                      help="run the tasks on N emulated hosts, each with its "
                      "own address, inside the launch's namespace")
  parser.add_argument("--link-rate", metavar="RATE",
                      help="with --hosts: shape every host's link to RATE "
                      "both ways, as tc writes it (200mbit, 1gbit; default: "
                      "unshaped)")
  parser.add_argument("--place", type=_host_list, metavar="H,H,...",
                      help="with --hosts: the host number (0 to N-1) of "
                      "every task in start order: the ps tasks, the chief, "
                      "the workers (default: round-robin)")
  _cli.add_command(parser)
  args = parser.parse_args(argv)
  _cli.command_given(parser, args)
  if args.ps < 0 or args.workers < 1:
    parser.error("need --ps >= 0 and --workers >= 1, got --ps %d --workers %d"
                 % (args.ps, args.workers))
  if not 0 <= args.backup < args.workers:
    parser.error("--backup must be in [0, --workers) so that at least one "
                 "replica's gradient makes an update, got --backup %d with "
                 "--workers %d" % (args.backup, args.workers))
  if args.timeout <= 0 or args.grace < 0:
    parser.error("need --timeout > 0 and --grace >= 0, got --timeout %s "
                 "--grace %s" % (args.timeout, args.grace))
  if args.port is not None and not 0 < args.port <= 65536 - (
      args.ps + args.workers):
    parser.error("--port must leave room for %d ports below 65536, got %d"
                 % (args.ps + args.workers, args.port))
  problem = _hosts_problem(args)
  if problem:
    parser.error(problem)
  return args


def _host_list(text):
  try:
    return [int(h) for h in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(
        "expected host numbers separated by commas, e.g. 0,1,1,2; got %r"
        % text) from None


def _hosts_problem(args):
  """What is wrong with the --hosts arguments, or None."""
  if args.hosts is None:
    if args.link_rate is not None or args.place is not None:
      return ("--link-rate and --place shape and place emulated hosts: "
              "give --hosts N too")
    return None
  tasks = args.ps + args.workers
  if not 1 <= args.hosts <= 250:
    return "--hosts must be in [1, 250], got %d" % args.hosts
  if args.unconfined:
    return ("--hosts builds its hosts inside the launch's own namespace "
            "and cannot run --unconfined")
  if args.link_rate is not None:
    try:
      _hosts.rate_bits(args.link_rate)
    except ValueError as e:
      return "--link-rate: %s" % e
  if args.place is not None:
    if len(args.place) != tasks:
      return ("--place needs one host number per task (%d: --ps %d, then "
              "--workers %d), got %d" % (tasks, args.ps, args.workers,
                                         len(args.place)))
    bad = [h for h in args.place if not 0 <= h < args.hosts]
    if bad:
      return ("--place numbers hosts 0 to %d (--hosts %d), got %s" % (
          args.hosts - 1, args.hosts, ", ".join(map(str, bad))))
  if args.port is not None and args.port > 65536 - tasks:
    return "--port must leave room for %d ports below 65536" % tasks
  return None


def task_order(num_ps, num_workers):
  """(job, index) of every task in start order: ps, chief, workers."""
  return ([("ps", i) for i in range(num_ps)] + [("chief", 0)] +
          [("worker", i) for i in range(num_workers - 1)])


def hosts_cluster_spec(order, addresses, placement, *, base_port):
  """The cluster spec of tasks ``order`` placed on hosts ``placement``.

  The first task on each host at ``base_port``, the next ones of that host
  on the ports after it.
  """
  cluster, taken = {}, {}
  for (job, _), host in zip(order, placement, strict=True):
    port = base_port + taken.get(host, 0)
    taken[host] = taken.get(host, 0) + 1
    cluster.setdefault(job, []).append("%s:%d" % (addresses[host], port))
  return cluster


free_ports = _ports.free_ports
LOOPBACK = _ports.LOOPBACK


def cluster_spec(*, num_ps, num_workers, base_port=None):
  """{"chief": [...], "worker": [...], "ps": [...]} on loopback ports.

  The ports are ``base_port`` and the ones after it, or free ones.
  """
  count = num_ps + num_workers
  ports = (free_ports(count) if base_port is None else
           range(base_port, base_port + count))
  # The ps tasks first: with --port 2222 the first ps, the task a status
  # tool talks to, is at 2222.
  return cluster_of(["%s:%d" % (LOOPBACK, p) for p in ports], num_ps=num_ps)


def cluster_of(addresses, *, num_ps):
  """The TF_CONFIG cluster of ``addresses``: ps tasks first, then the chief
  (replica 0, job ``chief``), then the other replicas (job ``worker``)."""
  replicas = addresses[num_ps:]
  num_workers = len(replicas)
  cluster = {"chief": replicas[:1]}
  if num_workers > 1:
    cluster["worker"] = replicas[1:]
  if num_ps:
    cluster["ps"] = addresses[:num_ps]
  return cluster


def tf_config(cluster, job, index):
  """The TF_CONFIG of task ``index`` of ``job`` in ``cluster``, as JSON."""
  return json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})


class Task:
  """One process of the cluster: its name, process and log streamer."""

  def __init__(self, job, index, cluster, command, env, out, out_lock, *,
               config=None, preexec_fn=None, popen=subprocess.Popen):
    """Starts the task. Its TF_CONFIG: ``config`` where given (a TF_CONFIG
    as another launcher writes it, e.g. tools/tfjob's, as Kubeflow's
    operator does), else ours for ``cluster``; none where ``cluster`` is
    None too (the command has its cluster as flags). ``preexec_fn`` runs in
    the child before the command (``subprocess.Popen``'s). ``popen``
    starts the process, with Popen's arguments, and returns a Popen or an
    object that behaves as one (tools/data_end's tests pass the suite's
    fork server, tests/_forkserver.py)."""
    self.job, self.index = job, index
    self.name = "%s%d" % (job, index)
    self.is_ps = job == "ps"
    env = dict(env, PYTHONUNBUFFERED="1")
    if config is None and cluster is not None:
      config = tf_config(cluster, job, index)
    if config is not None:
      env["TF_CONFIG"] = config
    # A session of its own: the task and all its children form one process
    # group that can be signalled at once, and a terminal's Ctrl-C reaches
    # the launcher only, which then stops the tasks in order.
    self.proc = popen(
        command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=preexec_fn)
    self._out, self._lock = out, out_lock
    self._pump = threading.Thread(target=self._stream, daemon=True,
                                  name="log-" + self.name)
    self._pump.start()

  def _stream(self):
    prefix = ("[%s] " % self.name).encode()
    for line in iter(self.proc.stdout.readline, b""):
      with self._lock:
        self._out.write(prefix + line if line.endswith(b"\n")
                        else prefix + line + b"\n")
        self._out.flush()

  def poll(self):
    """The task's exit code, or None while its process runs.

    Once the process has exited, what is left of its process group is
    killed, and only then is the process reaped. The order matters: until
    it is reaped, its pid (the group's id) cannot be given to another
    process, so the signal reaches only this task's group. Signalling a
    group by the id of a reaped leader can hit an unrelated process that got
    the recycled pid (pid_max is often 32768, and threads use pids too).
    """
    if self.proc.returncode is not None:
      return self.proc.returncode
    try:
      exited = os.waitid(os.P_PID, self.proc.pid,
                         os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
      return self.proc.poll()
    if exited is None or exited.si_pid == 0:
      return None
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(self.proc.pid, signal.SIGKILL)
    return self.proc.wait()

  def running(self):
    return self.poll() is None

  def signal_group(self, sig):
    """Signals the task's group while its process runs (see ``poll``)."""
    if self.running():
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(self.proc.pid, sig)

  def finish_streaming(self, timeout):
    self._pump.join(timeout)


class Launcher:
  """Starts, watches and stops the tasks of one run."""

  def __init__(self, args, *, out=None, environ=None, hosts=None):
    self._args = args
    #: The emulated hosts the tasks run on (``_hosts.Hosts``), or None.
    self.hosts = hosts
    self._out = out or sys.stdout.buffer
    self._lock = threading.Lock()
    self._env = dict(os.environ if environ is None else environ)
    if args.backup is not None:  # None: tools/tfjob, whose tasks have flags.
      self._env["SYNC_REPLICAS_BACKUPS"] = str(args.backup)
    self._env.pop("TF_CONFIG", None)
    # TensorFlow reads it once, as it loads: only the environment a task
    # starts with can keep its C++ INFO and WARNING lines (a dozen per task,
    # some alarming and routine) out of the merged log.
    self._env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    self.tasks = []

  def say(self, fmt, *args):
    with self._lock:
      self._out.write(("[launch] " + fmt % args + "\n").encode())
      self._out.flush()

  def run(self):
    """Runs the cluster to its end; returns the launcher's exit code."""
    args = self._args
    # ps first, then the chief: a replica that finds the model
    # uninitialized may sleep 30 s before it looks again.
    order = task_order(args.ps, args.workers)
    placement = None
    if self.hosts is None:
      cluster = cluster_spec(num_ps=args.ps, num_workers=args.workers,
                             base_port=args.port)
      busy = _ports_in_use(cluster)
    else:
      # Fresh hosts: every port is free on them.
      placement = args.place or [i % args.hosts for i in range(len(order))]
      cluster = hosts_cluster_spec(order, self.hosts.addresses, placement,
                                   base_port=args.port or CONFINED_BASE_PORT)
      busy = []
      for host, address in enumerate(self.hosts.addresses):
        self.say("%s %s: %s", self.hosts.names[host], address, ", ".join(
            "%s%d" % task for task, on in zip(order, placement, strict=True)
            if on == host) or "no task")
    if busy:
      self.say("port(s) %s already in use on this machine: nothing was "
               "started. Pick another --port (the cluster needs %d ports "
               "from it), or omit --port to use free ones.",
               ", ".join(map(str, busy)), args.ps + args.workers)
      return EXIT_USAGE
    self.say("cluster %s", json.dumps(cluster))
    return self.run_tasks(cluster, [
        (job, index, args.command if placement is None else
         self.hosts.command(placement[i], args.command), None)
        for i, (job, index) in enumerate(order)])

  def run_tasks(self, cluster, starts):
    """Starts tasks in order and runs them to the end; returns the exit code.

    Args:
      cluster: The cluster spec every task's TF_CONFIG carries.
      starts: ``(job, index, command, config)`` of every task, in start
        order; ``config`` None for the launcher's own TF_CONFIG.
    """
    deadline = time.monotonic() + self._args.timeout
    code = None
    command = None
    try:
      for job, index, command, config in starts:
        task = Task(job, index, cluster, command, self._env, self._out,
                    self._lock, config=config)
        self.tasks.append(task)
        self.say("started %s (pid %d)", task.name, task.proc.pid)
      code = self._watch(deadline)
    except KeyboardInterrupt:
      self.say("interrupted: stopping every task")
      code = EXIT_INTERRUPTED
    except OSError as e:
      self.say("could not start %r: %s. Check the command after --.",
               " ".join(command or ()), e)
      code = EXIT_CANNOT_RUN
    finally:
      self._stop_all()
    return code

  def _watch(self, deadline):
    replicas = [t for t in self.tasks if not t.is_ps]
    reported = set()
    while True:
      for task in self.tasks:
        rc = task.poll()
        if rc is None or task.name in reported:
          continue
        reported.add(task.name)
        if rc != 0:
          self.say("%s failed with %s: stopping every task", task.name,
                   describe(rc))
          return rc if rc > 0 else 1
        self.say("%s exited 0", task.name)
      if all(t.poll() == 0 for t in replicas):
        self._end_ps_tasks(reported)
        return 0
      if time.monotonic() > deadline:
        self.say("timed out after %.0f s: stopping every task",
                 self._args.timeout)
        return EXIT_TIMEOUT
      time.sleep(0.1)

  def _end_ps_tasks(self, reported):
    """Once every replica is done: a ps that ends by itself (README's
    program) gets ``PS_OWN_EXIT_SECS`` to, and says ``exited 0``; the others
    (the examples' serve until stopped) are stopped, each saying so."""
    live = [t for t in self.tasks if t.is_ps and t.name not in reported]
    deadline = time.monotonic() + PS_OWN_EXIT_SECS
    while any(t.running() for t in live) and time.monotonic() < deadline:
      time.sleep(0.05)
    for task in live:
      rc = task.poll()
      if rc is not None:
        reported.add(task.name)
        self.say("%s exited %s", task.name,
                 "0" if rc == 0 else "with " + describe(rc))
    serving = [t for t in live if t.name not in reported]
    if not serving:
      self.say("every replica finished, and every ps task ended by itself")
      return
    self.say("every replica finished: stopping %s, which serve%s until "
             "stopped", ", ".join(t.name for t in serving),
             "s" if len(serving) == 1 else "")
    stop_tasks(serving, grace=self._args.grace, say=self.say)
    for task in serving:
      rc = task.poll()
      if rc is not None:
        self.say("%s stopped (%s)", task.name, describe(rc))

  def _stop_all(self):
    """Stops every task (``stop_tasks``), deaf to a second Ctrl-C."""
    if threading.current_thread() is threading.main_thread():
      # A second Ctrl-C must not cut the clean-up short and leave tasks
      # behind; the clean-up itself is bounded by --grace + 10 s.
      signal.signal(signal.SIGINT, signal.SIG_IGN)
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop_tasks(self.tasks, grace=self._args.grace, say=self.say)


def stop_tasks(tasks, *, grace, say):
  """SIGTERM to every running task's group, SIGKILL after ``grace`` s.

  Bounded: at most ``grace`` plus 10 s. A task's group is killed outright
  once its process exited (``Task.poll``). ``say(fmt, *args)`` reports a
  task that needed SIGKILL or could not be stopped. Returns the names of
  tasks still running (none unless the kernel refused).
  """
  live = [t for t in tasks if t.running()]
  for task in live:
    task.signal_group(signal.SIGTERM)
  _wait_groups(live, grace)
  stubborn = [t for t in live if t.running()]
  for task in stubborn:
    say("%s ignored SIGTERM for %.0f s: killing it", task.name, grace)
    task.signal_group(signal.SIGKILL)
  _wait_groups(stubborn, 10.0)
  for task in tasks:
    task.finish_streaming(timeout=2.0)
  left = [t.name for t in tasks if t.running()]
  if left:
    say("could not stop %s", ", ".join(left))
  return left


def _wait_groups(tasks, timeout):
  deadline = time.monotonic() + timeout
  for task in tasks:
    while task.running() and time.monotonic() < deadline:
      time.sleep(0.05)


def describe(rc):
  if rc < 0:
    try:
      return "signal %s" % signal.Signals(-rc).name
    except ValueError:
      return "signal %d" % -rc
  return "exit code %d" % rc


def _confine_or_refuse(args, launcher):
  """Confines this process unless told not to; returns an exit code or None.

  Runs before the launcher starts any thread or task, as confinement needs.
  """
  if args.unconfined:
    launcher.say("unconfined: every task's port listens on all of this "
                 "machine's interfaces, without authentication "
                 "(docs/security.md)")
    return None
  try:
    # With --hosts, root inside a user namespace, so that ip and tc may
    # build the hosts there (an ordinary user's launch).
    what = _confine.confine(as_root=args.hosts is not None)
  except _confine.CannotConfine as e:
    _cli.say(PROG, "cannot confine the cluster to a private network "
             "namespace (%s); rerun with --unconfined (or "
             "SYNC_REPLICAS_UNCONFINED=1) to open its ports to every host "
             "that reaches this machine, see docs/security.md" % e)
    return EXIT_USAGE
  if args.port is None:
    args.port = CONFINED_BASE_PORT
  launcher.say("confined to a private %s with only loopback%s: nothing "
               "outside it reaches the cluster's ports. Run a command inside "
               "with: %s --enter %d -- COMMAND", what,
               "" if args.hosts is None else " and the emulated hosts",
               PROG, os.getpid())
  return None


def _emulate_hosts(args, launcher):
  """The emulated hosts of --hosts (None without), or an exit code.

  Runs confined, before the launcher starts any thread: the mount namespace
  that hides ``ip netns``'s state needs that.
  """
  if args.hosts is None:
    return None
  try:
    _hosts.private_mounts()
    hosts = _hosts.Hosts(args.hosts, rate=args.link_rate)
  except _hosts.CannotEmulate as e:
    _cli.say(PROG, "cannot emulate %d hosts inside the launch's namespace "
             "(%s); run without --hosts to put every task on its loopback"
             % (args.hosts, e))
    return EXIT_USAGE
  launcher.say("%d emulated hosts on bridge address %s, links %s",
               args.hosts, hosts.bridge_address,
               "shaped to %s both ways" % args.link_rate
               if args.link_rate else "unshaped")
  return hosts


def _ports_in_use(cluster):
  """The cluster's ports that a server could not bind now.

  Checked on 0.0.0.0, where TensorFlow binds whatever the spec says, with
  SO_REUSEADDR as gRPC sets it: a task whose bind fails aborts outright.
  """
  busy = []
  for address in (a for hosts in cluster.values() for a in hosts):
    port = int(address.rsplit(":", 1)[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        sock.bind(("0.0.0.0", port))
      except OSError:
        busy.append(port)
  return busy


def _enter(args):
  """Runs the command in the namespace of the confined launch ``--enter``."""
  pid = args.enter
  try:
    with open("/proc/%d/cmdline" % pid, "rb") as f:
      argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
  except OSError:
    _cli.say(PROG, "no process %d: give --enter the pid a running launch "
             "printed in its 'confined ... --enter PID' line" % pid)
    return EXIT_USAGE
  if not _is_launch(argv):
    _cli.say(PROG, "process %d is not %s, it runs %r: give --enter the pid "
             "from the launch's 'confined' line"
             % (pid, PROG, " ".join(argv)[:60]))
    return EXIT_USAGE
  try:
    if not _confine.is_confined_apart(pid):
      _cli.say(PROG, "launch %d shares this network namespace (it runs "
               "unconfined, or this shell is already inside): run the "
               "command without --enter" % pid)
      return EXIT_USAGE
    _confine.enter(pid)
  except (OSError, _confine.CannotConfine) as e:
    _cli.say(PROG, "cannot enter the namespace of launch %d: %s" % (pid, e))
    return EXIT_USAGE
  try:
    os.execvp(args.command[0], args.command)
  except OSError as e:
    _cli.say(PROG, "could not start %r: %s" % (" ".join(args.command), e))
    return EXIT_CANNOT_RUN


def confined_launches(*, port=None, namespace=None):
  """The pids of the running confined launches, those whose namespace
  listens on ``port``, or whose namespace is ``namespace`` (its inode, as
  a sync manifest records it), or the namespace of one of its tasks (an
  emulated host's, with --hosts): where a tool must go to reach their
  cluster.

  Only launches of this machine that this user may look into count; an
  ``--enter`` has become its command and is not one.
  """
  found = []
  pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
  for pid in pids:
    if pid == os.getpid():
      continue
    try:
      with open("/proc/%d/cmdline" % pid, "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\0")
                if a]
      if (_is_launch(argv) and "--enter" not in argv
          and _confine.is_confined_apart(pid)
          and (namespace is None
               or namespace in _namespaces_of(pid, pids))
          and (port is None or _confine.listens(port, pid))):
        found.append(pid)
    except OSError:
      continue  # Ended meanwhile, or not ours to read.
  return found


def _namespaces_of(launch, pids):
  """The network namespaces of process ``launch`` and of its children (its
  tasks, which run on emulated hosts with --hosts), as inodes."""
  found = {os.stat("/proc/%d/ns/net" % launch).st_ino}
  for pid in pids:
    try:
      with open("/proc/%d/stat" % pid, encoding="ascii",
                errors="replace") as f:
        # The parent is the second field after the command's ")", which
        # may itself hold spaces and parentheses.
        parent = int(f.read().rpartition(")")[2].split()[1])
      if parent == launch:
        found.add(os.stat("/proc/%d/ns/net" % pid).st_ino)
    except (OSError, ValueError, IndexError):
      continue  # Ended meanwhile, or not ours to read.
  return found


def _is_launch(argv):
  """Whether the command line ``argv`` is a launch's, however it started.

  The console script (``.../sync-replicas-launch``), ``python -m
  sync_replicas.cli.launch``, or tools/launch of a checkout.
  """
  return any(os.path.basename(a) in (PROG, "launch")
             or a == "sync_replicas.cli.launch" for a in argv[:3])


def main(argv: "typing.Sequence[str] | None" = None) -> int:
  """The console script ``sync-replicas-launch``; returns the exit code."""
  return _cli.run(_main, argv, prog=PROG)


def _main(argv):
  args = _parse(argv)
  if args.enter is not None:
    return _enter(args)
  launcher = Launcher(args)
  if shutil.which(args.command[0]) is None:
    launcher.say("could not start %r: no such program (%s is not an "
                 "executable file, nor one on PATH). Check the command "
                 "after --.", " ".join(args.command), args.command[0])
    return EXIT_CANNOT_RUN
  refused = _confine_or_refuse(args, launcher)
  if refused is not None:
    return refused
  hosts = _emulate_hosts(args, launcher)
  if isinstance(hosts, int):
    return hosts
  # Ctrl-C, and SIGTERM (e.g. from a CI timeout), stop the tasks. SIGINT is
  # set explicitly: a shell starts background jobs with it ignored, and
  # Python then installs no handler of its own.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  signal.signal(signal.SIGTERM, lambda *_: _raise_interrupt())
  if hosts is None:
    return launcher.run()
  launcher.hosts = hosts
  try:
    return launcher.run()
  finally:
    # Everything also goes with the launch's namespaces, however it ends.
    hosts.close()


def _raise_interrupt():
  raise KeyboardInterrupt


if __name__ == "__main__":
  sys.exit(main())
