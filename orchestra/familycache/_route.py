"""Routing as a plan: what a FamilyCache request should do, decided from plain facts, no models.

`plan_route` reads what the pool holds for the request (cached prefixes on its member and on members
that can map into it), which builds are in flight, and the policy's `min_mapped_tokens`, and returns
one route: reuse an entry whole (`Exact`), compute the rest over a prefix (`Extend`), map another
member's prefix (`Map`), compute everything (`Prefill`), wait for a build in flight and plan again
(`Join`), or build the tokens on the source first and plan again (`Seed`: a cold request on a mapped
member then maps them, and so can every other member). The FamilyCache carries the route out in one place; keeping the decision pure lets tests
drive every branch with fake pool contents, and lets the cache plan and register its own build
under one lock (so concurrent requests see each other's builds: a cold burst over one document
prefills it once and maps it into the other members).

Entries and flights are opaque handles here (`Any`): the planner only reads the facts beside them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from orchestra.familycache._pool import common_prefix

__all__ = ["RouteRequest", "Held", "InFlight", "Exact", "Extend", "Map", "Prefill", "Join", "Seed", "Route",
           "plan_route"]


@dataclass(frozen=True)
class RouteRequest:
    """What is asked: these token ids on this member, and whether a mapped cache may serve them."""

    member: str
    ids: tuple[int, ...]
    allow_mapped: bool = True
    """False: only the member's own exact caches (`allow_mapped=False`, a gate forcing re-prefill, under 3 tokens)."""
    min_mapped_tokens: int = 64
    """A map (or a wait for a longer prefix) must reuse at least this many more tokens than the best exact prefix."""
    seed: str | None = None
    """A member (the source) to build a cold request's tokens on first, so that they are mapped (None: never)."""


@dataclass(frozen=True)
class Held:
    """A cached entry that shares `length` leading tokens with the request."""

    entry: Any
    member: str
    length: int
    mapped: bool = False
    """A mapped entry (of the request's member, usable: current mapping, same repair variant); never mapped again."""


@dataclass(frozen=True)
class InFlight:
    """A build in progress: `ids` on `member`, exact or mapped."""

    flight: Any
    member: str
    ids: tuple[int, ...]
    mapped: bool = False


@dataclass(frozen=True)
class Prefill:
    """Compute every token exactly on the member."""


@dataclass(frozen=True)
class Extend:
    """Compute ids[start:] on the member over `base` (an entry of the member holding the first `start` tokens).

    A mapped `base` makes the result a mapped cache (gated; refused, the member plans its own exact route)."""

    base: Any
    start: int
    mapped: bool = False


@dataclass(frozen=True)
class Exact:
    """Reuse `entry` whole: it holds every requested token on the member (a mapped one is gated first)."""

    entry: Any
    mapped: bool = False


@dataclass(frozen=True)
class Map:
    """Map the first `length` tokens of `source`'s exact `source_entry` into the member, then compute the rest."""

    source: str
    source_entry: Any
    length: int


@dataclass(frozen=True)
class Join:
    """Wait for `flight` (`tokens` ids on `member`), then plan again: it will hold a longer prefix."""

    flight: Any
    member: str
    tokens: int
    mapped: bool = False


@dataclass(frozen=True)
class Seed:
    """Build the request's tokens exactly on `source` (over `base`, its entry holding the first `start`), then plan again.

    Taken only when the member holds nothing of the request: the source's build is mapped into it, and
    into every other member that asks for the same document later, where a prefill of its own would
    serve this member alone."""

    source: str
    base: Any = None
    start: int = 0


Route = Exact | Extend | Map | Prefill | Join | Seed


def plan_route(request: RouteRequest, held: Sequence[Held], mappable: Collection[str],
               flights: Sequence[InFlight] = ()) -> Route:
    """The cheapest trustworthy route for `request`.

    `held`: cached entries sharing a prefix with the request: the member's exact and usable mapped
    entries, and exact entries of other members (only those in `mappable`, the members with a mapping
    into this one, count). `flights`: builds in progress. In order:

    1. an exact entry of the member holding every token: `Exact`;
    2. a build of exactly these tokens on the member (exact; or mapped, when mapped caches may serve):
       `Join` it (single-flight);
    3. a build on the member, or an exact build on a member that maps into it, sharing at least
       `min_mapped_tokens` more tokens than the best exact prefix: `Join` the longest, then plan again
       (a cold burst over one document builds it once: on other members it is then mapped);
    4. a usable mapped entry of the member, or a `mappable` member's exact entry, sharing at least
       `min_mapped_tokens` more tokens (and 3 or more): the longest (a mapped entry on ties): `Exact`
       or `Extend` over the mapped entry, or `Map` (refused by a gate, the caller plans again without maps);
    5. when `request.seed` maps into the member and would compute at most `min_mapped_tokens` more of the
       request than the member itself (whose own prefix is then a few shared header tokens, or nothing):
       `Seed` (build on the seed member first; the caller plans again, without seeding, and maps that build);
    6. else `Extend` the member's exact prefix, or `Prefill`.
    """
    n = len(request.ids)
    own = max((h for h in held if h.member == request.member and not h.mapped), key=lambda h: h.length, default=None)
    have = own.length if own is not None else 0
    if own is not None and have == n:
        return Exact(own.entry)
    exact_route: Extend | Prefill = Extend(own.entry, have) if own is not None else Prefill()
    mapped_ok = request.allow_mapped and n >= 3

    def joinable(f: InFlight) -> bool:
        if f.member == request.member:
            return not f.mapped or mapped_ok
        return mapped_ok and not f.mapped and f.member in mappable

    live = [f for f in flights if joinable(f)]
    same = [f for f in live if f.member == request.member and f.ids == request.ids]
    if same:  # exact builds before mapped ones: an exact cache never needs a gate
        f = min(same, key=lambda f: f.mapped)
        return Join(f.flight, f.member, len(f.ids), f.mapped)
    need = have + request.min_mapped_tokens
    best_flight, best_common = None, 0
    for f in live:
        common = common_prefix(f.ids, request.ids)
        if common >= need and common > best_common:
            best_flight, best_common = f, common
    if best_flight is not None:
        return Join(best_flight.flight, best_flight.member, len(best_flight.ids), best_flight.mapped)
    if mapped_ok:
        best: Held | None = None
        for h in held:
            if h.mapped and h.member == request.member:
                ok = h.length >= need
            elif not h.mapped and h.member != request.member and h.member in mappable:
                ok = h.length >= max(need, 3)
            else:
                continue  # the member's own exact entries are `own`; another member's mapped entries are never mapped
            if ok and (best is None or h.length > best.length or (h.length == best.length and h.mapped
                                                                   and not best.mapped)):
                best = h
        if best is not None and best.mapped:
            if best.length == n:
                return Exact(best.entry, mapped=True)
            return Extend(best.entry, best.length, mapped=True)
        if best is not None:
            return Map(best.member, best.entry, best.length)
        if request.seed is not None and request.seed in mappable and n >= max(3, need):
            start = max((h for h in held if h.member == request.seed and not h.mapped), key=lambda h: h.length,
                        default=None)
            begin = start.length if start else 0
            # Seed only when the source computes at most `min_mapped_tokens` more than the member would alone
            # (a chat template's few shared header tokens do not count as holding the document); its build is
            # then shared by every member it maps into.
            if begin + request.min_mapped_tokens >= have:
                return Seed(request.seed, start.entry if start else None, begin)
    return exact_route
