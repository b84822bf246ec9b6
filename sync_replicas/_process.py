"""Which process wrote a file, and whether it still runs.

Owns the ``writer`` record of a sync manifest (host, pid, start time) and
the check of it that ``sync-replicas-status`` makes before anything else:
on the writer's own machine, a writer that no longer runs is a chief that
has exited. The start time tells the writer from a later process that was
given the same pid. Standard library only: the status tool asks before
TensorFlow's import.
"""

import os
import socket


def identity():
  """This process: ``{"host", "pid", "started"}`` for a manifest."""
  return {"host": socket.gethostname(), "pid": os.getpid(),
          "started": started(os.getpid())}


def started(pid):
  """Process ``pid``'s start time (clock ticks since boot), or None when it
  does not run, is not ours to see, or the platform has no /proc."""
  try:
    with open("/proc/%d/stat" % pid, encoding="ascii",
              errors="replace") as f:
      # The command name, in parentheses, may hold spaces: count after it.
      # The start time is the stat line's 22nd field.
      return int(f.read().rsplit(")", 1)[1].split()[19])
  except (OSError, IndexError, ValueError):
    return None


def has_exited(record):
  """True when ``record`` (an ``identity``) names a process of this machine
  that no longer runs; False when it runs, or when that cannot be told
  (another machine, an older manifest without the record, no /proc)."""
  if not isinstance(record, dict) or record.get("host") != socket.gethostname():
    return False
  pid, began = record.get("pid"), record.get("started")
  if not isinstance(pid, int) or not isinstance(began, int):
    return False
  if not os.path.isdir("/proc/self"):
    return False
  return started(pid) != began
