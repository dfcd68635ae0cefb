"""The two modules DFlash2 adds to the DFlash backbone (docs/algorithm.md section 8).

Shape legend: Q = block-slot rows (n blocks x L slots), L = slots per block, H = hidden size,
k = conv taps, G = channel groups (H / g), R = rows scored, K = candidates per slot,
r = selector rank, S = drafted slots of one block (L - 1), V = vocab.

Grouped dynamic convolution (`GroupedDynamicConv`, one around each attention and MLP
sublayer). With x the sublayer's normed input and D = kernel_projection(x) viewed as
[Q, 2, k, G] (side 0 = before the sublayer, side 1 = after it):

    x'[t, c] = sum_j (base[0, j, c] + D[t, 0, j, c // g]) * x[t - j, c]     sublayer input
    y'[t, c] = sum_j (base[1, j, c] + D[t, 1, j, c // g]) * y[t - j, c]     y = sublayer(x')

where a tap t - j before the block's first slot reads zero: a tap never reaches another
block or the context, also when training packs many blocks in one sequence (the rows are
viewed as [n, L, ...] and shifted inside each block). Both sides' coefficients come from the
input x. Initialised as an exact identity (base = [1, 0, ...], D = 0), so a DFlash2
drafter built on a trained DFlash backbone drafts exactly as DFlash before its first step.

Candidate selector (`CandidateSelector`): the backbone's top-K tokens of each slot, with
unary scores U (the lm_head logits), are re-ranked by a low-rank pairwise term that
depends on the token chosen at the slot before:

    S_k(p, c) = U_k(c) + sum_r A[p, r] * (P h_k)[r] * B[c, r]

(A = predecessor_codebook [V, r], B = successor_codebook [V, r], P = hidden_projection).
Serving walks one path: the anchor is slot 1's predecessor, and each slot's choice is the
next slot's. B starts at zero, so S = U and the greedy walk is DFlash's argmax.
Training scores every slot at once with the true previous token as predecessor: when the
earlier slots were all right, that is exactly the token the walk chose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trainer.core.fused_head import upcast


def is_dflash2_tensor(name: str) -> bool:
    """Whether a drafter state-dict key belongs to a module DFlash2 adds."""
    return name.startswith("candidate_selector.") or "_conv." in name


class GroupedDynamicConv(nn.Module):
    """Two-sided grouped dynamic causal convolution over the slots of each block."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        if hidden % group_size != 0:
            raise ValueError(f"conv_group_size {group_size} does not divide hidden {hidden}")
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 weighs 1, every other tap 0, no dynamic part."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0, :] = 1.0
            self.kernel_projection.weight.zero_()

    def coefficients(self, x_QH: torch.Tensor) -> torch.Tensor:
        """Both sides' per-slot kernels base + D, [Q, 2, G, g, k], taps in window order.

        Window position i holds tap k - 1 - i (the slot k - 1 - i before), so one multiply and
        one sum apply every tap: a sublayer's two sides are about 10 small ops in all, which
        is what a decoding step with a small target pays for them.
        """
        q, k = x_QH.shape[0], self.kernel_size
        d = self.kernel_projection(x_QH).view(q, 2, k, self.groups, 1)
        base = self.base_kernel.to(d.dtype).view(1, 2, k, self.groups, self.group_size)
        return (base + d).flip(2).permute(0, 1, 3, 4, 2)

    def apply_side(
        self, side: int, x_QH: torch.Tensor, w_Q2Ggk: torch.Tensor, block_len: int
    ) -> torch.Tensor:
        """sum_j (base[side, j] + D[:, side, j]) * x shifted j slots inside each block."""
        q, h = x_QH.shape
        n = q // block_len
        assert n * block_len == q, "rows must be whole blocks"
        k = self.kernel_size
        xs = x_QH.view(n, block_len, self.groups, self.group_size)
        # k - 1 zero slots before each block: a tap never reads another block or the context.
        windows = F.pad(xs, (0, 0, 0, 0, k - 1, 0)).unfold(1, k, 1)  # [n, L, G, g, k]
        w = w_Q2Ggk[:, side].unflatten(0, (n, block_len)).to(x_QH.dtype)
        return (windows * w).sum(-1).reshape(q, h)


CODEBOOK_NAMES = ("predecessor_codebook", "successor_codebook")
FACTOR_NAMES = ("predecessor_projection", "successor_projection")


