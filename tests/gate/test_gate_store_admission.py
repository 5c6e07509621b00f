"""Store admission: skipped chunks are counted, what is stored is a prefix."""

from __future__ import annotations

from pykvcache.gate import StoreAdmission


def test_short_requests_are_not_stored():
    adm = StoreAdmission(chunk_tokens=32, min_tokens=300)
    assert adm.admit([b"a", b"b"], request_tokens=256) == 0
    assert adm.admit([b"a"] * 10, request_tokens=320) == 10
    assert adm.take_counters() == {"store_skipped_below_break_even": 2}
    assert adm.take_counters() == {}


def test_second_sighting_stores_shared_prefixes_only():
    adm = StoreAdmission(chunk_tokens=32, second_sighting=True)
    shared = [b"s1", b"s2", b"s3"]
    adm.sighted("r1", shared + [b"x1"])
    assert adm.admit(shared + [b"x1"], request_tokens=128) == 0
    adm.sighted("r1", shared)  # the same request again is not a second sighting
    assert adm.admit(shared, request_tokens=96) == 0
    adm.sighted("r2", shared + [b"y1", b"y2"])
    # The shared head is admitted; the tail stops at the first unseen chunk.
    assert adm.admit(shared + [b"y1", b"y2"], request_tokens=160) == 3
    assert adm.totals["store_skipped_first_sighting"] == 4 + 3 + 2


def test_a_skipped_chunk_ends_the_admitted_prefix():
    adm = StoreAdmission(chunk_tokens=32, second_sighting=True)
    adm.sighted("r1", [b"a", b"c"])
    adm.sighted("r2", [b"a", b"b", b"c"])
    assert adm.admit([b"a", b"b", b"c"], request_tokens=96) == 1


def test_sightings_are_bounded():
    adm = StoreAdmission(chunk_tokens=32, second_sighting=True, max_tracked=100)
    for i in range(1000):
        adm.sighted(f"r{i}", [i.to_bytes(4, "little")])
    assert len(adm._seen) == 100
    adm.sighted("again", [b"\x00\x00\x00\x00"])  # long forgotten: a first sighting again
    assert adm.admit([b"\x00\x00\x00\x00"], request_tokens=32) == 0


def test_off_by_default():
    adm = StoreAdmission(chunk_tokens=32)
    adm.sighted("r", [b"k"])
    assert adm.admit([b"k"], request_tokens=32) == 1
    assert adm.admit([], request_tokens=0) == 0
