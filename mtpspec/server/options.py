"""How a server runs, fixed at start-up: its speculation and its limits (`mtpspec serve` flags).

No request can change any of this: a request chooses sampling, its length and its stops, never the
drafter, a path or a limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..drafters.mtp import check_lookup
from ..errors import ConfigError


@dataclass(frozen=True)
class ServeOptions:
    drafter: str = "auto"  # none | ngram | draft | mtp | eagle | medusa | auto (the model's own MTP head, else ngram)
    k: int | str = "auto"  # draft length D, or "auto": chosen per sequence from the whole batch's cost
    max_batch: int = 16  # sequences sharing one target forward
    max_queue: int = 64  # requests waiting for a slot; one more is answered 429 with Retry-After
    prefill_chunk: int = 512  # prompt positions prefilled per engine step (running sequences keep decoding)
    prefix_cache: int = 4096  # finished requests' KV positions kept per model for prompts that start the same way; 0 off
    max_prompt_chars: int = 200_000  # characters of one prompt (or of all chat messages), before tokenising
    max_tokens_default: int = 256  # max_tokens when a request gives none (then clipped by the context)
    api_key: str | None = None  # when set: `Authorization: Bearer KEY` on every endpoint but the static page
    mtp_lookup: int = 0  # mtp: where the last N tokens recur, draft their earlier continuation instead (N >= 2); 0 = off
    exact: bool = False  # verify with width-one calls: each sequence's tokens bitwise plain decoding's (on a GPU too)

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_queue", "prefill_chunk", "max_prompt_chars", "max_tokens_default"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if not isinstance(self.prefix_cache, int) or isinstance(self.prefix_cache, bool) or self.prefix_cache < 0:
            raise ConfigError(f"--prefix-cache must be an integer >= 0, got {self.prefix_cache!r}")
        if self.k != "auto" and (not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1):
            raise ConfigError(f"--k must be an integer >= 1 or 'auto', got {self.k!r}")
        check_lookup(self.mtp_lookup)
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key is empty")
