"""A worker lost for good: declared gone when asked, and taken back.

Owns ``worker_gone_secs`` (its check and its environment variable), the
mark a gone worker gets in the done record (``_data_end``'s table on the ps),
and the chief's watch that declares a worker gone and takes it back.

Stock, and this package by default, wait for a lost worker's gradient for
good (or until the operation timeout ends every process). With
``worker_gone_secs=T`` the chief declares gone a worker that, while the
global step has not moved for ``T`` seconds, started once (its hook recorded
its address) and cannot push: its task refuses
connections, does not answer, or accepts them but does not answer
(``_lost.lacking``'s bounded probe; the last at two looks a pause apart,
since a live task starved of CPU can miss one read's bound). With backups or an aggregation deadline
the updates go on without a lost worker (and its tokens go to the others),
so there a worker whose local-step record has not moved for ``T`` seconds is
probed, and declared, the same way. A gone worker is counted as a done
worker is (``data_end="train_all"``): each update then needs
``min(replicas_to_aggregate, workers neither done nor gone)`` gradients and
the chief releases one token per live worker. Its mark lives in the same
table, under the same key, with the value ``GONE`` instead of a batch count,
so everything that keeps the workers done keeps it too: the chief's copy
that puts the table back after a restart of its ps task, and a restarted
chief's read of it.

Unlike done-ness, gone-ness is revocable: a gone worker whose entry in the
local-step record (``_step_record``) changes to a token, which each of its
train runs records, is taken back: its mark is removed, the next update
needs its gradient again, and the chief enqueues one token for the one its
run took from a release cut to the others. Its hook's start (a fresh
negative value) takes it back only where that cannot strand it
(``GoneWatch._back_at_start``). Only the chief writes or removes marks, so
its copy of the table stays right.
"""

import logging
import numbers
import os
import threading
import time

import tensorflow as tf

from sync_replicas import _compat
from sync_replicas import _diagnose
from sync_replicas import _lost
from sync_replicas import _restart
from sync_replicas import _task_names

_LOG = logging.getLogger(__name__)

#: The environment variable the constructor's None reads.
ENV = "SYNC_REPLICAS_WORKER_GONE_SECS"
#: A gone worker's value in the done record (a done worker's is its batch
#: count, or -1 when unknown).
GONE = -(1 << 62)
#: Bound on each run of the watch and the marks.
RUN_TIMEOUT_MS = 10_000
#: Longest pause between two looks of the chief's watch, in seconds.
WATCH_MAX_SECS = 1.0


def secs_from(worker_gone_secs, *, data_end, environ=None):
  """``worker_gone_secs`` as a float, or None (off); None reads ``ENV``.

  Raises:
    ValueError: Not a positive number of seconds (nor None), the
      environment variable is not one, or ``data_end`` is not
      ``"train_all"``.
  """
  source = "worker_gone_secs"
  value = worker_gone_secs
  if value is None:
    text = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not text:
      return None
    source = ENV
    try:
      value = float(text)
    except ValueError:
      value = text
  if (isinstance(value, bool) or not isinstance(value, numbers.Real)
      or not value > 0 or value != value or value == float("inf")):
    raise ValueError(
        "%s must be a number of seconds > 0, got %r. Pass how long an "
        "update may wait for a worker whose task does not answer before "
        "the job goes on without it, or None (the default) to wait for it "
        "as stock does." % (source, value))
  if data_end != "train_all":
    raise ValueError(
        "%s=%s needs data_end=\"train_all\" (the default), got data_end=%r: "
        "a gone worker's share of each update is handled as a done "
        "worker's, which only \"train_all\" builds. Drop data_end, or drop "
        "%s." % (source, value, data_end, source))
  return float(value)


def gone_keys(keys, values):
  """The keys of the done record's export whose value marks them gone."""
  return sorted(int(k) for k, v in zip(keys, values, strict=True)
                if int(v) == GONE)


def clause(gone, *, total_num_replicas, devices=None):
  """The stall line's and the status tool's words on the gone workers
  (``devices``: ``{key: task device}``, which names them)."""
  if not gone:
    return ""
  return "%d of %d workers gone (worker_gone_secs): %s" % (
      len(gone), total_num_replicas, _task_names.listed(gone, devices))


def end_clause(gone, *, total_num_replicas, devices=None):
  """The chief's last line's words on the workers gone when a data-end job
  ends: counted with the done ones, but their input did not end."""
  return ("%d of %d workers gone, not done (%s): what was left of their "
          "input was never trained" % (
              len(gone), total_num_replicas,
              _task_names.listed(gone, devices)))


