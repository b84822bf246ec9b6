"""Ending with the data: what happens when a worker's input runs out.

Owns the ``data_end`` policies, the record of which workers are done (a hash
table on the global step's device, in our own name scope, never
checkpointed: it lives as long as that ps task, and the chief process keeps
a copy that puts it back when the task restarted), a worker's key in it, how
many gradients an update needs once some workers are done, how many tokens
the chief releases then, and the announcement a worker makes when its input
ends (with the chief's wait for the others that follows it). Beside the
record, on the same device, every worker's local step (``_step_record``),
which the chief's stall line lists with the workers done.

Stock knows nothing of a worker's end: a worker whose one-pass input raises
``OutOfRangeError`` leaves, and every later update still waits for
``replicas_to_aggregate`` gradients, which the others cannot give (they
hang), or the chief leaves and closes the token queue (the others stop with
their data half read). The policies:

* ``"train_all"`` (default): a worker whose input ended says so; from then on
  an update needs ``min(replicas_to_aggregate, tokens_per_step - done)``
  gradients and the chief releases ``tokens_per_step - done`` tokens after
  it, so the workers left push exactly what the next update takes. A chief
  whose own input ended keeps running updates until every worker is done;
  then the job ends as a prompt stop does.
* ``"stop_together"``: the first worker whose input ends stops every worker
  at once; they all end at the same global step, and the gradients pushed
  for the update that never comes are dropped (logged).
* ``"stock"``: nothing of the above is built; stock's behaviour.

A worker's end is seen without any change to the script where hooks run
(``MonitoredSession``, ``MonitoredTrainingSession``, an Estimator): those end
normally when a run raises ``OutOfRangeError`` or ``StopIteration`` and then
call every hook's ``end()``; a run that raised gets no ``after_run``, which
tells this end from a step limit's (whose last run returned). A Supervisor
loop runs no hooks: its script calls ``announce_data_end(sess)`` once.
"""

import json
import logging
import os
import random
import re
import threading
import time
import typing

import tensorflow as tf

from sync_replicas import _abort
from sync_replicas import _announce
from sync_replicas import _compat
from sync_replicas import _diagnose
from sync_replicas import _gone
from sync_replicas import _lost
from sync_replicas import _step_record
from sync_replicas import _task_names

_LOG = logging.getLogger(__name__)

TRAIN_ALL = "train_all"
STOP_TOGETHER = "stop_together"
STOCK = "stock"
#: Every ``data_end`` value, the default first.
POLICIES = (TRAIN_ALL, STOP_TOGETHER, STOCK)

#: Bound on each read or write of the done record from a hook or a script.
RUN_TIMEOUT_MS = 10_000
#: How often the chief, its own input ended, looks whether the others are.
WAIT_POLL_SECS = 0.2
#: How long the chief's wait goes on without any progress (no update and no
#: worker newly done) before it gives up and ends the job, when
#: ``stall_timeout_secs`` does not say otherwise. A worker that crashed is
#: not done: the wait lets it recover.
NO_PROGRESS_SECS = 600.0

_TASK = re.compile(r"/job:(?P<job>[^/]+)/(?:replica:\d+/)?task:(?P<task>\d+)")


def check(policy, *, prompt_stop):
  """Raises unless ``policy`` is a ``data_end`` this optimizer can honour."""
  if policy not in POLICIES:
    raise ValueError(
        "data_end must be one of %s, got %r. \"train_all\" trains every "
        "batch of every worker and ends when the last one is done; "
        "\"stop_together\" stops every worker when the first one's input "
        "ends; \"stock\" keeps stock's behaviour." % (
            ", ".join(repr(p) for p in POLICIES), policy))
  if policy != STOCK and not prompt_stop:
    raise ValueError(
        "data_end=%r needs prompt_stop=True: with prompt_stop=False the "
        "chief runs stock's QueueRunner, whose take waits for "
        "replicas_to_aggregate gradients even after a worker is done. Pass "
        "prompt_stop=True, or data_end=\"stock\" (stock's behaviour; one of "
        "%s)." % (policy, ", ".join(repr(p) for p in POLICIES)))


