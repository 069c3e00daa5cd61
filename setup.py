"""Packaging for mxamp.

MXNet ships its CPU and CUDA builds as two distributions that install the same
``mxnet`` module, so exactly one of them may be installed.  The CPU build is the
default; set ``MXAMP_MXNET_BUILD=cu112`` when installing on an NVIDIA machine to
depend on ``mxnet-cu112`` instead (the ``cu112`` extra names it explicitly)::

    MXAMP_MXNET_BUILD=cu112 pip install -c constraints.txt '.[cu112]'
"""
import os

from setuptools import find_packages, setup

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
    python_requires='>=3.8',
    install_requires=[
        _MXNET_BUILDS[_build],
        'numpy<1.24',
        'gluoncv==0.10.5.post0',
        'opencv-python<4.12',
        'tqdm',
    ],
    extras_require={
        'cu112': [_MXNET_BUILDS['cu112']],
        'test': ['pytest', 'hypothesis', 'scikit-learn', 'matplotlib', 'docutils', 'pyflakes'],
        'demo': ['scikit-learn', 'matplotlib'],
    },
    entry_points={'console_scripts': ['mxamp = mxamp.cli:main']},
    classifiers=[
        'Programming Language :: Python :: 3',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
)
