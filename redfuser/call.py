"""The call path of a ``Kernel``: one ``CallPlan`` per input signature, then a thin loop.

Everything that depends only on the inputs' kinds, shapes and dtypes (the layout check,
the geometry, the plan, the compiled function, every argument's kernel shape and every
output's user shape) is worked out on the first call with that signature and looked up
afterwards.  The kernel's arguments take the caller's shapes (``signature.call_shape``), so
a call hands its arrays to TVM as they are (a reshape, no copy, only where an input has
fewer row axes than the kernel) and returns the buffers the kernel wrote: numpy in gives
numpy out, a DLPack tensor (torch) in gives the same framework's tensors out, zero-copy.
``out=`` supplies preallocated outputs; a wrong shape, dtype, alignment or layout is a
clear error naming the output, and so are two outputs that share memory.  An output that
overlaps an input is written to a temporary and copied into the caller's array after the
kernel ran (the kernels read and write through restrict pointers, in an order of their
own), except where exactly the same memory is known to be safe (``in_place``): a rule's
only per-element output over a stream of its shape, whose element is read before it is
written.  A call with no rows (a row axis of 0) returns empty outputs without a kernel.
"""

from __future__ import annotations

import importlib
import operator
from dataclasses import dataclass
from math import prod
from numbers import Number

import numpy as np
from numpy.lib.array_utils import byte_bounds

from algebra.cascade import LENGTH
from algebra.layout import VIEW_BITS, Layout, vector_results
from algebra.rule import FusionRule
from algebra.stages import StagedLowering

from .lowering import FUNC_NAME, Geometry, signature
from .lowering.signature import call_shapes
from .runtime import Built
from .tvm.ir import ALIGNMENT
from .tvm.runtime import aligned_arg, from_dlpack, kernel_arg

F32 = np.dtype(np.float32)


def input_key(inputs: dict) -> tuple:
    """What a call's plan depends on: per input, a number or (shape, dtype, contiguous, type);
    the stream length ``N`` (given when only the index is streamed) by its value.  In the
    caller's order (another order is another key: a second plan, no recompile)."""
    return tuple([(name, _length_key(v) if name == LENGTH else _key(v))  # a list: 0.1 us less
                  for name, v in inputs.items()])


def _length_key(v) -> tuple:
    """``N`` by its integer value (np.int64(7) and 7 share a plan); anything that is not an
    integer gets a key of its own, and the layout check names the problem."""
    try:
        if not isinstance(v, bool):
            return ("value", operator.index(v), None, True)
    except TypeError:
        pass
    return ("other", repr(v), None, False)


def _key(v) -> tuple:
    """(kind, shape, dtype, whether it can be handed to the kernel as it is), through the
    key function of ``v``'s type (``_keyer``, looked up once per type: the ABC and
    attribute checks cost more than the key of a torch tensor itself)."""
    keyer = _KEYERS.get(type(v))
    if keyer is None:
        keyer = _keyer(type(v))
        if keyer is None:
            return _instance_key(v)
        _KEYERS[type(v)] = keyer
    return keyer(v)


def _numpy_key(v) -> tuple:
    return ("numpy", v.shape, v.dtype, v.flags.c_contiguous)


def _number_key(v) -> tuple:
    return ("number", (), None, True)


def _keyer(kind: type):
    """The key function of the values of type ``kind``: numbers, numpy arrays (a subclass
    read through the layout check), and tensor types that declare a shape and a dtype
    (torch's: on the CPU, contiguous, with no lazy view bit set, can be handed over as
    they are);
    None for any other type (``_instance_key`` reads each value)."""
    if issubclass(kind, Number):
        return _number_key
    if issubclass(kind, np.ndarray):
        return lambda v: ("numpy", v.shape, v.dtype, False)
    if not (hasattr(kind, "shape") and hasattr(kind, "dtype")):
        return None
    module = kind.__module__
    flags = tuple(getattr(kind, f) for f, _ in VIEW_BITS if hasattr(kind, f))  # unbound
    if not (hasattr(kind, "is_contiguous") and hasattr(kind, "is_cpu")):
        return lambda v: (module, tuple(v.shape), v.dtype, False)

    def key(v) -> tuple:
        plain = v.is_cpu and v.is_contiguous()
        for flag in flags:  # a loop, not any(): a generator costs 0.3 us of a 1.3 us key
            plain = plain and not flag(v)
        return (module, tuple(v.shape), v.dtype, plain)
    return key


