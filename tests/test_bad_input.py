"""Bad input to sync-replicas-status and sync-replicas-launch: a clear error, nothing touched.

Each case is what a user can get wrong: a ps that is not there, a file that
is not this job's manifest, a manifest of another job or format version, an
accumulator the ps does not hold; a launch of a program that does not exist,
on a port in use, with no workers, or with more backups than workers. Every
test checks both the message (what was expected, what arrived, how to fix)
and that nothing changed: the job's sync state is as before, no task of the
launch was started.
"""

import io
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import tensorflow as tf

import sync_replicas
from sync_replicas.cli import status as status_tool
import support

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The launcher as ``python -m`` runs it (tools/launch is a wrapper of it).
LAUNCH = ["-m", "sync_replicas.cli.launch"]


def _status(argv, capsys):
  out = io.StringIO()
  code = status_tool.main(argv, out=out)
  return code, out.getvalue(), capsys.readouterr().err


def _free_port():
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def test_status_names_an_unreachable_ps_and_how_to_reach_it(tmp_path, capsys,
                                                            half_way):
  _, path, state, _, _ = half_way
  port = _free_port()  # Nothing listens there once the probe socket closes.
  code, out, err = _status(["--manifest", path, "--ps", "127.0.0.1:%d" % port,
                            "--timeout", "2"], capsys)
  assert code == 1 and not out
  # The time it says is the time it took, all told (issue 46: "10 s" once
  # meant 15.9). The --enter hint comes only with running confined
  # launches to name, which other suites on this machine may have or not.
  found = re.search(r"could not reach the job at grpc://127\.0\.0\.1:%d: no "
                    r"answer within --timeout 2 s \((\d+) s since the tool "
                    r"started; " % port, err)
  assert found and int(found.group(1)) >= 2, err
  assert "--enter PID" not in err or "launches running now: " in err, err
  assert state() == [0, 1, [1]]


def test_status_says_a_job_that_ended_meanwhile_has_ended(capsys, half_way,
                                                         monkeypatch):
  # A walk through README saw it: TensorFlow's import took 40 s on a loaded
  # machine, the job ended meanwhile, and the read timed out. When the job
  # does not answer, the tool asks again whether it has ended (here: its
  # chief, as the manifest records it, "has exited"), and says that instead.
  _, path, state, _, _ = half_way
  port = _free_port()
  manifest = json.loads(pathlib.Path(path).read_text())
  asked = []

  def has_exited(writer):  # Running at the tool's start, gone at the read.
    asked.append(writer)
    return writer == manifest["writer"] and len(asked) > 1

  monkeypatch.setattr(
      status_tool._process, "has_exited",  # pylint: disable=protected-access
      has_exited)
  code, out, err = _status(["--manifest", path, "--ps", "127.0.0.1:%d" % port,
                            "--timeout", "2"], capsys)
  assert code == 1 and not out
  assert err == (
      "sync-replicas-status: the job that wrote %s has ended: its chief (pid "
      "%d) has exited, and nothing listens on port %d any more. Its sync "
      "state ended with it; its checkpoints, logs and timeline (if it "
      "recorded one: sync-replicas-timeline DIR) remain.\n" % (
          path, os.getpid(), port)), err
  assert len(asked) == 2, asked  # Once before the read, once after it.
  assert state() == [0, 1, [1]]


def _status_process(argv, **kwargs):
  """sync-replicas-status as its own process (python -m), started."""
  return subprocess.Popen(
      [sys.executable, "-m", "sync_replicas.cli.status", *argv], cwd=ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      start_new_session=True, **kwargs)


