"""plan_route over fake pool contents: which route a request gets, with no models and no tensors."""

from __future__ import annotations

from orchestra.familycache._route import (
    Exact,
    Extend,
    Held,
    InFlight,
    Join,
    Map,
    Prefill,
    RouteRequest,
    Seed,
    plan_route,
)

DOC = tuple(range(100, 300))  # a 200-token document
ASK = DOC + (7, 8, 9)


def _req(member: str = "child", ids: tuple[int, ...] = ASK, **kw) -> RouteRequest:
    return RouteRequest(member, ids, min_mapped_tokens=kw.pop("min_mapped_tokens", 16), **kw)


def test_an_entry_holding_every_token_is_an_exact_hit():
    assert plan_route(_req(), [Held("e1", "child", len(ASK))], mappable={"base"}) == Exact("e1")


def test_a_partial_prefix_on_the_member_is_extended():
    assert plan_route(_req(), [Held("e1", "child", 50)], mappable=()) == Extend("e1", 50)


def test_nothing_cached_anywhere_is_a_prefill():
    assert plan_route(_req(), [], mappable={"base"}) == Prefill()


def test_a_longer_prefix_on_a_member_with_a_mapping_is_mapped():
    held = [Held("own", "child", 20), Held("src", "base", len(DOC))]
    assert plan_route(_req(), held, mappable={"base"}) == Map("base", "src", len(DOC))


def test_without_a_mapping_the_member_extends_its_own_prefix_or_prefills():
    assert plan_route(_req(), [Held("own", "child", 20), Held("src", "base", len(DOC))], mappable=()) == Extend("own", 20)
    assert plan_route(_req(), [Held("src", "base", len(DOC))], mappable={"other"}) == Prefill()


def test_a_map_must_reuse_min_mapped_tokens_more_than_the_exact_prefix():
    held = [Held("own", "child", 150), Held("src", "base", 180)]
    assert plan_route(_req(min_mapped_tokens=64), held, mappable={"base"}) == Extend("own", 150)
    assert plan_route(_req(min_mapped_tokens=30), held, mappable={"base"}) == Map("base", "src", 180)


def test_maps_are_off_when_the_request_forbids_them():
    held = [Held("src", "base", len(DOC))]
    assert plan_route(_req(allow_mapped=False), held, mappable={"base"}) == Prefill()


def test_a_mapped_entry_of_the_member_is_reused_never_another_members_mapped_entry():
    mine = Held("m1", "child", len(DOC), mapped=True)
    assert plan_route(_req(), [mine], mappable={"base"}) == Extend("m1", len(DOC), mapped=True)
    assert plan_route(_req(ids=DOC), [mine], mappable={"base"}) == Exact("m1", mapped=True)
    # a map of a map would compound the error: base's mapped entry is not a source, even with a mapping
    theirs = Held("m2", "base", len(DOC), mapped=True)
    assert plan_route(_req(), [theirs], mappable={"base"}) == Prefill()


def test_a_mapped_entry_wins_a_tie_with_a_fresh_map():
    held = [Held("src", "base", len(DOC)), Held("m1", "child", len(DOC), mapped=True)]
    assert plan_route(_req(), held, mappable={"base"}) == Extend("m1", len(DOC), mapped=True)


def test_a_build_of_the_same_tokens_on_the_member_is_joined():
    flight = InFlight("f", "child", ASK)
    assert plan_route(_req(), [], mappable=(), flights=[flight]) == Join("f", "child", len(ASK))


def test_a_longer_prefix_in_flight_on_the_member_is_waited_for():
    flight = InFlight("f", "child", DOC + (1, 2))
    assert plan_route(_req(), [Held("own", "child", 10)], mappable=(), flights=[flight]) == Join("f", "child", len(DOC) + 2)


