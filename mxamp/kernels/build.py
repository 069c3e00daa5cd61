"""Building mxamp's own oneDNN 3 convolution when mxamp is installed (used by setup.py).

Owns the build of ``_native/libmxamp_own_conv.so`` from ``csrc/`` (beside this file)
against oneDNN 3.2 from the package registry: headers from
``onednn-devel-cpu-gomp``, the library from ``onednn-cpu-gomp`` (GNU OpenMP,
the runtime MXNet 1.9.1 uses), both build requirements in pyproject.toml and
found through their installed files.  The build is optional: without a C++
compiler, or on a platform without those wheels, it writes why into
``_native/own_conv_not_built.txt`` and mxamp installs without it
(:mod:`mxamp.kernels.operators` then says so and MXNet's convolution runs).

In setup.py, ``build_own_conv`` runs as a sub-command of ``build`` (``pip
install .``) and of setuptools' editable wheel (``pip install -e .``), which
sets ``editable_mode``: the library then goes into the source tree.
:class:`BinaryDistribution` marks the wheel as platform-specific, since it
carries a shared library.  After editing ``csrc/`` in a checkout installed with
``pip install -e .``, ``python mxamp/kernels/build.py`` rebuilds in place.
"""
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from setuptools import Command, Distribution
from setuptools.command.build import build

# The project's root: setup.py loads this file from mxamp/kernels/ before mxamp is installed.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CSRC = os.path.join('mxamp', 'kernels', 'csrc')
SOURCES = tuple(os.path.join(_CSRC, name) for name in (
    'onednn_runtime.cc', 'onednn_conv.cc', 'onednn_batch_norm.cc', 'onednn_pooling.cc',
    'onednn_attention.cc', 'onednn_layer_norm.cc', 'master_weights.cc', 'fan_out.cc',
    'move_channels.cc', 'clip.cc', 'dropout.cc', 'bfloat16_batch_norm.cc', 'masked_softmax.cc',
    'mxnet_extension.cc'))
HEADERS = tuple(os.path.join(_CSRC, name) for name in (
    'onednn_runtime.h', 'onednn_conv.h', 'onednn_batch_norm.h', 'onednn_pooling.h',
    'onednn_attention.h', 'onednn_layer_norm.h', 'master_weights.h', 'fan_out.h',
    'move_channels.h', 'clip.h', 'dropout.h', 'bfloat16_batch_norm.h', 'masked_softmax.h',
    'vector_isa.h',
    'mxnet_lib_api_v11.h'))
LIBRARY = 'libmxamp_own_conv.so'
NOT_BUILT_NOTE = 'own_conv_not_built.txt'  # read by mxamp/kernels/operators.py
NATIVE_PACKAGE_DIR = os.path.join('mxamp', 'kernels', '_native')
HEADERS_DISTRIBUTION = 'onednn-devel-cpu-gomp'
LIBRARY_DISTRIBUTION = 'onednn-cpu-gomp'
ONEDNN_SONAME = 'libdnnl.so.3'
# -fopenmp: the master-weight kernel's loop runs on the calling thread's OpenMP team, in the
# GNU OpenMP runtime MXNet and oneDNN's wheel use (one libgomp.so.1 in the process).
COMPILE_FLAGS = ('-std=c++14', '-O2', '-fPIC', '-fvisibility=hidden', '-DNDEBUG', '-Wall',
                 '-fopenmp')
# -z defs: every symbol resolved at link time (against oneDNN's real library), not at the
# first call.  No rpath: mxamp.kernels.operators loads libdnnl.so.3 by path before this library.
LINK_FLAGS = ('-shared', '-fopenmp', '-Wl,-z,defs', '-Wl,--as-needed')


class NotBuilt(Exception):
    """The library cannot be built here; the message says why, in one line."""


