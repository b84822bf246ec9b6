"""A worker's side of the timeline, as its session hook drives it.

Owns turning each train-op run's fetched marks into one record: the time
the hook handed the run to TensorFlow (its compute begins), the marks, the
local step the run pushed at (the token the previous run got) and the token
it got. The hook calls ``before_run`` and ``after_run`` around every run of
its session, including runs that do not run the train op; those fetch no
token and are not recorded.
"""

import time

#: The key of the timeline's fetches among the hook's.
KEY = "sync_replicas_timeline"


class WorkerTimeline:
  """Per-hook state: the fetches, the writer and the step pushed at."""

  @classmethod
  def of(cls, timeline):
    """One for ``timeline`` if it records, else None."""
    return cls(timeline) if timeline.worker_fetches else None

  def __init__(self, timeline):
    self._timeline = timeline
    self._writer = timeline.writer("worker")
    self._step = None
    self._began = None

  def session_started(self, session):
    """Reads the local step the session's first push will carry."""
    self._step = int(session.run(self._timeline.local_step_read))

  def before_run(self, fetches):
    """The marks to add to a run of ``fetches``, or None if it does not
    train (fetching them would run a push)."""
    if not self._timeline.runs_train_op(fetches):
      return None
    self._began = time.time()
    return self._timeline.worker_fetches

  def after_run(self, marks):
    if not marks:
      return
    got = int(marks["got"])
    self._writer.record(kind="step", began=self._began, step=self._step,
                        got=got, **{k: float(marks[k]) for k in
                                    ("grads", "pushed", "token")})
    self._step = got
