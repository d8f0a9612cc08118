"""Every TVM import and version-specific name lives here (TVM 0.27: tirx, s_tir, tvm.compile).

The rest of redfuser imports TVM only through this module, so a TVM upgrade touches
one file.  See docs/TVM-NOTES.md for why each choice is what it is.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import socket
import struct
import sys
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

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

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402
from tvm import tirx  # noqa: E402
from tvm.script.ir_builder import IRBuilder  # noqa: E402
from tvm.script.ir_builder import tirx as T  # noqa: E402
from tvm.support import nvcc  # noqa: E402

# Node classes for isinstance checks (0.27 exports BufferLoad as a builder function).
BufferLoadNode = type(tirx.decl_buffer((1,), "float32")[0])
LEAVES = (tirx.Var, tirx.IntImm, tirx.FloatImm, BufferLoadNode)

__all__ = ["ALIGNMENT", "LEAVES", "IRBuilder", "T", "arg_buffer", "block_sync", "build", "cpu_has",
           "cpu_target", "cuda_device_name", "cuda_rounded", "cuda_source", "cuda_target",
           "default_threads", "device", "empty_aligned", "from_dlpack", "from_numpy",
           "kernel_arg", "llvm_rounded", "nvcc_compile", "structural_equal", "time_ms", "tirx"]


def default_threads() -> int:
    """Threads the TVM runtime uses (TVM_NUM_THREADS, default: every core)."""
    return int(os.environ["TVM_NUM_THREADS"])


@lru_cache(maxsize=1)
def cpu_target() -> dict:
    """The host CPU by name: "native" and plain "llvm" silently give generic SSE code."""
    return {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()}


SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18  # x86-64 Linux
AMX_FEATURES = ("+amx-tile", "+amx-int8")


@lru_cache(maxsize=1)
def host_grants_amx() -> bool:
    """Does Linux let this process use AMX tiles?  It must ask first (ARCH_REQ_XCOMP_PERM
    for XTILEDATA, granted to every thread of the process); a tile instruction without the
    grant is SIGILL.  The kernel refuses when the CPU or the hypervisor has no AMX."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def host_int8_target() -> dict:
    """The host CPU with AMX's features where the process is granted the tiles: LLVM names
    the CPU by its model, and a virtual machine's model can lack the AMX its CPU has."""
    if host_grants_amx():
        return {**cpu_target(), "mattr": list(AMX_FEATURES)}
    return cpu_target()


def cpu_has(target: dict, feature: str) -> bool:
    """Does the LLVM CPU ``target`` names have ``feature`` ("avx512vnni", "avx2")?"""
    return bool(tvm.target.codegen.target_has_features(feature, tvm.target.Target(target)))


def llvm_rounded(x):
    """``x`` behind an arithmetic fence: LLVM will not fuse the operation computing it into
    a later one.  TVM builds every LLVM target with AllowFPOpFusion = Fast, so ``a*b - c``
    becomes one FMA (the product unrounded) wherever the product has a single use.  (0.27's
    call_llvm_pure_intrin takes no signature-count argument.)"""
    return tirx.call_llvm_pure_intrin(x.ty.dtype, "llvm.arithmetic.fence", x)


_CUDA_ROUNDED = {tirx.Mul: "__fmul_rn", tirx.Add: "__fadd_rn", tirx.Sub: "__fsub_rn"}


def block_sync():
    """A CUDA block barrier (``__syncthreads``): what the threads stored before it, in
    shared or global memory, is what every thread of the block reads after it."""
    T.evaluate(T.tvm_storage_sync("shared"))


def cuda_rounded(x):
    """``x`` computed by its last operation rounded on its own: nvcc never contracts the
    ``__f*_rn`` intrinsics into an FMA (CUDA C Programming Guide, intrinsic functions); a
    value whose last operation is not one of these has nothing to contract."""
    name = _CUDA_ROUNDED.get(type(x))
    return x if name is None else tirx.call_pure_extern(x.ty.dtype, name, x.a, x.b)


