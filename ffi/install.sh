#!/usr/bin/env bash
# Installs the qccl C library under a prefix, as a versioned shared library:
#   P/lib/libqccl.so.X.Y.Z                      the library (SONAME libqccl.so.X, set by ffi/build.rs)
#   P/lib/libqccl.so.X -> libqccl.so.X.Y.Z      what programs load at run time
#   P/lib/libqccl.so   -> libqccl.so.X          what `-lqccl` finds at link time
#   P/lib/libqccl.a  P/include/qccl.h  P/lib/pkgconfig/qccl.pc
#   P/lib/cmake/qccl/qcclConfig.cmake, qcclConfigVersion.cmake   the CMake package
# (X.Y.Z: the version in ffi/Cargo.toml), so that `cc app.c $(pkg-config --cflags --libs qccl)`
# works with PKG_CONFIG_PATH=P/lib/pkgconfig, and CMake's `find_package(qccl)` with
# CMAKE_PREFIX_PATH=P (targets qccl::qccl and qccl::qccl_static). See ffi/README.md and
# docs/C_API.md.
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
mkdir -p "$prefix/lib/pkgconfig" "$prefix/lib/cmake/qccl" "$prefix/include"
# Replace the file rather than write into it (a running program may have it mapped); `ln -f`
# also replaces the plain lib/libqccl.so that older versions of this script installed.
rm -f "$prefix/lib/libqccl.so.$version"
install -m 0755 "$from/libqccl.so" "$prefix/lib/libqccl.so.$version"
ln -sfn "libqccl.so.$version" "$prefix/lib/$soname"
ln -sfn "$soname" "$prefix/lib/libqccl.so"
install -m 0644 "$from/libqccl.a" "$prefix/lib/libqccl.a"
install -m 0644 "$root/include/qccl.h" "$prefix/include/qccl.h"

# What a program linking libqccl.a statically also needs (`rustc --print native-static-libs`
# on Linux): qccl.pc's Libs.private and qccl::qccl_static's INTERFACE_LINK_LIBRARIES.
static_libs="gcc_s util rt pthread m dl c"
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
Libs.private: $(for l in $static_libs; do printf -- '-l%s ' "$l"; done | sed 's/ $//')
EOF

# The CMake package, written by hand (no CMake needed here). Relocatable: the config file
# finds the prefix from its own location, so it holds no absolute path.
# CMAKE_SIZEOF_VOID_P of the library, from its ELF class (empty: the version file skips the
# 32/64-bit check).
case "$(od -An -tu1 -j4 -N1 "$from/libqccl.so" 2>/dev/null | tr -d ' ')" in
    1) void_p=4 ;;
    2) void_p=8 ;;
    *) void_p="" ;;
esac
cmake_subst() {
    sed -e "s/@VERSION@/$version/g" -e "s/@MAJOR@/$major/g" -e "s/@SONAME@/$soname/g" \
        -e "s/@STATIC_LIBS@/$(echo $static_libs | tr ' ' ';')/g" -e "s/@VOID_P@/$void_p/g"
}
cmake_subst > "$prefix/lib/cmake/qccl/qcclConfig.cmake" <<'EOF'
# The CMake package of qccl @VERSION@, written by ffi/install.sh.
#
#   find_package(qccl 0.1 REQUIRED)          # CMAKE_PREFIX_PATH=<prefix> if not a system prefix
#   target_link_libraries(app PRIVATE qccl::qccl)          # lib/libqccl.so (SONAME @SONAME@)
#   target_link_libraries(app PRIVATE qccl::qccl_static)   # lib/libqccl.a + the system libraries
#
# Both targets carry include/ (qccl.h). Also sets qccl_FOUND, qccl_VERSION (and _MAJOR, _MINOR,
# _PATCH), qccl_INCLUDE_DIRS and qccl_LIBRARIES (qccl::qccl). Components `shared` and `static`
# (both always present) may be named. Relocatable: paths are relative to this file, which
# lives in <prefix>/lib/cmake/qccl.

if(CMAKE_VERSION VERSION_LESS 3.0)
  message(FATAL_ERROR "qccl's CMake package needs CMake 3.0 or newer")
endif()
cmake_policy(PUSH)
cmake_policy(VERSION 3.0...3.28)

get_filename_component(_qccl_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)

set(qccl_VERSION "@VERSION@")
string(REGEX MATCH "^([0-9]+)\\.([0-9]+)\\.([0-9]+)" _qccl_v "${qccl_VERSION}")
set(qccl_VERSION_MAJOR "${CMAKE_MATCH_1}")
set(qccl_VERSION_MINOR "${CMAKE_MATCH_2}")
set(qccl_VERSION_PATCH "${CMAKE_MATCH_3}")

set(qccl_FOUND TRUE)
foreach(_qccl_f include/qccl.h lib/libqccl.so.@VERSION@ lib/libqccl.a)
  if(NOT EXISTS "${_qccl_prefix}/${_qccl_f}")
    set(qccl_FOUND FALSE)
    set(qccl_NOT_FOUND_MESSAGE
      "${_qccl_prefix}/${_qccl_f} is missing (an incomplete install? rerun ffi/install.sh)")
  endif()
endforeach()

