"""Ring attention (iokernels.context_parallel): the split, the merge, the ring over gloo.

The in-process simulation runs the same step generators as the process-group driver, so
the many shapes are checked there cheaply; the real gloo worlds (one launch of 4 ranks,
sub-groups for W = 1, 2, 3, 4) check the distributed path on fewer cases, and the
launcher's failure and timeout paths are exercised on purpose.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import iokernels as ik
from iokernels import context_parallel as cp

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


def _oracle(q, k, v, do, causal):
    O, L = ik.reference.attention(q, k, v, causal=causal)
    return dict(o=O, lse=L, **dict(zip(("dq", "dk", "dv"), ik.reference.attention_backward(do, q, k, v,
                                                                                          causal=causal))))


# --------------------------------------------------------------------------- the split
@pytest.mark.parametrize("split", cp.SPLITS)
@pytest.mark.parametrize("n, W", [(29, 3), (64, 4), (9, 2), (17, 1), (203, 4)])
def test_split_covers_every_token_once(split, n, W):
    pos = cp.split_positions(n, W, split)
    covered = np.zeros(n, int)
    for segs in pos:
        for a, b in segs:
            covered[a:b] += 1
    assert np.all(covered == 1)
    sizes = [b - a for segs in pos for a, b in segs]
    assert max(sizes) - min(sizes) <= 1
    if split == "zigzag":                       # one early, one late chunk: chunk r and 2W-1-r
        ch = cp.chunk_bounds(n, 2 * W)
        assert all(segs == (ch[r], ch[2 * W - 1 - r]) for r, segs in enumerate(pos))


def test_split_rejects_bad_sizes():
    with pytest.raises(ValueError, match="split"):
        cp.split_positions(10, 2, "striped")
    with pytest.raises(ValueError, match="seqlen"):
        cp.split_positions(5, 3, "zigzag")
    with pytest.raises(ValueError, match="world_size"):
        cp.split_positions(5, 0, "contiguous")


def test_shard_unshard_round_trip(rng):
    x = rng.standard_normal((2, 3, 23, 5))
    pos = cp.split_positions(23, 3, "zigzag")
    parts = [cp.shard(x, p) for p in pos]
    assert sum(p.shape[2] for p in parts) == 23
    np.testing.assert_array_equal(cp.unshard(parts, pos), x)


# --------------------------------------------------------------------------- the merge
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_merge_pair_chained_equals_merge_states(rng, kind):
    S, shape, d = 5, (2, 7), 11
    o_parts = rng.standard_normal((S,) + shape + (d,))
    lse_parts = rng.standard_normal((S,) + shape) * 30          # wide range: the stable form matters
    lse_parts[1, 0, :3] = -np.inf                              # empty parts weigh nothing
    lse_parts[:, 1, 0] = -np.inf                               # a row with every part empty
    want_o, want_l = ik.merge_states(o_parts, lse_parts)
    conv = (lambda a: torch.from_numpy(a)) if kind == "torch" else (lambda a: a)
    o, lse = conv(np.zeros(shape + (d,))), conv(np.full(shape, -np.inf))
    for s in range(S):
        o, lse = cp.merge_pair(o, lse, conv(o_parts[s]), conv(lse_parts[s]))
    o, lse = np.asarray(o), np.asarray(lse)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert np.isneginf(lse[1, 0]) and np.all(o[1, 0] == 0)
    np.testing.assert_allclose(o, want_o, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse[np.isfinite(want_l)], want_l[np.isfinite(want_l)], rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- the simulated ring
@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("split", cp.SPLITS)
def test_simulated_ring_matches_oracle(rng, W, causal, split):
    n = int(rng.integers(4 * W + 1, 40)) | 1                   # odd: never a multiple of 2W
    q, k, v, do = ik.testing.make_inputs(rng, batch=2, heads_q=6, heads_kv=2, seqlen_q=n, head_dim=13,
                                         with_grad=True)
    r = cp.simulate(q, k, v, W, do=do, causal=causal, split=split)
    ref = _oracle(q, k, v, do, causal)
    for name in ref:
        ik.testing.assert_close(r[name], ref[name], dtype="float64", name=name)
    model = cp.comm_model(n, W, split, batch=2, heads_kv=2, head_dim=13, dtype="float64", backward=True)
    fwd = cp.comm_model(n, W, split, batch=2, heads_kv=2, head_dim=13, dtype="float64")
    for st, bst, m, f in zip(r["stats"], r["bwd_stats"], model, fwd):
        assert (st.sent, st.received) == (f["sent"], f["received"])
        assert (bst.sent, bst.received) == (m["sent"], m["received"])
    assert [s.pairs for s in r["stats"]] == cp.causal_work(n, W, split, causal)


def test_simulated_ring_non_causal_different_lengths(rng):
    q, k, v, do = ik.testing.make_inputs(rng, heads_q=4, heads_kv=1, seqlen_q=19, seqlen_k=31, head_dim=9,
                                         with_grad=True)
    r = cp.simulate(q, k, v, 3, do=do, split="contiguous")
    ref = _oracle(q, k, v, do, False)
    for name in ref:
        ik.testing.assert_close(r[name], ref[name], dtype="float64", name=name)


@pytest.mark.parametrize("backend", ["naive", "torch", "torch_fused"])
def test_simulated_ring_other_local_backends(rng, backend):
    q, k, v, do = ik.testing.make_inputs(rng, heads_q=4, heads_kv=2, seqlen_q=21, head_dim=10, with_grad=True)
    r = cp.simulate(q, k, v, 3, do=do, causal=True, backend=backend)
    ref = _oracle(q, k, v, do, True)
    for name in ref:
        ik.testing.assert_close(r[name], ref[name], dtype="float64", name=name)


def test_simulate_rejects_bad_arguments(rng):
    q, k, v = ik.testing.make_inputs(rng, seqlen_q=8, head_dim=4)
    with pytest.raises(ValueError, match="backend"):
        cp.simulate(q, k, v, 2, backend="mpi")
    with pytest.raises(ValueError, match="partial_dtype"):
        cp.simulate(q, k, v, 2, partial_dtype="int8")
    with pytest.raises(ValueError, match="world_size"):
        cp.simulate(q, k, v, 0)


def test_causal_needs_equal_lengths(rng):
    q, k, v = ik.testing.make_inputs(rng, seqlen_q=8, seqlen_k=12, head_dim=4)
    with pytest.raises(ValueError, match="seqlen_k"):
        cp.simulate(q, k, v, 2, causal=True)


def test_zigzag_balances_causal_work():
    contiguous, zigzag = cp.causal_work(4096, 4, "contiguous"), cp.causal_work(4096, 4, "zigzag")
    assert sum(contiguous) == sum(zigzag)                      # the same work, dealt differently
    assert max(contiguous) / min(contiguous) > 6
    assert max(zigzag) / min(zigzag) < 1.01


def test_bf16_partials_error_grows_with_ring_size(rng):
    err = cp.merge_error_vs_world_size(rng, [1, 4, 16], seqlen=96, heads=2, head_dim=16)
    bf16, fp32 = err["bfloat16"], err["float32"]
    assert bf16[0] < bf16[1] < bf16[2]                         # more rounded merges, more error
    assert max(fp32) < bf16[0] / 100                           # fp32 partials stay far below


def test_memory_model_equals_what_a_simulated_rank_holds(rng):
    q, k, v = ik.testing.make_inputs(rng, heads_q=4, heads_kv=2, seqlen_q=48, head_dim=8, dtype="float32")
    for W in (1, 3):
        held = {s.resident_bytes for s in cp.simulate(q, k, v, W, causal=True)["stats"]}
        model = cp.memory_per_rank(48, W, heads_q=4, heads_kv=2, head_dim=8, dtype="float32")
        assert held == {model["per_rank"]}


def test_memory_per_rank_shrinks_with_world_size():
    one = cp.memory_per_rank(65536, 1, heads_q=8, heads_kv=8, head_dim=128)
    four = cp.memory_per_rank(65536, 4, heads_q=8, heads_kv=8, head_dim=128)
    assert four["one_device"] == one["one_device"]
    eight = cp.memory_per_rank(65536, 8, heads_q=8, heads_kv=8, head_dim=128)
    assert one["per_rank"] < one["one_device"] * 1.5       # W = 1: O in fp32 is the only extra
    assert eight["per_rank"] < four["per_rank"] / 1.9 < one["one_device"] / 4


# --------------------------------------------------------------------------- real gloo worlds
def _children():
    """Live rank processes (spawned children of this process; zombies excluded).

    multiprocessing's own resource tracker, a helper that lives as long as this process,
    is not a rank and is not counted.
    """
    me, kids = os.getpid(), []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z" and "multiprocessing.spawn" in cmd:
                kids.append(int(p.name))
    return kids


CASES = [
    dict(batch=1, heads_q=4, heads_kv=2, seqlen=23, head_dim=11, causal=True, split="zigzag", seed=1),
    dict(batch=2, heads_q=3, heads_kv=3, seqlen=17, head_dim=8, causal=True, split="contiguous", seed=2),
    dict(batch=1, heads_q=4, heads_kv=1, seqlen=13, seqlen_k=21, head_dim=7, causal=False, split="zigzag",
         seed=3),
]


def test_gloo_worlds_match_oracle_and_model(capsys):
    from iokernels import ring_launch
    cases = [dict(c, dtype="float64", backend="tiled") for c in CASES]
    res = ring_launch.run_checks(cases, 4, world_sizes=[1, 2, 3, 4], timeout=240)
    for W, rows in res.items():
        for case, r in zip(cases, rows):
            assert all(r["checks"]), (W, case, [str(c) for c in r["checks"]])
            assert max(c.error for c in r["checks"]) < 1e-12
            assert r["bytes_ok"], (W, case, r["counted"], r["model"])
            if W > 1:
                assert all(m["bytes_sent"] > 0 for m in r["model"]["fwd"])
    assert not _children()
    ring_launch.print_check(cases[0], 3, res[3][0])         # what `python -m iokernels ring` prints
    out = capsys.readouterr().out
    m = res[3][0]["model"]["fwd"][1]
    assert f"fwd rank 1: sent {m['bytes_sent']} / {m['bytes_sent']}, received {m['bytes_received']}" in out
    assert "counted bytes equal the model: yes" in out and "verdict: ok" in out


#: the launch timeout of the hang test: short, but the ranks' start-up may use all of it
TIMEOUT_S = 8


def hang_worker(rank, world_size, device, payload):
    """A rank that never finishes (rank 1), for the timeout path."""
    if rank == 1:
        time.sleep(600)
    return rank


def test_launcher_times_out_and_leaves_nothing():
    from iokernels.core.launch import RankFailed, launch
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=rf"timed out after {TIMEOUT_S} s waiting for rank\(s\) \[(0, )?1\]"):
        launch(hang_worker, 2, timeout=TIMEOUT_S)
    assert time.monotonic() - t0 < TIMEOUT_S + 30
    assert not _children()


def _marked(mark):
    """Processes anywhere on the machine whose environment carries ``mark``."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if mark.encode() in (p / "environ").read_bytes():
                    found.append(int(p.name))
            except OSError:
                continue
    return found


