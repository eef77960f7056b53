"""What a replica's scheduler tells the data-parallel router (services/router): which blocks
it has cached or evicted, which requests it no longer holds, whether it serves. Pure: built
from the EngineCore after each turn of the actor's loop, sent only when something changed.
"""

from __future__ import annotations

from common.messages import ReplicaNotice
from services.scheduler.block_manager import BlockManager
from services.scheduler.engine_core import EngineCore
from services.scheduler.grouped_blocks import GroupedBlockManager


class NoticeBuilder:
    def __init__(self, replica: int) -> None:
        self.replica = replica
        self._received: set[str] = set()  # request ids received and not yet reported ended
        # the pool the router has heard of
        self._blocks: BlockManager | GroupedBlockManager | None = None
        self._was_ready: bool | None = None
        self._root = 0
        self._loras: dict[str, str] | None = None  # the adapters the router heard of

    def received(self, request_id: str) -> None:
        self._received.add(request_id)

    def resync(self) -> None:
        """A new router knows nothing: the next notice resets and tells everything."""
        self._blocks, self._was_ready, self._loras = None, None, None

    def build(self, core: EngineCore) -> ReplicaNotice | None:
        """The notice for what changed since the last one, or None when nothing did."""
        policy, served = core.policy, core.served
        is_ready = policy is not None and served is not None
        blocks = policy.blocks if policy is not None else None
        reset = blocks is not self._blocks
        self._blocks = blocks
        cached, evicted = blocks.drain_hash_changes() if blocks is not None else ([], [])
        if reset and blocks is not None:  # a new pool, or a new router: all it holds
            cached, evicted = blocks.cached_hashes(), []
        ended = [rid for rid in self._received if rid not in core.groups]
        self._received.difference_update(ended)
        root = served.root if served is not None else 0
        changed = reset or is_ready != self._was_ready or root != self._root
        loras = core.loras.weights_hashes()
        new_loras = loras if loras != self._loras else None
        if not (changed or cached or evicted or ended or new_loras is not None):
            return None
        self._was_ready, self._root, self._loras = is_ready, root, loras
        return ReplicaNotice(
            replica=self.replica,
            is_ready=is_ready,
            cache_root=root,
            block_size=blocks.block_size if blocks is not None else 0,
            tokenizer_fingerprint=served.tokenizer_fingerprint if served is not None else "",
            cached_hashes=cached,
            evicted_hashes=evicted,
            ended_request_ids=sorted(ended),
            reset=reset,
            lora_names=None if new_loras is None else list(new_loras),
            lora_hashes=None if new_loras is None else list(new_loras.values()),
        )
