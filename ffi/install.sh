#!/usr/bin/env bash
# Installs the qccl C library under a prefix:
#   P/lib/libqccl.so  P/lib/libqccl.a  P/include/qccl.h  P/lib/pkgconfig/qccl.pc
# so that `cc app.c $(pkg-config --cflags --libs qccl)` works with
# PKG_CONFIG_PATH=P/lib/pkgconfig. See ffi/README.md.
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
mkdir -p "$prefix"
prefix="$(cd "$prefix" && pwd)"
mkdir -p "$prefix/lib/pkgconfig" "$prefix/include"
install -m 0755 "$from/libqccl.so" "$prefix/lib/libqccl.so"
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
echo "  $prefix/lib/libqccl.so, $prefix/lib/libqccl.a, $prefix/include/qccl.h, $prefix/lib/pkgconfig/qccl.pc"