def worker_key(device, *, environ=None):
  """This worker's key in the done record, and how it was found.

  The task of the device the worker-local step was placed on (a
  ``replica_device_setter``'s ``worker_device``): task ``i`` of job
  ``worker`` is ``i``, or ``i + 1`` when TF_CONFIG names a ``chief`` job (an
  Estimator's layout, whose chief is 0). Else TF_CONFIG's own task. Else a
  random key: such a worker still counts once, but a restart of it would
  count again.

  Returns:
    ``(key, who)``: an int, and the task's name for the log lines
    (``_task_names``: ``chief0``, ``worker1``).
  """
  environ = os.environ if environ is None else environ
  has_chief, task = False, None
  try:
    config = json.loads(environ.get("TF_CONFIG") or "{}")
    has_chief = bool(config.get("cluster", {}).get("chief"))
    task = config.get("task")
  except (ValueError, AttributeError):
    pass
  found = _TASK.search(device or "")
  if found:
    job, index = found.group("job"), int(found.group("task"))
  elif isinstance(task, dict) and "index" in task:
    job, index = task.get("type"), int(task["index"])
  else:
    key = random.getrandbits(62) + (1 << 32)
    return key, "a worker with no task device (key %d)" % key
  who = _task_names.name(job, index)
  if job == "chief":
    return 0, who
  if has_chief:
    return index + 1, who
  return index, who


class NoDataEnd:
  """``data_end="stock"``: nothing built, stock's behaviour everywhere."""

  policy = STOCK
  enabled = False
  #: No record on the ps: nothing for a status reader.
  shared_name = None

  def build(self, *, device, scope, token_queue, local_step):
    del device, scope, token_queue, local_step

  def encoding(self, generations, *, scope, initial=False):
    del scope, initial
    return generations.encode


class _Seen:
  """The chief's memory of the done record: ``{key: batches}`` of every
  worker this process saw done. The record lives on one ps task; a restart
  of that task empties it, and the workers that were done have exited and
  cannot say it again, so the chief puts them back (``DataEnd.restore``)."""

  def __init__(self):
    self._batches = {}
    self._lock = threading.Lock()

  def keep(self, keys, batches):
    with self._lock:
      for key, value in zip(keys, batches, strict=True):
        self._batches[int(key)] = int(value)

  def learn(self, keys, batches, *, own, devices):
    """``keep`` for what a read of the record holds, with one line naming
    the workers done it newly tells this process of (the chief's): neither
    a gone mark, which the chief makes or reads back with lines of its own,
    nor the chief's own end (key ``own``), which its own line says."""
    skip = set(_gone.gone_keys(keys, batches)) | {own}
    with self._lock:
      new = sorted({int(k) for k in keys} - set(self._batches) - skip)
    self.keep(keys, batches)
    if new:
      _LOG.info("sync_replicas: the chief learnt from the record on the ps "
                "that %s %s done", _task_names.listed(new, devices),
                "is" if len(new) == 1 else "are")

  def copy(self):
    with self._lock:
      return dict(self._batches)

  def note(self, key, value=None):
    """Keeps ``key`` with ``value``, or forgets it (None)."""
    with self._lock:
      if value is None:
        self._batches.pop(int(key), None)
      else:
        self._batches[int(key)] = int(value)