def _instance_key(v) -> tuple:
    if not hasattr(v, "shape") or not hasattr(v, "dtype"):
        return ("other", type(v).__name__, None, False)  # the layout check names the problem
    return (type(v).__module__, tuple(v.shape), str(v.dtype), False)


_KEYERS = {np.ndarray: _numpy_key}


@dataclass(frozen=True)
class Output:
    name: str
    kernel_shape: tuple[int, ...]
    user_shape: tuple[int, ...]
    dtype: np.dtype


@dataclass(frozen=True)
class Fresh:
    """How one output is allocated on every call, worked out once: its kernel shape and
    dtype, the user's shape where it differs (else None: a reshape costs 0.3 us), whether
    it is empty."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    user_shape: tuple[int, ...] | None
    empty: bool


@dataclass(frozen=True)
class CallPlan:
    """One input signature's call: the compiled function and every argument's shapes.
    ``direct``: every array input can be handed over as it is (float32, C-contiguous);
    otherwise each call converts through ``algebra.layout`` (still without recompiling)."""

    geo: Geometry
    built: Built
    func: object
    # kernel argument order: (name, the kernel's view, whether the caller's arrays have it)
    inputs: tuple[tuple[str, tuple[int, ...], bool], ...]
    outputs: tuple[Output, ...]
    direct: bool
    to_caller: object  # numpy array -> the caller's tensor kind, zero-copy (None: numpy)
    address: object  # the caller's tensor -> its data address (None: not known, DLPack's check)
    fresh: tuple[Fresh, ...]  # ``outputs`` as allocated when the caller gives no ``out``
    in_place: frozenset[tuple[str, str]]  # (output, input) that may be the same memory
    arrays: tuple[str, ...]  # the inputs that are arrays (not numbers): what out= may overlap


def call_plan(rule: FusionRule, layout: Layout, geo: Geometry, built: Built | None,
              key: tuple, inputs: dict, keep: frozenset | None = None) -> CallPlan:
    """The ``CallPlan`` of a signature whose layout was checked and whose kernel is built
    (``inputs``: the first call's, whose kinds the key fixes; ``keep``: the per-row results
    the kernel returns, as ``signature``; ``built`` None: no rows, nothing to launch)."""
    sig = signature(rule, geo, keep)
    shapes = call_shapes(rule, geo, keep)  # the kernel's view of every argument
    vector = vector_results(rule.cascade, layout.vector)
    outs = tuple(Output(a.name, shape, _user_shape(rule, layout, a, vector),
                        np.dtype(a.dtype))
                 for a, shape in zip(sig.outputs, shapes[len(sig.inputs):], strict=True))
    for o in outs:
        if prod(o.user_shape) != prod(o.kernel_shape):  # the two conventions must agree
            raise RuntimeError(f"output '{o.name}': kernel shape {o.kernel_shape} does not "
                               f"hold user shape {o.user_shape}")
    direct = all(k[-1] and (k[2] is None or _is_f32(k[2])) for _, k in key)
    return CallPlan(geo, built, _no_rows if built is None else built.executable[FUNC_NAME],
                    _input_views(sig, shapes, key),
                    outs, direct, caller_kind(inputs),
                    caller_address(inputs) if all(map(prod, shapes)) else None,  # empty: copied
                    tuple(map(_fresh, outs)), _in_place(rule),
                    tuple(name for name, k in key if k[0] not in ("number", "value")))


def _no_rows(*args) -> None:
    """The "kernel" of a call with no rows: its outputs are empty, there is nothing to
    compute (TVM refuses a zero-row buffer, and numpy returns empty results)."""


def _in_place(rule: FusionRule) -> frozenset[tuple[str, str]]:
    """The (output, input) pairs that may be exactly the same memory: a one-pass rule's only
    per-element output over a stream of its shape.  The pass that writes element i reads
    the streams' element i first and no pass reads it again (tests/test_call_reliability.py
    checks every variant against float64).  Nothing else: a staged rule's later stage reads
    its inputs again after an earlier stage wrote its results, a second per-element output
    would read the element the first one overwrote, and a per-row result is written while
    the row's parameters may still be read."""
    elementwise = list(rule.cascade.elementwise)
    if isinstance(rule, StagedLowering) or len(elementwise) != 1:
        return frozenset()
    return frozenset((elementwise[0], s.name) for s in rule.cascade.streams)


