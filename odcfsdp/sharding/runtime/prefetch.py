"""Which groups to gather ahead of a hook site: the order sites ran in, replayed.

Design note [prefetch]
----------------------
The first forward records the hook sites (tuples of groups) in the order they run.
From then on, when site i starts, ``targets(i, backward)`` names the groups of the
next ``depth`` sites in forward order (i+1, i+2, ...) or, in backward, in reverse
(i-1, i-2, ...), skipping groups already counted (a site whose groups are all in
hand does not use up the depth: two norms in one group are one step ahead, not
two). A site first seen after the first forward (a module called only sometimes)
has no position and prefetches nothing.

A site may be given its own targets instead (``set_explicit``: FSDP2's
``set_modules_to_forward_prefetch`` / ``_backward_prefetch``), one list per direction; they
replace the recorded order's for that site and direction.
"""

from __future__ import annotations

from typing import Hashable, Sequence


class PrefetchSchedule:
    """The recorded order of hook sites and the groups ``depth`` sites ahead of each.

    Args:
        depth: how many sites ahead to gather (0: no prefetch).
    """

    def __init__(self, depth: int):
        self.depth = depth
        self.sites: list[tuple] = []  # each site's groups, in the order the first forward ran them
        self.position: dict[tuple, int] = {}  # a site's place in that order (looked up on every hook call)
        self.recorded = False
        self.explicit: dict[tuple[tuple, bool], list] = {}  # (site, backward) -> groups to gather ahead

    def set_explicit(self, site: tuple, groups: Sequence[Hashable], backward: bool) -> None:
        """Gather ``groups`` ahead when ``site`` starts (in backward if ``backward``), instead of the recorded
        order's next sites."""
        self.explicit[(tuple(site), backward)] = list(dict.fromkeys(g for g in groups if g not in site))

    def record(self, site: tuple) -> int | None:
        """Note that ``site`` ran (while recording); return its position (None if unknown)."""
        pos = self.position.get(site)
        if pos is None and not self.recorded:
            pos = self.position[site] = len(self.sites)
            self.sites.append(site)
        return pos

    def finish_recording(self) -> None:
        """The first forward is over: the order is fixed from now on."""
        self.recorded = True

    def targets(self, site: Sequence[Hashable], backward: bool) -> list:
        """Groups of the next ``depth`` sites after ``site`` (before it in backward), ``site``'s own excluded."""
        explicit = self.explicit.get((tuple(site), backward))
        if explicit is not None:
            return explicit
        pos = self.position.get(tuple(site))
        if not self.recorded or not self.depth or pos is None:
            return []
        seen, ahead, out = set(site), 0, []
        for i in range(pos - 1, -1, -1) if backward else range(pos + 1, len(self.sites)):
            new = [g for g in self.sites[i] if g not in seen]
            if not new:  # a site using only groups already counted (e.g. the next norm in the same group)
                continue
            out += new
            seen.update(new)
            ahead += 1
            if ahead == self.depth:
                break
        return out
