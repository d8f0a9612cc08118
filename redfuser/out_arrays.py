"""``out=``: the caller's preallocated outputs of a ``Kernel`` call, checked (shape, dtype,
alignment, layout: a clear error naming the output), refused where two of them share
memory, and written through a temporary where one overlaps an input (the kernels read
and write through restrict pointers, in an order of their own), except for the exact
aliases a rule allows (``call.CallPlan.in_place``)."""

from __future__ import annotations

import numpy as np
from numpy.lib.array_utils import byte_bounds

from algebra.layout import VIEW_BITS, host_view

from .call import CallPlan, Output
from .tvm.ir import ALIGNMENT
from .tvm.runtime import aligned_arg, host_arg


def given_outputs(plan: CallPlan, out, inputs: dict | None = None) -> tuple[dict, list, list]:
    """(user-facing outputs, kernel arguments, copies) of a call with ``out``: the caller's
    arrays where given (checked, and refused where two of them share memory), allocated arrays
    for the other outputs.  With the call's ``inputs`` (a host kernel, which reads the
    caller's memory), an output that overlaps an input (other than ``plan.in_place``'s
    exact aliases) is written to a new temporary instead: ``copies`` lists the
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
                continue  # read before written, element by element (``call._in_place``)
            temp = np.empty(o.kernel_shape, o.dtype)
            args[index] = host_arg(temp)
            copies.append((host_array(given).reshape(o.kernel_shape), temp))
            break
    return copies


def _given_arrays(plan: CallPlan, out: dict) -> tuple[dict, list]:
    """(user-facing outputs, kernel arguments): ``out``'s arrays checked, allocated ones for the
    outputs it does not name."""
    users, args = {}, []
    for o in plan.outputs:
        given = out.get(o.name)
        if given is None:  # aligned as output_arrays' are
            buf = np.empty(o.kernel_shape, o.dtype)
            users[o.name] = buf.reshape(o.user_shape)
            args.append(host_arg(buf))
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
        return host_view(v)
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
    """Are ``a`` and ``b`` (of one dtype, as the call checked) views of exactly the same elements:
    the same bytes, the same shape, both C-contiguous?"""
    ha, hb = host_array(a), host_array(b)
    return (ha is not None and hb is not None and ha.shape == hb.shape
            and ha.flags.c_contiguous and hb.flags.c_contiguous
            and byte_bounds(ha) == byte_bounds(hb))
