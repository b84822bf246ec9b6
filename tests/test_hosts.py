"""sync-replicas-launch --hosts: the tasks on emulated hosts, each its own address.

Every task runs in a network namespace of its own (an emulated host) with its
own address on a bridge, inside the launch's confined namespace
(sync_replicas/cli/_hosts.py). These tests check from inside (the tasks, and
``--enter PID``) that nothing routes out and that the links are shaped, then
train every driving mode across hosts: MonitoredTrainingSession
(examples.digits, read live by sync-replicas-status from outside), a
Supervisor (examples.digits_supervisor), an Estimator on 2.15
(examples.digits_estimator) and an unchanged TF1 script under
sync-replicas-run; and survive a host's link cut for seconds and mended, as
tools/soak's cuts are. Every process group is killed in a finally block.
"""

import contextlib
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import pytest

from examples import digits_estimator
import support

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Where the launches run: ``python -m`` puts its working directory first on
#: the path, so under tools/knockout that is its patched copy (of the package
#: and the examples), which the launcher and its tasks must import.
CWD = pathlib.Path(os.environ.get("SYNC_REPLICAS_KNOCKOUT_COPY") or ROOT)
LAUNCH = [sys.executable, "-m", "sync_replicas.cli.launch"]
BIN = pathlib.Path(sys.executable).parent
HAS_ESTIMATOR = digits_estimator.estimator_module() is not None
_FINAL = re.compile(r"final test accuracy (\d\.\d+)")
#: How long the cut-link test keeps the ps's host cut off.
CUT_SECS = 5.0
#: The cut-link test's step limit (its comment says why so many).
CUT_LINK_STEPS = 150

pytestmark = pytest.mark.skipif(
    not support.is_machine_root(),
    reason="emulated hosts need the machine's root here: /run/netns and "
    "/etc/hosts are mounted over in the launch's own mount namespace")


def _env(**extra):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
             **extra)
  for name in ("TF_CONFIG", "SYNC_REPLICAS_UNCONFINED",
               "SYNC_REPLICAS_BACKUPS"):
    env.pop(name, None)
  # The tasks' `python` is the one running these tests.
  env["PATH"] = str(BIN) + os.pathsep + env["PATH"]
  return env


def _start(args, env=None):
  return subprocess.Popen(
      [*LAUNCH, *args], cwd=CWD, env=env or _env(), stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, start_new_session=True)


def _launch(args, *, timeout, env=None):
  """Runs a launch to its end; returns its output, checks exit code 0."""
  proc = _start(["--timeout", str(timeout), *args], env)
  try:
    out, _ = proc.communicate(timeout=timeout + 30)
  finally:
    support.kill_group(proc)
  out = out.decode(errors="replace")
  assert proc.returncode == 0, "launcher exited %d:\n%s" % (
      proc.returncode, out[-6000:])
  return out


def _cluster(out):
  return json.loads(re.search(r"\[launch\] cluster (\{.*\})\n", out).group(1))


def _addresses(cluster):
  return [a.rsplit(":", 1)[0] for tasks in cluster.values() for a in tasks]


def _final_accuracy(out):
  found = _FINAL.findall(out)
  assert len(found) == 1, "expected one final accuracy line:\n" + out[-6000:]
  return float(found[0])


