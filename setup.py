# The native extension is declared here because cffi's setuptools hook reads
# ``cffi_modules`` from setup(); all other metadata lives in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["offload/_build_native.py:ffibuilder"])
