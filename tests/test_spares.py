"""Hot spares (``--spare-nodes``): the extra launchers and pods a job gets, as rendered, and which NVRx
release can run them where. The spare taking a lost node's place in a real job is tested in
test_engine.py (locally) and test_slurm_spares.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from eks_pods import LocalPod
from test_eks_gpu_cluster import pod_of
from test_eks_render import eks_spec

import nvrx_releases as releases
from eksft_nb import commands, nvrx
from eksft_nb.backends.eks import EksBackend, names, schemas
from eksft_nb.backends.eks.failures import CONFIG_ERROR
from eksft_nb.backends.local import LocalBackend
from eksft_nb.errors import JobError, SpecError
from eksft_nb.launcher import Ports, launcher_argv
from eksft_nb.spec import JobSpec


@pytest.mark.parametrize("kind", ["job", "jobset"])
def test_eks_workloads_get_the_spare_pods_and_the_rendezvous_keeps_its_size(kind: str) -> None:
    spec = eks_spec(nnodes=2, kind=kind, spare_nodes=1)
    docs = [d for d in yaml.safe_load_all(EksBackend().render(spec)) if d]
    for doc in docs:
        schemas.validate(doc, spec.eks.k8s_version)
    (workload,) = [d for d in docs if d["kind"] in ("Job", "JobSet")]
    job = workload["spec"] if kind == "job" else workload["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["completions"] == job["parallelism"] == 3
    args = job["template"]["spec"]["containers"][0]["args"]
    assert "--nnodes=2:3" in args   # NVRx's standby nodes: 2 train, the third waits for a lost one's place


@pytest.mark.parametrize("release", ["installed", releases.NEWEST])
def test_an_eks_pod_whose_nvrx_cannot_run_the_spares_stops_before_training(
        release: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The render cannot know the image's NVRx: the pod's init container (`prepare`, run here with the
    pod's environment: its doctor gate) refuses spares its NVRx cannot run, in one line with the
    configuration-error exit that fails the job; with NVRx 0.6+ it goes on."""
    releases.use(release, monkeypatch)
    m = EksBackend().manifests(eks_spec(name="sparepod", nnodes=2, spare_nodes=1))
    pod = LocalPod(pod_of(m.workload()), "sparepod-0", tmp_path, m.job[0]["data"],
                   {names.COMPLETION_INDEX: "0", names.INDEX_FAILURES: "0"})
    done = pod.run("prepare", timeout=120)
    if nvrx.supports_own_spares(releases.version(release)):
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == CONFIG_ERROR, done.stderr
    [line] = done.stderr.strip().splitlines()
    version = releases.version(release)
    assert line.startswith(f"eksft: error: --spare-nodes 1: NVRx {version} takes --nnodes 2:3 as an elastic "
                           "range and would train on every spare → use NVRx >= 0.6"), line


def test_pytorchjobs_refuse_spares_in_one_line() -> None:
    with pytest.raises(SpecError) as err:
        # the command layer's one check
        commands.dry_run(eks_spec(nnodes=2, kind="pytorchjob", spare_nodes=1))
    assert "\n" not in str(err.value) and "use --kind job (or jobset) for hot spares" in str(err.value)


def test_local_jobs_start_a_launcher_per_spare_and_refuse_a_negative_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = JobSpec(name="spares", nnodes=2, nproc_per_node=1, spare_nodes=1)
    monkeypatch.setattr(nvrx, "installed", lambda: nvrx.NVRx("0.4.1"))
    text = LocalBackend().render(spec)   # the legacy rendezvous: spares in its redundancy list
    assert text.count("ft_launcher ") == 3 and text.count("--nnodes=2 ") == 3 and "nvrx-control" not in text
    monkeypatch.setattr(nvrx, "installed", lambda: nvrx.NVRx("0.7.0"))
    text = LocalBackend().render(spec)   # NVRx's own standby nodes, its store host outside the launchers
    assert text.count("ft_launcher ") == 3 and text.count("nvrx-control ") == 1
    assert text.count("--nnodes=2:3 ") == 4 and text.count("--rdzv-conf=is_host=false") == 3
    with pytest.raises(SpecError, match="spare_nodes"):
        JobSpec(name="spares", spare_nodes=-1).validate()


