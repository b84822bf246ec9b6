"""The examples as a package, so that tests import their ``main(argv)``."""
