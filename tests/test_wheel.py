"""The package as a user gets it: a wheel installed into a fresh venv.

Issue 28: the tools an operator runs used to live only in a clone. Here the
wheel is built from a copy of this checkout (pip wheel --no-deps
--no-build-isolation: no download), its contents are checked (the package
and its CLI modules, the licence in its metadata; no tests, tools or
examples), and it is installed into a new venv whose console scripts then
run: ``--help`` and ``--version`` of each, bad arguments, and one real use,
the demo's cluster (the digits example, 1 ps and 3 replicas, 1 a backup)
started by ``sync-replicas-launch`` and read live by ``sync-replicas-status``
through ``sync-replicas-launch --enter``, both ended by Ctrl-C.

What it costs (marked ``wheel``): about 40-60 s on 2 cores, most of it the
six TensorFlow imports of the cluster and the status tool, which is why
that one test is in the scale tier (``./tools/test --all``, CI); a few MB
in a temporary directory. TensorFlow is not installed again: the new venv sees
this test venv's site-packages through a ``.pth`` line, added after the
wheel's install (so that pip sees a clean venv). A directory named by a
``.pth`` line is not scanned for ``.pth`` files of its own, so the editable
install of a checkout there stays off; every run asserts that
``sync_replicas`` is imported from the new venv, and nothing runs with this
checkout on its path.
"""

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile

import pytest

import support

# Version-independent (tests/conftest.py): the wheel is pure Python, its
# console scripts' launcher imports no TensorFlow, and the demo its cluster
# runs is tested under every TensorFlow (test_examples): CI runs this file
# under its newest TensorFlow only.
pytestmark = [pytest.mark.wheel, pytest.mark.version_independent]

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Console scripts and their modules.
SCRIPTS = {"sync-replicas-launch": "sync_replicas/cli/launch.py",
           "sync-replicas-slurm": "sync_replicas/cli/slurm.py",
           "sync-replicas-status": "sync_replicas/cli/status.py",
           "sync-replicas-run": "sync_replicas/patch/__main__.py",
           "sync-replicas-timeline": "sync_replicas/timeline.py"}
#: Their entry points, ``main`` unless named here: the status command ends
#: its process once it has answered (``status.console``).
ENTRY_POINTS = {"sync-replicas-status": "console"}
#: What the wheel must hold, beside every module of the package.
CLI_MODULES = ["sync_replicas/cli/__init__.py", "sync_replicas/cli/_cli.py",
               "sync_replicas/cli/_confine.py",
               "sync_replicas/cli/_job_state.py",
               "sync_replicas/cli/launch.py", "sync_replicas/cli/status.py",
               "sync_replicas/cli/slurm.py", "sync_replicas/cli/_slurm_env.py",
               "sync_replicas/cli/_rendezvous.py"]


