"""A stand-in that hides Keras from the processes the tests start.

``import tensorflow`` imports Keras (3 on TensorFlow 2.16+, 2 on 2.15) for
its ``tf.keras`` alias and optimizer registry, and quietly goes on when that
fails. No task, tool or example process of the suite uses Keras (the
package's graph-mode protocol never touches it), yet the import costs about
0.85 of the ~2.7 CPU-seconds of ``import tensorflow`` on 2.21 (Keras 3 also
imports matplotlib), 0.35 on 2.15, in each of the suite's ~140 such
processes. tests/conftest.py puts this folder first on the PYTHONPATH the
tests' processes inherit; the pytest processes themselves keep Keras
(test_keras and test_validation use it). A child that needs it (the
Estimator, on 2.15) gets ``support.with_keras()``'s environment.
"""

raise ImportError(
    "keras is hidden in the processes the test suite starts: "
    "tests/conftest.py puts tests/_hidden_from_tasks first on their "
    "PYTHONPATH, so that `import tensorflow` skips Keras (about 0.85 s of "
    "CPU per process on TensorFlow 2.21). A test whose child process needs "
    "Keras starts it with support.with_keras()'s environment.", name="keras")
