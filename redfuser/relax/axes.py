"""Which rows and which stream a reduction over any set of axes reads.

The kernels reduce along the last axis of an (R, N) view of their inputs.  A reduction
over the trailing axes (LayerNorm over the two last axes, a variance over all of them)
reads the data as it lies: the reduced axes merge into one stream and the kernel's
reshape is free.  Any other set (softmax over axis 1 of a rank-4 tensor, batch
statistics over the batch and spatial axes) is read through one ``permute_dims`` that puts
the reduced axes last; an elementwise result then carries that permutation (``Node.perm``)
and the splice puts its axes back.  Axes of size 1 never count as moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from .frag import Unliftable, computed
from .values import Ext, Lifting, Operand, static_shape


@dataclass(frozen=True)
class View:
    """The data (of ``shape``, maybe a reshape of the Relax value) read as rows x stream.

    Examples
    --------
    >>> v = View((2, 3, 4, 5), (0, 2, 3), (1,))   # softmax over axis 1
    >>> v.out, v.perm
    ((2, 4, 5, 3), (0, 2, 3, 1))
    >>> View((2, 6, 8), (0,), (1, 2)).perm        # LayerNorm over the two last axes
    ()
    """

    shape: tuple[int, ...]
    kept: tuple[int, ...]  # the row axes, in order
    reduced: tuple[int, ...]  # the stream axes, in order

    @property
    def frame(self) -> tuple[int, ...]:
        return tuple(self.shape[a] for a in self.kept)

    @property
    def n(self) -> int:
        return prod(self.shape[a] for a in self.reduced)

    @property
    def out(self) -> tuple[int, ...]:
        return (*self.frame, self.n)

    @property
    def perm(self) -> tuple[int, ...]:
        """The permutation that puts the reduced axes last; () when no data moves."""
        order = self.kept + self.reduced
        moved = [a for a in order if self.shape[a] != 1]
        return () if moved == sorted(moved) else order


def axes_view(shape: tuple, axis) -> View:
    """The view of a reduction of ``shape`` over ``axis`` (an int, a list, or None: all).

    Examples
    --------
    >>> axes_view((2, 6, 8), None).out
    (96,)
    >>> axes_view((2, 6, 8), [-1]).kept
    (0, 1)
    """
    rank = len(shape)
    axes = range(rank) if axis is None else [axis] if isinstance(axis, int) else axis
    reduced = sorted({int(a) % rank for a in axes} if rank else set())
    if any(not -rank <= int(a) < rank for a in axes) or not reduced:
        raise Unliftable(f"reduces over axes {list(axes)} of a rank-{rank} tensor")
    view = View(tuple(shape), tuple(a for a in range(rank) if a not in reduced),
                tuple(reduced))
    if view.n < 2:
        raise Unliftable(f"nothing to reduce over: axes {reduced} of shape {shape}")
    return view


def _group_view(call, shape: tuple) -> View:
    """group_norm: the channel axis split into (groups, channels per group); each group
    reduces over its channels and the spatial axes."""
    attrs, rank = call.attrs, len(shape)
    c, groups = int(attrs.channel_axis) % rank, int(attrs.num_groups)
    if shape[c] % groups:
        raise Unliftable(f"{shape[c]} channels in {groups} groups")
    split = (*shape[:c], groups, shape[c] // groups, *shape[c + 1:])
    spatial = {int(a) % rank for a in attrs.axes}
    reduced = {c + 1} | {a + (a > c) for a in spatial}
    return View(split, tuple(a for a in range(rank + 1) if a not in reduced),
                tuple(sorted(reduced)))


VIEWS = {  # op -> its reduction view of the data (default: its axis / axes attribute)
    "relax.nn.group_norm": _group_view,
    "relax.nn.instance_norm": lambda call, shape: axes_view(shape, call.attrs.axes),
    # every axis but the channel's (training statistics)
    "relax.nn.batch_norm": lambda call, shape: axes_view(
        shape, [a for a in range(len(shape)) if a != int(call.attrs.axis) % len(shape)]),
}


def weight_shape(call, view: View) -> tuple:
    """Where a norm's weight varies, one entry per view axis (1 where it is broadcast)."""
    op, shape = call.op.name, view.shape
    if op == "relax.nn.group_norm":
        c = int(call.attrs.channel_axis) % (len(shape) - 1)
        return tuple(shape[a] if a in (c, c + 1) else 1 for a in range(len(shape)))
    if op in ("relax.nn.instance_norm", "relax.nn.batch_norm"):
        attrs = call.attrs
        c = int(getattr(attrs, "channel_axis", getattr(attrs, "axis", 0))) % len(shape)
        return tuple(shape[a] if a == c else 1 for a in range(len(shape)))
    return tuple(shape[a] if a in view.reduced else 1 for a in range(len(shape)))


def read_data(lf: Lifting, data, view: View) -> Operand:
    """The reduced data per element of the view: a lifted value when the reduction is
    over its last axis, else the Relax value reshaped (free) or permuted (a copy)."""
    shape, own = tuple(view.shape), static_shape(data.ty)
    if view.reduced == (len(shape) - 1,) and shape == own:
        return lf.elem(data, shape)
    ext = lf.ext(data)  # seen through reshapes: the view reshapes anyway
    if not view.perm:
        return lf.elem(Ext(ext.source, view.out, ext.dtype, (), ext.storage), view.out)
    steps = (("reshape", shape),) if shape != own else ()
    return lf.elem(Ext(data, view.out, ext.dtype, (*steps, ("perm", view.perm)),
                       str(data.ty.dtype)), view.out)


def read_weight(lf: Lifting, arg, view: View, where: tuple) -> Operand:
    """A norm's weight or bias (one axis of ``where`` per view axis: its size there, 1
    where it is broadcast) per element of the view: a per-row parameter, a stream, or a
    stream broadcast over part of the reduced axes (a per-channel weight of a group)."""
    own, dtype = static_shape(arg.ty), str(arg.ty.dtype)
    computed(dtype)
    if prod(where) != prod(own):
        raise Unliftable(f"weight {own} does not fit {where}")
    steps, full = [("reshape", where)], tuple(where)
    streamed = [where[a] for a in view.reduced if where[a] != 1]
    if streamed and prod(streamed) != view.n:  # read on part of the stream: spread it
        full = tuple(view.shape[a] if a in view.reduced else w for a, w in enumerate(where))
        steps.append(("broadcast", full))
    if view.perm:
        steps.append(("perm", view.perm))
    shape = (*(full[a] for a in view.kept), view.n if streamed else 1)
    return lf.elem(Ext(arg, shape, dtype, tuple(steps), dtype), view.out)
