"""Owns the reading of a process's thread count from /proc (stdlib only).

Used by the test scheduler (tools/_run_tests.py, for each pytest process it
runs) and by tests/conftest.py (for its own process, per test file): the
threads a process holds are what the scheduler keeps under the pid limit.
"""


def threads(pid="self"):
  """Threads of process ``pid`` (default: this one); 0 once it has ended."""
  try:
    with open("/proc/%s/status" % pid) as f:
      for line in f:
        if line.startswith("Threads:"):
          return int(line.split()[1])
  except OSError:
    pass
  return 0
