"""Builds the extension module kvcache._kvcache with the project's CMake for `pip install .` (pyproject.toml
has the metadata). The libraries are built static (KVC_BUILD_SHARED=OFF) and linked into the module, so the
installed package needs no libkvcache.so and no run path; fmt, xxhash and zstd stay the system's shared
libraries. KVC_PIP_BUILD_DIR sets the CMake build directory (default: setuptools' temporary directory),
KVC_PIP_JOBS the parallel jobs (default: the CPU count)."""
import glob
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.environ.get("KVC_PIP_BUILD_DIR") or os.path.join(os.path.abspath(self.build_temp), "cmake")
        configure = ["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release", "-DKVC_BUILD_SHARED=OFF",
                     "-DKVC_BUILD_TESTS=OFF", "-DKVC_BUILD_BENCH=OFF", "-DKVC_BUILD_TOOLS=OFF",
                     "-DKVC_BUILD_PYTHON=ON", f"-DPython_EXECUTABLE={sys.executable}"]
        if shutil.which("ninja") and not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            configure += ["-G", "Ninja"]
        subprocess.check_call(configure)
        jobs = os.environ.get("KVC_PIP_JOBS") or str(os.cpu_count() or 1)
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "kvcache_python", "--parallel", jobs])
        built = glob.glob(os.path.join(build_dir, "python", "kvcache", "_kvcache*.so"))
        if len(built) != 1:
            raise RuntimeError(f"kvcache: expected one built module in {build_dir}/python/kvcache, found {built}")
        dest = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(built[0], dest)


setup(ext_modules=[CMakeExtension("kvcache._kvcache")], cmdclass={"build_ext": CMakeBuild})
