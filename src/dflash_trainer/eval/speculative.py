"""Speculative decoding with a block drafter (docs/algorithm.md section 7), batch 1.

Shape legend: P = prompt tokens, N = committed tokens (prompt + generated), B = block size,
S = tokens fed in one target forward, V = vocab, F = n_tapped * H_target.

One step, with the anchor x_a (the last committed token, not yet fed to the target):

    drafts d_1..d_{B-1} = drafter(committed ids, features committed since the last step)
    logits = target([x_a, d_1..d_{B-1}])             one forward, positions a..a+B-1
    t_i    = sample(logits[i])                        the target's own token after slot i
    accepted = longest prefix with d_i == t_{i-1}     commit d_1..d_accepted, then t_accepted
    rewind the target cache to the commit; the next anchor is t_accepted

Exactness: every committed token is a t_i, drawn from the target's (temperature, top-p)
distribution given exactly the committed prefix (slot i sees [x_a, d_1..d_i], and d_1..d_i
were accepted, so they ARE the prefix). Samples after the first rejection are discarded,
and that decision depends only on earlier samples, so the output is distributed exactly as
target-only sampling; at temperature 0 it is the target's greedy output. For a greedy drafter
this accept rule has the same acceptance probability as rejection sampling (p_target(d_i)).
A drafter that samples its drafts at temperature > 0 returns a `Proposal` (the drafts and the
q they were drawn from: DFlash2's selector walk, or DFlash with draft sampling on), which is
verified by rejection sampling instead (eval/drafting.py), also exact.

The target-only baseline is the same function with `drafter=None` (a block of the anchor
alone, no taps), so the speedup compares two runs of one implementation.

The target side (its cache, and the rewind of recurrent layers after a partial acceptance)
is `target_runner.py`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn

from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.errors import DFlashError
from dflash_trainer.eval.drafting import Proposal, draft_tokens, rejection_verify
from dflash_trainer.eval.target_runner import DynamicTargetRunner, TargetRunner
from dflash_trainer.target.model import FrozenTarget

# ----------------------------------------------------------------------------- sampling


def top_p_filter(probs_SV: torch.Tensor, top_p: float) -> torch.Tensor:
    """Renormalised nucleus: the smallest set of most likely tokens whose mass reaches top_p."""
    if top_p >= 1.0:
        return probs_SV
    sorted_p, order = probs_SV.sort(dim=-1, descending=True)
    # A token stays when the mass strictly before it is below top_p: the token that
    # crosses the threshold is kept, so the set is never empty.
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs_SV * keep
    return kept / kept.sum(-1, keepdim=True)


def target_probs(logits_SV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution the target samples from (temperature > 0), fp32."""
    probs = torch.softmax(logits_SV.float() / temperature, dim=-1)
    return top_p_filter(probs, top_p)


