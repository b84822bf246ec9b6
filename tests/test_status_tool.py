"""sync-replicas-status (sync_replicas.cli.status) against a live in-process cluster whose state the test knows.

Each test builds a fresh LocalCluster, puts it in a known state (gradients
accumulated, tokens queued), runs the tool and checks both what it printed and
that the state is exactly as before: the tool must never take or dequeue.
"""

import io
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import tensorflow as tf

import sync_replicas
from sync_replicas.cli import status as status_tool
import support


def _run(argv):
  out = io.StringIO()
  code = status_tool.main(argv, out=out)
  return code, out.getvalue()


def test_manifest_names_the_sync_state(half_way):
  _, path, _, workers, _ = half_way
  manifest = json.loads(pathlib.Path(path).read_text())
  assert path.endswith("sync_manifest.json")
  assert manifest["replicas_to_aggregate"] == 2
  assert manifest["global_step"]["name"] == "global_step"
  assert [(a["shared_name"], a["sparse"], a["shape"])
          for a in manifest["accumulators"]] == [("w:0/grad_accum", False, [4])]
  assert manifest["accumulators"][0]["device"] == (
      workers[0].opt.accumulators[0][1])
  # Where the status tool finds a confined launch's job (issue 38).
  assert manifest["network_namespace"] == os.stat("/proc/self/ns/net").st_ino


def test_status_reports_known_state_and_changes_nothing(half_way):
  cluster, path, state, workers, sessions = half_way
  ps = cluster.cluster_spec.job_tasks("ps")[0]
  code, text = _run(["--manifest", path, "--ps", ps])
  assert code == 0, text
  assert "global_step: 0" in text
  assert "tokens queued: 1 (each update releases 2)" in text
  assert "w " in text and " 1/2 " in text
  # The chief's stall line's words.
  assert ("next: update to step 1 waits for gradients: w 1/2; 1 token(s) "
          "queued\n") in text, text
  # Both replicas hold local step 0 (the global step): nothing is stale.
  assert ("replicas: workers' local steps: worker0 0, worker1 0\n") in text, (
      text)
  assert state() == [0, 1, [1]], "the status tool changed the sync state"

  # The second gradient completes the update; the tool sees it too.
  sessions[1].run(workers[1].train_op)
  support.wait_until(lambda: state()[0] == 1, timeout=20,
                     what="global_step == 1")
  code, text = _run(["--manifest", path, "--ps", ps, "--watch", "--count",
                     "2", "--interval", "0.05"])
  assert code == 0, text
  assert text.count("global_step: 1") == 2
  assert " 0/2 " in text and "tokens queued: 2" in text
  assert state() == [1, 2, [0]]


#: Seconds the command may take from its last line to its exit: closing its
#: session to the ps, then nothing (Python's exit, TensorFlow's teardown,
#: took 9-96 s more at load 30-47; without it 0.2-8.5 s, the close starved
#: of CPU). The atexit probe is what tells the two apart on any machine.
EXIT_SECS = 20.0

_ATEXIT_PROBE = """import atexit, os
atexit.register(lambda: open(os.environ["STATUS_EXIT_PROBE"], "w").close())
"""


#: The job's bound on a run, the chief's take of the update that waits
#: while the command runs included: the command's TensorFlow import alone
#: outlasted half_way's 30 s on a loaded machine (load 40-50).
JOB_TIMEOUT_MS = 240_000


@pytest.mark.timeout(300)
def test_the_command_exits_once_it_has_answered(tmp_path):
  """The command's process (status.console, the console script's entry
  point; ``python -m`` runs the same) ends once its lines are out, without
  Python's exit: an atexit hook that a sitecustomize puts in never runs,
  and the process is gone within EXIT_SECS of its last line. Against a job
  as half_way's (the chief pushed once), whose runs wait longer."""
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  chief, other = [support.LinearWorker(
      support.OURS, cluster, t, replicas=2, total=2,
      opt_kwargs={"data_end": "stock"}) for t in range(2)]
  path = chief.opt.write_sync_manifest(str(tmp_path / "job"))
  ps = cluster.cluster_spec.job_tasks("ps")[0]
  sessions = [chief.session(timeout_ms=JOB_TIMEOUT_MS)]
  try:
    sessions.append(other.session(timeout_ms=JOB_TIMEOUT_MS))
    sessions[0].run(chief.train_op)
    _exits_once_it_has_answered(tmp_path, path, ps)
  finally:
    for session in reversed(sessions):
      session.close()


