"""The two field checks every CuPy config class runs in ``__post_init__``."""
from __future__ import annotations

from ..core import conventions as cv


def check_positive(cfg, names) -> None:
    """Each field of ``names`` is None or a positive int (a ValueError naming config.<field>)."""
    for name in names:
        val = getattr(cfg, name)
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"config.{name}: must be a positive integer or None, got {val!r}")


def check_version(cfg, choices) -> None:
    """``cfg.version`` is None or one of ``choices``."""
    if cfg.version is not None:
        cv.check_choice(cfg.version, "config.version", choices)
