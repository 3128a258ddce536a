"""A process that follows an EKS job exits cleanly whenever the cluster answers.

The stream's threads are daemons. One that wakes while Python shuts down is ended by the interpreter
(``pthread_exit``), which unwinds its C stack; a stack that runs through compiled Rust code (the kubernetes
client's generated methods validate their arguments in pydantic-core) cannot be unwound and the process
aborts (SIGABRT, exit -6, nothing on stderr): CI saw ``stop --backend eks`` do so after printing that the
job stopped. Here the answers the threads wait for arrive exactly while the child shuts down.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

CHILD = textwrap.dedent("""
    import os, sys, time
    from kubernetes import client
    from eksft_nb.backends.eks.cluster import Cluster
    from eksft_nb.backends.eks.stream import EksEvents
    from eksft_nb.spec import JobSpec

    cfg = client.Configuration()
    cfg.host, cfg.retries = sys.argv[1], False
    spec = JobSpec(name="demo", backend="eks", nnodes=2, nproc_per_node=1, steps=10).replace(
        **{"eks.image": "img:1", "eks.gpus_per_node": 0})
    events = EksEvents(Cluster(client.ApiClient(cfg), "default"), spec, time.time(), poll_s=60.0)
    events.read()   # starts the pod watch and the workload poll: both now wait for the server
    sys.stdin.readline()   # the server holds both requests


    class Finalizing:
        # deleted as Python clears this module, well into its shutdown: the answers arrive meanwhile
        def __del__(self, write=os.write, sleep=time.sleep):
            write(1, b"finalizing\\n")
            sleep(3.0)


    held = Finalizing()
""")


class HeldServer:
    """Accepts HTTP requests and answers none of them until :meth:`answer`; then each gets a 200 with one
    pod event (what a watch would send) and the connection closes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.paths: list[str] = []
        self.held = threading.Condition()
        self.release = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                request += chunk
            with self.held:
                self.paths.append(request.split(b" ")[1].decode())
                self.held.notify_all()
            self.release.wait(60)
            body = b'{"type":"ADDED","object":{"metadata":{"name":"demo-0-x","uid":"u0"},"status":{}}}\n'
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def wait_for(self, count: int, timeout: float) -> list[str]:
        with self.held:
            assert self.held.wait_for(lambda: len(self.paths) >= count, timeout), self.paths
            return list(self.paths)

    def close(self) -> None:
        self.release.set()
        self.sock.close()


def test_a_following_process_exits_cleanly_when_the_answers_come_as_it_shuts_down(tmp_path: Path) -> None:
    server = HeldServer()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, server.url], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        paths = server.wait_for(2, timeout=60)
        assert any("watch=true" in p for p in paths) and any(p.endswith("/jobs/demo") for p in paths), paths
        child.stdin.write("go\n")
        child.stdin.close()
        assert child.stdout.readline() == "finalizing\n"
        server.release.set()   # both threads wake while the interpreter is shutting down
        assert child.wait(timeout=60) == 0, child.stderr.read()[-3000:]
    finally:
        child.kill()
        server.close()