@pytest.mark.timeout(120)
def test_status_process_says_what_failed_in_one_line(tmp_path):
  """As a user sees it: one line on stderr, exit code 1, no traceback (and
  none of TensorFlow's start-up lines)."""
  # A manifest, and no job: a live one would time out its own sessions
  # while these processes import TensorFlow on a loaded machine.
  path = _other_job_manifest(tmp_path)
  not_json = tmp_path / "not_json.json"
  not_json.write_text("{not json")
  cases = {
      "unreachable": (["--manifest", path, "--ps",
                       "127.0.0.1:%d" % _free_port(), "--timeout", "2"],
                      "sync-replicas-status: could not reach the job at "
                      "grpc://127.0.0.1:"),
      "not-json": (["--manifest", str(not_json), "--ps", "127.0.0.1:1"],
                   "sync-replicas-status: %s is not a sync manifest: "
                   "expected JSON" % not_json),
  }
  procs = {name: _status_process(argv) for name, (argv, _) in cases.items()}
  for name, proc in procs.items():
    try:
      out, err = proc.communicate(timeout=90)
    finally:
      support.kill_group(proc)
    assert proc.returncode == 1, (name, out, err)
    assert not out and err.count("\n") == 1, (name, err)
    assert err.startswith(cases[name][1]), (name, err)


@pytest.mark.timeout(120)
def test_status_process_ends_on_ctrl_c_with_130_and_no_traceback(tmp_path):
  # A read that waits (nothing answers at the address for 60 s): Ctrl-C
  # arrives during TensorFlow's import or inside the session's run, where a
  # KeyboardInterrupt once came out as a pybind11 RuntimeError traceback.
  with socket.socket() as silent:
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # Accepts connections, never answers.
    proc = _status_process(["--manifest", _other_job_manifest(tmp_path),
                            "--ps", "127.0.0.1:%d" % silent.getsockname()[1],
                            "--timeout", "60"])
    try:
      time.sleep(8)
      proc.send_signal(signal.SIGINT)
      out, err = proc.communicate(timeout=30)
    finally:
      support.kill_group(proc)
  assert proc.returncode == 130, (out, err)
  assert err == "sync-replicas-status: interrupted\n" and not out, err


def test_status_explains_a_missing_manifest(tmp_path, capsys):
  code, _, err = _status(["--manifest", str(tmp_path), "--ps",
                          "127.0.0.1:1"], capsys)
  assert code == 2  # A bad argument, as --help says.
  assert "No sync manifest at %s/sync_manifest.json" % tmp_path in err, err
  assert "write_sync_manifest(checkpoint_dir)" in err
  assert "--logdir" in err


@pytest.mark.parametrize("text,message", [
    ("{not json", "expected JSON in format 'sync_replicas.manifest/1', got "
     "text that does not parse"),
    ('{"format": "tensorboard"}', "not a sync manifest: expected format "
     "'sync_replicas.manifest/1', got 'tensorboard'"),
    ("[1, 2]", "got 'list'"),
    ('{"format": "sync_replicas.manifest/2"}', "of format "
     "'sync_replicas.manifest/2', but this sync_replicas reads "
     "'sync_replicas.manifest/1'. Read it with the sync-replicas-status of "
     "the sync_replicas version"),
], ids=["not-json", "other-format", "not-an-object", "newer-version"])
def test_status_refuses_a_wrong_manifest_before_connecting(tmp_path, capsys,
                                                           text, message):
  path = tmp_path / "sync_manifest.json"
  path.write_text(text)
  # No cluster at all: the manifest is refused before any connection.
  code, out, err = _status(["--manifest", str(path), "--ps", "127.0.0.1:1"],
                           capsys)
  assert code == 1 and not out
  assert message in err, err


def _other_job_manifest(directory):
  """The manifest of another job: other step and variable names."""
  with tf.Graph().as_default():
    with tf.compat.v1.device("/job:ps/task:0"):
      step = tf.compat.v1.Variable(0, name="other_step", trainable=False)
      var = tf.compat.v1.get_variable("embedding", [3],
                                      initializer=tf.zeros_initializer())
    opt = sync_replicas.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1),
        replicas_to_aggregate=2, total_num_replicas=2)
    opt.apply_gradients([(tf.ones([3]), var)], global_step=step)
    return opt.write_sync_manifest(str(directory))