class DataEnd:
  """``"train_all"`` or ``"stop_together"``: the done record and its reads.

  Made with the optimizer; ``build`` makes its ops (in our scope, on the
  global step's device) and must come before everything else.

  Args:
    policy: ``TRAIN_ALL`` or ``STOP_TOGETHER``.
    replicas_to_aggregate: Gradients a full update averages.
    total_num_replicas: Workers in the job.
    tokens_per_step: Tokens a full update releases.
    shared_prefix: What the optimizer's shared names start with.
    shared_tokens: Every worker takes from ``sync_token_q`` (not
      ``one_gradient_per_worker``'s queues): only then are tokens cut.
  """

  enabled = True

  def __init__(self, policy, *, replicas_to_aggregate, total_num_replicas,
               tokens_per_step, shared_prefix, shared_tokens=True):
    self.policy = policy
    self.shared_tokens = shared_tokens
    self.replicas_to_aggregate = replicas_to_aggregate
    self.total_num_replicas = total_num_replicas
    self.tokens_per_step = tokens_per_step
    self.shared_name = shared_prefix + "sync_replicas_done"
    self.key = self.who = None
    #: ``{key: task device}`` of every worker, which the chief's lines
    #: name (``_lost.key_devices``).
    self.devices = {}
    self.done_count = self.done_keys = self.is_closed = None
    self._restore_keys = self._restore_batches = self._restore = None
    self._announcement = None
    self.gone_marks = None
    #: Every worker's local step on the ps, for the chief's stall line.
    self.local_steps = _step_record.LocalStepRecord(
        shared_prefix=shared_prefix, total_num_replicas=total_num_replicas)
    #: Why the chief stopped a job that failed, for the workers (``_abort``).
    self.abort = _abort.AbortMark(shared_prefix=shared_prefix)
    self._seen = _Seen()  # The chief's memory of the record.

  def build(self, *, device, scope, token_queue, local_step):
    """The done record and the ops that read and write it."""
    self.key, self.who = worker_key(local_step.device)
    self.devices = _lost.key_devices(local_step.device,
                                     self.total_num_replicas)
    self.local_steps.build(device=device, scope=scope, key=self.key,
                           worker_device=local_step.device)
    self.abort.build(device=device, scope=scope)
    with tf.compat.v1.device(device), tf.compat.v1.name_scope(scope):
      # A table, not a variable: no Saver, readiness check or checkpoint
      # sees it, and it lives as long as the ps task, across chief restarts;
      # across a restart of the ps task, the chief puts it back (restore).
      table = tf.raw_ops.MutableHashTableV2(
          shared_name=self.shared_name, use_node_name_sharing=False,
          key_dtype=tf.int64, value_dtype=tf.int64, name="done_workers")
      self.done_count = tf.cast(
          tf.raw_ops.LookupTableSizeV2(table_handle=table), tf.int32,
          name="done_count")
      self.done_keys = tf.raw_ops.LookupTableExportV2(
          table_handle=table, Tkeys=tf.int64, Tvalues=tf.int64,
          name="done_export")
      key = tf.compat.v1.placeholder(tf.int64, [], name="done_key")
      batches = tf.compat.v1.placeholder(tf.int64, [], name="done_batches")
      insert = tf.raw_ops.LookupTableInsertV2(
          table_handle=table, keys=tf.reshape(key, [1]),
          values=tf.reshape(batches, [1]), name="announce_done")
      self._restore_keys = tf.compat.v1.placeholder(
          tf.int64, [None], name="restore_keys")
      self._restore_batches = tf.compat.v1.placeholder(
          tf.int64, [None], name="restore_batches")
      self._restore = tf.raw_ops.LookupTableInsertV2(
          table_handle=table, keys=self._restore_keys,
          values=self._restore_batches, name="restore_done")
      # worker_gone_secs' marks live in the same table.
      self.gone_marks = _gone.Marks(self, table)
      # Whether the job already ended (the chief closed the token queue):
      # a worker's run then raises OutOfRange too, and its input may not be
      # over at all.
      self.is_closed = token_queue.is_closed(name="token_queue_closed")
    with tf.compat.v1.device(local_step.device), tf.compat.v1.name_scope(
        scope):
      # Nothing on the ps: a new session's first run (``_announce``).
      start = tf.no_op(name="data_end_session_start")
    self._announcement = _announce.Announcement(
        key=key, batches=batches, insert=insert, is_closed=self.is_closed,
        done_count=self.done_count, session_start=start,
        timeout_ms=RUN_TIMEOUT_MS, who=self.who,
        where=self.done_count.device or "the global step's device")

  def need(self, done):
    """Gradients the next update needs with ``done`` workers done."""
    return max(0, min(self.replicas_to_aggregate,
                      self.tokens_per_step - done))

  def encoding(self, generations, *, scope, initial=False):
    """What the chief applies to the tokens it enqueues: the cut to the
    rights to push the workers lack (``initial_steps`` for the initial
    fill, else ``release_steps``), then the generation's offset.

    Only with stock's shared queue, and only where the tokens already pass
    through our scope (int64 steps): int32 steps enqueue stock's fill
    itself and keep its count. ``scope`` is our name scope.
    """
    if not self.shared_tokens or not generations.enabled:
      return generations.encode

    def encode(steps):
      with tf.compat.v1.name_scope(scope):
        steps = (self.initial_steps(steps, starts=generations.starts)
                 if initial else self.release_steps(steps))
      return generations.encode(steps)
    return encode

  def release_steps(self, steps):
    """``steps`` (the tokens an update releases) cut to the workers left.

    Each done worker took a token it never uses; without the cut the
    others would have one spare token each per update, push twice at that
    step, and the second push would be dropped as stale if it lands after
    the update.
    """
    with tf.compat.v1.name_scope("release_count"):
      left = tf.maximum(self.tokens_per_step - self.done_count, 0)
      return tf.slice(steps, [0], tf.reshape(left, [1]))

  def initial_steps(self, steps, *, starts):
    """``steps`` (the chief's initial tokens) cut on the job's first start,
    and on a later one with workers done or gone.

    Every worker's first push needs no token (its local step starts at the
    global step), so each worker brings its own right to push. Stock's
    ``replicas_to_aggregate`` initial tokens come on top: a fast worker
    uses them to push twice at the first step, and from then on the job
    has more rights to push than an update takes, so some pushes land
    after their update and are dropped (README, "Why synchronous
    replicas"). On the job's first start (the first chief start the ps
    has seen, ``starts`` at most 1, at global step 0) only what the
    workers cannot bring is enqueued: ``replicas_to_aggregate -
    total_num_replicas`` in multi-batch mode, else none. Any other start
    enqueues stock's count: a restarted chief, whose workers that pushed
    before the restart wait for tokens; and a start at a global step
    other than 0 (a ps restarted under a living chief, a resumed job),
    whose ``chief_init_op`` clears the accumulators and so eats a first
    push that came before it: that worker then waits for a token (the
    hang tests/test_recovery.py's killed ps found).

    Such a start with workers done or gone (``worker_gone_secs``) in the
    record enqueues only what the live workers lack, at most stock's
    count: a token for each live worker but the chief, whose first push
    needs none (``tokens_per_step - done - 1``; without the ``- 1`` when
    the chief's own input ended), as the release after each update gives
    one per live worker. Stock's count there holds the done and gone
    workers' tokens and one more, and each spare token lets a survivor
    push twice for an update: often for the restarted chief's first,
    which then goes without the chief's own push (slow to come from a new
    process). With none done or gone the count stays stock's, one spare
    token included. The survivors of a restart wait in their dequeue and
    take these tokens first; one that does not yet (a worker that had not
    pushed since) may find its token taken by the chief's first run,
    which then pushes twice for the first update: the next release,
    after the update that second push completes, gives it one.
    """
    with tf.compat.v1.name_scope("initial_count"):
      first = max(0, self.replicas_to_aggregate - self.total_num_replicas)
      # ``steps`` are copies of the global step (before the generation's
      # offset); the fill has at least one.
      pristine = tf.logical_and(starts <= 1,
                                tf.equal(tf.reduce_max(steps), 0))
      # Any other start: one token per live worker but the chief (see
      # above), stock's count when none is done or gone. A chief whose own
      # input ended pushes no more: then every live worker lacks one.
      chief_pushes = tf.cast(tf.logical_not(tf.reduce_any(
          tf.equal(self.done_keys[0], self.key))), tf.int32)
      lacking = tf.maximum(
          self.tokens_per_step - self.done_count - chief_pushes, 0)
      later = tf.where(tf.equal(self.done_count, 0), tf.size(steps),
                       tf.minimum(tf.size(steps), lacking))
      keep = tf.where(pristine, tf.minimum(tf.size(steps), first), later)
      return tf.slice(steps, [0], tf.reshape(keep, [1]))

  def all_done(self, done):
    return done >= self.total_num_replicas

  def announce(self, session, *, batches):
    """Records this worker as done; returns the workers done, or None if the
    job already ended (the token queue is closed) or the record could not
    be written: tried again while the record's ps task does not answer, for
    at most the session's ``operation_timeout_in_ms`` (``_announce``)."""
    # -1: a caller that did not count them (announce_data_end's
    # batches=None).
    value = -1 if batches is None else batches
    done = self._announcement.record(session, self.key, value,
                                     bound=_record_bound)
    if done is None:
      return None
    # The chief's own end: no poll of its loop may see it before a restart
    # of the record's ps task.
    self._seen.keep([self.key], [value])
    return done

  def seen_done(self):
    """``{key: batches}`` of every worker this process saw done: its own
    announcement and what ``remember`` read."""
    return self._seen.copy()

  def remember(self, session, *, done):
    """Keeps every key of the record, read now, if ``done`` (the count the
    caller just read) says it holds one this process has not seen.

    The chief's loop calls it on each poll: one read of the record per
    worker that becomes done, none otherwise.
    """
    if done <= len(self._seen.copy()):
      return
    keys, batches = session.run(
        self.done_keys,
        options=tf.compat.v1.RunOptions(timeout_in_ms=RUN_TIMEOUT_MS))
    self._seen.learn(keys, batches, own=self.key, devices=self.devices)

  def note(self, key, value=None):
    """The chief's copy of the record: keeps ``key`` with ``value``, or
    forgets it (None: a gone worker taken back, ``_gone``)."""
    self._seen.note(key, value)

  def restore(self, session):
    """Puts back on the ps every worker this process saw done; returns the
    keys put back.

    The chief's hook calls it on every session it creates, before the
    initial tokens and the sync loop: a ps task that restarted lost the
    record, and the loop would wait for gradients of workers that have
    exited. It first keeps what the record holds (a chief that restarted
    learns it here, and logs the gone marks it finds: ``_gone.Marks.
    read_back``), then inserts every remembered key the record lacks
    (inserting a key again only rewrites its batches). One read (two more
    for the line when it finds gone marks), and one write only when
    something was lost.

    Raises:
      tf.errors.UnavailableError, tf.errors.AbortedError: The ps is not
        reachable: MonitoredSession creates the session again, and this
        runs again.
    """
    options = tf.compat.v1.RunOptions(timeout_in_ms=RUN_TIMEOUT_MS)
    try:
      keys, batches = session.run(self.done_keys, options=options)
      before = self.seen_done()
      self._seen.learn(keys, batches, own=self.key, devices=self.devices)
      # Gone marks this process neither made nor saw: a chief that
      # restarted reads them back here, and says so (``_gone``).
      self.gone_marks.read_back(session, [
          k for k in _gone.gone_keys(keys, batches)
          if before.get(k) != _gone.GONE], out=len(keys))
      seen = self.seen_done()
      lost = sorted(set(seen) - {int(k) for k in keys})
      if not lost:
        return []
      session.run(self._restore, options=options, feed_dict={
          self._restore_keys: lost,
          self._restore_batches: [seen[k] for k in lost]})
    except (tf.errors.UnavailableError, tf.errors.AbortedError):
      raise
    except tf.errors.OpError as e:
      _LOG.warning("sync_replicas: the chief could not check the record of "
                   "the workers done on the ps (%s): if that ps task "
                   "restarted, updates may wait for workers that are done",
                   e)
      return []
    _LOG.info("sync_replicas: the record of the workers done on the ps held "
              "%d of the %d the chief saw done (its ps task restarted?): "
              "put back %s", len(keys), len(seen),
              _task_names.listed(lost, self.devices))
    return lost

  def gone_keys(self, session):
    """The keys of the record's workers that are gone (``worker_gone_secs``),
    not done; [] if it cannot be read."""
    try:
      keys, values = session.run(
          self.done_keys,
          options=tf.compat.v1.RunOptions(timeout_in_ms=RUN_TIMEOUT_MS))
    except tf.errors.OpError:
      return []
    return _gone.gone_keys(keys, values)


