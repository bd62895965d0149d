"""How counts read in what the commands print: ``1 connection``, ``2 connections``, ``0 connections``."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str | None = None, *, grouped: bool = False) -> str:
    """``count`` (with thousands separators when ``grouped``) and ``noun``, plural unless ``count`` is one."""
    word = noun if count == 1 else plural or f"{noun}s"
    return f"{count:,} {word}" if grouped else f"{count} {word}"
