#!/bin/bash
# `make gpu-check` on a GPU machine with no network and no TVM (python3 with numpy, sympy,
# torch, nvcc there): unpacks `make gpu-bundle`'s TVM into /tmp/site, compiles the
# kernels with NVRTC where it works (else nvcc), and writes the log to $OUT.
# Run from the repository root with the bundle carried: bash redfuser/tools/gpu_run.sh
set -u
BUNDLE=${BUNDLE:-.gpu-bundle}; S=/tmp/site; LOG=${OUT:-.}/gpucheck.log; t0=$(date +%s)
mkdir -p $S
tar xJf $BUNDLE/site.tar.xz -C $S && xz -T0 -dc $BUNDLE/compiler.so.xz > $S/tvm/lib/libtvm_compiler.so \
  || { echo "unpacking $BUNDLE failed"; exit 1; }
CUDART=$(find /usr/local /opt -name 'libcudart.so.13' 2>/dev/null | head -1)  # TVM's CUDA runtime needs it
export LD_LIBRARY_PATH=$(dirname "$CUDART"):${LD_LIBRARY_PATH:-}
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for mode in nvrtc nvcc; do
  TVM_CUDA_COMPILE_MODE=$mode python3 -c "
from redfuser.lowering.cuda.fp8 import fp8_quant_gemm
from redfuser.tvm.runtime import build
from redfuser.tvm.target import cuda_target
build(fp8_quant_gemm(4, 32, 32, 'f'), cuda_target())" > /dev/null 2>&1 && break
done
export TVM_CUDA_COMPILE_MODE=$mode
echo "set up in $(( $(date +%s) - t0 )) s; CUDA compiled by $mode"
# nvcc's warnings about unused temporaries in TVM's source are dropped from the log
timeout ${GPUCHECK_TIMEOUT:-450} python3 -m redfuser.tools.gpucheck 2>&1 \
  | grep -v "warning #177\|declared but never\|^ *\^ *$\|^ *$\|int cse_v\|float v_" | tee "$LOG"
echo "total $(( $(date +%s) - t0 )) s"