# ps0 counts what arrives on its port for a while; chief0 sends to it for
# SEND_SECS, then tries the test's listener (LISTENER, on an address of the
# launching namespace), and ends once the file LOOKED exists (at most 60 s
# later). Each prints its routes and links. No TensorFlow.
_PROBE = r"""
import errno, json, os, socket, subprocess, time
config = json.loads(os.environ["TF_CONFIG"])
task = config["task"]
def sh(*argv):
  return subprocess.run(argv, capture_output=True, text=True,
                        timeout=30).stdout
print("links", sorted(n for _, n in socket.if_nameindex()), flush=True)
print("routes", json.dumps(sh("ip", "route").splitlines()), flush=True)
if task["type"] == "ps":
  server = socket.socket()
  server.bind(("0.0.0.0", 2222))
  server.listen()
  print("listening", flush=True)
  conn, peer = server.accept()
  total, start = 0, None
  while True:
    data = conn.recv(1 << 20)
    if not data:
      break
    start = start or time.monotonic()
    total += len(data)
  print("received %d bits in %.3f s from %s" % (
      total * 8, time.monotonic() - start, peer[0]), flush=True)
  conn.sendall(b"counted")  # The chief ends (and the launch) only now.
else:
  ps = config["cluster"]["ps"][0].rsplit(":", 1)[0]
  for attempt in range(300):
    try:
      sock = socket.create_connection((ps, 2222), timeout=5)
      break
    except OSError:
      time.sleep(0.1)
  chunk, end = b"x" * 65536, time.monotonic() + float(os.environ["SEND_SECS"])
  while time.monotonic() < end:
    sock.sendall(chunk)
  sock.shutdown(socket.SHUT_WR)
  sock.settimeout(30)
  assert sock.recv(16) == b"counted"
  sock.close()
  host, port = os.environ["LISTENER"].rsplit(":", 1)
  try:
    socket.create_connection((host, int(port)), timeout=5).close()
    print("outside: connected", flush=True)
  except OSError as e:
    print("outside: %s" % errno.errorcode.get(e.errno, e), flush=True)
  # The launch (its hosts) lives until the test has looked inside.
  end = time.monotonic() + 60
  while not os.path.exists(os.environ["LOOKED"]) and time.monotonic() < end:
    time.sleep(0.05)
"""


def _own_address():
  """An IPv4 address of this namespace that is not loopback, or None."""
  text = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True,
                        text=True, timeout=30, check=True).stdout
  found = re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", text)
  return next((a for a in found if not a.startswith("127.")), None)


# The launcher's hosts, with tasks that import no TensorFlow (these three
# tests): CI runs them under its newest TensorFlow only (docs/testing.md).
@pytest.mark.version_independent
@pytest.mark.timeout(120)
def test_nothing_routes_out_of_the_hosts_and_links_are_shaped(tmp_path):
  own = _own_address()
  if own is None:
    pytest.skip("this namespace has no address but loopback to try")
  before = socket.if_nameindex()
  with _listening(own) as listener:
    proc = _start(["--hosts", "2", "--link-rate", "20mbit", "--ps", "1",
                   "--workers", "1", "--timeout", "90", "--", sys.executable,
                   "-c", _PROBE],
                  _env(SEND_SECS="1.5", LISTENER="%s:%d" % (own, listener),
                       LOOKED=str(tmp_path / "looked")))
    try:
      output = support.OutputLines(proc.stdout)
      pid = int(output.find(r"--enter (\d+)", "the launch's --enter line",
                            timeout=20).group(1))
      output.find(r"\[ps0\] listening", "ps0 listening", timeout=30)

      def inside(*argv):
        return subprocess.run(
            [*LAUNCH, "--enter", str(pid), "--", *argv], cwd=CWD,
            env=_env(), capture_output=True, text=True, timeout=30,
            check=True).stdout

      during = socket.if_nameindex()
      launch_links = inside("ip", "-o", "link")
      launch_routes = inside("ip", "route")
      qdiscs = inside("tc", "qdisc", "show")
      # Until now the chief waited: a launch that ended meanwhile would have
      # removed its hosts while --enter could still join its namespace.
      (tmp_path / "looked").touch()
      proc.wait(timeout=90)
    finally:
      support.kill_group(proc)
  text = output.finish()
  assert proc.returncode == 0, text
  cluster = _cluster(text)
  ps, chief = cluster["ps"][0], cluster["chief"][0]
  assert ps.endswith(":2222") and chief.endswith(":2222"), cluster
  assert ps.rsplit(":")[0] != chief.rsplit(":")[0], cluster
  # Each host: loopback and its one link, and one route, to the hosts'
  # subnet (no default route: nothing else is reachable).
  for task in ("ps0", "chief0"):
    assert "[%s] links ['eth0', 'lo']\n" % task in text, text
    routes = json.loads(re.search(r"\[%s\] routes (.*)\n" % task,
                                  text).group(1))
    assert len(routes) == 1 and routes[0].startswith("10.231."), routes
    assert " dev eth0 " in routes[0], routes
  assert "[chief0] outside: ENETUNREACH" in text, text
  # Nothing of the launch's was added to the launching namespace: no link
  # reaches it. (The machine's namespace: other tests and tools add and
  # remove their own links meanwhile, e.g. test_recovery's 18 hosts.)
  added = {n for _, n in during} - {n for _, n in before}
  names = re.findall(r"^\d+: ([^:@]+)[:@]", launch_links, re.M)
  assert not added & {*names, *(n + "h" for n in names)}, (added, names)
  # The launch's namespace: loopback, the bridge and one link per host,
  # each one's other end in a host's namespace, and no default route.
  assert sorted(names) == ["host0", "host1", "hosts", "lo"], launch_links
  for host in ("host0", "host1"):
    line = next(l for l in launch_links.splitlines()
                if re.match(r"\d+: %s@" % host, l))
    assert "master hosts" in line and "link-netns %s" % host in line, line
  assert "default" not in launch_routes, launch_routes
  assert launch_routes.strip().startswith("10.231."), launch_routes
  # Both ends of each link shaped (the hosts' ends are in their namespaces,
  # checked by the rate below); the rate caps what ps0 received.
  shaped = re.findall(r"qdisc tbf \S+: dev (host\d) root .*rate 20Mbit",
                      qdiscs)
  assert sorted(shaped) == ["host0", "host1"], qdiscs
  bits, secs = map(float, re.search(
      r"\[ps0\] received (\d+) bits in ([\d.]+) s from (\S+)\n",
      text).groups()[:2])
  # The bucket (5 ms of the rate, at least 64 KiB) may pass at once.
  assert bits / secs < 20e6 * 1.1 + 65536 * 8 / secs, (bits, secs)
  assert bits / secs > 20e6 * 0.3, (bits, secs)