def read_back_line(gone, *, out, total_num_replicas, need, steps,
                   addresses, devices=None):
  """The line of a chief that found ``gone`` (keys) marked gone in the
  record without having declared them: a chief process that restarted.

  Args:
    gone: The keys read back.
    out: The workers in the record (done or gone).
    total_num_replicas: Workers in the job.
    need: Gradients each update needs now (``DataEnd.need``).
    steps: ``{key: value}`` of the local-step record: the token of each
      worker's last train run (a negative value: a session's start).
    addresses: ``{key: "host:port"}`` recorded on the ps.
    devices: ``{key: task device}``, which names them.
  """
  named = []
  for key in sorted(gone):
    step = steps.get(key)
    if step is None:
      since = "no train run of it recorded"
    elif step < 0:
      since = "since its session's start, before any train run"
    else:
      # The token carries the restart generation (int64 steps); the line
      # says the plain step, as the stall line does.
      since = "since its last train run, for step %d" % (
          _restart.decode(step, True)[1])
    named.append("%s (%s)" % (_lost.named(
        key, (devices or {}).get(key), addresses.get(key)), since))
  return (
      "sync_replicas: the chief read back %d gone mark(s) from the record "
      "on the ps, made before this chief process started "
      "(worker_gone_secs): %s; updates need %d gradients (%d of %d workers "
      "live); each is taken back when its task starts again" % (
          len(named), "; ".join(named), need, total_num_replicas - out,
          total_num_replicas))


class Marks:
  """The gone marks' ops on the done record ``table`` of ``ends`` (a
  ``_data_end.DataEnd``), built in its scope and on its device; only the
  chief runs them. ``count``: the workers gone, for the statistics."""

  def __init__(self, ends, table):
    self._ends = ends
    self._keys = tf.compat.v1.placeholder(tf.int64, [None], name="gone_keys")
    self._mark = tf.raw_ops.LookupTableInsertV2(
        table_handle=table, keys=self._keys,
        values=tf.fill(tf.shape(self._keys), tf.constant(GONE, tf.int64)),
        name="declare_gone")
    self._remove = tf.raw_ops.LookupTableRemoveV2(
        table_handle=table, keys=self._keys, name="take_back")
    self.count = tf.reduce_sum(
        tf.cast(tf.equal(ends.done_keys[1], GONE), tf.int32),
        name="gone_count")

  def read(self, session, global_step):
    """The global step, the record (``{key: batches or GONE}``) and every
    worker's local-step record (``{key: step}``), in one bounded run."""
    step, (keys, values), steps = session.run(
        [global_step, self._ends.done_keys, self._ends.local_steps.export],
        options=tf.compat.v1.RunOptions(timeout_in_ms=RUN_TIMEOUT_MS))
    return (int(step),
            {int(k): int(v) for k, v in zip(keys, values, strict=True)},
            {int(k): int(v) for k, v in zip(*steps, strict=True)})

  def read_back(self, session, gone, *, out):
    """Logs ``read_back_line`` for ``gone`` (keys), marks that this chief
    process read from the record without having made them (``DataEnd.restore``),
    with each worker's last local step and address read in bounded runs;
    nothing without any. ``out``: the workers in the record.

    The mark itself needs no read-back: it lives in the record on the ps,
    whose count every update's need is read from. The line says what a
    restarted chief goes on with, where its previous process's declaration
    went with that process's log.
    """
    if not gone:
      return
    ends = self._ends
    try:
      keys, values = session.run(
          ends.local_steps.export,
          options=tf.compat.v1.RunOptions(timeout_in_ms=RUN_TIMEOUT_MS))
      steps = {int(k): int(v) for k, v in zip(keys, values, strict=True)}
    except tf.errors.OpError as e:
      _LOG.debug("reading the gone workers' local steps failed: %s", e)
      steps = {}
    _LOG.info("%s", read_back_line(
        gone, out=out, total_num_replicas=ends.total_num_replicas,
        need=ends.need(out), steps=steps,
        addresses=ends.local_steps.read_addresses(session),
        devices=ends.devices))

  def declare(self, session, key):
    """Marks worker ``key`` gone; the chief's copy keeps the mark, which a
    restart of the record's ps task then does not lose."""
    session.run(self._mark, feed_dict={self._keys: [key]},
                options=tf.compat.v1.RunOptions(timeout_in_ms=RUN_TIMEOUT_MS))
    self._ends.note(key, GONE)

  def take_back(self, session, key):
    """Removes worker ``key``'s mark: updates need its gradient again."""
    self._ends.note(key)
    session.run(self._remove, feed_dict={self._keys: [key]},
                options=tf.compat.v1.RunOptions(timeout_in_ms=RUN_TIMEOUT_MS))


