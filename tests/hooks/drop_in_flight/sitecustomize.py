"""Test-only hook: every Python process with this directory on its PYTHONPATH forgets the
replication round that was in flight when a failure struck, as if the failure had cut its
transfers, so the recovery restores one round further back and recomputes a step.

Used by tests/test_megatron_lm.py to exercise recomputation in Megatron-LM's loop (whether a
real failure leaves the in-flight round incomplete depends on timing). Nothing in
`megatron_deadpool` knows about it.
"""

from megatron_deadpool.replication import replicator

_abandon = replicator.Replicator.abandon


def _drop_in_flight(self: replicator.Replicator) -> list[int]:
    in_flight = self._round
    _abandon(self)
    if in_flight is not None:
        for pair in [self.local, *self.held.values()]:
            pair.verified = [None if it == in_flight else it for it in pair.verified]
    return []


replicator.Replicator.abandon = _drop_in_flight
