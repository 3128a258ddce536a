"""Hand a lost node's place to a hot spare at once, in NVRx's legacy rendezvous (0.4.x).

That rendezvous keeps a spare in its redundancy list while the round has ``max_nodes`` participants, and
drops a participant only once its keep-alive has expired: 3 beats of 5 s, fixed in 0.4.1 (no
``--rdzv-conf`` key sets them). Meanwhile the survivors wait (their ranks stuck on the lost peer until
the rank heartbeat timeout): a spare took 18-23 s where a job restart took 7. The supervisor hosts the
rendezvous store and sees a launcher die within a poll, so it edits the rendezvous state itself: the
lost launcher's keep-alive expired, and one spare moved from the redundancy list to the wait list (what
the spare would do itself once the lost node was gone, a second or two of its polling later). Every
node then applies NVRx's own rule on its next sync: the lost node leaves the round, and the survivors'
agents, seeing a node waiting, restart their workers into a new round with the spare.

The state is NVRx's pickled ``_RendezvousState`` under torch's ``torch.rendezvous.<run id>`` key; it is
read with an unpickler that builds only the classes such a state holds, and written back with the
store's compare-and-set, so a launcher's concurrent write is never lost.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from datetime import datetime
from typing import Any

RDZV_MODULE = "nvidia_resiliency_ext.fault_tolerance._ft_rendezvous"
# what a pickled rendezvous state may name: its own classes, the workers' state enum, timestamps
_ALLOWED = {(RDZV_MODULE, "_RendezvousState"), (RDZV_MODULE, "_NodeDesc"),
            ("nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.agent.server.api", "WorkerState"),
            ("datetime", "datetime")}
_NULL_SENTINEL = b"Y2FuaW1hZGFt"   # torch's C10dRendezvousBackend: no state written yet
EXPIRED = datetime(1970, 1, 1)     # a keep-alive older than any expiry window
TRIES = 20


class HandoverError(Exception):
    """The rendezvous state could not be read or written: the spare comes in by NVRx's own expiry."""


class _StateUnpickler(pickle._Unpickler):  # the Python unpickler: its BUILD can be checked
    """Names only the classes a rendezvous state holds; BUILD sets only an instance's own fields, never
    a class's attributes or slot state (which would change those classes in the supervisor)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} has no place in a rendezvous state")
        return super().find_class(module, name)

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if isinstance(inst, type) or type(state) is not dict:
            raise pickle.UnpicklingError("it sets a class's attributes or slot state, which a rendezvous "
                                         "state never does")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def _load(raw: bytes) -> Any:
    try:
        return _StateUnpickler(io.BytesIO(base64.b64decode(raw, validate=True))).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError,
            ValueError) as e:
        raise HandoverError(f"the rendezvous state is unreadable ({type(e).__name__}: {e})") from e


def expire(store: Any, rdzv_id: str, launcher_pid: int) -> int:
    """Mark the rendezvous nodes of the ft_launcher ``launcher_pid`` (a node descriptor carries its
    launcher's pid) as expired in ``store``'s rendezvous ``rdzv_id`` and, if one was a participant, move a
    spare to the wait list. Returns how many were marked (0: it held no place, or the state is not the
    legacy rendezvous's)."""
    key = "torch.rendezvous." + rdzv_id
    for _ in range(TRIES):
        try:
            if not store.check([key]):   # get() would wait for it
                return 0
            raw = store.get(key)
        except (RuntimeError, ValueError) as e:   # torch's store errors (a timeout is a RuntimeError)
            raise HandoverError(f"the rendezvous store did not answer ({e})") from e
        if raw == _NULL_SENTINEL:
            return 0
        state = _load(raw)
        beats = getattr(state, "last_heartbeats", None)
        if not isinstance(beats, dict):
            return 0
        lost = [n for n in beats if getattr(n, "pid", None) == launcher_pid]
        if not lost:
            return 0
        for node in lost:
            beats[node] = EXPIRED
        spares = getattr(state, "redundancy_list", None)
        waiting = getattr(state, "wait_list", None)
        if (isinstance(spares, set) and isinstance(waiting, set) and spares
                and any(n in getattr(state, "participants", {}) for n in lost)):
            spare = min(spares, key=repr)
            spares.discard(spare)
            waiting.add(spare)
        new = base64.b64encode(pickle.dumps(state)).decode()
        try:
            written = store.compare_set(key, raw.decode(), new)
        except (RuntimeError, ValueError) as e:
            raise HandoverError(f"the rendezvous store did not answer ({e})") from e
        if written == new.encode():
            return len(lost)
    raise HandoverError(f"the rendezvous state kept changing under {TRIES} attempts to write it")