class Watches:
  """Makes the chief's watch thread for each session of its sync loop
  (``SyncQueueRunner.create_threads``); see ``make_watches``."""

  def __init__(self, secs, *, ends, global_step, local_step, token):
    self._secs, self._ends, self._global_step = secs, ends, global_step
    self._token = token
    self._reader = _diagnose.LocalStepReader(
        _diagnose.local_step_spec(local_step))

  def threads(self, sess, coord):
    """The watch of ``sess`` (not started); none in process, where no task
    can be probed and none is lost."""
    if not sess.sess_str:
      return []
    watch = GoneWatch(self._secs, ends=self._ends,
                      global_step=self._global_step, reader=self._reader,
                      token=self._token)
    return [threading.Thread(target=watch.run, args=(sess, coord),
                             name="SyncQueueRunnerGone")]


def make_watches(secs, *, ends, global_step, local_step, token=None):
  """The runner's ``gone``: a ``Watches``, or None without
  ``worker_gone_secs`` (``secs`` None) or a data-end record (``ends``).
  ``token``: the op that enqueues one token for a worker taken back at a
  push (None: it needs none)."""
  if not secs or ends is None:
    return None
  return Watches(secs, ends=ends, global_step=global_step,
                 local_step=local_step, token=token)


class GoneWatch:
  """The chief's watch: declares workers gone and takes them back.

  One per session of the chief's sync loop (``SyncQueueRunner``), on the
  chief's own session, only against a remote master.

  Args:
    secs: ``worker_gone_secs``.
    ends: The ``_data_end.DataEnd`` whose record holds the marks.
    global_step: The global step variable.
    reader: The runner's ``_diagnose.LocalStepReader`` (each task's local
      step, for the probe).
    token: The op that enqueues one token, or None (``make_watches``).
    clock: ``time.monotonic`` (for tests).
  """

  def __init__(self, secs, *, ends, global_step, reader, token=None,
               clock=time.monotonic):
    self.secs, self._token = secs, token
    self._ends, self._global_step = ends, global_step
    self._reader, self._clock = reader, clock
    # key -> its local-step record when declared (None: it had none).
    self._declared = {}
    # key -> (its local-step record, when that was first seen).
    self._seen_step = {}
    # key -> the hook-start record of a gone worker not yet taken back
    # (``_back_at_start``), so that its line is logged once.
    self._started = {}

  def run(self, sess, coord):
    """Looks every ``min(secs / 4, WATCH_MAX_SECS)`` until ``coord`` stops."""
    period = min(self.secs / 4.0, WATCH_MAX_SECS)
    last_step, since = None, self._clock()
    while not coord.wait_for_stop(period):
      try:
        step, record, steps = self._ends.gone_marks.read(
            sess, self._global_step)
      except Exception as e:  # pylint: disable=broad-except
        # A ps restarting: the chief's session recovers, and the watch of
        # the new session takes over (this one ends with its coordinator).
        _LOG.debug("the chief's watch for gone workers could not read: %s", e)
        continue
      now = self._clock()
      for key, value in steps.items():
        if self._seen_step.get(key, (None,))[0] != value:
          self._seen_step[key] = (value, now)
      out = set(record) - self._take_back(sess, record, steps)
      if step != last_step:
        last_step, since = step, now
      # With backups or an aggregation deadline the updates go on without a
      # lost worker, and the tokens released for it go to the others (one
      # of them pushes twice for an update): a worker whose record has not
      # moved for ``secs`` while they did is looked at too.
      quiet = {key for key, (_, seen) in self._seen_step.items()
               if now - seen >= self.secs} - out
      if now - since >= self.secs:
        self._declare(sess, coord, step=int(step), stalled=now - since,
                      out=out, steps=steps, now=now)
      elif quiet:
        self._declare(sess, coord, step=int(step), stalled=None, out=out,
                      steps=steps, now=now, only=quiet)

  def _take_back(self, sess, record, steps):
    """Takes back each gone worker whose local-step record changed since it
    was declared; returns their keys. ``record``: the done record."""
    gone = set(gone_keys(record, record.values()))
    for key in sorted(gone):
      # Marks this process did not make (a chief that restarted): the
      # record as it is now is what a return must change.
      self._declared.setdefault(key, steps.get(key))
    taken = set()
    for key in sorted(self._declared):
      if key not in gone:
        del self._declared[key]
        self._started.pop(key, None)
        continue
      now_step = steps.get(key)
      if now_step is None or now_step == self._declared[key]:
        continue
      if now_step < 0 and not self._back_at_start(key, record, now_step):
        continue
      self._ends.gone_marks.take_back(sess, key)
      if now_step >= 0 and self._token is not None:
        # Its push took a token of a release cut to the others: one of
        # them would wait for good for an update that needs it too.
        sess.run(self._token, options=tf.compat.v1.RunOptions(
            timeout_in_ms=RUN_TIMEOUT_MS))
      del self._declared[key]
      self._started.pop(key, None)
      taken.add(key)
      how = ("its hook started again" if now_step < 0 else
             "it pushed again (local step %d)" % now_step)
      _LOG.info(
          "sync_replicas: %s is back (%s): taken back; updates "
          "need %d gradients again from the next update", self._name(key),
          how, self._ends.need(len(record) - len(taken)))
    return taken

  def _name(self, key):
    """Worker ``key``'s task name (``_task_names``)."""
    return _task_names.of_key(key, self._ends.devices)

  def _back_at_start(self, key, record, now_step):
    """Whether worker ``key``, whose hook started again (``now_step``, a
    fresh negative value), is taken back now, without a token.

    Its first push needs no token, but the chief cannot tell whether that
    push already happened: if an update that needed only the others took
    it (or it landed stale after one), and the release cut to the others
    left this worker waiting for a token, taking it back now would make
    the next update wait for its gradient while it waits for a token, for
    good. So with the shared token queue it is taken back at the push its
    first token follows (given back there), unless no other worker trains:
    then no release would ever reach it. A worker's own token queue gets
    every release, gone or not: nothing to wait for there.
    """
    others = set(record) - {key}
    if (self._token is None
        or len(others) >= self._ends.total_num_replicas - 1):
      return True
    if self._started.get(key) != now_step:
      self._started[key] = now_step
      _LOG.info(
          "sync_replicas: %s's hook started again: it is taken "
          "back once a train run of it gets a token (updates need %d "
          "gradients until then)", self._name(key),
          self._ends.need(len(record)))
    return False

  def _declare(self, sess, coord, *, step, stalled, out, steps, now,
               only=None):
    """Declares gone every worker not in ``out`` (done or gone), of
    ``only`` if given, that cannot push. ``stalled``: how long the global
    step has not moved, or None (it moved; ``only`` have not pushed)."""
    total = self._ends.total_num_replicas
    config = _compat.session_config(sess)
    addresses = self._ends.local_steps.read_addresses(sess)
    # Never the chief's own key (``_lost.stall_clause`` says why): a probe
    # of itself that misses its bound would declare the chief gone.
    keys = (set(range(total)) & set(addresses)) - out - {self._ends.key}
    devices = _lost.key_devices(self._reader.spec.device, total)
    lost = _lost.lacking(
        # Only a worker that started once (its hook recorded its address)
        # can be lost: one still starting up is not.
        keys=keys if only is None else keys & only,
        addresses=addresses, devices=devices,
        # Each task through its own server, every call bounded: through
        # the chief's master a read of a stopped task outlives its bound
        # (``_diagnose.LocalStepReader``), and can end the process at exit.
        read_steps=lambda wanted: self._reader.read(
            sess.sess_str, wanted, config=config,
            addresses=_lost.by_device(addresses, devices)),
        # A task that accepts connections but misses the read's bound (a
        # live one starved of CPU can) is declared only if a second look
        # finds it silent too.
        wait=coord.wait_for_stop)
    for key, device, address, reason in lost:
      if coord.should_stop():
        return
      self._ends.gone_marks.declare(sess, key)
      self._declared[key] = steps.get(key)
      out.add(key)
      seen = self._seen_step.get(key)
      quiet = (stalled or 0.0) if seen is None else now - seen[1]
      waits = ("the update to step %d waits for it" % (step + 1)
               if stalled is not None else
               "updates went on without it to step %d" % step)
      _LOG.warning(
          "sync_replicas: %s is gone (worker_gone_secs=%g):"
          " no push for %.0f s, %s, and %s; "
          "updates now need %d gradients (%d of %d workers live); it is "
          "taken back when its task starts again",
          _lost.named(key, device, address), self.secs, quiet, waits,
          reason, self._ends.need(len(out)), total - len(out), total)
