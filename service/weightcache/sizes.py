"""Integer size arithmetic shared by the planning stages and the memory backends.

One definition of rounding up to a multiple (an alignment, a VMM
granularity, a page, vLLM's vocabulary padding) and of ceiling division (a
count of chunks).

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client, weightcache.memory.
"""

from __future__ import annotations


def ceil_div(n: int, d: int) -> int:
    """``n / d`` rounded up, for ``n >= 0`` and ``d > 0`` (e.g. the number of ``d``-byte chunks of ``n`` bytes).

    Example:
        >>> ceil_div(0, 4), ceil_div(5, 4), ceil_div(8, 4)
        (0, 2, 2)
    """
    return -(-n // d)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (``n >= 0``, ``multiple > 0``; 0 stays 0).

    Args:
        n (`int`): a size (bytes, elements: the unit of ``multiple``).
        multiple (`int`): alignment, granularity or padding, same unit.

    Example:
        >>> round_up(0, 64), round_up(1, 64), round_up(64, 64), round_up(65, 64)
        (0, 64, 64, 128)
    """
    return ceil_div(n, multiple) * multiple
