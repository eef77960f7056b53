"""The model new requests start on, as the worker described it: EngineCore holds one."""

from __future__ import annotations

import dataclasses

from common.messages import ModelInfo


@dataclasses.dataclass
class CurrentModel:
    """The served model's facts (`info`), its name and its prefix-cache root."""

    info: ModelInfo
    name: str
    root: int

    @property
    def version(self) -> str:
        return self.info.weights_version

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.info.tokenizer_fingerprint

    @property
    def max_model_len(self) -> int:
        return min(self.info.max_model_len, self.info.num_blocks * self.info.block_size)

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size  # 0: unknown (no check)