@pytest.mark.parametrize("version, local, cluster", [
    ("0.4.1", None, "takes --nnodes 2:3 as an elastic range and would train on every spare"),
    ("0.5.0", "barrier rendezvous counts a hot spare against --nnodes", "counts a hot spare against"),
    ("0.6.0", None, None), ("0.7.0", None, None), ("0.7.0rc1", None, None)])
def test_each_release_runs_spares_where_it_can_and_a_spec_it_cannot_is_refused_in_one_line(
        version: str, local: str | None, cluster: str | None) -> None:
    """NVRx 0.4's spares work locally through the supervisor's handover; 0.6+ has its own standby nodes
    everywhere; 0.5's barrier rendezvous closes the job when a spare joins. The check a pod or a Slurm node
    runs (doctor) asks the same."""
    found = nvrx.NVRx(version)
    assert nvrx.supports_own_spares(version) == (nvrx.parse_version(version) >= (0, 6, 0))
    for backend, want in (("local", local), ("eks", cluster), ("slurm", cluster)):
        spec = JobSpec(name="s", backend=backend, nnodes=2, spare_nodes=1)
        refused = found.cannot_run(spec)
        assert (refused is None) == (want is None), (backend, refused)
        if refused is not None:
            line = str(refused)
            assert "\n" not in line and f"--spare-nodes 1: NVRx {version}" in line and want in line, line
            assert line.endswith("or --spare-nodes 0 (a lost node is then a job restart)"), line
            assert "nvidia-resiliency-ext>=0.6" in refused.fix
        assert found.cannot_run(spec.replace(spare_nodes=0)) is None
    if found.spares == "standby":   # the survivors of a lost node let the spare in: one node has none
        line = str(found.cannot_run(JobSpec(name="s", nnodes=1, spare_nodes=1)))
        assert line.startswith(f"--spare-nodes 1 with --nnodes 1: NVRx {version}'s standby nodes"), line
        assert line.endswith("use --nnodes 2 or more, or --spare-nodes 0 (a lost node is then a job restart)")


def test_a_local_job_with_spares_is_refused_before_anything_starts_where_nvrx_cannot_run_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvrx, "installed", lambda: nvrx.NVRx("0.5.0"))
    spec = JobSpec(name="spare-barrier", nnodes=2, nproc_per_node=1, spare_nodes=1).validate()
    with pytest.raises(JobError, match=r"^--spare-nodes 1: NVRx 0.5.0's barrier rendezvous") as e:
        LocalBackend().check(spec)
    assert "use NVRx >= 0.6" in e.value.fix
    assert not LocalBackend().jobs() or "spare-barrier" not in {j.name for j in LocalBackend().jobs()}


def test_the_launch_line_gives_spares_to_nvrx_s_standby_nodes_where_the_release_has_them() -> None:
    spec = JobSpec(name="j", nnodes=2, spare_nodes=2).validate()
    args = dict(node_rank=0, rdzv_host="h", ports=Ports.from_base(29500), rdzv_id="r")
    assert "--nnodes=2:4" in launcher_argv(spec, **args)   # a cluster's: checked where it runs
    assert "--nnodes=2:4" in launcher_argv(spec, **args, nvrx=nvrx.NVRx("0.7.0"))
    assert "--nnodes=2" in launcher_argv(spec, **args, nvrx=nvrx.NVRx("0.4.1"))
    assert "--nnodes=2" in launcher_argv(spec.replace(spare_nodes=0), **args)


def _rendezvous(store, rdzv_id: str, state) -> None:
    import base64
    import pickle

    store.set("torch.rendezvous." + rdzv_id, base64.b64encode(pickle.dumps(state)).decode())


