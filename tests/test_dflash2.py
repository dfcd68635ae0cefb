"""DFlash2's modules: the convolution stays in its block, both modules start as no-ops, the
selector's scores, lattice and walks, and its training term (misses, gradient, tau)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_spec, random_docs
from test_drafter import CONFIGS, train_forward

from dflash_trainer.core.anchors import block_input_ids, sample_anchors
from dflash_trainer.core.dflash2 import (
    CandidateSelector,
    GroupedDynamicConv,
    is_dflash2_tensor,
    walk_greedy,
    walk_sample,
)
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.core.geometry import dflash2_problems, init_differences
from dflash_trainer.core.packing import pack_documents
from dflash_trainer.core.selector_loss import selector_terms

pytestmark = pytest.mark.usefixtures("one_thread")


def randomize(conv: GroupedDynamicConv, seed: int = 0) -> GroupedDynamicConv:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        conv.base_kernel.copy_(
            torch.randn(conv.base_kernel.shape, generator=g, dtype=torch.float64)
        )
        w = conv.kernel_projection.weight
        w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float64) * 0.3)
    return conv


def naive_conv(conv: GroupedDynamicConv, side: int, x: torch.Tensor, blk: int):
    """The definition, one slot and channel group at a time (D straight from the projection)."""
    q, h = x.shape
    d = conv.kernel_projection(x).view(q, 2, conv.kernel_size, h // conv.group_size)
    out = torch.zeros_like(x)
    g = conv.group_size
    for t in range(q):
        pos = t % blk
        for j in range(conv.kernel_size):
            if pos - j < 0:
                continue
            coef = conv.base_kernel[side, j].clone()
            for grp in range(h // g):
                coef[grp * g : (grp + 1) * g] += d[t, side, j, grp]
            out[t] += coef * x[t - j]
    return out


@pytest.mark.parametrize(("k", "g", "blk"), [(2, 4, 4), (3, 8, 5), (1, 16, 3), (4, 2, 4)])
def test_conv_equals_its_definition_block_by_block(k, g, blk):
    torch.manual_seed(0)
    conv = randomize(GroupedDynamicConv(32, k, g).double())
    x = torch.randn(3 * blk, 32, dtype=torch.float64)
    w = conv.coefficients(x)
    for side in (0, 1):
        got = conv.apply_side(side, x, w, blk)
        torch.testing.assert_close(got, naive_conv(conv, side, x, blk))


def test_conv_never_crosses_a_block_and_is_causal_inside_it():
    torch.manual_seed(0)
    blk = 4
    conv = randomize(GroupedDynamicConv(16, 3, 4).double())
    x = torch.randn(5 * blk, 16, dtype=torch.float64)
    y0 = conv.apply_side(1, x, conv.coefficients(x), blk)
    for t in range(x.shape[0]):
        x2 = x.clone()
        x2[t] += 1.0
        # The coefficients are recomputed from the changed input too, as in the layer.
        y1 = conv.apply_side(1, x2, conv.coefficients(x2), blk)
        changed = (y1 - y0).abs().sum(-1) > 0
        start = (t // blk) * blk
        expect = torch.zeros_like(changed)
        expect[t : min(t + 3, start + blk)] = True  # 3 taps: slots t, t+1, t+2 of its block
        assert torch.equal(changed, expect), t


def test_conv_and_selector_start_as_exact_identities():
    conv = GroupedDynamicConv(16, 2, 4)
    x = torch.randn(8, 16)
    d = conv.coefficients(x)
    assert torch.equal(conv.apply_side(0, x, d, 4), x)
    assert torch.equal(conv.apply_side(1, x, d, 4), x)
    sel = CandidateSelector(16, 50, 8)
    u = torch.randn(6, 5)
    scores = sel(torch.randn(6, 16), torch.randint(0, 50, (6,)), torch.randint(0, 50, (6, 5)), u)
    assert torch.equal(scores, u)


def _backbone_copy(spec2, dflash: DFlashDrafter) -> DFlashDrafter:
    model = DFlashDrafter(spec2)
    missing, unexpected = model.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and missing and all(is_dflash2_tensor(k) for k in missing)
    return model


@pytest.mark.parametrize("cfg", CONFIGS[:3])
def test_dflash2_on_a_dflash_backbone_equals_dflash_until_trained(cfg):
    torch.manual_seed(0)
    spec = make_spec(**cfg)
    spec2 = make_spec(**cfg, kind="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=4)
    d1 = DFlashDrafter(spec).double().eval()
    d2 = _backbone_copy(spec2, d1).double().eval()
    ids, masks = random_docs([23, 41], vocab=spec.vocab_size - 1)
    pack = pack_documents(ids, masks)
    anchors = sample_anchors(pack, 16, spec.block_size, torch.Generator().manual_seed(1))
    feats = torch.randn(pack.length, spec.num_context_features, dtype=torch.float64)
    emb = torch.randn(spec.vocab_size, spec.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(
            train_forward(d1, pack, anchors, feats, emb),
            train_forward(d2, pack, anchors, feats, emb),
        )
        # The same after any change to the DFlash2 modules' inputs but not their weights; and
        # different once the convolution is no longer the identity.
        for layer in d2.layers:
            randomize(layer.attention_conv)
        assert not torch.equal(
            train_forward(d1, pack, anchors, feats, emb),
            train_forward(d2, pack, anchors, feats, emb),
        )


@pytest.mark.parametrize("cfg", CONFIGS)
def test_dflash2_training_forward_equals_inference_step(cfg):
    """With trained (random) convolutions, the packed training forward of many blocks equals
    one block at a time against the cache: the convolution stays inside each block."""
    torch.manual_seed(0)
    spec = make_spec(**cfg, kind="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=4)
    model = DFlashDrafter(spec).double().eval()
    for i, layer in enumerate(model.layers):
        randomize(layer.attention_conv, i)
        randomize(layer.mlp_conv, 100 + i)
    ids, masks = random_docs([23, 41, 30], vocab=spec.vocab_size - 1)
    pack = pack_documents(ids, masks)
    anchors = sample_anchors(pack, 24, spec.block_size, torch.Generator().manual_seed(1))
    feats = torch.randn(pack.length, spec.num_context_features, dtype=torch.float64)
    emb_table = torch.randn(spec.vocab_size, spec.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        train = train_forward(model, pack, anchors, feats, emb_table)
        for n in range(anchors.num_real):
            a, start = int(anchors.anchor_idx_N[n]), int(anchors.doc_start_N[n])
            cache = model.new_cache()
            model.extend_cache(cache, feats[start:a], torch.arange(a - start))
            blk = block_input_ids(anchors, pack.input_ids_T, spec.mask_token_id)[n]
            step = model.step(cache, emb_table[blk], a - start)
            torch.testing.assert_close(step, train[n], atol=1e-10, rtol=1e-9)


def test_dflash2_rules_and_init_differences():
    bad = make_spec(kind="dflash2", conv_group_size=7, conv_kernel_size=9, selector_top_k=500)
    problems = dflash2_problems(bad)
    assert len(problems) == 3
    assert "conv_group_size=7 does not divide hidden_size=64" in problems[0]
    assert "conv_kernel_size=9 exceeds block_size=4" in problems[1]
    assert "selector_top_k=500 exceeds the target vocabulary" in problems[2]
    assert dflash2_problems(make_spec()) == []
    one, two = make_spec(), make_spec(kind="dflash2", selector_top_k=8)
    assert init_differences(one, two) == {}  # a DFlash backbone may start DFlash2
    assert "kind" in init_differences(two, one)  # not the other way round
    assert init_differences(make_spec(block=8), two) == {}  # block size is no weight shape
    assert "num_layers" in init_differences(make_spec(layers=3), two)


def brute_greedy(lattice: torch.Tensor) -> list[int]:
    picks, row = [], 0
    for s in range(lattice.shape[0]):
        row = int(lattice[s, row].argmax())
        picks.append(row)
    return picks


def test_lattice_matches_teacher_forced_scores_and_the_walks():
    torch.manual_seed(0)
    sel = CandidateSelector(12, 40, 6).double()
    with torch.no_grad():
        sel.successor_codebook.normal_()
    s, k = 5, 4
    hidden = torch.randn(s, 12, dtype=torch.float64)
    cand = torch.stack([torch.randperm(40)[:k] for _ in range(s)])
    unary = torch.randn(s, k, dtype=torch.float64)
    anchor = torch.tensor(7)
    lat = sel.lattice(hidden, anchor, cand, unary)
    for slot in range(s):
        for i in range(k):
            prev = anchor if slot == 0 else cand[slot - 1, i]
            row = sel(
                hidden[slot : slot + 1], prev.view(1), cand[slot : slot + 1], unary[slot : slot + 1]
            )
            torch.testing.assert_close(lat[slot, i], row[0])
    assert walk_greedy(lat).tolist() == brute_greedy(lat)
    # Sampling at a tiny temperature is the greedy walk; q rows are distributions.
    picks, q = walk_sample(lat, 1e-4, torch.rand(s, dtype=torch.float64))
    assert picks.tolist() == brute_greedy(lat)
    torch.testing.assert_close(q.sum(-1), torch.ones(s, dtype=torch.float64))


def test_walk_sample_draws_from_q():
    torch.manual_seed(0)
    lat = torch.randn(2, 3, 3, dtype=torch.float64)
    counts = torch.zeros(3)
    n = 4000
    us = torch.rand(n, 2, dtype=torch.float64)
    for u in us:
        picks, _ = walk_sample(lat, 1.0, u)
        counts[picks[0]] += 1
    expect = torch.softmax(lat[0, 0], -1) * n
    assert ((counts - expect).abs() / expect.sqrt()).max() < 4.5


def stepwise_sample(lattice: torch.Tensor, temperature: float, uniforms: torch.Tensor):
    """The walk slot by slot: each slot's row picked by the previous choice, then drawn."""
    picks, rows, prev = [], [], 0
    for s in range(lattice.shape[0]):
        q = torch.softmax(lattice[s, prev] / temperature, -1)
        cdf = q.cumsum(0)
        prev = int(
            torch.searchsorted(cdf, (uniforms[s] * cdf[-1]).view(1)).clamp(max=q.numel() - 1)
        )
        picks.append(prev)
        rows.append(q)
    return picks, torch.stack(rows)


