"""The one table of fault kinds, and the one loop that fires them on a rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from eksft_nb.backends import get_backend
from eksft_nb.control import FaultCommand, parse_fault, parse_when, submit
from eksft_nb.fault_registry import REGISTRY, refused
from eksft_nb.jobdir import JobDir
from eksft_nb.runtime import faults
from eksft_nb.runtime.session import InjectedFault, RankInfo, Session
from eksft_nb.spec import JobSpec
from eksft_nb.states import FaultKind, FaultScope


def test_every_kind_has_one_entry_with_a_handler_that_imports() -> None:
    assert list(REGISTRY) == list(FaultKind)
    for kind, entry in REGISTRY.items():
        assert entry.kind is kind and callable(faults.handler(kind)), kind
    assert {d.scope for d in REGISTRY.values()} == set(FaultScope)


@pytest.mark.parametrize("backend", ["local", "eks", "slurm"])
def test_each_backend_refuses_what_the_registry_says(backend: str) -> None:
    assert get_backend(backend).refused_faults == refused(backend)
    assert ("kill-supervisor" in refused(backend)) == (backend != "local")


def test_when_is_read_one_way_for_the_cli_and_the_dashboard() -> None:
    assert [parse_when(w) for w in ("now", "", "120", "step 120", "30s", "2.5s")] == \
        [(None, None), (None, None), (120, None), (120, None), (None, 30.0), (None, 2.5)]
    for text, (step, after) in (("hang:0@45s", (None, 45.0)), ("sigkill:1@30", (30, None)),
                                ("sigterm", (None, None))):
        command = parse_fault(text)
        assert (command.step, command.after) == (step, after), text
    assert [FaultCommand(k, rank=0 if REGISTRY[FaultKind(k)].scope == FaultScope.RANK else None,
                         node=1).target
            for k in ("sigkill", "kill-launcher", "corrupt-checkpoint")] == ["rank 0", "node 1", "the job"]


def test_a_fault_that_raises_leaves_the_next_due_one_queued_not_lost(tmp_path: Path) -> None:
    """Commands are claimed one at a time, each just before it fires: one that raises (an injected
    exception) has not claimed the next, which fires at the next chance."""
    spec = JobSpec(name="fire", nnodes=1, nproc_per_node=1, steps=10)
    jd = JobDir(tmp_path / "fire")
    jd.create(spec)
    for cid in ("first", "second"):
        submit(jd.pending, FaultCommand("exception", rank=0, id=cid))
    s = Session(spec, jd.path,
                RankInfo(rank=0, local_rank=0, world_size=1, node=0, injob_restart=0, job_attempt=0))
    try:
        fired = []
        for step in (3, 4):
            with pytest.raises(InjectedFault, match=f"injected exception on rank 0 at step {step}"):
                s.step_begin(step)
            fired += [p.name for p in jd.fired.iterdir()]
        assert sorted(set(fired)) == ["first", "second"]
        s.step_begin(5)   # nothing left to fire
    finally:
        s.close()


def test_an_injected_exception_that_a_library_raised_again_is_still_the_fault() -> None:
    """A timed fault may land inside library code that wraps what it caught (an import, a collective's
    set-up): the rank's error is still the injected fault, not an exception of its own."""
    from eksft_nb.runtime.session import InjectedFault, error_origin, error_text

    def wrapped(chain: bool) -> BaseException:
        try:
            try:
                raise InjectedFault("injected exception on rank 1")
            except InjectedFault as e:
                if chain:
                    raise ImportError("cannot import name 'x'") from e
                raise RuntimeError("while handling it, another error")  # noqa: B904 - the implicit context
        except (ImportError, RuntimeError) as outer:
            return outer

    assert error_origin(wrapped(True)) == "fault" and error_origin(wrapped(False)) == "fault"
    assert error_origin(RuntimeError("the script's own")) == "exception"
    # the rank's error names the fault, not the wrapper's message (DTensor appends its sharding propagation)
    fault = "InjectedFault: injected exception on rank 1"
    assert error_text(wrapped(True)) == f"{fault} (raised again as ImportError)"
    assert error_text(InjectedFault("injected exception on rank 1")) == fault
    assert error_text(RuntimeError("the script's own")) == "RuntimeError: the script's own"


def test_an_error_that_says_the_other_end_went_first_is_a_peers() -> None:
    """Both ranks of a group may fail on one cause (a section ft_launcher has no timeout for): the rank whose
    rank monitor was stopped first reads a broken pipe, the other the cause; the cause must be named."""
    from eksft_nb.runtime.session import error_origin

    class RankMonitorClientError(Exception):
        pass

    gone = RankMonitorClientError("RankMonitorClient could not send section update. Exception: [Errno 32] "
                                  "Broken pipe")
    said = RankMonitorClientError("RankMonitorClient could not send section update. Exception: Unknown "
                                  "section: restore. Does it have an entry in the config?")
    assert (error_origin(gone), error_origin(BrokenPipeError(32, "x")), error_origin(said)) == (
        "peer", "peer", "exception")
