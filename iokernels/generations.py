"""FlashAttention 1 to 4 as data: what each changed, what it reported, and where it runs.

Every figure here is a *reported* result, quoted with its framing: "up to" means the best
shape the authors chose, a speed-up is relative to a named baseline on a named GPU, and a
beta kernel or a forward-only path says so.  Read them as what the papers claim, not as
what a given model or sequence length will see; the caveats below say why.

Sources: Dao, Fu, Ermon, Rudra, Re, "FlashAttention" (2022); Dao, "FlashAttention-2"
(2023); Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao, "FlashAttention-3" (2024);
Zadouri, Hoehnerbach, Shah, Liu, Thakkar, Dao, "FlashAttention-4" (2026); the support
notes of the FlashAttention repository as summarised by the source article
("FlashAttention-3 and PagedAttention: IO-Aware Attention Kernels", 2026).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Generation", "GENERATIONS", "HARDWARE", "ARCHITECTURES", "CAVEATS", "generations_table",
           "hardware_matrix"]


@dataclass(frozen=True)
class Generation:
    """One FlashAttention generation: who, what changed, what was reported, and its status."""
    name: str
    paper: str
    changed: tuple
    reported: tuple            # each: (claim with its framing, GPU and baseline)
    status: str = ""


GENERATIONS = (
    Generation(
        "FlashAttention", "Dao, Fu, Ermon, Rudra, Re, 2022",
        ("tiling with the online softmax: S and P never reach HBM",
         "recompute S and P in the backward from O and the log-sum-exp",
         "HBM accesses Theta(N^2 d^2 / M) instead of Theta(N d + N^2)"),
        (("15% end-to-end over the MLPerf 1.1 record", "BERT-large, sequence 512"),
         ("3x end-to-end", "GPT-2, sequence 1K"),
         ("2.4x", "Long Range Arena"),
         ("first better-than-chance Path-X", "sequence 16K"),
         ("25-40% of the GPU's peak (as FlashAttention-2's paper puts it)", "A100"))),
    Generation(
        "FlashAttention-2", "Dao, 2023",
        ("fewer non-matmul FLOPs",
         "parallel over the sequence length; Q tiles outer, each output tile finished by one thread block",
         "work split among warps to cut shared-memory traffic"),
        (("about 2x over FlashAttention", "A100"),
         ("50-73% of peak", "A100, forward"),
         ("up to 225 TFLOP/s per GPU (72% model FLOPs utilisation)", "A100, GPT training"),
         ("about 35% utilisation (as FlashAttention-3's paper measures it)", "H100"))),
    Generation(
        "FlashAttention-3", "Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao, 2024",
        ("warp specialization: producer warps issue TMA loads, consumer warpgroups run wgmma",
         "softmax interleaved with the matmuls: ping-pong between two warpgroups, and within one",
         "FP8 with block quantization and incoherent processing (a random orthogonal transform)"),
        (("1.5-2.0x over FlashAttention-2", "H100, FP16"),
         ("up to 740 TFLOP/s, 75% of peak", "H100, FP16"),
         ("close to 1.2 PFLOP/s", "H100, FP8"),
         ("2.6x lower error than a baseline FP8 attention", "numerical test with outliers")),
        status="Hopper kernel released as beta; FP8 forward pass only"),
    Generation(
        "FlashAttention-4", "Zadouri, Hoehnerbach, Shah, Liu, Thakkar, Dao, 2026",
        ("software-emulated exp2 on the FMA units for part of the elements",
         "conditional softmax rescaling (only when the maximum grows by more than a threshold)",
         "Blackwell's tensor memory and 2-CTA MMA; written in CuTe-DSL"),
        (("up to 1.3x over cuDNN 9.13", "B200, BF16"),
         ("up to 2.7x over Triton", "B200, BF16"),
         ("up to 1,613 TFLOP/s, 71% of peak", "B200, BF16"))),
)

#: GPU architectures of the hardware matrix, oldest first
ARCHITECTURES = ("Turing", "Ampere", "Ada", "Hopper", "Blackwell")

#: generation -> {architecture: support}; "" = not supported
HARDWARE = {
    "FlashAttention-2": {"Turing": "community fork", "Ampere": "yes", "Ada": "yes", "Hopper": "yes",
                         "Blackwell": ""},
    "FlashAttention-3": {"Turing": "", "Ampere": "", "Ada": "", "Hopper": "yes (CUDA >= 12.3)",
                         "Blackwell": ""},
    "FlashAttention-4": {"Turing": "", "Ampere": "", "Ada": "", "Hopper": "yes", "Blackwell": "yes"},
}
#: what the matrix cannot say in one cell
HARDWARE_NOTES = ("FlashAttention-2: FP16/BF16, head dim up to 256.",
                  "FlashAttention (the first) lives on in the same library as FlashAttention-2.",
                  "Turing support comes from a community fork, not the upstream repository.")

#: the caveats that go with every number above
CAVEATS = (
    "'Up to' is the best shape the authors chose (long sequences, large head dims); typical shapes see less.",
    "A speed-up names its baseline and GPU: 2x over FlashAttention-2 on an H100 says nothing about an A100.",
    "Short sequences may not benefit at all: launch overhead and the non-matmul work dominate.",
    "An unsupported head dim or dtype can drop to a slower kernel silently; check which kernel ran.",
    "FP8 trades accuracy for speed: its error depends on the data (outliers), so measure it on yours.",
    "Faster kernels do not make long context free: the KV cache still has to be read, every token.",
)


def generations_table() -> str:
    """The generations as plain text: what changed, what was reported (with framing), status."""
    out = []
    for g in GENERATIONS:
        out.append(f"{g.name} ({g.paper})" + (f"  [{g.status}]" if g.status else ""))
        out += [f"  changed:  {c}" for c in g.changed]
        out += [f"  reported: {claim}  ({where})" for claim, where in g.reported]
    return "\n".join(out)


def hardware_matrix() -> str:
    """Which generation runs on which architecture, as plain text, with its notes."""
    w = max(len(v) for row in HARDWARE.values() for v in row.values()) + 2
    lines = [f"{'':<18}" + "".join(f"{a:<{w}}" for a in ARCHITECTURES)]
    for gen, row in HARDWARE.items():
        lines.append(f"{gen:<18}" + "".join(f"{row[a] or '-':<{w}}" for a in ARCHITECTURES))
    return "\n".join(lines + [""] + list(HARDWARE_NOTES))
