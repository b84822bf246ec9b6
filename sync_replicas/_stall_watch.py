"""The chief's watch over updates that do not come.

A stalled update is logged every ``stall_log_secs`` with what it waits for
(the stall line), stops the job with ``SyncStallError`` past
``stall_timeout_secs``, and, shortly before the sessions' operation timeout,
with ``SyncTimeoutError`` when a worker it needs cannot push. Kept apart from
the sync loop (``_runner``): the loop runs updates, this reads why one does
not come, in threads of its own that the runner starts beside the loop.
"""

import logging

import tensorflow as tf

from sync_replicas import _compat
from sync_replicas import _data_end
from sync_replicas import _diagnose
from sync_replicas import _lost
from sync_replicas import _step_record
from sync_replicas import errors

_LOG = logging.getLogger(__name__)


def _read_local_steps(sess, local_step, reader, recorded=None):
  """Every replica's local step, for the stall line; () if unknowable.

  Against a remote master, each replica task's (``reader``, a
  ``_diagnose.LocalStepReader``: a fresh session per read, bounded); in
  process, this chief's own (``local_step``). Only on a stall report.

  A task whose address is known (``recorded`` on the ps, ``{device:
  "host:port"}``, else TF_CONFIG's entry) is read through its own server,
  every call bounded: through the chief's master a read of a stopped task
  outlives its bound, and one left inside TensorFlow at exit can abort the
  process (``_diagnose.LocalStepReader`` says how).
  """
  if local_step is None:
    return ()
  spec = reader.spec
  try:
    devices = []
    if sess.sess_str:
      devices = _diagnose.replica_devices(
          [d.name for d in sess.list_devices()], spec.device)
    if not devices:
      return [_diagnose.LocalStep(spec.device or "this replica",
                                  int(sess.run(local_step)), None)]
    addresses = dict(recorded or {})
    for device in devices:
      address = addresses.get(device) or _step_record.task_address(
          None, device)
      if address:
        addresses[device] = address
    return reader.read(sess.sess_str, devices,
                       config=_compat.session_config(sess),
                       addresses=addresses)
  except Exception as e:  # pylint: disable=broad-except
    _LOG.debug("reading the replicas' local steps failed: %s", e)
    return ()


def _recorded_addresses(sess, ends, reader):
  """``{key: "host:port"}`` of the workers whose hook recorded its address
  on the ps (a ``data_end`` policy's record), in one bounded run; {}
  without one, or in process (no task is read or probed there)."""
  if ends is None or reader is None or not sess.sess_str:
    return {}
  return ends.local_steps.read_addresses(sess)


def _timeout_error(waited, timeout_ms, what):
  """The ``SyncTimeoutError`` the look before the operation timeout stops
  with, as ``_stall_error``'s tuple."""
  return _lost.timeout_error(
      "Operation timed out: no update for %.0f s, and the sessions' "
      "operation_timeout_in_ms=%d ends every run waiting for it in %.0f s: "
      "%s. The update cannot come while a worker it needs cannot push: "
      "restart that worker's task (the same task index), or let the job go "
      "on without it with worker_gone_secs (or the environment's "
      "SYNC_REPLICAS_WORKER_GONE_SECS) below the operation timeout "
      "(docs/operations.md, \"A worker lost for good\")."
      % (waited, timeout_ms, max(timeout_ms / 1000.0 - waited, 0.0), what))


def _stall_error(waited, timeout_secs, what, *, replicas_to_aggregate):
  """The ``SyncStallError`` a stall past ``stall_timeout_secs`` stops with,
  as the ``exc_info`` tuple ``Coordinator.request_stop`` takes outside an
  ``except`` block (raised once, so that it carries a traceback)."""
  try:
    raise errors.SyncStallError(
        "No update for %.0f s (stall_timeout_secs=%s): %s. Fewer than "
        "replicas_to_aggregate=%d workers are pushing fresh gradients; "
        "restart the missing workers, add backups "
        "(total_num_replicas > replicas_to_aggregate), or raise "
        "stall_timeout_secs." % (waited, timeout_secs, what,
                                 replicas_to_aggregate))
  except errors.SyncStallError as e:
    return type(e), e, e.__traceback__


