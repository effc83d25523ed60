"""The command line: ``iokernels {tour,figures,bench,dev,ring,serve-bench,labs}`` (or ``python -m iokernels``).

tour      run the progression on a small embedded problem and print, per step and backend,
          the error against the float64 oracle, counted and modelled HBM bytes, and time;
          writes its figures to out/figures/, a folder git ignores, so running it never
          changes a tracked file (see :mod:`iokernels.tour`)
figures   regenerate the committed figures/ from fixed seeds (see :mod:`iokernels.viz.figures`)
bench     the side-by-side GPU benchmark (see :mod:`iokernels.bench`)
dev       check one op, version and shape against the float64 oracle and time it next to torch
          (see :mod:`iokernels.bench.dev`)
ring      ring attention on W local processes over torch.distributed, checked against the
          float64 oracle, bytes per rank counted and modelled (see :mod:`iokernels.ring_launch`)
serve-bench  serve a seeded chat-like trace with continuous batching, paged against contiguous
          at the same KV memory; ``--device cuda`` keeps the model and the KV cache on the GPU
          (see :mod:`iokernels.serving.bench`)
labs      lab notebooks: ``labs student OUTDIR`` writes learner copies, ``labs grade PATH``
          grades them (see :mod:`iokernels.labs.cli`)

Without an NVIDIA device, NUMBA_ENABLE_CUDASIM=1 is set here, before anything imports
numba, so the Numba kernels run on the simulator.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

#: the repository root when run from a checkout (it holds pyproject.toml), else the current folder
ROOT = Path(__file__).resolve().parents[1]
ROOT = ROOT if (ROOT / "pyproject.toml").is_file() else Path.cwd()
#: the lab notebooks an installed wheel carries (setup.py copies notebooks/labs there); a
#: checkout's ``labs student`` reads notebooks/labs itself
PACKAGED_LABS = Path(__file__).resolve().parent / "data" / "labs"
#: where ``figures`` writes: the committed figures/
DEFAULT_FIGURES = ROOT / "figures"
#: where ``tour`` writes its figures: out/figures/, ignored by git (.gitignore's /out/), so a
#: tour leaves a clean checkout clean whatever the CPU draws
TOUR_FIGURES = ROOT / "out" / "figures"


def _prepare_environment() -> None:
    from .tour import nvidia_device_present
    if not nvidia_device_present():
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    os.environ.setdefault("MPLBACKEND", "Agg")


def _tour(args) -> int:
    from . import tour
    problem = tour.SMALL if args.small else tour.DEFAULT
    rows = tour.run(problem, seed=args.seed, figures_dir=None if args.no_figures else Path(args.out),
                    times=not args.no_times)
    failed = [r for r in rows if r.status == "failed" or r.verdict == "FAIL"]
    return 1 if failed else 0


def _figures(args) -> int:
    from .viz import figures
    paths = figures.write_all(Path(args.out), progress=not args.quiet)
    for p in paths:
        print(p)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # the console script `iokernels` (pyproject.toml's [project.scripts]) or `python -m iokernels`
    prog = "iokernels" if Path(sys.argv[0]).name == "iokernels" else "python -m iokernels"
    parser = argparse.ArgumentParser(prog=prog,
                                     description="IO-aware attention kernels: the tour, the figures, the benchmark.")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tour", help="run the progression on a small problem and print what each step does")
    t.add_argument("--small", action="store_true", help="an even smaller problem (seconds)")
    t.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    t.add_argument("--out", default=str(TOUR_FIGURES), help="where figures go (default: out/figures/, "
                   "ignored by git; `figures` rewrites the committed figures/)")
    t.add_argument("--no-figures", action="store_true", help="do not write figures")
    t.add_argument("--no-times", action="store_true", help="print '-' for the times (an output that repeats)")

    f = sub.add_parser("figures", help="regenerate the figures from fixed seeds")
    f.add_argument("--out", default=str(DEFAULT_FIGURES), help="output folder (default: the committed figures/)")
    f.add_argument("--quiet", action="store_true", help="no progress bar")

    sub.add_parser("bench", help="the GPU benchmark (options: python -m iokernels bench --help)",
                   add_help=False)

    sub.add_parser("dev", help="check and time one op/version/shape (options: python -m iokernels dev --help)",
                   add_help=False)
    if argv and argv[0] == "dev":       # the development tool parses its own options
        _prepare_environment()
        from .bench import dev
        return int(dev.main(argv[1:]))

    sub.add_parser("ring", help="ring attention over W processes (options: python -m iokernels ring --help)",
                   add_help=False)
    if argv and argv[0] == "ring":      # the ring launcher parses its own options
        from . import ring_launch
        return int(ring_launch.main(argv[1:]))

    sub.add_parser("serve-bench", help="serve a trace paged and contiguous at the same KV memory "
                   "(options: python -m iokernels serve-bench --help)", add_help=False)
    if argv and argv[0] == "serve-bench":   # the serving benchmark parses its own options
        _prepare_environment()
        from .serving import bench as serve_bench
        return int(serve_bench.main(argv[1:]))

    if argv and argv[0] == "bench":     # the benchmark parses its own options
        _prepare_environment()
        from . import bench
        if not hasattr(bench, "main"):
            print("bench: iokernels.bench.main is not available in this version", file=sys.stderr)
            return 2
        return int(bench.main(argv[1:]) or 0)

    from .labs import cli as labs_cli
    labs_cli.add_parser(sub)

    args = parser.parse_args(argv)
    _prepare_environment()
    if args.command == "labs":
        if getattr(args, "source", None) == str(labs_cli.DEFAULT_SOURCE) and not labs_cli.DEFAULT_SOURCE.is_dir():
            args.source = str(PACKAGED_LABS)    # an installed wheel: its copy of notebooks/labs
        return labs_cli.run(args)
    return {"tour": _tour, "figures": _figures}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
