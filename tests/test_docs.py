"""The docs: the site builds from docs/ with warnings as errors (every page in the navigation, every link to a
page, an anchor or a file resolved; nothing is fetched), its generated references say what the code takes,
every notebook is a tutorial page, and the README stays a landing page whose links all lead somewhere."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import REPO
from eksft_nb import arguments
from eksft_nb.fault_registry import REGISTRY
from eksft_nb.spec import fsx_specs, spec_options
from eksft_nb.timeouts import fsx_table

ROOT = REPO
DOCS = REPO / "docs"
README_MAX_LINES = 250
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as ``make docs`` builds it, into a folder of the test's own."""
    out = tmp_path_factory.mktemp("docs")
    run = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                          "-d", str(out / "doctrees"), str(DOCS), str(out / "html")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"the docs build failed:\n{run.stdout}\n{run.stderr}"
    assert not run.stderr.strip(), f"the docs build warned:\n{run.stderr}"
    return out / "html"


class _Page(HTMLParser):
    """A built page's element ids and its text."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.chunks: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.ids.update(v for k, v in attrs if k == "id" and v)

    def handle_data(self, data: str) -> None:
        self.chunks.append(data)

    @property
    def text(self) -> str:
        return "".join(self.chunks)


def plain(text: str) -> str:
    """Text as a page shows it: Markdown's code marks gone, white space as one blank."""
    return " ".join(text.replace("`", "").split())


def page(site: Path, name: str) -> _Page:
    return _Page((site / name).read_text(encoding="utf-8"))


def test_cli_reference_is_the_argument_table(site: Path) -> None:
    """Every command, each of its flags and every job-spec option, as the code defines them today."""
    cli = page(site, "cli.html")
    text = plain(cli.text)
    for verb in arguments.ARGS.values():
        assert verb.name in cli.ids, f"no section for the {verb.name} command"
        assert plain(verb.help) in text, f"the help of {verb.name} is not in the CLI reference"
        for arg in verb.args:
            for flag in arg.flags:
                assert flag in text, f"{verb.name}'s {flag} is not in the CLI reference"
            if help_ := arg.kwargs.get("help"):
                assert plain(help_) in text, f"{verb.name}'s help of {arg.names[0]} is not in the reference"
    for option in spec_options():
        assert option.flag in text and option.path in text, f"{option.flag} is not in the CLI reference"
        assert plain(option.help) in text, f"the help of {option.flag} is not in the CLI reference"
    assert "eksft:generate" not in (site / "cli.html").read_text(encoding="utf-8")


def test_faults_table_is_the_registry(site: Path) -> None:
    faults = page(site, "faults.html")
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", (site / "faults.html").read_text(encoding="utf-8"), re.S)
    kinds = [re.sub(r"<[^>]+>", "", re.split(r"</td>", row)[0]).strip() for row in rows if "<td" in row]
    assert [k for k in kinds if k in {d.kind.value for d in REGISTRY.values()}] == \
        [d.kind.value for d in REGISTRY.values()], "the faults table is not the registry, in its order"
    text = plain(faults.text)
    for d in REGISTRY.values():
        assert plain(d.description) in text, f"the description of {d.kind} is not in the faults table"
        for name, param in d.params.items():
            assert f"{name} (default {param.default}): {plain(param.what)}" in text, (d.kind, name)


def test_fsx_table_is_computed_from_the_presets(site: Path) -> None:
    text = plain(page(site, "eks.html").text)
    for row in fsx_table(fsx_specs()).splitlines()[2:]:
        assert plain(" ".join(c.strip() for c in row.strip("|").split("|"))) in text, row


def test_every_notebook_is_a_tutorial_page(site: Path) -> None:
    """A tutorial page is a link to the committed notebook, in the navigation, shown as committed."""
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    links = sorted(p.name for p in (DOCS / "tutorials").glob("*.ipynb"))
    assert links == notebooks, "each notebook of notebooks/ needs a link in docs/tutorials/ (docs/README.md)"
    for name in notebooks:
        assert (DOCS / "tutorials" / name).resolve() == (ROOT / "notebooks" / name).resolve()
        cells = json.loads((ROOT / "notebooks" / name).read_text(encoding="utf-8"))["cells"]
        built = plain(page(site, f"tutorials/{name.removesuffix('.ipynb')}.html").text)
        title = next(c for c in cells if c["cell_type"] == "markdown")["source"][0]
        code = next(c for c in cells if c["cell_type"] == "code")["source"]
        assert plain(title.lstrip("# ")) in built, f"{name}'s page does not show its title"
        assert plain("".join(code)) in built, f"{name}'s page does not show its first code cell"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [n for n in notebooks if f"notebooks/{n}" not in readme]
    assert not missing, f"the README lists no tutorial {missing}"


def test_readme_is_a_landing_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, \
        f"README.md has {lines} lines, over {README_MAX_LINES}: move reference into docs/ and link it"


def _local_links(md: Path) -> list[tuple[str, str]]:
    """(path, anchor) of each relative link in a Markdown file, code blocks and spans left out."""
    text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue   # a URL (not fetched: the build runs offline) or an anchor of the same page
        path, _, anchor = target.partition("#")
        out.append((path, anchor))
    return out


def test_readme_links_lead_somewhere(site: Path) -> None:
    """Every relative link of the README names a file of the repository, and an anchor in a docs page one
    that the built page has (the site's own links are checked by the build)."""
    readme = ROOT / "README.md"
    links = _local_links(readme)
    assert links, "the README links nothing"
    for path, anchor in links:
        target = (ROOT / path).resolve()
        assert target.exists(), f"README.md links {path}, which does not exist"
        if anchor:
            assert target.is_relative_to(DOCS) and target.suffix == ".md", f"README.md links {path}#{anchor}"
            built = site / target.relative_to(DOCS).with_suffix(".html")
            assert anchor in page(site, str(built.relative_to(site))).ids, \
                f"README.md links {path}#{anchor}: no such section"
