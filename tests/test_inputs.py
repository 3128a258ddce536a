"""Generated inputs (Hypothesis) for every parser a user or a job folder feeds: job specs (YAML,
JSON, command-line flags, ``%%ftrain`` lines) and telemetry lines (files, pod logs). Each input is
either handled or refused with one line (a SpecError/JobError/ControlError, IPython's UsageError,
or argparse's usage message); no other exception, no hang, nothing written."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from eksft_nb import cli, commands, magics
from eksft_nb.backends.eks.stream import Tracker
from eksft_nb.errors import EksftError
from eksft_nb.events import KINDS, LOG_PREFIX, EventTail, decode
from eksft_nb.monitor import JobMonitor
from eksft_nb.spec import JobSpec, spec_options

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
OPTIONS = spec_options()

scalars = st.none() | st.booleans() | st.integers(-3, 70) | st.integers() | st.floats() | st.text(max_size=10)
values = st.recursive(scalars,
                      lambda inner: (st.lists(inner, max_size=3)
                                     | st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=10)


def spec_dicts() -> st.SearchStrategy[dict]:
    """Partial specs: real field paths (nested as in a spec file) with arbitrary values, plus strays."""
    def nest(pairs: list[tuple[str, object]]) -> dict:
        out: dict = {}
        for path, value in pairs:
            node = out
            *parents, leaf = path.split(".")
            for p in parents:
                node = node.setdefault(p, {}) if isinstance(node.get(p, {}), dict) else node
            node[leaf] = value
        return out

    good = {"name": st.from_regex(r"[a-z][a-z0-9-]{0,10}[a-z0-9]", fullmatch=True),
            "steps": st.integers(1, 50),
            "model.preset": st.sampled_from(["tiny", "small"]), "backend": st.sampled_from(["local", "eks"])}
    pair = st.sampled_from([o.path for o in OPTIONS] + ["model", "ft", "bogus", "eks.bogus"]).flatmap(
        lambda p: st.tuples(st.just(p), (good.get(p, values) | values) if p in good else values))
    return st.lists(pair, max_size=6).map(nest)


def refused_in_one_line(e: BaseException) -> None:
    text = str(e)
    assert text and "\n" not in text and "Traceback" not in text, text


@SETTINGS
@given(spec_dicts(), st.sampled_from(["json", "yaml"]))
def test_generated_spec_files_load_or_are_refused(data: dict, fmt: str) -> None:
    try:
        text = json.dumps(data) if fmt == "json" else yaml.safe_dump(data)
    except (ValueError, yaml.YAMLError):
        return   # not expressible in this format
    try:
        spec = (JobSpec.from_json if fmt == "json" else JobSpec.from_yaml)(text).validate()
    except EksftError as e:
        refused_in_one_line(e)
        return
    accepted(spec)


def accepted(spec: JobSpec) -> None:
    """An accepted spec has every field of its declared type, serialises, reads back the same, and
    its launch line renders (or the backend refuses it in one line)."""
    for opt in OPTIONS:
        value = spec
        for part in opt.path.split("."):
            value = getattr(value, part)
        if value is None and opt.optional:
            continue
        expected = {float: (int, float), list: list}.get(opt.type, opt.type)
        assert isinstance(value,
                          expected) and (opt.type is bool or not isinstance(value, bool)), (opt.path, value)
    assert JobSpec.from_json(spec.to_json()) == spec and JobSpec.from_yaml(spec.to_yaml()).validate() == spec
    try:
        assert commands.dry_run(spec)   # the backend's own check, then its render
    except EksftError as e:
        refused_in_one_line(e)


yaml_junk = st.text(alphabet="abc:- \n\t'\"{}[]&*!#|>%@`?,0123456789.\x00\x85é", max_size=60)


@SETTINGS
@given(yaml_junk | st.sampled_from(["a: &x [*x]", "steps: !!python/object:os.system {}", "name: 2020-01-01",
                                    "image: !!set {a, b}", "eks: [1, 2]", "steps: .nan", "lr: .inf",
                                    "{" * 2000,
                                    "ft:\n  heartbeat_timeout: .nan", "script_args: [a, 1]",
                                    "name: !!binary aGk="]))
def test_arbitrary_yaml_and_json_text_is_refused_in_one_line(text: str) -> None:
    for load in (JobSpec.from_yaml, JobSpec.from_json):
        try:
            spec = load(text).validate()
        except EksftError as e:
            refused_in_one_line(e)
        else:
            accepted(spec)


flag_values = st.sampled_from(["1", "0", "-1", "2", "nan", "inf", "1e400", "none", "", "tiny", "eks", "local",
                               "sync",
                               "step:3", "/tmp/x", "'unclosed", "$(HOME)", "a\x00b", "1.5", "true",
                               "--x"]) | \
    st.text(max_size=8)


@st.composite
def flag_lines(draw: st.DrawFn) -> list[str]:
    argv: list[str] = []
    for opt in draw(st.lists(st.sampled_from(OPTIONS), max_size=5)):
        if opt.type is bool:
            argv.append(draw(st.sampled_from([opt.flag, "--no-" + opt.flag[2:]])))
        else:
            argv += [opt.flag, draw(flag_values)]
    if draw(st.booleans()):
        argv += ["--fault",
                 draw(st.sampled_from(["sigkill:1@3", "exception", "hang:9", "bogus", "kill-launcher:5@x",
                                                  "slow-rank@0", ":@", ""]))]
    return argv


@SETTINGS
@given(flag_lines())
def test_generated_cli_flags_run_or_are_refused(argv: list[str]) -> None:
    """``run --dry-run`` with generated flags: exit 0, or 2 with argparse's usage message or one
    ``eksft: error:`` line; nothing is launched."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(["run", "--dry-run", *argv])
        except SystemExit as e:   # argparse: usage, then one error line
            assert e.code == 2 and err.getvalue().startswith("usage: ") and "error: " in err.getvalue()
            return
    if code:
        assert code == 2 and err.getvalue().startswith("eksft: error: ") \
            and err.getvalue().count("\n") == 1, err.getvalue()
    else:
        assert out.getvalue() and not err.getvalue()