def _input_views(sig, shapes: list, key: tuple) -> tuple:
    """(name, kernel view, whether the keyed caller's shape is it already) per input."""
    given = {name: k[1] for name, k in key}
    return tuple((a.name, shape, tuple(given.get(a.name, ())) == shape)
                 for a, shape in zip(sig.inputs, shapes, strict=False))


def _fresh(o: Output) -> Fresh:
    user = None if o.user_shape == o.kernel_shape else o.user_shape
    return Fresh(o.name, o.kernel_shape, o.dtype, user, prod(o.kernel_shape) == 0)


def _is_f32(dtype) -> bool:
    return dtype == F32 or str(dtype) in ("torch.float32", "float32")


def _user_shape(rule, layout: Layout, arg, vector: set) -> tuple[int, ...]:
    """The documented shape of an output (``algebra.layout.to_user``): (*rows[, D | k]) for
    results, (*rows, N[, D]) for per-element outputs."""
    c = rule.cascade
    feature = (layout.d or 1,) if arg.name in vector else ()
    shape = c.shapes.get(arg.name)
    if shape is not None and shape.k:
        return layout.rows + (shape.k,)
    if arg.elementwise:
        return layout.rows + (layout.n,) + feature
    return layout.rows + feature


def input_arrays(plan: CallPlan, inputs: dict, layout: Layout | None) -> list:
    """The kernel's inputs: the caller's memory reshaped (no copy) when ``direct``, else the
    views ``algebra.layout`` made (converted to float32 there).  The FFI takes numpy arrays
    and torch tensors as they are (DLPack in C); TVM never checks the alignment a kernel
    was compiled for, so a tensor goes over as it is only where its address is known to be
    aligned, and through ``redfuser.tvm.runtime.from_dlpack`` (the check, or an aligned copy)
    otherwise (torch: 1.1 us against 3.8 us a call).  An array already of the kernel's view
    (the key says so) is handed over without a reshape (0.15 us; torch's: 2 us)."""
    out = []
    for name, shape, as_is in plan.inputs:
        v = inputs[name] if layout is None else layout.arrays[name]
        if type(v) is np.ndarray and v.flags.owndata and v.size:
            # numpy's own memory is aligned (``output_arrays``)
            out.append(v if as_is and layout is None else v.reshape(shape))
        elif isinstance(v, Number):
            out.append(np.full(shape, v, F32))
        elif layout is None and plan.address is not None and plan.address(v) % ALIGNMENT == 0:
            out.append(v if as_is else v.reshape(shape))  # a plain CPU tensor (the key), aligned
        else:
            out.append(from_dlpack(v.reshape(shape)))
    return out


def output_arrays(plan: CallPlan) -> tuple[dict, list]:
    """(user-facing outputs, kernel arguments) of a call without ``out``: fresh arrays.  A
    fresh ``np.empty`` is ALIGNMENT-aligned without a check: numpy takes its memory from
    malloc, aligned for any C type (16 bytes on x86-64 and AArch64; tests/test_call.py
    holds it to that)."""
    users, args = {}, []
    for o in plan.fresh:
        buf = np.empty(o.shape, o.dtype)
        users[o.name] = buf if o.user_shape is None else buf.reshape(o.user_shape)
        args.append(kernel_arg(buf) if o.empty else buf)  # empty: an N = 0 stream
    return users, args


