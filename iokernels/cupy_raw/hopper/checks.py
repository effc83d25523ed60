"""Whether the Hopper kernels can run here, and the registry check of a call."""
from __future__ import annotations

from ..launch import cupy_ok, device_info
from ..policy import held_back, hopper_default_at, hopper_forward_for_length, hopper_v7_default_at, hopper_v8_default_at
from .config import DTYPES, HEAD_DIMS, HOPPER_CC, head_dims


def available() -> str | None:
    """None when these kernels can run here, else why not (no CuPy / GPU, cc != 9.0, no
    cuda-python)."""
    try:
        if not cupy_ok():
            return "no CUDA device visible to CuPy"
        cc = device_info()["cc"]
    except Exception as e:  # ImportError, or a broken CUDA install
        return f"CuPy with a CUDA device is needed ({type(e).__name__}: {e})"
    if cc != HOPPER_CC:
        return f"needs compute capability 9.0 (Hopper: wgmma, TMA, sm_90a); this GPU is {cc / 10:.1f}"
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return "needs cuda-python (cuda.bindings.driver) to encode the TMA tensor maps"
    return None


def require_available():
    why = available()
    if why is not None:
        raise ValueError(f"config.version: the Hopper kernels cannot run here: {why}")


def check(need) -> str | None:
    """The registry check: why a call cannot run on these kernels, or None."""
    if need.simulator:
        return "runs on a GPU only (not the simulator)"
    if need.cc is not None and need.cc != HOPPER_CC:
        return f"needs compute capability 9.0 (sm_90a), this GPU is {need.cc / 10:.1f}"
    if need.dtype not in DTYPES:
        return f"takes float16 / bfloat16, not {need.dtype}"
    if need.head_dim not in HEAD_DIMS:
        return f"takes head_dim in {HEAD_DIMS}, not {need.head_dim}"
    return available()


def check_for(version: str):
    """The registry check of ``version``: :func:`check`, after the head dims it takes
    (:func:`~iokernels.cupy_raw.hopper.config.head_dims`: v6 at head_dim 64 only)."""
    dims = head_dims(version)
    if dims == HEAD_DIMS:
        return check

    def check_version(need) -> str | None:
        if need.head_dim not in dims:
            return (f"takes head_dim {' or '.join(map(str, dims))} only (three consumer warpgroups leave 160 "
                    f"registers a thread, room for O, S and P only there), not {need.head_dim}")
        return check(need)
    return check_version


def default_check_for(version: str):
    """The ``default_check`` of ``version``: :func:`default_check`, then whether the version is
    held back from the default until measured (:data:`~iokernels.cupy_raw.policy.HELD_BACK`,
    asked on every call); v7 and v8 then by their head-dim gates, v9, v10 and v11 by the call's
    lengths and band (:data:`DEFAULT_GATES`)."""
    gate = DEFAULT_GATES.get(version)
    if gate is not None:
        return lambda need: default_check(need) or held_back("attention", version) or gate(need)
    return lambda need: default_check(need) or held_back("attention", version)


def v7_default_check(need) -> str | None:
    """Why the default does not pick v7 at this head dim (v5's third stage already keeps the tiles
    landing there), or None where it may."""
    if hopper_v7_default_at(need.head_dim):
        return None
    return (f"not the default at head_dim {need.head_dim}: v5's third stage already keeps the next tiles "
            f"landing there (policy.hopper_v7_default_at); a config naming v7 runs it")


def v8_default_check(need) -> str | None:
    """Why the default does not pick v8 at this head dim (one policy.hopper_v8_default_at leaves
    out: none today), or None where it may."""
    if hopper_v8_default_at(need.head_dim):
        return None
    return (f"not the default at head_dim {need.head_dim} (policy.hopper_v8_default_at); a config naming v8 "
            f"runs it")


def length_default_check(version: str):
    """The default gate of ``version`` (v9, v10, v11): whether the call's lengths and band are the ones the
    default runs it at (:func:`~iokernels.cupy_raw.policy.hopper_forward_for_length`); a need
    without them (made by hand, not by the backend's ``need``) leaves the version out."""
    def gate(need) -> str | None:
        seq_q, seq_k = need.extra.get("seq_q"), need.extra.get("seq_k")
        if seq_q is None or seq_k is None:
            return "the default picks it by the call's lengths, and this need carries none (a config naming it runs it)"
        window = need.extra.get("window", (-1, -1))
        choice = hopper_forward_for_length(need.head_dim, seq_q, seq_k, window)
        if choice == version:
            return None
        return (f"not the default for {seq_q} query rows over {seq_k} keys (band {window}) at head_dim "
                f"{need.head_dim}: {choice} is (policy.hopper_forward_for_length); a config naming {version} runs it")
    return gate


#: the versions whose default is gated by head dim or by length, and their checks
DEFAULT_GATES = {"v7": v7_default_check, "v8": v8_default_check, "v9": length_default_check("v9"),
                  "v10": length_default_check("v10"), "v11": length_default_check("v11")}


def default_check(need) -> str | None:
    """The records' ``default_check``: why the registry's default does not pick a Hopper
    version for a call it can run (a head dim :func:`~iokernels.cupy_raw.policy.hopper_default_at`
    does not allow yet), or None.  A config naming the version still runs it."""
    if not hopper_default_at(need.head_dim):
        return (f"not the default at head_dim {need.head_dim} until measured on a GPU; "
                f"a config naming the version runs it (HopperConfig(version=...))")
    return None