@pytest.mark.parametrize("slots", [1, 2, 3, 7, 15, 16])
def test_batched_walks_equal_the_slot_by_slot_walks(slots):
    torch.manual_seed(slots)
    for trial in range(30):
        k = 1 + trial % 6
        # Integer scores make ties common: both must break them to the lower index.
        lat = (
            torch.randint(-2, 3, (slots, k, k)).double() if trial % 2 else torch.randn(slots, k, k)
        )
        assert walk_greedy(lat).tolist() == brute_greedy(lat)
        u = torch.rand(slots, dtype=torch.float64)
        picks, q = walk_sample(lat, 0.7, u)
        want_picks, want_q = stepwise_sample(lat, 0.7, u)
        assert picks.tolist() == want_picks
        torch.testing.assert_close(q, want_q.to(q.dtype))


def _selector_case():
    torch.manual_seed(0)
    n, b, h, v, k = 3, 5, 8, 30, 4
    sel = CandidateSelector(h, v, 6).double()
    with torch.no_grad():
        sel.successor_codebook.normal_()
    hidden = torch.randn(n, b, h, dtype=torch.float64, requires_grad=True)
    label = torch.randint(0, v, (n, b))
    cand = torch.stack([torch.randperm(v)[:k] for _ in range(n * b)]).view(n, b, k)
    # Put the label among the candidates everywhere except two slots.
    where = torch.randint(0, k, (n, b))
    cand.scatter_(-1, where[..., None], label[..., None])
    cand[0, 2] = torch.tensor([v - 1, v - 2, v - 3, v - 4])
    label[0, 2] = 0  # not a candidate: a miss
    cand[1, 3, 0] = label[1, 3] = 5
    cand[1, 3, 1:] = torch.tensor([6, 7, 8])
    logits = torch.randn(n, b, k, dtype=torch.float64)
    valid = torch.ones(n, b, dtype=torch.bool)
    valid[:, 0] = False
    valid[2, 4] = False
    anchors = torch.randint(0, v, (n,))
    return sel, hidden, anchors, label, cand, logits, valid


