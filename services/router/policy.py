"""Which replica serves a request (data parallelism): prefix affinity bounded by load.

Pure logic, no sockets. The router keeps a view of every replica, fed by the replicas'
`ReplicaNotice`s and by its own decisions:

    replica view:  held     hashes of blocks the replica has cached (its notices)
                   pending  hashes of prompts just routed there, not yet confirmed (FIFO,
                            bounded: a request that is cancelled before its prefill never
                            confirms them)
                   live     ids routed there that the replica has not reported ended

Load is the number of live requests (waiting + running + on their way there), counted by the
router itself, so a burst routed between two notices is counted at once.

`prefix` routing hashes the prompt's matchable full blocks with the scheduler's own chain
(common/prefix_hash.py, on the replica's cache root) and sends the request to
the ready replica holding the longest run of its leading blocks, unless that replica's
load would go above `load_bound` times the mean (at least 1 request); on a miss, or when
the holders are all too busy, to the least loaded replica (ties: the one given fewest
requests so far). `round-robin` takes the ready replicas in turn.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict

from common.messages.scheduler_router import ReplicaNotice
from common.model_facts import lora_root
from common.prefix_hash import prefix_hashes

MAX_PENDING_HASHES = 8192


@dataclasses.dataclass
class ReplicaView:
    index: int
    role: str = "both"  # both, prefill (takes new requests) or decode (takes hand-overs)
    is_ready: bool = False
    cache_root: int = 0
    block_size: int = 0
    tokenizer_fingerprint: str = ""
    held: set[int] = dataclasses.field(default_factory=set)
    pending: OrderedDict[int, None] = dataclasses.field(default_factory=OrderedDict)
    live: set[str] = dataclasses.field(default_factory=set)
    loras: dict[str, str] = dataclasses.field(default_factory=dict)  # adapter -> weights hash
    num_routed: int = 0  # requests routed here in all

    @property
    def load(self) -> int:
        return len(self.live)

    def has(self, h: int) -> bool:
        return h in self.held or h in self.pending

    def num_leading_hits(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if not self.has(h):
                break
            n += 1
        return n

    def expect(self, hashes: list[int]) -> None:
        """These blocks will be cached here soon (a request was just routed here)."""
        for h in hashes:
            if h not in self.held:
                self.pending[h] = None
                self.pending.move_to_end(h)
        while len(self.pending) > MAX_PENDING_HASHES:
            self.pending.popitem(last=False)

    def forget_cache(self) -> None:
        self.held.clear()
        self.pending.clear()


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    replica: int
    num_hit_blocks: int  # leading blocks the router believes the replica holds (0: a miss)


class Router:
    """Routes requests among `num_replicas` replicas; see the module docstring."""

    def __init__(
        self,
        num_replicas: int,
        routing: str = "prefix",
        load_bound: float = 1.25,
        roles: list[str] | None = None,
    ):
        if routing not in ("prefix", "round-robin"):
            raise ValueError(f"unknown routing {routing!r}")
        roles = roles or ["both"] * num_replicas
        self.replicas = [ReplicaView(i, role) for i, role in enumerate(roles)]
        self.routing = routing
        self.load_bound = load_bound
        self._turn = 0
        self.num_prefix_routed = 0  # sent to a replica holding a prefix of the prompt
        self.num_least_loaded_routed = 0  # a miss (or every holder too busy): least loaded
        self.num_handovers_routed = 0  # sequences handed from a prefill to a decode replica

    # notices -------------------------------------------------------------------------------
    def on_notice(self, msg: ReplicaNotice) -> None:
        r = self.replicas[msg.replica]
        if msg.reset:
            r.forget_cache()
        r.is_ready, r.cache_root, r.block_size = msg.is_ready, msg.cache_root, msg.block_size
        r.tokenizer_fingerprint = msg.tokenizer_fingerprint
        r.held.update(msg.cached_hashes)
        r.held.difference_update(msg.evicted_hashes)
        for h in (*msg.cached_hashes, *msg.evicted_hashes):
            r.pending.pop(h, None)
        r.live.difference_update(msg.ended_request_ids)
        if msg.lora_names is not None and msg.lora_hashes is not None:
            r.loras = dict(zip(msg.lora_names, msg.lora_hashes, strict=True))

    def on_replica_down(self, index: int) -> list[str]:
        """Replica `index`'s scheduler died: route around it until it tells again; returns
        the requests that were live there (they fail, retryably)."""
        r = self.replicas[index]
        r.is_ready = False
        r.forget_cache()
        lost = sorted(r.live)
        r.live.clear()
        return lost

    # routing -------------------------------------------------------------------------------
    def route(
        self,
        request_id: str,
        token_ids: list[int],
        tokenizer_fingerprint: str = "",
        lora_name: str = "",
    ) -> Decision | None:
        """The replica for this request (None: no replica is ready). Mid-swap, replicas
        whose model has the request's tokenizer come first (elsewhere it is tokenised again);
        a request of a LoRA adapter goes to a replica that has the adapter, then by prefix
        (hashed under the adapter's root)."""
        ready = [r for r in self.replicas if r.is_ready and r.role != "decode"]
        if not ready:
            return None
        same = [r for r in ready if r.tokenizer_fingerprint == tokenizer_fingerprint]
        ready = same if tokenizer_fingerprint and same else ready
        having = [r for r in ready if lora_name in r.loras]
        ready = having if lora_name and having else ready
        hashes: list[int] = []
        if self.routing == "round-robin":
            chosen, hits = self._next_in_turn(ready), 0
        else:
            chosen, hashes, hits = self._by_prefix(ready, token_ids, lora_name)
        chosen.live.add(request_id)
        chosen.num_routed += 1
        chosen.expect(hashes)
        return Decision(chosen.index, hits)

    def route_handover(
        self, request_id: str, tokenizer_fingerprint: str = "", lora: tuple[str, str] = ("", "")
    ) -> ReplicaView | None:
        """The decode replica that continues a handed-over sequence: the least loaded ready
        one (mid-swap, one serving the tokenizer it was made with first; for an adapter's
        sequence, `lora` (name, weights hash), one serving that adapter so first); None:
        none is."""
        ready = [r for r in self.replicas if r.is_ready and r.role != "prefill"]
        same = [r for r in ready if r.tokenizer_fingerprint == tokenizer_fingerprint]
        ready = same or ready
        name, weights_hash = lora
        having = [r for r in ready if name and r.loras.get(name) == weights_hash]
        ready = having or ready
        if not ready:
            return None
        chosen = min(ready, key=lambda r: (r.load, r.num_routed, r.index))
        chosen.live.add(request_id)
        chosen.num_routed += 1
        self.num_handovers_routed += 1
        return chosen

    def _next_in_turn(self, ready: list[ReplicaView]) -> ReplicaView:
        chosen = min(ready, key=lambda r: (r.index - self._turn) % len(self.replicas))
        self._turn = chosen.index + 1
        return chosen

    def _by_prefix(
        self, ready: list[ReplicaView], token_ids: list[int], lora_name: str = ""
    ) -> tuple[ReplicaView, list[int], int]:
        chains: dict[tuple[int, int], list[int]] = {}
        hits: dict[int, int] = {}
        roots: dict[int, int] = {}  # replica -> the request's root there
        for r in ready:
            root = lora_root(r.cache_root, lora_name, r.loras.get(lora_name, ""))
            roots[r.index] = root
            key = (root, r.block_size)
            if key not in chains:
                chains[key] = list(prefix_hashes(root, token_ids, r.block_size))
            hits[r.index] = r.num_leading_hits(chains[key])
        cap = self.load_cap(ready)
        holders = [r for r in ready if hits[r.index] and r.load + 1 <= cap]
        if holders:
            chosen = min(holders, key=lambda r: (-hits[r.index], r.load, r.num_routed, r.index))
            self.num_prefix_routed += 1
        else:
            chosen = min(ready, key=lambda r: (r.load, r.num_routed, r.index))
            self.num_least_loaded_routed += 1
        return chosen, chains[(roots[chosen.index], chosen.block_size)], hits[chosen.index]

    def load_cap(self, ready: list[ReplicaView]) -> int:
        """Most requests a replica may hold after taking one more by affinity: the bound
        times the mean load with that request counted, and never less than 1."""
        mean = (sum(r.load for r in ready) + 1) / len(ready)
        return max(1, math.ceil(self.load_bound * mean))

    def stats(self) -> dict[str, object]:
        return {
            "routing": self.routing,
            "num_prefix_routed": self.num_prefix_routed,
            "num_least_loaded_routed": self.num_least_loaded_routed,
            "num_handovers_routed": self.num_handovers_routed,
            "replicas": [
                {
                    "replica": r.index,
                    "role": r.role,
                    "is_ready": r.is_ready,
                    "load": r.load,
                    "num_routed": r.num_routed,
                    "num_cached_hashes": len(r.held),
                }
                for r in self.replicas
            ],
        }
