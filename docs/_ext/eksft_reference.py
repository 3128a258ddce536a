"""Reference tables generated from the code when the site is built, so they cannot drift from it.

A page marks the place with an HTML comment on a line of its own, ``<!-- eksft:generate NAME -->``
(invisible where the Markdown is read as is, e.g. on GitHub); when Sphinx reads the page the line is
replaced by the Markdown that :data:`GENERATORS` ``[NAME]`` returns:

- ``cli``: every command of :data:`eksft_nb.arguments.ARGS` (the table the CLI's and the magics' parsers are
  built from) with its arguments;
- ``spec-options``: every job-spec option (:func:`eksft_nb.spec.spec_options`: each field's flag, help and
  default), grouped as ``run --help`` groups them (:data:`eksft_nb.arguments.SPEC_GROUPS`);
- ``faults``: the fault kinds of :data:`eksft_nb.fault_registry.REGISTRY`;
- ``expect-keys``: what a resilience test's ``--expect`` checks (:data:`eksft_nb.resilience.expect.KEYS`);
- ``fsx-table``: a checkpoint's save and restore time per model preset and FSx throughput
  (:func:`eksft_nb.timeouts.fsx_table` of :func:`eksft_nb.spec.fsx_specs`).

The pages holding a mark are read again on every build, since their text depends on the code.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)

MARK = re.compile(r"^<!-- eksft:generate ([\w-]+) -->[ \t]*$", re.MULTILINE)
PROG, MAGIC_PROG = "python -m eksft_nb", "%ftrain"


# ---- Markdown helpers ----------------------------------------------------------------------------

def text(s: str) -> str:
    """``s`` as table-cell Markdown: code spans kept, other markup characters escaped, pipes escaped
    everywhere (a table splits cells on them, inside code spans too)."""
    parts = str(s).split("`")
    for i in range(0, len(parts), 2):   # outside code spans
        parts[i] = re.sub(r"([\\*_\[\]<>$])", r"\\\1", parts[i])
    return "`".join(parts).replace("|", r"\|").replace("\n", " ")


def code(s: Any) -> str:
    s = str(s).replace("|", r"\|")
    return f"``{s}``" if "`" in s else f"`{s}`"


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell or " " for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# ---- the CLI -------------------------------------------------------------------------------------

def _metavar(a: Any, kw: dict[str, Any]) -> str:
    """The word argparse writes for an argument's value (its usage line's), or "" for a switch."""
    action = kw.get("action")
    if action in ("store_true", "store_false", "count") or isinstance(action, type):
        return ""
    if kw.get("metavar"):
        return kw["metavar"]
    if kw.get("choices"):
        return "{" + ",".join(kw["choices"]) + "}"
    dest = kw.get("dest") or next((n[2:] for n in a.names if n.startswith("--")), a.names[0])
    return dest.replace("-", "_").upper()


def _argument(a: Any, kw: dict[str, Any]) -> str:
    """``--rank RANK``, ``-n, --lines LINES``, ``--inprocess, --no-inprocess``, ``FAULT``."""
    if not a.flags:
        word = kw.get("metavar") or a.names[0].upper()
        return code(f"[{word}]" if kw.get("nargs") in ("?", "*") else word)
    flags = list(a.flags)
    if kw.get("action") is argparse.BooleanOptionalAction:
        flags += [f"--no-{f[2:]}" for f in a.flags if f.startswith("--")]
    word = _metavar(a, kw)
    return ", ".join(code(f) for f in flags[:-1]) + (", " if len(flags) > 1 else "") + \
        code(f"{flags[-1]} {word}" if word else flags[-1])


def _default(value: Any) -> str:
    if value is None or value is False or value == [] or value is argparse.SUPPRESS:
        return ""
    return code(value)


def cli() -> str:
    from eksft_nb import arguments

    out = []
    verbs = list(arguments.ARGS.values())
    rows = []
    for v in verbs:
        magic = ("`%%ftrain` (a cell)" if v.name == "run" else
                 code(f"{MAGIC_PROG} {v.name_in(arguments.MAGIC)}") if arguments.MAGIC in v.fronts
                 else "terminal only")
        rows.append((f"[{code(v.name)}](#{v.name})", text(v.help), magic))
    out.append(table(("command", "what it does", "in a notebook"), rows))
    for v in verbs:
        out.append(f"### `{v.name}`\n\n{text(v.help)[0].upper()}{text(v.help)[1:]}.")
        words = arguments.positionals(v.name, arguments.CLI)
        usage = f"{PROG} {v.name}" + (f" {words}" if words else "") + " [options]"
        lines = [f"```text\n{usage}\n```"]
        if arguments.MAGIC in v.fronts:
            mwords = arguments.positionals(v.name, arguments.MAGIC)
            notebook = ("%%ftrain [options]\n<the cell: empty for the built-in trainer, or your script>"
                        if v.name == "run" else
                        f"{MAGIC_PROG} {v.name_in(arguments.MAGIC)}" + (f" {mwords}" if mwords else "")
                        + " [options]")
            lines.append(f"In a notebook:\n\n```text\n{notebook}\n```")
        else:
            lines.append("Terminal only.")
        out.append("\n\n".join(lines))
        rows = []
        for a in v.args:
            kw = dict(a.kwargs)
            help_ = text(kw.get("help", ""))
            if arguments.MAGIC in v.fronts and arguments.MAGIC not in a.fronts:
                help_ += " *(terminal only)*"
            if a.magic.get("help") and arguments.MAGIC in a.fronts:
                help_ += f" *(in a notebook: {text(a.magic['help'])})*"
            rows.append((_argument(a, kw), _default(kw.get("default")), help_))
        if v.name in arguments.SPEC_VERBS:
            rows.append(("every [job-spec option](#job-spec-options)", "", "the job to run"))
        if rows:
            out.append(table(("argument", "default", "what it does"), rows))
    return "\n\n".join(out)


# ---- the job spec's options ----------------------------------------------------------------------

def _spec_default(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return code(str(value).lower())
    return code(value)


def spec_options() -> str:
    from eksft_nb import arguments
    from eksft_nb.spec import spec_options as options

    groups: dict[str, list[tuple[str, ...]]] = {title: [] for title in arguments.SPEC_GROUPS.values()}
    for o in options():
        section = o.path.rsplit(".", 1)[0] + "." if "." in o.path else ""
        if section not in arguments.SPEC_GROUPS:
            logger.warning(f"spec field {o.path} is in no section of arguments.SPEC_GROUPS",
                           type="eksft", subtype="generate")
            continue
        flag = (f"{code(o.flag)}, {code('--no-' + o.flag[2:])}" if o.type is bool
                else code(f"{o.flag} {o.flag[2:].upper()}"))
        help_ = text(o.help) + (f" (one of {', '.join(code(c) for c in o.choices)})" if o.choices else "")
        groups[arguments.SPEC_GROUPS[section]].append((flag, code(o.path), _spec_default(o.default), help_))
    out = []
    for title, rows in groups.items():
        if rows:
            out.append(f"### {title[0].upper()}{title[1:]}\n\n"
                       + table(("option", "spec field", "default", "what it sets"), rows))
    return "\n\n".join(out)


# ---- the faults ----------------------------------------------------------------------------------

def faults() -> str:
    from eksft_nb.fault_registry import REGISTRY

    rows = []
    for d in REGISTRY.values():
        params = "; ".join(f"{code(name)} (default {code(p.default)}): {text(p.what)}"
                             for name, p in d.params.items())
        refused = ", ".join(sorted(d.refused_by))
        rows.append((f"{code(d.kind.value)}", d.scope.value, text(d.description), params,
                     f"not on {refused}" if refused else "every backend"))
    return table(("fault", "hits", "what happens", "parameters", "backends"), rows)


# ---- the resilience test's expectations ----------------------------------------------------------

def expect_keys() -> str:
    from eksft_nb.resilience.expect import KEYS

    return table(("key", "what it checks"), [(code(k), text(v)) for k, v in KEYS.items()])


# ---- what a checkpoint costs on FSx ----------------------------------------------------------------

def fsx_table() -> str:
    from eksft_nb.spec import fsx_specs
    from eksft_nb.timeouts import fsx_table as table_of

    return table_of(fsx_specs())


# ---- what GPU time costs, and what heals each fault ----------------------------------------------------

def prices() -> str:
    from eksft_nb import cost

    rows = [(code(name), i.gpu, str(i.gpus), f"${i.usd_per_hour:,.4f}", f"${i.usd_per_hour / i.gpus:,.4f}")
            for name, i in cost.PRICES.items()]
    return (f"On-demand, Linux, {cost.PRICES_REGION}, as of {cost.PRICES_AS_OF}:\n\n"
            + table(("--price", "GPU", "GPUs", "USD per instance-hour", "USD per GPU-hour"), rows))


def expected_levels() -> str:
    from eksft_nb.engines.registry import ENGINES
    from eksft_nb.spec import JobSpec
    from eksft_nb.states import EngineName, FaultKind

    off = JobSpec().replace(**{"ft.inprocess": False})
    columns = [(EngineName.NVRX, "NVRx, in-process on", JobSpec()),
               (EngineName.NVRX, "NVRx, in-process off", off),
               (EngineName.NVRX, "NVRx, a script", JobSpec(script="train.py")),
               (EngineName.TORCHFT, "torchft", JobSpec(engine="torchft", nnodes=2, nproc_per_node=1)),
               (EngineName.TORCHFT, "torchft, a script",
                JobSpec(engine="torchft", nnodes=2, nproc_per_node=1, script="train.py"))]
    rows = []
    for kind in FaultKind:
        cells = []
        for engine, _, spec in columns:
            level = ENGINES[engine].expected_level(kind.value, spec)
            fired = kind.value in ENGINES[engine].fires(spec)
            cells.append("(not fired)" if not fired else code(level) if level else "not said")
        rows.append((code(kind.value), *cells))
    return table(("fault", *(label for _, label, _ in columns)), rows)


GENERATORS: dict[str, Callable[[], str]] = {"cli": cli, "spec-options": spec_options, "faults": faults,
                                            "expect-keys": expect_keys, "fsx-table": fsx_table,
                                            "prices": prices, "expected-levels": expected_levels}


# ---- Sphinx --------------------------------------------------------------------------------------

def _generate(match: re.Match[str], docname: str) -> str:
    name = match.group(1)
    if name not in GENERATORS:
        logger.warning(f"unknown generated table {name!r} (known: {', '.join(GENERATORS)})",
                       location=docname, type="eksft", subtype="generate")
        return ""
    return GENERATORS[name]() + "\n"


def source_read(app: Sphinx, docname: str, source: list[str]) -> None:
    source[0] = MARK.sub(lambda m: _generate(m, docname), source[0])


def generated_pages(app: Sphinx, env: Any, added: set[str], changed: set[str],
                    removed: set[str]) -> list[str]:
    """The pages with a mark, read again whatever changed: the code they are generated from may have."""
    src = Path(app.srcdir)
    return [doc for doc in env.found_docs if (src / f"{doc}.md").is_file()
            and MARK.search((src / f"{doc}.md").read_text(encoding="utf-8"))]


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("source-read", source_read)
    app.connect("env-get-outdated", generated_pages)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
