"""Why an update waits: the stall verdict, with every worker's local step.

Owns the one text that says what a stalled update waits for (the chief's
stall log line and ``sync-replicas-status`` both print it) and the read, from
outside any worker's graph, of every worker's ``sync_rep_local_step``.

An accumulator drops a push whose local step is behind its own step and
counts nothing for it, so "0/2 gradients" alone cannot tell workers that are
gone from workers whose every push is stale. The local steps can: a worker
holds the step of the last token it took, and pushes with it. They live on
each worker's own task, so they are read only when a stall is reported (in a
fresh graph, through ``VarHandleOp``/``VariableV2`` by the variable's name, as
between-graph replication shares variables), never on the training path.

A read runs in a thread of its own, and one that misses its bound is left
behind; the interpreter's exit waits for it (``wait_for_reads``, bounded):
a thread that comes back from TensorFlow while the interpreter finalizes is
ended by CPython inside TensorFlow's C++ frames, which aborts the process
("FATAL: exception not rethrown", exit 134) where Python's exit code was
due.
"""

import atexit
import collections
import logging
import threading
import time

import tensorflow as tf

from sync_replicas import _compat
from sync_replicas import _restart
from sync_replicas import _task_names

_LOG = logging.getLogger(__name__)

#: Jobs whose tasks may run a replica (a TF_CONFIG job may name a "chief").
REPLICA_JOBS = ("chief", "worker")
#: Bound on reading one worker's local step: a dead worker is reported as
#: unreachable, never waited for.
READ_TIMEOUT_MS = 2000
#: How long past its own bound the interpreter's exit waits for a read
#: still in flight (``wait_for_reads``): a read through the task's own
#: server ends by its bound; this is the time its thread needs to leave.
EXIT_GRACE_SECS = 2.0

# name: the variable's op name (the same in every worker's graph); dtype: its
# dtype's name; resource: a resource variable (else a TF1 ref variable);
# device: the device it has in this graph ("" when unplaced).
LocalStepSpec = collections.namedtuple(
    "LocalStepSpec", ["name", "dtype", "resource", "device"])
# device: the task read (or "key N" in the ps's record where no task is
# known); the lines name it by its task (``_task_names``); step: its
# local step, or None with ``error`` saying why it could not be read; done:
# its input ended (data_end), or "gone" (worker_gone_secs): either way the
# updates do not wait for it, and it is never counted stale.
LocalStep = collections.namedtuple("LocalStep",
                                   ["device", "step", "error", "done"],
                                   defaults=(False,))
#: ``LocalStep.done`` of a worker declared gone.
GONE = "gone"


def local_step_spec(local_step):
  """What a reader needs to find ``local_step`` on every worker."""
  return LocalStepSpec(local_step.op.name, local_step.dtype.base_dtype.name,
                       not _compat.is_ref_variable(local_step),
                       local_step.device)


def replica_devices(device_names, own_device):
  """The task devices (``/job:J/replica:R/task:T``) that may hold a replica.

  Args:
    device_names: Every device of the cluster, as ``Session.list_devices``
      names them.
    own_device: This worker's local step device: its job counts too.

  Returns:
    Sorted task device strings, one per task.
  """
  jobs = set(REPLICA_JOBS)
  own = tf.DeviceSpec.from_string(own_device or "")
  if own.job:
    jobs.add(own.job)
  tasks = set()
  for name in device_names:
    spec = tf.DeviceSpec.from_string(name)
    if spec.job in jobs and spec.task is not None:
      tasks.add((spec.job, spec.replica or 0, spec.task))
  return ["/job:%s/replica:%d/task:%d" % t for t in sorted(tasks)]


def probe_config(config, device):
  """The chief session's config, filtered to ``device``'s task alone.

  A replica's local step lives on its own task, which the chief's own
  filters may exclude; a session filtered to that task alone also never
  waits for any other (dead) task.
  """
  probe = tf.compat.v1.ConfigProto()
  if config is not None:
    probe.CopyFrom(config)
  del probe.device_filters[:]
  probe.device_filters.append(device)
  return probe


def _read_op(spec, device):
  dtype = tf.as_dtype(spec.dtype)
  scope = spec.name.rpartition("/")[0]
  base = spec.name.rpartition("/")[2]
  with tf.compat.v1.device(device), tf.compat.v1.name_scope(
      scope + "/" if scope else None):
    if spec.resource:
      handle = tf.raw_ops.VarHandleOp(dtype=dtype, shape=[],
                                      shared_name=spec.name)
      return tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)
    # A ref variable is shared by its node name: the op must carry it.
    ref = tf.raw_ops.VariableV2(shape=[], dtype=dtype, name=base)
    return tf.identity(ref)


