"""Where a pool places a new session among the replicas that can take it: a policy object
the pool is given (`Pool.placement`), so a router of another kind (one that shares its
prefix index with other coordinators, say) replaces this module, not the pool.

The default, `PrefixAffinity`, is the least loaded replica, ties in turn, unless one holds
the prompt's prefix: a replica that took a session starting with the longest run of the
prompt's blocks takes this one too, while it has at most PREFIX_AFFINITY_SLACK sessions more
than the least loaded (llm-d's and SGLang's routers weigh cache hits against load the same
way): a cached prefix saves a prefill, a crowded replica costs every round.

Where the replicas keep a prefix cache, a prompt this coordinator has not placed before goes
to the replica its first block names by rendezvous hashing (the highest hash of the block's
key and the replica's address, among those within the same slack of the least loaded). Every
coordinator computes the same, sharing nothing: behind a load balancer, a chat's next turn or
a shared system prompt reaches the replica that cached it whichever coordinator takes it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

PREFIX_AFFINITY_SLACK = 2
PREFIX_INDEX_ENTRIES = 1 << 16  # prompt prefixes remembered per pool (least recently used go)

# A new session's prompt: its cache namespace and token ids.
Prompt = tuple[str, Sequence[int]]


class Replica(Protocol):
    """What placement reads of a replica (coordinator.replica.Replica)."""

    @property
    def address(self) -> str: ...

    @property
    def load(self) -> tuple[int, int]: ...


R = TypeVar("R", bound=Replica)


class Placement(Protocol):
    def choose(self, candidates: list[R], keys: Sequence[bytes]) -> list[R]:
        """The replicas among `candidates` (serving, with room) the session may go to, the
        pool taking one of them in turn. `keys`: its prompt's whole blocks as the replicas'
        prefix caches hold them (`prefix_keys`; none where they keep no cache)."""
        ...

    def placed(self, keys: Sequence[bytes], replica: Replica) -> None:
        """The pool placed a session whose prompt has these block keys on `replica`."""
        ...


@dataclass
class PrefixAffinity:
    """The least loaded, or the replica that holds the prompt's longest cached prefix (the
    module docstring)."""

    slack: int = PREFIX_AFFINITY_SLACK
    entries: int = PREFIX_INDEX_ENTRIES
    # Which replica last took a session starting with each prompt prefix (block chain keys):
    # where that prefix's blocks most likely sit in a prefix cache (--prefix-cache-bytes).
    _prefixes: OrderedDict[bytes, str] = field(default_factory=OrderedDict)

    def choose(self, candidates: list[R], keys: Sequence[bytes]) -> list[R]:
        least = min(replica.load for replica in candidates)
        holder = self.holder(keys, candidates)
        if holder is not None and holder.load[0] <= least[0] + self.slack:
            return [holder]
        if keys:  # none here holds it: the replica every coordinator names for its first block
            near = [replica for replica in candidates if replica.load[0] <= least[0] + self.slack]
            return [max(near, key=lambda replica: rendezvous(keys[0], replica.address))]
        return [replica for replica in candidates if replica.load == least]

    def placed(self, keys: Sequence[bytes], replica: Replica) -> None:
        for key in keys:
            self._prefixes[key] = replica.address
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > self.entries:
            self._prefixes.popitem(last=False)

    def holder(self, keys: Sequence[bytes], candidates: list[R]) -> R | None:
        """The candidate that last took the longest of these prefixes, if any."""
        by_address = {replica.address: replica for replica in candidates}
        for key in reversed(keys):
            address = self._prefixes.get(key)
            if address in by_address:
                return by_address[address]
        return None


def prefix_keys(prompt: Prompt | None, block_tokens: int) -> list[bytes]:
    """Chain keys of the prompt's whole blocks (the replicas' prefix_block_tokens, from Info), the
    last token left out as a prefix cache leaves it; none without a prompt or a cache. The
    same in every process (no salted hash()), so coordinators agree on them."""
    if prompt is None or not block_tokens:
        return []
    namespace, token_ids = prompt
    keys, key = [], _digest(namespace.encode())
    for start in range(0, (len(token_ids) - 1) // block_tokens * block_tokens, block_tokens):
        key = _digest(key + array("q", token_ids[start : start + block_tokens]).tobytes())
        keys.append(key)
    return keys


def rendezvous(key: bytes, address: str) -> bytes:
    """The weight of `address` for `key`: the replica with the highest takes it."""
    return _digest(key + address.encode())


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()
