"""Child process of test_robust_staging: many threads, a tiny staging pool and
a tiny operation table. Each request takes a slot (some threads wait without a
timeout, others poll with a short one and count PoolExhausted), loads its chunk
or stores it on a miss, verifies the bytes and gives the slot back. Reports
counts and this process's memory high-water mark as JSON. A fresh process, so
that VmHWM measures this workload only.

usage: robust_staging_worker.py STORE_DIR"""

import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pykvcache as kv  # noqa: E402

THREADS = 32
REQUESTS = 10
SLOT = 1 << 20
SLOTS = 4
KEYS = 8
DEADLINE = 60.0


def vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def retry(call, counter: str, counts: dict, lock: threading.Lock):
    """Backpressure: PoolExhausted is the engine saying 'not now'."""
    while True:
        try:
            return call()
        except kv.PoolExhausted:
            with lock:
                counts[counter] += 1


def main():
    store_dir = sys.argv[1]
    rng = random.Random(5)
    # Expected payloads exist before the baseline, so that checking them allocates nothing.
    payloads = [rng.randbytes(rng.randint(SLOT // 2, SLOT)) for _ in range(KEYS)]
    counts = {"done": 0, "bad": 0, "pool_exhausted": 0, "queue_full": 0, "hits": 0, "stores": 0}
    lock = threading.Lock()
    baseline = vm("VmRSS")  # before the pool: growth = staging + engine + threads
    pool = kv.StagingPool(SLOT, SLOTS)
    store = kv.BlockStore([store_dir], pool, namespace="robust-staging", capacity_bytes=1 << 30, max_inflight=2, submit_timeout=0.002)

    def worker(n: int):
        blocking = n % 2 == 0
        for i in range(REQUESTS):
            k = (n + i) % KEYS
            key, data = b"staging-%d" % k, payloads[k]
            if blocking:
                slot = pool.acquire(timeout=None)
            else:
                slot = retry(lambda: pool.acquire(timeout=0.001), "pool_exhausted", counts, lock)
            r = retry(lambda: store.get(key, slot), "queue_full", counts, lock).wait(DEADLINE)
            if r.status == "miss":
                with pool.view(slot) as v:
                    v[: len(data)] = data
                w = retry(lambda: store.put(key, slot, len(data)), "queue_full", counts, lock).wait(DEADLINE)
                with lock:
                    counts["stores"] += w.ok
                    counts["bad"] += not w.ok
            else:
                with pool.view(slot) as v:
                    good = r.ok and r.length == len(data) and v[: len(data)] == data
                with lock:
                    counts["hits"] += 1
                    counts["bad"] += not good
            pool.release(slot)
            with lock:
                counts["done"] += 1

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(THREADS)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, DEADLINE - (time.monotonic() - t0)))
    stuck = sum(t.is_alive() for t in threads)
    report = dict(
        counts,
        stuck=stuck,
        requests=THREADS * REQUESTS,
        seconds=round(time.monotonic() - t0, 3),
        baseline_rss=baseline,
        hwm=vm("VmHWM"),
        rss=vm("VmRSS"),
        budget=pool.total_bytes,
        free_slots=pool.free_slots,
        num_slots=SLOTS,
    )
    print(json.dumps(report), flush=True)
    if not stuck:
        store.close()


if __name__ == "__main__":
    main()
