"""The call path of a ``Kernel``: one ``CallPlan`` per input signature, then a thin loop.

Everything that depends only on the inputs' kinds, shapes and dtypes (the layout check,
the geometry, the plan, the compiled function, every argument's kernel shape and every
output's user shape) is worked out on the first call with that signature (its key:
``call_key.input_key``) and looked up afterwards.  The kernel's arguments take the
caller's shapes (``signature.call_shape``), so a call hands its arrays to TVM as they are
(a reshape, no copy, only where an input has fewer row axes than the kernel) and returns
the buffers the kernel wrote: numpy in gives numpy out, a DLPack tensor (torch) in gives
the same framework's tensors out, zero-copy.  ``out=`` supplies preallocated outputs
(``out_arrays``: checked, and written through a temporary where one overlaps an input,
except where exactly the same memory is known to be safe: ``in_place``, a rule's only
per-element output over a stream of its shape, whose element is read before it is
written).  A call with no rows (a row axis of 0) returns empty outputs without a kernel.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from math import prod
from numbers import Number

import numpy as np

from algebra.dtypes import array_dtype, numpy_dtype
from algebra.layout import Layout, bits_view, vector_results
from algebra.rule import FusionRule
from algebra.stages import StagedLowering

from .lowering import FUNC_NAME, Geometry, signature
from .lowering.signature import call_shapes, output_shape
from .runtime import Built
from .tvm.ir import ALIGNMENT
from .tvm.runtime import from_dlpack, host_arg


@dataclass(frozen=True)
class Output:
    name: str
    kernel_shape: tuple[int, ...]
    user_shape: tuple[int, ...]
    dtype: np.dtype


@dataclass(frozen=True)
class Allocated:
    """How one output is allocated on every call, worked out once: its kernel shape and
    dtype, the user's shape where it differs (else None: a reshape costs 0.3 us), whether
    it is empty."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    user_shape: tuple[int, ...] | None
    wrapped: bool  # handed over through ``host_arg``: empty, or bfloat16 (over its bits)


@dataclass(frozen=True)
class CallPlan:
    """One input signature's call: the compiled function and every argument's shapes.
    ``direct``: every array input can be handed over as it is (a dtype the kernel declares
    as it is, C-contiguous); otherwise each call converts through ``algebra.layout`` (still
    without recompiling)."""

    geo: Geometry
    built: Built
    func: object
    # kernel argument order: (name, the kernel's view, whether the caller's arrays have it,
    # the dtype a number given for it is filled in)
    inputs: tuple[tuple[str, tuple[int, ...], bool, np.dtype], ...]
    outputs: tuple[Output, ...]
    direct: bool
    to_caller: object  # numpy array -> the caller's tensor kind, zero-copy (None: numpy)
    address: object  # the caller's tensor -> its data address (None: not known, DLPack's check)
    allocated: tuple[Allocated, ...]  # ``outputs`` as allocated when the caller gives no ``out``
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
    outs = tuple(Output(a.name, shape, user_shape(rule, layout, a, vector),
                        numpy_dtype(a.dtype))
                 for a, shape in zip(sig.outputs, shapes[len(sig.inputs):], strict=True))
    for o in outs:
        if prod(o.user_shape) != prod(o.kernel_shape):  # the two conventions must agree
            raise RuntimeError(f"output '{o.name}': kernel shape {o.kernel_shape} does not "
                               f"hold user shape {o.user_shape}")
    direct = all(k[-1] and (k[2] is None or _as_is(k[2])) for _, k in key)
    return CallPlan(geo, built, _no_rows if built is None else built.executable[FUNC_NAME],
                    _input_views(sig, shapes, key),
                    outs, direct, caller_kind(inputs, any(o.dtype.kind == "V" for o in outs)),
                    caller_address(inputs) if all(map(prod, shapes)) else None,  # empty: copied
                    tuple(map(_allocated, outs)), _in_place(rule),
                    tuple(name for name, k in key if k[0] not in ("number", "value")))


def _no_rows(*args) -> None:
    """The "kernel" of a call with no rows: its outputs are empty, there is nothing to
    compute (TVM refuses a zero-row buffer, and numpy returns empty results)."""


def _in_place(rule: FusionRule) -> frozenset[tuple[str, str]]:
    """The (output, input) pairs that may be exactly the same memory: a one-pass rule's only
    per-element output over a stream of its shape.  The pass that writes element i reads
    the streams' element i first and no pass reads it again (tests/api/test_call_reliability.py
    checks every variant against float64).  Nothing else: a staged rule's later stage reads
    its inputs again after an earlier stage wrote its results, a second per-element output
    would read the element the first one overwrote, and a per-row result is written while
    the row's parameters may still be read."""
    elementwise = list(rule.cascade.elementwise)
    if isinstance(rule, StagedLowering) or len(elementwise) != 1:
        return frozenset()
    return frozenset((elementwise[0], s.name) for s in rule.cascade.streams)


def _input_views(sig, shapes: list, key: tuple) -> tuple:
    """(name, kernel view, whether the keyed caller's shape is it already, its dtype) per
    input."""
    given = {name: k[1] for name, k in key}
    return tuple((a.name, shape, tuple(given.get(a.name, ())) == shape, numpy_dtype(a.dtype))
                 for a, shape in zip(sig.inputs, shapes, strict=False))


