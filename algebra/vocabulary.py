"""The spec language's vocabulary: function names, comparisons, connectives, numpy kernels.

One table, ``FUNCTIONS``, maps each spec name to its arity, its sympy builder and the numpy
implementation used by the interpreter; ``COMPARISONS`` and ``CONNECTIVES`` map the spec's
operators to sympy's own classes; ``NUMPY_KERNELS`` maps each sympy class name the
interpreter meets to its numpy kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce

import numpy as np
import sympy as sp
from sympy.codegen.cfunctions import expm1, log1p

from .functions import Clip, Dot, Maximum, Minimum, Relu, Round, Sigmoid, Softplus, Where
from .ieee import IsFinite, IsInf, IsNaN


def _np_sigmoid(x):
    one = x.dtype.type(1)
    return one / (one + np.exp(-x))


def _np_erf(x):
    return np.vectorize(math.erf, otypes=[x.dtype])(x)  # numpy has no erf ufunc


def _np_dot(a, b):
    return np.sum(a * b, axis=-1, keepdims=True)


@dataclass(frozen=True)
class Elementwise:
    """One spec function: how many arguments, how sympy builds it, how numpy runs it."""

    arity: int
    build: Callable[..., sp.Expr]
    numpy: Callable[..., np.ndarray] | None  # None: sympy lowers it to other nodes
    condition: bool = False  # returns a condition (read by where), not a number


def _pow(a, b):
    return sp.Pow(a, b)


# spec name -> (arity, sympy builder, numpy kernel); keyed data, one line each.
FUNCTIONS: dict[str, Elementwise] = {
    "exp": Elementwise(1, sp.exp, np.exp),
    "log": Elementwise(1, sp.log, np.log),
    "sqrt": Elementwise(1, sp.sqrt, None),  # sqrt(x) -> x**(1/2)
    "rsqrt": Elementwise(1, lambda x: 1 / sp.sqrt(x), None),  # -> x**(-1/2)
    "abs": Elementwise(1, sp.Abs, np.abs),
    "tanh": Elementwise(1, sp.tanh, np.tanh),
    "sigmoid": Elementwise(1, Sigmoid, _np_sigmoid),
    "relu": Elementwise(1, Relu, lambda x: np.maximum(x, x.dtype.type(0))),
    "softplus": Elementwise(1, Softplus, lambda x: np.logaddexp(x, x.dtype.type(0))),
    "pow": Elementwise(2, _pow, None),  # -> Pow node
    "sin": Elementwise(1, sp.sin, np.sin),
    "cos": Elementwise(1, sp.cos, np.cos),
    "erf": Elementwise(1, sp.erf, _np_erf),
    "log1p": Elementwise(1, log1p, np.log1p),
    "expm1": Elementwise(1, expm1, np.expm1),
    "floor": Elementwise(1, sp.floor, np.floor),
    "ceil": Elementwise(1, sp.ceiling, np.ceil),
    "round": Elementwise(1, Round, np.round),
    "sign": Elementwise(1, sp.sign, np.sign),
    "clip": Elementwise(3, Clip, np.clip),  # np.clip: min(max(x, lo), hi), NaN stays NaN
    "maximum": Elementwise(2, Maximum, np.maximum),
    "minimum": Elementwise(2, Minimum, np.minimum),
    "dot": Elementwise(2, Dot, _np_dot),
    "where": Elementwise(3, Where, np.where),  # select: the other branch never leaks
    "isinf": Elementwise(1, IsInf, np.isinf, condition=True),  # +-inf (not NaN)
    "isfinite": Elementwise(1, IsFinite, np.isfinite, condition=True),  # not inf, not NaN
    "isnan": Elementwise(1, IsNaN, np.isnan, condition=True),
}

# Comparisons and connectives are sympy's own Relational/And/Or/Not (Booleans, never numbers):
# spec operator -> sympy class.  The spec uses Python's ``and``/``or``/``not`` for connectives.
COMPARISONS: dict[str, type] = {"Lt": sp.StrictLessThan, "LtE": sp.LessThan,
                                "Gt": sp.StrictGreaterThan, "GtE": sp.GreaterThan,
                                "Eq": sp.Equality, "NotEq": sp.Unequality}
CONNECTIVES: dict[str, type] = {"And": sp.And, "Or": sp.Or, "Not": sp.Not}


def _fold(op):
    return lambda *args: reduce(op, args)  # sympy's And/Or take any number of arguments


# sympy class name -> numpy kernel of the boolean nodes (IEEE: every comparison with NaN is
# false except !=, as in numpy).
BOOLEAN_KERNELS: dict[str, Callable[..., np.ndarray]] = {
    "StrictLessThan": np.less, "LessThan": np.less_equal, "StrictGreaterThan": np.greater,
    "GreaterThan": np.greater_equal, "Equality": np.equal, "Unequality": np.not_equal,
    "And": _fold(np.logical_and), "Or": _fold(np.logical_or), "Not": np.logical_not,
    "BooleanTrue": lambda: np.True_, "BooleanFalse": lambda: np.False_,
}

# sympy class name -> numpy kernel, for the interpreter's expression compiler.
NUMPY_KERNELS: dict[str, Callable[..., np.ndarray]] = {
    **{e.build.__name__: e.numpy for e in FUNCTIONS.values() if e.numpy is not None},
    **BOOLEAN_KERNELS,
    "AsWritten": lambda v: v,
}