def _exits_once_it_has_answered(tmp_path, path, ps):
  probe_dir = tmp_path / "probe"
  probe_dir.mkdir()
  (probe_dir / "sitecustomize.py").write_text(_ATEXIT_PROBE)
  ran = tmp_path / "python-exit-ran"
  env = dict(os.environ, PYTHONUNBUFFERED="1", STATUS_EXIT_PROBE=str(ran),
             PYTHONPATH=support.pythonpath(probe_dir))
  proc = subprocess.Popen(
      [sys.executable, "-m", "sync_replicas.cli.status", "--manifest", path,
       "--ps", ps], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, env=env, start_new_session=True)
  lines, last = [], None
  try:
    for line in proc.stdout:  # Until the process closes it: at its end.
      lines.append(line)
      last = time.monotonic()
    code = proc.wait(timeout=60)
    ended = time.monotonic()
    err = proc.stderr.read()
  finally:
    support.kill_group(proc)
  text = "".join(lines)
  assert code == 0, (text, err)
  assert "global_step: 0" in text and "replicas: " in text, (text, err)
  assert not ran.exists(), "the command ran Python's exit (atexit, teardown)"
  assert ended - last < EXIT_SECS, ended - last
  # The probe works: a plain Python's exit runs it.
  subprocess.run([sys.executable, "-c", "pass"], env=env, check=True,
                 timeout=60)
  assert ran.exists()


def test_status_finds_the_ps_in_tf_config(half_way, monkeypatch):
  cluster, path, state, _, _ = half_way
  monkeypatch.setenv("TF_CONFIG", json.dumps(
      {"cluster": cluster.cluster_spec.as_dict(),
       "task": {"type": "worker", "index": 0}}))
  code, text = _run(["--manifest", path])
  assert code == 0, text
  assert "global_step: 0" in text and " 1/2 " in text
  assert state() == [0, 1, [1]]


def test_status_flags_a_stuck_job(half_way):
  cluster, path, _, _, _ = half_way
  ps = cluster.cluster_spec.job_tasks("ps")[0]
  code, text = _run(["--manifest", path, "--ps", ps, "--watch", "--count",
                     "3", "--interval", "0.05", "--stall-secs", "0.05"])
  assert code == 0
  assert "STUCK: global step 0 has not moved" in text


def test_status_explains_a_missing_cluster(tmp_path, monkeypatch, capsys):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  manifest = tmp_path / "sync_manifest.json"
  manifest.write_text(json.dumps({"format": "something else"}))
  assert status_tool.main(["--manifest", str(manifest)]) == 1
  assert "not a sync manifest" in capsys.readouterr().err


def test_status_counts_the_workers_own_token_queues(tmp_path):
  """With one_gradient_per_worker the tokens wait in one queue per worker."""
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  workers = [support.LinearWorker(
      support.OURS, cluster, t, replicas=2, total=2,
      opt_kwargs=dict(one_gradient_per_worker=True, worker_index=t))
             for t in range(2)]
  chief = workers[0]
  path = chief.opt.write_sync_manifest(str(tmp_path))
  manifest = json.loads(pathlib.Path(path).read_text())
  assert manifest["worker_token_queues"] == ["sync_token_q_worker_0",
                                             "sync_token_q_worker_1"]
  session = chief.session()
  try:
    # The chief's start gave each worker queue one token; nobody took any.
    ps = cluster.cluster_spec.job_tasks("ps")[0]
    code, text = _run(["--manifest", path, "--ps", ps])
    assert code == 0, text
    assert "tokens queued: 2" in text
  finally:
    session.close()


def test_write_sync_manifest_creates_a_missing_checkpoint_dir(tmp_path):
  """Issue 28: docs/operations.md's order (the chief writes the manifest to
  its checkpoint_dir, then opens its MonitoredTrainingSession there) on a
  checkpoint_dir that did not exist yet wrote a *file* at that path, and the
  session then failed with "is not a directory"."""
  checkpoint_dir = tmp_path / "not" / "yet"
  with tf.Graph().as_default():
    step = tf.compat.v1.train.get_or_create_global_step()
    var = tf.compat.v1.Variable([1.0, 2.0])
    opt = support.OURS(support.sgd(), replicas_to_aggregate=1)
    train_op = opt.minimize(tf.reduce_sum(var * var), global_step=step)
    written = opt.write_sync_manifest(str(checkpoint_dir))
    assert written == str(checkpoint_dir / "sync_manifest.json")
    assert json.loads(pathlib.Path(written).read_text())["format"] == (
        "sync_replicas.manifest/1")
    with tf.compat.v1.train.MonitoredTrainingSession(
        is_chief=True, checkpoint_dir=str(checkpoint_dir),
        hooks=[opt.make_session_run_hook(True)], stop_grace_period_secs=1,
        config=support.session_config()) as sess:
      sess.run(train_op)
    assert list(checkpoint_dir.glob("model.ckpt-*.index")), sorted(
        p.name for p in checkpoint_dir.iterdir())
    # A name ending in .json is a file, in a directory made for it; an
    # existing file is overwritten, whatever its name.
    named = tmp_path / "elsewhere" / "job.json"
    assert opt.write_sync_manifest(str(named)) == str(named)
    assert named.is_file()
    plain = tmp_path / "manifest"
    plain.write_text("old")
    assert opt.write_sync_manifest(str(plain)) == str(plain)
    assert json.loads(plain.read_text())["replicas_to_aggregate"] == 1
