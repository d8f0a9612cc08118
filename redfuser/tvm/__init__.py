"""Every TVM import and version-specific name lives in this package (TVM 0.27: tirx, s_tir,
tvm.compile); the rest of redfuser imports TVM only through it, so a TVM upgrade touches one
folder.  See docs/TVM-NOTES.md for why each choice is what it is.  One module a role:

- ``target``: the machines a kernel is built for (TVM targets, host CPU features, AMX grant);
- ``ir``: building and reading TensorIR (the script builder, buffers, rounding fences,
  structural walks and equality, shape arithmetic);
- ``runtime``: compiling a PrimFunc, tensors over host memory without copies, timing;
- ``cuda``: CUDA source and nvcc;
- ``graph``: Relax modules (import from torch, compile, load and save, the VM);
- ``rpc``: measuring on other machines through TVM's tracker.

Importing the package sets the runtime's environment first: TVM reads it when it loads.
"""

import os

# TVM's runtime uses one thread unless told, and reads this when it loads: set it first.
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))
# After every parallel kernel TVM's idle pool workers busy-wait for the next one (a
# sched_yield loop, 300000 turns by default: ~150 ms of a core after each kernel here),
# taking the cores from torch's threads in the same process: a torch copy_ of 4096 x 4096
# float32 took 7.9 ms instead of 3.9 ms right after our kernels on 2 cores.  3000 turns
# spin ~1 ms (0.7-1.3 ms of CPU after a kernel) and keep back-to-back small kernels as fast
# as TVM's default (softmax 64 x 4096: 0.052-0.055 ms against 0.050-0.053); 0 (sleeping
# workers) costs them a ~10 us wake-up (0.064-0.077 ms); python -m redfuser.tools.neighbour.
# The pool reads this when it starts (the first parallel kernel); a user's value is kept.
THREAD_POOL_SPIN_COUNT = "3000"
os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", THREAD_POOL_SPIN_COUNT)
