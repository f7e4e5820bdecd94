"""Build the C core (tensorsocket._core) from csrc/.

Environment switches:
  TENSORSOCKET_WERROR=1    add -Werror (CI sets it)
  TENSORSOCKET_SANITIZE=1  build with AddressSanitizer + UndefinedBehaviorSanitizer
"""

import os
from glob import glob

from setuptools import Extension, setup

# csrc/base (OS primitives, errors), csrc/device (the device interface, the CUDA backend),
# csrc/ring (the ring, DLPack export), csrc/store (the decoded-sample store), csrc/binding (the module: the only Python.h user).
SOURCES = sorted(glob("csrc/*/ts_*.c"))

compile_args = ["-std=c11", "-Wall", "-Wextra", "-O2", "-fvisibility=hidden"]
link_args = []
if os.environ.get("TENSORSOCKET_WERROR") == "1":
    compile_args.append("-Werror")
if os.environ.get("TENSORSOCKET_SANITIZE") == "1":
    sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g", "-O1"]
    compile_args += sanitize
    link_args += ["-fsanitize=address,undefined"]

setup(
    ext_modules=[
        Extension(
            "tensorsocket._core",
            sources=SOURCES,
            include_dirs=["csrc"],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            libraries=["dl", "pthread", "rt"],
        )
    ],
)
