"""Shared by test_robust_crash and its writer child: one key space, so the
parent can check every chunk the child could have written."""

NAMESPACE = "robust-crash"
KEYS = [b"crash-%04d" % i for i in range(150)]
MAX_PAYLOAD = 256 << 10
SLOTS = 8
# Below the key space's total size, so the writer also evicts while it dies.
CAPACITY = 8 << 20
