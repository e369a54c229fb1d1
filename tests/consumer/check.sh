#!/bin/sh
# Install mcguard into a scratch prefix, then build a consumer with
# find_package (asking for this version) and another with pkg-config, and
# run both as built, with no LD_LIBRARY_PATH (both carry the library's
# directory); both report the header's version.
set -eu
src=$1 bin=$2 lib=$3 version=$4
prefix=$bin/consumer-prefix
rm -rf "$prefix" "$bin/consumer-build"
cmake --install "$bin" --prefix "$prefix" >/dev/null
cmake -S "$src/tests/consumer" -B "$bin/consumer-build" -DCMAKE_PREFIX_PATH="$prefix" -DMCGUARD_WANT="$version" >/dev/null
cmake --build "$bin/consumer-build" >/dev/null
env -u LD_LIBRARY_PATH "$bin/consumer-build/consumer"
libdir=$(ls -d "$prefix"/lib*/pkgconfig | head -n 1)
# The .pc file names the configured prefix; point pkg-config at the scratch one.
pcversion=$(PKG_CONFIG_PATH=$libdir pkg-config --modversion mcguard)
header=$(sed -n 's/^#define MC_GUARD_VERSION_STRING "\(.*\)"/\1/p' "$src/include/mcguard.h")
if [ "$pcversion" != "$header" ] || [ "$version" != "$header" ]; then
  echo "version mismatch: pkg-config $pcversion, cmake $version, mcguard.h $header" >&2
  exit 1
fi
flags=$(PKG_CONFIG_PATH=$libdir pkg-config --define-variable=prefix="$prefix" --cflags --libs mcguard)
cc -o "$bin/consumer-pc" "$src/tests/consumer/main.c" $flags
env -u LD_LIBRARY_PATH "$bin/consumer-pc"
# The examples from the same prefix: the C++ one built by its own CMake
# project (find_package), the C one by pkg-config; both run their two
# processes.
rm -rf "$bin/examples-build"
cmake -S "$src/examples" -B "$bin/examples-build" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$bin/examples-build" >/dev/null
env -u LD_LIBRARY_PATH "$bin/examples-build/prefill_decode_cpp"
cc -o "$bin/example-pc" "$src/examples/c/prefill_decode.c" $flags
env -u LD_LIBRARY_PATH sh "$src/examples/c/run.sh" "$bin/example-pc"
