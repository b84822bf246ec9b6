"""Standard-library-only modules of this repository, loaded by file path.

Loaded by path rather than imported so that a tool needs neither the
package installed nor this checkout on sys.path: the bench's driver and the
test scheduler both use ``sync_replicas/_ports.py``.
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


#: Set by tools/knockout to its patched copy of the package: a child that
#: imports this checkout imports that copy instead, so that the tests of
#: process clusters see the knock-out as in-process tests do.
KNOCKOUT_COPY_ENV = "SYNC_REPLICAS_KNOCKOUT_COPY"


def child_pythonpath(environ=None):
  """PYTHONPATH for a child that imports this checkout: ROOT first (after
  tools/knockout's patched copy, when one is set), then the entries of
  ``environ`` (default: this process's), kept (./tools/test puts
  tests/_hidden there, which hides scikit-learn from Keras:
  tools/_run_tests.py says why)."""
  environ = os.environ if environ is None else environ
  first = [p for p in [environ.get(KNOCKOUT_COPY_ENV)] if p]
  return os.pathsep.join(
      first + [str(ROOT)] + [p for p in [environ.get("PYTHONPATH")] if p])