def _record_bound(session):
  """How long ``announce`` tries again, in seconds, and why: the session's
  ``operation_timeout_in_ms``, after which the other workers' runs waiting
  for this worker's gradient end anyway; ``NO_PROGRESS_SECS`` without
  one."""
  timeout_ms = _compat.operation_timeout_ms(session)
  if timeout_ms > 0:
    return timeout_ms / 1000.0, "the session's operation_timeout_in_ms"
  return NO_PROGRESS_SECS, ("the session has no operation_timeout_in_ms: "
                            "NO_PROGRESS_SECS")


def wait_for_the_others(ends, session, *, global_step, should_stop,
                        no_progress_secs, log_secs,
                        clock=time.monotonic, sleep=time.sleep):
  """The chief's wait, its own data ended, until every worker of ``ends``
  (a ``DataEnd``) is done.

  Its sync loop runs meanwhile (the coordinator has not stopped yet). Ends
  when every worker is done, when ``should_stop()`` (the loop failed), or
  after ``no_progress_secs`` with no update and no worker newly done.

  Returns:
    True if every worker is done.
  """
  options = tf.compat.v1.RunOptions(timeout_in_ms=RUN_TIMEOUT_MS)
  last, since = None, clock()
  logged = since
  while not should_stop():
    try:
      step, done = session.run([global_step, ends.done_count],
                               options=options)
    except tf.errors.OpError as e:
      _LOG.warning("sync_replicas: the chief stops waiting for the other "
                   "workers: %s", e)
      return False
    if ends.all_done(done):
      gone = ends.gone_keys(session)
      if gone:
        # Counted among the done, but none of them finished its input.
        _LOG.info("sync_replicas: every live worker is done at global "
                  "step %d: the job ends; %s", step, _gone.end_clause(
                      gone, total_num_replicas=ends.total_num_replicas,
                      devices=ends.devices))
      else:
        _LOG.info("sync_replicas: every worker is done at global step "
                  "%d: the job ends", step)
      return True
    now = clock()
    if (step, done) != last:
      last, since = (step, done), now
    elif now - since >= no_progress_secs:
      _LOG.warning(
          "sync_replicas: no update and no worker done for %.0f s while "
          "the chief waits for %d worker(s) to finish their data: the job "
          "ends now", now - since, ends.total_num_replicas - done)
      return False
    if log_secs and now - logged >= log_secs:
      logged = now
      _LOG.info("sync_replicas: the chief's data ended; it keeps running "
                "updates (global step %d) for the %d worker(s) not done",
                step, ends.total_num_replicas - done)
    sleep(WAIT_POLL_SECS)
  return False