def cuda_target(arch: str = "sm_90") -> dict:
    return {"kind": "cuda", "arch": arch}


def build(func: tirx.PrimFunc, target: dict):
    """Compile one PrimFunc; returns the executable (call ``ex[name](*tensors)``).  Built
    inside the target's scope: TVM's CUDA compile callback reads the architecture from the
    scope, and otherwise asks the GPU (none where kernels are only compiled)."""
    with tvm.target.Target(target):
        return tvm.compile(func, target=target)


def device(target: dict):
    return tvm.cuda(0) if target["kind"] == "cuda" else tvm.cpu(0)


def cuda_device_name() -> str | None:
    """The name of GPU 0, or None where there is no driver or no device."""
    try:
        dev = tvm.cuda(0)
        return str(dev.device_name) if dev.exist else None
    except Exception:  # noqa: BLE001 - no driver: TVM raises its own error classes
        return None


# Kernel buffers are declared 16-byte aligned (numpy's guarantee for float arrays), so numpy
# inputs pass without a copy; TVM's own default (64) would force a copy of most of them.
ALIGNMENT = 16
# What code TVM compiles itself (a Relax executable's kernels) assumes of every tensor: handing
# it numpy's 16-byte aligned memory segfaults when the address is 16, 32 or 48 mod 64.
TVM_ALIGNMENT = 64


def arg_buffer(name: str, shape: tuple, dtype: str = "float32"):
    """A PrimFunc argument buffer, declared ALIGNMENT-aligned: every kernel argument must go
    through here, since from_numpy hands over numpy's 16-byte aligned memory as it is and
    code compiled for TVM's default 64-byte alignment would fault on it."""
    return T.match_buffer(T.arg(name, T.handle()), shape, dtype, align=ALIGNMENT)


def arg_alias(buf, shape: tuple, dtype: str = "float32"):
    """A view of argument buffer ``buf`` with another (flattened) shape over the same
    memory, aligned as the argument is."""
    return T.decl_buffer(shape, dtype, data=buf.data, align=ALIGNMENT)


def shape_var(name: str, dtype: str = "int64"):
    """A TIR shape variable (bound from an argument's shape when the kernel is called)."""
    return tirx.Var(name, dtype)


def empty_aligned(shape: tuple, dtype, align: int = ALIGNMENT) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``align``-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def from_numpy(array: np.ndarray, dev=None, align: int = ALIGNMENT):
    """A TVM tensor over a numpy array: zero-copy through DLPack when it is C-contiguous,
    writeable and ``align``-aligned; otherwise an aligned copy.  redfuser's kernels need
    ALIGNMENT (numpy's arrays have it); code TVM compiled itself needs TVM_ALIGNMENT."""
    if dev is None or dev.dlpack_device_type() == tvm.cpu(0).dlpack_device_type():
        array = np.asarray(array)
        if not (array.flags.c_contiguous and array.ctypes.data % align == 0
                and array.flags.writeable):
            aligned = empty_aligned(array.shape, array.dtype, align)
            np.copyto(aligned, array)
            array = aligned
        return kernel_arg(tvm_ffi.from_dlpack(array, require_alignment=align,
                                              require_contiguous=True))
    return tvm.runtime.tensor(np.ascontiguousarray(array), dev)


def from_dlpack(tensor):
    """A TVM tensor over a host array (numpy's, or any DLPack tensor such as torch's):
    zero-copy when it is contiguous and ALIGNMENT-aligned, else an aligned numpy copy.  TVM
    never checks at call time the alignment a kernel was compiled for (a misaligned view
    would fault or misread), so every input goes through here.  An empty array (an N = 0
    stream) becomes a TVM-allocated one: numpy and torch give it strides TVM's compact
    check refuses ("Mismatched .strides"), and there is nothing to copy.  A torch tensor
    that requires grad, which torch's Python DLPack export refuses (BufferError), is read
    through TVM's own import (torch's C exchange API), which takes it."""
    try:
        out = tvm_ffi.from_dlpack(tensor, require_alignment=ALIGNMENT, require_contiguous=True)
    except (ValueError, RuntimeError, TypeError, BufferError):  # misaligned, strided or
        # (torch) requiring grad: copy once
        try:
            host = np.from_dlpack(tensor)
        except BufferError:  # torch, requires grad
            host = np.from_dlpack(tvm_ffi.from_dlpack(tensor))
        out = from_numpy(host)
    return kernel_arg(out) if 0 in tuple(out.shape) else out


