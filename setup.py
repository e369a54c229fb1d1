"""The wheel's build: the Go library (go build -buildmode=c-shared, the
same command as `make build`), the public header, and the CMake and
pkg-config files a C or C++ build finds them with, all inside the mcguard
package. Needs Go, pkg-config and libzmq's headers, as `make build` does."""

import hashlib
import os
import re
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))


def version():
    with open(os.path.join(HERE, "include", "mcguard.h")) as f:
        return re.search(r'^#define MC_GUARD_VERSION_STRING "([0-9.]+)"', f.read(), re.M).group(1)


CMAKE_CONFIG = """# find_package(mcguard) -> the imported target mcguard::mcguard, from the Python package.
get_filename_component(_mcguard_dir "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
if(NOT TARGET mcguard::mcguard)
  add_library(mcguard::mcguard SHARED IMPORTED)
  set_target_properties(mcguard::mcguard PROPERTIES
    IMPORTED_LOCATION "${_mcguard_dir}/libmcguard.so"
    IMPORTED_SONAME "libmcguard.so"
    INTERFACE_INCLUDE_DIRECTORIES "${_mcguard_dir}/include")
endif()
set(mcguard_FOUND TRUE)
unset(_mcguard_dir)
"""

CMAKE_VERSION = """set(PACKAGE_VERSION "{v}")
set(PACKAGE_VERSION_COMPATIBLE FALSE)
if(PACKAGE_FIND_VERSION_MAJOR EQUAL {major} AND PACKAGE_FIND_VERSION_MINOR EQUAL {minor}
   AND NOT PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_FIND_VERSION VERSION_EQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
"""

PKG_CONFIG = """prefix=${{pcfiledir}}/..
libdir=${{prefix}}
includedir=${{prefix}}/include

Name: mcguard
Description: Verified KV-cache transfers for disaggregated LLM serving
Version: {v}
Libs: -L${{libdir}} -Wl,-rpath,${{libdir}} -lmcguard
Cflags: -I${{includedir}}
"""


class BuildWithGo(build_py):
    """build_py, then the library and its C-side files into the package."""

    def run(self):
        super().run()
        pkg = os.path.join(os.path.abspath(self.build_lib), "mcguard")
        lib = os.path.join(pkg, "libmcguard.so")
        script = os.path.join(HERE, "export", "mcguard.map")
        # Go's build cache does not see include/mcguard.h change (outside
        # export/): its checksum in the C flags recompiles the C shims, as
        # the Makefile does.
        with open(os.path.join(HERE, "include", "mcguard.h"), "rb") as f:
            header_sum = hashlib.sha1(f.read()).hexdigest()[:12]
        env = dict(os.environ, CGO_CFLAGS="%s -DMCG_HEADER_SUM=%s" % (os.environ.get("CGO_CFLAGS", "-O2 -g"), header_sum))
        subprocess.run(["go", "build", "-buildmode=c-shared", "-o", lib,
                        "-ldflags", "-extldflags=-Wl,--version-script=%s,-soname,libmcguard.so" % script, "./export"],
                       cwd=HERE, check=True, env=env)
        os.remove(os.path.join(pkg, "libmcguard.h"))  # cgo's header; the public one follows
        v = version()
        major, minor = v.split(".")[:2]
        for sub, name, text in (("include", "mcguard.h", None),
                                ("cmake", "mcguardConfig.cmake", CMAKE_CONFIG),
                                ("cmake", "mcguardConfigVersion.cmake", CMAKE_VERSION.format(v=v, major=major, minor=minor)),
                                ("pkgconfig", "mcguard.pc", PKG_CONFIG.format(v=v))):
            os.makedirs(os.path.join(pkg, sub), exist_ok=True)
            if text is None:
                shutil.copy(os.path.join(HERE, "include", name), os.path.join(pkg, sub, name))
            else:
                with open(os.path.join(pkg, sub, name), "w") as f:
                    f.write(text)


class BinaryDistribution(Distribution):
    """A wheel for this platform: it carries a native library."""

    def has_ext_modules(self):
        return True


# mc_guard_transfer and mc_guard_sync_transfers without ctypes (python/mcguard/_fastcall.c). Optional:
# without Python's headers the wheel still builds, and ctypes serves.
FASTCALL = Extension("mcguard._fastcall", ["python/mcguard/_fastcall.c"], include_dirs=["include"], optional=True)

setup(version=version(), distclass=BinaryDistribution, cmdclass={"build_py": BuildWithGo}, ext_modules=[FASTCALL])
