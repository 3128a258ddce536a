"""torchft as an engine (``--engine torchft``): replica groups train on through a per-step quorum that
torchft's Lighthouse forms, and a group that was lost heals from a peer's live state instead of the job
restarting from a checkpoint.

- :mod:`.checks`: which specs and faults the engine takes (the command layer asks it once);
- :mod:`.lighthouse`: the Lighthouse's command line: torchft's Lighthouse behind its :mod:`.gateway`, which
  answers only the job's processes, on a network of its own (:mod:`.netns`);
- the job's trust: its secret (:mod:`.secret`), the channel every server speaks (:mod:`.wire`), a group's
  coordination service in place of torchft's manager server (:mod:`.coordination`: a quorum with a stranger
  in it is refused), the checkpoint transport a group heals through (:mod:`.transport`, the state as data:
  :mod:`.codec`), all put in place in a group's process by :mod:`.listen`, refusals said by :mod:`.alarm`;
- :mod:`.losses`: a group lost, then healed, as ``failure`` and ``restart`` events (every backend's);
- :mod:`.hosts`: where a job's servers listen, per backend (loopback locally, the pod's or node's address
  on a cluster); :mod:`.listen` puts a group's servers there alone;
- each backend runs its own: :mod:`eksft_nb.backends.local.torchft` (the local supervisor's torchft
  variant: the Lighthouse, and each group's processes, one per rank), :mod:`eksft_nb.backends.eks.torchft`,
  :mod:`eksft_nb.backends.slurm.torchft` (what the clusters render);
- :mod:`.trainer`: the built-in trainer as torchft DDP, or HSDP with N ranks per group (:mod:`.hsdp`:
  FSDP inside a group, torchft across groups), reporting through the one event schema;
- :mod:`.script`: a user's torchft script as a replica group, its Manager watched;
- :mod:`.startup`: at the job's start, every group waits for the others before its first quorum.
"""
