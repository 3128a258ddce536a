"""A name finds its job, on the backend it was launched with: an EKS job launched into another namespace
is found from any process without the flag; a name held by two backends is refused, naming both, with the
flag that picks one (issues 33 and 35). kmock's Kubernetes and job folders: no job runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from eks_kube import Kube, running
from jobs import cli

from eksft_nb import commands
from eksft_nb.backends import whereabouts
from eksft_nb.backends.eks import EksBackend
from eksft_nb.cli import main
from eksft_nb.errors import JobError, UnknownJobError
from eksft_nb.jobdir import JobDir, eksft_home
from eksft_nb.job import attach
from eksft_nb.spec import JobSpec


def eks_spec(name: str, **changes: object) -> JobSpec:
    spec = JobSpec(name=name, backend="eks", nnodes=2, nproc_per_node=1, steps=10)
    return spec.replace(**{"eks.image": "img:1", "eks.gpus_per_node": 0, "model.preset": "tiny", **changes})


def workloads(kube: Kube, namespace: str) -> list[str]:
    return sorted(name for (res, ns, name), obj in kube.emulator.objects.items()
                  if res.plural == "jobs" and ns == namespace and not obj.deleted)


@pytest.fixture
def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Kube:
    """kmock behind a kubeconfig whose context's namespace is ``default``; the FSx claim in ``default``
    and ``other``."""
    with running() as k:
        monkeypatch.setenv("KUBECONFIG", str(k.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("EKSFT_NAMESPACE", raising=False)
        monkeypatch.delenv("EKSFT_CONTEXT", raising=False)
        for ns in ("default", "other"):
            EksBackend(namespace=ns)._cluster().create({
                "apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": "fsx-claim", "namespace": ns},
                "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
        yield k


def test_an_eks_job_in_another_namespace_is_found_from_a_fresh_process(kube: Kube) -> None:
    commands.launch(eks_spec("far", **{"eks.namespace": "other"}))
    assert workloads(kube, "other") == ["far"] and workloads(kube, "default") == []
    with pytest.raises(UnknownJobError, match="no EKS job named 'far' in namespace default"):
        EksBackend().spec("far")   # what a backend built per call, with the defaults, saw
    seen = cli("status", "far", "--json", timeout=60)   # another process, no --backend, no --namespace
    assert seen.returncode == 0, seen.stderr
    assert '"backend": "eks"' in seen.stdout and '"state": "starting"' in seen.stdout
    assert attach("far", "eks").backend.namespace == "other"
    stopped = commands.stop("far")
    assert stopped["state"] == "stopped" and workloads(kube, "other") == []
    assert commands.remove_jobs([("far", None)]) == [
        {"name": "far", "backend": "eks", "removed": True, "message": "removed far"}]
    assert not (eksft_home() / "whereabouts" / "eks" / "far.json").exists()
    with pytest.raises(UnknownJobError, match="no job named 'far' under .*, nor on eks"):
        commands.status("far")


def test_one_name_on_two_backends_is_named_both_with_the_flag(kube: Kube, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    shared = tmp_path / "shared"
    monkeypatch.setenv("EKSFT_SHARED_DIR", str(shared))
    slurm = JobSpec(name="twice", backend="slurm").replace(**{"slurm.shared_dir": str(shared)})
    JobDir.for_name("twice", shared).create(slurm)   # a Slurm job's folder on the shared disk
    JobDir.for_name("only-slurm", shared).create(slurm.replace(name="only-slurm"))
    JobDir.for_name("twice").create(JobSpec(name="twice"))   # and a local job of the same name
    try:
        assert attach("only-slurm").backend.name == "slurm"   # issue 35: no --backend slurm needed
        with pytest.raises(JobError) as both:
            attach("twice")
        assert str(both.value) == ("'twice' names a job on 2 backends: local and slurm: pick one with "
                                   "--backend local or --backend slurm")
        assert attach("twice", "slurm").spec.backend == "slurm"
        assert attach("twice", "local").spec.backend == "local"
        commands.launch(eks_spec("twice"))
        assert main(["summary", "twice"]) == 2
        assert capsys.readouterr().err == (
            "eksft: error: 'twice' names a job on 3 backends: local, eks and slurm: pick one with "
            "--backend local, --backend eks or --backend slurm\n")
        assert commands.checkpoints("twice", backend="local") == []
    finally:
        JobDir.for_name("twice").path.rename(tmp_path / "local-twice")   # the session's jobs folder


def test_a_record_eksft_did_not_write_is_refused_and_a_silent_cluster_is_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = eksft_home() / "whereabouts" / "eks" / "forged.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    for text in ('{"namespace": "../../api"}', '{"shared_dir": "/x"}', "[", '{"namespace": 3}'):
        record.write_text(text)
        with pytest.raises(JobError) as refused:
            whereabouts.find("forged", "eks")
        assert str(refused.value) == (f"the record of where eks job 'forged' runs ({record}) is not one "
                                      "eksft wrote: delete it (the eks backend's defaults are then used)")
    record.write_text('{"namespace": "other"}')
    with running() as gone:   # a cluster that no longer answers
        monkeypatch.setenv("KUBECONFIG", str(gone.kubeconfig(tmp_path / "kubeconfig")))
    with pytest.raises(UnknownJobError) as missing:
        commands.status("forged")
    assert str(missing.value).startswith("no job named 'forged' under ")
    # the Slurm links folder exists once any test launched on Slurm
    assert re.search(r", nor on eks( or slurm)?; eks did not answer \(cannot connect to the Kubernetes "
                     r"API at http://127\.0\.0\.1:\d+ ", str(missing.value)), str(missing.value)
    record.unlink()


def test_slurm_is_searched_once_a_job_was_launched_here_and_the_panel_lists_it_alike(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from eksft_nb.backends.slurm.backend import SlurmBackend
    from eksft_nb.lab.manager import slurm_configured

    monkeypatch.setenv("EKSFT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EKSFT_SHARED_DIR", raising=False)
    links = eksft_home() / "slurm"
    links.mkdir(parents=True)   # what removing the last Slurm job launched here leaves
    assert not SlurmBackend().configured() and not slurm_configured()
    with pytest.raises(UnknownJobError) as missing:
        whereabouts.find("nowhere")
    assert ", nor on" not in str(missing.value), str(missing.value)
    (links / "gone").symlink_to(tmp_path / "gone")
    assert SlurmBackend().configured() and slurm_configured()
    with pytest.raises(UnknownJobError) as missing:
        whereabouts.find("nowhere")
    assert str(missing.value).startswith("no job named 'nowhere' under ") and "nor on slurm" in str(
        missing.value), str(missing.value)
