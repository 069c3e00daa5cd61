"""mxamp's version, in one place: the package (``mxamp.__version__``), ``mxamp --version``
and ``mxamp info`` read it here."""
__version__ = '0.1.0'
