"""Which workers a waiting update lacks, and whether their tasks still answer.

Owns the chief's look at the workers behind a stall (issue 44): from the
state on the ps (each worker's key, its recorded address and local step, the
workers done) and a bounded probe of each worker's task, the clause that
names every worker that cannot push (task, address, and why: its task
refuses connections, does not answer, or answers but does not push).

The probe has two stages, each bounded: a TCP connection to the task's
address (refused: nothing listens there, the task is down; no answer: the
host or the link is gone), then, where it connects, a read of the task's
own local step (``_diagnose.LocalStepReader``): a process that is stopped
(SIGSTOP) or hung still gets its connections from the kernel, but its
server answers nothing. A task that misses that read is looked at again
before anything is concluded (``lacking``): every caller (the stall line,
the look before the operation timeout, the chief's watch for gone workers,
a worker's watch on the chief) gets that second look from this one place.
"""

import errno
import logging
import socket
import threading
import time

from sync_replicas import _compat
from sync_replicas import _diagnose
from sync_replicas import _task_names
from sync_replicas import errors

_LOG = logging.getLogger(__name__)

#: Bound on the TCP probe of one task, in seconds.
CONNECT_TIMEOUT_SECS = 2.0
#: Pause before the second look at a task that accepted the connection but
#: missed the read's bound (``lacking``), in seconds.
SECOND_LOOK_SECS = 1.0
#: How long before the sessions' operation timeout the chief looks at an
#: update that has not come, and a worker at the chief while its train run
#: waits for a token: this fraction of the timeout, at least
#: TIMEOUT_LEAD_MIN_SECS (the reads of the record, and the probe of a task
#: that misses a read: a connection, a read bounded at 2 s and its thread's
#: join at 3 s, the pause, and the same again, take up to about 8 s), at
#: most half of it.
TIMEOUT_LEAD_FRACTION = 0.1
TIMEOUT_LEAD_MIN_SECS = 10.0
#: The key of the chief in the workers' records (``_data_end.worker_key``).
CHIEF_KEY = 0

REFUSED = "its task refuses connections (down)"
NO_ANSWER = ("its task does not answer (stopped or hung, or its host or "
             "link is down)")
SILENT = ("its task accepts connections but does not answer (stopped or "
          "hung)")
#: The words of ``lacking``'s line on a task it looks at again.
LOOKED_AGAIN = "is looked at again"