@contextlib.contextmanager
def _listening(address):
  """A TCP listener on ``address`` of this namespace; yields its port."""
  with socket.socket() as sock:
    sock.bind((address, 0))
    sock.listen()
    yield sock.getsockname()[1]


@pytest.mark.version_independent
@pytest.mark.parametrize("argv, said", [
    (["--link-rate", "1gbit"], "--link-rate and --place shape and place "
     "emulated hosts: give --hosts N too"),
    (["--hosts", "2", "--link-rate", "fast"], "--link-rate: a link rate is "
     "a positive number and a unit as tc writes it"),
    (["--hosts", "2", "--place", "0,1"], "--place needs one host number per "
     "task (3: --ps 1, then --workers 2), got 2"),
    (["--hosts", "2", "--place", "0,1,2"], "--place numbers hosts 0 to 1 "
     "(--hosts 2), got 2"),
    (["--hosts", "2", "--unconfined"], "--hosts builds its hosts inside the "
     "launch's own namespace and cannot run --unconfined"),
    (["--hosts", "0"], "--hosts must be in [1, 250], got 0"),
], ids=["rate-without-hosts", "bad-rate", "place-too-short",
        "place-off-hosts", "unconfined", "no-hosts"])
def test_bad_hosts_arguments_are_one_line_and_start_nothing(argv, said):
  proc = subprocess.run(
      [*LAUNCH, "--ps", "1", "--workers", "2", *argv, "--", "true"],
      cwd=CWD, env=_env(), capture_output=True, text=True, timeout=30)
  assert proc.returncode == 2, proc
  assert proc.stdout == "", proc.stdout
  assert said in proc.stderr and len(proc.stderr.splitlines()) == 1, (
      proc.stderr)


@pytest.mark.version_independent
def test_a_machine_without_iproute2_gets_one_line_saying_why(tmp_path):
  # Only the python that runs the tasks on PATH: no ip, no tc.
  (tmp_path / "python").symlink_to(sys.executable)
  proc = subprocess.run(
      [*LAUNCH, "--hosts", "2", "--ps", "1", "--workers", "1", "--",
       sys.executable, "-c", "print('ran')"], cwd=CWD,
      env=dict(_env(), PATH=str(tmp_path)), capture_output=True, text=True,
      timeout=30)
  assert proc.returncode == 2, proc
  assert "ran" not in proc.stdout, proc.stdout
  assert proc.stderr == (
      "sync-replicas-launch: cannot emulate 2 hosts inside the launch's "
      "namespace (ip and tc not found on PATH: install iproute2 (apt-get "
      "install iproute2)); run without --hosts to put every task on its "
      "loopback\n"), proc.stderr


@pytest.mark.timeout(300)
@pytest.mark.scale(reason=(
    "a second driving mode across emulated hosts: the Supervisor trains in "
    "test_examples and test_user_scripts, and training across hosts is "
    "this file's cut-link test, both in the default run"))
