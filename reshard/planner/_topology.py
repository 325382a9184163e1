"""`Topology`: which ranks share an NVLink domain."""

from __future__ import annotations

from typing import Hashable, Mapping


class Topology:
    """The rank -> NVLink-domain map. Traffic between domains crosses the network.

    Args:
        domain_size: ranks `r // domain_size` share a domain (8 for a DGX H100 node, 72 for a GB200 NVL72 rack).
        domain_of: an explicit rank -> domain mapping (domain ids are any hashable, compared for equality).
            Every rank a plan touches must be in it.

    With neither, every rank is its own domain: nothing is NVLink, every inter-rank byte is network.

    Example:
        >>> t = Topology(domain_size=4)
        >>> t.domain(5), t.same_domain(4, 7), t.same_domain(3, 4)
        (1, True, False)
    """

    __slots__ = ("domain_size", "domain_of", "key")

    def __init__(self, domain_size: int | None = None, domain_of: Mapping[int, Hashable] | None = None) -> None:
        if domain_size is not None and domain_of is not None:
            raise ValueError("Topology: give domain_size or domain_of, not both")
        if domain_size is not None:
            if isinstance(domain_size, bool) or not isinstance(domain_size, int) or domain_size < 1:
                raise ValueError(f"Topology: domain_size must be a positive integer, got {domain_size!r}")
        self.domain_size = domain_size
        self.domain_of = dict(domain_of) if domain_of is not None else None
        if self.domain_of is not None:
            for r in self.domain_of:
                if isinstance(r, bool) or not isinstance(r, int):
                    raise ValueError(f"Topology: domain_of keys must be integer ranks, got {r!r}")
            self.key: tuple = ("map", tuple(sorted((r, repr(d)) for r, d in self.domain_of.items())))
        else:
            self.key = ("size", domain_size)

    def domain(self, rank: int) -> Hashable:
        """The domain id of `rank`."""
        if self.domain_size is not None:
            return rank // self.domain_size
        if self.domain_of is not None:
            try:
                return self.domain_of[rank]
            except KeyError:
                raise ValueError(
                    f"Topology: rank {rank} has no domain in domain_of (it maps ranks {sorted(self.domain_of)})"
                ) from None
        return ("rank", rank)

    def same_domain(self, a: int, b: int) -> bool:
        return self.domain(a) == self.domain(b)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        if self.domain_size is not None:
            return f"Topology(domain_size={self.domain_size})"
        if self.domain_of is not None:
            return f"Topology(domain_of={{{len(self.domain_of)} ranks}})"
        return "Topology(every rank its own domain)"
