"""Builds the compiled data plane (native/plane.c, frames.c, stream.c, receiver.c, pushes.c, writer.c -> redsrv.core._plane);
everything else is in pyproject.toml.

The extension is optional: where it cannot be compiled (no C compiler, no Python headers) the
install goes on with one warning and redsrv runs its Python plane (core/plane.py). Build
switches, for CI and developers only:
  REDSRV_NATIVE_STRICT=1    warnings are errors, and a failed build fails the install
  REDSRV_NATIVE_SANITIZE=1  AddressSanitizer and UndefinedBehaviorSanitizer (tox -e native-asan)
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

STRICT = os.environ.get("REDSRV_NATIVE_STRICT") == "1"
SANITIZE = os.environ.get("REDSRV_NATIVE_SANITIZE") == "1"

# No fused multiply-add: the kernels must round exactly as NumPy's separate operations do. No
# trapping math: lets the compiler compute both sides of a select (vectorised conversions); redsrv
# never reads the floating-point exception flags.
compile_args = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-Wall", "-Wextra",
                "-Wconversion", "-Wno-sign-conversion", "-Wno-unused-parameter"]
link_args = []
if STRICT:
    compile_args.append("-Werror")
if SANITIZE:
    # target_clones' ifuncs resolve before the sanitizer runtime is up: one plain build instead.
    compile_args += ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g",
                     "-DREDSRV_NO_CLONES"]
    link_args += ["-fsanitize=address,undefined"]


class OptionalBuildExt(build_ext):
    """Builds the plane where it can; elsewhere warns once and installs the Python plane."""

    def finalize_options(self):
        super().finalize_options()
        # Always compile (one file, a second): a sanitized build and a plain one share build/,
        # and setuptools would otherwise take the other's library as up to date.
        self.force = True

    def run(self):
        try:
            super().run()
        except Exception as exc:  # setuptools raises several types for "no compiler"
            self._give_up(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._give_up(exc)

    def _give_up(self, exc):
        if STRICT:
            raise exc
        # A library an earlier build left in build/ must not ship as if this one had made it.
        for ext in self.extensions:
            stale = self.get_ext_fullpath(ext.name)
            if os.path.exists(stale):
                os.remove(stale)
        print(f"WARNING: redsrv's compiled data plane was not built ({exc}); redsrv will run its Python "
              "plane, which is slower. Install a C compiler and Python's headers, then reinstall, to build it.",
              file=sys.stderr)


setup(
    ext_modules=[Extension("redsrv.core._plane",
                           ["native/plane.c", "native/frames.c", "native/stream.c", "native/receiver.c", "native/pushes.c",
                            "native/writer.c", "native/forward.c"],
                           depends=["native/frames.h", "native/stream.h", "native/receiver.h", "native/pushes.h",
                                    "native/writer.h", "native/forward.h", "native/plane.h"],
                           extra_compile_args=compile_args,
                           extra_link_args=link_args)] if os.name == "posix" else [],
    cmdclass={"build_ext": OptionalBuildExt},
)
