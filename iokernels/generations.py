"""FlashAttention 1 to 4 as data: what each changed, what it reported, and where it runs.

Every figure here is a *reported* result, quoted with its framing: "up to" means the best
shape the authors chose, a speed-up is relative to a named baseline on a named GPU, and a
beta kernel or a forward-only path says so.  Read them as what the papers claim, not as
what a given model or sequence length will see; the caveats below say why.

Sources: Dao, Fu, Ermon, Rudra, Re, "FlashAttention" (2022); Dao, "FlashAttention-2"
(2023); Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao, "FlashAttention-3" (2024);
Zadouri, Hoehnerbach, Shah, Liu, Thakkar, Dao, "FlashAttention-4" (2026); the support
notes of the FlashAttention repository as summarised by the source article
("FlashAttention-3 and PagedAttention: IO-Aware Attention Kernels", 2026); the FlashAttention-3
blog post (PyTorch blog, 2024-07-11) for FlashAttention-2's throughput on an H100; the
repository's setup.py for what builds on Blackwell.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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


def _load_generations() -> tuple:
    """The reported results live as data in ``iokernels/data/generations.json``."""
    rows = json.loads((Path(__file__).resolve().parent / "data" / "generations.json").read_text())["generations"]
    return tuple(Generation(r["name"], r["paper"], tuple(r["changed"]), tuple(tuple(x) for x in r["reported"]),
                            r.get("status", "")) for r in rows)


#: FA1 to FA4, oldest first (from iokernels/data/generations.json)
GENERATIONS = _load_generations()


#: GPU architectures of the hardware matrix, oldest first
ARCHITECTURES = ("Turing", "Ampere", "Ada", "Hopper", "Blackwell")

#: generation -> {architecture: support}; "" = not supported
HARDWARE = {
    "FlashAttention-2": {"Turing": "community fork", "Ampere": "yes", "Ada": "yes", "Hopper": "yes",
                         "Blackwell": "builds; not listed"},
    "FlashAttention-3": {"Turing": "", "Ampere": "", "Ada": "", "Hopper": "yes (CUDA >= 12.3)",
                         "Blackwell": ""},
    "FlashAttention-4": {"Turing": "", "Ampere": "", "Ada": "", "Hopper": "yes", "Blackwell": "yes"},
}
#: what the matrix cannot say in one cell
HARDWARE_NOTES = ("FlashAttention-2: FP16/BF16, head dim up to 256.",
                  "FlashAttention-2 on Blackwell: the repository's build (code: setup.py) adds the "
                  "Blackwell targets when CUDA >= 12.8 compiles it, but its list of supported GPUs does "
                  "not name Blackwell: it builds, it is not listed as supported.",
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
