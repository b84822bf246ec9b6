"""A process's peak resident memory (Linux VmHWM), and restarting its mark.

The bench's task processes serve many runs, so a run's peak is its own only
if the mark is restarted before it: the kernel resets VmHWM on a write of
"5" to /proc/<pid>/clear_refs (the process's owner may write it). Elsewhere
the getrusage fallback gives this process's peak since it started.
"""

import resource


def reset(pid="self"):
  """Restarts ``pid``'s peak-RSS mark; does nothing where it cannot."""
  try:
    with open("/proc/%s/clear_refs" % pid, "w") as f:
      f.write("5")
  except OSError:
    pass


def peak_mb(pid="self"):
  """``pid``'s peak RSS in MB since its last reset; None if unreadable."""
  try:
    with open("/proc/%s/status" % pid) as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024
  except (OSError, ValueError):
    pass
  if pid == "self":
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  return None
