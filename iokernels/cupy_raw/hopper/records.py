"""The records of the Hopper attention versions (fa_v3.cu .. fa_v5.cu)."""
from __future__ import annotations

from ...core.records import Record
from ..launch import HOPPER_OPTIONS
from ..registry import REGISTRY
from .attention import attention, attention_args
from .checks import check, default_check
from .config import HopperConfig


def run_attention(q, k, v, *, causal, scale, window, config):
    """The registry's launcher: :func:`.attention.attention` with the resolved config."""
    return attention(q, k, v, causal=causal, scale=scale, window=window, config=config)


def _record(version, rank, summary):
    return Record("cupy", "attention", version, f"fa_{version}.cu", f"fa_{version}", HopperConfig, run_attention,
                  summary, check, rank, attention_args, dict(options=HOPPER_OPTIONS), default_check)


#: ranked above every portable attention version (so on Hopper the default is the best of
#: these where checks.default_check lets it pick them), v5 > v4 > v3
RECORDS = (
    _record("v3", 100, "Hopper: wgmma from SRAM, TMA tile loads, an mbarrier a stage"),
    _record("v4", 110, "Hopper: v3 + a producer warpgroup (warp specialization), setmaxnreg"),
    _record("v5", 120, "Hopper: v4 + ping-pong between consumer warpgroups, softmax overlapped with P V"),
)
REGISTRY.add(*RECORDS)
