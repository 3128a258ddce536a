"""Sphinx configuration of the eksft-nb docs: MyST Markdown pages, the tutorials rendered from the committed
notebooks (never executed here), reference tables generated from the code (_ext/eksft_reference.py).
``make docs`` builds it into build/docs/html; tests/test_docs.py builds it with warnings as errors."""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path[:0] = [str(DOCS.parent), str(DOCS / "_ext")]   # this tree's eksft_nb, whatever the venv installed

project = "eksft-nb"
author = "the eksft-nb developers"
copyright = "the eksft-nb developers"

# myst_nb brings myst_parser (the .md pages) with it
extensions = ["myst_nb", "eksft_reference", "eksft_links"]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "**/.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]

# MyST: headings get anchors down to ### (links like cli.md#inject); no $ math, so a $VAR stays text
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist", "attrs_inline"]

# the tutorials are the committed notebooks, shown as they are: running them takes minutes and real jobs
nb_execution_mode = "off"
nb_merge_streams = True

# no typographic quotes or dashes: a flag written in prose (--dry-run) must stay one a reader can copy
smartquotes = False

html_theme = "pydata_sphinx_theme"
html_title = "eksft-nb"
html_static_path: list[str] = []
# the pages are in the header (index.md's toctrees); only the tutorials have a section list of their own
html_sidebars = {"*": []}   # "*" stops at a "/": the tutorials keep their list
html_theme_options = {
    "navigation_with_keys": False,
    "header_links_before_dropdown": 6,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": [],
    "footer_end": [],
}
html_show_sourcelink = False
html_copy_source = False
