"""The engine contract (eksft_nb.engines.base): every engine is registered whole, every backend says what it
does for every engine, and what an engine decides is asked of it, never read from its name."""

from __future__ import annotations

import ast

import pytest
from conftest import REPO

from eksft_nb.backends.eks import engine_parts as eks_parts
from eksft_nb.backends.eks.names import KINDS
from eksft_nb.backends.local import engine_parts as local_parts
from eksft_nb.backends.slurm import engine_parts as slurm_parts
from eksft_nb.control import parse_fault
from eksft_nb.engines.base import Engine, per_engine
from eksft_nb.engines.registry import ENGINES, engine_of
from eksft_nb.errors import SpecError
from eksft_nb.spec import JobSpec, spec_options
from eksft_nb.states import EngineName, FaultKind

TORCHFT = JobSpec(engine="torchft", nnodes=3, nproc_per_node=2)


def test_every_engine_name_has_its_engine_and_every_engine_says_what_it_is() -> None:
    assert list(ENGINES) == list(EngineName)
    for name, engine in ENGINES.items():
        assert isinstance(engine, Engine) and engine.name is name
        for attribute in ("label", "node_process", "heals_alone", "faults"):
            assert getattr(engine, attribute, None) is not None, (name, attribute)
        assert set(engine.faults) <= {k.value for k in FaultKind}, name
    # --engine takes exactly the registered names
    [option] = [o for o in spec_options() if o.path == "engine"]
    assert option.choices == tuple(e.value for e in EngineName) and option.default == EngineName.NVRX


def test_every_backend_says_what_it_does_for_every_engine() -> None:
    for parts in (local_parts.PARTS, eks_parts.PARTS, slurm_parts.PARTS):
        assert set(parts) == set(EngineName)
    with pytest.raises(TypeError, match="torchft"):
        per_engine({EngineName.NVRX: 1})


def test_an_engine_this_version_does_not_know_is_refused_in_one_line() -> None:
    for bad in ("deepspeed", ["torchft"], "x" * 10_000):
        with pytest.raises(SpecError) as e:
            engine_of(JobSpec(engine=bad))
        message = str(e.value)
        assert "\n" not in message and len(message) < 200 and "--engine nvrx or --engine torchft" in message


def test_what_the_branches_decided_is_the_engines() -> None:
    nvrx, torchft = engine_of(JobSpec(nnodes=3, nproc_per_node=2)), engine_of(TORCHFT)
    assert nvrx.target_rank(JobSpec(nnodes=3, nproc_per_node=2)) == 5   # the last rank
    assert torchft.target_rank(TORCHFT) == 4   # the last replica group's first: it reports the group's steps
    assert (nvrx.heals_alone, torchft.heals_alone) == (False, True)
    assert nvrx.group_losses(print) is None and torchft.group_losses(print) is not None
    assert torchft.fires(TORCHFT) == torchft.faults
    assert set(torchft.fires(TORCHFT.replace(script="train.py"))) < set(torchft.faults)
    nvrx.check_faults(JobSpec(), [parse_fault("kill-supervisor@5")])
    with pytest.raises(SpecError, match="--engine torchft cannot fire kill-supervisor so far: use one of"):
        torchft.check_faults(TORCHFT, [parse_fault("kill-supervisor@5")])
    assert "replica groups" in torchft.describe(TORCHFT)
    assert "in-process restart on" in nvrx.describe(JobSpec())


def test_an_eks_job_deletes_exactly_what_its_engine_created_beside_the_workload() -> None:
    for name in EngineName:
        spec = JobSpec.from_dict({"name": "demo", "engine": name.value, "nnodes": 2, "nproc_per_node": 1,
                                  "backend": "eks", "eks": {"kind": "jobset", "image": "repo/eksft:1"}})
        parts = eks_parts.PARTS[name]
        created = [(KINDS[o["kind"]], o["metadata"]["name"]) for o in parts.objects(spec)]
        assert parts.beside("demo") == created[::-1], name
        assert len(created) == (4 if name is EngineName.TORCHFT else 0)   # the Lighthouse's three, the secret


def test_no_module_compares_an_engine_with_its_name() -> None:
    """``spec.engine == "torchft"`` is what the contract replaced: a call site asks the engine."""
    found = []
    for path in sorted((REPO / "eksft_nb").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if (any(isinstance(x, ast.Attribute) and x.attr == "engine" for x in sides)
                        and any(isinstance(x, ast.Constant) and isinstance(x.value, str) for x in sides)):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found