def given_outputs(plan: CallPlan, out, inputs: dict | None = None) -> tuple[dict, list, list]:
    """(user-facing outputs, kernel arguments, copies) of a call with ``out``: the caller's
    arrays where given (checked, and refused where two of them share memory), fresh arrays
    for the other outputs.  With the call's ``inputs`` (a host kernel, which reads the
    caller's memory), an output that overlaps an input (other than ``plan.in_place``'s
    exact aliases) is written to a fresh temporary instead: ``copies`` lists the
    (caller's array, temporary) pairs to copy after the kernel ran."""
    names = [o.name for o in plan.outputs]
    if not isinstance(out, dict):
        raise TypeError(f"out must be a dict mapping output name -> array (this kernel's "
                        f"outputs are {names}), not a {type(out).__name__}")
    unknown = sorted(set(out) - set(names))
    if unknown:
        raise ValueError(f"out names {unknown}, which this kernel does not compute; its "
                         f"outputs are {names}")
    users, args = _given_arrays(plan, out)
    given = [(o.name, out[o.name]) for o in plan.outputs if out.get(o.name) is not None]
    for i, (a, va) in enumerate(given):  # a handful of outputs: every pair
        for b, vb in given[i + 1:]:
            if overlaps(va, vb):
                raise ValueError(f"out['{a}'] and out['{b}'] share memory: the kernel "
                                 "writes both, give each output a buffer of its own")
    return users, args, [] if inputs is None else _overlap_copies(plan, out, inputs, args)


def _overlap_copies(plan: CallPlan, out: dict, inputs: dict, args: list) -> list:
    """Replace in ``args`` each given output that overlaps an input by a temporary; the
    (caller's array in the kernel's shape, temporary) pairs to copy afterwards."""
    copies = []
    for index, o in enumerate(plan.outputs):
        given = out.get(o.name)
        if given is None:
            continue
        for name in plan.arrays:
            value = inputs[name]
            if not overlaps(given, value):
                continue
            if (o.name, name) in plan.in_place and same_memory(given, value):
                continue  # read before written, element by element (``_in_place``)
            temp = np.empty(o.kernel_shape, o.dtype)
            args[index] = temp
            copies.append((host_array(given).reshape(o.kernel_shape), temp))
            break
    return copies


def _given_arrays(plan: CallPlan, out: dict) -> tuple[dict, list]:
    """(user-facing outputs, kernel arguments): ``out``'s arrays checked, fresh ones for the
    outputs it does not name."""
    users, args = {}, []
    for o in plan.outputs:
        given = out.get(o.name)
        if given is None:  # aligned as output_arrays' are
            buf = np.empty(o.kernel_shape, o.dtype)
            users[o.name] = buf.reshape(o.user_shape)
            args.append(kernel_arg(buf))
            continue
        _check_out(o, given)
        arg = aligned_arg(given.reshape(o.kernel_shape))
        if arg is None:
            raise ValueError(f"out['{o.name}'] must be C-contiguous and {ALIGNMENT}-byte "
                             "aligned (numpy's and torch's own allocations are)")
        users[o.name] = given
        args.append(arg)
    return users, args


def _check_out(o: Output, given) -> None:
    """``given`` can be written by the kernel in place as output ``o``, or a clear error."""
    if (type(given) is np.ndarray and given.shape == o.user_shape and given.dtype == o.dtype
            and given.flags.c_contiguous and given.flags.writeable):
        return  # the common case, in a few attribute reads (the caller checks alignment)
    shape, dtype = tuple(getattr(given, "shape", ())), str(getattr(given, "dtype", type(given)))
    if not hasattr(given, "__dlpack__"):
        raise TypeError(f"out['{o.name}'] must be an array or a DLPack tensor, not "
                        f"{type(given).__name__}")
    if shape != o.user_shape:
        raise ValueError(f"out['{o.name}'] has shape {shape}; expected {o.user_shape}")
    for flag, _ in VIEW_BITS:  # the kernel writes memory; such a view would read it changed
        if getattr(given, flag, lambda: False)():
            raise ValueError(f"out['{o.name}'] is a view with its {flag[3:]} bit set (its "
                             "memory does not hold its values): pass a plain tensor")
    if dtype.replace("torch.", "") != o.dtype.name:
        raise TypeError(f"out['{o.name}'] has dtype {dtype}; expected {o.dtype.name}")
    if isinstance(given, np.ndarray):
        ok, address = given.flags.c_contiguous and given.flags.writeable, given.ctypes.data
    else:
        ok, address = given.is_contiguous(), given.data_ptr()
    if not ok or address % ALIGNMENT:
        raise ValueError(f"out['{o.name}'] must be C-contiguous, writeable and "
                         f"{ALIGNMENT}-byte aligned (numpy's and torch's own allocations are)")


