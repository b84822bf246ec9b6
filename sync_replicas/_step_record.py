"""Every worker's local step, recorded on the ps for the chief's stall line.

Owns a hash table in our own name scope on the global step's device (key:
the worker's ``_data_end.worker_key``, value: the token its last train run
took, which is its local step), the insert a worker's hook runs with each
train run, and the chief's read of it. Built with a ``data_end`` policy
only.

Without it the chief reads each worker task's ``sync_rep_local_step``
(``_diagnose.LocalStepReader``), which ``device_filters`` hide from the
chief (the README recommends filters that show each worker only the ps
tasks and itself): the stall line then named the chief alone. On the ps
every worker's step is there, a worker that crashed keeps its last one,
and the done record says which have ended.

The insert is not a dependency of the train op, so that every op outside
our scope stays stock's: the hook fetches it beside the train op. Its input
is the dequeued token, on the ps where the dequeue ran, so the run's ps
partition does it: no transfer, no extra round trip. A Supervisor loop runs
no hook and records nothing; the stall line then reads the tasks as before.

Beside it, every worker's task address (a second table: key to
``host:port``), which the hook records at each session's start, so that the
chief can name a worker whose gradient an update lacks and probe its task
(``_lost``).
"""

import json
import logging
import os
import socket
import time
import urllib.parse

import tensorflow as tf

from sync_replicas import _diagnose

_LOG = logging.getLogger(__name__)

#: Bound on the chief's read of the record, on a stall report.
READ_TIMEOUT_MS = 10_000