@SETTINGS
@given(flag_lines(), st.sampled_from(["", "--dry-run"]))
def test_generated_magic_lines_parse_or_are_refused(argv: list[str], extra: str) -> None:
    import shlex

    line = " ".join(shlex.quote(a) for a in argv) + f" {extra}"
    try:
        spec, faults, _ = magics.parse_cell(line, "")
    except UsageError as e:   # the magic's form: the problem, then "  → the fix"
        lines = str(e).splitlines()
        assert 1 <= len(lines) <= 2 and (len(lines) == 1 or lines[1].startswith("  → ")), str(e)
        return
    except EksftError as e:
        refused_in_one_line(e)
        return
    assert all(f.validate(spec.world_size, spec.nnodes) for f in faults)
    accepted(spec)


@SETTINGS
@given(st.lists(st.sampled_from(["list", "attach", "stop", "inject", "resume", "logs", "ckpts", "summary",
                                 "--rank",
                                 "--step", "--node", "--delay", "--duration", "--as", "-n", "--debug",
                                 "--backend",
                                 "eks", "sigkill", "x", "-1", "1.5", "nan", "'",
                                 "../x"]) | st.text(max_size=6),
                max_size=6))
def test_generated_line_magic_commands_parse_or_are_refused(words: list[str]) -> None:
    try:
        magics._parse(magics._line_parser(), " ".join(words), "%ftrain")
    except UsageError as e:
        lines = str(e).splitlines()
        assert 1 <= len(lines) <= 2 and (len(lines) == 1 or lines[1].startswith("  → ")), str(e)


@pytest.mark.parametrize("name", ["../outside", "a/b", "..", "x" * 64, "Bad"])
def test_job_names_that_are_paths_name_no_job(name: str) -> None:
    """A folder beside the jobs root that looks like a job (``rm ../outside`` would delete it)."""
    from eksft_nb.job import attach
    from eksft_nb.jobdir import JobDir, atomic_write, jobs_root

    jobs_root().mkdir(parents=True, exist_ok=True)
    outside = jobs_root().parent / "outside"
    outside.mkdir(parents=True, exist_ok=True)
    atomic_write(outside / "spec.json", JobSpec(name="outside").to_json())
    with pytest.raises(EksftError, match="no job named"):
        JobDir.existing(name)
    with pytest.raises(EksftError, match="no job named"):
        attach(name)


def test_an_unknown_name_among_hundreds_of_jobs_is_one_short_line_with_the_closest(tmp_path: Path) -> None:
    """A few jobs are listed; hundreds are not (the closest is named, and where the rest are)."""
    from eksft_nb.jobdir import JobDir, atomic_write

    for count in (3, 300):
        root = tmp_path / str(count)
        for i in range(count):
            (root / f"train-{i:03d}").mkdir(parents=True)
            atomic_write(root / f"train-{i:03d}" / "spec.json", JobSpec(name=f"train-{i:03d}").to_json())
        with pytest.raises(EksftError) as err:
            JobDir.existing("train-2999", root)
        message = str(err.value)
        assert "\n" not in message and len(message) < 300, message
        if count == 3:
            assert message.endswith("pick one of: train-000, train-001, train-002"), message
        else:
            assert "did you mean 'train-299'? (300 jobs: `python -m eksft_nb list` names them)" in message


