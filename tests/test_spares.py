"""Hot spares (``--spare-nodes``): the extra launchers and pods a job gets, as rendered. The spare
taking a lost node's place in a real job is tested in test_engine.py."""

from __future__ import annotations

import pytest
import yaml
from test_eks_render import eks_spec

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
        EksBackend().render(eks_spec(nnodes=2, kind="pytorchjob", spare_nodes=1))
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
    proc = cli("run", "--name", "spare-barrier", "--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "1",
               nvrx=NVRX_06)
    assert proc.returncode != 0
    [line] = proc.stderr.strip().splitlines()
    assert "--spare-nodes 1: NVRx 0.6.0's barrier rendezvous counts a hot spare against --nnodes" in line, line
    assert "use --spare-nodes 0" in line, line
    assert "spare-barrier" not in cli("list").stdout   # nothing was started or saved
