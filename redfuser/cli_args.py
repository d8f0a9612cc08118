"""Command-line argument types shared by ``cli`` and ``cli_tune``: every size a positive
integer, refused by argparse with one line naming what was given."""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """A command line that cannot be run: one line on stderr, exit code 2."""


def positive(text: str) -> int:
    """argparse type: a positive integer (a size).

    Examples
    --------
    >>> positive("64")
    64
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {value}")
    return value


def row_axes(text: str) -> tuple[int, ...]:
    """argparse type: row axes such as ``8x1024``, each a positive integer.

    Examples
    --------
    >>> row_axes("8x1024")
    (8, 1024)
    """
    try:
        return tuple(positive(part) for part in text.split("x"))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected row axes such as 8x1024 (positive "
                                         f"integers), not {text!r}") from None


def shape(item: str) -> tuple[str, tuple[int, ...]]:
    """argparse type of --shape: an input's name and axes; ``scale=`` is a scalar.

    Examples
    --------
    >>> shape("x=4096x4096"), shape("scale=")
    (('x', (4096, 4096)), ('scale', ()))
    """
    name, sep, dims = item.partition("=")
    try:
        if not sep or not name.isidentifier():
            raise ValueError
        return name, row_axes(dims) if dims else ()
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected NAME=AxBxC with positive axes (e.g. "
                                         f"x=4096x4096), not {item!r}") from None