def test_selector_term_leaves_misses_out_and_counts_them():
    sel, hidden, anchors, label, cand, logits, valid = _selector_case()
    real = torch.ones(3, dtype=torch.bool)
    w = valid.double()
    loss, m = selector_terms(sel, hidden, anchors, label, cand, logits, valid, real, w)
    slots = int(valid.sum())
    assert float(m["candidate_recall"]) == pytest.approx((slots - 1) / slots)
    # The loss by hand: CE over the candidates, predecessor = anchor / previous label.
    num, den = 0.0, 0.0
    for i in range(3):
        for kk in range(1, 5):
            if not valid[i, kk] or (i, kk) == (0, 2):
                continue
            prev = anchors[i] if kk == 1 else label[i, kk - 1]
            s = sel(
                hidden[i, kk : kk + 1], prev.view(1), cand[i, kk : kk + 1], logits[i, kk : kk + 1]
            )[0]
            tgt = int((cand[i, kk] == label[i, kk]).nonzero()[0])
            num += float((torch.logsumexp(s, 0) - s[tgt]).detach())
            den += 1
    assert float(loss.detach()) == pytest.approx(num / den)
    # A miss contributes nothing: changing its candidates' logits leaves the loss.
    logits2 = logits.clone()
    logits2[0, 2] += 5.0
    loss2, _ = selector_terms(sel, hidden, anchors, label, cand, logits2, valid, real, w)
    assert float(loss2.detach()) == pytest.approx(float(loss.detach()))
    # Oracle: every covered slot right; selector tau never above it.
    assert float(m["selector_tau"]) <= float(m["oracle_tau"])
    # Block 0: slots 1 covered, 2 missed -> oracle run of 1 (tau 2); block 2: slots 1-3 (tau 4).
    assert float(m["oracle_tau"]) == pytest.approx((2 + 5 + 4) / 3)


