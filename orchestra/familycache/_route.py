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
    own = _longest_exact(held, request.member)
    have = own.length if own is not None else 0
    if own is not None and have == n:
        return Exact(own.entry)
    exact_route: Extend | Prefill = Extend(own.entry, have) if own is not None else Prefill()
    facts = _Facts(request, held, mappable, have=have, mapped_ok=request.allow_mapped and n >= 3)
    route: Route | None = _join_route(facts, flights)
    if route is None and facts.mapped_ok:
        route = _mapped_route(facts)
        if route is None:
            route = _seed_route(facts)
    return exact_route if route is None else route


@dataclass(frozen=True)
class _Facts:
    """What the steps of a plan read: the request, what the pool holds, and what the member holds itself."""

    request: RouteRequest
    held: Sequence[Held]
    mappable: Collection[str]
    have: int
    """Leading tokens of the request the member's own longest exact entry holds (0: none)."""
    mapped_ok: bool
    """Whether a mapped cache may serve the request at all."""

    @property
    def need(self) -> int:
        """Tokens a map (or a wait for a longer prefix) must reach to be worth it."""
        return self.have + self.request.min_mapped_tokens


def _longest_exact(held: Sequence[Held], member: str) -> Held | None:
    """The exact (unmapped) entry of `member` sharing the most tokens with the request, or None."""
    return max((h for h in held if h.member == member and not h.mapped), key=lambda h: h.length, default=None)


def _joinable(facts: _Facts, f: InFlight) -> bool:
    """Whether the request may wait for build `f`: the member's own, or an exact one of a member mapping into it."""
    request = facts.request
    if f.member == request.member:
        return not f.mapped or facts.mapped_ok
    return facts.mapped_ok and not f.mapped and f.member in facts.mappable


def _join_route(facts: _Facts, flights: Sequence[InFlight]) -> Join | None:
    """Steps 2 and 3 of `plan_route`: `Join` a build of these very tokens, else of the longest prefix worth it."""
    request = facts.request
    live = [f for f in flights if _joinable(facts, f)]
    same = [f for f in live if f.member == request.member and f.ids == request.ids]
    if same:  # exact builds before mapped ones: an exact cache never needs a gate
        f = min(same, key=lambda f: f.mapped)
        return Join(f.flight, f.member, len(f.ids), f.mapped)
    best_flight, best_common = None, 0
    for f in live:
        common = common_prefix(f.ids, request.ids)
        if common >= facts.need and common > best_common:
            best_flight, best_common = f, common
    if best_flight is not None:
        return Join(best_flight.flight, best_flight.member, len(best_flight.ids), best_flight.mapped)
    return None


def _mapped_route(facts: _Facts) -> Exact | Extend | Map | None:
    """Step 4 of `plan_route`: reuse or extend the member's best mapped entry, or map another member's exact one."""
    best = _best_mappable(facts)
    if best is None:
        return None
    if best.mapped:
        if best.length == len(facts.request.ids):
            return Exact(best.entry, mapped=True)
        return Extend(best.entry, best.length, mapped=True)
    return Map(best.member, best.entry, best.length)


def _best_mappable(facts: _Facts) -> Held | None:
    """The longest mapped entry of the member or exact entry of a `mappable` member sharing enough tokens
    (a mapped entry on ties), or None."""
    request, need = facts.request, facts.need
    best: Held | None = None
    for h in facts.held:
        if h.mapped and h.member == request.member:
            ok = h.length >= need
        elif not h.mapped and h.member != request.member and h.member in facts.mappable:
            ok = h.length >= max(need, 3)
        else:
            continue  # the member's own exact entries are `own`; another member's mapped entries are never mapped
        if ok and (best is None or h.length > best.length or (h.length == best.length and h.mapped
                                                               and not best.mapped)):
            best = h
    return best


def _seed_route(facts: _Facts) -> Seed | None:
    """Step 5 of `plan_route`: `Seed` the request's tokens on the source when that costs about what the member's
    own prefill would."""
    request = facts.request
    if request.seed is None or request.seed not in facts.mappable or len(request.ids) < max(3, facts.need):
        return None
    start = _longest_exact(facts.held, request.seed)
    begin = start.length if start else 0
    # Seed only when the source computes at most `min_mapped_tokens` more than the member would alone
    # (a chat template's few shared header tokens do not count as holding the document); its build is
    # then shared by every member it maps into.
    if begin + request.min_mapped_tokens >= facts.have:
        return Seed(request.seed, start.entry if start else None, begin)
    return None
