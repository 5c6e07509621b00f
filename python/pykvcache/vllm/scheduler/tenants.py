"""Which tenant each chunk is sealed for: vLLM's per-request ``cache_salt``.

vLLM mixes a request's ``cache_salt`` into its block hashes, so tenants never
share a chunk key. With an encryption key (decision 0083) the engine also
seals each chunk under a key derived for its tenant, so that a chunk of one
tenant cannot even be opened for another (a hash or indexing bug, a file
copied under another name): defence in depth.

:class:`PyKvCacheConnector` sees each request's salt at arrival and records
the tenant in the request's ``ReqContext``, which vLLM hands to every later
manager call for that request (stores completed after it finished included),
and in its lookahead entry. Each staging entry is filled for one tenant (the
request that stored it or whose lookup, preload or gate sample read it): its
put and get carry that tenant to the engine (``tenant=``), and a lookup of
another tenant never takes it from staging. vLLM's stock
``OffloadingConnector`` gives the manager no request: every chunk is then
sealed for the empty tenant, and the salt still keeps tenants apart through
the keys.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import ReqContext

#: Longest tenant the engine takes; a longer salt is named by its SHA-256.
MAX_TENANT_BYTES = 1024


@dataclass(frozen=True)
class Tenant:
    """A request's tenant, kept in its ``ReqContext`` (``set_state``)."""

    name: bytes


def tenant_of_salt(salt: str | None) -> bytes:
    """The engine's tenant for a request's ``cache_salt`` (b"": none)."""
    if not salt:
        return b""
    raw = salt.encode()
    return raw if len(raw) <= MAX_TENANT_BYTES else b"sha256:" + hashlib.sha256(raw).digest()


def tenant_of(req_context: ReqContext) -> bytes:
    state = req_context.get_state(Tenant)
    return state.name if state is not None else b""
