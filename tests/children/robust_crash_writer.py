"""Child process of test_robust_crash: stores chunks in a loop, several in
flight at once, until it is SIGKILLed. Prints one line per completed put so
the parent knows how far it got.

usage: robust_crash_writer.py STORE_DIR {tmpfile|rename} SEED"""

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from robust_crash_params import CAPACITY, KEYS, MAX_PAYLOAD, NAMESPACE, SLOTS  # noqa: E402


def main():
    store_dir, mode, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "rename":
        import robust_no_tmpfile

        robust_no_tmpfile.refuse_o_tmpfile()
    import pykvcache as kv
    from robust_chunkfmt import payload_for

    pool = kv.StagingPool(MAX_PAYLOAD, SLOTS)
    store = kv.BlockStore([store_dir], pool, namespace=NAMESPACE, capacity_bytes=CAPACITY, queue_depth=SLOTS)
    fallbacks = store.stats()["fallbacks"]
    print("ready tmpfile=%d" % (not any("O_TMPFILE" in f for f in fallbacks)), flush=True)
    rng = random.Random(seed)
    inflight = []
    for _slot in range(SLOTS):
        pool.acquire()
    free = list(range(SLOTS))
    while True:
        while free:
            slot = free.pop()
            key = rng.choice(KEYS)
            data = payload_for(key, MAX_PAYLOAD)
            with pool.view(slot) as v:
                v[: len(data)] = data
            inflight.append(store.put(key, slot, len(data)))
        h = inflight.pop(0)
        r = h.wait(30)
        print("put %s %s" % (h.key.decode(), r.status), flush=True)
        free.append(h.slot)


if __name__ == "__main__":
    main()
