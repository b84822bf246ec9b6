"""Fixtures shared by every test module."""

import os

# Quiet TensorFlow's C++ start-up chatter; tests read Python-side logs only.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import support  # pylint: disable=g-import-not-at-top


def pytest_configure(config):
  # Registered here rather than in setup.cfg: tools/_env.sh reinstalls every
  # venv when setup.cfg changes.
  config.addinivalue_line(
      "markers", "quick: the inner loop's tests (./tools/test --quick): "
      "unit, validation, graph parity, hook and scenario tests, under a "
      "minute together; a module sets pytestmark = pytest.mark.quick")


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