def _allocated(o: Output) -> Allocated:
    user = None if o.user_shape == o.kernel_shape else o.user_shape
    return Allocated(o.name, o.kernel_shape, o.dtype, user,
                     prod(o.kernel_shape) == 0 or o.dtype.kind == "V")


def _as_is(dtype) -> bool:
    """Can an input of ``dtype`` go to the kernel as the caller's memory is: a dtype the
    kernel declares as it is (float64 too; bfloat16 goes over as its bits:
    ``layout.host_view``, ``host_arg``)."""
    kind = array_dtype(dtype)
    return kind is not None and kind.bits_as is None


def user_shape(rule: FusionRule, layout: Layout, arg, vector: set) -> tuple:
    """The documented shape of output ``arg`` (``algebra.layout.to_user``): (*rows[, D | k])
    for results, (*rows, N[, D]) for per-element outputs; ``vector``: the outputs with a
    feature axis (``algebra.layout.vector_results``)."""
    feature = (layout.d or 1,) if arg.name in vector else ()
    return output_shape(rule, arg.name, layout.rows, layout.n, feature)


def input_arrays(plan: CallPlan, inputs: dict, layout: Layout | None) -> list:
    """The kernel's inputs: the caller's memory reshaped (no copy) when ``direct``, else the
    views ``algebra.layout`` made (numbers converted to the compute dtype there, arrays
    kept in theirs); a number the key let through is filled in its input's dtype. The FFI
    takes numpy arrays and torch tensors as they are (DLPack in C); TVM never checks the
    alignment a kernel was compiled for, so a tensor goes over as it is only where its
    address is known to be aligned, and through ``redfuser.tvm.runtime.from_dlpack`` (the
    check, or an aligned copy) otherwise (torch: 1.1 us against 3.8 us a call). An array
    already of the kernel's view (the key says so) is handed over without a reshape (0.15
    us; torch's: 2 us)."""
    out = []
    for name, shape, as_is, dtype in plan.inputs:
        v = inputs[name] if layout is None else layout.arrays[name]
        if type(v) is np.ndarray and v.flags.owndata and v.size:
            # numpy's own memory is aligned (``output_arrays``)
            v = v if as_is and layout is None else v.reshape(shape)
            out.append(host_arg(v) if v.dtype.kind == "V" else v)
        elif isinstance(v, Number):
            out.append(np.full(shape, v, dtype))
        elif layout is None and plan.address is not None and plan.address(v) % ALIGNMENT == 0:
            out.append(v if as_is else v.reshape(shape))  # a plain CPU tensor (the key), aligned
        else:
            out.append(from_dlpack(v.reshape(shape)))
    return out


def output_arrays(plan: CallPlan) -> tuple[dict, list]:
    """(user-facing outputs, kernel arguments) of a call without ``out``: allocated arrays.  A
    new ``np.empty`` is ALIGNMENT-aligned without a check: numpy takes its memory from
    malloc, aligned for any C type (16 bytes on x86-64 and AArch64; tests/api/test_call.py
    holds it to that)."""
    users, args = {}, []
    for o in plan.allocated:
        buf = np.empty(o.shape, o.dtype)
        users[o.name] = buf if o.user_shape is None else buf.reshape(o.user_shape)
        args.append(host_arg(buf) if o.wrapped else buf)
    return users, args


def caller_kind(inputs: dict, bits: bool = False):
    """How an allocated numpy output becomes the caller's kind of tensor, zero-copy: the module of
    the first non-numpy array input (torch), its ``from_numpy`` where it has one (a C call,
    half of ``from_dlpack``'s Python-level cost), else its ``from_dlpack``; None for numpy
    inputs.  With ``bits`` (a bfloat16 output, which numpy holds as ml_dtypes'), the
    output goes over as its int16 bits and is viewed as the module's dtype of that name."""
    for v in inputs.values():
        if not isinstance(v, Number | np.ndarray) and hasattr(v, "__dlpack__"):
            module = importlib.import_module(type(v).__module__.split(".")[0])
            convert = getattr(module, "from_numpy", None) or module.from_dlpack
            if not bits:
                return convert
            return lambda a: convert(a) if a.dtype.kind != "V" else \
                convert(bits_view(a)).view(getattr(module, a.dtype.name))
    return None


def caller_address(inputs: dict):
    """The data address of the caller's tensors (torch's ``data_ptr``), read through the
    type of the first non-numpy array input that declares one; None otherwise."""
    for v in inputs.values():
        if not isinstance(v, Number | np.ndarray) and hasattr(v, "__dlpack__"):
            return getattr(type(v), "data_ptr", None)
    return None


def in_kind(users: dict, out: dict | None, to_caller) -> dict:
    """Outputs as the caller's kind: ``out`` objects as given, allocated ones converted
    zero-copy (``caller_kind``)."""
    if to_caller is None:
        return users
    if not out:
        return {k: to_caller(v) for k, v in users.items()}
    return {k: v if out.get(k) is not None else to_caller(v) for k, v in users.items()}
