#!/usr/bin/env bash
# Installs the qccl C library under a prefix, as a versioned shared library:
#   P/lib/libqccl.so.X.Y.Z                      the library (SONAME libqccl.so.X, set by ffi/build.rs)
#   P/lib/libqccl.so.X -> libqccl.so.X.Y.Z      what programs load at run time
#   P/lib/libqccl.so   -> libqccl.so.X          what `-lqccl` finds at link time
#   P/lib/libqccl.a  P/include/qccl.h  P/lib/pkgconfig/qccl.pc
# (X.Y.Z: the version in ffi/Cargo.toml), so that `cc app.c $(pkg-config --cflags --libs qccl)`
# works with PKG_CONFIG_PATH=P/lib/pkgconfig. See ffi/README.md and docs/C_API.md.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: ffi/install.sh --prefix P [--from DIR] [--build]

  --prefix P   where to install (created if missing)
  --from DIR   directory holding libqccl.so and libqccl.a
               (default: $CARGO_TARGET_DIR/release, else <repo>/target/release)
  --build      run `cargo build --release -p qccl-ffi` first
EOF
}

prefix=""
from=""
build=0
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) prefix="${2:?--prefix needs a directory}"; shift 2 ;;
        --prefix=*) prefix="${1#--prefix=}"; shift ;;
        --from) from="${2:?--from needs a directory}"; shift 2 ;;
        --from=*) from="${1#--from=}"; shift ;;
        --build) build=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done
if [ -z "$prefix" ]; then
    echo "install.sh: --prefix is required" >&2
    usage >&2
    exit 2
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "$build" = 1 ]; then
    (cd "$root" && cargo build --release -p qccl-ffi)
fi
if [ -z "$from" ]; then
    from="${CARGO_TARGET_DIR:-$root/target}/release"
fi
for f in libqccl.so libqccl.a; do
    if [ ! -f "$from/$f" ]; then
        echo "install.sh: $from/$f not found; run \`cargo build --release -p qccl-ffi\` or pass --build" >&2
        exit 1
    fi
done

version="$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$root/ffi/Cargo.toml" | head -n1)"
major="${version%%.*}"
if [ -z "$version" ] || [ -z "$major" ]; then
    echo "install.sh: no version in $root/ffi/Cargo.toml" >&2
    exit 1
fi
soname="libqccl.so.$major"
# The library should name itself $soname (ffi/build.rs); say so when it does not (a library
# built before the build script, or another platform's), but install it anyway.
if command -v readelf >/dev/null 2>&1; then
    got="$(readelf -d "$from/libqccl.so" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')"
    if [ "$got" != "$soname" ]; then
        echo "install.sh: warning: $from/libqccl.so has SONAME '${got:-none}', expected '$soname'" >&2
    fi
fi
mkdir -p "$prefix"
prefix="$(cd "$prefix" && pwd)"
mkdir -p "$prefix/lib/pkgconfig" "$prefix/include"
# Replace the file rather than write into it (a running program may have it mapped); `ln -f`
# also replaces the plain lib/libqccl.so that older versions of this script installed.
rm -f "$prefix/lib/libqccl.so.$version"
install -m 0755 "$from/libqccl.so" "$prefix/lib/libqccl.so.$version"
ln -sfn "libqccl.so.$version" "$prefix/lib/$soname"
ln -sfn "$soname" "$prefix/lib/libqccl.so"
install -m 0644 "$from/libqccl.a" "$prefix/lib/libqccl.a"
install -m 0644 "$root/include/qccl.h" "$prefix/include/qccl.h"

# Libs.private: what a program linking libqccl.a statically also needs
# (`rustc --print native-static-libs` on Linux).
cat > "$prefix/lib/pkgconfig/qccl.pc" <<EOF
prefix=$prefix
exec_prefix=\${prefix}
libdir=\${exec_prefix}/lib
includedir=\${prefix}/include

Name: qccl
Description: Collective communication library with compression inside the collective (NCCL-shaped C API)
Version: $version
Cflags: -I\${includedir}
Libs: -L\${libdir} -lqccl
Libs.private: -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc
EOF

echo "installed qccl $version into $prefix"
echo "  $prefix/lib/libqccl.so.$version (+ links $soname, libqccl.so), $prefix/lib/libqccl.a, $prefix/include/qccl.h, $prefix/lib/pkgconfig/qccl.pc"
