"""A stand-in that hides scikit-learn from the test suite's processes.

On TensorFlow 2.21, ``import tensorflow`` imports Keras 3, whose
scikit-learn wrappers (keras/src/wrappers/) try ``import sklearn`` and fall
back quietly when it fails (2.15's Keras 2 does not try). Importing the real
one, with more of SciPy, costs about 1.2 of the ~6 CPU-seconds of ``import
tensorflow`` (measured on 2 cores), in each of the suite's ~125 TensorFlow
processes, for wrappers no test uses. tools/_run_tests.py (./tools/test)
puts this folder first on PYTHONPATH, which every child inherits. The digits
examples read scikit-learn's data file without importing it
(examples/_digits.py); a test that needs the real package runs a child with
``support.without_hidden()``.
"""

raise ImportError(
    "sklearn is hidden in the test suite's processes: tools/_run_tests.py "
    "puts tests/_hidden first on PYTHONPATH so that `import tensorflow` "
    "skips Keras's scikit-learn wrapper (about 1.2 s of CPU per process). "
    "A test that needs the real scikit-learn runs a child process with "
    "support.without_hidden().", name="sklearn")