def test_the_handover_expires_only_the_lost_launchers_keep_alive_and_refuses_a_foreign_state() -> None:
    """The supervisor's handover (NVRx 0.4's legacy rendezvous, in the store it hosts): the lost launcher's
    node gets an expired keep-alive, so every node's next sync drops it, and a spare waits for the next
    round; the others' keep-alives are untouched. A state naming anything but the rendezvous's own classes is
    refused, not run."""
    import base64
    import os
    import pickle
    from datetime import datetime

    from torch.distributed import TCPStore

    from eksft_nb.backends.local.handover import EXPIRED, HandoverError, expire
    from eksft_nb.nvrx import installed

    if installed().rendezvous != "legacy":
        pytest.skip("the handover is for NVRx 0.4's legacy rendezvous")
    from nvidia_resiliency_ext.fault_tolerance._ft_rendezvous import _NodeDesc, _RendezvousState

    from jobs import free_port

    store = TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    state = _RendezvousState()
    now = datetime.utcnow()
    lost, survivor, spare = (_NodeDesc("127.0.0.1", pid, 0) for pid in (101, 102, 103))
    state.participants = {lost: 1, survivor: 0}
    state.redundancy_list = {spare}
    state.last_heartbeats = {lost: now, survivor: now, spare: now}
    state.complete = True
    _rendezvous(store, "r1", state)
    assert expire(store, "r1", 101) == 1
    after = pickle.loads(base64.b64decode(store.get("torch.rendezvous.r1")))
    assert after.last_heartbeats == {lost: EXPIRED, survivor: now, spare: now}
    assert after.participants == {lost: 1, survivor: 0}   # NVRx's own sync drops it
    # the survivors' agents see it waiting
    assert after.redundancy_list == set() and after.wait_list == {spare}
    assert expire(store, "r1", 999) == 0 and expire(store, "no-such-run", 101) == 0

    class Evil:
        def __reduce__(self):
            return (os.getpid, ())

    _rendezvous(store, "r2", Evil())
    with pytest.raises(HandoverError, match="has no place in a rendezvous state"):
        expire(store, "r2", 101)


def test_the_handover_refuses_a_state_that_sets_a_class_s_attributes() -> None:
    """An allowed class named in the state and BUILT with slot state would have its attributes set in the
    supervisor (the Trust II attack on the checkpoint loader): refused, and the class is unchanged."""
    import base64

    from eksft_nb.backends.local.handover import RDZV_MODULE, HandoverError, _load
    from eksft_nb.nvrx import installed

    if installed().rendezvous != "legacy":
        pytest.skip("the handover is for NVRx 0.4's legacy rendezvous")
    from nvidia_resiliency_ext.fault_tolerance._ft_rendezvous import _NodeDesc

    # protocol 0: the class itself, then BUILD (None, {"marker": "owned"}): setattr on the class
    payload = b"c" + RDZV_MODULE.encode() + b"\n_NodeDesc\n(N(dS'marker'\nS'owned'\nstb."
    with pytest.raises(HandoverError, match="a class's attributes or slot state"):
        _load(base64.b64encode(payload))
    assert not hasattr(_NodeDesc, "marker")


@pytest.mark.parametrize("made_by", ["REDUCE", "NEWOBJ"])
@pytest.mark.parametrize("attr", ["_value_", "marker"])
def test_the_handover_cannot_change_an_nvrx_enum_member(made_by: str, attr: str) -> None:
    """Issue 34: the handover refused BUILD on a class but not on a shared object. A stored state that
    names NVRx's WorkerState.HEALTHY (by value, or through the enum's __new__) and BUILDs it would set the
    member's value or attributes in the supervisor: only objects made by the load itself are BUILT."""
    import base64

    from ckpt_craft import name, text
    from eksft_nb.backends.local.handover import WORKER_STATE, HandoverError, _load
    from eksft_nb.nvrx import installed

    if installed().rendezvous != "legacy":
        pytest.skip("the handover is for NVRx 0.4's legacy rendezvous")
    from nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.agent.server.api import WorkerState

    call = b"R" if made_by == "REDUCE" else b"\x81"   # WorkerState("HEALTHY"), WorkerState.__new__(...)
    member = name(WORKER_STATE, "WorkerState") + text("HEALTHY") + b"\x85" + call
    payload = b"\x80\x04" + member + b"}" + text(attr) + text("FAILED") + b"sb."   # BUILD {attr: "FAILED"}
    before = dict(vars(WorkerState.HEALTHY))
    try:
        with pytest.raises(HandoverError) as refused:
            _load(base64.b64encode(payload))
        assert "\n" not in str(refused.value)
        assert vars(WorkerState.HEALTHY) == before and WorkerState("HEALTHY") is WorkerState.HEALTHY
        assert WorkerState.HEALTHY.value == "HEALTHY" and not hasattr(WorkerState.HEALTHY, "marker")
    finally:  # on a handover that let it through: undo it, so that the other tests run in a sound process
        vars(WorkerState.HEALTHY).clear()
        vars(WorkerState.HEALTHY).update(before)
