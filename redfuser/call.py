"""The call path of a ``Kernel``: one ``CallPlan`` per input signature, then a thin loop.

Everything that depends only on the inputs' kinds, shapes and dtypes (the layout check,
the geometry, the plan, the compiled function, every argument's kernel shape and every
output's user shape) is worked out on the first call with that signature and looked up
afterwards.  The kernel's arguments take the caller's shapes (``signature.call_shape``), so
a call hands its arrays to TVM as they are (a reshape, no copy, only where an input has
fewer row axes than the kernel) and returns the buffers the kernel wrote: numpy in gives
numpy out, a DLPack tensor (torch) in gives the same framework's tensors out, zero-copy.
``out=`` supplies preallocated outputs; they are checked once per signature, and a wrong
shape, dtype, alignment or layout is a clear error naming the output.
"""

from __future__ import annotations

import importlib
import operator
from dataclasses import dataclass
from math import prod
from numbers import Number

import numpy as np

from algebra.cascade import LENGTH
from algebra.layout import VIEW_BITS, Layout, vector_results
from algebra.rule import FusionRule

from .lowering import FUNC_NAME, Geometry, signature
from .lowering.signature import call_shapes
from .runtime import Built
from .tvm_adapter import ALIGNMENT, aligned_arg, from_dlpack, kernel_arg

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


def call_plan(rule: FusionRule, layout: Layout, geo: Geometry, built: Built,
              key: tuple, inputs: dict, keep: frozenset | None = None) -> CallPlan:
    """The ``CallPlan`` of a signature whose layout was checked and whose kernel is built
    (``inputs``: the first call's, whose kinds the key fixes; ``keep``: the per-row results
    the kernel returns, as ``signature``)."""
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
    return CallPlan(geo, built, built.executable[FUNC_NAME],
                    _input_views(sig, shapes, key),
                    outs, direct, caller_kind(inputs),
                    caller_address(inputs) if all(map(prod, shapes)) else None,  # empty: copied
                    tuple(map(_fresh, outs)))


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
    aligned, and through ``tvm_adapter.from_dlpack`` (the check, or an aligned copy)
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


def output_arrays(plan: CallPlan, out: dict | None) -> tuple[dict, list]:
    """(user-facing outputs, kernel arguments): the caller's ``out`` arrays where given
    (checked), else fresh arrays.  A fresh ``np.empty`` is ALIGNMENT-aligned without a
    check: numpy takes its memory from malloc, aligned for any C type (16 bytes on
    x86-64 and AArch64; tests/test_call.py holds it to that)."""
    if out:
        return _given_outputs(plan, out)
    users, args = {}, []
    for o in plan.fresh:
        buf = np.empty(o.shape, o.dtype)
        users[o.name] = buf if o.user_shape is None else buf.reshape(o.user_shape)
        args.append(kernel_arg(buf) if o.empty else buf)  # empty: an N = 0 stream
    return users, args


def _given_outputs(plan: CallPlan, out: dict) -> tuple[dict, list]:
    unknown = sorted(set(out) - {o.name for o in plan.outputs})
    if unknown:
        raise ValueError(f"out names {unknown}, which this kernel does not compute; its "
                         f"outputs are {[o.name for o in plan.outputs]}")
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
    return {k: v if k in out else to_caller(v) for k, v in users.items()}
