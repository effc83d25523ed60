"""One colour per runner, in every figure.

A runner is a row of the benchmark: an SDPA kernel forced on its own (``sdpa:cudnn``), the
default dispatch (``sdpa:default``), naive attention in torch, or one version of this
project's kernels (``numba:v3``, ``cupy:v4``).  Every figure that plots runners asks
:func:`colour` for the colour of each, so sdpa:math is the same red in the prefill plot, the
traffic plot and the decode summary.  Variants of one runner (``cupy:v4 paged``,
``sdpa:flash fwd+bwd``, ``numba:v1 gather``) share its colour; a figure tells them apart
by line style or hatching.

The versions of one backend are shades of one hue (numba oranges, cupy pinks, triton teals, light to dark
as the version grows), so a family reads as a family and each version still has its own.
"""
from __future__ import annotations

__all__ = ["RUNNER_COLOURS", "colour", "base_runner", "TRAFFIC_CASE_RUNNER", "traffic_colour"]

#: the fixed colours (matplotlib's tab10 hues for SDPA's kernels and torch's rows)
RUNNER_COLOURS = {
    "sdpa:cudnn": "#1f77b4",
    "sdpa:flash": "#2ca02c",
    "sdpa:efficient": "#9467bd",
    "sdpa:math": "#d62728",
    "sdpa:default": "#7f7f7f",
    "torch naive": "#8c564b",
    "device copy (torch)": "#17becf",
    "torch:matmul": "#bcbd22",
    "torch:sdpa": "#7f7f7f",
    # the project's kernels: one hue per backend, a shade per version
    "numba": "#d95f02",
    "numba:v1": "#fb9a4b",
    "numba:v2": "#f57c20",
    "numba:v3": "#d95f02",
    "numba:v4": "#8c3a00",
    "numba:v5": "#5c2600",
    "cupy": "#a81a74",
    "cupy:v1": "#f58cc8",
    "cupy:v1b": "#e95fae",
    "cupy:v2": "#d12f8f",
    "cupy:v3": "#a81a74",
    "cupy:v4": "#730d50",
    "cupy:v5": "#45052f",
    "cupy:v6": "#2b021d",
    "triton": "#00796b",
    "triton:v1": "#4db6ac",
    "triton:v2": "#00796b",
}

#: the colour of a runner this table does not name
OTHER = "#333333"


def base_runner(runner: str) -> str:
    """The runner a variant belongs to: "cupy:v4 paged" -> "cupy:v4", "sdpa:flash fwd+bwd" -> "sdpa:flash"."""
    runner = str(runner)
    if runner in RUNNER_COLOURS:
        return runner
    words = runner.split(" ")
    if len(words) > 1 and f"{words[0]}:{words[1]}" in RUNNER_COLOURS:      # "cupy v4 paged bfloat16"
        return f"{words[0]}:{words[1]}"
    head = words[0]
    if head in RUNNER_COLOURS:
        return head
    if runner.startswith("torch naive"):
        return "torch naive"
    if runner.startswith("device copy"):
        return "device copy (torch)"
    backend = head.split(":")[0]
    return backend if backend in RUNNER_COLOURS else runner


def colour(runner: str) -> str:
    """The colour of ``runner`` (a hex string); variants share their runner's colour, and a
    version not in the table takes its backend's colour."""
    return RUNNER_COLOURS.get(base_runner(runner), OTHER)


#: the runner behind each case name of the profiler's traffic record (scripts/profile_traffic.py)
TRAFFIC_CASE_RUNNER = {"copy": "device copy (torch)", "naive attention": "torch naive",
                       "sdpa flash": "sdpa:flash", "sdpa decode": "sdpa:default"}


def traffic_colour(case: str) -> str:
    """The colour of a traffic case: "sdpa flash" is sdpa:flash's, "cupy backward v2" cupy:v2's,
    "numba paged decode" numba's (the profiler names a backend, not always a version)."""
    if case in TRAFFIC_CASE_RUNNER:
        return colour(TRAFFIC_CASE_RUNNER[case])
    words = case.split()
    backend = words[0]
    version = next((w for w in words[1:] if w.startswith("v") and w[1:2].isdigit()), None)
    return colour(f"{backend}:{version}" if version else backend)
