"""Emulated hosts: one network namespace per host, on one bridge.

Owns making N hosts on this machine, each a network namespace of its own
with its own address on a shared bridge, joined to it by a veth link that
``tc``'s token bucket filter (``tbf``) may shape to a rate both ways; running
a command on a host; cutting a host's link and mending it; removing it all;
and the private mount namespace that keeps ``ip netns``'s state (the
namespace files under /run/netns, an /etc/hosts naming the hosts) out of
the machine's sight.

Why: a cluster whose tasks all share 127.0.0.1 never shows what its links
cost. On emulated hosts every task has an address of its own and every byte
it sends or receives crosses its host's link, at the rate that link is
shaped to (``tbf``: the kernel here has no ``netem``). The launcher
(``sync-replicas-launch --hosts``) builds them inside its own confined
namespace, so nothing routes out: the bridge and the links live there, with
no default route and no link to the machine's network. tools/soak builds
them in the machine's namespace to cut tasks off.

Linux and root (or a user namespace's root) only; standard library plus the
``ip`` and ``tc`` commands of iproute2.
"""

import ctypes
import os
import re
import shutil
import subprocess

#: The port every task's server uses on its host: each host is a machine of
#: its own, as on Kubernetes, so no port needs to differ between hosts.
PORT = 2222
#: Where ``ip netns`` keeps its namespace files (iproute2's NETNS_RUN_DIR).
NETNS_DIR = "/run/netns"
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE, _MS_BIND = 0x4000, 1 << 18, 0x1000
_RATE = re.compile(r"(\d+(\.\d+)?)([kmgt]?)(bit|bps)", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


class CannotEmulate(Exception):
  """The platform (commands, permissions, kernel) cannot make the hosts."""


def rate_bits(rate):
  """Bits per second of a ``tc`` rate (``200mbit``, ``1gbit``, ``10mbps``).

  Raises:
    ValueError: For anything else, saying what is accepted.
  """
  match = _RATE.fullmatch(rate.strip())
  if not match or float(match.group(1)) <= 0:
    raise ValueError(
        "a link rate is a positive number and a unit as tc writes it: "
        "kbit, mbit, gbit (bits per second) or kbps, mbps, gbps (bytes), "
        "e.g. 200mbit or 1gbit; got %r" % rate)
  bits = float(match.group(1)) * _SCALE[match.group(3).lower()]
  return bits * 8 if match.group(4).lower() == "bps" else bits


def check_commands():
  """Raises CannotEmulate unless ``ip`` and ``tc`` are on PATH."""
  missing = [c for c in ("ip", "tc") if shutil.which(c) is None]
  if missing:
    raise CannotEmulate(
        "%s not found on PATH: install iproute2 (apt-get install iproute2)"
        % " and ".join(missing))


def _call(what, result):
  if result != 0:
    raise CannotEmulate("%s: %s" % (what, os.strerror(ctypes.get_errno())))


def private_mounts():
  """Moves this process into a mount namespace of its own for ``ip netns``.

  Its mounts stop propagating to the machine; a tmpfs on /run/netns then
  holds the namespace files that ``ip netns add`` makes (and the hosts file
  of ``name_hosts``). All of it vanishes with the last process of the
  namespace, however it ends. Must run before the process starts a thread
  (``unshare(CLONE_NEWNS)`` refuses a process whose threads share its file
  system information).

  Raises:
    CannotEmulate: With the reason.
  """
  libc = ctypes.CDLL(None, use_errno=True)
  _call("unshare(CLONE_NEWNS)", libc.unshare(_CLONE_NEWNS))
  _call("making / private",
        libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None))
  # The directory iproute2 itself makes on first use; left in place (empty
  # for the machine: what fills it is our tmpfs, seen only in here).
  try:
    os.makedirs(NETNS_DIR, exist_ok=True)
  except OSError:
    # Not ours to make (an ordinary user's launch, on a machine where no
    # ip netns ever ran): a tmpfs over all of /run, in here only, holds it.
    _call("mounting a tmpfs on /run (no %s, and no right to make it)"
          % NETNS_DIR, libc.mount(b"tmpfs", b"/run", b"tmpfs", 0, b"mode=755"))
    os.makedirs(NETNS_DIR)
  _call("mounting a tmpfs on " + NETNS_DIR,
        libc.mount(b"tmpfs", NETNS_DIR.encode(), b"tmpfs", 0, b"mode=755"))


def name_hosts(text):
  """Binds ``text`` over /etc/hosts for this mount namespace (made by
  ``private_mounts``) and every process started in it afterwards: names
  resolve to emulated hosts as a cluster's DNS would resolve them.

  Raises:
    CannotEmulate: With the reason.
  """
  path = os.path.join(NETNS_DIR, ".hosts")
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  libc = ctypes.CDLL(None, use_errno=True)
  _call("binding the hosts' names over /etc/hosts",
        libc.mount(path.encode(), b"/etc/hosts", None, _MS_BIND, None))


def ip(*argv, check=True):
  """Runs ``ip ARGV`` (bounded); returns its output."""
  return _run("ip", argv, check)


def tc(*argv, check=True):
  """Runs ``tc ARGV`` (bounded); returns its output."""
  return _run("tc", argv, check)


