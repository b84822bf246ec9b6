"""Free TCP ports on 127.0.0.1, with the standard library only.

Kept free of TensorFlow so that the launcher (``sync_replicas.cli.launch``),
which imports it, starts in milliseconds and can still confine itself (a
process that imported TensorFlow runs threads); tools/ load this file by its
path.
"""

import collections
import contextlib
import os
import random
import socket
import tempfile
import threading

LOOPBACK = "127.0.0.1"
#: ``LOW-HIGH`` (HIGH excluded): where ``free_ports`` draws from, when set.
#: tools/test gives each pytest process it runs side by side a range of its
#: own, so that two of them never pick the same port in the window before a
#: server binds it (CI once lost a real-script test to that: "Could not
#: start gRPC server" for a port another process had just drawn too).
PORT_RANGE_ENV = "SYNC_REPLICAS_PORT_RANGE"

#: Ports this process handed out lately, skipped by ``free_ports``: until a
#: server binds one it still tests free, so two clusters started side by
#: side from one process (stock's and ours, in the tests) could otherwise
#: draw the same port and one server fail to bind ("Could not start gRPC
#: server", seen in CI). Bounded, so a long-lived process never runs out.
_HANDED_OUT: "collections.deque[int]" = collections.deque(maxlen=1024)
_HANDED_OUT_LOCK = threading.Lock()


def _ephemeral_range():
  """The kernel's range for automatically assigned (client) ports."""
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      low, high = (int(x) for x in f.read().split())
    return low, high
  except (OSError, ValueError):
    return 32768, 60999  # Linux's default.


def draw_range():
  """``(low, high)``: where free ports are drawn from, high excluded.

  Below the ephemeral range (see ``free_ports``), or ``PORT_RANGE_ENV``'s
  range when it is set.
  """
  ephemeral_low, _ = _ephemeral_range()
  floor = 10000 if ephemeral_low > 12000 else 1024
  value = os.environ.get(PORT_RANGE_ENV)
  if not value:
    return floor, ephemeral_low
  try:
    low, high = (int(x) for x in value.split("-"))
  except ValueError:
    low = high = None
  if low is None or not 1024 <= low < high <= 65536:
    raise ValueError(
        "%s must be LOW-HIGH with 1024 <= LOW < HIGH <= 65536, got %r; "
        "unset it to draw from [%d, %d)" % (PORT_RANGE_ENV, value, floor,
                                            ephemeral_low))
  return low, high


def free_ports(count, *, rng=None):
  """Returns ``count`` distinct TCP ports that are free on 127.0.0.1 now.

  A port is released between this check and the server binding it. Ports
  the kernel hands out on its own (the ephemeral range, used by every
  outgoing gRPC connection) could be taken in that window, and TensorFlow
  aborts the whole process when a server cannot bind; so the ports are drawn
  at random from below that range, where only explicit binds land, and
  never one this process handed out lately (another call's server may not
  have bound it yet).
  """
  rng = rng or random.SystemRandom()
  floor, low = draw_range()
  chosen = []
  with _HANDED_OUT_LOCK:
    # At most half a small range is kept out, so it never runs dry.
    recent = set(list(_HANDED_OUT)[-((low - floor) // 2):]) if (
        low - floor >= 2) else set()
    for _ in range(count * 200):
      if len(chosen) == count:
        break
      port = rng.randrange(floor, low)
      if port in chosen or port in recent:
        continue
      with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
          sock.bind((LOOPBACK, port))
        except OSError:
          continue
      chosen.append(port)
    _HANDED_OUT.extend(chosen)
  if len(chosen) < count:
    raise RuntimeError(
        "found only %d free ports of %d in [%d, %d) on %s; free some ports "
        "or pass the cluster spec yourself" % (len(chosen), count, floor, low,
                                               LOOPBACK))
  return chosen


#: Where ``reserve_free_port`` records, for every process of this machine,
#: the ports it drew for a program that may not listen yet: one file per
#: port, named after it, holding the pid that keeps it.
RESERVED_DIR = os.path.join(tempfile.gettempdir(), "sync_replicas-ports")


def reserve_port(port):
  """Reserves ``port`` for this process if no live process has; returns
  whether it did. A reservation left by a process that died is removed, and
  the port is taken on that same call.

  The port stays reserved until ``release_port`` or this process's exit.
  """
  os.makedirs(RESERVED_DIR, exist_ok=True)
  with contextlib.suppress(OSError):
    os.chmod(RESERVED_DIR, 0o1777)  # Any user's wrappers share it.
  path = os.path.join(RESERVED_DIR, str(port))
  for _ in range(2):
    try:
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      if _holder_alive(path):
        return False
      with contextlib.suppress(OSError):
        os.remove(path)  # Its holder died: free to take.
      continue
    with os.fdopen(fd, "w") as f:
      f.write("%d\n" % os.getpid())
    return True
  return False


def reserve_free_port(exclude=()):
  """A free port that no live process of this machine has reserved and
  that is not in ``exclude``; it stays reserved for this process until
  ``release_port`` or its exit.

  Why: ``free_ports`` skips only what this process handed out. Separate
  processes that each draw a port for a program that binds it seconds later
  (sync-replicas-slurm's wrappers, one per task, two jobs on one node; the
  program imports TensorFlow first) can draw the same one, and the second
  server then fails to bind ("Could not start gRPC server", seen in CI).
  ``exclude``: ports something else will bind soon without drawing them
  (a Slurm step's meeting-point candidates, which CI once saw taken by the
  meeting point after a worker's wrapper had drawn one for its program).
  """
  exclude = set(exclude)
  for _ in range(200):
    port = free_ports(1)[0]
    if port not in exclude and reserve_port(port):
      return port
  raise RuntimeError("found no port free and unreserved in %d draws; "
                     "remove stale files from %s" % (200, RESERVED_DIR))


def release_port(port):
  """Ends this process's reservation of ``port`` (``reserve_free_port``)."""
  path = os.path.join(RESERVED_DIR, str(port))
  with contextlib.suppress(OSError, ValueError):
    with open(path) as f:
      if int(f.read().split()[0]) != os.getpid():
        return
    os.remove(path)


def _holder_alive(path):
  """Whether the process named in a reservation file still runs."""
  try:
    with open(path) as f:
      pid = int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return True  # Being written right now, or unreadable: leave it.
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True
