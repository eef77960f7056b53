"""Speculative decoding's config section: n-gram (prompt lookup) or draft-model proposals,
verified by the target model in one step."""

from __future__ import annotations

import dataclasses

from common.config_base import check_field, config_field


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    speculative: str = config_field(
        "",
        "speculative decoding: '' (off) | ngram (prompt lookup) | "
        "draft (needs --draft-model); --draft-model alone means draft",
    )
    draft_model: str = config_field(
        "", "Hugging Face folder of a small draft model with the target's tokenizer"
    )
    num_speculative_tokens: int = config_field(
        4, "tokens proposed per step for each decoding request"
    )
    prompt_lookup_max: int = config_field(
        4, "ngram: longest suffix n-gram looked up in the context"
    )
    prompt_lookup_min: int = config_field(2, "ngram: shortest suffix n-gram looked up")

    def __post_init__(self) -> None:
        check_field(self.speculative in ("", "ngram", "draft"), "speculative", "'', ngram or draft")
        check_field(
            self.speculative != "draft" or bool(self.draft_model),
            "draft_model",
            "set when --speculative is draft",
        )
        check_field(
            self.speculative != "ngram" or not self.draft_model,
            "speculative",
            "draft (or unset) when --draft-model is given",
        )
        check_field(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens", "in [1, 16]")
        check_field(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16,
            "prompt_lookup_min",
            "in [1, --prompt-lookup-max] (and --prompt-lookup-max <= 16)",
        )

    @property
    def method(self) -> str:
        """'' (off), 'ngram' or 'draft'."""
        return "draft" if self.draft_model else self.speculative

    @property
    def num_tokens(self) -> int:
        """Draft tokens per step: 0 when speculation is off."""
        return self.num_speculative_tokens if self.method else 0
