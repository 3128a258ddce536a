"""The job spec: round trips, validation messages, and the option table the CLI and magic share."""

from __future__ import annotations

import pytest

from eksft_nb.errors import SpecError
from eksft_nb.spec import MODEL_PRESETS, JobSpec, parse_option_value, spec_options


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