def test_selector_term_gradient_reaches_codebooks_gate_and_hidden_not_logits():
    sel, hidden, anchors, label, cand, logits, valid = _selector_case()
    logits.requires_grad_(True)
    real = torch.ones(3, dtype=torch.bool)
    loss, _ = selector_terms(sel, hidden, anchors, label, cand, logits, valid, real, valid.double())
    loss.backward()
    assert logits.grad is None  # unary scores are detached
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    for p in sel.parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0

    # Central differences on a few codebook entries agree with the analytic gradient.
    grad = sel.successor_codebook.grad.clone()
    rows = cand[cand == label[..., None].expand_as(cand)][:3].tolist()
    for r in rows:
        for c in (0, 3):
            with torch.no_grad():
                sel.successor_codebook[r, c] += 1e-6
                up, _ = selector_terms(
                    sel, hidden, anchors, label, cand, logits, valid, real, valid.double()
                )
                sel.successor_codebook[r, c] -= 2e-6
                down, _ = selector_terms(
                    sel, hidden, anchors, label, cand, logits, valid, real, valid.double()
                )
                sel.successor_codebook[r, c] += 1e-6
            assert float(grad[r, c]) == pytest.approx(float(up - down) / 2e-6, rel=1e-5, abs=1e-9)


def test_selector_tau_is_the_walked_acceptance():
    """Teacher-forced prefix of right picks == the greedy walk's accepted drafts (per block)."""
    torch.manual_seed(3)
    h, v, k, b = 8, 20, 3, 6
    sel = CandidateSelector(h, v, 4).double()
    with torch.no_grad():
        sel.successor_codebook.normal_(std=2.0)
    for trial in range(30):
        hidden = torch.randn(1, b, h, dtype=torch.float64)
        cand = torch.stack([torch.randperm(v)[:k] for _ in range(b)]).view(1, b, k)
        logits = torch.randn(1, b, k, dtype=torch.float64)
        label = cand[0, torch.arange(b), torch.randint(0, k, (b,))].view(1, b)
        anchor = torch.randint(0, v, (1,))
        valid = torch.ones(1, b, dtype=torch.bool)
        valid[:, 0] = False
        _, m = selector_terms(
            sel,
            hidden,
            anchor,
            label,
            cand,
            logits,
            valid,
            torch.ones(1, dtype=torch.bool),
            valid.double(),
        )
        lat = sel.lattice(hidden[0, 1:], anchor[0], cand[0, 1:], logits[0, 1:])
        walked = cand[0, 1:].gather(1, walk_greedy(lat)[:, None]).squeeze(1)
        acc = 0
        while acc < b - 1 and walked[acc] == label[0, acc + 1]:
            acc += 1
        assert float(m["selector_tau"]) == acc + 1, trial


