"""The launcher's confinement: the cluster's ports are closed to the outside.

Run through tools/launch, the checkout's wrapper of sync-replicas-launch (the
path the demo takes; tests/test_launcher.py runs the module itself).

A confined launch runs every task in a private network namespace with only
loopback. These tests look from outside (this test process) and from inside
(``tools/launch --enter PID``): the port listens inside, a connection from
outside fails, nothing listens on it in our namespace. The same is checked
for the path an ordinary user's launch takes, a user namespace of its own
around the network one (as root, the test runs that launch as another uid
through setpriv), with --enter joining both from the same user and from
root, and refused to another user. Every process group is killed in a
finally block.

The demo's own launch, confined, and the status command it prints, run from
outside as printed, are test_examples' (its demo run also serves the digits
example's test there).
"""

import contextlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

import support
from sync_replicas.cli import launch

# Version-independent (tests/conftest.py): the launcher's confinement imports
# no TensorFlow, and the programs its tasks run are tested under every
# TensorFlow elsewhere: CI runs this file under its newest only.
pytestmark = pytest.mark.version_independent

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "tools" / "launch"

# A ps that only listens, as TensorFlow's server does (0.0.0.0), and replicas
# that sleep: no TensorFlow, so the launch is up in a second.
_LISTENER = r"""
import json, os, socket, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
print("interfaces", sorted(name for _, name in socket.if_nameindex()),
      flush=True)
print("ids", os.getuid(), os.getgid(), flush=True)
if task["type"] == "ps":
  sock = socket.socket()
  sock.bind(("0.0.0.0", 2222))
  sock.listen()
  print("listening", flush=True)
time.sleep(float(os.environ["SLEEP"]))
"""


def _env(**extra):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
             **extra)
  env.pop("TF_CONFIG", None)
  env.pop("SYNC_REPLICAS_UNCONFINED", None)
  # The demo's `python` is the one running these tests.
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
  return env


#: Run inside a namespace: connects to the confined ps.
_CONNECT = ("import socket; socket.create_connection(('127.0.0.1', 2222), "
            "timeout=2); print('connected')")


@pytest.mark.timeout(60)

def _assert_served_only_inside(ps_pid):
  """ps0's port 2222 listens in its own namespace and nowhere the test sees."""
  assert support.listens(2222, ps_pid), (
      "ps0 does not listen in its namespace")
  assert not support.listens(2222), (
      "port 2222 listens in the test's namespace")
  assert not support.connects(2222), (
      "port 2222 accepted a connection from outside")

