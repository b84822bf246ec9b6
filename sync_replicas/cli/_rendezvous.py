"""The meeting point of a Slurm step's tasks: addresses in, the end out.

Owns the small TCP service that the wrapper of the step's first task (slot
0 of ``_slurm_env.layout``) runs for the whole step, and the client every
wrapper (that one's too) talks to it with, one JSON object per line:

  client: {"hello": STEP, "slot": i, "address": "host:port"}
  server: {"welcome": true}          at once, for this step's tasks only
  server: {"cluster": [addresses]}   once every slot has said hello
  client: {"exit": "..."}            its program ended (how, in words) or
                                     {"exit": "ok"}
  server: {"stop": why}              to a ps task, once every replica ended
                                     well: its program serves forever
  server: {"abort": why}             to everyone, once any task failed, was
                                     killed, or its wrapper vanished

Why a meeting point: the ports. Each task takes a port the kernel says is
free on its own node, and the service tells everyone the others'; so two
jobs sharing a node never pick the same port (a port derived from the job
id collides with anything already there). The service itself must be found
without being told: its port is the first of ``candidate_ports(STEP)``
that it can bind, and a client tries them in order, taking the one whose
answer welcomes STEP (another job's service, or any other program on a
port, is skipped). And the end: a ps task serves forever, and a step ends
only when all its tasks have; the service sees every replica's end and
tells the ps tasks to stop, and tells everyone to stop when one task
failed, instead of leaving them to wait for an operation timeout.

Standard library only (see ``_cli``).
"""

import contextlib
import json
import os
import socket
import threading
import time
import zlib

from sync_replicas import _ports

#: How many ports the service may try; its clients try each in turn.
CANDIDATES = 8
#: Where the candidates are drawn from: below Linux's ephemeral range
#: (32768 on), which outgoing connections take, so nothing else lands there
#: by chance.
PORT_LOW, PORT_HIGH = 10000, 32000
#: How long a client waits for a welcome on a port that accepted it.
HELLO_SECS = 3.0
#: Pause between two rounds over the candidates, while the service starts.
RETRY_SECS = 0.2


def candidate_ports(step_key):
  """The ports the service of step ``step_key`` tries, in order.

  The same in every task of the step (srun gives every task the same
  environment); different for different steps. Drawn from
  ``PORT_LOW``-``PORT_HIGH``, or from $SYNC_REPLICAS_PORT_RANGE when it is
  set: tools/test gives each of its pytest processes a range of its own, so
  that a test's meeting point cannot take a port another test drew.
  """
  low, high = PORT_LOW, PORT_HIGH
  if os.environ.get(_ports.PORT_RANGE_ENV):
    low, high = _ports.draw_range()
  return [low + zlib.crc32(("%s/%d" % (step_key, k)).encode()) % (high - low)
          for k in range(CANDIDATES)]


class RendezvousError(Exception):
  """The tasks could not meet; the message says which and why."""


def _send(sock, message):
  sock.sendall((json.dumps(message) + "\n").encode())