class CandidateSelector(nn.Module):
    """Low-rank pairwise re-ranking of each slot's top-K candidates.

    `codebooks="tables"`: A and B are free [V, r] tables, the published layout. With
    `"embedding"` (a training parameterisation) they are E' W_A and E' W_B: the frozen target
    input embedding E, scaled to unit mean row norm (E'), times two trained [H, r] matrices.
    A table row learns only from the pairs its token takes part in, so a short run on a few
    million tokens fits the pairs it saw; through E every pair informs every token with a
    similar embedding, with 2 H r instead of 2 V r parameters. Served drafters always hold
    the tables: `serving_state` computes them.
    """

    def __init__(self, hidden: int, vocab: int, rank: int, codebooks: str = "tables") -> None:
        super().__init__()
        if codebooks not in ("tables", "embedding"):
            raise ValueError(f"selector codebooks {codebooks!r}: tables or embedding")
        self.codebooks = codebooks
        self.vocab = vocab
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        # Plain parameters (not nn.Embedding): their state-dict names are the published
        # tensor names, which carry no `.weight` suffix.
        rows = vocab if codebooks == "tables" else hidden
        names = CODEBOOK_NAMES if codebooks == "tables" else FACTOR_NAMES
        self.first_name, self.second_name = names
        setattr(self, names[0], nn.Parameter(torch.empty(rows, rank)))
        setattr(self, names[1], nn.Parameter(torch.empty(rows, rank)))
        # E' (embedding mode): a plain attribute, not a buffer: frozen, never saved, not
        # sharded or broadcast by data parallelism (every rank holds the target).
        self.embedding: torch.Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """A zero successor codebook makes the pair term 0: S = U, the selector a no-op.

        The successor codebook gets gradient at once; the other two once it is non-zero.
        With unit-norm embedding rows, E' W_A has rows of the same spread as a table's.
        """
        with torch.no_grad():
            nn.init.normal_(self.hidden_projection.weight, std=std)
            nn.init.normal_(getattr(self, self.first_name), std=std)
            getattr(self, self.second_name).zero_()

    def attach_embedding(self, embedding_VH: torch.Tensor) -> None:
        """Give an embedding-mode selector the target's input embedding (no-op for tables)."""
        if self.codebooks != "embedding":
            return
        e = embedding_VH.detach()
        if e.shape[0] != self.vocab:
            raise ValueError(f"embedding has {e.shape[0]} rows, the selector {self.vocab}")
        norm = e.float().pow(2).sum(-1).mean().sqrt().clamp(min=1e-12)
        self.embedding = (e.float() / norm).to(e.dtype)

    def _rows(self, second: bool, ids: torch.Tensor) -> torch.Tensor:
        """Rows of A (second=False) or B for token ids, at least fp32."""
        table = getattr(self, self.second_name if second else self.first_name)
        if self.codebooks == "tables":
            return upcast(table[ids])
        if self.embedding is None:
            raise RuntimeError("an embedding-mode selector needs attach_embedding() first")
        e = self.embedding.to(table.device)
        if ids.numel() > e.shape[0]:
            # More rows asked than the vocabulary has (a training step's R x K candidates):
            # the whole [V, r] codebook once (2VHr FLOPs, and as much back) is cheaper than
            # projecting every gathered row (2 R K H r).
            return upcast((e.to(table.dtype) @ table)[ids])
        return upcast(e[ids].to(table.dtype) @ table)

    def gate(self, hidden_RH: torch.Tensor) -> torch.Tensor:
        """P h [R, r], at least fp32."""
        w = self.hidden_projection.weight
        return upcast(hidden_RH.to(w.dtype) @ w.t())

    def forward(
        self,
        hidden_RH: torch.Tensor,
        prev_R: torch.Tensor,
        cand_RK: torch.Tensor,
        unary_RK: torch.Tensor,
    ) -> torch.Tensor:
        """Scores [R, K] (at least fp32) of each row's candidates given one predecessor per row."""
        a = self._rows(False, prev_R) * self.gate(hidden_RH)
        b = self._rows(True, cand_RK)
        return upcast(unary_RK) + torch.einsum("rd,rkd->rk", a, b)

    def lattice(
        self,
        hidden_SH: torch.Tensor,
        anchor_id: torch.Tensor,
        cand_SK: torch.Tensor,
        unary_SK: torch.Tensor,
    ) -> torch.Tensor:
        """Scores [S, K, K] of one block: row i of slot s has predecessor candidate i of slot
        s - 1 (slot 0: every row has the anchor). Everything a walk reads, in one pass."""
        k = cand_SK.shape[1]
        gate = self.gate(hidden_SH)  # [S, r]
        prev = torch.cat([anchor_id.view(1).expand(k).view(1, k), cand_SK[:-1]], 0)  # [S, K]
        a = self._rows(False, prev) * gate[:, None, :]  # [S, K, r]
        b = self._rows(True, cand_SK)  # [S, K, r]
        return upcast(unary_SK)[:, None, :] + torch.einsum("sid,sjd->sij", a, b)


def _selector_keys(state: dict[str, torch.Tensor], names: tuple[str, ...]) -> list[str]:
    # The names belong to the selector alone (any prefix: bare, drafter, wrapped).
    return [k for k in state if k.rsplit(".", 1)[-1] in names]


