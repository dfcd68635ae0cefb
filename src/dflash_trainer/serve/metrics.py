"""vLLM's speculative-decoding counters, read from its Prometheus `/metrics` page.

vLLM counts, over every request it served: drafts proposed (`num_drafts`: one per verified
step that had a draft), draft tokens and accepted draft tokens. The served acceptance length
is tau = 1 + accepted / drafts: each verified step emits its accepted drafts plus the
target's own token, the same quantity as `dflash eval`'s pooled tau. Counters only grow, so a
prompt set's numbers are the difference of two readings.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

from dflash_trainer.errors import DFlashError

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}


@dataclass(frozen=True)
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(
            self.drafts - other.drafts,
            self.draft_tokens - other.draft_tokens,
            self.accepted_tokens - other.accepted_tokens,
        )

    @property
    def tau(self) -> float | None:
        """1 + accepted / drafts (None when nothing was drafted)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else None


def metric_sums(text: str) -> dict[str, float]:
    """Metric name -> the sum of its samples over every label set."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        sums[m.group(1)] = sums.get(m.group(1), 0.0) + value
    return sums


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The counters in a /metrics page; None when it has none (no speculation configured)."""
    sums = metric_sums(text)
    if COUNTERS["drafts"] not in sums:
        return None
    return SpecCounters(*(sums.get(name, 0.0) for name in COUNTERS.values()))


def read_spec_counters(server_root: str, timeout: float = 30.0) -> SpecCounters:
    """The counters of the server at `server_root` (http://host:port, no /v1)."""
    try:
        with urllib.request.urlopen(f"{server_root}/metrics", timeout=timeout) as resp:
            text = resp.read().decode("utf-8", "replace")
    except OSError as e:
        raise DFlashError(f"cannot read {server_root}/metrics ({e})") from e
    counters = parse_spec_counters(text)
    if counters is None:
        raise DFlashError(
            f"{server_root}/metrics has no speculative-decoding counters "
            f"({COUNTERS['drafts']}): the server runs without a drafter, or is not vLLM"
        )
    return counters
