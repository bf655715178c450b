#!/usr/bin/env bash
# Build pyverbs 59 (and the rdma-core 59 libraries it needs at run time) into a cache folder
# outside the repository, for machines whose distribution ships an older libibverbs
# (Debian 12 has 44: importing a pyverbs 59 wheel fails with "IBVERBS_PRIVATE_59 not found").
#
#   hack/build_pyverbs.sh            # builds once into ${TANDEM_CACHE:-~/.cache/tandem}/pyverbs-59
#   eval "$(hack/build_pyverbs.sh env)"   # then: python -c 'import pyverbs'
#
# Needs: python3 with venv, cmake, ninja, pkg-config, gcc, libnl-3-dev, libnl-route-3-dev,
# libudev-dev (apt-get install -y cmake ninja-build pkg-config libnl-3-dev libnl-route-3-dev libudev-dev).
# The test suite never depends on this: without pyverbs the rdma tests skip and say why.
set -euo pipefail

VERSION=59.0
CACHE="${TANDEM_CACHE:-$HOME/.cache/tandem}/pyverbs-${VERSION%%.*}"
SITE="$CACHE/site-packages"
LIBS="$CACHE/lib"  # libibverbs.so.1 and librdmacm.so.1 of rdma-core 59
PYTHON="${PYTHON:-python3}"

if [[ "${1:-}" == "env" ]]; then
  echo "export PYTHONPATH=\"$SITE\${PYTHONPATH:+:\$PYTHONPATH}\""
  echo "export LD_LIBRARY_PATH=\"$LIBS\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
  exit 0
fi

if [[ -f "$CACHE/.done" ]]; then
  echo "pyverbs $VERSION already built in $CACHE"; exit 0
fi
for tool in cmake ninja pkg-config gcc; do
  command -v "$tool" >/dev/null || { echo "missing build tool: $tool" >&2; exit 1; }
done
for lib in libnl-3.0 libnl-route-3.0 libudev; do
  pkg-config --exists "$lib" || { echo "missing development package for $lib (see the header of $0)" >&2; exit 1; }
done

mkdir -p "$CACHE"
BUILD_VENV="$CACHE/build-venv"
[[ -x "$BUILD_VENV/bin/pip" ]] || "$PYTHON" -m venv "$BUILD_VENV"
# pyverbs 59's Cython sources do not compile with Cython >= 3.1.
"$BUILD_VENV/bin/pip" install --quiet "cython<3.1" scikit-build-core setuptools-scm wheel
# Build the wheel (it compiles the bundled rdma-core with cmake), without build isolation so the
# pinned Cython is the one used.
cd "$CACHE"  # never run Python from the repository root: its operator/ folder shadows the stdlib module
if ! ls "$CACHE"/wheels/pyverbs-*.whl >/dev/null 2>&1; then
  nice -n 19 "$BUILD_VENV/bin/pip" wheel --no-deps --no-binary :all: --no-build-isolation \
    -w "$CACHE/wheels" "pyverbs==$VERSION"
fi
WHEEL=$(ls "$CACHE"/wheels/pyverbs-*.whl | head -n1)
rm -rf "$SITE" && mkdir -p "$SITE"
"$BUILD_VENV/bin/python" -I -m zipfile -e "$WHEEL" "$SITE"
# The wheel leaves out the rdma-core 59 C libraries (libibverbs, librdmacm) it links against:
# build them from the rdma-core source the sdist bundles, into a prefix of our own.
if [[ ! -f "$LIBS/libibverbs.so.1" ]]; then
  "$BUILD_VENV/bin/pip" download --quiet --no-deps --no-binary :all: --no-build-isolation \
    -d "$CACHE/src" "pyverbs==$VERSION"
  tar xzf "$CACHE/src/pyverbs-$VERSION.tar.gz" -C "$CACHE/src"
  cmake -S "$CACHE/src/pyverbs-$VERSION/rdma-core" -B "$CACHE/rdma-core-build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DNO_MAN_PAGES=1 -DNO_PYVERBS=1 -DCMAKE_INSTALL_PREFIX="$CACHE/prefix"
  nice -n 19 ninja -C "$CACHE/rdma-core-build" -j 2 ibverbs rdmacm
  mkdir -p "$LIBS"
  cp -a "$CACHE"/rdma-core-build/lib/libibverbs.so* "$CACHE"/rdma-core-build/lib/librdmacm.so* "$LIBS/"
fi
touch "$CACHE/.done"
echo "built pyverbs $VERSION into $CACHE"
echo "use it with: eval \"\$($0 env)\""
