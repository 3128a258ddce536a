"""Links from the docs to files of the repository outside ``docs/``, written as plain relative paths so
that they work where the Markdown is read as is (a clone, GitHub) and on the built site:

- a link to a notebook that a tutorial page shows (``../notebooks/01_quickstart.ipynb``; the pages under
  ``tutorials/`` are links to those notebooks) goes to that page;
- a link to any other file (``../bench/README.md``) is served with the site as a download, as Sphinx serves
  a linked file that is not a page.

MyST reads such a link as one to a page, and Sphinx resolves symbolic links, so without this the build
warns ``Unknown source document``. A link to a file that does not exist is left alone: it still warns.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.transforms import SphinxTransform

SUFFIXES = (".md", ".ipynb")


class RepositoryLinks(SphinxTransform):
    default_priority = 100   # at read time: before the downloads are collected, long before MyST resolves

    def apply(self, **kwargs: Any) -> None:
        env = self.env
        srcdir = Path(env.srcdir).resolve()
        pages = {Path(env.doc2path(doc)).resolve(): doc for doc in env.found_docs}
        here = Path(env.doc2path(env.docname)).parent
        for node in list(self.document.findall(addnodes.pending_xref)):
            if node.get("refdomain") != "doc" or node.get("reftype") != "myst":
                continue
            target = Path(node["reftarget"])
            if not target.is_absolute() or target.resolve().is_relative_to(srcdir):
                continue   # a page of the site: MyST resolves it
            file = next((p for s in SUFFIXES if (p := target.with_name(target.name + s)).is_file()), None)
            if file is None:
                continue
            page = pages.get(file.resolve())
            if page is not None:
                node["reftarget"] = page
                continue
            download = addnodes.download_reference(
                "", "", *node.children, refdoc=node.get("refdoc", env.docname), refdomain=None,
                reftype="myst", refexplicit=True, reftarget=os.path.relpath(file, here))
            download["classes"] = ["xref", "download", "myst"]
            node.replace_self(download)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_transform(RepositoryLinks)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