class LocalStepRecord:
  """The record; ``build`` makes the table and its read, ``record`` the
  worker's insert (with its train op).

  Args:
    shared_prefix: What the optimizer's shared names start with.
    total_num_replicas: Workers in the job.
  """

  def __init__(self, *, shared_prefix, total_num_replicas):
    self.shared_name = shared_prefix + "sync_replicas_local_steps"
    self._total = total_num_replicas
    self._device = self._scope = self._key = None
    self._table = self._export = None
    self._insert = self._train_runs = None
    self._addresses = self._address = self._address_insert = None
    self._address_export = self._device_of_worker = None
    self._started = self._start_insert = None

  def build(self, *, device, scope, key, worker_device=None):
    """The tables, on ``device`` in ``scope``; ``key``: this worker's;
    ``worker_device``: where its local step lives (its task)."""
    self._device, self._scope, self._key = device, scope, key
    self._device_of_worker = worker_device
    with tf.compat.v1.device(device), tf.compat.v1.name_scope(scope):
      # A table, not a variable: no Saver, readiness check or checkpoint
      # sees it.
      self._table = tf.raw_ops.MutableHashTableV2(
          shared_name=self.shared_name, use_node_name_sharing=False,
          key_dtype=tf.int64, value_dtype=tf.int64, name="local_steps")
      self._export = tf.raw_ops.LookupTableExportV2(
          table_handle=self._table, Tkeys=tf.int64, Tvalues=tf.int64,
          name="local_steps_export")
      self._addresses = tf.raw_ops.MutableHashTableV2(
          shared_name=self.shared_name + "_addresses",
          use_node_name_sharing=False, key_dtype=tf.int64,
          value_dtype=tf.string, name="worker_addresses")
      self._address = tf.compat.v1.placeholder(tf.string, [],
                                               name="worker_address")
      self._address_insert = tf.raw_ops.LookupTableInsertV2(
          table_handle=self._addresses,
          keys=tf.constant([key], tf.int64),
          values=tf.reshape(self._address, [1]), name="record_address")
      # The session's start, as a fresh negative step: the chief's watch
      # for gone workers sees the record change (_gone).
      self._started = tf.compat.v1.placeholder(tf.int64, [],
                                               name="session_started")
      self._start_insert = tf.raw_ops.LookupTableInsertV2(
          table_handle=self._table, keys=tf.constant([key], tf.int64),
          values=tf.reshape(self._started, [1]), name="record_start")
      self._address_export = tf.raw_ops.LookupTableExportV2(
          table_handle=self._addresses, Tkeys=tf.int64, Tvalues=tf.string,
          name="addresses_export")

  def record(self, token, *, train_runs):
    """The insert of ``token`` (the train op's new local step, on the ps)
    under this worker's key; the hook runs it with the train op
    (``train_runs``, the optimizer's ``_train_runs.TrainRuns``)."""
    with tf.compat.v1.device(self._device), \
        tf.compat.v1.name_scope(self._scope):
      self._insert = tf.raw_ops.LookupTableInsertV2(
          table_handle=self._table,
          keys=tf.constant([self._key], tf.int64),
          values=tf.reshape(tf.cast(token, tf.int64), [1]),
          name="record_local_step")
    self._train_runs = train_runs

  @property
  def export(self):
    """The record's ``(keys, steps)``; a step below 0 is a session's start
    before its first train run."""
    return self._export

  def fetches_for(self, fetches):
    """The insert if a run of ``fetches`` trains, else None (fetched in
    any other run it would run a push and take a token)."""
    if self._insert is None or not self._train_runs.runs_train_op(fetches):
      return None
    return self._insert

  def read(self, session, done_keys, gone_keys=()):
    """``_diagnose.LocalStep`` readings of every key, those in
    ``done_keys`` marked done (``_diagnose.GONE`` for those also in
    ``gone_keys``); None if the record is empty (no hook ran a train step
    yet, or a Supervisor loop) or cannot be read.

    When every key is a task index (below ``total_num_replicas``), a
    worker that never finished a train step is listed too.
    """
    read = _read_table(session, self._export, "the workers' local steps")
    if read is None or not len(read[0]):
      return None
    keys, steps = read
    # A negative step is a session's start (record_address): no step yet.
    found = {int(k): int(v) for k, v in zip(keys, steps, strict=True)
             if int(v) >= 0}
    done = {int(k) for k in done_keys or ()}
    gone = {int(k) for k in gone_keys or ()}
    every = set(found) | done
    if all(0 <= k < self._total for k in every):
      every |= set(range(self._total))
    # Labelled by task device (the lines name the task: chief0, worker1),
    # "key N" where the job names no task (in process).
    devices = dict(enumerate(_diagnose.manifest_devices(
        self._device_of_worker, self._total)))
    return [_diagnose.LocalStep(
        devices.get(k, "key %d" % k), found.get(k),
        None if k in found else "no step yet",
        done=_diagnose.GONE if k in gone else k in done)
            for k in sorted(every)]

  def record_address(self, session, *, environ=None):
    """Records this worker's task address under its key, and the
    session's start in the local-step record (a fresh negative value, which
    takes a gone worker back: ``_gone``); the hook calls it at each
    session's start. Best effort: a failure is logged at debug."""
    # A session-like object without a target (a user's wrapper, a test's
    # recorder) still gets TF_CONFIG's address, or none.
    address = task_address(getattr(session, "sess_str", None),
                           self._device_of_worker, environ=environ)
    if address is None or self._address_insert is None:
      return
    try:
      session.run([self._address_insert, self._start_insert],
                  feed_dict={self._address: address,
                             self._started: -1 - time.time_ns() // 1000},
                  options=tf.compat.v1.RunOptions(
                      timeout_in_ms=READ_TIMEOUT_MS))
    except tf.errors.OpError as e:
      _LOG.debug("recording this worker's address on the ps failed: %s", e)

  def read_addresses(self, session):
    """``{key: "host:port"}`` of every worker that recorded one; {} if the
    table cannot be read."""
    if self._address_export is None:
      return {}
    read = _read_table(session, self._address_export,
                       "the workers' addresses")
    if read is None:
      return {}
    return {int(k): v.decode("utf-8")
            for k, v in zip(*read, strict=True)}


def _read_table(session, export, what):
  """``(keys, values)`` of a table's ``export``, in one bounded run; None
  (logged at debug) if it cannot be read: the readers are best effort."""
  try:
    return session.run(
        export, options=tf.compat.v1.RunOptions(timeout_in_ms=READ_TIMEOUT_MS))
  except Exception as e:  # pylint: disable=broad-except
    _LOG.debug("reading %s on the ps failed: %s", what, e)
    return None


#: What the done record's shared name ends with (``_data_end.DataEnd``).
_DONE_SUFFIX = "sync_replicas_done"


def addresses_name(done_shared_name):
  """The address table's shared name, from the done record's (the status
  tool's manifest names only the latter): the same prefix."""
  prefix = done_shared_name[:-len(_DONE_SUFFIX)]
  return prefix + "sync_replicas_local_steps_addresses"


def task_address(target, device, *, environ=None):
  """This worker's ``host:port``, or None if it cannot tell.

  TF_CONFIG's entry for the task of ``device`` (a ``/job:J/.../task:T``
  string) where it has one; else the port of ``target`` (this task's server,
  ``grpc://localhost:PORT`` for a ``tf.distribute.Server``) on this host's
  name, which other hosts can resolve where ``localhost`` names their own.
  """
  environ = os.environ if environ is None else environ
  spec = tf.DeviceSpec.from_string(device or "")
  try:
    cluster = json.loads(environ.get("TF_CONFIG") or "{}").get("cluster", {})
    return str(cluster[spec.job][spec.task])
  except (ValueError, AttributeError, KeyError, IndexError, TypeError):
    pass
  if isinstance(target, bytes):  # tf.distribute.Server.target is bytes.
    target = target.decode("utf-8")
  parsed = urllib.parse.urlsplit(target or "")
  if not parsed.port:
    return None
  host = parsed.hostname or "localhost"
  if host == "localhost":
    host = socket.gethostname()
  return "%s:%d" % (host, parsed.port)
