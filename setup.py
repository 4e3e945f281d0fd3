"""Build psd and its C extension psd._native (C11, -O3, OpenMP, pthreads; the optimizer kernels also
for AVX2 and AVX-512, picked at load time: native/psd.h PSD_KERNEL).

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
    # -fno-math-errno: sqrtf is the packed square root, with no libm call to set errno (nothing reads it)
    extra_compile_args=["-std=c11", "-O3", "-fno-math-errno", "-fopenmp", "-pthread", "-Wall", "-Wextra", *extra],
    extra_link_args=["-fopenmp", "-pthread"],
    libraries=["m"],
)

setup(
    packages=["psd", "psd.bench", "psd.learner", "psd.watchdog"],
    package_dir={"psd": "psd", "psd.learner": "learner", "psd.watchdog": "watchdog"},
    ext_modules=[native],
)
