"""A real Slurm on this machine: Debian's slurm-wlm controller and two node daemons (`make test` installs
it), each on a free port, every file in a temporary folder, stopped by pid afterwards; a third node with two
fake GPUs in its gres.conf stands alone in a partition of its own.

No munge (``auth/none``), both "nodes" this host: the job folder on ``shared/`` is a shared disk for
free, and the first node of an allocation is found the cluster way (``scontrol show hostnames``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from eksft_nb import loopback
from jobs import free_port


def node_names(count: int = 2) -> tuple[str, ...] | None:
    """The nodes' names: the first node of an allocation is reached by its name, so the first is this
    host's name (containers and CI runners resolve it to loopback), the others sort after it."""
    host = socket.gethostname()
    try:
        ok = host != "localhost" and socket.gethostbyname(host).startswith("127.")
    except OSError:
        ok = False
    return (host, *(f"{host}-{i}" for i in range(2, count + 1))) if ok else None


@dataclass
class SlurmCluster:
    dir: Path
    shared: Path          # the "shared filesystem": the jobs' folders
    env: dict[str, str]   # SLURM_CONF, a PATH that finds this environment's python and ft_launcher

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, env=self.env,
                              check=check)

    def job_processes(self, job_id: str, node: str) -> list[psutil.Process]:
        """What job ``job_id`` runs on ``node`` (its batch script, launcher and ranks there): every process
        whose environment names the job and the node."""
        marks = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURMD_NODENAME={node}".encode()}
        found = []
        for p in psutil.process_iter():
            try:
                if marks <= set(Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0")):
                    found.append(p)
            except (OSError, psutil.Error):
                continue
        return found

    def idle_nodes(self) -> int:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
        return sum(1 for state in out[1::2] if state == "idle")


def free_base() -> int:
    """A port free with the two after it (the rendezvous and the trainer's two stores)."""
    return free_port(3)


GPU_NODE = "localhost"   # a third node, with two fake GPUs in gres.conf, alone in partition GPU_PARTITION
GPU_PARTITION = "gpus"
SECOND_PARTITION = "second"   # the second node alone: its name need not resolve (an allocation's first node)


def config(d: Path, ports: list[int], names: tuple[str, ...]) -> str:
    """A requeued job may start ``cred_expire`` s after its requeue (Slurm's rule), and only the main
    scheduler's periodic pass starts it then (the backfill's skips a pass when no job or node changed): that
    pass runs every second, not every 60 s (which added up to a minute to each requeue of the tests).
    KillWait is low (SIGKILL 5 s after SIGTERM), so a save that does not start before the end is killed."""
    ctld, slurmd, *node_ports = ports
    # the GPU node is named localhost (a name every host resolves: the rendezvous of its jobs is there), and
    # slurmctld refuses a node name that is another node's host name: each node's host name is its own name
    nodes = "\n".join(f"NodeName={n} NodeHostname={n} NodeAddr=127.0.0.1 Port={p} CPUs=2 RealMemory=4000 "
                      "State=UNKNOWN" + (" Gres=gpu:2" if n == GPU_NODE else "")
                      for n, p in zip((*names, GPU_NODE), node_ports))
    return f"""ClusterName=eksft
SlurmctldHost=localhost
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool%n
SlurmctldPidFile={d}/ctld.pid
SlurmdPidFile={d}/d%n.pid
SlurmctldLogFile={d}/log/ctld.log
SlurmdLogFile={d}/log/d%n.log
SlurmctldPort={ctld}
SlurmdPort={slurmd}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
ReturnToService=2
MpiDefault=none
KillWait=5
MinJobAge=600
AuthInfo=cred_expire=10
GresTypes=gpu
{nodes}
PartitionName=gpu Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName={GPU_PARTITION} Nodes={GPU_NODE} MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName={SECOND_PARTITION} Nodes={names[1]} MaxTime=INFINITE State=UP OverSubscribe=NO
"""


def gres(d: Path) -> str:
    """The GPU node's two GPUs: files that stand for devices (slurmd 22.05 logs that they are no character
    devices, and counts them)."""
    for i in range(2):
        (d / f"fake-gpu{i}").touch()
    return f"AutoDetect=off\nNodeName={GPU_NODE} Name=gpu File={d}/fake-gpu[0-1]\n"


@contextmanager
def slurm_cluster(base: Path, nodes: int = 2) -> Iterator[SlurmCluster]:
    """Start slurmctld and ``nodes`` slurmd in ``base``; on exit cancel every job, wait for them to end and
    stop the daemons by pid."""
    import pytest

    if shutil.which("slurmctld") is None or os.geteuid() != 0:
        pytest.skip("needs Debian's slurm-wlm (`make slurm`) and root (the daemons run as root, "
                    "without munge)")
    names = node_names(nodes)
    if names is None:
        pytest.skip("needs a host name that resolves to loopback (the second node's name; see /etc/hosts)")
    d = base / "slurm"
    for sub in ("state", "log"):
        (d / sub).mkdir(parents=True)
    conf = d / "slurm.conf"
    ports = loopback.free_ports(3 + len(names))   # slurmctld, slurmd, the GPU node, the nodes
    conf.write_text(config(d, ports, names))
    (d / "gres.conf").write_text(gres(d))
    shared = base / "shared"
    shared.mkdir()
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    daemons = [subprocess.Popen(["slurmctld", "-D", "-c", "-f", str(conf)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    cluster = SlurmCluster(d, shared, env)
    try:
        for node in (*names, GPU_NODE):
            daemons.append(subprocess.Popen(["slurmd", "-D", "-N", node, "-f", str(conf)], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 60
        while cluster.idle_nodes() < len(names) + 1:
            dead = [p.args[0] for p in daemons if p.poll() is not None]
            assert not dead and time.time() < deadline, \
                f"Slurm did not come up ({dead} exited); see {d / 'log'}"
            time.sleep(0.3)
        yield cluster
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True, timeout=30)
        deadline = time.time() + 60
        while time.time() < deadline and daemons[0].poll() is None and subprocess.run(
                ["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30).stdout.strip():
            time.sleep(0.3)
        for p in reversed(daemons):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in daemons:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        _kill_left(conf)


def _kill_left(conf: Path) -> None:
    """End what the daemons left (a step on a node set down keeps its slurmstepd and ranks): every
    process whose environment names this cluster's slurm.conf (this test process's does not)."""
    mark = f"SLURM_CONF={conf}".encode()
    left = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and mark in Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0"):
                left.append(p)
        except (OSError, psutil.Error):
            continue
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=10)
