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

import tensorflow as tf

_LOG = logging.getLogger("sync_replicas")

#: How long a save waits for the update being applied, by default.
DEFAULT_TIMEOUT_SECS = 10.0


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
    runner: The optimizer's chief queue runner (``SyncQueueRunner``); it
      is switched to its non-blocking loop here, before its threads start.
    timeout_secs: How long a save waits for the update being applied.
  """

  def __init__(self, runner, timeout_secs):
    check_timeout(timeout_secs)
    runner.pause_for_saves()
    self._runner = runner
    self._timeout_secs = float(timeout_secs)
    self._held = False

  def before_save(self, session, global_step_value):
    del session
    if self._held:
      # The last save raised before after_save (a ps lost mid-save, which
      # MonitoredSession recovers from): the lock is still ours, and this
      # save, the new session's first, releases it.
      return
    self._held = self._runner.hold_updates(self._timeout_secs)
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
      self._runner.release_updates()
