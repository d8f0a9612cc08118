#!/bin/bash
# `make gpu-bundle`: TVM packed for a GPU machine that has no network (see gpu_run.sh).
# The apache-tvm wheel is 100 MB, over the 64 MiB a device run carries: its Python files
# and runtime libraries travel as one tarball (5 MB), the compiler library (260 MB) on its
# own, xz-compressed (59 MB, ~8 minutes on 2 cores).  PY: the device's Python (3.12).
set -eu
PY=${PY:-3.12}
OUT=${BUNDLE:-.gpu-bundle}
PIP=${PIP:-.venv/bin/pip}
VERSIONS=$(.venv/bin/python -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('apache-tvm', 'apache-tvm-ffi')))")
tmp=$(mktemp -d); trap 'rm -rf $tmp' EXIT
$PIP download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp/whl" $VERSIONS
mkdir -p "$tmp/site" "$OUT"
for w in "$tmp"/whl/*.whl; do (cd "$tmp/site" && python3 -m zipfile -e "$w" .); done
mv "$tmp/site/tvm/lib/libtvm_compiler.so" "$tmp/compiler.so"
rm -rf "$tmp/site/tvm/3rdparty"  # CUTLASS headers: not used by redfuser's kernels
tar cJf "$OUT/site.tar.xz" -C "$tmp/site" .
xz -T1 --lzma2=preset=9e,dict=256MiB -c "$tmp/compiler.so" > "$OUT/compiler.so.xz"
du -sh "$OUT"/*
