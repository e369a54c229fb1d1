"""The mcguard command: mcguard version | stress ... | bench ... | demo,
and --include, --libdir, --cmake-dir, --pkgconfig-dir for C and C++ builds
against the installed package (as pybind11 and nanobind offer):

    cmake -Dmcguard_DIR=$(mcguard --cmake-dir) ...
    cc app.c $(PKG_CONFIG_PATH=$(mcguard --pkgconfig-dir) pkg-config --cflags --libs mcguard)
"""

import os
import sys

# The installed package's folder (include/, cmake/, pkgconfig/, the library).
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DIRS = {"--include": "include", "--libdir": "", "--cmake-dir": "cmake", "--pkgconfig-dir": "pkgconfig"}


def prog(command):
    """How a tool names itself in its usage: as the mcguard command's
    subcommand when run through it, else as the module run with -m."""
    if os.path.basename(sys.argv[0]) == "mcguard":
        return "mcguard " + command
    return "%s -m mcguard.tools.%s" % (os.path.basename(sys.executable) or "python3", command)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in _DIRS:
        path = os.path.join(_HERE, _DIRS[cmd]) if _DIRS[cmd] else _HERE
        if not os.path.isdir(path) or (cmd == "--include" and not os.path.exists(os.path.join(path, "mcguard.h"))):
            print("mcguard: %s: not in this installation (%s); install the wheel (pip install .)" % (cmd, path),
                  file=sys.stderr)
            return 2
        print(path)
        return 0
    if cmd == "version":
        from .. import version
        print(version())
        return 0
    if cmd == "stress":
        from . import stress
        return stress.main(rest)
    if cmd == "bench":
        from . import bench
        return bench.main(rest)
    if cmd == "demo":
        from . import demo
        return demo.main(rest)
    print("mcguard: unknown command %r (version, stress, bench, demo, --include, --libdir, --cmake-dir, "
          "--pkgconfig-dir)" % cmd, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
