"""Standard-library-only modules of this repository, loaded by file path.

Importing the package would import TensorFlow (seconds, for its
``__init__``) into tools that need only such modules: the launcher, the
bench's driver and the test scheduler all use ``sync_replicas/_ports.py``.
"""

import importlib.util
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(relative, name):
  """The module at ``ROOT / relative``, executed afresh as ``name``."""
  spec = importlib.util.spec_from_file_location(name, ROOT / relative)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def ports():
  """``sync_replicas/_ports.py``: free loopback ports, the port range."""
  return load("sync_replicas/_ports.py", "_sync_replicas_ports")


def child_pythonpath():
  """PYTHONPATH for a child that imports this checkout: ROOT first, then the
  caller's own entries, kept (./tools/test puts tests/_hidden there, which
  hides scikit-learn from Keras: tools/_run_tests.py says why)."""
  return os.pathsep.join(
      [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
