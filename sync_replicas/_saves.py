"""Whole checkpoints: the chief applies no update while it saves one.

Stock's chief applies each update in its queue runner's thread while
``CheckpointSaverHook`` saves from the chief's main thread. With variables on
several ps tasks a save can read some of them (or the global step) before an
update and the others after it: a torn checkpoint, whose restore applies that
update twice or loses it (docs/operations-soak.md, fault 3). Measured here
with a backup worker pushing during the chief's saves: 35 and 46 of 200
stock checkpoints torn, 0 of 200 with this listener.

``SavePauseListener`` closes that race in the chief's process, where both
threads live: it holds the runner's update lock from ``before_save`` to
``after_save``, and the runner takes the same lock around each sync op. So
that a save never waits for a take blocked on gradients (which may need the
chief's own next push, after the save), the runner then runs the sync op only
once every accumulator holds enough gradients, polling as it does in process.

Nothing is added to the graph, and without the listener the runner is
unchanged (stock's blocking loop). A save waits at most ``timeout_secs``
for the lock (an update's apply normally takes milliseconds; a sync op
blocked on a restarted ps can hold it longer), then goes ahead and says so.
"""

import logging
import numbers
import threading

import tensorflow as tf

_LOG = logging.getLogger("sync_replicas")

#: How long a save waits for the update being applied, by default.
DEFAULT_TIMEOUT_SECS = 10.0
#: How often a loop waiting for a save to end checks for a stop, in seconds.
UPDATE_WAIT_SECS = 0.1


class UpdateLock:
  """The lock the chief's updates and its checkpoint saves share.

  Owned by the chief's runner (``SyncQueueRunner.updates``): its loops run
  each sync op through ``run``; the listener holds it for a save.
  """

  def __init__(self, *, prompt_stop):
    self._lock = threading.Lock()
    self._prompt_stop = prompt_stop
    self._pauses_for_saves = False

  @property
  def pauses_for_saves(self):
    """Whether saves hold updates back (a listener exists)."""
    return self._pauses_for_saves

  def pause_for_saves(self):
    """From now on the loop runs the sync op only when it cannot block.

    Called by the listener, before the runner's threads start: a save then
    never waits for a take blocked on gradients. Stock's threads
    (``prompt_stop=False``) cannot hold anything back.
    """
    if not self._prompt_stop:
      raise ValueError(
          "make_checkpoint_saver_listener() needs the chief's prompt-stop "
          "loop, and this optimizer was built with prompt_stop=False "
          "(stock's QueueRunner threads, which nothing can pause). Build it "
          "with prompt_stop=True (the default) to pause updates for saves.")
    self._pauses_for_saves = True

  def hold(self, timeout_secs):
    """Waits for the update being applied, if any, and holds the next.

    Returns False if that took longer than ``timeout_secs`` (then nothing
    is held).
    """
    return self._lock.acquire(timeout=timeout_secs)

  def release(self):
    self._lock.release()

  def run(self, coord, run_sync, *args):
    """``run_sync(*args)`` unless a save holds the updates until a stop."""
    while not self._lock.acquire(timeout=UPDATE_WAIT_SECS):
      if coord.should_stop():
        return
    try:
      run_sync(*args)
    finally:
      self._lock.release()


def check_timeout(timeout_secs):
  if (isinstance(timeout_secs, bool)
      or not isinstance(timeout_secs, numbers.Real) or timeout_secs <= 0):
    raise ValueError(
        "timeout_secs must be a number of seconds > 0, got %r. Pass how "
        "long a save waits for the update being applied, e.g. %s."
        % (timeout_secs, DEFAULT_TIMEOUT_SECS))


class SavePauseListener(tf.compat.v1.train.CheckpointSaverListener):
  """Holds the chief's updates back while a checkpoint is written.

  Made by ``SyncReplicasOptimizer.make_checkpoint_saver_listener()``; pass
  it to the chief's ``CheckpointSaverHook(..., listeners=[...])``, first, so
  that later listeners' ``before_save`` already run under it.

  Args:
    updates: The chief runner's ``UpdateLock``; its loop is switched to
      the non-blocking one here, before its threads start.
    timeout_secs: How long a save waits for the update being applied.
  """

  def __init__(self, updates, timeout_secs):
    check_timeout(timeout_secs)
    updates.pause_for_saves()
    self._updates = updates
    self._timeout_secs = float(timeout_secs)
    self._held = False

  def before_save(self, session, global_step_value):
    del session
    if self._held:
      # The last save raised before after_save (a ps lost mid-save, which
      # MonitoredSession recovers from): the lock is still ours, and this
      # save, the new session's first, releases it.
      return
    self._held = self._updates.hold(self._timeout_secs)
    if not self._held:
      _LOG.warning(
          "sync_replicas: the update being applied did not finish within "
          "%.1f s before the save at global step %s (a ps task restarted "
          "or unreachable?); saving without holding updates back, so this "
          "checkpoint may hold part of an update, as stock's can.",
          self._timeout_secs, global_step_value)

  def after_save(self, session, global_step_value):
    del session, global_step_value
    self._release()

  def end(self, session, global_step_value):
    del session, global_step_value
    self._release()  # A save that raised never reached after_save.

  def _release(self):
    if self._held:
      self._held = False
      self._updates.release()