def test_status_refuses_another_jobs_manifest_and_creates_nothing(
    tmp_path, capsys, half_way):
  cluster, _, state, _, _ = half_way
  ps = cluster.cluster_spec.job_tasks("ps")[0]
  (tmp_path / "other").mkdir()
  path = _other_job_manifest(tmp_path / "other")
  code, out, err = _status(["--manifest", path, "--ps", ps], capsys)
  assert code == 1 and not out
  assert ("holds no global step 'other_step' on /job:ps/task:0; no variable "
          "'embedding' (accumulator 'embedding:0/grad_accum')") in err, err
  assert "Nothing was read or created" in err
  assert state() == [0, 1, [1]]


def test_status_refuses_an_accumulator_the_ps_does_not_hold(tmp_path, capsys,
                                                            half_way):
  cluster, path, state, _, _ = half_way
  ps = cluster.cluster_spec.job_tasks("ps")[0]
  manifest = json.loads(pathlib.Path(path).read_text())
  # The job's own manifest plus an accumulator for a variable it never had,
  # as a manifest kept from an older version of the model would have.
  extra = dict(manifest["accumulators"][0], variable="bias",
               shared_name="bias:0/grad_accum")
  manifest["accumulators"].append(extra)
  edited = tmp_path / "edited.json"
  edited.write_text(json.dumps(manifest))
  code, out, err = _status(["--manifest", str(edited), "--ps", ps], capsys)
  assert code == 1 and not out
  assert "holds no variable 'bias' (accumulator 'bias:0/grad_accum')" in err
  assert "global step" not in err, "the job's global step is there: " + err
  assert state() == [0, 1, [1]]
  # The job's own manifest still reads: the refusal left the ps usable.
  code, out, _ = _status(["--manifest", path, "--ps", ps], capsys)
  assert code == 0 and " 1/2 " in out


def _launch(argv, tmp_path, timeout=30):
  """The launcher with a task program that would leave a file if started."""
  marker = tmp_path / "started"
  cmd = [sys.executable, *LAUNCH, *argv]
  if "--" not in argv:
    cmd += ["--", sys.executable, "-c",
            "open(%r, 'a').write('x')" % str(marker)]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)
  return proc.returncode, proc.stdout, proc.stderr, marker.exists()


def test_launch_refuses_a_missing_program_before_starting_anything(tmp_path):
  code, out, err, _ = _launch(["--ps", "1", "--workers", "2", "--",
                               str(tmp_path / "no-such-program")], tmp_path)
  assert code == 127, out + err
  assert ("could not start '%s': no such program" % (
      tmp_path / "no-such-program")) in out
  assert "Check the command after --" in out
  assert "started" not in out and "confined" not in out


def test_launch_refuses_a_port_in_use_and_starts_nothing(tmp_path):
  with socket.socket() as held:
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    # Unconfined: a confined launch has a namespace of its own, where the
    # port is free.
    code, out, err, started = _launch(
        ["--unconfined", "--ps", "1", "--workers", "2", "--port",
         str(port - 1)], tmp_path)
  assert code == 2, out + err
  assert ("port(s) %d already in use on this machine: nothing was started. "
          "Pick another --port (the cluster needs 3 ports from it)" % port
          ) in out
  assert not started and "started ps0" not in out


@pytest.mark.parametrize("argv,message", [
    (["--workers", "0"], "need --ps >= 0 and --workers >= 1, got --ps 1 "
     "--workers 0"),
    (["--workers", "2", "--backup", "3"], "--backup must be in [0, --workers)"
     " so that at least one replica's gradient makes an update, got --backup 3"
     " with --workers 2"),
    (["--workers", "2", "--backup", "2"], "got --backup 2 with --workers 2"),
], ids=["zero-workers", "more-backups-than-workers", "as-many-backups"])
def test_launch_refuses_a_cluster_without_updates(tmp_path, argv, message):
  code, out, err, started = _launch(argv, tmp_path)
  assert code == 2, out + err
  assert message in err
  assert not started and not out
