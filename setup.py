"""Build psd and its C extension psd._native (C11, -O3, OpenMP, pthreads).

No -march=native: the default build must run on any x86-64. Set
PSD_NATIVE_CFLAGS to add flags for a local build (e.g. "-march=native").
"""

import glob
import os

from setuptools import Extension, setup

extra = os.environ.get("PSD_NATIVE_CFLAGS", "").split()

native = Extension(
    "psd._native",
    sources=sorted(glob.glob("native/*.c")),
    depends=sorted(glob.glob("native/*.h")),
    include_dirs=["native"],
    extra_compile_args=["-std=c11", "-O3", "-fopenmp", "-pthread", "-Wall", "-Wextra", *extra],
    extra_link_args=["-fopenmp", "-pthread"],
    libraries=["m"],
)

setup(
    packages=["psd", "psd.bench", "psd.learner", "psd.watchdog"],
    package_dir={"psd": "psd", "psd.learner": "learner", "psd.watchdog": "watchdog"},
    ext_modules=[native],
)