@pytest.mark.newest_only(reason=(
    "a Supervisor trains under every version in test_examples' "
    "test_supervisor_flow_learns_with_tf1_flags and test_user_scripts' two "
    "Supervisor scripts, and training across emulated hosts is this "
    "file's cut-link and Estimator tests' (10 CPU-seconds on 2.15)"))
def test_supervisor_trains_on_hosts():
  out = _launch(["--hosts", "3", "--link-rate", "1gbit", "--ps", "1",
                 "--workers", "2", "--", "python", "-m",
                 "examples.digits_supervisor", "--steps", "100"], timeout=200)
  assert len(set(_addresses(_cluster(out)))) == 3, out[-3000:]
  assert _final_accuracy(out) > 0.8, out[-4000:]
  assert "[worker0] worker0 done after" in out, out[-4000:]


@pytest.mark.timeout(420)
def test_training_on_hosts_survives_a_cut_link_and_is_read_by_status(
    tmp_path):
  # One job serves both (each was a job of its own, about 35 CPU-seconds):
  # the ps on host0 cut off for CUT_SECS while the replicas train: every
  # update waits for it, and training must go on once the link is mended
  # (as tools/soak's cuts: the task lives on, unreachable); then, the chief
  # held, sync-replicas-status reads the job from outside. Steps slowed by
  # a 50 ms median sleep (no CPU; about 7 steps a second at load 10): the
  # cut follows the chief's first progress line (its first step) by two
  # commands entering the launch (logging every 10 steps, the chief's last
  # line at the end of the status read was still its first, at load 8-10),
  # and the rest of CUT_LINK_STEPS lasts long enough, on a loaded machine
  # too, for the cut to come before the end. (300 steps trained nearly 290
  # after the status read: 8 CPU-seconds and 20 s that nothing read.) The
  # ps on host0, the replicas on hosts 1 and 2.
  logdir = tmp_path / "digits"
  proc = _start(["--hosts", "3", "--link-rate", "1gbit", "--ps", "1",
                 "--workers", "2", "--timeout", "300", "--", "python", "-m",
                 "examples.digits", "--steps", str(CUT_LINK_STEPS),
                 "--delay_ms", "50", "--log_every", "50",
                 "--checkpoint_every", "1000", "--logdir", str(logdir),
                 "--no_plot"])
  try:
    output = support.OutputLines(proc.stdout)
    pid = int(output.find(r"--enter (\d+)", "the launch's --enter line",
                          timeout=20).group(1))
    cluster = json.loads(output.find(r"\[launch\] cluster (\{.*\})\n",
                                     "the cluster line", timeout=30).group(1))
    ps = cluster["ps"][0]
    output.find(r"\[chief0\] .*step +\d+ +loss", "the chief's first "
                "progress line", timeout=180)
    support.wait_until(lambda: (logdir / "sync_manifest.json").exists(),
                       timeout=60, what="the chief's sync_manifest.json",
                       interval=0.2)
    chief = int(output.find(r"\[launch\] started chief0 \(pid (\d+)\)",
                            "the chief's pid", timeout=1).group(1))

    def inside(*argv, check=True):
      return subprocess.run([*LAUNCH, "--enter", str(pid), "--", *argv],
                            cwd=CWD, env=_env(), capture_output=True,
                            text=True, timeout=60, check=check)

    reach = [sys.executable, "-c", "import socket; socket.create_connection("
             "(%r, %s), timeout=2)" % tuple(ps.rsplit(":", 1))]
    assert inside(*reach, check=False).returncode == 0
    inside("ip", "link", "set", "host0", "down")
    cut_at = time.monotonic()
    try:
      assert inside(*reach, check=False).returncode != 0, (
          "the ps is reachable while its link is down")
      time.sleep(max(0.0, CUT_SECS - (time.monotonic() - cut_at)))
    finally:
      inside("ip", "link", "set", "host0", "up")
    assert proc.poll() is None, "the job ended during the cut"
    # Held in turns while the status tool reads (as in test_confine): the
    # job must still be training when it reads.
    with support.held_in_turns(lambda signum: os.killpg(chief, signum)):
      assert proc.poll() is None, "the job ended before its chief was held"
      # From outside, as a user types it: the tool finds the launch whose
      # host wrote the manifest, and enters its namespace.
      status = subprocess.run(
          [str(BIN / "sync-replicas-status"), "--manifest", str(logdir),
           "--ps", ps], cwd=CWD, env=_env(),
          capture_output=True, text=True, timeout=200)
      still_training = proc.poll() is None
    proc.wait(timeout=300)
  finally:
    support.kill_group(proc)
  text = output.finish()
  assert proc.returncode == 0, text[-6000:]
  assert len(set(_addresses(cluster))) == 3, cluster
  assert re.search(r"\[chief0\] final test accuracy 0\.\d+ .* at step %d"
                   % CUT_LINK_STEPS, text), text[-4000:]
  assert _final_accuracy(text) > 0.8, text[-4000:]
  assert status.returncode == 0, (status.stdout, status.stderr)
  assert re.search(r"global_step: \d+", status.stdout), status.stdout
  assert still_training, "training ended before the status tool returned"
  assert status.stderr == (
      "sync-replicas-status: reading inside the network namespace of "
      "sync-replicas-launch %d, where the job runs\n" % proc.pid), (
          status.stderr)