def host_array(v) -> np.ndarray | None:
    """``v`` as a numpy array over the same memory (a DLPack tensor's, zero-copy), or None
    where it has none on the host (a number, a device tensor)."""
    if isinstance(v, np.ndarray):
        return v
    try:
        return np.from_dlpack(v)
    except (AttributeError, BufferError, RuntimeError, TypeError, ValueError):
        return None


def byte_range(v) -> tuple[int, int] | None:
    """The bytes [lo, hi) that array or tensor ``v`` spans; None when it is empty or has no
    host memory.  A torch tensor's from its address and strides (0.5 us; its DLPack view
    costs 2.4 us), any other's through ``host_array``."""
    if hasattr(v, "data_ptr") and hasattr(v, "is_cpu"):
        if not v.is_cpu or v.numel() == 0:
            return None
        start, size = v.data_ptr(), v.element_size()
        if v.is_contiguous():
            return start, start + v.numel() * size
        span = sum([(n - 1) * s for n, s in zip(v.shape, v.stride(), strict=True)])
        return start, start + (span + 1) * size  # torch's strides are >= 0
    array = host_array(v)
    if array is None or array.size == 0:
        return None
    return byte_bounds(array)


def overlaps(a, b) -> bool:
    """May arrays/tensors ``a`` and ``b`` share memory?  By the byte ranges they span (two
    numpy arrays: ``np.may_share_memory``, 0.3 us): exact for the C-contiguous outputs, and
    for a strided input at worst a needless temporary."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return np.may_share_memory(a, b)
    ra, rb = byte_range(a), byte_range(b)
    return ra is not None and rb is not None and ra[0] < rb[1] and rb[0] < ra[1]


def same_memory(a, b) -> bool:
    """Are ``a`` and ``b`` (float32, as the call checked) views of exactly the same elements:
    the same bytes, the same shape, both C-contiguous?"""
    ha, hb = host_array(a), host_array(b)
    return (ha is not None and hb is not None and ha.shape == hb.shape
            and ha.flags.c_contiguous and hb.flags.c_contiguous
            and byte_bounds(ha) == byte_bounds(hb))


def caller_kind(inputs: dict):
    """How a fresh numpy output becomes the caller's kind of tensor, zero-copy: the module of
    the first non-numpy array input (torch), its ``from_numpy`` where it has one (a C call,
    half of ``from_dlpack``'s Python-level cost), else its ``from_dlpack``; None for numpy
    inputs."""
    for v in inputs.values():
        if not isinstance(v, Number | np.ndarray) and hasattr(v, "__dlpack__"):
            module = importlib.import_module(type(v).__module__.split(".")[0])
            return getattr(module, "from_numpy", None) or module.from_dlpack
    return None


def caller_address(inputs: dict):
    """The data address of the caller's tensors (torch's ``data_ptr``), read through the
    type of the first non-numpy array input that declares one; None otherwise."""
    for v in inputs.values():
        if not isinstance(v, Number | np.ndarray) and hasattr(v, "__dlpack__"):
            return getattr(type(v), "data_ptr", None)
    return None


def in_kind(users: dict, out: dict | None, to_caller) -> dict:
    """Outputs as the caller's kind: ``out`` objects as given, fresh ones converted
    zero-copy (``caller_kind``)."""
    if to_caller is None:
        return users
    if not out:
        return {k: to_caller(v) for k, v in users.items()}
    return {k: v if out.get(k) is not None else to_caller(v) for k, v in users.items()}
