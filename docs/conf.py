"""Sphinx configuration of the course website (``bash dev.sh site``, built by docs/build_site.py).

Why Sphinx + MyST-NB + sphinx-book-theme: it is the stack Jupyter Book 1 is built on, kept up
by the Executable Books project, and used directly it needs no Node.js: notebooks become pages
with their outputs (MyST-NB), Markdown pages are MyST, the API reference comes from the
docstrings (autodoc), the search box is Sphinx's own (a static index, no server), and the
whole site is static HTML that opens without a network (MathJax is served from the site, see
build_site.py). mkdocs-material + mkdocs-jupyter would do the notebooks too, but the API
reference would need another plug-in, and Jupyter Book 2 needs Node.js.

This file is read from the staging folder build/site-src/, which build_site.py fills (the
README's introduction, the executed lesson notebooks, the learner copies of the labs, the
pages of docs/pages/); the package is imported from the checkout.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(os.environ.get("IOKERNELS_ROOT", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(ROOT))

import iokernels  # noqa: E402

project = "iokernels"
author = "the iokernels authors"
copyright = "the iokernels authors, MIT licence"
release = version = iokernels.__version__

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
root_doc = "index"

# ---- notebooks: executed by build_site.py before Sphinx reads them (with outputs), never here;
# a page may opt in to execution in its front matter (the recorded-results page does)
nb_execution_mode = "off"
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_merge_streams = True
# widgets: build_site.py replaces each widget's output with a note (a widget needs a live kernel),
# so no widget JavaScript is loaded (it would come from a CDN)
nb_ipywidgets_js: dict = {}
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
# MathJax 2 below: MyST's MathJax 3 options would replace its configuration
myst_update_mathjax = False
suppress_warnings = ["mystnb.unknown_mime_type", "myst.header"]

# ---- API reference
autodoc_default_options = {"members": False, "undoc-members": False}
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = False
napoleon_numpy_docstring = True

# ---- math: MathJax 2 from the site itself (the jupyter-server-mathjax package's copy, which
# build_site.py puts in _static/mathjax/): the pages need no network
mathjax_path = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"
mathjax2_config = {"tex2jax": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]],
                               "processRefs": False, "processEnvironments": False},
                   "messageStyle": "none",
                   # the package ships the STIX web fonts only: no TeX fonts, no image fonts
                   "HTML-CSS": {"availableFonts": [], "webFont": "STIX-Web", "imageFont": None,
                                "preferredFont": None,
                                # its blank test font: a local name, not url('about:blank'), which
                                # Chromium refuses with a console error
                                "styles": {"@font-face": {"font-family": "MathJax_Blank",
                                                          "src": "local('MathJax_Blank')"}}}}

# ---- HTML
html_theme = "sphinx_book_theme"
html_title = "iokernels: IO-aware attention, step by step"
html_static_path = ["_static"]
html_favicon = "_static/favicon.svg"     # else a browser asks for /favicon.ico, which is not there
# the light theme unless the reader picks another (without it the theme logs an error on load)
html_context = {"default_mode": "light"}
html_last_updated_fmt = None
html_show_sourcelink = False
html_copy_source = False
html_theme_options = {
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "use_repository_button": False,
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
