"""Which numbers of a numbered list to read, when a counter anyone can add to numbers it.

Error reports (`error/{n}`), agents' orders and exits and the spares' wake-ups are numbered by a
store counter (`add` cannot carry a MAC); the values themselves are sealed. A stranger's add
can move the counter far ahead: a reader that read every number up to it would make millions
of requests per look (a coordinator stalled in its tick). The job's own values are numbered
just after what a reader saw (written before the bump) or just below the counter (written
after it): so a reader reads at most `WINDOW` numbers after the last it saw and `WINDOW` up to
the counter, and remembers at most `WINDOW` numbers counted but not written yet. A counter below
what the reader saw was moved back (the job's own adds never lower it): a writer claims the first
empty number it is handed from there on (`SealedStore.append`), so the reader reads the `WINDOW`
numbers up to the counter, skipping those it read a value at before, and goes on from the
counter. No number below 1 is read. Pure.
"""

from __future__ import annotations

WINDOW = 64
"""Numbers read at each end of a gap, and numbers kept to read again."""


def numbers_to_read(seen: int, count: int, unread: set[int], window: int = WINDOW) -> list[int]:
    """The numbers to read now: those counted but not written at the last look (`unread`, the
    newest `window` of them) and the new ones after `seen` up to `count` - all of them, or the
    first and last `window` of a gap wider than that (a stranger's add in between); with the
    counter moved back below `seen`, the last `window` up to it. The reader's `seen` is then
    `count` (at least 0)."""
    if count < seen:
        fresh = set(range(count - window + 1, count + 1))
    elif count - seen > 2 * window:
        fresh = {*range(seen + 1, seen + 1 + window), *range(count - window + 1, count + 1)}
    else:
        fresh = set(range(seen + 1, count + 1))
    kept = sorted(unread)[-window:]
    return sorted(n for n in fresh | set(kept) if n >= 1)
