"""mxamp: mixed-precision training for Apache MXNet 1.9.1 (Gluon and Symbol API)."""
__version__ = '0.1.0'
