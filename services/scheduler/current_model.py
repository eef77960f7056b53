"""The model new requests start on, as the worker described it: EngineCore holds one."""

from __future__ import annotations

import dataclasses

from common.kv_groups import max_tokens_in_pool
from common.messages import ModelInfo


@dataclasses.dataclass
class CurrentModel:
    """The served model's facts (`info`), its name and its prefix-cache root."""

    info: ModelInfo
    name: str
    root: int
    chunk: int = 0  # the most tokens of a prompt one step computes (the token budget)

    @property
    def version(self) -> str:
        return self.info.weights_version

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.info.tokenizer_fingerprint

    @property
    def max_model_len(self) -> int:
        info = self.info
        if info.kv_group_windows:  # a sliding layer group holds its window only
            return max_tokens_in_pool(
                info.kv_group_windows,
                info.num_blocks,
                info.block_size,
                self.chunk or info.max_model_len,
                info.max_model_len,
            )
        return min(info.max_model_len, info.num_blocks * info.block_size)

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size  # 0: unknown (no check)