def _run(tool, argv, check):
  try:
    proc = subprocess.run([tool, *argv], capture_output=True, text=True,
                          timeout=30, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise CannotEmulate("%s %s: %s" % (tool, " ".join(argv), e)) from e
  if check and proc.returncode != 0:
    raise CannotEmulate("%s %s failed (exit code %d): %s" % (
        tool, " ".join(argv), proc.returncode, proc.stderr.strip()))
  return proc.stdout


class Hosts:
  """N emulated hosts on one bridge, each with its address and its link.

  The bridge, with the address ``.254`` of the hosts' /24 (where tools in
  the building namespace reach the hosts from), and one end of every host's
  veth link (``links``) live in the namespace that builds them; the other
  end, ``eth0`` with the host's address (``.1`` for host 0, ...), in the
  host's namespace, as on a machine of its own.
  Cutting a host takes its link's bridge end down: its processes live on,
  unreachable, as behind a failed switch port.

  Attributes:
    names: The hosts' network namespaces (``ip netns`` names), in order.
    addresses: The hosts' IPv4 addresses, in order.
    bridge: The bridge's interface name.
    links: The bridge end of every host's link, in order: what ``cut``
      takes down (``ip link set LINK down`` does the same).
    bridge_address: The building namespace's address on the bridge.
    rate: The links' ``tc`` rate, or None (unshaped).
  """

  def __init__(self, count, *, rate=None, prefix="host", bridge="hosts",
               link_prefix="host"):
    """Builds the hosts; on any failure removes what it made and raises.

    Args:
      count: How many hosts.
      rate: Every link's rate both ways, as ``tc`` writes it (``200mbit``),
        or None to leave the links unshaped.
      prefix: The hosts' namespace names are this and their number: unique
        on the machine unless built in a mount namespace of one's own
        (``private_mounts``).
      bridge: The bridge's interface name.
      link_prefix: The links' interface names are this and the host's
        number. The bridge's and the links' names must be unique in the
        building namespace (the machine's, unless built in a network
        namespace of one's own) and at most 15 characters with an ``h``
        added.

    Raises:
      CannotEmulate: With the reason.
    """
    if count < 1:
      raise ValueError("need at least one host, got %d" % count)
    if count > 250:
      raise ValueError("at most 250 hosts fit the hosts' /24, got %d" % count)
    if rate is not None:
      rate_bits(rate)
    check_commands()
    self.rate = rate
    self.names = ["%s%d" % (prefix, i) for i in range(count)]
    self.bridge = bridge
    self.links = ["%s%d" % (link_prefix, i) for i in range(count)]
    too_long = [n for n in [bridge] + self.links if len(n) > 14]
    if too_long:
      raise ValueError("interface names have at most 15 characters, and "
                       "the links get an h added: %s" % ", ".join(too_long))
    self._made = []
    try:
      subnet = self._free_subnet()
      self.addresses = ["%s.%d" % (subnet, i + 1) for i in range(count)]
      self.bridge_address = subnet + ".254"
      ip("link", "add", self.bridge, "type", "bridge")
      self._made.append(("link", self.bridge))
      ip("addr", "add", self.bridge_address + "/24", "dev", self.bridge)
      ip("link", "set", self.bridge, "up")
      for name, link, address in zip(self.names, self.links, self.addresses,
                                     strict=True):
        self._add_host(name, link, address)
    except BaseException:
      self.close()
      raise

  def _add_host(self, name, link, address):
    ip("netns", "add", name)
    self._made.append(("netns", name))
    # The host's end gets a name unique here, then eth0 in its namespace.
    ip("link", "add", link, "type", "veth", "peer", "name", link + "h")
    self._made.append(("link", link))
    ip("link", "set", link + "h", "netns", name)
    ip("-n", name, "link", "set", link + "h", "name", "eth0")
    inner = "eth0"
    ip("link", "set", link, "master", self.bridge)
    ip("link", "set", link, "up")
    ip("-n", name, "link", "set", "lo", "up")
    ip("-n", name, "addr", "add", address + "/24", "dev", inner)
    ip("-n", name, "link", "set", inner, "up")
    if self.rate is not None:
      # Both ways: what the host sends leaves through its end (egress of
      # inner), what it receives leaves the bridge through the other.
      shape = _tbf(self.rate)
      tc("qdisc", "add", "dev", link, "root", *shape)
      ip("netns", "exec", name, "tc", "qdisc", "add", "dev", inner, "root",
         *shape)

  @staticmethod
  def _free_subnet():
    """A 10.231.x.0/24 that no interface of this namespace uses."""
    used = ip("-4", "-o", "addr")
    for x in list(range(os.getpid() % 200, 256)) + list(range(0, 200)):
      subnet = "10.231.%d" % x
      if subnet + "." not in used:
        return subnet
    raise CannotEmulate("every 10.231.x.0/24 is in use in this network "
                        "namespace; remove stale bridges (ip link show type "
                        "bridge)")

  def command(self, host, argv):
    """``argv`` run on host number ``host`` (its network namespace)."""
    return ["ip", "netns", "exec", self.names[host], *argv]

  def cut(self, host):
    """Takes host ``host``'s link down: nothing reaches it or leaves it."""
    ip("link", "set", self.links[host], "down")

  def mend(self, host):
    """Brings host ``host``'s link up again."""
    ip("link", "set", self.links[host], "up")

  def close(self):
    """Removes every namespace and link made, newest first; bounded."""
    for kind, name in reversed(self._made):
      if kind == "netns":
        ip("netns", "del", name, check=False)
      else:
        ip("link", "del", name, check=False)
    self._made = []


def _tbf(rate):
  """tbf's arguments for ``rate``: a bucket of 5 ms at the rate (at least
  64 KiB, a veth's largest segment: a packet larger than the bucket never
  passes), and a queue of at most 50 ms before packets drop, as a switch's
  buffer would."""
  burst = max(int(rate_bits(rate) / 8 * 0.005), 65536)
  return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
