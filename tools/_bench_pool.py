"""The task processes of tools/bench, and the driver's side of their protocol.

Owns the pool (P ps tasks and W workers, each tools/_bench_task.py in its own
process group, started together once per W and serving every run at that
W), sending commands and reading answers with a deadline, and one run's
choreography (``run_once``). The messages themselves are defined in
tools/_bench_protocol.py. No TensorFlow here: the driver stays light, and
TensorFlow's import, seconds per process, is paid once per task.
"""

import os
import pathlib
import selectors
import signal
import subprocess
import sys
import time

import _bench_protocol as protocol
import _by_path
import _peak_rss as peak_rss

ROOT = pathlib.Path(__file__).resolve().parents[1]
TASK = ROOT / "tools" / "_bench_task.py"
PEER_TASK = ROOT / "tools" / "_bench_peer_task.py"


# The driver needs no TensorFlow: the ports module is loaded by its path.
_ports = _by_path.ports()
free_ports = _ports.free_ports
LOOPBACK = _ports.LOOPBACK


class RunError(RuntimeError):
  """A run failed: a task's error, a timeout, or a task gone."""


class Pool:
  """P ps and W worker processes (tools/_bench_task.py --serve) that serve runs;
  or, for a peer, W MultiWorkerMirroredStrategy workers and no ps
  (tools/_bench_peer_task.py).

  TensorFlow is imported and every server started once per pool, all tasks
  at the same time; each run then costs only its graph, its session and its
  steps. Every wait is bounded by ``timeout``.
  """

  def __init__(self, workers, *, log, timeout, communication=None, ps=1,
               places=None, ps_config=None):
    """Starts the tasks and waits for every one's ``up``.

    Args:
      workers: W.
      log: The open file every task's stderr goes to.
      timeout: Seconds the start may take.
      communication: None: ``ps`` ps tasks and W workers of
        tools/_bench_task.py. A MultiWorkerMirroredStrategy communication
        (protocol.PEERS' values): W workers of tools/_bench_peer_task.py, no
        ps.
      ps: P, the ps tasks of a pool that has them (the device setter spreads
        the variables over them round-robin).
      places: None: every task on 127.0.0.1, on a free port. Or one
        ``(argv_prefix, "address:port")`` per task, ps tasks first, then
        the workers: the task listens there and is started as
        ``argv_prefix + [python, ...]`` (e.g. ``ip netns exec host3``: a
        task of its own emulated host, tools/linkcost).
      ps_config: The ``ConfigProto`` the ps tasks start their servers
        with, in protobuf's text format (``ServeSpec.ps_config``); None:
        TensorFlow's defaults.
    """
    self.has_ps = communication is None
    ps = ps if self.has_ps else 0
    if ps < int(self.has_ps):
      raise ValueError("a ps pool needs at least one ps task, got %d" % ps)
    if places is None:
      places = [([], "%s:%d" % (LOOPBACK, p))
                for p in free_ports(workers + ps)]
    if len(places) != workers + ps:
      raise ValueError("places: one per task (%d ps, %d workers), got %d"
                       % (ps, workers, len(places)))
    self.workers = workers
    self.cluster = {"worker": [a for _, a in places[ps:]]}
    if self.has_ps:
      self.cluster["ps"] = [a for _, a in places[:ps]]
    script = TASK if self.has_ps else PEER_TASK
    jobs = [("ps", t) for t in range(ps)] + [
        ("worker", t) for t in range(workers)]
    self._log = log
    self._procs = {}
    self._buffers = {}
    env = dict(os.environ, PYTHONPATH=_by_path.child_pythonpath(),
               TF_CPP_MIN_LOG_LEVEL="2")
    started = time.monotonic()
    try:
      for (job, task), (prefix, _) in zip(jobs, places, strict=True):
        spec = protocol.ServeSpec(cluster=self.cluster, job=job, task=task,
                                  communication=communication,
                                  ps_config=ps_config)
        self._procs[(job, task)] = subprocess.Popen(
            [*prefix, sys.executable, str(script), "--serve",
             protocol.serve_argument(spec)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log, start_new_session=True)
        self._buffers[(job, task)] = b""
      deadline = time.monotonic() + timeout
      for key in self._procs:
        self.receive(key, deadline, protocol.UP)
    except BaseException:
      self.close()
      raise
    self.startup_secs = time.monotonic() - started

  @property
  def pids(self):
    return [proc.pid for proc in self._procs.values()]

  @property
  def ps_pid(self):
    """The ps task's process id; None for a peer's pool (no ps)."""
    return self._procs[("ps", 0)].pid if self.has_ps else None

  def send(self, key, message):
    """Sends ``message`` to task ``key`` (a ("job", index) pair)."""
    proc = self._procs[key]
    try:
      proc.stdin.write(protocol.encode(message))
      proc.stdin.flush()
    except (BrokenPipeError, OSError) as e:
      raise RunError("%s:%d is gone (%s); see %s" % (
          key[0], key[1], e, self._log.name)) from e

  def _line(self, key, deadline):
    """The next line from ``key``'s stdout, waiting until ``deadline``."""
    proc = self._procs[key]
    while b"\n" not in self._buffers[key]:
      left = deadline - time.monotonic()
      if left <= 0:
        raise RunError("%s:%d did not answer in time; see %s" % (
            key[0], key[1], self._log.name))
      with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(min(left, 1.0)):
          continue
      chunk = os.read(proc.stdout.fileno(), 1 << 20)
      if not chunk:
        raise RunError("%s:%d exited (%s); see %s" % (
            key[0], key[1], proc.poll(), self._log.name))
      self._buffers[key] += chunk
    line, self._buffers[key] = self._buffers[key].split(b"\n", 1)
    return protocol.decode(line)

  def receive(self, key, deadline, expect):
    """The ``expect`` answer of ``key``; RunError for anything else."""
    message = self._line(key, deadline)
    if protocol.ERROR in message:
      raise RunError("%s:%d failed:\n%s" % (key[0], key[1],
                                             message[protocol.ERROR]))
    if expect not in message:
      raise RunError("%s:%d: expected %r, got %r" % (key[0], key[1], expect,
                                                     message))
    return message[expect]

  def receive_all(self, keys, deadline, expect):
    """One ``expect`` answer from each of ``keys``, in whatever order."""
    pending, answers = set(keys), {}
    while pending:
      if time.monotonic() > deadline:
        raise RunError("no %r from %s in time; see %s" % (
            expect, sorted(pending), self._log.name))
      with selectors.DefaultSelector() as sel:
        for key in pending:
          if b"\n" in self._buffers[key]:
            ready = [key]
            break
          sel.register(self._procs[key].stdout, selectors.EVENT_READ, key)
        else:
          ready = [k.data for k, _ in sel.select(
              min(max(deadline - time.monotonic(), 0), 1.0))]
      for key in ready:
        answers[key] = self.receive(key, deadline, expect)
        pending.discard(key)
    return [answers[k] for k in keys]

  def close(self):
    """Asks the workers to leave, then kills whatever is left."""
    for proc in self._procs.values():
      try:
        proc.stdin.close()  # End of stdin: the task leaves.
      except OSError:
        pass
    deadline = time.monotonic() + 10
    for proc in self._procs.values():
      try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
      except subprocess.TimeoutExpired:
        pass
      # Only an unreaped task: a reaped one's pid (its group's id) may
      # already belong to an unrelated process (pid_max is 32768 here).
      if proc.returncode is None:
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      try:
        proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        pass
      if proc.stdout:
        proc.stdout.close()
    self._procs = {}


def run_once(pool, scenario, impl, *, secs, warmup, options, timeout, grace,
             stop_file, op_timeout=120.0):
  """One run of one implementation on ``pool``; returns the workers' records.

  All workers build their graphs at once; the non-chiefs create their
  sessions once the chief's exists, and all start stepping together. The
  chief stops ``secs`` after the warm-up: it writes a last global step to
  ``stop_file``, where the other workers read it.

  Args:
    pool: The Pool to run on.
    scenario: One of protocol.SCENARIOS.
    impl: One of protocol.ALL_IMPLS; a peer's on its own pool.
    secs: Measured seconds.
    warmup: Seconds after the chief's first step before ``secs`` count.
    options: Keyword options for our optimizer.
    timeout: Seconds the whole run may take.
    grace: ``stop_grace_period_secs`` of every worker's session.
    stop_file: Where the chief writes the last global step.
    op_timeout: Seconds any one session.run of a worker may take.

  Returns:
    Every worker's record (the chief's first), the chief's with the
    driver's ``spawned_wall`` (when the run was sent), ``run_secs`` and the
    ps's ``ps_peak_rss_mb`` (its peak during the run; None off Linux).

  Raises:
    RunError: A task failed, left, or did not answer in time.
  """
  stop_file = pathlib.Path(stop_file)
  if stop_file.exists():
    stop_file.unlink()
  workers = pool.workers
  straggler = scenario.startswith("straggler")
  spec = protocol.RunSpec(
      cluster=pool.cluster, scenario=scenario.replace("_backup", ""),
      impl=impl, secs=secs, warmup=warmup, stop_file=str(stop_file),
      replicas=workers - 1 if scenario == "straggler_backup" else workers,
      options=options, straggler_delay=0.03 if straggler else 0,
      grace=grace, pool_pids=pool.pids, op_timeout_secs=op_timeout)
  keys = [("worker", t) for t in range(workers)]
  deadline = time.monotonic() + timeout
  # The ps serves every run of the pool: its peak is this run's only from
  # here (the previous run's variables are gone once the chief resets).
  if pool.has_ps:
    peak_rss.reset(pool.ps_pid)
  sent = time.time()
  for key in keys:
    pool.send(key, protocol.command(protocol.RUN, spec))
  if pool.has_ps:
    pool.receive(keys[0], deadline, protocol.READY)
    for key in keys[1:]:
      pool.send(key, protocol.command(protocol.GO))
    pool.receive_all(keys[1:], deadline, protocol.READY)
  else:  # A peer's workers wait for no chief's initialization.
    pool.receive_all(keys, deadline, protocol.READY)
  for key in keys:
    pool.send(key, protocol.command(protocol.START))
  records = pool.receive_all(keys, deadline, protocol.DONE)
  records[0]["spawned_wall"] = sent
  records[0]["run_secs"] = time.time() - sent
  records[0]["ps_peak_rss_mb"] = (peak_rss.peak_mb(pool.ps_pid)
                                  if pool.has_ps else None)
  return records
