#!/usr/bin/env bash
# The project's one entry point.  Each command first sets everything up (idempotent,
# a few seconds when already done), then runs:
#
#   bash dev.sh tour      the progression on a small problem; figures -> out/figures/ (ignored
#                         by git: a tour leaves a clean checkout clean)          (README step 1)
#   bash dev.sh test      the whole test suite, notebooks and browser test included, on two
#                         cores (pytest-xdist)                                       (README step 2)
#   bash dev.sh test-nosimd  the numerics-sensitive tests again, NumPy's SIMD dispatch off (below)
#   bash dev.sh lint      ruff check (lint) and mypy (types of the core and the public API)
#   bash dev.sh figures   regenerate the committed figures/ from fixed seeds (the only command that does)
#   bash dev.sh lab       JupyterLab on the notebooks (simulator on without a GPU, no news pop-up)
#   bash dev.sh strip     strip outputs from every notebook, in place, and set its kernel metadata
#                         to what JupyterLab writes on open (before committing one)
#   bash dev.sh site      the course website in build/site/ (index.html): every lesson notebook
#                         executed on the CPU, the recorded GPU results, the labs' learner copies,
#                         the API reference (docs/build_site.py; ignored by git)
#   bash dev.sh site-test build the site, then open it in headless Chromium (tests/test_site.py)
#   bash dev.sh setup     only the set-up
#
# Extra arguments go to the command (e.g. `bash dev.sh test tests/test_cli.py -x`).
#
# Set-up: a virtual environment in .venv (python3 -m venv), torch 2.13.0 first (a CPU
# wheel; a torch range alone could pull a multi-GB CUDA build), then this package in
# editable mode with all its extras, then a Jupyter kernel named "python3" that runs the
# venv's Python.  A stamp file holding the hash of pyproject.toml (and of this script)
# skips the pip steps when nothing changed.
#
# IOKERNELS_SETUP=cpu picks a lighter set-up for machines without a GPU: no CuPy and no
# CUDA toolkit wheels (numba and numba-cuda alone: the simulator needs nothing more; triton
# too: its interpreter runs the Triton kernels on the CPU); the
# CuPy sections then show recorded results only, as they do on any machine without a GPU.
#
# `bash dev.sh test-nosimd` runs the numerics-sensitive tests (NOSIMD_TESTS) again with NumPy's
# run-time CPU dispatch switched off (NPY_DISABLE_CPU_FEATURES set to every feature this NumPy
# build dispatches to and this CPU has, read from NumPy at run time): the baseline SIMD path,
# so results may not depend on which path a learner's CPU takes.  CI runs it after the suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PYTHON=${PYTHON:-python3}      # the interpreter that creates .venv
VENV=.venv
TORCH_PIN="torch==2.13.0"      # the CPU build pip finds locally; the GPU machine brings its own
STAMP="$VENV/.iokernels-setup"
SETUP=${IOKERNELS_SETUP:-full}  # full | cpu
# `dev.sh test` runs the suite on two cores (pytest-xdist): each test file stays on one worker
# (--dist loadfile), so a file's module fixtures (a pool of notebooks, a JupyterLab server, a
# PTX report) run once; files are handed out in the order tests/conftest.py gives them (the
# long ones first: see LONG_FILES there).  `-n auto` or `-n 0` among the extra arguments
# overrides the worker count (0: one process, no workers).
TEST_PARALLEL=(-n 2 --dist loadfile --no-loadscope-reorder)
# the tests whose results depend on floating-point last bits, rounding or figure pixels
NOSIMD_TESTS=(tests/test_fa4.py tests/test_online_softmax.py tests/test_reference.py tests/test_forward.py
              tests/test_backward.py tests/test_conditional_rescale.py tests/test_decode.py tests/test_traffic.py
              tests/test_fp8.py tests/test_kv_quant.py tests/test_mla.py tests/test_failure_modes.py
              tests/test_figures.py tests/test_exact_log.py)

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        echo "[dev.sh] creating $VENV with $($PYTHON --version 2>&1)"
        "$PYTHON" -m venv "$VENV"
    fi
    local want
    want=$( (cat pyproject.toml dev.sh; echo "$SETUP") | sha256sum | cut -d' ' -f1)
    if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$want" ]; then
        echo "[dev.sh] set-up ($SETUP): installing $TORCH_PIN first"
        "$VENV/bin/python" -m pip install --quiet "$TORCH_PIN"
        case "$SETUP" in
            full) echo "[dev.sh] installing iokernels[all] (editable)"
                  "$VENV/bin/python" -m pip install --quiet -e ".[all]" ;;
            cpu)  echo "[dev.sh] installing iokernels[torch,triton,notebooks,dev,hf] (editable), numba, numba-cuda"
                  "$VENV/bin/python" -m pip install --quiet -e ".[torch,triton,notebooks,dev,hf]" "numba>=0.60" \
                      "numba-cuda>=0.30" ;;
            *)    echo "IOKERNELS_SETUP must be full or cpu, got '$SETUP'" >&2; exit 2 ;;
        esac
        echo "$want" > "$STAMP"
    fi
    # A kernel named python3 inside the venv (sys-prefix) that runs the venv's Python.
    local spec="$VENV/share/jupyter/kernels/python3/kernel.json"
    if ! grep -q "$PWD/$VENV/bin/python" "$spec" 2>/dev/null; then
        "$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 \
            --display-name "Python 3 (iokernels)" >/dev/null
    fi
    # JupyterLab's settings overrides inside the venv: never fetch news and never ask about it
    # (JupyterLab 4 otherwise opens on a toast asking to fetch Jupyter news), no update check.
    # Keys and values as in the installed schema, @jupyterlab/apputils-extension/notification.json.
    local overrides="$VENV/share/jupyter/lab/settings/overrides.json"
    local want_overrides='{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}'
    if [ "$(cat "$overrides" 2>/dev/null || true)" != "$want_overrides" ]; then
        mkdir -p "$(dirname "$overrides")"
        echo "$want_overrides" > "$overrides"
    fi
    # Prefer the venv's Jupyter kernels and settings over any in the user's home.
    export JUPYTER_PREFER_ENV_PATH=1
    # Without an NVIDIA device, Numba's CUDA kernels run on its simulator (tiny sizes), and
    # the Triton kernels on Triton's interpreter (small sizes).
    if [ ! -e /dev/nvidiactl ] && ! command -v nvidia-smi >/dev/null 2>&1; then
        export NUMBA_ENABLE_CUDASIM=${NUMBA_ENABLE_CUDASIM:-1}
        export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
    fi
    export MPLBACKEND=${MPLBACKEND:-Agg}
}