def test_top_candidates_break_ties_by_id_so_candidate_zero_is_the_argmax():
    from dflash_trainer.core.fused_head import top_candidates

    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [2.0, 2.0, 1.0, 2.0, 0.0]])
    vals, ids = top_candidates(logits, 4)
    assert ids.tolist() == [[1, 2, 4, 0], [0, 1, 3, 2]]
    assert vals.tolist() == [[3.0, 3.0, 3.0, 1.0], [2.0, 2.0, 2.0, 1.0]]
    assert torch.equal(ids[:, 0], logits.argmax(-1))


def test_selector_lr_scale_gives_only_the_selector_a_larger_step():
    """training.selector_lr_scale multiplies the selector's lr through warmup and cosine; the
    convolutions and backbone keep lr, and scale 1 keeps the two groups checkpoints hold."""
    from dflash_trainer.config import TrainingConfig
    from dflash_trainer.train.optim import build_optimizer, build_scheduler

    model = DFlashDrafter(make_spec(kind="dflash2", conv_group_size=8, selector_rank=8))
    plain = build_optimizer(model, TrainingConfig(lr=1e-3))
    assert [g["weight_decay"] for g in plain.param_groups] == [0.01, 0.0]
    t = TrainingConfig(lr=1e-3, selector_lr_scale=30.0, warmup_ratio=0.5)
    opt = build_optimizer(model, t)
    sched = build_scheduler(opt, t, total_steps=4)
    selector = {id(p) for p in model.candidate_selector.parameters()}
    for g in opt.param_groups:
        inside = {id(p) in selector for p in g["params"]}
        assert len(inside) == 1  # a group is all selector or none of it
        want = 1e-3 * (30.0 if inside == {True} else 1.0) * 0.5  # warmup step 1 of 2
        assert g["lr"] == pytest.approx(want)
    n_sel = sum(len(g["params"]) for g in opt.param_groups if id(g["params"][0]) in selector)
    assert n_sel == len(selector) and {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters()
    }
    # One Adam step moves each touched entry by about its group's lr: the zero successor
    # codebook leaves zero by 30x the conv kernel projection's (also zero) step.
    model.candidate_selector.successor_codebook.grad = torch.ones_like(
        model.candidate_selector.successor_codebook
    )
    conv = model.layers[0].attention_conv.kernel_projection.weight
    conv.grad = torch.ones_like(conv)
    opt.step()
    sched.step()
    succ = model.candidate_selector.successor_codebook.detach().abs().max()
    assert float(succ) == pytest.approx(30 * float(conv.detach().abs().max()), rel=1e-3)