def log_done(ends, *, batches, done, is_chief, gone=0):
  """The one line a worker logs when its data ends (``ends``: its
  ``DataEnd``). ``done`` counts the record's workers, ``gone`` of them
  gone (``worker_gone_secs``), not done."""
  total = ends.total_num_replicas
  if ends.policy == STOP_TOGETHER:
    nxt = ("data_end=\"stop_together\": every worker stops now, at the "
           "same global step; what the others pushed for the next update "
           "is dropped")
  elif done >= total:
    nxt = ("every live worker is done: the job ends" if gone else
           "every worker is done: the job ends")
  elif is_chief:
    nxt = ("the chief keeps running updates (each needs %d gradients) "
           "until the other %d worker(s) are done" % (
               ends.need(done), total - done))
  else:
    nxt = ("the other %d worker(s) train on; each update now needs %d "
           "gradients" % (total - done, ends.need(done)))
  _LOG.info("sync_replicas: %s: its data ended after %s train steps; %d of "
            "%d workers done%s; %s", ends.who,
            "?" if batches is None else batches, done - gone, total,
            ", %d gone" % gone if gone else "", nxt)


def read_done(sess, ends):
  """``(done, gone)``: the keys of the workers out of the updates (those
  whose input ended and those gone: ``worker_gone_secs``, as the updates
  count them) and, among them, the gone ones; ``(None, None)`` without a
  ``data_end`` policy (``ends`` None) or when the record cannot be read."""
  if ends is None:
    return None, None
  try:
    keys, values = sess.run(ends.done_keys)
  except Exception as e:  # pylint: disable=broad-except
    _LOG.debug("reading the workers done failed: %s", e)
    return None, None
  return sorted(int(k) for k in keys), _gone.gone_keys(keys, values)


