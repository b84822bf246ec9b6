"""A task's timeline file, written off the training step's path.

Owns the bounded hand-over from the thread that trains (a hook's
``after_run``, the chief's sync loop) to one writer thread per file, and
what happens when writing fails. ``record`` never blocks and never raises:

* the queue holds at most ``MAX_PENDING`` records; a record that finds it
  full is dropped and counted, and the count is logged once, when the file
  closes;
* the writer thread appends JSON lines and flushes at most every
  ``FLUSH_SECS``; the first write error (a full disk, a directory that
  vanished) is logged once, and every later record is dropped uncounted;
* the file closes at ``close_all()``, which runs at interpreter exit,
  bounded by ``CLOSE_SECS``.

One writer per path in a process: a chief whose session is recreated, or
two hooks of the same task, append to the same file. A process's first
write to a file is a ``start`` record holding when the process loaded this
module, before its first step: the merge tells the runs that appended to
one directory apart by the chief's.
"""

import atexit
import json
import logging
import os
import queue
import threading
import time

_LOG = logging.getLogger(__name__)

#: Records waiting to be written; past this a record is dropped.
MAX_PENDING = 10000
#: The writer flushes at most this often, so a killed task loses at most
#: about this much of its timeline.
FLUSH_SECS = 1.0
#: How long closing waits for the pending records at exit.
CLOSE_SECS = 5.0

_lock = threading.Lock()
_writers: "dict[str, TimelineWriter]" = {}
#: Before this process's first timeline record (the module loads with the
#: optimizer that records).
PROCESS_BEGAN = time.time()


class TimelineWriter:
  """Appends records, as JSON lines, to one file from a thread of its own."""

  def __init__(self, path):
    self.path = path
    self._pending = queue.Queue(MAX_PENDING)
    self._dropped = 0
    self._failed = False
    self._thread = threading.Thread(
        target=self._write_all, name="sync_replicas_timeline_writer",
        daemon=True)
    self._thread.start()

  def record(self, **fields):
    """Queues one record; drops it if the queue is full or writing failed."""
    if self._failed:
      return
    try:
      self._pending.put_nowait(fields)
    except queue.Full:
      self._dropped += 1

  def close(self, timeout=CLOSE_SECS):
    """Writes what is pending (bounded by ``timeout``) and ends the thread."""
    try:
      self._pending.put(None, timeout=timeout)
    except queue.Full:
      pass
    self._thread.join(timeout)
    if self._dropped:
      _LOG.warning("sync_replicas timeline: %d records dropped because the "
                   "writer of %s fell behind", self._dropped, self.path)

  def _write_all(self):
    out = None
    last_flush = time.monotonic()
    while True:
      try:
        fields = self._pending.get(timeout=FLUSH_SECS)
      except queue.Empty:
        fields = ()
      try:
        if fields is None:
          if out is not None:
            out.close()
          return
        if fields:
          if out is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            out = open(self.path, "a", encoding="utf-8")
            out.write(json.dumps({"kind": "start", "began": PROCESS_BEGAN,
                                  "pid": os.getpid()}) + "\n")
          out.write(json.dumps(fields, separators=(",", ":")) + "\n")
        if out is not None and time.monotonic() - last_flush >= FLUSH_SECS:
          out.flush()
          last_flush = time.monotonic()
      except OSError as e:
        if not self._failed:
          _LOG.warning("sync_replicas timeline: cannot write %s (%s); the "
                       "rest of this task's timeline is dropped, training "
                       "goes on", self.path, e)
        self._failed = True


def for_path(path):
  """The process's writer for ``path``, made on first use."""
  path = os.path.abspath(path)
  with _lock:
    writer = _writers.get(path)
    if writer is None:
      writer = _writers[path] = TimelineWriter(path)
    return writer


def close_all():
  """Closes every writer (at exit, or when a test wants its files whole)."""
  with _lock:
    writers = list(_writers.values())
    _writers.clear()
  for writer in writers:
    writer.close()


atexit.register(close_all)
