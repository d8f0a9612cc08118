"""The backward of a product reduction (``algebra.backward``): its log-derivative.

``R = prod(b(x, a))`` with every factor nonzero has ``dR/da = R * sum((db/da) / b)``, so R
passes to each anchor, parameter or per-row value ``a`` what a sum passes, with ``db/da``
replaced by ``R * (db/da) / b``.  Where ``(db/da) / b`` is free of the stream (an exp
factor's: a constant) the sum is N times it, no new sum: geometric_mean's
``g_prod = prod(exp((x - m) / N))`` passes ``-g_prod`` times its adjoint to m, which cancels
what ``g = g_prod * exp(m)`` passes, so m comes out a stabiliser (proven, as softmax's m);
otherwise R's adjoint is materialised as a line of the backward, as a sum's is.  A stream
element gets ``adjoint(R) * R * (db/dx) / b``.

Where a factor can be 0 (sympy cannot show ``b != 0``: ``prod(x[i])``), ``R / b`` is not the
derivative: torch's convention there (the product of the other factors to a lone zero,
nothing where two are 0) needs the zero count and the product of the nonzero factors, new
reductions of the backward that are not derived yet, so such a product is refused
(``check_factors``).  Nothing here is assumed by the proof (``algebra.backward_proof``), which
unrolls R as the product of its factors.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp

from .adjoint import Adjoint, diff, ratio, spelled
from .backward_text import spelling
from .cascade import Cascade, N, Reduction
from .errors import NoBackward
from .functions import Where
from .printing import spec_text

PRODUCTS = ("prod",)  # reductions differentiated by their log-derivative
ZERO_FACTOR = ("{name} = prod({factor}): a factor can be 0, where {name}/factor is not its "
               "derivative (torch's zero handling needs the product of the other factors, not "
               "derived yet)")


def check_factors(c: Cascade, red: Reduction) -> None:
    """Raise ``NoBackward`` where ``red`` is a product one of whose factors can be 0
    (``can_be_zero``): its log-derivative is not its derivative there.

    Examples
    --------
    >>> from algebra.spec import parse
    >>> c = parse("p = prod(x[i])")
    >>> check_factors(c, c.reductions[0])
    Traceback (most recent call last):
    ...
    algebra.errors.NoBackward: p = prod(x[i]): a factor can be 0, where p/factor is not ...
    """
    if red.op in PRODUCTS and can_be_zero(red.body):
        factor = spec_text(spelled(red.body), spelling(c, {s.name for s in c.streams}),
                           NoBackward)
        raise NoBackward(ZERO_FACTOR.format(name=red.name, factor=factor))


def products_reached(c: Cascade, adjoint: dict[str, Adjoint]) -> tuple[str, ...]:
    """The products of ``c`` a gradient passes through (their ``adjoint`` is not 0).

    Examples
    --------
    >>> from algebra.spec import parse
    >>> c = parse("p = prod(exp(x[i]))\\nq = prod(exp(2 * x[i]))")
    >>> products_reached(c, {"p": Adjoint(row=sp.Symbol("dp")), "q": Adjoint()})
    ('p',)
    """
    return tuple(r.name for r in c.reductions
                 if r.op in PRODUCTS and adjoint.get(r.name, Adjoint()) != Adjoint())


def can_be_zero(factor: sp.Expr) -> bool:
    """Whether sympy cannot show ``factor`` nonzero for every real input (a select: on
    either branch), where a product's log-derivative is not its derivative.

    Examples
    --------
    >>> x = sp.Symbol("x", real=True)
    >>> can_be_zero(sp.exp(x)), can_be_zero(1 + sp.exp(x)), can_be_zero(x)
    (False, False, True)
    """
    if isinstance(factor, Where):
        return any(can_be_zero(b) for b in factor.args[1:])
    return factor.is_zero is not False


def log_derivative(factor: sp.Expr, s: sp.Symbol) -> sp.Expr:
    """``(d factor / d s) / factor``: a product's derivative is the product times its sum
    over the stream.

    Examples
    --------
    >>> from algebra.cascade import N
    >>> x, m = sp.symbols("x m", real=True)
    >>> log_derivative(sp.exp((x - m) / N), m)
    -1/N
    """
    return ratio(diff(factor, s), factor)


def through_product(red: Reduction, s: sp.Symbol, a: Adjoint, result: sp.Symbol,
                    per_element: set[sp.Symbol],
                    value_of: Callable[[str], sp.Expr]) -> Adjoint:
    """What ``red = prod(b)`` with adjoint ``a`` passes to the per-row value ``s``:
    ``a * red * sum((db/ds) / b)``, ``N`` times the log-derivative where it is free of the
    stream (``per_element``), else a sum over the stream of ``adjoint(red) * red * (db/ds) / b``
    (``value_of``: the adjoint of ``red`` as one per-row value); ``result`` is red's symbol.

    Examples
    --------
    >>> from algebra.spec import parse
    >>> c = parse("m = max(x[i])\\np = prod(exp(x[i] - m) * (1 + exp(t * x[i])))")
    >>> red, dp = c.reductions[-1], sp.Symbol("dp", real=True)
    >>> m, t, x = sorted(red.body.free_symbols, key=str)
    >>> through_product(red, m, Adjoint(row=dp), red.symbol, {x}, lambda _: dp)
    Adjoint(row=-N*dp*p, body=0)
    >>> through_product(red, t, Adjoint(row=dp), red.symbol, {x}, lambda _: dp).body
    dp*p*x*exp(t*x)/(exp(t*x) + 1)
    """
    q = log_derivative(red.body, s)
    if not q.free_symbols & per_element:
        return a.times(N * q * result)  # sum(q) = N * q: no sum to run
    return Adjoint(body=value_of(red.name) * result * q)


def element_derivative(red: Reduction, s: sp.Symbol, result: sp.Symbol) -> sp.Expr:
    """d red / d s at one element of the stream ``s``: ``db/ds`` for ``red = sum(b)``,
    ``red * (db/ds) / b`` for a product (``result``: red's symbol).

    Examples
    --------
    >>> from algebra.spec import parse
    >>> red = parse("p = prod(1 + exp(x[i]))").reductions[0]
    >>> element_derivative(red, next(iter(red.body.free_symbols)), red.symbol)
    p*exp(x)/(exp(x) + 1)
    """
    if red.op in PRODUCTS:
        return result * log_derivative(red.body, s)
    return diff(red.body, s)
