"""Confinement to a private network namespace that has only loopback.

Owns moving the calling process into a network namespace of its own (inside
a user namespace of its own when it is not root, or when root may not create
one directly), bringing that namespace's loopback up, entering the namespace
of another process, and asking whether a port listens in a process's
namespace.

Why: TensorFlow's gRPC server listens on ``0.0.0.0:<port>`` with insecure
credentials whatever address the cluster spec names, and anyone who reaches
the port can run any op as the task's user (docs/security.md). Inside a fresh
network namespace ``0.0.0.0`` is the namespace's own loopback and nothing
else: no other host, and no process of this machine outside the namespace,
can connect. Processes inside still reach each other on 127.0.0.1, and they
share the file system, users and everything but the network with the rest of
the machine.

Linux only. Standard library only (``ctypes`` for ``unshare(2)`` and
``setns(2)``): the launcher (``sync_replicas.cli.launch``) imports it and
must start in milliseconds, without TensorFlow, whose import starts the
threads that ``confine`` refuses.
"""

import contextlib
import ctypes
import errno
import fcntl
import os
import socket
import struct
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


class CannotConfine(Exception):
  """This platform (kernel, permissions, sandbox) cannot make the namespace."""


def confine(*, as_root=False):
  """Moves this process into a new network namespace with only loopback up.

  Must run before the process starts any thread: ``unshare(CLONE_NEWUSER)``
  refuses a multithreaded caller, and a new network namespace would apply to
  the calling thread only. Every process started afterwards inherits it.

  Args:
    as_root: In a user namespace (the path of a process without root), map
      this user to uid and gid 0 instead of to themselves, as ``unshare -r``
      does: the commands it starts (``ip``, ``tc``, for emulated hosts) then
      keep the namespace's capabilities. Files stay the user's outside.

  Returns:
    What was made, for a log line: ``"network namespace"`` or ``"user and
    network namespace"``.

  Raises:
    CannotConfine: With the reason, if no namespace could be made (the
      process is then unchanged).
  """
  if not sys.platform.startswith("linux"):
    raise CannotConfine("network namespaces exist on Linux only, this is %s"
                        % sys.platform)
  threads = thread_count()
  if threads > 1:
    raise CannotConfine("the process already runs %d threads; confine it "
                        "before starting any" % threads)
  libc = _libc()
  uid, gid = os.geteuid(), os.getegid()
  reasons = []
  # Root may make a network namespace directly. Without root, or when a
  # container denies root that, a user namespace of our own grants the
  # capability inside it: the same uid and gid are mapped to themselves, so
  # files and processes keep their owner.
  attempts = ([(CLONE_NEWNET, "network namespace")] if uid == 0 else []) + [
      (CLONE_NEWUSER | CLONE_NEWNET, "user and network namespace")]
  for flags, what in attempts:
    if libc.unshare(flags) == 0:
      break
    reasons.append("%s: unshare(%s): %s" % (
        what, _flag_names(flags), os.strerror(ctypes.get_errno())))
  else:
    raise CannotConfine("; ".join(reasons))
  if flags & CLONE_NEWUSER:
    _map_ids(uid, gid, inside=(0, 0) if as_root else (uid, gid))
  _loopback_up()
  names = sorted(name for _, name in socket.if_nameindex())
  if names != ["lo"]:
    raise CannotConfine("the new namespace has interfaces %s, expected only "
                        "lo" % names)
  return what


def is_confined_apart(pid):
  """True if process ``pid`` is in another network namespace than we are."""
  return (os.stat("/proc/%d/ns/net" % pid).st_ino
          != os.stat("/proc/self/ns/net").st_ino)


def listens(port, pid="self"):
  """True if a TCP socket listens on ``port`` in the network namespace of
  process ``pid`` (``/proc/PID/net`` shows that namespace's sockets).

  Raises:
    OSError: If the process's tables cannot be read (it ended, or is not
      ours to read).
  """
  for table in ("tcp", "tcp6"):
    path = "/proc/%s/net/%s" % (pid, table)
    if not os.path.exists(path):
      continue
    with open(path, encoding="ascii") as rows:
      next(rows)  # The header.
      for row in rows:
        fields = row.split()
        # 0A: TCP_LISTEN.
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
          return True
  return False