class Venv:
  """A fresh venv holding the wheel, and how to run its scripts."""

  def __init__(self, path, wheel, build_output):
    self.path = path
    self.wheel = wheel
    self.build_output = build_output
    self.bin = path / "bin"
    self.python = self.bin / "python"
    self.site = pathlib.Path(subprocess.run(
        [str(self.python), "-c", "import sysconfig; "
         "print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60).stdout.strip())

  def env(self, **extra):
    """A user's environment: this venv first on PATH, no checkout anywhere.

    PYTHONPATH holds only tests/_hidden (a stub that keeps scikit-learn out
    of TensorFlow's import, as in every test process: support.HIDDEN).
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SYNC_REPLICAS_", "PYTHON"))
           and k not in ("TF_CONFIG", "VIRTUAL_ENV")}
    env.update(PATH=str(self.bin) + os.pathsep + os.environ["PATH"],
               PYTHONPATH=str(support.HIDDEN), PYTHONUNBUFFERED="1",
               VIRTUAL_ENV=str(self.path), TF_CPP_MIN_LOG_LEVEL="2", **extra)
    return env

  def run(self, argv, *, cwd, timeout=120):
    return subprocess.run(argv, cwd=cwd, env=self.env(), capture_output=True,
                          text=True, timeout=timeout)


def _copy_of_checkout(dest):
  """The checkout's files, without what a build or a run left in it."""
  shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
      ".git", ".venv*", "runs", "build", "dist", "*.egg-info", "__pycache__",
      ".pytest_cache", ".mypy_cache", ".ruff_cache"))
  return dest


def _pip_env():
  """pip's environment: no PYTHONPATH (a checkout there, or its egg-info,
  would count as sync_replicas already installed)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
  env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
  return env


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
  """Builds the wheel and installs it, without its dependencies, in a venv."""
  base = tmp_path_factory.mktemp("wheel")
  source = _copy_of_checkout(base / "source")
  built = subprocess.run(
      [sys.executable, "-m", "pip", "wheel", "--no-deps",
       "--no-build-isolation", "--no-cache-dir", "-w", str(base / "dist"),
       str(source)], capture_output=True, text=True, timeout=300,
      env=_pip_env())
  assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
  wheel, = (base / "dist").glob("sync_replicas-*.whl")
  path = base / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)],
                 check=True, timeout=120)
  # This venv's pip installs into the new one; with no index it can fetch
  # nothing, and the wheel has no dependency it would need.
  installed = subprocess.run(
      [sys.executable, "-m", "pip", "--python", str(path / "bin" / "python"),
       "install", "--no-deps", "--no-index", str(wheel)],
      capture_output=True, text=True, timeout=300, env=_pip_env())
  assert installed.returncode == 0, installed.stdout + installed.stderr
  assert "Successfully installed sync" in installed.stdout, installed.stdout
  result = Venv(path, wheel, built.stdout + built.stderr)
  # Only now, so that pip saw a venv without any sync_replicas: this venv's
  # TensorFlow, numpy and scikit-learn's data, as a plain path.
  (result.site / "_test_venv_site_packages.pth").write_text(
      sysconfig.get_paths()["purelib"] + "\n")
  return result


def test_wheel_holds_the_package_and_its_tools_and_nothing_else(venv):
  names = zipfile.ZipFile(venv.wheel).namelist()
  modules = sorted(str(p.relative_to(ROOT)) for p in
                   (ROOT / "sync_replicas").rglob("*.py"))
  assert set(CLI_MODULES) <= set(names), names
  assert set(modules) <= set(names), sorted(set(modules) - set(names))
  # PEP 561's marker: users' type checkers read the package's type hints.
  assert "sync_replicas/py.typed" in names, names
  stray = [n for n in names if not re.match(
      r"(sync_replicas/|sync_replicas-[^/]+\.dist-info/)", n)]
  assert not stray, "the wheel holds more than the package: %s" % stray
  assert not [n for n in names if re.search(r"(^|/)(tests|tools|examples)/",
                                            n)], names
  dist_info = [n for n in names if ".dist-info/" in n]
  licence, = [n for n in dist_info if n.endswith("/LICENSE")]
  assert "Apache License" in zipfile.ZipFile(venv.wheel).read(licence).decode()
  metadata = zipfile.ZipFile(venv.wheel).read(
      next(n for n in dist_info if n.endswith("/METADATA"))).decode()
  assert "License: Apache-2.0" in metadata
  assert "License-File: LICENSE" in metadata
  assert "Requires-Python: " in metadata
  entry_points = zipfile.ZipFile(venv.wheel).read(
      next(n for n in dist_info if n.endswith("/entry_points.txt"))).decode()
  for script, module in SCRIPTS.items():
    dotted = module[:-len(".py")].replace("/", ".")
    assert "%s = %s:%s" % (script, dotted, ENTRY_POINTS.get(
        script, "main")) in entry_points, entry_points
  # No warning of ours while building (setuptools once deprecated our licence
  # classifier in every build and install).
  assert not re.search(r"(?i)deprecat|license classifier", venv.build_output), (
      venv.build_output[-3000:])


def test_installed_package_is_the_wheels(venv, tmp_path):
  # Found, not imported (importing the optimizer would cost a TensorFlow
  # import; the cluster test below does that in every task).
  done = venv.run([str(venv.python), "-c",
                   "import importlib.util as u; "
                   "print(u.find_spec('sync_replicas.optimizer').origin); "
                   "print(u.find_spec('tensorflow').origin)"],
                  cwd=tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  ours, tensorflow = done.stdout.split()
  assert pathlib.Path(ours).is_relative_to(venv.site), ours
  assert not pathlib.Path(tensorflow).is_relative_to(venv.site), tensorflow


def _installed_scripts():
  return [s for s, module in SCRIPTS.items() if (ROOT / module).exists()]


@pytest.mark.parametrize("script", _installed_scripts())
def test_every_console_script_says_what_it_does(venv, tmp_path, script):
  helped = venv.run([str(venv.bin / script), "--help"], cwd=tmp_path)
  version = venv.run([str(venv.bin / script), "--version"], cwd=tmp_path)
  bad = venv.run([str(venv.bin / script), "--no-such-flag"], cwd=tmp_path)
  assert helped.returncode == 0 and version.returncode == 0, (helped, version)
  assert re.search(r"\b\d+\.\d+\.\d+\n", version.stdout), version.stdout
  assert bad.returncode == 2 and not bad.stdout, bad
  assert helped.stdout.startswith("usage: " + script), helped.stdout
  # What it does, with an example of a command line.
  assert re.search(r"\n  %s \S" % re.escape(script), helped.stdout), (
      helped.stdout)
  assert re.fullmatch(r"%s \(sync_replicas\) \d+\.\d+\.\d+\n"
                      % re.escape(script), version.stdout), version.stdout
  assert bad.stderr.count("\n") == 1, bad.stderr
  assert bad.stderr.startswith(script + ": error: "), bad.stderr


@pytest.mark.parametrize("script,argv,message", [
    ("sync-replicas-status", ["--manifest", "m", "--ps", "127.0.0.1:70000"],
     "argument --ps: expected host:port with a port in 1..65535, got "
     "'127.0.0.1:70000'"),
    ("sync-replicas-launch", ["--port", "70000", "--", "true"],
     "--port must leave room for 4 ports below 65536, got 70000"),
], ids=["status-port", "launch-port"])
def test_a_port_out_of_range_is_one_line_and_exit_code_2(venv, tmp_path,
                                                         script, argv,
                                                         message):
  bad = venv.run([str(venv.bin / script), *argv], cwd=tmp_path)
  assert bad.returncode == 2, bad
  assert bad.stderr.count("\n") == 1 and message in bad.stderr, bad.stderr
  assert not bad.stdout


def _start(venv, argv, cwd):
  return subprocess.Popen(argv, cwd=cwd, env=venv.env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True)


def _interrupt(proc, timeout=60):
  """Ctrl-C, as a terminal sends it to the foreground program; its code."""
  proc.send_signal(signal.SIGINT)
  return proc.wait(timeout=timeout)


@pytest.mark.timeout(300)
@pytest.mark.scale(reason=(
    "the installed wheel's console scripts on a live cluster (28-34 "
    "CPU-seconds in two loaded runs), where the default run proves each "
    "part apart: this file's other tests run every console script of the "
    "wheel and import "
    "its package, test_examples' test_demo_trains_confined_and_its_printed_"
    "status_command_reads_it launches the demo's cluster confined and reads "
    "it live inside its namespace, test_hosts' cut-link test runs commands "
    "through --enter PID, test_status_tool's --watch tests read snapshots "
    "in turn, and test_bad_input's and test_launcher's Ctrl-C tests end "
    "the status tool and the launcher with 130"))
def test_launch_runs_the_demo_cluster_and_status_reads_it_live(venv,
                                                               tmp_path):
  # The examples are no part of the wheel: a copy of them, next to nothing
  # else, is the user's program.
  shutil.copytree(ROOT / "examples", tmp_path / "examples",
                  ignore=shutil.ignore_patterns("__pycache__"))
  logdir = tmp_path / "demo"
  launch = [str(venv.bin / "sync-replicas-launch"), "--ps", "1", "--workers",
            "3", "--backup", "1", "--timeout", "240", "--grace", "5", "--",
            str(venv.python), "-m", "examples.digits", "--logdir",
            str(logdir), "--steps", "100000", "--delay_ms", "20",
            "--log_every", "20", "--checkpoint_every", "100000", "--no_plot"]
  started = time.monotonic()
  proc = _start(venv, launch, tmp_path)
  status_proc = None
  try:
    output = support.OutputLines(proc.stdout)
    errors = support.OutputLines(proc.stderr)
    confined = output.find(r"\[launch\] (confined|unconfined)", "the "
                           "launch's first line", timeout=30)
    if confined.group(1) == "unconfined":
      pytest.fail("the launch ran unconfined without being told to")
    pid = int(output.find(r"--enter (\d+)", "the --enter line",
                          timeout=5).group(1))
    assert pid == proc.pid
    output.find(r"\[chief0\] .*step +\d+ +loss", "the chief's first progress "
                "line", timeout=180)
    assert (logdir / "sync_manifest.json").is_file()
    # The status tool inside the launch's namespace, as the launch said;
    # --enter execs it, so this process is the status tool.
    status_proc = _start(venv, [
        str(venv.bin / "sync-replicas-launch"), "--enter", str(pid), "--",
        str(venv.bin / "sync-replicas-status"), "--manifest", str(logdir),
        "--ps", "127.0.0.1:2222", "--watch", "--interval", "1"], tmp_path)
    status = support.OutputLines(status_proc.stdout)
    status_errors = support.OutputLines(status_proc.stderr)
    status.find(r"(?s)(sync state at .*){2}", "two snapshots", timeout=120)
    status_code = _interrupt(status_proc)
    launch_code = _interrupt(proc, timeout=60)
  finally:
    for p in (status_proc, proc):
      if p is not None and p.returncode is None:
        p.terminate()  # The launcher stops its tasks on SIGTERM.
        try:
          p.wait(timeout=30)
        except subprocess.TimeoutExpired:
          pass
        support.kill_group(p)
  elapsed = time.monotonic() - started
  text, err = output.finish(), errors.finish()
  shown, status_err = status.finish(), status_errors.finish()
  print("launch and status, from the wheel, in %.0f s" % elapsed)
  chief = [line for line in text.splitlines()
           if re.match(r"\[chief0\] .*step +\d+ +loss", line)]
  print("--- sync-replicas-launch (its own lines, the chief's first and last):")
  print("\n".join(line for line in text.splitlines()
                  if line.startswith("[launch]") or line in chief[:3]
                  or line in chief[-2:]))
  print("--- sync-replicas-status --watch:")
  print(shown[-3000:])

  assert status_code == 130, (shown, status_err)
  assert "Traceback" not in status_err, status_err
  assert status_err.rstrip().endswith("sync-replicas-status: interrupted"), (
      status_err)
  steps = [int(s) for s in re.findall(r"global_step: (\d+)", shown)]
  assert len(steps) >= 2 and steps[-1] > 0, shown
  assert re.search(r"hidden/weights +\d/2 ", shown), shown
  assert "tokens queued:" in shown and "next: " in shown, shown

  assert launch_code == 130, text[-3000:] + err[-3000:]
  assert "[launch] interrupted: stopping every task" in text
  assert "Traceback" not in err, err
  pids = [int(p) for p in re.findall(r"\[launch\] started \w+ \(pid (\d+)\)",
                                     text)]
  assert len(pids) == 4, text[-3000:]
  support.wait_until(lambda: not any(map(support.pid_runs, pids)), timeout=10,
                     what="every task of the launch gone")
  # Every task imported the wheel's sync_replicas, not a checkout's.
  assert str(ROOT / "sync_replicas") not in text + err
