"""Fixtures shared by every test module."""

import os

# Quiet TensorFlow's C++ start-up chatter; tests read Python-side logs only.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import support  # pylint: disable=g-import-not-at-top
import sync_replicas  # pylint: disable=g-import-not-at-top


def pytest_configure(config):
  # Registered here rather than in setup.cfg: tools/_env.sh reinstalls every
  # venv when setup.cfg changes.
  config.addinivalue_line(
      "markers", "quick: the inner loop's tests (./tools/test --quick): "
      "unit, validation, graph parity, hook and scenario tests, under a "
      "minute together; a module sets pytestmark = pytest.mark.quick")
  config.addinivalue_line(
      "markers", "wheel: builds the package's wheel and installs it into a "
      "fresh venv under the temporary directory (tests/test_wheel.py, about "
      "a minute on 2 cores, most of it the TensorFlow imports of a demo "
      "cluster; a few MB of disk)")


@pytest.fixture(params=["stock", "ours"])
def impl(request):
  """Each side-by-side test runs once with stock's class and once with ours."""
  return {"stock": support.STOCK, "ours": support.OURS}[request.param]


@pytest.fixture
def graph():
  """A fresh default graph for building-only tests."""
  g = tf.Graph()
  with g.as_default():
    yield g


@pytest.fixture
def half_way(tmp_path):
  """A live job: the chief pushed once, 1 of 2 gradients, 1 token queued.

  Yields ``(cluster, manifest path, state, workers, sessions)``; ``state()``
  reads ``[global step, tokens queued, [gradients per accumulator]]``, which
  tools that must change nothing are checked against.
  """
  cluster = sync_replicas.LocalCluster(num_workers=2, num_ps=1)
  workers = [support.LinearWorker(support.OURS, cluster, t, replicas=2,
                                  total=2) for t in range(2)]
  chief, other = workers
  with chief.graph.as_default():
    # Built before the session: a finalized graph takes no new ops.
    reads = [chief.global_step, chief.opt.token_queue.size(),
             [a.num_accumulated() for a, _ in chief.opt.accumulators]]
  path = chief.opt.write_sync_manifest(str(tmp_path))
  sessions = [chief.session()]
  try:
    sessions.append(other.session())
    sessions[0].run(chief.train_op)
    state = lambda: sessions[0].run(reads)  # pylint: disable=unnecessary-lambda
    assert state() == [0, 1, [1]]
    yield cluster, path, state, workers, sessions
  finally:
    for s in reversed(sessions):
      s.close()
