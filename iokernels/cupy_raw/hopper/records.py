"""The records of the Hopper attention versions (fa_v3.cu .. fa_v11.cu)."""
from __future__ import annotations

from ...core.records import Record
from ..launch import HOPPER_OPTIONS
from ..policy import held_back_note
from ..registry import REGISTRY
from .attention import attention, attention_args, lpt_attention_args, persistent_attention_args
from .checks import check_for, default_check_for
from .config import HopperConfig


def run_attention(q, k, v, *, causal, scale, window, config):
    """The registry's launcher: :func:`.attention.attention` with the resolved config."""
    return attention(q, k, v, causal=causal, scale=scale, window=window, config=config)


def _record(version, rank, summary, args=attention_args):
    return Record("cupy", "attention", version, f"fa_{version}.cu", f"fa_{version}", HopperConfig, run_attention,
                  summary + held_back_note("attention", version), check_for(version), rank, args,
                  dict(options=HOPPER_OPTIONS), default_check_for(version))


#: ranked above every portable attention version (so on Hopper the default is the best of
#: these where checks.default_check lets it pick them), v11 > v10 > ... > v3; v6 runs at head_dim 64
#: only and is held back from the default until measured (policy.HELD_BACK); v7's default gate
#: is head_dim 256 (policy.hopper_v7_default_at), v8's every head dim (hopper_v8_default_at); v9,
#: v10 (head_dim 64 only) and v11 are the default at the lengths and bands
#: policy.hopper_forward_for_length gives them
RECORDS = (
    _record("v3", 100, "Hopper: wgmma from SRAM, TMA tile loads, an mbarrier a stage"),
    _record("v4", 110, "Hopper: v3 + a producer warpgroup (warp specialization), setmaxnreg"),
    _record("v5", 120, "Hopper: v4 + ping-pong between consumer warpgroups, softmax overlapped with P V"),
    _record("v6", 130, "Hopper, head_dim 64: v5 with three consumer warpgroups (a 192-row query tile) taking "
                       "turns on the tensor cores"),
    _record("v7", 140, "Hopper: v5 with K and V tiles released apart, so two stages keep the next tile "
                       "landing"),
    _record("v8", 150, "Hopper: v7 with the masked softmax reading two key bounds a row, and 80-key tiles at "
                       "head_dim 256 (the default)"),
    _record("v9", 160, "Hopper: v8 as a persistent kernel (a block an SM claims query tiles, the next tile's Q "
                       "and K loaded during the last one's end)", args=persistent_attention_args),
    _record("v10", 170, "Hopper, head_dim 64: v8 with three consumer warpgroups (a 192-row query tile) taking "
                        "turns on the tensor cores"),
    _record("v11", 180, "Hopper: v8 with its blocks longest first (causal: each head's heaviest query tiles "
                        "first, in groups of heads whose K and V fit the L2 cache)",
            args=lpt_attention_args),
)
REGISTRY.add(*RECORDS)
