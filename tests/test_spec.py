"""The job spec: round trips, validation messages, and the option table the CLI and magic share."""

from __future__ import annotations

from pathlib import Path

import pytest

from eksft_nb.control import parse_fault
from eksft_nb.errors import SHOWN_CHARS, EksftError, SpecError, closest, shown
from eksft_nb.jobdir import JobDir
from eksft_nb.spec import MAX_SPEC_BYTES, JobSpec, spec_options
from eksft_nb.spec_fields import parse_option_value
from eksft_nb.spec_sections import MODEL_PRESETS


def test_json_and_yaml_round_trip_keep_every_field() -> None:
    spec = JobSpec(name="round-trip", steps=123).replace(**{"checkpoint.every": 7, "ft.inprocess": False,
                                                            "model.d_model": 96, "script_args": ["--a", "1"]})
    assert JobSpec.from_json(spec.to_json()) == spec
    assert JobSpec.from_yaml(spec.to_yaml()) == spec
    assert JobSpec.from_json(spec.to_json()).digest() == spec.digest()
    assert spec.replace(seed=1).digest() != spec.digest()


@pytest.mark.parametrize("changes, problem, fix", [
    ({"name": "Bad_Name"}, "invalid job name 'Bad_Name'", "--name bad-name"),
    ({"name": "x" * 64}, "at most 63 characters", "--name"),
    ({"nproc_per_node": 0}, "nproc_per_node must be an integer >= 1, got 0", "--nproc-per-node 1"),
    ({"steps": -5}, "steps must be an integer >= 1, got -5", "--steps 1"),
    ({"checkpoint.keep_last": 1}, "keep_last must be an integer >= 2", "--keep-last 2"),
    ({"model.preset": "smal"}, "unknown model preset 'smal'", "--model small"),
    ({"model.d_model": 100, "model.n_heads": 3}, "not divisible by n_heads 3", "--n-heads"),
    ({"ft.soft_timeout": 9.0, "ft.hard_timeout": 8.0}, "soft timeout (9.0s) must be shorter",
     "--hard-timeout"),
    ({"resume": "yesterday"}, "invalid resume 'yesterday'", "step:N"),
    ({"ft.collective_timeout": 9.0}, "collective timeout (9.0s) must be shorter", "--collective-timeout"),
])
def test_invalid_fields_name_the_problem_and_the_fix(changes: dict, problem: str, fix: str) -> None:
    with pytest.raises(SpecError) as err:
        JobSpec().replace(**changes).validate()
    message = str(err.value)
    assert problem in message and fix in message
    assert "\n" not in message


def test_unknown_fields_suggest_the_closest_one() -> None:
    with pytest.raises(SpecError, match=r"unknown spec field 'step'.*did you mean steps"):
        JobSpec.from_dict({"step": 10})
    with pytest.raises(SpecError, match=r"unknown spec field checkpoint.'evry'.*checkpoint.every"):
        JobSpec.from_dict({"checkpoint": {"evry": 10}})


def test_every_field_has_a_flag_and_help() -> None:
    options = spec_options()
    flags = [o.flag for o in options]
    assert len(flags) == len(set(flags)), "two fields share a flag"
    assert all(o.flag.startswith("--") and o.help for o in options)
    paths = {o.path for o in options}
    assert {"steps", "checkpoint.every", "ft.inprocess", "model.preset", "eks.namespace"} <= paths
    preset = next(o for o in options if o.path == "model.preset")
    assert preset.default == "small" and set(MODEL_PRESETS) >= {"tiny", "small"}


def test_option_values_are_parsed_with_clear_errors() -> None:
    steps = next(o for o in spec_options() if o.path == "steps")
    assert parse_option_value(steps, "42") == 42
    with pytest.raises(SpecError, match=r"--steps expects int, got 'ten'"):
        parse_option_value(steps, "ten")
    mode = next(o for o in spec_options() if o.path == "checkpoint.mode")
    with pytest.raises(SpecError,
                       match=r"--ckpt-mode must be one of async, sync, got 'asnyc'.*--ckpt-mode async"):
        parse_option_value(mode, "asnyc")
    timeout = next(o for o in spec_options() if o.path == "ft.step_timeout")
    assert parse_option_value(timeout, "none") is None


def test_what_a_message_echoes_of_a_value_is_bounded_and_says_its_size() -> None:
    huge = "a" * 30_000_000
    for value, size in ((huge, "(30,000,000 chars)"), (b"\0" * 100, "(100 bytes)"),
                        ("\n" * 81, "(81 chars)")):
        text = shown(value)
        assert len(text) <= SHOWN_CHARS + 25 and "\n" not in text and text.endswith(f"... {size}"), text
    nested: list = []
    for _ in range(10_000):
        nested = [nested, list(range(1000))]
    assert len(shown(nested)) <= SHOWN_CHARS + 3 and len(shown(list(range(10**6)))) <= SHOWN_CHARS + 3
    assert shown("nvrx") == "'nvrx'" and shown("x" * SHOWN_CHARS) == repr("x" * SHOWN_CHARS)
    assert closest("torchf", ["nvrx", "torchft"]) == "torchft" and closest(huge, ["nvrx"]) == "nvrx"
    # where a user's value reaches a one-line error: a 30 MB job name, fault, option value, field name
    for fails in (lambda: JobSpec(name=huge).validate(), lambda: parse_fault(huge).validate(2, 1),
                  lambda: JobSpec.from_dict({huge: 1}), lambda: JobDir.existing(huge),
                  lambda: parse_option_value(next(o for o in spec_options() if o.path == "steps"), huge)):
        with pytest.raises(EksftError) as err:
            fails()
        message = str(err.value)
        assert "\n" not in message and len(message) < 600 and "30,000,000 chars" in message, message[:600]


def test_a_spec_over_the_size_cap_is_refused_in_one_line_naming_its_size_and_the_fix(tmp_path: Path) -> None:
    big = tmp_path / "spec.yaml"
    big.write_text("name: big\n" + "#" * MAX_SPEC_BYTES)
    with pytest.raises(SpecError) as err:
        JobSpec.load(big)
    message = str(err.value)
    assert f"{big} is {MAX_SPEC_BYTES + 10:,} bytes, over the {MAX_SPEC_BYTES:,}" in message, message
    assert "check that it is the spec file you meant" in message and "\n" not in message
    for parse in (JobSpec.from_yaml, JobSpec.from_json):
        with pytest.raises(SpecError, match=f"over the {MAX_SPEC_BYTES:,} a job spec may hold"):
            parse(" " * (MAX_SPEC_BYTES + 1))
    big.write_text("name: small\nsteps: 7\n" + "#" * (MAX_SPEC_BYTES - 30))   # under the cap: read as ever
    assert JobSpec.load(big).steps == 7
