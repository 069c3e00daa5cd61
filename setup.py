"""Packaging for mxamp.

MXNet ships its CPU and CUDA builds as two distributions that install the same
``mxnet`` module, so exactly one of them may be installed.  The CPU build is the
default; set ``MXAMP_MXNET_BUILD=cu112`` when installing on an NVIDIA machine to
depend on ``mxnet-cu112`` instead (the ``cu112`` extra names it explicitly)::

    MXAMP_MXNET_BUILD=cu112 pip install -c constraints.txt '.[cu112]'

Python 3.8 to 3.12: MXNet 1.9.1 needs numpy < 2, and numpy 1.x has no wheels for
Python 3.13.  On Python 3.12 (numpy 1.26) two things that MXNet 1.9.1 takes for
granted are gone: distutils (setuptools provides it) and numpy's ``bool``/``int``/
``float`` aliases (the start-up hook ``_mxamp_numpy_aliases.py`` restores them).
"""
import importlib.util
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py



def _load_kernel_build():
    """mxamp/kernels/build.py, loaded by path: the package itself imports MXNet, which
    building does not need."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'mxamp', 'kernels', 'build.py')
    spec = importlib.util.spec_from_file_location('mxamp_kernels_build', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# mxamp's own oneDNN 3 kernels, built when they can be.
_kernel_build = _load_kernel_build()
BinaryDistribution, BuildOwnConv, BuildWithOwnConv = (
    _kernel_build.BinaryDistribution, _kernel_build.BuildOwnConv, _kernel_build.BuildWithOwnConv)

# The start-up hook: a module and a .pth file that imports it at every interpreter start
# (site.py runs the .pth files of site-packages), so numpy's aliases are back before
# anyone's first `import mxnet` (see _mxamp_numpy_aliases.py).
_HOOK_MODULE = '_mxamp_numpy_aliases.py'
_HOOK_PTH = 'mxamp-numpy-aliases.pth'


class BuildPyWithStartupHook(build_py):
    """build_py that also puts the start-up hook's two files at the top of the wheel (site-packages)."""

    def run(self):
        super().run()
        if getattr(self, 'editable_mode', False):
            # `pip install -e` (setuptools >= 64 builds an editable wheel): build_lib is thrown
            # away there, and the wheel's top is the `install` command's install_lib.
            top = self.get_finalized_command('install').install_lib
        else:
            top = self.build_lib
        self.mkpath(top)
        self.copy_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), _HOOK_MODULE),
                       os.path.join(top, _HOOK_MODULE))
        with open(os.path.join(top, _HOOK_PTH), 'w') as handle:
            handle.write('import _mxamp_numpy_aliases\n')

_GLUONTS = 'gluonts==0.17.0; python_version >= "3.10" and python_version < "3.12"'
_MXNET_BUILDS = {'cpu': 'mxnet==1.9.1', 'cu112': 'mxnet-cu112==1.9.1'}
_build = os.environ.get('MXAMP_MXNET_BUILD', 'cpu')
if _build not in _MXNET_BUILDS:
    raise SystemExit("MXAMP_MXNET_BUILD=%r: expected one of %s" % (_build, ', '.join(sorted(_MXNET_BUILDS))))

setup(
    name='mxamp',
    version='0.1.0',
    description='Mixed-precision (float16 / bfloat16) training for Apache MXNet 1.9.1, Gluon and Symbol API',
    long_description=open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'README.rst')).read(),
    long_description_content_type='text/x-rst',
    license='Apache-2.0',
    packages=find_packages(include=['mxamp', 'mxamp.*']),
    # Measured data: where bfloat16 pays per layer (mxamp.cost) and the choice of mxamp's own
    # convolution (mxamp.kernels.choice).
    package_data={'mxamp': ['cost_table.json'], 'mxamp.kernels': ['choice_table.json']},
    python_requires='>=3.8,<3.13',
    install_requires=[
        _MXNET_BUILDS[_build],
        # numpy 2 removed np.PZERO & co., used by MXNet 1.9.1.  numpy 1.23, the last with the
        # aliases (np.bool...), has no Python 3.12 wheels; 1.26 is the first numpy that has.
        'numpy<1.24; python_version < "3.12"',
        'numpy>=1.26,<2; python_version >= "3.12"',
        'setuptools; python_version >= "3.12"',  # distutils, which MXNet 1.9.1 imports, left the stdlib in 3.12
        # numpy's bfloat16 dtype (mxamp.dtypes.to_numpy).  0.5.x needs Python >= 3.9; 0.2.0 is the
        # last for 3.8; both take the numpy above.  Pinned: the 0.5.x releases after 0.5.1 have
        # wheels for glibc >= 2.27 only, so pip would build them from source on older systems.
        'ml-dtypes==0.2.0; python_version < "3.9"',
        'ml-dtypes==0.5.1; python_version >= "3.9"',
        # oneDNN 3 for mxamp's own convolution (mxamp.kernels.operators); GNU OpenMP, like MXNet 1.9.1.
        'onednn-cpu-gomp==2023.2.0; platform_system == "Linux" and platform_machine == "x86_64"',
        'gluoncv==0.10.5.post0',
        'opencv-python<4.12',
        'tqdm',
    ],
    extras_require={
        'cu112': [_MXNET_BUILDS['cu112']],
        # GluonNLP's models (tests/test_partial_conversion.py): an optional family, never needed
        # by mxamp itself; its tests skip without it.
        'nlp': ['gluonnlp==0.10.0'],
        # GluonTS's MXNet forecasters (mxamp.gluonts): likewise optional.  0.17 needs Python
        # 3.10 or later, and numpy >= 1.24 on 3.12, which MXNet 1.9.1 cannot import.
        'gluonts': [_GLUONTS],
        'test': ['pytest', 'hypothesis', 'scikit-learn', 'matplotlib', 'docutils', 'pyflakes', 'mypy',
                 'gluonnlp==0.10.0', _GLUONTS],
        'demo': ['scikit-learn', 'matplotlib'],
        # The manual (`make docs`): Sphinx 7.1 is the last release for Python 3.8, 7.4 the last
        # for 3.9; one pinned line each, so a warning (an error under -W) is the same everywhere.
        'docs': ['sphinx==7.1.2; python_version < "3.9"',
                 'sphinx==7.4.7; python_version >= "3.9"'],
    },
    entry_points={'console_scripts': ['mxamp = mxamp.cli:main']},
    cmdclass={'build_py': BuildPyWithStartupHook, 'build': BuildWithOwnConv,
              'build_own_conv': BuildOwnConv},
    distclass=BinaryDistribution,
    classifiers=[
        'Programming Language :: Python :: 3',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
)