def enter(pid):
  """Moves this process into the network namespace of process ``pid``.

  When ``pid`` is in a user namespace of its own (a non-root launch), that is
  entered first: its network namespace belongs to it, and only inside it does
  this process hold the right to join. When ``pid`` has a mount namespace of
  its own (a launch with emulated hosts: ``ip netns`` names them there, and
  its /etc/hosts names their tasks), that is joined too, keeping the working
  directory. Must run before the process starts a thread.

  Raises:
    CannotConfine: With the reason, if the namespace cannot be entered.
  """
  if not sys.platform.startswith("linux"):
    raise CannotConfine("network namespaces exist on Linux only, this is %s"
                        % sys.platform)
  libc = _libc()
  cwd = os.getcwd()
  for kind, flag in (("user", CLONE_NEWUSER), ("mnt", CLONE_NEWNS),
                     ("net", CLONE_NEWNET)):
    path = "/proc/%d/ns/%s" % (pid, kind)
    try:
      if os.stat(path).st_ino == os.stat("/proc/self/ns/" + kind).st_ino:
        continue
      fd = os.open(path, os.O_RDONLY)
    except OSError as e:
      raise CannotConfine("cannot open %s: %s" % (path, e.strerror)) from None
    try:
      if libc.setns(fd, flag) != 0:
        raise CannotConfine("setns(%s of pid %d): %s" % (
            kind, pid, os.strerror(ctypes.get_errno())))
    finally:
      os.close(fd)
    if kind == "mnt":
      # Joining a mount namespace moves to its root; the same path names
      # the same directory in there (the launch's copy of our mounts).
      with contextlib.suppress(OSError):
        os.chdir(cwd)


def _libc():
  try:
    libc = ctypes.CDLL(None, use_errno=True)
  except OSError as e:
    raise CannotConfine("the C library does not load (%s)" % e) from e
  # An attribute of a CDLL looks the symbol up: a libc without one (too old,
  # or not glibc) fails here rather than at the first call.
  missing = [n for n in ("unshare", "setns") if not hasattr(libc, n)]
  if missing:
    raise CannotConfine("the C library offers no %s" % "/".join(missing))
  return libc


def thread_count():
  """This process's threads (TensorFlow's C++ ones included), from /proc."""
  try:
    return len(os.listdir("/proc/self/task"))
  except OSError:
    return 1


def _flag_names(flags):
  names = [n for n, f in (("CLONE_NEWUSER", CLONE_NEWUSER),
                          ("CLONE_NEWNET", CLONE_NEWNET)) if flags & f]
  return "|".join(names)


def _map_ids(uid, gid, *, inside):
  # setgroups must be denied before an unprivileged process may write a
  # gid_map (user_namespaces(7)).
  for path, text in (("/proc/self/uid_map", "%d %d 1" % (inside[0], uid)),
                     ("/proc/self/setgroups", "deny"),
                     ("/proc/self/gid_map", "%d %d 1" % (inside[1], gid))):
    try:
      with open(path, "w") as f:
        f.write(text)
    except OSError as e:
      if path.endswith("setgroups") and e.errno == errno.ENOENT:
        continue  # Kernels before 3.19 have no such file.
      raise CannotConfine(
          "writing %r to %s: %s" % (text, path, e.strerror)) from e


def _loopback_up():
  """Sets ``lo`` up: a new network namespace starts with it down."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
    request = struct.pack("16sH22x", b"lo", 0)
    try:
      flags = struct.unpack("16sH22x", fcntl.ioctl(
          sock, _SIOCGIFFLAGS, request))[1]
      fcntl.ioctl(sock, _SIOCSIFFLAGS,
                  struct.pack("16sH22x", b"lo", flags | _IFF_UP))
    except OSError as e:
      raise CannotConfine("bringing up lo: %s" % e.strerror) from None