def stall_part(done, ends, replicas_to_aggregate, *, gone=()):
  """The stall line's data-end part: ``(gradients the update needs, text)``,
  the text empty without a ``data_end`` policy (``ends`` None) or a record
  that could not be read (``done``, from ``read_done``, None). ``gone``:
  the keys among ``done`` that are gone, named apart as the status tool
  does (``out_clauses``)."""
  if done is None:
    return replicas_to_aggregate, ""
  return ends.need(len(done)), "; " + "; ".join(out_clauses(
      done, gone, total_num_replicas=ends.total_num_replicas,
      devices=ends.devices))


def out_clauses(done, gone, *, total_num_replicas, devices=None):
  """The words on the workers out of the updates: those done, then (if
  any) those gone; the chief's stall line joins them, the status tool
  prints each on a line of its own (``data end:``, ``lost:``). ``devices``:
  ``{key: task device}``, which names them."""
  gone = sorted(gone or ())
  clauses = [done_clause([k for k in done if k not in gone],
                         total_num_replicas=total_num_replicas,
                         devices=devices)]
  if gone:
    clauses.append(_gone.clause(gone, total_num_replicas=total_num_replicas,
                                devices=devices))
  return clauses


def log_stop_together(*, step, dropped):
  _LOG.info("sync_replicas: a worker's data ended (data_end="
            "\"stop_together\"): every worker stops at global step %d; "
            "%d gradient(s) per variable pushed for the next update are "
            "dropped", step, dropped)


def done_clause(keys, *, total_num_replicas, devices=None):
  """The stall line's part on the workers done (``keys`` from the record),
  named by task (``devices``: ``{key: task device}``,
  ``_lost.key_devices``).

  A worker that crashed is not done: it stays among those the update waits
  for.
  """
  if not keys:
    return "no worker is done (data_end)"
  return "%d of %d workers done, their input ended: %s" % (
      len(keys), total_num_replicas, _task_names.listed(keys, devices))


