"""The scheduling policy's settings: the config's scheduler section, and the draft slots and
adapter limit the speculative and LoRA sections ask of it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config import Config


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    watermark: float = 0.01
    scheduling_policy: str = "fcfs"  # fcfs | priority
    preemption_mode: str = "recompute"  # recompute | swap
    batch_policy: str = "continuous"  # continuous | static | dynamic
    batch_window: float = 0.05
    static_batch_timeout: float = 1.0
    num_speculative_tokens: int = 0  # draft slots per decode (0: no speculative decoding)
    max_loras: int = 0  # distinct LoRA adapters in one step (0: LoRA off, no limit)

    @classmethod
    def from_config(cls, config: Config) -> PolicyConfig:
        """The scheduler section's settings, field by field by name (a field added to both
        cannot be forgotten here), and the draft slots speculative decoding asks for."""
        section = dataclasses.asdict(config.scheduler)
        return cls(
            **{f.name: section[f.name] for f in dataclasses.fields(cls) if f.name in section},
            num_speculative_tokens=config.speculative.num_tokens,
            max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
        )