if(qccl_FOUND)
  if(NOT TARGET qccl::qccl)
    add_library(qccl::qccl SHARED IMPORTED)
    set_target_properties(qccl::qccl PROPERTIES
      IMPORTED_LOCATION "${_qccl_prefix}/lib/libqccl.so.@VERSION@"
      IMPORTED_SONAME "@SONAME@"
      INTERFACE_INCLUDE_DIRECTORIES "${_qccl_prefix}/include")
  endif()
  if(NOT TARGET qccl::qccl_static)
    add_library(qccl::qccl_static STATIC IMPORTED)
    set_target_properties(qccl::qccl_static PROPERTIES
      IMPORTED_LOCATION "${_qccl_prefix}/lib/libqccl.a"
      IMPORTED_LINK_INTERFACE_LANGUAGES "C"
      INTERFACE_INCLUDE_DIRECTORIES "${_qccl_prefix}/include"
      INTERFACE_LINK_LIBRARIES "@STATIC_LIBS@")
  endif()
  set(qccl_INCLUDE_DIRS "${_qccl_prefix}/include")
  set(qccl_LIBRARIES qccl::qccl)

  foreach(_qccl_c ${qccl_FIND_COMPONENTS})
    if(_qccl_c STREQUAL "shared" OR _qccl_c STREQUAL "static")
      set(qccl_${_qccl_c}_FOUND TRUE)
    elseif(qccl_FIND_REQUIRED_${_qccl_c})
      set(qccl_FOUND FALSE)
      set(qccl_NOT_FOUND_MESSAGE "qccl has no component '${_qccl_c}' (it has: shared, static)")
    endif()
  endforeach()
endif()

unset(_qccl_prefix)
unset(_qccl_v)
unset(_qccl_f)
unset(_qccl_c)
cmake_policy(POP)
EOF
cmake_subst > "$prefix/lib/cmake/qccl/qcclConfigVersion.cmake" <<'EOF'
# The version of the qccl CMake package, written by ffi/install.sh: compatible with requests of
# the same major version and no newer than @VERSION@ (CMake's SameMajorVersion rule, the
# rule of the library's SONAME @SONAME@).

set(PACKAGE_VERSION "@VERSION@")
set(_qccl_major "@MAJOR@")

if(PACKAGE_VERSION VERSION_LESS PACKAGE_FIND_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
elseif(PACKAGE_FIND_VERSION_RANGE)
  # Both ends of a range (CMake 3.19+) must have this major version.
  math(EXPR _qccl_major_next "${_qccl_major} + 1")
  if(NOT PACKAGE_FIND_VERSION_MIN_MAJOR STREQUAL _qccl_major
      OR (PACKAGE_FIND_VERSION_RANGE_MAX STREQUAL "INCLUDE"
          AND NOT PACKAGE_FIND_VERSION_MAX_MAJOR STREQUAL _qccl_major)
      OR (PACKAGE_FIND_VERSION_RANGE_MAX STREQUAL "EXCLUDE"
          AND NOT PACKAGE_FIND_VERSION_MAX VERSION_LESS_EQUAL _qccl_major_next))
    set(PACKAGE_VERSION_COMPATIBLE FALSE)
  elseif((PACKAGE_FIND_VERSION_RANGE_MAX STREQUAL "INCLUDE"
          AND PACKAGE_VERSION VERSION_LESS_EQUAL PACKAGE_FIND_VERSION_MAX)
      OR (PACKAGE_FIND_VERSION_RANGE_MAX STREQUAL "EXCLUDE"
          AND PACKAGE_VERSION VERSION_LESS PACKAGE_FIND_VERSION_MAX))
    set(PACKAGE_VERSION_COMPATIBLE TRUE)
  else()
    set(PACKAGE_VERSION_COMPATIBLE FALSE)
  endif()
else()
  if(PACKAGE_FIND_VERSION_MAJOR STREQUAL _qccl_major)
    set(PACKAGE_VERSION_COMPATIBLE TRUE)
  else()
    set(PACKAGE_VERSION_COMPATIBLE FALSE)
  endif()
  if(PACKAGE_FIND_VERSION STREQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
unset(_qccl_major)
unset(_qccl_major_next)

# A 64-bit library is no use to a 32-bit build, and the other way round.
if(NOT "${CMAKE_SIZEOF_VOID_P}" STREQUAL "" AND NOT "@VOID_P@" STREQUAL ""
    AND NOT CMAKE_SIZEOF_VOID_P STREQUAL "@VOID_P@")
  math(EXPR _qccl_bits "@VOID_P@ * 8")
  set(PACKAGE_VERSION "${PACKAGE_VERSION} (${_qccl_bits}bit)")
  set(PACKAGE_VERSION_UNSUITABLE TRUE)
  unset(_qccl_bits)
endif()
EOF

echo "installed qccl $version into $prefix"
echo "  $prefix/lib/libqccl.so.$version (+ links $soname, libqccl.so), $prefix/lib/libqccl.a, $prefix/include/qccl.h"
echo "  $prefix/lib/pkgconfig/qccl.pc, $prefix/lib/cmake/qccl/qcclConfig.cmake (find_package(qccl): qccl::qccl, qccl::qccl_static)"