def aligned_arg(array):
    """``array`` as a kernel argument without a copy, or None where it is not contiguous
    and ALIGNMENT-aligned: DLPack's own check, in C (reading a numpy view's address through
    ``ctypes`` costs three times as much).  For outputs, which must never be copies."""
    try:
        out = tvm_ffi.from_dlpack(array, require_alignment=ALIGNMENT, require_contiguous=True)
    except (ValueError, RuntimeError, TypeError, BufferError):
        return None
    return kernel_arg(out)


def kernel_arg(array):
    """``array`` as a kernel argument: as it is, except an empty one, which is replaced by
    a TVM-allocated empty tensor of its shape and dtype (compact strides, see
    ``from_dlpack``); the kernel never reads or writes an empty buffer."""
    if 0 not in tuple(array.shape):
        return array
    return tvm.runtime.empty(tuple(array.shape), str(array.dtype), tvm.cpu(0))


MIN_REPEAT_MS = 1  # each timed repeat runs the kernel for at least this long: a single
# call of a 0.1 ms kernel measures the thread pool's wake-up as much as the kernel


def time_ms(executable, name: str, dev, args, repeat: int = 5) -> float:
    """Median time of one call of ``executable[name]`` in milliseconds (TVM's evaluator,
    which synchronises the device), after one warm-up call (JIT, page faults, idle threads)."""
    executable[name](*args)
    timer = executable.mod.time_evaluator(name, dev, number=1, repeat=repeat,
                                          min_repeat_ms=MIN_REPEAT_MS)
    return float(timer(*args).median) * 1e3


def structural_equal(a, b) -> bool:
    """IR equality up to variable names (TVM's structural equality)."""
    return bool(tvm_ffi.structural_equal(a, b, map_free_vars=True))


def host_source(executable, fmt: str = "asm") -> str:
    """The code LLVM generated for a CPU executable: ``fmt`` "asm" (assembly) or "ll"
    (LLVM IR), to count instructions per element in a hot loop."""
    if fmt not in ("asm", "ll"):
        raise ValueError(f"fmt must be 'asm' or 'll', not {fmt!r}")
    return executable.mod.inspect_source(fmt)


def cuda_source(executable) -> str:
    """The generated .cu text of a CUDA executable (a PrimFunc's or a Relax VM's: the CUDA
    module is found among the imports at any depth)."""
    pending = [executable.mod]
    while pending:
        module = pending.pop()
        if module.kind == "cuda":
            return module.inspect_source()
        pending += list(module.imports)
    raise ValueError("the executable holds no CUDA module")


def nvcc_compile(source: str, arch: str = "sm_90", fmt: str = "ptx") -> bytes:
    """Compile CUDA source with nvcc (must be on PATH), inside a CUDA target scope, to PTX
    or (``fmt="cubin"``) to machine code: only then does ptxas check the kernel's resources
    (shared memory, registers, stack) against the architecture's limits."""
    with tvm.target.Target(cuda_target(arch)):
        return nvcc.compile_cuda(source, target_format=fmt, arch=arch, compiler="nvcc")


# --- Relax: names used by redfuser.relax (the model-level pass) ------------------------------
# 0.27 spellings: struct info is `.ty` (TensorType/TupleType), var names are `.name`.
from tvm import relax  # noqa: E402, F401
from tvm.ir import GenericConst, IRModule  # noqa: E402, F401
from tvm.ir.transform import Sequential, module_pass  # noqa: E402, F401
from tvm.s_tir import dlight  # noqa: E402, F401