class StallWatch:
  """What ``SyncQueueRunner``'s watch threads run for one optimizer.

  Args:
    status: The optimizer's status ops (``num_accumulated``, ``tokens``,
      ``starts``, ``names``).
    global_step: The global step variable.
    replicas_to_aggregate: The optimizer's.
    loop: The sync loop; its ``data_end`` (or None) says who is done or gone.
    local_step: This replica's local step variable, or None.
    stall_log_secs, stall_timeout_secs: The optimizer's options.
    updated_at: Returns when the last update ran (``clock``'s time), or None
      before the first.
    clock: A monotonic clock.
  """

  def __init__(self, *, status, global_step, replicas_to_aggregate, loop,
               local_step, stall_log_secs, stall_timeout_secs, updated_at,
               clock):
    self._status = status
    self._global_step = global_step
    self._replicas_to_aggregate = replicas_to_aggregate
    self._loop = loop
    self._local_step = local_step
    self._local_steps = None if local_step is None else (
        _diagnose.LocalStepReader(_diagnose.local_step_spec(local_step)))
    self._stall_log_secs = stall_log_secs
    self._stall_timeout_secs = stall_timeout_secs
    self._updated_at = updated_at
    self._clock = clock

  def look_before_timeout(self, sess, coord, timeout_ms):
    """Stops the job with ``SyncTimeoutError`` when an update has not come
    ``timeout_lead`` seconds before the sessions' operation timeout and a
    worker it needs cannot push.

    Stock's job ends at that timeout, every waiting run with a bare
    ``DeadlineExceededError``. The runs that time out are the sync loop's
    take and every worker's wait for a token, each started at about the
    last update; the chief's own run fails with the rest, and a
    coordinator stopped after that keeps no error. So the chief looks
    first, once per update that does not come: from the record on the ps
    and the probe of each worker not done (``_lost``), the stall line's
    words. If they name a worker that cannot push, the job stops with them
    (the closer then closes the token queue: the workers' runs end before
    their timeout); if not (slow workers), the timeout comes as in stock.
    """
    timeout_secs = timeout_ms / 1000.0
    lead = _lost.timeout_lead(timeout_secs)
    started = self._clock()
    looked = None  # The last update (or start) a look was made after.
    while True:
      since = self._updated_at()
      base = started if since is None else max(since, started)
      due = base + timeout_secs - lead
      if looked == base:
        due = self._clock() + min(lead / 2.0, 1.0)  # For the next update.
      if coord.wait_for_stop(max(due - self._clock(), 0.0)):
        return
      if self._updated_at() != since or looked == base:
        continue
      looked = base
      found = self._stall_text(sess, coord)
      if found is None or self._updated_at() != since or not found[1]:
        continue
      waited = self._clock() - base
      _LOG.error("sync_replicas: no update for %.0f s, the sessions' "
                 "operation timeout (%d ms) comes in %.0f s, and a worker "
                 "the update needs cannot push: the job stops now with "
                 "SyncTimeoutError", waited, timeout_ms,
                 max(timeout_secs - waited, 0.0))
      # Bounded reads and probes may outlast a session stopped meanwhile:
      # then no error is delivered, and this thread ends cleanly.
      _compat.request_stop(coord, _timeout_error(waited, timeout_ms,
                                                  found[0]))
      return

  def _read_status(self, sess, coord):
    """The global step and status ops, read once, as ``_verdict``'s
    keywords; None if the read failed (logged unless the job stops)."""
    try:
      step, counts, tokens, starts = sess.run(
          [self._global_step, self._status.num_accumulated,
           self._status.tokens, self._status.starts])
    except Exception as e:  # pylint: disable=broad-except
      if not coord.should_stop():
        _LOG.debug("status read failed: %s", e)
      return None
    return {"step": step, "counts": counts, "tokens": tokens,
            "starts": starts}

  def _stall_text(self, sess, coord):
    """``(what the update waits for, whether it names a worker that cannot
    push)``, read once; None if the read failed."""
    status = self._read_status(sess, coord)
    return None if status is None else self._verdict(sess, coord, **status)

  def _verdict(self, sess, coord, *, step, counts, tokens, starts):
    """The stall line's words after ``no update for N s: ``, and whether
    they name a worker that cannot push (a task that missed one read only
    if it misses a second look too: ``_lost.lacking``)."""
    ends = self._loop.data_end
    done, gone = _data_end.read_done(sess, ends)
    needed, done_clause = _data_end.stall_part(
        done, ends, self._replicas_to_aggregate, gone=gone)
    # The addresses recorded on the ps, read once (a bounded run) for both
    # reads of the tasks below.
    addresses = _recorded_addresses(sess, ends, self._local_steps)
    # The workers' record on the ps (a data_end policy's); else each
    # worker task's local step, which device filters may hide.
    local_steps = (ends.local_steps.read(sess, done, gone)
                   if ends is not None and done is not None else None)
    if local_steps is None:
      local_steps = _read_local_steps(
          sess, self._local_step, self._local_steps,
          # Only a record (``ends``) has addresses.
          recorded=addresses and _lost.by_device(addresses, ends.devices))
    lost = _lost.stall_clause(sess, ends=ends, done=done, counts=counts,
                              needed=needed, reader=self._local_steps,
                              addresses=addresses, wait=coord.wait_for_stop)
    what = _diagnose.verdict(
        names=self._status.names, counts=counts, tokens=tokens,
        replicas_to_aggregate=needed, global_step=int(step),
        starts=int(starts),
        generations=self._global_step.dtype.base_dtype == tf.int64,
        local_steps=local_steps) + done_clause + lost
    return what, bool(lost)

  def watch(self, sess, coord):
    """Logs what a stalled update waits for; stops the job past a timeout."""
    period = min(x for x in (self._stall_log_secs, self._stall_timeout_secs)
                 if x)
    last_step, since = None, self._clock()
    while not coord.wait_for_stop(period):
      status = self._read_status(sess, coord)
      if status is None:
        return
      now = self._clock()
      if status["step"] != last_step:
        last_step, since = status["step"], now
        continue
      waited = now - since
      what, _ = self._verdict(sess, coord, **status)
      if self._stall_timeout_secs and waited >= self._stall_timeout_secs:
        _compat.request_stop(coord, _stall_error(
            waited, self._stall_timeout_secs, what,
            replicas_to_aggregate=self._replicas_to_aggregate))
        return
      if self._stall_log_secs:
        _LOG.warning("sync_replicas: no update for %.0f s: %s", waited, what)