def sample_tokens(
    logits_SV: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token per row: argmax at temperature 0, else a sample of `target_probs`."""
    if temperature == 0:
        return logits_SV.argmax(-1)
    probs = target_probs(logits_SV, temperature, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ----------------------------------------------------------------------------- drafters


class BlockDrafter(Protocol):
    """What the loop needs from a drafter (the DFlash model, or a test oracle).

    The loop calls `start` once after the target prefill, then `__call__` once per step.
    `ids_N` holds every committed token; its last one is the anchor, at position N-1.
    `new_features_SF` are the target's tapped features of the committed tokens not yet
    given (positions N-1-S .. N-2), or None when `needs_features` is False.
    """

    block_size: int
    needs_features: bool

    def start(self, prompt_ids_P: torch.Tensor, features_PF: torch.Tensor | None) -> None: ...

    def __call__(
        self, ids_N: torch.Tensor, new_features_SF: torch.Tensor | None
    ) -> torch.Tensor | Proposal:
        """block_size - 1 drafted token ids (a 1-D long tensor on the target's device), or
        at temperature > 0 a `Proposal` (sampled tokens with their q: rejection sampling)."""
        ...


def unwrap_module(model: nn.Module) -> nn.Module:
    """The DFlashDrafter inside DDP (`.module`) or torch.compile (`._orig_mod`) wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


DRAFT_SAMPLING = ("auto", "greedy", "sample")
"""At temperature > 0: greedy drafts (verified by the target's own sample), or drafts sampled
from the drafter's distribution (verified by rejection sampling); auto samples, with both
kinds (DFlash2 through its selector walk)."""


class DFlashBlockDrafter:
    """A `DFlashDrafter` as a `BlockDrafter`: cached context K/V, drafts from its logits
    (eval/drafting.py: argmax, or DFlash2's selector walk; sampled at temperature > 0 when
    `draft_sampling` says so, then returned as a `Proposal` with its q).

    Block tokens are embedded and drafts decoded with the target's own embed_tokens and
    lm_head (shared, frozen). `block_size` may be smaller than the trained one (fewer slots).
    """

    needs_features = True

    def __init__(
        self,
        model: nn.Module,
        target: FrozenTarget,
        block_size: int | None = None,
        draft_sampling: str = "auto",
        draft_temperature_scale: float = 1.0,
    ):
        self.model: Any = cast(Any, unwrap_module(model))
        spec: DrafterSpec = self.model.spec
        if draft_sampling not in DRAFT_SAMPLING:
            raise DFlashError(
                f"draft sampling {draft_sampling!r}: choose one of {', '.join(DRAFT_SAMPLING)}"
            )
        self.draft_sampling = draft_sampling
        if not (math.isfinite(draft_temperature_scale) and draft_temperature_scale > 0):
            raise DFlashError(
                f"draft temperature scale {draft_temperature_scale}: must be a finite number > 0"
            )
        self.draft_temperature_scale = draft_temperature_scale
        self.selector = self.model.candidate_selector
        self.top_k = spec.selector_top_k
        self.temperature = 0.0
        self.generator: torch.Generator | None = None
        self.last_hidden: torch.Tensor | None = None
        """The last block's normed hidden states (the candidate walk reads them)."""
        self.block_size: int = spec.block_size if block_size is None else block_size
        if not 2 <= self.block_size <= spec.block_size:
            raise DFlashError(
                f"block size {self.block_size}: must be in 2..{spec.block_size} (the drafter "
                "was trained with that block size; use the target-only loop for 1)"
            )
        self.target = target
        self.dtype = next(self.model.parameters()).dtype
        mask = torch.tensor([spec.mask_token_id], device=target.device)
        self.mask_emb_1H = target.embed(mask).to(self.dtype)
        self.cache: Any = None

    def _extend(self, features_SF: torch.Tensor | None) -> None:
        assert features_SF is not None, "DFlash drafting needs the target's tapped features"
        n, s = self.cache.length, features_SF.shape[0]
        positions = torch.arange(n, n + s, device=features_SF.device)
        self.model.extend_cache(self.cache, features_SF.to(self.dtype), positions)

    def set_sampling(self, temperature: float, generator: torch.Generator | None) -> None:
        """The loop's temperature and generator (generate() calls this before decoding).

        Drafts are drawn at `temperature` x draft_temperature_scale: q is whatever they were
        drawn from, and the verifier reads that same q, so the output stays the target's."""
        self.temperature = temperature * self.draft_temperature_scale
        self.generator = generator

    @property
    def samples(self) -> bool:
        """Whether drafts are sampled (and returned as a `Proposal`) at this temperature."""
        # "auto" samples for both kinds: measured on SmolLM2 at t=1, DFlash drafts sampled from
        # its own distribution were accepted 10-20% more than its argmax drafts and decoded
        # 6-15% faster (benchmarks/dflash2_vs_dflash_smollm2_h100_202612.md).
        return self.temperature > 0 and self.draft_sampling != "greedy"

    def uniforms(self, device: torch.device) -> torch.Tensor | None:
        if not self.samples:
            return None
        return torch.rand(self.block_size - 1, device=device, generator=self.generator)

    def proposal(
        self, tokens: torch.Tensor, q: torch.Tensor | None, ids: torch.Tensor | None
    ) -> torch.Tensor | Proposal:
        return Proposal(tokens, q, ids) if q is not None else tokens

    def start(self, prompt_ids_P: torch.Tensor, features_PF: torch.Tensor | None) -> None:
        self.cache = self.model.new_cache()
        self._extend(features_PF)

    def __call__(
        self, ids_N: torch.Tensor, new_features_SF: torch.Tensor | None
    ) -> torch.Tensor | Proposal:
        if new_features_SF is not None:  # None on the first step: start() took the prompt's
            self._extend(new_features_SF)
        anchor = ids_N[-1:]
        anchor_emb = self.target.embed(anchor).to(self.dtype)
        block = torch.cat([anchor_emb, self.mask_emb_1H.expand(self.block_size - 1, -1)])
        hidden_BH = self.model.step(self.cache, block, ids_N.numel() - 1)
        self.last_hidden = hidden_BH
        tokens, q, ids = draft_tokens(
            hidden_BH[1:],
            self.target.lm_head_weight,
            anchor,
            self.selector,
            self.top_k,
            self.temperature,
            self.uniforms(hidden_BH.device),
        )
        return self.proposal(tokens, q, ids)


# ----------------------------------------------------------------------------- the loop


@dataclass
class Generation:
    """One response of `generate`."""

    prompt_len: int
    tokens: list[int]
    """Generated ids, cut after the first stop id and at max_new_tokens."""
    accepted: list[int]
    """Per step: drafts accepted (0..B-1); tau of the step = accepted + 1."""
    block_size: int
    prefill_s: float
    """Target prefill + first token + the drafter's prompt context (excluded from TPOT)."""
    decode_s: float
    stop_reason: str
    """'stop_id' or 'max_new_tokens'."""
    target_forwards: int
    """Decode-phase target forwards, re-feeds of hybrid targets included."""
    margins: list[float] | None = field(default=None, repr=False)
    """Greedy only, when asked: top-1 minus top-2 logit of the target at each generated token."""

    @property
    def decode_tokens(self) -> int:
        """Tokens produced after the first one (which the prefill produces)."""
        return max(len(self.tokens) - 1, 0)

    @property
    def tpot_s(self) -> float:
        return self.decode_s / self.decode_tokens if self.decode_tokens else float("nan")


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _margin(logits_V: torch.Tensor) -> torch.Tensor:
    top2 = logits_V.topk(2).values
    return top2[0] - top2[1]


def _cut_at_stop(tokens: list[int], stops: set[int]) -> tuple[list[int], int | None]:
    """Tokens up to and including the first stop id, and its index (None: no stop)."""
    cut = next((i for i, t in enumerate(tokens) if t in stops), None)
    return (tokens[: cut + 1] if cut is not None else tokens), cut


@dataclass
class _Decode:
    """The state of one decode loop between steps."""

    seq: torch.Tensor
    """Committed tokens in seq[:n], room for a block beyond."""
    n: int
    generated: list[int]
    margins: list[torch.Tensor] | None
    """Top-2 logit margins of committed tokens, when recorded."""
    accepted: list[int] = field(default_factory=list)
    new_feats: torch.Tensor | None = None
    """Target features of the tokens committed by the last step (the drafter's input)."""
    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    def p_rows(self, logits_SV: torch.Tensor) -> torch.Tensor:
        """The target's sampling distribution of each verified row."""
        return target_probs(logits_SV, self.temperature, self.top_p)


def _draft_and_verify(
    st: _Decode,
    drafter: BlockDrafter | None,
    runner: TargetRunner,
    block: int,
    taps: bool,
    sample: Callable[[torch.Tensor], torch.Tensor],
) -> list[int]:
    """One step: draft a block, verify it in one target forward, commit the accepted
    prefix plus the target's own next token. Returns the committed tokens."""
    seq, n = st.seq, st.n
    proposal = None
    if drafter is not None:
        out = drafter(seq[:n], st.new_feats)
        if isinstance(out, Proposal):
            proposal, out = out, out.tokens_S
        drafts = out.to(seq.device).view(-1)
        assert drafts.numel() == block - 1, "a drafter must return block_size - 1 ids"
        block_ids = torch.cat([seq[n - 1 : n], drafts])
    else:
        block_ids = seq[n - 1 : n]
    snapshot = runner.snapshot(block)
    logits, feats = runner.forward(block_ids, taps=taps)
    if st.margins is not None:
        st.margins.extend(_margin(row) for row in logits)
    if proposal is not None:
        new, acc = rejection_verify(proposal, st.p_rows(logits), st.generator)
        seq[n : n + acc + 1] = torch.tensor(new, device=seq.device)
    else:
        posterior = sample(logits)
        host = torch.cat([block_ids[1:], posterior]).tolist()  # the step's one host sync
        drafted, post = host[: block - 1], host[block - 1 :]
        acc = 0
        while acc < block - 1 and drafted[acc] == post[acc]:
            acc += 1
        seq[n : n + acc] = block_ids[1 : acc + 1]
        seq[n + acc] = posterior[acc]
        new = post[: acc + 1]
    st.n = n + acc + 1
    st.accepted.append(acc)
    st.generated.extend(new)
    if st.margins is not None:
        # Keep the margins of committed slots only (the rest saw rejected drafts).
        del st.margins[len(st.margins) - block + acc + 1 :]
    if feats is not None:
        st.new_feats = feats[: acc + 1]
    runner.rewind(block_ids, acc + 1, snapshot)
    return new


@torch.no_grad()
def _checked_prompt(
    prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, dev: torch.device
) -> torch.Tensor:
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).to(dev).view(-1)
    if prompt.numel() == 0:
        raise DFlashError("empty prompt: the loop needs at least one prompt token")
    return prompt


def generate(
    target: FrozenTarget,
    prompt_ids: Sequence[int] | torch.Tensor,
    drafter: BlockDrafter | None = None,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    record_margins: bool = False,
    runner: TargetRunner | None = None,
) -> Generation:
    """Speculative decoding with `drafter`, or target-only decoding when it is None.

    `generator` (on the target's device) drives sampling when temperature > 0. `runner`
    (default: a new `DynamicTargetRunner`) runs the target; it is reset first.
    """
    dev = target.device
    sync = _synchronizer(dev)
    prompt = _checked_prompt(prompt_ids, max_new_tokens, dev)
    p = prompt.numel()
    block = drafter.block_size if drafter is not None else 1
    taps = drafter is not None and drafter.needs_features
    stops = set(int(t) for t in stop_ids)
    if runner is None:
        runner = DynamicTargetRunner(target)
    runner.begin()
    margins: list[torch.Tensor] = []

    sync()
    t0 = time.perf_counter()
    logits, feats = runner.forward(prompt, taps=taps, last_logits_only=True)
    runner.after_prefill()

    def sample(logits_SV: torch.Tensor) -> torch.Tensor:
        return sample_tokens(logits_SV, temperature, top_p, generator)

    anchor = sample(logits[-1:])
    if record_margins:
        margins.append(_margin(logits[-1]))
    if drafter is not None:
        set_sampling = getattr(drafter, "set_sampling", None)
        if set_sampling is not None:
            set_sampling(temperature, generator)
        drafter.start(prompt, feats)
    seq = torch.empty(p + max_new_tokens + block, dtype=torch.long, device=dev)
    seq[:p] = prompt
    seq[p] = anchor[0]
    generated = [int(anchor[0])]  # one host sync per step, this one included
    sync()
    t1 = time.perf_counter()
    runner.forwards = 0

    # n: committed tokens; the anchor seq[n-1] is not in the target cache yet
    st = _Decode(seq, p + 1, generated, margins if record_margins else None)
    st.temperature, st.top_p, st.generator = temperature, top_p, generator
    stopped = generated[0] in stops
    while len(generated) < max_new_tokens and not stopped:
        new = _draft_and_verify(st, drafter, runner, block, taps, sample)
        stopped = bool(stops.intersection(new))
    sync()
    t2 = time.perf_counter()

    tokens, cut = _cut_at_stop(generated[:max_new_tokens], stops)
    return Generation(
        prompt_len=p,
        tokens=tokens,
        accepted=st.accepted,
        block_size=block,
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        stop_reason="stop_id" if cut is not None else "max_new_tokens",
        target_forwards=runner.forwards,
        margins=[float(m) for m in torch.stack(margins).tolist()][: len(tokens)]
        if record_margins
        else None,
    )