def with_root_block(func):
    """``func`` with its body inside a root SBlock: Relax passes (RewriteDataflowReshape's
    reshape detection) read a called PrimFunc's root block."""
    return func.with_body(SBlockRealize([], True, SBlock([], [], [], "root", func.body)))


def import_torch(model, args: tuple, dynamic_shapes=None) -> IRModule:
    """A PyTorch module as Relax through TVM's own importer (torch.export, then
    from_exported_program); the model runs in inference mode.  ``dynamic_shapes`` is
    torch.export's (``torch.export.Dim`` per symbolic axis): those axes become Relax
    shape variables.  It traces under the math backend of scaled_dot_product_attention: the
    graph keeps the one SDPA op either way, but the CPU flash backend's fake output has
    strides a later ``view`` refuses (transformers' GPT-2 with ``sdpa``: "Cannot view a
    tensor with shape [2, s, 64] and strides (64, 128, 1)", pytorch/pytorch#141107)."""
    # lazily: torch is an optional dependency, and loading it costs seconds
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel  # (torch, as above)
    from tvm.relax.frontend.torch import from_exported_program  # (imports torch)

    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        exported = torch.export.export(model, tuple(args), dynamic_shapes=dynamic_shapes)
        return from_exported_program(exported)


def provably_equal(a, b) -> bool:
    """Are two shape values (ints or TIR expressions of shape variables) equal for every
    value of the variables?"""
    return bool(tvm.sym.Analyzer().can_prove_equal(tirx.const(a, "int64") if isinstance(
        a, int) else a, tirx.const(b, "int64") if isinstance(b, int) else b))


def bounded_simplify(bounds: dict):
    """A simplifier of shape expressions that knows each variable's range: ``bounds`` maps
    a TIR variable to (lowest, highest) value."""
    analyzer = tvm.sym.Analyzer()
    for var, (low, high) in bounds.items():
        analyzer.bind(var, tvm.ir.Range(low, high + 1))
    return analyzer.simplify


def build_relax(mod: IRModule, pipeline, target: dict):
    """Compile a Relax module with ``pipeline`` (a Pass, run inside the target's scope as
    dlight needs) for ``target``; returns the VM executable."""
    with tvm.target.Target(target):
        return tvm.compile(mod, target=tvm.target.Target(target), relax_pipeline=pipeline)


def load_ir_module(path: str) -> IRModule:
    """The IRModule saved at ``path``: JSON (``save_ir_module``, ``tvm.ir.save_json``) when
    the name ends in ``.json``, else TVMScript text (``mod.script()``).  ``ValueError``
    naming the file when it holds something else."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    how = "tvm.ir.save_json JSON" if path.endswith(".json") else "TVMScript"
    try:
        mod = tvm.ir.load_json(text) if path.endswith(".json") else tvm.script.from_source(text)
    except Exception as e:  # noqa: BLE001 - the parsers raise many classes (SyntaxError too)
        first = str(e).strip().splitlines()[:1] or [type(e).__name__]
        raise ValueError(f"{path} is not a module in {how}: {first[0]}") from None
    if not isinstance(mod, IRModule):
        raise ValueError(f"{path} holds a {type(mod).__name__}, not an IRModule")
    return mod


def save_ir_module(mod: IRModule, path: str) -> None:
    """Write ``mod`` as JSON (``load_ir_module`` reads it back)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(tvm.ir.save_json(mod))


def relax_tensor(array: np.ndarray):
    """A host tensor a Relax executable may read: TVM_ALIGNMENT-aligned (copied if not)."""
    return from_numpy(np.ascontiguousarray(array), align=TVM_ALIGNMENT)


def relax_vm(executable, dev=None):
    """A Relax virtual machine over ``executable`` (CPU by default)."""
    return relax.VirtualMachine(executable, dev or tvm.cpu(0))


