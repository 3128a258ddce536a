"""Hot spares (``--spare-nodes``): the extra launchers and pods a job gets, as rendered. The spare
taking a lost node's place in a real job is tested in test_engine.py."""

from __future__ import annotations

import pytest
import yaml
from test_eks_render import eks_spec

from eksft_nb import commands
from eksft_nb.backends.eks import EksBackend, schemas
from eksft_nb.backends.local import LocalBackend
from eksft_nb.errors import SpecError
from eksft_nb.spec import JobSpec
from jobs import cli
from test_engine import NVRX_06


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
    assert "--nnodes=2" in args   # the third pod waits in the rendezvous's redundancy list


def test_pytorchjobs_refuse_spares_in_one_line() -> None:
    with pytest.raises(SpecError) as err:
        # the command layer's one check
        commands.dry_run(eks_spec(nnodes=2, kind="pytorchjob", spare_nodes=1))
    assert "\n" not in str(err.value) and "use --kind job (or jobset) for hot spares" in str(err.value)


def test_local_jobs_start_a_launcher_per_spare_and_refuse_a_negative_count() -> None:
    text = LocalBackend().render(JobSpec(name="spares", nnodes=2, nproc_per_node=1, spare_nodes=1))
    assert text.count("ft_launcher ") == 3 and text.count("--nnodes=2 ") == 3
    with pytest.raises(SpecError, match="spare_nodes"):
        JobSpec(name="spares", spare_nodes=-1).validate()


def test_a_local_job_with_spares_is_refused_in_one_line_where_nvrx_has_the_barrier_rendezvous() -> None:
    """NVRx 0.6's barrier rendezvous counts a spare against --nnodes and closes the job when it joins (the
    job then fails after its restarts): refused before anything starts, with what to do instead."""
    if not (NVRX_06 / "nvidia_resiliency_ext").is_dir():
        pytest.skip(f"NVRx 0.6.0 is not installed in {NVRX_06} (`make setup` installs it)")
    proc = cli("run", "--name", "spare-barrier", "--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes",
               "1",
               nvrx=NVRX_06)
    assert proc.returncode != 0
    [line] = proc.stderr.strip().splitlines()
    assert ("--spare-nodes 1: NVRx 0.6.0's barrier rendezvous counts a hot spare against --nnodes"
            in line), line
    assert "use --spare-nodes 0" in line, line
    assert "spare-barrier" not in cli("list").stdout   # nothing was started or saved


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
