"""The install step's part beyond pyproject.toml: next to libmixstack.so
(setuptools-rust), build libmixstack_torch.so, the ops' C++ registration,
against the torch of the installing environment (mixstack_torch/_ext.py),
with mixstack.h copied into the package for builds on first use.

    pip install --no-build-isolation ./python     # torch importable: builds the op library

Under pip's default build isolation torch is not importable here (and a
torch installed only for the build could differ from the one the op runs
with): the op library is then built on first use instead (_ext.py).
"""

import importlib.util
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithTorchOp(build_py):
    def run(self):
        super().run()
        pkg = os.path.join(self.build_lib, "mixstack_torch")
        os.makedirs(os.path.join(pkg, "include"), exist_ok=True)
        shutil.copy(os.path.join(HERE, "..", "include", "mixstack.h"), os.path.join(pkg, "include"))
        if importlib.util.find_spec("torch") is None:
            print("mixstack_torch: torch is not importable here; libmixstack_torch.so is built on first use")
            return
        # _ext.py by path: importing the package would load the ops.
        spec = importlib.util.spec_from_file_location("_mixstack_ext", os.path.join(HERE, "mixstack_torch", "_ext.py"))
        ext = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ext)
        print("mixstack_torch: built", ext.build(pkg))


setup(cmdclass={"build_py": BuildPyWithTorchOp})
