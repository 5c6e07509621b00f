"""Child process of tests/engine/test_core_shared_capacity.py and
tests/shared_fs/test_shared_fs_capacity.py: one of several writers of one
storage directory, opened with the engine's defaults (no refresh interval
given).

usage: shared_capacity_worker.py STORE_DIR NAMESPACE PREFIX COUNT CAPACITY [SECONDS RATE]

Writes COUNT keys, or with SECONDS, keys for that long at RATE bytes/s (0: as
fast as it can) and at least COUNT of them (for at most 10x SECONDS: a busy
host may write too few in SECONDS to fill the capacity), counting the puts
skipped while other writers hold the room.
Prints "ready", waits for "go", writes, prints "written" (JSON with SECONDS),
then answers each "report" with what its index holds (JSON) and closes at
end of input, printing "closed"."""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pykvcache as kv  # noqa: E402
from robust_chunkfmt import put_bytes  # noqa: E402

PAYLOAD = 60 << 10
FILE_LEN = 4096 + PAYLOAD


def main():
    store_dir, namespace, prefix, count, capacity = sys.argv[1:6]
    seconds, rate = (float(sys.argv[6]), float(sys.argv[7])) if len(sys.argv) > 7 else (None, 0.0)
    pool = kv.StagingPool(PAYLOAD, 1)
    slot = pool.acquire()
    # The subject is the capacity, not stalls (the partition tests have those): a deadline far
    # above a put on a saturated 2-core CI host, where GlusterFS once took over the default 2 s
    # for one put (skipped, an error here, and its slot still in flight for the next put).
    # PYKVCACHE_TEST_SEGMENT_FILES=1: chunks in segment files (decision 0086).
    segment_files = os.environ.get("PYKVCACHE_TEST_SEGMENT_FILES") == "1"
    store = kv.BlockStore(
        [store_dir],
        pool,
        namespace=namespace,
        capacity_bytes=int(capacity),
        min_free_bytes=0,
        io_deadline=30.0,
        segment_files=segment_files,
    )
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    errors = skipped = i = 0
    t0 = time.monotonic()

    def more() -> bool:
        if seconds is None:
            return i < int(count)
        elapsed = time.monotonic() - t0
        return elapsed < 10 * seconds and (elapsed < seconds or i < int(count))

    while more():
        key = f"{prefix}-{i:06d}".encode()
        r = put_bytes(store, pool, slot, key, bytes([i % 251]) * PAYLOAD)
        if not r.ok:
            # Skipped while the room is held by chunks this writer has not walked yet.
            if r.errno == 11:
                skipped += 1
            else:
                errors += 1
                print(r.message, file=sys.stderr, flush=True)
        i += 1
        if rate:
            ahead = i * FILE_LEN / rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    if seconds is None:
        print("written", flush=True)
    else:
        print(json.dumps({"puts": i, "errors": errors, "skipped": skipped}), flush=True)
    for line in sys.stdin:
        if line.strip() != "report":
            break
        stats = store.stats()
        print(
            json.dumps(
                {
                    "errors": errors,
                    "chunks": stats["chunks"],
                    "used_bytes": stats["used_bytes"],
                    "ns_dir": os.path.basename(store.namespace_dir[0]),
                }
            ),
            flush=True,
        )
    store.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main()