def test_a_checkpoint_folder_that_cannot_be_made_is_refused_in_one_line_leaving_no_job_behind() -> None:
    """``run --ckpt-dir /etc/passwd/x`` (a path under a file): one line, and no half-made job folder
    that neither ``run`` (it exists) nor ``rm`` (no such job) could clear."""
    from eksft_nb.jobdir import JobDir

    for _ in range(2):   # the same name again: refused the same way, not "already exists"
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["run", "--name", "half-made", "--ckpt-dir", "/etc/passwd/x", "--model", "tiny"])
        assert code == 2 and err.getvalue().count("\n") == 1, err.getvalue()
        assert err.getvalue().startswith("eksft: error: cannot make the checkpoint folder /etc/passwd/x"), \
            err.getvalue()
        assert not JobDir.for_name("half-made").path.exists()


def alias_bomb(levels: int, fan: int = 9) -> str:
    """A "billion laughs" spec: a field whose list holds anchors, each a list of ``fan`` aliases of the
    one before (``fan ** levels`` leaves once expanded)."""
    items = ["&a0 [x]"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * fan)}]" for i in range(1, levels + 1)]
    return "steps: [" + ", ".join(items) + "]\n"


@pytest.mark.parametrize("levels", [6, 9])
def test_a_yaml_alias_bomb_is_refused_in_one_short_line(tmp_path: Path, levels: int) -> None:
    """A few hundred bytes of nested aliases expand to billions of nodes: refused at the first alias,
    in one line of bounded length (no repr of the expanded value)."""
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(levels))
    assert path.stat().st_size < 600
    with pytest.raises(EksftError) as e:
        JobSpec.load(path).validate()
    refused_in_one_line(e.value)
    assert len(str(e.value)) < 300 and "alias" in str(e.value), str(e.value)[:300]


# ---- telemetry lines ------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6)
event_like = st.fixed_dictionaries(
    {"kind": st.sampled_from(list(KINDS) + ["future"]) | json_scalars},
    optional={"v": st.sampled_from([1, 2, 0, -1, "1", None, 1.0]), "t": json_scalars | st.just(1.8e9),
              "job": json_scalars, "rank": st.sampled_from([0, 1, None, -1, "0", True]),
              **{k: json_scalars | st.lists(json_scalars, max_size=2) for k in
                 {f for fields in KINDS.values() for f in fields} | {"digest", "blocked_s", "bytes",
                                                                     "node"}}})


def as_line(event: dict, prefix: str) -> str:
    return prefix + json.dumps(event, allow_nan=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(event_like.map(lambda e: as_line(e, LOG_PREFIX)) | st.text(max_size=40) |
                st.sampled_from(["@@eksft {", "@@eksft " + "[" * 5000, '@@eksft {"kind":"step","t":1e999}',
                                 '{"kind":"step","t":NaN,"step":1,"loss":1,"tokens":1,"step_time":1}']),
                max_size=12))
def test_generated_event_lines_never_break_a_reader(lines: list[str]) -> None:
    """Decoded or dropped; what decodes folds into the monitor and the EKS tracker (incidents too)."""
    spec = JobSpec(name="demo", backend="eks", nnodes=2, nproc_per_node=1, steps=10)
    tracker, mon = Tracker(spec, 1.8e9, "https://eks.example"), JobMonitor()
    for line in lines:
        event = decode(line)
        if event is not None:
            assert isinstance(event.kind, str) and math.isfinite(event.t) and isinstance(event.job, str)
            mon.update([event])
        tracker.feed(("line", "demo-0-aaaaa", line))
    tracker.feed(("workload", {"status": {"conditions": [{"type": "Failed", "status": "True"}]}}))
    tracker.finish(tracker.outcome_at + 60)
    assert tracker.ended


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=80) | event_like.map(lambda e: as_line(e, "").encode()), max_size=8),
       st.integers(0, 40))
def test_an_events_file_of_arbitrary_bytes_is_tailed_without_error(chunks: list[bytes], cut: int) -> None:
    """Arbitrary bytes, truncated last lines: each read returns only complete lines, once."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "events.jsonl"
        tail = EventTail(path)
        data = b"\n".join(chunks)
        seen = []
        for part in (data[:cut], data[cut:], b"\n"):
            with open(path, "ab") as f:
                f.write(part)
            seen += tail.read()
        assert tail.offset == path.stat().st_size
        JobMonitor().update(seen)
        assert EventTail(path).read() == seen


@pytest.mark.parametrize("line", [
    '@@eksft {"v":1,"t":1.0,"kind":"step","job":"j","rank":0,"step":"7","loss":1,"tokens":1,"step_time":1}',
    '@@eksft {"v":1,"t":1.0,"kind":"checkpoint","job":"j","rank":0,"phase":"committed","step":4,'
    '"blocked_s":"x"}',
    '@@eksft {"v":1,"t":"soon","kind":"job_end","state":"succeeded","reason":"","final_step":1}',
    '@@eksft {"v":"1","t":1.0,"kind":"future"}',
    '@@eksft {"v":1,"t":Infinity,"kind":"future"}',
])
def test_events_with_wrong_types_are_dropped(line: str) -> None:
    assert decode(line) is None