def serving_state(
    state: dict[str, torch.Tensor], selector: CandidateSelector | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the drafter file's state, the selector factors apart) of a drafter state dict.

    Tables mode: (state, {}). Embedding mode: the two factor tensors are replaced by the
    codebooks they make with the selector's embedding, so every file a run writes is the
    published layout that every reader and engine loads; the factors come back for a
    checkpoint, whose resume trains them on.
    """
    if selector is None or selector.codebooks == "tables":
        return state, {}
    if selector.embedding is None:
        raise RuntimeError("an embedding-mode selector needs attach_embedding() first")
    keys = _selector_keys(state, FACTOR_NAMES)
    factors = {k: state[k] for k in keys}
    out = {k: v for k, v in state.items() if k not in factors}
    e = selector.embedding.float()
    for k in keys:
        name = k.rsplit(".", 1)[-1]
        table = e @ factors[k].detach().float().to(e.device)
        out[k[: len(k) - len(name)] + CODEBOOK_NAMES[FACTOR_NAMES.index(name)]] = table.to(
            factors[k].device
        )
    return out, factors


def training_state(
    state: dict[str, torch.Tensor],
    factors: dict[str, torch.Tensor],
    selector: CandidateSelector | None,
) -> dict[str, torch.Tensor]:
    """The inverse of serving_state for a resume: the factors back in place of the tables.

    A ValueError when an embedding-mode run meets a checkpoint without factors (one a
    tables-mode run wrote), or a tables-mode run meets factors."""
    embedding = selector is not None and selector.codebooks == "embedding"
    if not embedding:
        if factors:
            raise ValueError("the checkpoint holds selector factors (selector_codebooks=embedding)")
        return state
    if not factors:
        raise ValueError(
            "the checkpoint has no selector factors (selector_factors.safetensors: a run with "
            "selector_codebooks=tables wrote it, or the file was removed)"
        )
    _check_factors(factors)
    out = {k: v for k, v in state.items() if k not in _selector_keys(state, CODEBOOK_NAMES)}
    out.update(factors)
    return out


class DamagedFactors(ValueError):
    """selector_factors.safetensors is there but is not what this trainer writes."""


def _check_factors(factors: dict[str, torch.Tensor]) -> None:
    # A file that passed its checksums can still have been rewritten by hand or by other
    # code: a wrong tensor set, integers or NaN would otherwise load (load_state_dict casts)
    # and fail steps later as a "non-finite loss" that blames the target or the data.
    names = sorted(k.rsplit(".", 1)[-1] for k in factors)
    if names != sorted(FACTOR_NAMES):
        raise DamagedFactors(
            f"selector_factors.safetensors holds {names}, not exactly {sorted(FACTOR_NAMES)} "
            "(not written by this trainer)"
        )
    for k, v in factors.items():
        if not v.is_floating_point():
            raise DamagedFactors(
                f"selector_factors.safetensors: {k} is {v.dtype}, not floating point"
            )
        if not bool(torch.isfinite(v).all()):
            raise DamagedFactors(f"selector_factors.safetensors: {k} holds NaN or infinite values")


def _follow(choice_SK: torch.Tensor) -> torch.Tensor:
    """The path [S] through per-slot choice tables: choice_SK[s, p] is slot s's candidate
    index when slot s - 1 chose p (slot 0's rows are all the anchor's: row 0 is read).

    The walk is sequential by nature, but composing the tables is associative, so the prefix
    compositions G_s = f_s o ... o f_0 come from ceil(log2 S) rounds of one batched gather
    (G_s <- G_s o G_{s-d} for d = 1, 2, 4, ...) instead of S dependent single-row steps:
    about 10 small ops for a 16-slot block rather than 2-8 per slot. A decoding step with a
    small target is bound by such launches; every op here is fixed-shape (CUDA graphs).
    """
    g = choice_SK
    d = 1
    while d < g.shape[0]:
        g = torch.cat([g[:d], g[d:].gather(1, g[:-d])], 0)
        d *= 2
    return g[:, 0]


def walk_greedy(lattice_SKK: torch.Tensor) -> torch.Tensor:
    """Candidate index [S] of the greedy path: each slot's argmax given the previous choice.

    No host read (it runs inside a CUDA graph); ties go to the lower index, as torch.argmax.
    """
    return _follow(lattice_SKK.argmax(-1))


def walk_sample(
    lattice_SKK: torch.Tensor, temperature: float, uniforms_S: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled path: (candidate index [S], q [S, K], the distribution each was drawn from).

    q_s = softmax(S_s(previous choice, .) / temperature) over the K candidates; the draw is
    by inverse CDF from the given uniforms (drawn outside, so this runs in a CUDA graph).
    Every row of a slot is drawn with that slot's one uniform and the path then reads the row
    of its previous choice: the uniform of slot s is independent of the choices before it,
    so each pick is an exact draw from its row, the same pick a slot-by-slot walk makes.
    The verifier must use exactly these q rows for rejection sampling to stay lossless.
    """
    s, k = lattice_SKK.shape[:2]
    q_all = torch.softmax(lattice_SKK / temperature, dim=-1)  # [S, K(prev), K]
    cdf = q_all.cumsum(-1)
    # u * total: a cumulative sum that ends a hair under 1 never makes u miss every bin.
    u = uniforms_S.to(cdf.dtype).view(s, 1, 1) * cdf[..., -1:]
    choice = torch.searchsorted(cdf.contiguous(), u.contiguous()).squeeze(-1).clamp(max=k - 1)
    picks = _follow(choice)
    prev = torch.cat([picks.new_zeros(1), picks[:-1]])
    rows = q_all.gather(1, prev.view(s, 1, 1).expand(s, 1, k)).squeeze(1)
    return picks, rows