class LocalStepReader:
  """Reads every worker's local step, each read bounded in time.

  A read placed on a task through another task's master (the chief's, the
  ps's) blocks inside TensorFlow beyond any timeout while that task is
  stopped or hung (measured: a read placed on a dead task of a live cluster
  never returned; one on a SIGSTOPped task returns only when it resumes).
  So a task whose address is known is read through its own server, where
  the sessions' operation timeout bounds every call; and each device is read
  in a daemon thread of its own, waited for at most ``timeout_secs``; a
  device whose earlier read still blocks is reported unreachable without a
  second thread, so at most one thread per silent task is ever left waiting,
  and the interpreter's exit waits for it (``wait_for_reads``).
  """

  def __init__(self, spec, *, timeout_secs=READ_TIMEOUT_MS / 1000.0):
    #: The ``LocalStepSpec`` read on every device.
    self.spec = spec
    self._timeout_secs = timeout_secs
    self._blocked = {}  # device -> the thread still inside its read

  def read(self, target, devices, *, config=None, addresses=None):
    """A ``LocalStep`` per device, in order, within about ``timeout_secs``.

    ``addresses``: ``{device: "host:port"}`` of the tasks whose address is
    known (``_lost.by_device``): each is read through its own server.
    """
    results, threads = {}, {}
    timeout_ms = int(self._timeout_secs * 1000)
    for device in devices:
      stuck = self._blocked.get(device)
      if stuck is not None and stuck.is_alive():
        results[device] = LocalStep(device, None,
                                    "unreachable (an earlier read still waits)")
        continue
      address = (addresses or {}).get(device)
      thread = threading.Thread(
          target=lambda d=device, a=address: results.__setitem__(
              d, _read_one(target, self.spec, d, config, timeout_ms,
                           address=a)),
          name="SyncReplicasLocalStepRead", daemon=True)
      thread.start()
      _in_flight(thread, self._timeout_secs)
      threads[device] = thread
    for device, thread in threads.items():
      thread.join(self._timeout_secs + 1.0)
      if thread.is_alive():
        self._blocked[device] = thread
        results.setdefault(device, LocalStep(device, None, "unreachable"))
      else:
        self._blocked.pop(device, None)
    return [results[d] for d in devices]


#: Read threads started and their deadlines, for the interpreter's exit.
_READS: list[tuple[threading.Thread, float]] = []
_READS_LOCK = threading.Lock()


def _in_flight(thread, timeout_secs):
  with _READS_LOCK:
    _READS[:] = [(t, d) for t, d in _READS if t.is_alive()]
    _READS.append((thread, time.monotonic() + timeout_secs + EXIT_GRACE_SECS))


def wait_for_reads(clock=time.monotonic):
  """Waits for the reads still in flight, each until its deadline (its
  bound and ``EXIT_GRACE_SECS``); registered with ``atexit``, which runs
  before the interpreter finalizes. A read through another task's master
  may outlive its deadline (the class says why): it is not waited for,
  as an exit must not hang on a stopped task."""
  with _READS_LOCK:
    reads = list(_READS)
  for thread, deadline in reads:
    remaining = deadline - clock()
    if remaining > 0:
      thread.join(remaining)


atexit.register(wait_for_reads)


def _read_one(target, spec, device, config, timeout_ms, *, address=None):
  """One device's local step, in a fresh graph and session: through the
  task's own server at ``address`` if given, its every call bounded by
  ``timeout_ms`` (the session's operation timeout), else through
  ``target``'s master."""
  graph = tf.Graph()
  with graph.as_default():
    read = _read_op(spec, device)
  options = tf.compat.v1.RunOptions(timeout_in_ms=timeout_ms)
  config = probe_config(config, device)
  if address:
    target = "grpc://" + address
    config.operation_timeout_in_ms = timeout_ms
  try:
    with tf.compat.v1.Session(target, graph=graph, config=config) as sess:
      return _run_read(sess, read, device, options)
  except tf.errors.OpError as e:
    return LocalStep(device, None, _reason(e))


def _run_read(sess, read, device, options):
  try:
    return LocalStep(device, int(sess.run(read, options=options)), None)
  except tf.errors.OpError as e:
    return LocalStep(device, None, _reason(e))