cmd=${1:-tour}
[ $# -gt 0 ] && shift
case "$cmd" in
    setup)   setup ;;
    tour)    setup; exec "$VENV/bin/python" -m iokernels tour "$@" ;;
    figures) setup; exec "$VENV/bin/python" -m iokernels figures "$@" ;;
    test)    setup; exec "$VENV/bin/python" -m pytest -p no:cacheprovider --timeout=600 "${TEST_PARALLEL[@]}" "$@" ;;
    test-nosimd) setup
             # the features NumPy dispatches to beyond its baseline, on this CPU (empty: one path only)
             features=$("$VENV/bin/python" -c 'import numpy as np
try:
    from numpy._core._multiarray_umath import __cpu_dispatch__ as d, __cpu_features__ as f
except ImportError:
    from numpy.core._multiarray_umath import __cpu_dispatch__ as d, __cpu_features__ as f
print(" ".join(x for x in d if f.get(x)))')
             if [ -z "$features" ]; then
                 echo "[dev.sh] NumPy dispatches to nothing beyond its baseline here: the main run covers it"; exit 0
             fi
             echo "[dev.sh] NPY_DISABLE_CPU_FEATURES=\"$features\" (NumPy $("$VENV/bin/python" -c 'import numpy; print(numpy.__version__)'))"
             # a check that NumPy took it: every one of those features reads as off
             NPY_DISABLE_CPU_FEATURES="$features" "$VENV/bin/python" -c 'import sys
try:
    from numpy._core._multiarray_umath import __cpu_features__ as f
except ImportError:
    from numpy.core._multiarray_umath import __cpu_features__ as f
on = [x for x in sys.argv[1:] if f.get(x)]
sys.exit(f"NumPy ignored NPY_DISABLE_CPU_FEATURES for {on}" if on else 0)' $features
             NPY_DISABLE_CPU_FEATURES="$features" exec "$VENV/bin/python" -m pytest -p no:cacheprovider \
                 --timeout=600 "${TEST_PARALLEL[@]}" "${NOSIMD_TESTS[@]}" "$@" ;;
    lab)     setup; unset MPLBACKEND
             root_flag=(); [ "$(id -u)" = 0 ] && root_flag=(--allow-root)   # Jupyter refuses root otherwise
             # no news pop-up and no update check: a course opens on the notebooks, nothing else
             exec "$VENV/bin/jupyter" lab "${root_flag[@]}" --LabApp.news_url=None \
                 --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate notebooks/ "$@" ;;
    strip)   setup
             # every code cell: no outputs, no execution count; notebook-level widget state dropped
             "$VENV/bin/python" - "${@:-notebooks}" <<'PY'
import sys
from pathlib import Path
import nbformat
paths = [p for a in sys.argv[1:] for p in (sorted(Path(a).glob("*.ipynb")) if Path(a).is_dir() else [Path(a)])]
for path in paths:
    nb = nbformat.read(path, as_version=4)
    before = nbformat.writes(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("widgets", None)
    if nbformat.writes(nb) != before:
        nbformat.write(nb, path)
        print(f"stripped {path}")
PY
             # kernel metadata as JupyterLab writes it on open: the notebook opens unmodified
             exec "$VENV/bin/python" -m iokernels.notebook_meta "${@:-notebooks}" ;;
    site)    setup; exec "$VENV/bin/python" docs/build_site.py "$@" ;;
    site-test) setup; "$VENV/bin/python" docs/build_site.py
             IOKERNELS_SITE_DIR="$PWD/build/site" exec "$VENV/bin/python" -m pytest -p no:cacheprovider \
                 --timeout=900 tests/test_site.py "$@" ;;
    lint)    setup   # ruff (pyproject.toml [tool.ruff]) over the tree, mypy (its [tool.mypy] files)
             "$VENV/bin/python" -m ruff check . && exec "$VENV/bin/python" -m mypy "$@" ;;
    *) echo "usage: bash dev.sh {tour|test|test-nosimd|lint|figures|lab|strip|site|site-test|setup} [args...]" >&2; exit 2 ;;
esac
