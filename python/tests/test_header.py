"""The C header is the one source of the numbers that cross the ABI: every
status code, verify mode, flag, struct layout and the version that the
Python binding uses must be the header's. Change either side alone and
this fails."""

import ctypes
import os
import re
import subprocess

import pytest

import mcguard
from mcguard import abi
from mcguard.abi import STATUS_NAMES, VERIFY_MODES

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "include", "mcguard.h")


def header():
    with open(HEADER) as f:
        return f.read()


def defines(prefix):
    """{name: int value} of the header's #define PREFIX... lines."""
    out = {}
    for name, value in re.findall(r"^#define (%s\w*)\s+(-?\d+)u?\b" % prefix, header(), re.M):
        out[name] = int(value)
    return out


def test_status_codes_are_the_headers():
    want = defines("MC_(?:OK|ERR_)")
    assert want, "no status codes found in mcguard.h"
    assert {v: k for k, v in want.items()} == STATUS_NAMES


def test_verify_modes_are_the_headers():
    want = {name[len("MC_VERIFY_"):].lower(): v for name, v in defines("MC_VERIFY_").items()}
    got = {("default" if k is None else k): v for k, v in VERIFY_MODES.items()}
    assert got == want


def test_flags_are_the_headers():
    assert defines("MC_TRANSFER_") == {"MC_TRANSFER_NO_NOTICE": abi.TRANSFER_NO_NOTICE}


def test_version_is_the_headers():
    m = re.search(r'^#define MC_GUARD_VERSION_STRING "([0-9.]+)"', header(), re.M)
    assert m and mcguard.version() == m.group(1)


C_TYPES = {"uint32_t": ctypes.c_uint32, "int32_t": ctypes.c_int32, "uint64_t": ctypes.c_uint64,
           # the engine callbacks' typedefs, as the binding declares them
           "mc_transport_batch_fn": abi.BATCH_FN, "mc_transport_register_fn": abi.REGISTER_FN,
           "mc_transport_unregister_fn": abi.UNREGISTER_FN, "mc_transport_fence_fn": abi.FENCE_FN}


def struct_fields(name):
    """The header's typedef struct name as [(field, ctypes type)], in order."""
    m = re.search(r"typedef struct %s \{(.*?)\} %s;" % (name, name), header(), re.S)
    assert m, name
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    out = []
    for ctype, ptr, field in re.findall(r"(?:const\s+)?(\w+)\s*(\*?)\s*(\w+);", body):
        if ctype == "char" and ptr:
            out.append((field, ctypes.c_char_p))
            continue
        t = C_TYPES[ctype]
        out.append((field, ctypes.POINTER(t) if ptr else t))
    return out


@pytest.mark.parametrize("name,cls", [("mc_transfer_opts", abi.TransferOpts), ("mc_sync_opts", abi.SyncOpts),
                                      ("mc_transport_ops", abi.TransportOps)])
def test_struct_layouts_are_the_headers(name, cls, tmp_path):
    declared = struct_fields(name)
    assert cls._fields_ == declared
    fields = [f for f, _ in declared]
    # Offsets and size as a C compiler lays the header's struct out.
    prog = tmp_path / "layout.c"
    prog.write_text('#include <stdio.h>\n#include <stddef.h>\n#include "mcguard.h"\nint main(void) {\n'
                    + "".join('printf("%%zu\\n", offsetof(%s, %s));\n' % (name, f) for f in fields)
                    + 'printf("%%zu\\n", sizeof(%s));\nreturn 0;\n}\n' % name)
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-I", os.path.dirname(HEADER), "-o", str(exe), str(prog)], check=True)
    got = [int(x) for x in subprocess.run([str(exe)], stdout=subprocess.PIPE, text=True, check=True).stdout.split()]
    assert got[:-1] == [getattr(cls, f).offset for f in fields]
    assert got[-1] == ctypes.sizeof(cls)


def test_the_package_exports_every_status():
    for code, name in STATUS_NAMES.items():
        assert getattr(mcguard, name) == code, name


def test_log_levels_are_the_headers():
    want = {name[len("MC_LOG_"):].lower(): v for name, v in defines("MC_LOG_").items()}
    assert want == {name: i for i, name in enumerate(abi.LOG_LEVELS)}