class AnnouncesDataEnd:
  """``SyncReplicasOptimizer``'s ``announce_data_end``, kept with the rest
  of the data end. Reads the optimizer's ``_data_end`` (a ``DataEnd`` or
  ``NoDataEnd``) and its public accessors."""

  def announce_data_end(
      self, sess: "tf.compat.v1.Session", *, is_chief: "bool | None" = None,
      batches: "int | None" = None,
      should_stop: "typing.Callable[[], bool] | None" = None) -> None:
    """Not in stock: tells the job that this worker's input has ended.

    The session hook calls it by itself when a run of a MonitoredSession
    (or an Estimator) ends on OutOfRangeError or StopIteration. A
    Supervisor loop runs no hooks: call it once when the input ends (a
    closed input queue raising OutOfRangeError), before ``sv.stop()``::

      try:
        while not sv.should_stop():
          sess.run(train_op)
      except tf.errors.OutOfRangeError:
        opt.announce_data_end(sess)  # sync_replicas: this worker is done

    With ``data_end="train_all"`` the updates then need one gradient less
    (down to ``replicas_to_aggregate`` with backups), and on the chief it
    returns only once every worker is done (or nothing moved for
    ``stall_timeout_secs``, 600 s without it; logged), its sync loop
    running meanwhile. With ``"stop_together"`` every worker stops at once.
    With ``"stock"`` it does nothing. Logs one line either way.

    Args:
      sess: A session on this worker's target (the Supervisor's, a
        MonitoredSession's raw one).
      is_chief: Whether this is the chief; None: whether this process runs
        the optimizer's sync loop.
      batches: This worker's train steps, for the log line; None: unknown.
      should_stop: A callable; the chief's wait ends when it returns True.

    Raises:
      NotBuiltError: Before ``apply_gradients``.
    """
    # The SyncReplicasOptimizer this class is mixed into (its accessors).
    opt: typing.Any = self
    global_step = opt.global_step  # NotBuiltError before the build.
    ends = opt._data_end  # pylint: disable=protected-access
    if not ends.enabled:
      return
    done = ends.announce(sess, batches=batches)
    if done is None:
      return
    if is_chief is None:
      is_chief = opt.get_chief_queue_runner().serving
    # A gone worker is in the record too, but its input did not end.
    gone = len(ends.gone_keys(sess)) if done > 1 else 0
    log_done(ends, batches=batches, done=done, is_chief=is_chief, gone=gone)
    if (not is_chief or ends.policy != TRAIN_ALL
        or ends.all_done(done)):
      return
    o = opt.options
    wait_for_the_others(
        ends, sess, global_step=global_step,
        should_stop=should_stop or (lambda: False),
        no_progress_secs=o.stall_timeout_secs or NO_PROGRESS_SECS,
        log_secs=o.stall_log_secs)

  def record_task_address(self, sess: "tf.compat.v1.Session") -> None:
    """Not in stock: records this worker's task address on the ps.

    With a ``data_end`` policy, the chief's stall line names a worker whose
    gradient an update lacks by its address and probes its task; the hook
    calls this at each session's start. Nothing with ``data_end="stock"``.

    Raises:
      NotBuiltError: Before ``apply_gradients``.
    """
    ends = self._built_data_end()
    if ends.enabled:
      ends.local_steps.record_address(sess)

  def workers_gone(self, sess: "tf.compat.v1.Session") -> "list[int]":
    """Not in stock: the keys of the workers declared gone
    (``worker_gone_secs``), read from the record on the ps in one bounded
    run; [] with ``data_end="stock"``.

    A worker's key is its task index, the chief's 0. A gone worker never
    says it is done: README's program has the chief put one item in the
    ps's ``done`` queue for each, after its own (docs/operations.md, "A
    worker lost for good").

    Raises:
      NotBuiltError: Before ``apply_gradients``.
      tf.errors.OpError: The record on the ps cannot be read.
    """
    ends = self._built_data_end()
    if not ends.enabled:
      return []
    keys, values = sess.run(ends.done_keys, options=tf.compat.v1.RunOptions(
        timeout_in_ms=RUN_TIMEOUT_MS))
    return _gone.gone_keys(keys, values)

  def chief_watch(self, sess: "tf.compat.v1.Session") -> typing.Any:
    """Not in stock: a non-chief's watch on the chief, or None.

    With a ``data_end`` policy (its record holds the chief's address), a
    session on a remote master and an ``operation_timeout_in_ms``, a
    ``_lost.ChiefWatch`` that the hook tells of each train run: a run
    still waiting for a token shortly before that timeout, with the chief's
    task not answering, ends the worker with ``SyncTimeoutError`` naming
    the chief (docs/operations.md, "The chief lost for good").

    Raises:
      NotBuiltError: Before ``apply_gradients``.
    """
    opt: typing.Any = self
    local_step = opt.local_step  # NotBuiltError before the build.
    ends = opt._data_end  # pylint: disable=protected-access
    timeout_ms = _compat.operation_timeout_ms(sess)
    # A session-like object without a target (a test's recorder) gets none.
    if (not ends.enabled or not getattr(sess, "sess_str", None)
        or timeout_ms <= 0):
      return None
    return _lost.ChiefWatch(
        read_addresses=ends.local_steps.read_addresses,
        local_step=_diagnose.local_step_spec(local_step),
        total_num_replicas=ends.total_num_replicas, timeout_ms=timeout_ms)

  def chief_stop_error(
      self, sess: "tf.compat.v1.Session") -> "Exception | None":
    """Not in stock: the error the chief stopped a failed job with, or None.

    Read from the abort mark the chief leaves on the ps before it closes
    the token queue on a stop with an error (``SyncStallError``,
    ``SyncTimeoutError``, its sync loop's error), in one bounded run. A
    worker's hook asks when a run ended on that closed queue: with a mark
    the worker fails with this error (the chief's class, its reason in the
    message) instead of ending as if training were done. None without a
    mark (a normal end), when the ps cannot be read, and with
    ``data_end="stock"`` (docs/operations.md, "A job that failed").

    Raises:
      NotBuiltError: Before ``apply_gradients``.
    """
    ends = self._built_data_end()
    return ends.abort.read(sess) if ends.enabled else None

  def data_end_fetches(self, fetches: typing.Any) -> "tf.Operation | None":
    """Not in stock: what a worker's hook adds to a session run of
    ``fetches``, or None.

    With a ``data_end`` policy, a run that trains (its fetches reach the
    train op) also records this worker's new local step on the ps, where
    the chief's stall line reads every worker's (docs/data_end.md); the
    hook adds it by itself. None for any other run, and with
    ``data_end="stock"``.

    Raises:
      NotBuiltError: Before ``apply_gradients``.
    """
    ends = self._built_data_end()
    return ends.local_steps.fetches_for(fetches) if ends.enabled else None

  def _built_data_end(self) -> typing.Any:
    """This optimizer's data-end policy, once it is built.

    Raises:
      NotBuiltError: Before ``apply_gradients``.
    """
    opt: typing.Any = self  # The SyncReplicasOptimizer mixed into.
    _ = opt.global_step  # NotBuiltError before the build.
    return opt._data_end  # pylint: disable=protected-access


