"""``redfuser.compile``'s options checked before anything is built: each value no plan or
target can honour is refused by name (at compile time: a refusal at the first call would
come after the caller kept the kernel)."""

from __future__ import annotations

from algebra import FusionRule
from algebra.dtypes import ARRAYS, COMPUTES, array_dtype

from .lowering import Plan
from .lowering.plan import check_variant
from .plans import TUNE_MODES


def check_dynamic(rule: FusionRule, backend_, variant, splits, tune, plan) -> None:
    """Refuse what a kernel for every shape cannot honour, naming the option (at compile
    time: a refusal at the first call would come after the caller kept the kernel)."""
    if backend_.dynamic is None:
        raise ValueError(f"dynamic=True: target '{backend_.name}' builds kernels for static "
                         "shapes only")
    check_variant(variant, dynamic=True)
    if splits is not None or (plan is not None and plan.variant == "split"):
        raise ValueError("splits cut each row by its length: they need dynamic=False")
    if tune not in (None, False):
        raise ValueError("tune searches one shape: it needs dynamic=False")
    if not rule.cascade.streams:
        raise ValueError("dynamic=True needs a streamed input: N is read from its shape")


def out_dtype_of(out_dtype) -> str | None:
    """The per-element outputs' storage dtype a caller asked for (None: the streams')."""
    if out_dtype is None:
        return None
    kind = array_dtype(out_dtype)
    if kind is None:
        raise ValueError(f"out_dtype must be one of {', '.join(ARRAYS)} (or None: the "
                         f"streams' dtype), not {out_dtype!r}")
    return kind.name


def compute_dtype_of(compute_dtype, backend_) -> str | None:
    """The compute dtype a caller asked for (None: float64 where an input is float64, else
    float32), refused by name where it is no compute dtype or the target builds none such."""
    if compute_dtype is None:
        return None
    kind = array_dtype(compute_dtype)
    if kind is None or kind.name not in COMPUTES:
        raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTES)} (or None: "
                         f"float64 where an input is float64, else float32), not "
                         f"{compute_dtype!r}")
    backend_.check_compute(kind.name)
    return kind.name


def kept_results(rule: FusionRule, outputs) -> frozenset | None:
    """The per-row results a call returns when the caller names ``outputs`` (None: all), or
    a clear error for a name the rule does not output or a per-element output left out."""
    if outputs is None:
        return None
    if isinstance(outputs, str) or not all(isinstance(n, str) for n in outputs):
        raise TypeError(f"outputs must be a list of output names, not {outputs!r}")
    names, every = set(outputs), rule.outputs
    unknown = sorted(names - set(every))
    if unknown or not names:
        raise ValueError(f"outputs names {unknown or 'nothing'}; this kernel's outputs are "
                         f"{list(every)}")
    left = [n for n in rule.cascade.elementwise if n not in names]
    if left:
        raise ValueError(f"outputs leaves out the per-element output(s) {left}: the pass "
                         "that writes them is part of the rule, name them too")
    return frozenset(n for n in names if n not in rule.cascade.elementwise)


def check_options(backend_, variant, splits, fast_math, threads, tune, plan) -> None:
    """Refuse option values that no plan can honour, naming the option."""
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be a redfuser.lowering.Plan, not {type(plan).__name__}")
    if plan is not None and type(plan) is not backend_.plan_type:
        raise TypeError(f"plan must be a {backend_.plan_type.__name__} for target "
                        f"'{backend_.name}', not a {type(plan).__name__}")
    check_variant(variant)
    for name, value in (("splits", splits), ("threads", threads)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, not {value!r}")
    if not isinstance(fast_math, bool):
        raise TypeError(f"fast_math must be True or False, not {fast_math!r}")
    if tune not in TUNE_MODES:
        raise ValueError(f"tune must be None, True, False or 'model', not {tune!r}")
