"""The batches a replica group skipped when it heals from a peer: those of its ranks that no committed step
holds, the count its ``heal`` event carries, so that the heals of a job add up to what its committed steps
lacked (:func:`eksft_nb.goodput.missing_batches`) and a fault's row in ``compare`` says what it cost.

Three things make that more than the steps it was behind: a step it threw away after its gradients were
all-reduced is committed by its peers with its batch (nothing skipped there); under torchft's async quorum (a
script's Manager by default) a healing group takes no part in the step it heals in (torchft zeroes its
gradients), so that step lacks its batch too; and each rank of the group (HSDP) has a batch of its own.

A restarted group knows the step it trained to only as the job's last step when its loss was seen (on EKS,
its beacon's): steps a peer committed alone before that are in the job's total, not in this count. The
tests pace the peer (seconds a step) so that none do; that case is reasoned, not measured.
"""

from __future__ import annotations


def skipped_batches(trained: int, healed_to: int, *, ranks: int, shared: int | None,
                    async_quorum: bool) -> int:
    """``trained``: the last step the group trained into the job's state; ``healed_to``: the peer's step it
    took; ``ranks``: the group's ranks; ``shared``: a step it threw away after its gradients went out (None:
    none); ``async_quorum``: whether it heals while the quorum trains the next step without it."""
    steps = max(0, healed_to - trained)
    if shared is not None and trained < shared <= healed_to:
        steps -= 1
    return (steps + (1 if async_quorum else 0)) * ranks