def probe_address(address, *, timeout_secs=CONNECT_TIMEOUT_SECS):
  """None if a TCP connection to ``address`` (``host:port``) opens, else
  why not (``REFUSED``, ``NO_ANSWER``, or what the resolver said)."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)),
                                  timeout=timeout_secs):
      return None
  except ConnectionRefusedError:
    return REFUSED
  except (socket.timeout, TimeoutError):
    return NO_ANSWER
  except socket.gaierror as e:
    return "its address %s does not resolve (%s)" % (address, e)
  except (OSError, ValueError) as e:
    if getattr(e, "errno", None) in (errno.EHOSTUNREACH, errno.ENETUNREACH):
      return NO_ANSWER
    return "its address %s cannot be reached (%s)" % (address, e)


def key_devices(local_step_device, total_num_replicas):
  """``{key: task device}``: the task of each worker key (``_data_end``'s
  keys are task indices, the chief first in a ``chief`` job's layout)."""
  devices = _diagnose.manifest_devices(local_step_device, total_num_replicas)
  return dict(enumerate(devices))


def lacking(*, keys, addresses, devices, read_steps, wait,
            probe=probe_address):
  """``[(key, device, address, reason)]`` of the workers in ``keys`` that
  cannot push, in key order.

  A task that refuses the connection, or does not answer it, is named at
  once: the kernel answers a live listening socket whatever the load. One
  that accepts it but misses the read's bound (``SILENT``) may only be
  starved of CPU on a loaded machine, where a single missed read once
  stopped a job, or ended a worker, whose task went on a moment later. So
  it is looked at again ``SECOND_LOOK_SECS`` later, a fresh probe and read
  (or the first read, still unanswered: ``LocalStepReader`` starts none
  beside it, and it has waited its bound, its thread's join and the
  pause), and named only if that look finds it unable to push too.

  Args:
    keys: The keys of the workers the update may wait for (not done).
    addresses: ``{key: "host:port"}`` recorded on the ps.
    devices: ``{key: task device}``.
    read_steps: Reads the local step of a list of task devices, bounded
      (``LocalStepReader.read`` with its target bound); a reading whose step
      is None did not answer.
    wait: ``wait(secs)``, the pause before a second look, True if the
      caller was asked to stop meanwhile (a coordinator's
      ``wait_for_stop``): then none is named. None: no second look (the
      status tool, whose readings are made before).
    probe: ``probe_address`` (for tests).
  """
  found = _look(keys, addresses, devices, read_steps, probe)
  doubted = sorted(k for k, reason in found.items() if reason == SILENT)
  if doubted and wait is not None:
    for key in doubted:
      _LOG.info("sync_replicas: %s accepts connections but did not answer a "
                "read of its local step in time: it %s in %.0f s before it "
                "is named lost", named(key, devices.get(key),
                                       addresses.get(key)),
                LOOKED_AGAIN, SECOND_LOOK_SECS)
    if wait(SECOND_LOOK_SECS):
      return []
    again = _look(doubted, addresses, devices, read_steps, probe)
    for key in doubted:
      if key in again:
        found[key] = again[key]
      else:
        del found[key]
  return [(key, devices.get(key), addresses.get(key), found[key])
          for key in sorted(found)]


def _look(keys, addresses, devices, read_steps, probe):
  """``{key: reason}`` of one probe and read of each of ``keys``."""
  found, to_read = {}, []
  for key in sorted(keys):
    address = addresses.get(key)
    reason = probe(address) if address else None
    if reason is not None:
      found[key] = reason
    elif key in devices:
      to_read.append(key)
  if to_read:
    for key, reading in zip(to_read, read_steps([devices[k] for k in to_read]),
                            strict=True):
      if reading.step is None and reading.error != "not started":
        found[key] = SILENT if addresses.get(key) else (
            "its task does not answer (%s)" % reading.error)
  return found


def by_device(addresses, devices):
  """``{device: "host:port"}`` from ``{key: address}`` and ``{key:
  device}``: where ``LocalStepReader.read`` reads each task through its
  own server, every call bounded."""
  return {devices[k]: a for k, a in addresses.items() if k in devices}


def named(key, device, address):
  """``worker1 at 127.0.0.1:2225``: a worker as the lines name it, by its
  task (``_task_names``), with the address recorded on the ps if any."""
  return (_task_names.of_device(device) or "key %d (task unknown)" % key) + (
      " at %s" % address if address else "")


def clause(lost, *, missing):
  """The stall line's part naming the workers that cannot push ("; ..."),
  "" if none.

  Args:
    lost: ``lacking``'s result.
    missing: Gradients the update still lacks (at least the fewest of any
      accumulator).
  """
  if not lost:
    return ""
  entries = ["%s: %s" % (named(key, device, address), reason)
             for key, device, address, reason in lost]
  return ("; the update lacks %d gradient(s); %d worker(s) cannot push: %s"
          % (missing, len(lost), "; ".join(entries)))


def stall_clause(sess, *, ends, done, counts, needed, reader, addresses,
                 wait):
  """The chief's clause for a stall line, "" where it cannot tell.

  Args:
    sess: The chief's session (a remote master's: in process no task is
      probed).
    ends: The ``_data_end.DataEnd`` (None without a policy: no record).
    done: The keys of the workers done (``_data_end.read_done``).
    counts: The accumulators' fresh gradient counts.
    needed: Gradients the update needs.
    reader: The runner's ``_diagnose.LocalStepReader`` (None without a
      local step).
    addresses: ``{key: "host:port"}`` recorded on the ps
      (``ends.local_steps.read_addresses``), read by the caller, whose
      other reads of the tasks use them too.
    wait: The pause before a second look (``lacking``): the coordinator's
      ``wait_for_stop``.
  """
  if ends is None or done is None or reader is None or not sess.sess_str:
    return ""
  missing = needed - min(counts, default=needed)
  if missing <= 0:
    return ""
  total = ends.total_num_replicas
  config = _compat.session_config(sess)
  devices = key_devices(reader.spec.device, total)
  lost = lacking(
      # Not the chief's own key (``ends.key``): this line is its own proof
      # that it runs, and a probe of itself can only mislead. Its task
      # accepts the connection, but the read of its own local step (a fresh
      # session, bounded at 2 s) can miss that bound on a loaded machine,
      # which the probe reports as a task "stopped or hung": seen on
      # TensorFlow 2.15 as the chief naming itself in its own stall line.
      keys=set(range(total)) - set(done) - {ends.key},
      addresses=addresses, devices=devices,
      read_steps=lambda wanted: reader.read(
          sess.sess_str, wanted, config=config,
          addresses=by_device(addresses, devices)),
      wait=wait)
  return clause(lost, missing=missing)


def timeout_lead(timeout_secs):
  """Seconds before an operation timeout of ``timeout_secs`` that the
  looks ahead of it are made."""
  return min(max(TIMEOUT_LEAD_FRACTION * timeout_secs, TIMEOUT_LEAD_MIN_SECS),
             timeout_secs / 2.0)


def timeout_error(message):
  """``SyncTimeoutError(message)`` as the ``exc_info`` tuple
  ``Coordinator.request_stop`` takes outside an ``except`` block (raised
  once, so that it carries a traceback)."""
  try:
    raise errors.SyncTimeoutError(message)
  except errors.SyncTimeoutError as e:
    return type(e), e, e.__traceback__


class ChiefWatch:
  """A non-chief's look at the chief while its train run waits for a token.

  Only the chief's loop releases tokens: with the chief lost for good, every
  worker's run waits until the sessions' operation timeout and ends with a
  bare ``DeadlineExceededError``, as in stock. The hook notes each train
  run's start and end (``run_started``, ``run_ended``); ``timeout_lead``
  seconds before a run in flight would time out, this watch probes the
  chief's task (its address from the record on the ps, ``lacking``'s
  bounded probe, with its second look at a chief that misses one read). If the chief cannot push, it stops the worker's
  coordinator with ``SyncTimeoutError`` naming it: the run still ends at
  its timeout, and MonitoredSession's close then raises this error, the
  bare one as its context. A chief that answers changes nothing. A look
  that ends after the session stopped (its run timed out first, and the
  close's grace for this thread ran out) delivers nothing: the error stays
  in the log, and the thread ends cleanly (``_compat.request_stop``).

  Args:
    read_addresses: Returns ``{key: "host:port"}`` from the record on the
      ps, given a session.
    local_step: The worker's ``_diagnose.LocalStepSpec`` (its device names
      the job's tasks; the probe reads the chief's).
    total_num_replicas: Workers in the job.
    timeout_ms: The sessions' ``operation_timeout_in_ms``.
    clock: ``time.monotonic`` (for tests).
  """

  def __init__(self, *, read_addresses, local_step, total_num_replicas,
               timeout_ms, clock=time.monotonic):
    self._read_addresses = read_addresses
    self._reader = _diagnose.LocalStepReader(local_step)
    self._devices = key_devices(local_step.device, total_num_replicas)
    self._timeout_ms, self._clock = timeout_ms, clock
    self._lock = threading.Lock()
    self._started = None  # When the train run in flight began, or None.

  def run_started(self):
    with self._lock:
      self._started = self._clock()

  def run_ended(self):
    with self._lock:
      self._started = None

  def _in_flight(self):
    with self._lock:
      return self._started

  def thread(self, session, coord):
    """The watch of ``session`` (not started)."""
    return threading.Thread(target=self._run, args=(session, coord),
                            name="SyncReplicasChiefWatch", daemon=True)

  def _run(self, session, coord):
    timeout_secs = self._timeout_ms / 1000.0
    lead = timeout_lead(timeout_secs)
    looked = None  # The run (its start) already looked at.
    while True:
      started = self._in_flight()
      if started is None or started == looked:
        due = self._clock() + min(lead / 2.0, 1.0)
      else:
        due = started + timeout_secs - lead
      if coord.wait_for_stop(max(due - self._clock(), 0.0)):
        return
      if started is None or started == looked or (
          self._in_flight() != started):
        continue
      looked = started
      lost = self._chief_lost(session, coord)
      if not lost or self._in_flight() != started:
        continue
      _, device, address, reason = lost[0]
      waited = self._clock() - started
      message = (
          "Operation timed out: this worker's train run has waited %.0f s "
          "for a token, and the sessions' operation_timeout_in_ms=%d ends "
          "it in %.0f s: only the chief releases tokens, and the chief, "
          "%s, cannot: %s. Restart the chief's task (the "
          "same task index and checkpoint directory): it resumes from the "
          "last checkpoint, and the workers restarted after it rejoin "
          "(docs/operations.md, \"The chief lost for good\")." % (
              waited, self._timeout_ms, max(timeout_secs - waited, 0.0),
              named(CHIEF_KEY, device, address), reason))
      _LOG.error("sync_replicas: %s", message)
      if not _compat.request_stop(coord, timeout_error(message)):
        # The run ended (its own timeout) and the session stopped while
        # this look ran: its error is the run's, and this line says why.
        _LOG.warning("sync_replicas: this worker's session stopped before "
                     "the error above could end it")
      return

  def _chief_lost(self, session, coord):
    """``lacking``'s finding on the chief, [] if it answers (or its
    address cannot be read, or ``coord`` stops during a second look)."""
    addresses = self._read_addresses(session)
    if CHIEF_KEY not in addresses:
      return []
    config = _compat.session_config(session)
    return lacking(
        keys={CHIEF_KEY}, addresses=addresses, devices=self._devices,
        read_steps=lambda devices: self._reader.read(
            session.sess_str, devices, config=config,
            addresses=by_device(addresses, self._devices)),
        wait=coord.wait_for_stop)
