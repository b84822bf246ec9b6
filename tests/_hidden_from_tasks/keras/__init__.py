"""A stand-in that hides Keras from the test suite's processes.

``import tensorflow`` imports Keras (3 on TensorFlow 2.16+, 2 on 2.15) for
its ``tf.keras`` alias and optimizer registry, and quietly goes on when that
fails. No task, tool or example process of the suite uses Keras (the
package's graph-mode protocol never touches it), yet the import costs about
0.85 of the ~2.7 CPU-seconds of ``import tensorflow`` on 2.21 (Keras 3 also
imports matplotlib), 0.35 on 2.15, in each of the suite's ~140 such
processes; about 1 of the ~4.5 a pytest process takes to start on 2.21.
tests/conftest.py puts this folder first on the PYTHONPATH the
tests' processes inherit, and tools/test (tools/_run_tests.py) on that of
every pytest process whose files are not marked ``keras``; the marked ones
(test_keras, test_validation, ...) keep it, and so does every pytest process
under SYNC_REPLICAS_TEST_KEEP_KERAS=1. A child that needs Keras (the
Estimator, on 2.15) gets ``support.with_keras()``'s environment.
"""

raise ImportError(
    "keras is hidden in the processes the test suite starts: "
    "tests/conftest.py puts tests/_hidden_from_tasks first on their "
    "PYTHONPATH, so that `import tensorflow` skips Keras (about 0.85 s of "
    "CPU per process on TensorFlow 2.21), and tools/test does so for every "
    "pytest process whose files are not marked keras. A test whose child "
    "process needs Keras starts it with support.with_keras()'s environment; "
    "a test file that uses Keras itself sets pytestmark = pytest.mark.keras "
    "(or run with SYNC_REPLICAS_TEST_KEEP_KERAS=1).", name="keras")
