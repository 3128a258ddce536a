"""The dashboard figure's JavaScript, by reference: plotly's FigureWidget carries its whole 5 MB bundle in
the widget state, once per figure, so a notebook saved with two dashboards weighed 10 MB. Our figure carries
this loader instead, which imports the bundle from the Jupyter server (route
``/eksft/plotly/widgetbundle.js``, eksft_nb.lab, which ``pip install`` enables): a saved notebook reopened in
JupyterLab still draws its figures, from the data in its widget state, with no kernel and no network.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def bundle_dir() -> Path:
    """plotly's package_data folder, which holds widgetbundle.js (found without importing plotly)."""
    (root,) = importlib.util.find_spec("plotly").submodule_search_locations
    return Path(root) / "package_data"


BUNDLE = "widgetbundle.js"
ROUTE = f"plotly/{BUNDLE}"   # under the server's /eksft/

LOADER = """\
const config = JSON.parse(document.getElementById("jupyter-config-data")?.textContent || "{}");
const url = new URL("eksft/%s", new URL(config.baseUrl || "/", location.href)).href;
let plotly;
try {
  plotly = (await import(url)).default;
} catch (e) {
  const why = `the figure needs the eksft_nb.lab server extension (${url}: ${e}) → ` +
    "pip install eksft-nb into the environment that runs Jupyter, or enable eksft_nb.lab";
  plotly = {render({el}) { el.textContent = why; el.className += " eksft-figure-missing"; }};
}
export default plotly;
""" % ROUTE
