"""Every notebook holds the kernel metadata JupyterLab writes on open, so it opens unmodified.

``python -m iokernels.notebook_meta`` normalises them (see :mod:`iokernels.notebook_meta`);
the browser test (tests/test_browser_course.py) checks in JupyterLab that such a notebook
shows no modified mark before it runs.
"""
import json
from pathlib import Path

import pytest

from iokernels import notebook_meta as nm

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = nm.notebook_paths([ROOT / "notebooks"])
FIX = "run `python -m iokernels.notebook_meta` (normalises every notebook under notebooks/) and commit"


def test_the_notebooks_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in NOTEBOOKS}
    assert "notebooks/12_context_parallel.ipynb" in names
    assert any(n.startswith("notebooks/labs/") for n in names)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT / "notebooks").as_posix())
def test_notebook_metadata_is_what_jupyterlab_writes(path):
    text = path.read_text(encoding="utf-8")
    md = json.loads(text)["metadata"]
    assert md.get("kernelspec") == nm.KERNELSPEC, f"{path.name}: kernelspec {md.get('kernelspec')}; {FIX}"
    assert md.get("language_info") == nm.language_info(), f"{path.name}: language_info; {FIX}"
    assert nm.normalise_text(text) == text, f"{path.name} is not laid out as normalised; {FIX}"


def _notebook_text(metadata, indent=1):
    nb = {"cells": [{"cell_type": "markdown", "id": "a", "metadata": {}, "source": ["é  x"]}],
          "metadata": metadata, "nbformat": 4, "nbformat_minor": 5}
    return json.dumps(nb, indent=indent, sort_keys=True, ensure_ascii=False) + "\n"


def test_normalising_changes_only_the_kernel_keys_of_the_metadata():
    old = _notebook_text({"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                          "language_info": {"name": "python"}, "widgets": {"x": 1}})
    new = nm.normalise_text(old)
    nb = json.loads(new)
    assert nb["metadata"] == {"kernelspec": nm.KERNELSPEC, "language_info": nm.language_info(), "widgets": {"x": 1}}
    assert nb["cells"] == json.loads(old)["cells"] and "é" in new          # non-ASCII kept as it is
    assert new.endswith("}\n") and nm.normalise_text(new) == new             # idempotent
    assert new.split('"metadata": {\n  "kernelspec"')[0] == old.split('"metadata": {\n  "kernelspec"')[0]
    assert nm.language_info("3.12.1")["version"] == "3.12.1"


def test_a_file_laid_out_otherwise_is_rewritten_as_nbformat_writes_it():
    new = nm.normalise_text(_notebook_text({}, indent=4))
    assert new == _notebook_text({"kernelspec": nm.KERNELSPEC, "language_info": nm.language_info()})


def test_bad_input_raises():
    with pytest.raises(ValueError, match="text"):
        nm.normalise_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="version"):
        nm.language_info("")
    with pytest.raises(ValueError, match="paths"):
        nm.notebook_paths([ROOT / "README.md"])


def test_check_lists_and_leaves_files_alone(tmp_path, capsys):
    p = tmp_path / "a.ipynb"
    p.write_text(_notebook_text({}), encoding="utf-8")
    before = p.read_text(encoding="utf-8")
    assert nm.main(["--check", str(tmp_path)]) == 1 and p.read_text(encoding="utf-8") == before
    assert "not normalised" in capsys.readouterr().out
    assert nm.main([str(tmp_path)]) == 0 and nm.main(["--check", str(tmp_path)]) == 0