def _installed_file(distribution, name):
    """The path of the installed file `name` of `distribution` (a wheel in this environment)."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise NotBuilt('%s is not installed in the build environment' % distribution) from None
    for entry in files:
        if entry.name == name:
            return os.path.normpath(str(entry.locate()))
    raise NotBuilt('%s lists no %s' % (distribution, name))


def onednn_paths():
    """``(include directory, library directory)`` of oneDNN 3 in this environment."""
    if sys.platform != 'linux' or platform.machine() not in ('x86_64', 'AMD64'):
        raise NotBuilt('no oneDNN 3 wheel for %s %s' % (sys.platform, platform.machine()))
    header = _installed_file(HEADERS_DISTRIBUTION, 'dnnl.hpp')
    if os.path.basename(os.path.dirname(header)) != 'dnnl':  # the top-level dnnl.hpp: go down
        header = os.path.join(os.path.dirname(header), 'oneapi', 'dnnl', 'dnnl.hpp')
    include = os.path.dirname(os.path.dirname(os.path.dirname(header)))
    library = _installed_file(LIBRARY_DISTRIBUTION, ONEDNN_SONAME)
    return include, os.path.dirname(library)


def _compiler():
    compiler = os.environ.get('CXX') or shutil.which('g++') or shutil.which('c++')
    if not compiler:
        raise NotBuilt('no C++ compiler (g++, or $CXX)')
    return compiler


def _run(commands):
    """Run the commands in parallel; NotBuilt with the first failure's last lines."""
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  universal_newlines=True) for command in commands]
    failures = []
    for command, process in zip(commands, processes):
        output = process.communicate()[0]
        if process.returncode != 0:
            failures.append('%s failed: %s' % (' '.join(command[:2]),
                                               ' | '.join(output.strip().splitlines()[-3:])))
    if failures:
        raise NotBuilt(failures[0])


def build_library(output, temp_dir):
    """Compile and link the library into `output`; returns the seconds it took.

    Raises
    ------
    NotBuilt
        When it cannot be built here, with why.
    """
    started = time.time()
    include, library_dir = onednn_paths()
    compiler = _compiler()
    objects, commands = [], []
    for source in SOURCES:
        obj = os.path.join(temp_dir, os.path.basename(source) + '.o')
        objects.append(obj)
        commands.append([compiler, *COMPILE_FLAGS, '-I', include, '-c',
                         os.path.join(ROOT, source), '-o', obj])
    _run(commands)  # one compiler per source, side by side
    linked = os.path.join(temp_dir, LIBRARY)
    _run([[compiler, *LINK_FLAGS, '-o', linked, *objects, '-L', library_dir,
           '-l:' + ONEDNN_SONAME]])
    os.makedirs(os.path.dirname(output), exist_ok=True)
    shutil.move(linked, output)
    return time.time() - started


def build_into(native_dir, temp_dir, announce):
    """Build into `native_dir`, or leave the reason there; `announce(message)` tells the user."""
    note = os.path.join(native_dir, NOT_BUILT_NOTE)
    try:
        seconds = build_library(os.path.join(native_dir, LIBRARY), temp_dir)
    except NotBuilt as why:
        os.makedirs(native_dir, exist_ok=True)
        with open(note, 'w') as handle:
            handle.write('%s\n' % why)
        announce("mxamp: own oneDNN 3 convolution not built (%s); mxamp works without it, "
                 "with MXNet's convolution" % why)
        return False
    if os.path.exists(note):
        os.remove(note)
    announce('mxamp: built %s in %.1f s' % (os.path.join(native_dir, LIBRARY), seconds))
    return True


class BuildOwnConv(Command):
    """``build_own_conv``: the library, into build_lib (or the source tree when editable)."""

    description = "build mxamp's own oneDNN 3 convolution library, when it can be built"
    user_options: list = []

    def initialize_options(self):
        self.build_lib = None
        self.build_temp = None
        self.editable_mode = False  # set by setuptools' editable_wheel (pip install -e)

    def finalize_options(self):
        self.set_undefined_options('build', ('build_lib', 'build_lib'),
                                   ('build_temp', 'build_temp'))

    def _native_dir(self):
        return os.path.join(ROOT if self.editable_mode else self.build_lib, NATIVE_PACKAGE_DIR)

    def run(self):
        os.makedirs(self.build_temp, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.build_temp) as temp_dir:
            build_into(self._native_dir(), temp_dir, lambda message: self.announce(message, 3))

    def get_outputs(self):
        return [os.path.join(self._native_dir(), name) for name in (LIBRARY, NOT_BUILT_NOTE)
                if os.path.exists(os.path.join(self._native_dir(), name))]

    def get_output_mapping(self):
        return {}

    def get_source_files(self):
        return list(SOURCES + HEADERS)


class BuildWithOwnConv(build):
    """setuptools' ``build`` with ``build_own_conv`` last among its sub-commands."""

    sub_commands = build.sub_commands + [('build_own_conv', None)]


class BinaryDistribution(Distribution):
    """A distribution whose wheel is platform-specific: it may carry the built library."""

    def has_ext_modules(self):
        return True


def main():
    """``python mxamp/kernels/build.py``: rebuild the library in this checkout (after editing csrc/)."""
    with tempfile.TemporaryDirectory() as temp_dir:
        built = build_into(os.path.join(ROOT, NATIVE_PACKAGE_DIR), temp_dir, print)
    return 0 if built else 1


if __name__ == '__main__':
    sys.exit(main())