class Service:
  """The meeting point, run by slot 0's wrapper in threads of its own.

  Args:
    step_key: The step's identity, ``"JOB.STEP"``.
    num_slots: The step's tasks.
    is_ps: For each slot, whether it is a ps task (told to stop when every
      replica has ended well).
    names: For each slot, how messages name it (``"worker1 on node03"``).
  """

  def __init__(self, step_key, num_slots, *, is_ps, names):
    self._key, self._n = step_key, num_slots
    self._is_ps, self._names = is_ps, names
    self._lock = threading.Lock()
    self._conns = {}
    self._addresses = {}
    self._ended = {}      # slot -> how its program ended ("ok" or words)
    self._aborted = None  # why, once the step is being stopped
    self._stopping = False
    self.finished = threading.Event()  # every slot has ended
    self._sock = self._bind()
    self.port = self._sock.getsockname()[1]
    threading.Thread(target=self._accept, daemon=True,
                     name="rendezvous-accept").start()

  def _bind(self):
    for port in candidate_ports(self._key):
      # Reserved first, as the wrappers reserve their programs' ports: a
      # port another wrapper drew for a program that has not bound it yet
      # still binds free here, and the program would then fail to start.
      if not _ports.reserve_port(port):
        continue
      sock = socket.socket()
      # A port whose last connections still linger in TIME_WAIT (an earlier
      # step's service, a task that ended) binds; one that a live socket
      # listens on still does not.
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        sock.bind(("", port))
      except OSError:
        sock.close()
        _ports.release_port(port)
        continue
      sock.listen(max(self._n, 16))
      return sock
    raise RendezvousError(
        "none of the step's %d meeting ports (%s) is free on this node"
        % (CANDIDATES, ", ".join(map(str, candidate_ports(self._key)))))

  def _accept(self):
    while True:
      try:
        conn, _ = self._sock.accept()
      except OSError:
        return
      threading.Thread(target=self._serve, args=(conn,), daemon=True,
                       name="rendezvous-conn").start()

  def _serve(self, conn):
    slot = None
    with contextlib.suppress(OSError, ValueError):
      lines = conn.makefile("r", encoding="utf-8")
      hello = json.loads(lines.readline() or "{}")
      if hello.get("hello") != self._key:
        _close(conn, lines)
        return
      slot = int(hello["slot"])
      _send(conn, {"welcome": True})
      self._register(slot, conn, hello["address"])
      for line in lines:
        message = json.loads(line)
        if "exit" in message:
          self._ended_as(slot, message["exit"])
    if slot is not None:
      self._ended_as(slot, None)  # Closed: said how it ended, or vanished.

  def _register(self, slot, conn, address):
    with self._lock:
      self._conns[slot], self._addresses[slot] = conn, address
      if len(self._addresses) < self._n:
        return
      cluster = [self._addresses[i] for i in range(self._n)]
      for c in self._conns.values():
        with contextlib.suppress(OSError):
          _send(c, {"cluster": cluster})

  def _ended_as(self, slot, how):
    with self._lock:
      if slot in self._ended:
        return
      if how is None:
        how = ("vanished: its wrapper (sync-replicas-slurm) was killed, or "
               "its node lost")
      self._ended[slot] = how
      if how != "ok" and not (self._stopping and self._is_ps[slot]):
        self._abort_locked("task %s %s" % (self._names[slot], how))
      replicas = [i for i in range(self._n) if not self._is_ps[i]]
      if (self._aborted is None and not self._stopping
          and all(self._ended.get(i) == "ok" for i in replicas)):
        self._stopping = True
        for i, c in self._conns.items():
          if self._is_ps[i] and i not in self._ended:
            with contextlib.suppress(OSError):
              _send(c, {"stop": "every replica finished"})
      if len(self._ended) == self._n:
        self.finished.set()

  def _abort_locked(self, why):
    if self._aborted is not None:
      return
    self._aborted = why
    for i, c in self._conns.items():
      if i not in self._ended:
        with contextlib.suppress(OSError):
          _send(c, {"abort": why})

  def close(self):
    with contextlib.suppress(OSError):
      self._sock.close()
    _ports.release_port(self.port)


def _close(sock, lines):
  """Closes a line for good: its file object holds the socket open."""
  with contextlib.suppress(OSError):
    sock.shutdown(socket.SHUT_RDWR)
  with contextlib.suppress(OSError):
    lines.close()
  with contextlib.suppress(OSError):
    sock.close()


class Client:
  """One wrapper's line to the service."""

  def __init__(self, sock):
    self._sock = sock
    self._lines = sock.makefile("r", encoding="utf-8")

  @classmethod
  def connect(cls, host, step_key, slot, address, *, timeout):
    """Finds the step's service on ``host`` and says hello.

    Raises:
      RendezvousError: No service of this step answered within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    seen = "nothing listening"
    while time.monotonic() < deadline:
      for port in candidate_ports(step_key):
        try:
          sock = socket.create_connection((host, port), timeout=HELLO_SECS)
        except OSError as e:
          seen = "%s:%d: %s" % (host, port, e.strerror or e)
          continue
        client = cls(sock)
        try:
          _send(sock, {"hello": step_key, "slot": slot, "address": address})
          if client.receive().get("welcome"):
            sock.settimeout(None)
            return client
        except (OSError, ValueError):
          pass  # Silent past HELLO_SECS, or not our protocol.
        seen = "%s:%d answered, but not for this step" % (host, port)
        client.close()
      time.sleep(RETRY_SECS)
    raise RendezvousError(
        "found no meeting point of step %s on %s within %.0f s (last: %s); "
        "is the step's first task running there?" % (step_key, host, timeout,
                                                     seen))

  def receive(self):
    """The next message; {} once the service has closed the line."""
    line = self._lines.readline()
    return json.loads(line) if line else {}

  def settimeout(self, seconds):
    self._sock.settimeout(seconds)

  def send_exit(self, how):
    with contextlib.suppress(OSError):
      _send(self._sock, {"exit": how})

  def close(self):
    _close(self._sock, self._lines)
