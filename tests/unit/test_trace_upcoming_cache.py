"""``AccessTrace.upcoming`` answers from a cache (the engine asks at every chunk access): the
cached answer is the scan's, a caller may change the list it gets, and ``record`` invalidates it."""

from hypothesis import given, settings
from hypothesis import strategies as st

from offload.scheduler import AccessTrace


def _scan(order, now, count):
    out = []
    for step in range(len(order)):
        key = order[(now + step) % len(order)]
        if key not in out:
            out.append(key)
            if len(out) >= count:
                break
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.integers(1, 4))
def test_upcoming_repeated_matches_a_fresh_scan(order, count):
    t = AccessTrace(order)
    for _ in range(2):           # the second pass is served from the cache
        for now in range(len(order)):
            assert t.upcoming(now, count) == _scan(order, now, count)


def test_record_invalidates_the_cached_upcoming():
    t = AccessTrace(["a", "a", "b"])
    assert t.upcoming(2, 2) == ["b", "a"]
    t.record("c")
    assert t.upcoming(2, 2) == ["b", "c"]


def test_changing_a_returned_list_leaves_the_cache_alone():
    t = AccessTrace(["a", "b", "c"])
    got = t.upcoming(0, 2)
    got.append("zzz")
    assert t.upcoming(0, 2) == ["a", "b"]