def test_a_build_on_another_member_with_a_mapping_is_waited_for_then_mapped():
    flight = InFlight("f", "base", DOC)
    assert plan_route(_req(), [], mappable={"base"}, flights=[flight]) == Join("f", "base", len(DOC))
    # once it landed, the plan is a map of what it built
    assert plan_route(_req(), [Held("src", "base", len(DOC))], mappable={"base"}) == Map("base", "src", len(DOC))


def test_a_build_on_a_member_without_a_mapping_is_not_waited_for():
    flight = InFlight("f", "base", DOC)
    assert plan_route(_req(), [], mappable=(), flights=[flight]) == Prefill()
    assert plan_route(_req(allow_mapped=False), [], mappable={"base"}, flights=[flight]) == Prefill()


def test_a_mapped_build_on_another_member_is_never_a_source():
    flight = InFlight("f", "base", DOC, mapped=True)
    assert plan_route(_req(), [], mappable={"base"}, flights=[flight]) == Prefill()


def test_a_build_sharing_too_short_a_prefix_is_not_waited_for():
    flight = InFlight("f", "base", DOC[:40])
    held = [Held("own", "child", 30)]
    assert plan_route(_req(min_mapped_tokens=16), held, mappable={"base"}, flights=[flight]) == Extend("own", 30)


def test_a_full_exact_hit_beats_any_build_in_flight():
    flight = InFlight("f", "child", ASK + (1,))
    assert plan_route(_req(), [Held("e", "child", len(ASK))], mappable=(), flights=[flight]) == Exact("e")


def test_an_exact_build_of_the_same_tokens_is_joined_before_a_mapped_one():
    flights = [InFlight("mapped", "child", ASK, mapped=True), InFlight("exact", "child", ASK)]
    assert plan_route(_req(), [], mappable={"base"}, flights=flights) == Join("exact", "child", len(ASK))
    # a request that may not be served a mapped cache never waits for one
    assert plan_route(_req(allow_mapped=False), [], mappable={"base"}, flights=flights[:1]) == Prefill()


def test_three_tokens_or_fewer_are_never_mapped():
    ids = (1, 2)
    assert plan_route(_req(ids=ids, min_mapped_tokens=1), [Held("src", "base", 2)], mappable={"base"}) == Prefill()


def test_a_cold_request_is_seeded_on_the_source_when_it_maps_into_the_member():
    assert plan_route(_req(seed="base"), [], mappable={"base"}) == Seed("base")


def test_a_seed_extends_the_sources_shorter_prefix():
    held = [Held("src", "base", 10)]  # too short to map (16 more tokens needed), long enough to build over
    assert plan_route(_req(seed="base"), held, mappable={"base"}) == Seed("base", "src", 10)


def test_a_few_shared_header_tokens_on_the_member_do_not_stop_a_seed():
    # a chat template's opening tokens, cached on the member by an earlier request: the document is still cold
    assert plan_route(_req(seed="base"), [Held("own", "child", 5)], mappable={"base"}) == Seed("base")
    held = [Held("own", "child", 20), Held("src", "base", 4)]  # 16 tokens more on the source: still a seed
    assert plan_route(_req(seed="base"), held, mappable={"base"}) == Seed("base", "src", 4)


def test_no_seed_when_the_member_holds_much_of_the_request_or_the_seed_cannot_map():
    assert plan_route(_req(seed="base"), [Held("own", "child", 17)], mappable={"base"}) == Extend("own", 17)
    assert plan_route(_req(seed="base"), [], mappable={"other"}) == Prefill()
    assert plan_route(_req(seed="base", allow_mapped=False), [], mappable={"base"}) == Prefill()
    assert plan_route(_req(seed="base", ids=DOC[:10]), [], mappable={"base"}) == Prefill()  # under min_mapped_tokens


def test_a_build_in_flight_is_joined_rather_than_seeded_again():
    flight = InFlight("f", "base", DOC)
    assert plan_route(_req(seed="base"), [], mappable={"base"}, flights=[flight]) == Join("f", "base", len(DOC))
