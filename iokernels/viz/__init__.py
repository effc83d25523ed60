"""Plots and widgets shared by the notebooks and ``python -m iokernels figures``.

Nothing here computes attention: every figure calls into the package and draws what
it returns.  matplotlib and ipywidgets are imported inside the functions that need them.
"""
from __future__ import annotations

import contextlib
import inspect


def show_source(obj, *, start: str | None = None, stop: str | None = None):
    """Show the source of a function, class or module in a notebook (plain text elsewhere).

    ``start`` / ``stop``: show only the lines from the first containing ``start`` up to the
    first after it containing ``stop``; a way to point at one loop of a kernel.
    For a .cu file (or a .py file read as text), pass its path (str or pathlib.Path).
    """
    import pathlib
    if isinstance(obj, (str, pathlib.Path)) and pathlib.Path(obj).exists():
        src = pathlib.Path(obj).read_text()
        lang = "python" if pathlib.Path(obj).suffix == ".py" else "cuda"
    else:
        src, lang = inspect.getsource(obj), "python"
    if start is not None:
        lines = src.splitlines()
        i0 = next(i for i, ln in enumerate(lines) if start in ln)
        i1 = next((i for i, ln in enumerate(lines[i0 + 1:], i0 + 1) if stop and stop in ln), len(lines) - 1)
        src = "\n".join(lines[i0:i1 + 1])
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
        if get_ipython() is not None:
            display(Markdown(f"```{lang}\n{src}\n```"))
            return None
    except ImportError:
        pass
    print(src)
    return None


@contextlib.contextmanager
def native_stderr_silenced():
    """Send what C/C++ code writes to file descriptor 2 to /dev/null inside the block.

    torch's profiler (Kineto) prints "USDT: ... profiler_start" / "profiler_stop" lines
    from C++ every time it starts and stops; they are trace markers, not warnings, and a
    notebook would show them as red stderr boxes.  Python-level warnings and exceptions
    are unaffected (they go through ``sys.stderr`` objects, which are left alone).
    """
    import os
    import sys
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