def make(options, *, shared_prefix):
  """The data-end policy ``options`` (an ``_options.Options``) ask for."""
  if options.data_end == STOCK:
    return NoDataEnd()
  return DataEnd(options.data_end,
                 replicas_to_aggregate=options.replicas_to_aggregate,
                 total_num_replicas=options.total_num_replicas,
                 tokens_per_step=options.tokens_per_step,
                 shared_prefix=shared_prefix,
                 shared_tokens=not options.one_gradient_per_worker)


def take_counts(aggregated):
  """The ``num_required`` inputs of every take behind ``aggregated``.

  Stock's takes read a constant each; the chief's loop feeds them (a
  constant's output may be fed) instead of building a placeholder, so the
  graph outside our scope stays stock's.

  Args:
    aggregated: The ``(gradient, variable)`` pairs the update applies.

  Returns:
    The distinct tensors, in a stable order.
  """
  takes = ("AccumulatorTakeGradient", "ResourceAccumulatorTakeGradient",
           "SparseAccumulatorTakeGradient")
  todo = []
  for grad, _ in aggregated:
    if isinstance(grad, tf.IndexedSlices):
      todo.extend([grad.values.op, grad.indices.op])
    elif grad is not None:
      todo.append(grad.op)
  seen, found = set(), []
  while todo:
    op = todo.pop()
    if op in seen:
      continue
    seen.add(op)
    if op.type in takes:
      if op.inputs[1] not in found:
        found.append(op.inputs[1])
      continue
    todo.extend(t.op for t in op.inputs)
  return sorted(found, key=lambda t: t.name)