# How a user runs a TF1 script that takes --job_name/--task_index/--ps_hosts/
# --worker_hosts under a launcher that gives TF_CONFIG: the flags from it
# (the chief is the scripts' worker 0), the script itself unchanged.
_FLAGS_FROM_TF_CONFIG = r"""
import json, os, sys
config = json.loads(os.environ.pop("TF_CONFIG"))
cluster, task = config["cluster"], config["task"]
workers = cluster["chief"] + cluster.get("worker", [])
job, index = task["type"], task["index"]
if job != "ps":
  index, job = (0 if job == "chief" else index + 1), "worker"
argv = sys.argv[1:] + ["--job_name=" + job, "--task_index=%d" % index,
                       "--ps_hosts=" + ",".join(cluster["ps"]),
                       "--worker_hosts=" + ",".join(workers)]
os.execv(argv[0], argv)
"""


@pytest.mark.timeout(300)
@pytest.mark.scale(reason=(
    "a third driving mode across emulated hosts: the unchanged-script "
    "runner trains every script of test_user_scripts, and training across "
    "hosts is this file's cut-link test, both in the default run"))
@pytest.mark.newest_only(reason=(
    "the unchanged-script runner (python -m sync_replicas.patch, what "
    "sync-replicas-run runs) trains every script of test_user_scripts under "
    "every version, and training across emulated hosts is this file's "
    "cut-link and Estimator tests' (10 CPU-seconds on 2.15)"))
def test_unchanged_script_runner_trains_on_hosts(tmp_path):
  script = ROOT / "tests" / "user_scripts" / "monitored_session.py"
  out = _launch(["--hosts", "3", "--link-rate", "1gbit", "--ps", "1",
                 "--workers", "2", "--", "python", "-c",
                 _FLAGS_FROM_TF_CONFIG, str(BIN / "sync-replicas-run"),
                 str(script), "--train_steps=60",
                 "--logdir=%s" % tmp_path], timeout=200,
                env=_env(PYTHONPATH=support.pythonpath(ROOT)))
  assert len(set(_addresses(_cluster(out)))) == 3, out[-3000:]
  for task in ("chief0", "worker0"):
    assert re.search(r"^\[%s\] optimizer: sync_replicas\.optimizer\."
                     r"SyncReplicasOptimizer$" % task, out, re.M), out[-4000:]
    assert re.search(r"^\[%s\] worker \d: final global step 60$" % task,
                     out, re.M), out[-4000:]


@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_ESTIMATOR, reason=(
    "this TensorFlow has no tf.compat.v1.estimator (removed in 2.16); run "
    "with SYNC_REPLICAS_TF='tensorflow-cpu==2.15.* tensorflow-estimator==2.15.*"
    " numpy<2' SYNC_REPLICAS_VENV=.venv-215"))
def test_estimator_trains_on_hosts(tmp_path):
  # The Estimator imports Keras, which the tests' children lack otherwise.
  out = _launch(["--hosts", "3", "--link-rate", "1gbit", "--ps", "1",
                 "--workers", "2", "--", "python", "-m",
                 "examples.digits_estimator", "--steps", "100", "--logdir",
                 str(tmp_path)], timeout=200, env=support.with_keras(_env()))
  assert len(set(_addresses(_cluster(out)))) == 3, out[-3000:]
  assert _final_accuracy(out) > 0.8, out[-4000:]
  assert "[worker0] worker0 done" in out, out[-4000:]