def target_in_scope():
    """The ``tvm.target.Target`` in scope (``with Target(...)``), or None."""
    return tvm.target.Target.current(allow_none=True)


def current_target_kind() -> str | None:
    """The kind ("llvm", "cuda", ...) of the target in scope, or None when there is none."""
    target = target_in_scope()
    return None if target is None else str(target.kind.name)


# --- TensorIR lifting and rewriting: names used by redfuser.tensorir (lift, fuse) ------------
# 0.27: a buffer *is* a Var (BufferType); loads are tvm.ir.expr.TensorLoad (`.source` is the
# buffer); PrimFunc has no buffer_map; SBlock/SBlockRealize live in s_tir; there is no Python
# stmt_functor: tvm_ffi.structural_map / structural_walk replace it.
from tvm import s_tir  # noqa: E402
from tvm.ir import Range  # noqa: E402
from tvm.ir.expr import Call, TensorLoad, TensorRegion  # noqa: E402
from tvm.tirx.buffer import is_buffer_var  # noqa: E402
from tvm_ffi import WalkResult, structural_map, structural_walk  # noqa: E402

SBlock, SBlockRealize = s_tir.SBlock, s_tir.SBlockRealize
__all__ += ["Call", "Range", "SBlock", "SBlockRealize", "TensorLoad", "TensorRegion",
            "WalkResult", "is_buffer_var", "structural_map", "structural_walk",
            "verify_sblock_func"]


def verify_sblock_func(func) -> str:
    """'' when ``func`` (a PrimFunc with SBlocks) is well formed, else TVM's message (the
    tirx verifier refuses every SBlock, so s_tir's is the one that applies)."""
    try:
        s_tir.analysis.verify_well_formed(func, assert_mode=True)
    except Exception as e:  # noqa: BLE001 - TVM raises its own error classes
        return str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return ""


# --- RPC: measuring on other machines through TVM's tracker (redfuser.tune.pool) ------------
# 0.27: tvm.rpc.connect_tracker(host, port) -> TrackerSession (.summary(), .request(key));
# RPCSession.upload / load_module / cpu() / cuda(); a remote module's time_evaluator times on
# the remote device.  TVM's tracker client retries a refused connect for 60 s and then waits
# without limit for every answer, so the tracker client here bounds each socket operation.
from tvm import rpc  # noqa: E402
from tvm.rpc import base as rpc_base  # noqa: E402
from tvm.support import cc as tvm_cc  # noqa: E402

__all__ += ["RemoteInfo", "export_library", "host_triple", "remote_device", "remote_load",
            "remote_tensors", "remote_time_ms", "rpc_alive", "rpc_device_info", "rpc_tracker"]


class _Tracker(rpc.TrackerSession):
    """TVM's tracker client on a socket whose every operation times out after ``timeout``
    seconds, and a request that returns the device's address with its session."""

    def __init__(self, addr: tuple[str, int], timeout: float):
        self._timeout = timeout
        super().__init__(addr)

    def _connect(self) -> None:
        # TrackerSession._connect's handshake, on a socket that cannot wait forever
        self._sock = socket.create_connection(self._addr, timeout=self._timeout)
        self._sock.sendall(struct.pack("<i", rpc_base.RPC_TRACKER_MAGIC))
        magic = struct.unpack("<i", rpc_base.recvall(self._sock, 4))[0]
        if magic != rpc_base.RPC_TRACKER_MAGIC:
            raise RuntimeError(f"{self._addr[0]}:{self._addr[1]} answers, but is not a TVM "
                               "RPC tracker")

    def devices(self, key: str) -> tuple[int, int, list[str]]:
        """(free devices of ``key``, devices of ``key`` registered, every key the tracker
        knows) from the tracker's summary."""
        summary = self.summary()
        keys = [s.get("key", "").partition(":")[2] for s in summary["server_info"]]
        free = summary["queue_info"].get(key, {}).get("free", 0)
        return int(free), keys.count(key), sorted(set(keys) | set(summary["queue_info"]))

    def request_device(self, key: str, session_timeout: float = 0):
        """(session, "host:port") of a free device of ``key`` (what TrackerSession.request
        does, keeping the address the tracker answered); waits at most the timeout."""
        if self._sock is None:
            self._connect()
        try:
            rpc_base.sendjson(self._sock, [rpc_base.TrackerCode.REQUEST, key, "", 1])
            value = rpc_base.recvjson(self._sock)
        except OSError:
            self.close()  # an answer may still arrive: this stream is out of step now
            raise
        if value[0] != rpc_base.TrackerCode.SUCCESS:
            raise RuntimeError(f"the tracker refused a request for {key!r}: {value}")
        url, port, matchkey = value[1]
        return rpc.connect(url, port, matchkey, session_timeout), f"{url}:{port}"


