"""Prompt lookup: drafts are what followed the latest earlier occurrence of the longest tail."""
from strata.coordinator.speculation.drafts import PromptLookup


def test_longest_tail_and_latest_occurrence():
    d = PromptLookup([1, 2, 3, 9, 2, 3, 7, 1, 2, 3])
    # the tail (1, 2, 3) occurred once before, at the start: 9 followed it
    assert d.propose(3) == [9, 2, 3]
    d.extend([5, 2, 3])
    # (1, 2, 3, 5, 2, 3): tail 3-gram (5, 2, 3) is new; (2, 3) last occurred before the 5
    assert d.propose(2) == [5, 2]
    assert d.propose(0) == []


def test_nothing_to_propose_and_short_continuations():
    assert PromptLookup([4, 5, 6]).propose(4) == []
    d = PromptLookup([4, 5, 4])
    assert d.propose(4) == [5, 4]  # what followed the earlier 4, up to the end


def test_draft_room_is_the_rows_beyond_the_slots_up_to_k():
    from strata.coordinator.speculation.drafts import draft_room
    assert draft_room(1, 7, 8) == 7 and draft_room(1, 3, 8) == 3   # 1 slot in 8 rows
    assert draft_room(3, 7, 8) == 5     # 5 rows beyond 3 slots (the window shares them)
    assert draft_room(8, 7, 8) == 0     # a full window that may not grow
    assert draft_room(8, 7, 32) == 7    # one that may grow to 32 rows
    assert draft_room(4, 3, 32) == 3 and draft_room(40, 7, 32) == 0
