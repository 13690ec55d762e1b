"""Non-negative integers written in ASCII digits, as configs, flags, query strings and endpoints take them."""

from __future__ import annotations


def ascii_int(s: str) -> int | None:
    """`s` as an int when it is ASCII digits only, else None ("", a sign, spaces). str.isdigit alone takes
    "①" and "²", which int() then refuses, and "١", which int() reads as 1."""
    if not (s.isascii() and s.isdigit()):
        return None
    try:
        return int(s)
    except ValueError:   # over Python's 4300 digits: no count or id we take, and int()'s error is a 500
        return None