def rpc_tracker(host: str, port: int, timeout: float) -> _Tracker:
    """A client of the RPC tracker at ``host:port`` (``OSError`` or ``RuntimeError`` when
    it cannot be reached within ``timeout`` seconds or is not a tracker)."""
    return _Tracker((host, port), timeout)


@dataclass(frozen=True)
class RemoteInfo:
    """What a device says about itself (None: its TVM runtime has no compiler to ask)."""

    cpu: str | None
    triple: str | None
    threads: int


def rpc_device_info(session) -> RemoteInfo:
    """The remote CPU's LLVM name and triple (servers running the whole of TVM have them)
    and the threads of its runtime (TVM_NUM_THREADS where the server was started)."""
    def ask(name: str):
        try:
            return str(session.get_function(name)())
        except (AttributeError, RuntimeError):  # a runtime-only server: no codegen there
            return None

    threads = int(session.get_function("runtime.NumThreads")())
    return RemoteInfo(ask("target.llvm_get_system_cpu"), ask("target.llvm_get_system_triple"),
                      threads)


def rpc_alive(session) -> bool:
    """Does the session still answer (a cheap round trip)?"""
    try:
        session.get_function("runtime.NumThreads")()
        return True
    except Exception:  # noqa: BLE001 - a dead connection raises TVM's own error classes
        return False


def host_triple() -> str:
    """The LLVM triple of this machine (a target with another one is cross-compiled)."""
    return str(tvm.target.codegen.llvm_get_system_triple())


def export_library(executable, path: str, cross_cc: str | None = None) -> None:
    """Write a CPU executable as a library a remote can load: ``path`` ending ``.so`` is
    linked here (by ``cross_cc``, e.g. ``aarch64-linux-gnu-g++``, for another machine),
    ``.tar`` holds the object files, which the remote links when it loads them."""
    fcompile = tvm_cc.cross_compiler(cross_cc) if cross_cc else None
    executable.export_library(path, fcompile=fcompile)


def remote_device(session, kind: str):
    """Device 0 of ``session`` of the target kind ``kind`` ("cuda", else the CPU)."""
    return session.cuda(0) if kind == "cuda" else session.cpu(0)


def remote_load(session, path: str):
    """Upload the library at ``path`` and load it on the remote.  Load each file once per
    session and keep the module: loading one path a second time crashes the session."""
    session.upload(path)
    return session.load_module(os.path.basename(path))


def remote_tensors(arrays: list, dev) -> list:
    """Copies of numpy ``arrays`` on the remote device ``dev``."""
    return [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in arrays]


def remote_time_ms(module, name: str, dev, tensors: list, repeat: int) -> float:
    """Median milliseconds of one call of ``module[name]`` on remote ``tensors`` (after
    one warm-up call), timed on the device by TVM's evaluator."""
    module[name](*tensors)
    timer = module.time_evaluator(name, dev, number=1, repeat=repeat,
                                  min_repeat_ms=MIN_REPEAT_MS)
    return float(timer(*tensors).median) * 1e3
