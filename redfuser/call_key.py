"""The key of a call's inputs: what a ``Kernel``'s per-signature plan (``call.CallPlan``)
depends on, read in about a microsecond per input (numbers, numpy arrays, torch tensors,
any DLPack tensor), so that a repeated call only looks its plan up."""

from __future__ import annotations

import operator
from numbers import Number

import numpy as np

from algebra.cascade import LENGTH
from algebra.layout import VIEW_BITS


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