def test_cli_names_the_failed_rank_exits_nonzero_and_leaves_nothing():
    mark = f"IOKERNELS_TEST_MARK=ring-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), IOKERNELS_RING_FAIL_RANK="1")
    env[mark.split("=")[0]] = mark.split("=")[1]
    p = subprocess.run([sys.executable, "-m", "iokernels", "ring", "--world-size", "2", "--seqlen", "11",
                        "--timeout", "150"], env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 2, p.stdout + p.stderr
    # the rank that failed first is named first, with its error; the others follow it
    assert p.stderr.startswith("ring: rank 1 failed: RuntimeError: injected failure on rank 1"), p.stderr
    assert not _marked(mark)                                   # no rank outlived the launcher


def test_cli_rejects_bad_sizes_before_launching(capsys):
    from iokernels import ring_launch
    assert ring_launch.main(["--world-size", "4", "--seqlen", "5", "--device", "cpu"]) == 2
    assert "seqlen" in capsys.readouterr().err


@pytest.mark.parametrize("causal", [False, True])
def test_torch_block_backward_matches_oracle(rng, monkeypatch, causal):
    """The block backward that CUDA tensors use, run here on CPU tensors, a few rows at a time."""
    monkeypatch.setattr(cp.steps, "TORCH_BWD_BLOCK_BYTES", 2 * 6 * 17 * 8 * 5)   # 5 rows a chunk, the last short
    q, k, v, do = ik.testing.make_inputs(rng, batch=2, heads_q=6, heads_kv=2, seqlen_q=17, head_dim=9,
                                         with_grad=True)
    O, L = ik.reference.attention(q, k, v, causal=causal)
    t = [torch.from_numpy(x) for x in (do, q, k, v, O, L)]
    got = cp._torch_block_backward(*t, causal, ik.conventions.default_scale(9))
    for name, g, ref in zip(("dq", "dk", "dv"), got, ik.reference.attention_backward(do, q, k, v, causal=causal)):
        ik.testing.assert_close(g.numpy(), ref, dtype="float64", name=name)


@pytest.mark.parametrize("causal", [True, False])
def test_ring_backward_through_the_torch_block_path(rng, monkeypatch, causal):
    """The ring backward as CUDA tensors run it (each block's gradients from
    _torch_block_backward, reached through _block_backward), here on CPU tensors: a GQA
    ring of 3 ranks, Nq != Nk when not causal, against the float64 oracle."""
    monkeypatch.setattr(cp.steps, "_torch_backward_for", lambda q: True)
    monkeypatch.setattr(cp.steps, "TORCH_BWD_BLOCK_BYTES", 2 * 6 * 23 * 8 * 4)   # a few rows a chunk
    nk = 19 if causal else 29
    q, k, v, do = ik.testing.make_inputs(rng, batch=2, heads_q=6, heads_kv=2, seqlen_q=19, seqlen_k=nk,
                                         head_dim=9, with_grad=True)
    r = cp.simulate(q, k, v, 3, do=do, causal=causal, backend="tiled", arrays="torch")
    for name, ref in zip(("dq", "dk", "dv"), ik.reference.attention_backward(do, q, k, v, causal=causal)):
        ik.testing.assert_close(r[name], ref, dtype="float64", name=name)


@pytest.mark.parametrize("backend", ["tiled", "torch_fused"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_simulated_ring_low_precision_follows_the_2x_rule(rng, backend, dtype):
    q, k, v = ik.testing.make_inputs(rng, heads_q=4, heads_kv=2, seqlen_q=45, head_dim=16, dtype=dtype)
    r = cp.simulate(q, k, v, 3, causal=True, backend=backend)
    O, L = ik.reference.attention(q, k, v, causal=True)
    bo, bl = ik.attention(q, k, v, causal=True, backend="naive", return_lse=True)
    ik.testing.assert_close(r["o"], O, bo, dtype=dtype, name="o")
    ik.testing.assert_close(r["lse"], L, bl, dtype=dtype, name="lse")
    assert ik.conventions.dtype_name(r["o"]) == dtype


#: the NCCL cases one GPU can hold: head dims the fused SDPA kernels take, lengths that split
#: unevenly, GQA, causal zig-zag and contiguous, a non-causal Nk != Nq
GPU_CASES = [
    dict(batch=1, heads_q=4, heads_kv=2, seqlen=301, head_dim=64, causal=True, split="zigzag", seed=4),
    dict(batch=2, heads_q=2, heads_kv=2, seqlen=130, head_dim=128, causal=True, split="contiguous", seed=5),
    dict(batch=1, heads_q=4, heads_kv=1, seqlen=77, seqlen_k=203, head_dim=64, causal=False, split="zigzag",
         seed=6),
]


@pytest.mark.gpu
def test_nccl_world_of_one_on_a_gpu():
    """The NCCL path on the one GPU a single-GPU machine has: a world of one rank (NCCL
    initialised, the local kernel torch_fused in bfloat16 on the GPU, no ring messages),
    forward and backward against the float64 oracle by the 2x rule, and nothing left running.
    The two-rank ring over NCCL needs two GPUs (NCCL does not put two ranks on one device)."""
    from iokernels import gpu as ik_gpu
    if not ik_gpu.torch_gpu():
        pytest.skip("needs torch with a CUDA GPU")
    from iokernels import ring_launch
    cases = [dict(c, dtype="bfloat16", backend="torch_fused") for c in GPU_CASES]
    res = ring_launch.run_checks(cases, 1, dist_backend="nccl", timeout=240)
    for case, r in zip(cases, res):
        assert all(r["checks"]), (case, [str(c) for c in r["checks"]])
        assert r["bytes_ok"], (case, r["counted"], r["model"])
    assert not _children()


@pytest.mark.parametrize("arrays", ["numpy", "torch"])
def test_simulated_ring_on_numpy_and_torch_arrays_agree(rng, arrays):
    """The simulation runs on NumPy arrays (no torch) or torch tensors: the same steps, the same
    bytes, both exact against the float64 oracle."""
    q, k, v, do = ik.testing.make_inputs(rng, batch=1, heads_q=4, heads_kv=2, seqlen_q=37, head_dim=8,
                                         with_grad=True)
    r = cp.simulate(q, k, v, 3, do=do, causal=True, split="zigzag", arrays=arrays)
    O, L = ik.reference.attention(q, k, v, causal=True)
    for name, ref in zip(("o", "lse", "dq", "dk", "dv"), (O, L) + ik.reference.attention_backward(do, q, k, v,
                                                                                                 causal=True)):
        ik.testing.assert_close(r[name], ref, dtype="float64", name=name)
    model = cp.comm_model(37, 3, "zigzag", batch=1, heads_kv=2, head_dim=8, dtype="float64", backward=True)
    assert [s.bytes_sent for s in r["bwd_stats"]] == [m["bytes_sent"] for m in model]


def test_simulation_needs_no_torch(rng):
    """With torch made unimportable, the simulated ring, its merge and its costs still run."""
    import subprocess
    import sys
    code = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is hidden in this test")
sys.meta_path.insert(0, _NoTorch())
import numpy as np
import iokernels as ik
from iokernels import context_parallel as cp
rng = np.random.default_rng(0)
q, k, v = ik.testing.make_inputs(rng, heads_q=2, seqlen_q=24, head_dim=8)
r = cp.simulate(q, k, v, 3, causal=True, partial_dtype="bfloat16")
ref, _ = ik.reference.attention(q, k, v, causal=True)
assert np.abs(r["o"] - ref).max() < 1e-2, np.abs(r["o"] - ref).max()
r = cp.simulate(q, k, v, 3, causal=True)
assert np.abs(r["o"] - ref).max() < 1e-12
cp.work_per_rank(rng, seqlen=32, world_size=2)
assert "torch" not in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_simulate_refuses_numpy_arrays_for_a_torch_kernel(rng):
    q, k, v = ik.testing.make_inputs(rng, heads_q=2, seqlen_q=12, head_dim=8)
    with pytest.raises(ValueError, match="arrays"):
        cp.simulate(q, k, v, 2, backend="torch", arrays="numpy")
    with pytest.raises(ValueError, match="arrays"):
        cp.simulate(q, k, v, 2, arrays="jax")
