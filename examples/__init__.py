"""The example programs (``python -m examples.NAME`` from the clone's root).

Imported before any example, so before TensorFlow: TensorFlow reads its log
settings from the environment once, when it loads. Unless the environment
says otherwise, the examples print only their own lines:

* ``TF_CPP_MIN_LOG_LEVEL=2``: no INFO or WARNING lines from TensorFlow's C++
  (server start-up, "Local rendezvous is aborting ... Cleanup" when a step's
  leftover transfers are dropped, which is routine);
* ``TF_ENABLE_ONEDNN_OPTS=0``: TensorFlow 2.21 announces its oneDNN kernels
  whatever the log level says, twice per process (two of its libraries log
  it), and only turning those kernels off silences it. Set
  ``TF_ENABLE_ONEDNN_OPTS=1`` to have them (and the notice) back.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
