"""Loss: chunked == unchunked, weights exactly as specified, metrics, all-masked steps."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_trainer.core.fused_head import fused_linear_loss, reference_linear_loss
from dflash_trainer.core.loss import (
    acceptance_metrics,
    decay_weights,
    dflash_loss,
    dpace_weights,
)


@pytest.mark.parametrize("kind", ["ce", "kl"])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_equals_unchunked_value_and_grad(kind, chunk):
    torch.manual_seed(0)
    r, h, v = 50, 16, 300
    w = torch.randn(v, h, dtype=torch.float64)
    x = torch.randn(r, h, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (r,)) if kind == "ce" else None
    th = torch.randn(r, h, dtype=torch.float64) if kind == "kl" else None
    up = torch.rand(r, dtype=torch.float64)
    loss, pred, label = fused_linear_loss(x, w, labels, th, chunk_rows=chunk)
    (loss * up).sum().backward()
    g = x.grad.clone()
    x.grad = None
    ref = reference_linear_loss(x, w, labels, th)
    (ref * up).sum().backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g, x.grad)
    assert torch.equal(pred, (x @ w.t()).argmax(-1))
    if kind == "kl":
        assert torch.equal(label, (th @ w.t()).argmax(-1))


def test_fused_loss_refuses_a_trainable_lm_head():
    w = torch.randn(10, 4, requires_grad=True)
    with pytest.raises(ValueError, match="frozen"):
        fused_linear_loss(torch.randn(3, 4), w, torch.tensor([1, 2, 3]))


def test_decay_weights_exact():
    w = decay_weights(6, gamma=4.0)
    assert w[0] == 0
    for k in range(1, 6):
        assert math.isclose(w[k].item(), math.exp(-(k - 1) / 4.0), rel_tol=1e-6)


def test_dpace_weights_match_the_definition():
    torch.manual_seed(0)
    n, b, alpha = 5, 6, 0.3
    ce = torch.rand(n, b) * 3
    valid = torch.rand(n, b) < 0.8
    valid[:, 0] = False
    w = dpace_weights(ce, valid, alpha)
    for i in range(n):
        s = [
            (1 - alpha) * math.exp(-ce[i, k].item()) + alpha if valid[i, k] else 1.0
            for k in range(b)
        ]
        prefix = [math.prod(s[: k + 1]) if valid[i, k] else 0.0 for k in range(b)]
        for k in range(b):
            want = sum(prefix[k:]) if valid[i, k] else 0.0
            assert math.isclose(w[i, k].item(), want, rel_tol=1e-5, abs_tol=1e-7)


def _loss_inputs(n=6, b=4, h=8, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, b, h, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, h, generator=g, dtype=torch.float64)
    valid = torch.rand(n, b, generator=g) < 0.7
    valid[:, 0] = False
    labels = torch.randint(0, v, (n, b), generator=g)
    return hidden, w, valid, labels


def test_dflash_loss_is_the_weighted_mean_over_valid_slots():
    hidden, w, valid, labels = _loss_inputs()
    real = torch.ones(6, dtype=torch.bool)
    res = dflash_loss(hidden, w, valid, real, labels_NB=labels, gamma=2.0, chunk_rows=5)
    ce = torch.nn.functional.cross_entropy(
        (hidden @ w.t()).reshape(-1, 50), labels.reshape(-1), reduction="none"
    ).view(6, 4)
    wk = decay_weights(4, 2.0).double()[None] * valid
    want = (wk * ce).sum() / wk.sum()
    torch.testing.assert_close(res.loss, want)
    res.loss.backward()
    g = hidden.grad.clone()
    hidden.grad = None
    want.backward()
    torch.testing.assert_close(g, hidden.grad, rtol=1e-5, atol=1e-7)
    # Invalid slots get exactly zero gradient.
    assert (g[~valid] == 0).all()


def test_all_masked_step_gives_zero_loss_and_no_nan():
    hidden, w, valid, labels = _loss_inputs()
    valid[:] = False
    for weighting in ("decay", "dpace"):
        res = dflash_loss(
            hidden, w, valid, torch.ones(6, dtype=torch.bool), labels_NB=labels, weighting=weighting
        )
        assert res.loss.item() == 0.0
        res.loss.backward()
        assert torch.isfinite(hidden.grad).all() and (hidden.grad == 0).all()
        hidden.grad = None
        assert all(torch.isfinite(v).all() for v in res.metrics.values())


def test_exact_and_expected_acceptance():
    correct = torch.tensor(
        [[True, True, True, False], [False, False, True, True], [True, True, True, True]]
    )
    valid = torch.tensor(
        [[False, True, True, True], [False, True, True, True], [False, True, True, False]]
    )
    real = torch.tensor([True, True, True])
    m = acceptance_metrics(correct, valid, real)
    # Blocks accept 2, 0 and 2 drafted tokens (the last stops at an invalid slot).
    assert math.isclose(m["exact_tau"].item(), (3 + 1 + 3) / 3, rel_tol=1e-6)
    acc = [2 / 3, 1.0, 1 / 2]
    torch.testing.assert_close(m["slot_acc"], torch.tensor(acc))
    want = 1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2]
    assert math.isclose(m["expected_tau"].item(), want, rel_tol=1e-6)


def test_padding_anchors_do_not_count():
    correct = torch.ones(3, 4, dtype=torch.bool)
    valid = torch.ones(3, 4, dtype=torch.bool)
    valid[2] = False
    m = acceptance_metrics(correct, valid, torch.tensor([True, True, False]))
    assert m["exact_tau"].item() == 4.0


def test_kl_target_labels_and_accuracy():
    hidden, w, valid, _ = _loss_inputs()
    target_hidden = hidden.detach().clone()  # drafter == target: KL 0, accuracy 1
    res = dflash_loss(
        hidden, w, valid, torch.ones(6, dtype=torch.bool), target_hidden_NBH=target_hidden
    )
    assert abs(res.loss.item()) < 1e-6
    assert res.metrics["accuracy"].item() == 1.0


# ------------------------------------------------------------------ lk (acceptance-direct)


def test_alpha_is_one_minus_total_variation_with_its_gradient():
    from dflash_trainer.core.fused_head import HeadSettings, fused_head, reference_head

    torch.manual_seed(0)
    r, h, v = 40, 12, 50
    w = torch.randn(v, h, dtype=torch.float64)
    x = torch.randn(r, h, dtype=torch.float64, requires_grad=True)
    th = torch.randn(r, h, dtype=torch.float64)
    up = torch.rand(r, dtype=torch.float64)
    for chunk in (1, 7, 100):
        rows = fused_head(x, w, None, th, HeadSettings(alpha=True, chunk_rows=chunk))
        (rows.alpha * up).sum().backward()
        g = x.grad.clone()
        x.grad = None
        _, ref = reference_head(x, w, None, th)
        (ref * up).sum().backward()
        torch.testing.assert_close(rows.alpha, ref)
        torch.testing.assert_close(g, x.grad)
        x.grad = None
        q = torch.softmax(x.detach() @ w.t(), -1)
        p = torch.softmax(th @ w.t(), -1)
        torch.testing.assert_close(rows.alpha, 1 - 0.5 * (p - q).abs().sum(-1))


def test_lk_reduces_to_the_expected_accepted_length():
    from dflash_trainer.core.loss import lk_term

    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[:, 0] = False
    real = torch.tensor([True, True])
    # Every slot accepted for sure: E[accepted] = B - 1 = 4, loss -4, tau 5.
    loss, tau = lk_term(torch.ones(2, 5), valid, real)
    assert float(loss) == -4.0 and float(tau) == 5.0
    # Never accepted: 0.
    loss, tau = lk_term(torch.zeros(2, 5), valid, real)
    assert float(loss) == 0.0 and float(tau) == 1.0
    # alpha 0.5 everywhere: 0.5 + 0.25 + 0.125 + 0.0625.
    loss, _ = lk_term(torch.full((2, 5), 0.5), valid, real)
    assert float(loss) == pytest.approx(-0.9375)
    # An unsupervised slot stops the block there; a padding block does not count.
    valid[0, 3] = False
    loss, _ = lk_term(torch.ones(2, 5), valid, torch.tensor([True, False]))
    assert float(loss) == -2.0


def test_lk_loss_trains_towards_the_target_distribution():
    """loss=lk on constructed distributions: identical drafter and target give alpha 1 on every
    slot (E[tau] = B); its gradient raises E[tau] from a perturbed drafter."""
    torch.manual_seed(0)
    n, b, h, v = 4, 5, 8, 30
    w = torch.randn(v, h, dtype=torch.float64)
    th = torch.randn(n, b, h, dtype=torch.float64)
    valid = torch.ones(n, b, dtype=torch.bool)
    valid[:, 0] = False
    real = torch.ones(n, dtype=torch.bool)
    from dflash_trainer.core.loss import Objective

    same = dflash_loss(
        th.clone().requires_grad_(True), w, valid, real, None, th, objective=Objective("lk")
    )
    assert float(same.metrics["lk_tau"]) == pytest.approx(b)
    assert float(same.loss.detach()) == pytest.approx(-(b - 1))
    hidden = (th + 0.5 * torch.randn_like(th)).requires_grad_(True)
    before = dflash_loss(hidden, w, valid, real, None, th, objective=Objective("lk"))
    before.loss.backward()
    with torch.no_grad():
        stepped = hidden - 0.5 * hidden.grad
    after = dflash_loss(stepped, w, valid, real, None, th, objective=Objective("lk"))
    assert float(after.metrics["lk_tau"]) > float(before.metrics["lk_tau"])
    # A ce loss with an lk term: ce on the target's argmax plus the weighted lk.
    mixed = dflash_loss(hidden, w, valid, real, None, th, objective=Objective("ce", lk_weight=0.3))
    plain = dflash_loss(hidden, w, valid, real, None, th, objective=Objective("ce"))
    expect = float(plain.loss.detach()) + 0.3 * float(before.metrics["lk_loss"])
    assert float(mixed.loss.detach()) == pytest.approx(expect)