def test_confined_port_is_reachable_inside_and_closed_outside(tmp_path):
  if support.listens(2222):
    pytest.skip("something on this machine already listens on 2222, which "
                "would make 'closed outside' untestable here")
  proc = subprocess.Popen(
      [sys.executable, str(LAUNCH), "--ps", "1", "--workers", "1", "--",
       sys.executable, "-c", _LISTENER], cwd=ROOT, env=_env(SLEEP="20"),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
  try:
    output = support.OutputLines(proc.stdout)
    pid = int(output.find(r"--enter (\d+)", "the launch's --enter line",
                          timeout=20).group(1))
    assert pid == proc.pid
    output.find(r"\[ps0\] listening", "ps0 listening", timeout=20)
    ps_pid = int(output.find(r"started ps0 \(pid (\d+)\)", "ps0's pid",
                             timeout=5).group(1))
    _assert_served_only_inside(ps_pid)
    # How sync-replicas-status finds the launch to enter. Other confined
    # launches of this machine may serve 2222 too, each in its namespace.
    assert pid in launch.confined_launches(port=2222)
    assert pid not in launch.confined_launches(port=2223)
    inode = os.stat("/proc/%d/ns/net" % pid).st_ino
    assert launch.confined_launches(namespace=inode) == [pid]
    for task in ("ps0", "chief0"):
      output.find(r"\[%s\] interfaces \['lo'\]\n" % task,
                  "%s seeing only lo" % task, timeout=20)
    inside = subprocess.run(
        [sys.executable, str(LAUNCH), "--enter", str(pid), "--",
         sys.executable, "-c", _CONNECT], cwd=ROOT, capture_output=True,
        text=True, timeout=20)
    assert inside.returncode == 0 and "connected" in inside.stdout, inside
  finally:
    support.kill_group(proc)
  output.finish()


#: As root, the test runs the launch as this ordinary user and tries --enter
#: as another one. setpriv takes any uid; neither needs an entry in
#: /etc/passwd. Not nobody (65534): that is also the id an unmapped user
#: gets inside a user namespace, which would hide a missing id map.
ORDINARY_UID = 54321
OTHER_UID = 54322


def _as_user(uid):
  """The argv prefix that runs a command as ``uid``, in no other group.

  Changing every uid from 0 drops all capabilities, so the command is an
  ordinary user's: _confine's root path (a bare network namespace) is not
  open to it.
  """
  return ["setpriv", "--reuid=%d" % uid, "--regid=%d" % uid,
          "--clear-groups", "--"]


def _ns(pid, kind):
  return os.stat("/proc/%s/ns/%s" % (pid, kind)).st_ino


def _real_uid(pid):
  with open("/proc/%d/status" % pid) as f:
    return int(next(l for l in f if l.startswith("Uid:")).split()[1])


@contextlib.contextmanager
def _readable_copy(prefix):
  """A copy of the launcher and the package in a new temporary directory
  that every user may read (and enter): pytest's tmp_path and the checkout
  may lie under a directory only their owner may enter."""
  with tempfile.TemporaryDirectory(prefix=prefix) as copy:
    copy = pathlib.Path(copy)
    for folder in ("tools", "sync_replicas"):
      shutil.copytree(ROOT / folder, copy / folder,
                      ignore=shutil.ignore_patterns("__pycache__"))
    for path in [copy, *copy.rglob("*")]:
      path.chmod(path.stat().st_mode | 0o444 | (0o111 if path.is_dir() else 0))
    yield copy


def _ordinary_user(copy):
  """(argv prefix, a Python it may run) for an ordinary user's launch.

  Skips, saying why, only where this machine cannot give an ordinary user
  a user namespace with a network namespace in it, or cannot run one at
  all. ``copy`` holds the launcher's files, readable by anyone.
  """
  if os.geteuid() != 0:
    # This process is the ordinary user: the other tests here already take
    # the same path; this one checks it explicitly.
    return [], sys.executable
  if not support.is_machine_root():
    pytest.skip("this process is uid 0 of a user namespace (as under "
                "unshare -r), which maps no other user to become")
  if shutil.which("setpriv") is None:
    pytest.skip("no setpriv (util-linux) to run the launch as an ordinary "
                "user; as root, the other tests here cover the root path")
  prefix = _as_user(ORDINARY_UID)  # Its gid is the same number.
  # An interpreter under /root (pyenv's, and so the venv's) is closed to
  # other users; the launcher needs only the standard library. The probe
  # asks what the launch does of its command (shutil.which): here the
  # kernel once ran a pyenv binary under /root for nobody, with the
  # system's libpython, while which() rightly said it is no program of
  # nobody's.
  tried = []
  for python in dict.fromkeys([sys.executable,
                               shutil.which("python3", path=os.defpath)]):
    if python is None:
      continue
    probe = subprocess.run(
        prefix + [python, "-c", "import shutil, sys; open(%r).close(); "
                  "sys.exit('not a program of this user' if shutil.which(%r) "
                  "is None else 0)" % (str(copy / "tools" / "launch"),
                                       python)],
        capture_output=True, text=True, timeout=30)
    if probe.returncode == 0:
      break
    tried.append("%s: %s" % (python, probe.stderr.strip()[-200:]))
  else:
    pytest.skip("no Python interpreter that uid %d may run (%s)"
                % (ORDINARY_UID, "; ".join(tried)))
  # The platform's own verdict, independent of sync_replicas/cli/_confine.py: util-
  # linux's unshare makes the same two namespaces in one call, as _confine
  # does. max_user_namespaces=0, Debian's unprivileged_userns_clone=0,
  # Ubuntu's AppArmor restriction or a container's seccomp profile refuse
  # it; tools/launch then stops with one line (tested above).
  try:
    with open("/proc/sys/user/max_user_namespaces") as f:
      if int(f.read()) == 0:
        pytest.skip("user namespaces are disabled here "
                    "(/proc/sys/user/max_user_namespaces is 0)")
  except OSError:
    pass
  if shutil.which("unshare") is not None:
    probe = subprocess.run(prefix + ["unshare", "--user", "--net", "true"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
      pytest.skip("this machine gives an ordinary user no user namespace "
                  "(unshare --user --net as uid %d: %s)"
                  % (ORDINARY_UID, probe.stderr.strip()))
  return prefix, python


def _stop(proc):
  """SIGTERM (the launcher then stops its tasks), then SIGKILL its group."""
  if proc.returncode is None:
    proc.terminate()
    try:
      proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
      pass
  support.kill_group(proc)


@pytest.mark.timeout(120)
def test_an_ordinary_users_launch_is_confined_in_a_user_namespace():
  # The path of every launch by a user other than root: unshare(CLONE_NEWUSER
  # | CLONE_NEWNET), the uid and gid mapped to themselves, lo brought up
  # with the capability the user namespace grants; and --enter joining the
  # user namespace before the network one.
  if support.listens(2222):
    pytest.skip("something on this machine already listens on 2222, which "
                "would make 'closed outside' untestable here")
  # The ordinary user must read the launcher and the modules it loads by
  # path. pytest's tmp_path lies under a directory only its owner may enter,
  # and so may the checkout: a copy in a directory of this test's own.
  with _readable_copy("sync_replicas_confine_") as copy:
    prefix, python = _ordinary_user(copy)
    uid = ORDINARY_UID if prefix else os.getuid()
    gid = ORDINARY_UID if prefix else os.getgid()
    launch = str(copy / "tools" / "launch")
    proc = subprocess.Popen(
        prefix + [python, launch, "--ps", "1", "--workers", "1", "--",
                  python, "-c", _LISTENER], cwd=copy, env=_env(SLEEP="60"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
      output = support.OutputLines(proc.stdout)
      confined = output.find(r"confined to a private (.+?) with only "
                             r"loopback.*--enter (\d+)", "the launch's "
                             "confined line", timeout=30)
      assert confined.group(1) == "user and network namespace", (
          output.text())
      pid = int(confined.group(2))
      assert pid == proc.pid
      output.find(r"\[ps0\] listening", "ps0 listening", timeout=30)
      ps_pid = int(output.find(r"started ps0 \(pid (\d+)\)", "ps0's pid",
                               timeout=5).group(1))
      for task in ("ps0", "chief0"):
        output.find(r"\[%s\] interfaces \['lo'\]\n" % task,
                    "%s seeing only lo" % task, timeout=30)
      # Namespaces of its own, and still the user's processes: its uid and
      # gid are mapped to themselves, so it sees its own ids inside.
      assert _ns(ps_pid, "user") != _ns("self", "user")
      assert _ns(ps_pid, "net") != _ns("self", "net")
      assert _real_uid(pid) == _real_uid(ps_pid) == uid
      for task in ("ps0", "chief0"):
        output.find(r"\[%s\] ids %d %d\n" % (task, uid, gid),
                    "%s's own uid and gid inside" % task, timeout=30)
      _assert_served_only_inside(ps_pid)
      enter = [launch, "--enter", str(pid), "--"]
      inside = subprocess.run(prefix + [python, *enter, python, "-c",
                                        _CONNECT], cwd=copy,
                              capture_output=True, text=True, timeout=30)
      assert inside.returncode == 0 and "connected" in inside.stdout, inside
      if prefix:
        # docs/security.md: root can enter it too, another user cannot.
        as_root = subprocess.run(
            [sys.executable, *enter, sys.executable, "-c", _CONNECT],
            cwd=copy, capture_output=True, text=True, timeout=30)
        assert as_root.returncode == 0 and "connected" in as_root.stdout, (
            as_root)
        other = subprocess.run(
            _as_user(OTHER_UID) + [python, *enter, python, "-c", _CONNECT],
            cwd=copy, capture_output=True, text=True, timeout=30)
        assert other.returncode == 2, other
        assert ("cannot enter the namespace of launch %d" % pid
                in other.stderr), other
        assert "connected" not in other.stdout
    finally:
      _stop(proc)
    output.finish()


@pytest.mark.timeout(60)
def test_enter_refuses_a_pid_that_is_no_confined_launch(tmp_path):
  not_launch = subprocess.run(
      [sys.executable, str(LAUNCH), "--enter", str(os.getpid()), "--",
       "true"], cwd=ROOT, capture_output=True, text=True, timeout=20)
  assert not_launch.returncode == 2
  assert "process %d is not sync-replicas-launch" % os.getpid() in not_launch.stderr
  proc = subprocess.Popen(
      [sys.executable, str(LAUNCH), "--unconfined", "--ps", "0", "--workers",
       "1", "--", sys.executable, "-c", "import time; time.sleep(20)"],
      cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      start_new_session=True)
  try:
    output = support.OutputLines(proc.stdout)
    output.find(r"started chief0", "the chief started", timeout=20)
    assert "unconfined: every task's port listens on all" in output.text()
    shared = subprocess.run(
        [sys.executable, str(LAUNCH), "--enter", str(proc.pid), "--", "true"],
        cwd=ROOT, capture_output=True, text=True, timeout=20)
  finally:
    support.kill_group(proc)
  output.finish()
  assert shared.returncode == 2
  assert "shares this network namespace" in shared.stderr
  assert "run the command without --enter" in shared.stderr


def test_launch_that_cannot_confine_says_so_in_one_line_and_starts_nothing():
  # A real condition under which no namespace can be made: a thread already
  # runs (unshare would confine that thread alone).
  code = ("import runpy, sys, threading, time; threading.Thread("
          "target=time.sleep, args=(5,), daemon=True).start(); sys.argv = ["
          "'launch', '--workers', '1', '--', 'true']; runpy.run_path(%r, "
          "run_name='__main__')" % str(LAUNCH))
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=30)
  assert proc.returncode == 2, proc
  assert proc.stderr.count("\n") == 1, proc.stderr
  assert proc.stderr.startswith(
      "sync-replicas-launch: cannot confine the cluster to a private "
      "network namespace (the process already runs 2 threads"), proc.stderr
  assert "rerun with --unconfined (or SYNC_REPLICAS_UNCONFINED=1)" in (
      proc.stderr)
  assert "started" not in proc.stdout


@pytest.mark.timeout(120)
def test_an_ordinary_users_hosts_launch_builds_its_hosts_in_its_user_namespace():
  # --hosts as an ordinary user: the user mapped to root in the launch's
  # user namespace (as unshare -r), so that ip and tc may build the bridge,
  # the hosts and their shaped links there; each task on its own address.
  with _readable_copy("sync_replicas_hosts_") as copy:
    prefix, python = _ordinary_user(copy)
    proc = subprocess.run(
        prefix + [python, str(copy / "tools" / "launch"), "--hosts", "2",
                  "--link-rate", "100mbit", "--ps", "1", "--workers", "1",
                  "--", "sh", "-c", "id -u; ip -o -4 addr show dev eth0"],
        cwd=copy, env=_env(), capture_output=True, text=True, timeout=90)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "confined to a private user and network namespace with only " \
      "loopback and the emulated hosts" in proc.stdout, proc.stdout
  addresses = re.findall(r"^\[(?:ps0|chief0)\] \d+: eth0\s+inet ([\d.]+)/24",
                         proc.stdout, re.M)
  assert len(set(addresses)) == 2, proc.stdout
  for task in ("ps0", "chief0"):
    assert "[%s] 0\n" % task in proc.stdout, proc.stdout