def _reason(error):
  # A task whose replica has not started (or not initialized) has no local
  # step yet: TensorFlow says NotFound or FailedPrecondition for the read.
  return {tf.errors.NotFoundError: "not started",
          tf.errors.FailedPreconditionError: "not started",
          tf.errors.DeadlineExceededError: "unreachable",
          tf.errors.UnavailableError: "unreachable"}.get(
              type(error), type(error).__name__)


def manifest_devices(local_step_device, total_num_replicas):
  """The replica tasks of a job, from its manifest's local step device.

  Tasks ``0..total-1`` of the local step's job; a job run with a ``chief``
  task (TF_CONFIG) has the chief and ``total - 1`` workers. An unplaced
  local step (an in-process job) names no task: empty.
  """
  job = tf.DeviceSpec.from_string(local_step_device or "").job
  if not job:
    return []
  if job == "chief":
    return ["/job:chief/replica:0/task:0"] + [
        "/job:worker/replica:0/task:%d" % i
        for i in range(total_num_replicas - 1)]
  return ["/job:%s/replica:0/task:%d" % (job, i)
          for i in range(total_num_replicas)]


def verdict(*, names, counts, tokens, replicas_to_aggregate, global_step,
            starts=None, generations=False, local_steps=()):
  """One line: what the next update waits for, and why, where it can tell.

  Args:
    names: Accumulator (variable) names, in order.
    counts: Their fresh gradient counts.
    tokens: Tokens queued.
    replicas_to_aggregate: Gradients each update needs.
    global_step: The global step's value.
    starts: How many times ``chief_init_op`` ran on this ps (the generation
      queue's length), or None if unknown.
    generations: The steps carry the restart generation (int64 steps).
    local_steps: ``LocalStep`` readings of the workers, if any.

  Returns:
    The text.
  """
  waiting = ["%s %d/%d" % (n, c, replicas_to_aggregate)
             for n, c in zip(names, counts, strict=True)
             if c < replicas_to_aggregate]
  text = ("update to step %d waits for gradients: %s; %d token(s) queued"
          % (global_step + 1, ", ".join(waiting) or "none (applying)", tokens))
  clause = replicas_clause(
      local_steps, global_step=global_step, tokens=tokens, starts=starts,
      generations=generations, waiting=bool(waiting))
  return text + "; " + clause if clause else text


def replicas_clause(local_steps, *, global_step, tokens, starts, generations,
                    waiting):
  """The replicas' part of the verdict: their local steps, and what follows.

  Args:
    local_steps: ``LocalStep`` readings; empty gives an empty clause.
    global_step: The global step's value.
    tokens: Tokens queued.
    starts: ``chief_init_op`` runs on this ps, or None if unknown.
    generations: The steps carry the restart generation (int64 steps).
    waiting: Some accumulator holds fewer gradients than an update needs.

  Returns:
    The text, or "" without readings.
  """
  if not local_steps:
    return ""
  generation = _restart.generation_of(starts)
  current = global_step + (
      generation * _restart.GENERATION_STRIDE if generations else 0)
  shown, stale, fresh = [], [], []
  for reading in local_steps:
    # The task's name (worker1), as every line names it; else the label.
    who = _task_names.of_device(reading.device) or reading.device
    done = " (%s)" % ("gone" if reading.done == GONE else "done") if (
        reading.done) else ""
    if reading.step is None:
      shown.append("%s %s%s" % (who, reading.error, done))
      continue
    gen, plain = _restart.decode(reading.step, generations)
    label = "%s %d" % (who, plain)
    if gen != generation:
      label += " (generation %d, current %d)" % (gen, generation)
    shown.append(label + done)
    if not reading.done:
      (stale if reading.step < current else fresh).append(who)
  text = "workers' local steps: " + ", ".join(shown)
  if stale:
    text += ("; every push from %s is stale (local step behind global step "
             "%d) and dropped" % (", ".join(stale), global_step))
    if not fresh and tokens == 0:
      text += (": no worker can push a fresh gradient and no token is "
               "queued, so no update can happen")
  elif waiting and tokens == 0 and starts == 0 and all(
      r.step == current for r in local_steps
      if r.step is not None and not r.done):
    # Workers hold the newest token, yet nothing accumulates: if they still
    # push, the accumulators' own step is ahead of the global step.
    text += ("; if these workers still train, their pushes are dropped: the "
             "accumulators' step is ahead of the global step, as after the "
             "global step went back (a checkpoint restore) without "
             "chief_init_op, which resets them; chief_init_op never ran on "
             "this ps: run it after restoring (the hook and TF 0.12's "
             "Supervisor recipe do)")
  return text
