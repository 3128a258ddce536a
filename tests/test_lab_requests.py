"""The lab server's request bodies (``eksft_nb.lab.requests``), without a server: anything JSON can
carry is read into the command layer's arguments or refused in one line."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eksft_nb.errors import EksftError
from eksft_nb.lab import requests


# ---- the body parser, on anything JSON can carry -------------------------------------------------

json_values = st.recursive(st.none() | st.booleans() | st.integers(min_value=-10**30, max_value=10**30)
                           | st.floats() | st.text(max_size=30),
                           lambda inner: (st.lists(inner, max_size=4)
                                          | st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                           max_leaves=12)
field_names = st.sampled_from(["fault", "rank", "step", "after", "node", "delay", "duration", "backend", "as",
                               "steps", "spec", "faults", "name", "model.preset", "steps", "checkpoint.every",
                               "x"])
spec_fields = st.dictionaries(st.sampled_from(["steps", "name", "model.preset", "nproc_per_node",
                                               "checkpoint.every",
                                               "ft.inprocess", "script_args", "resume", "lr", "model",
                                               "nosuch"]),
                              json_values, max_size=4)


@settings(max_examples=200, deadline=None)
@given(raw=st.one_of(st.binary(max_size=60),
                     st.dictionaries(field_names, json_values,
                                     max_size=5).map(lambda d: json.dumps(d).encode()),
                     st.builds(lambda spec, faults: json.dumps({"spec": spec, "faults": faults}).encode(),
                               spec_fields, st.lists(st.text(max_size=12), max_size=3))))
def test_request_bodies_are_read_or_refused_in_one_line(raw: bytes) -> None:
    for shape, read in ((requests.INJECT, requests.inject_args), (requests.LAUNCH, requests.launch_args),
                        (requests.RESUME, dict), (requests.STOP, dict)):
        try:
            args = read(requests.body(raw, shape))
        except EksftError as e:
            assert "\n" not in str(e) and e.problem and len(str(e)) < 1000, str(e)
            continue
        if shape is requests.INJECT:
            command, backend = args
            assert isinstance(command.fault, str) and isinstance(backend, str)
            assert set(command.params) <= {"delay", "duration"}
        elif shape is requests.LAUNCH:
            spec, faults = args
            assert spec.validate() is spec and all(f.fault for f in faults)
        else:
            assert set(args) <= set(shape)


def test_oversized_bodies_are_refused() -> None:
    with pytest.raises(EksftError, match="request body is"):
        requests.body(b"{" + b" " * requests.MAX_BODY + b"}", requests.STOP)
