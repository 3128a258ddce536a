"""torchft as an engine (``--engine torchft``): replica groups train on through a per-step quorum that
torchft's Lighthouse forms, and a group that was lost heals from a peer's live state instead of the job
restarting from a checkpoint.

- :mod:`.checks`: which specs and faults the engine takes (the command layer asks it once);
- :mod:`.lighthouse`: the Lighthouse's command line, on loopback;
- :mod:`.supervisor`: the local supervisor's torchft variant (the Lighthouse, one process per group);
- :mod:`.listen`: torchft's own servers on loopback in a local job;
- :mod:`.trainer`: the built-in trainer as torchft DDP, reporting through the one event schema;
- :mod:`.script`: a user's torchft script as a replica group, its Manager watched;
- :mod:`.startup`: at the job's start, every group waits for the others before its first quorum.
"""
