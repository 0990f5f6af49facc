"""GRPO math against slow, obvious references written from the formulas (CPU, random tensors)."""
import math

import pytest
import torch

import grpo
from grpo import LossNorm
from grpo import LossSettings as S


def reference_loss(logp, old, ref, adv, mask, loss_type, eps_lo, eps_hi, beta, max_len,
                   micro_batches=1, keep=None, delta=0.0, cispo_cap=None, kl_correction=True,
                   sapo=None, vespo=None, dppo=None, off_policy=0.0, weight=None):
    """A per-token Python loop: the formulas of GRPO_NOTES.md and of each objective's paper, one
    token at a time. keep[i][t] = 0 drops token t's policy-gradient term (top_entropy_quantile), not
    its KL or its count; delta: the unclipped term's ratio capped at delta (INTELLECT-2); cispo_cap:
    CISPO's -sg(min(rho, cap)) A logp; sapo (tau+, tau-): -(4/tau) sigmoid(tau (rho - 1)) A; vespo
    (k+, lambda+, k-, lambda-): -phi(w) A logp with phi(w) = exp(lambda) w^k exp(-lambda w), w the
    completion's ratio; dppo (low, high, kl_tau): -[token kept] A rho + kl_tau log^2 rho, a token
    dropped when its probability rose past high (A > 0) or fell past low (A <= 0); off_policy: a
    completion with A < 0 whose mean (old - logp) passes it loses its policy term; weight: the
    sampler's importance weights (VESPO multiplies them into w instead); kl_correction: the k3
    term times rho."""
    N, C = logp.shape
    seq_terms, total, tokens = [], 0.0, 0
    for i in range(N):
        s, n = 0.0, 0
        ts = [t for t in range(C) if mask[i, t] != 0]
        a = float(adv[i])
        drop = bool(off_policy and a < 0 and ts and sum(
            float(old[i, t] - logp[i, t].detach()) for t in ts) / len(ts) > off_policy)
        if vespo:  # the completion's weight, from its log-ratio (clamped as TRL)
            log_w = sum(min(max(float(logp[i, t].detach() - old[i, t]), -20), 20) for t in ts)
            if weight is not None:
                log_w += sum(min(max(math.log(max(float(weight[i, t]), 1e-300)), math.log(1e-8)),
                                 20) for t in ts)
            log_w = min(max(log_w, math.log(1e-8)), 20)
            k, lam = (vespo[0], vespo[1]) if a >= 0 else (vespo[2], vespo[3])
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
        for t in ts:
            rho = torch.exp(logp[i, t] - old[i, t])
            clipped = torch.clamp(rho, 1 - eps_lo, 1 + eps_hi)
            unclipped = torch.clamp(rho, max=delta) if delta else rho
            l_t = -torch.minimum(unclipped * a, clipped * a)
            if cispo_cap is not None:
                l_t = -min(rho.item(), cispo_cap) * a * logp[i, t]
            if sapo:
                tau = sapo[0] if a > 0 else sapo[1]
                l_t = -4 / tau * torch.sigmoid(tau * (rho - 1)) * a
            if vespo:
                l_t = -phi * a * logp[i, t]
            if dppo:
                moved = math.exp(logp[i, t].item()) - math.exp(old[i, t].item())
                out = moved > dppo[1] if a > 0 else moved < -dppo[0]
                l_t = -(0.0 if out else 1.0) * a * rho + dppo[2] * (logp[i, t] - old[i, t]) ** 2
            if drop:
                l_t = 0.0 * l_t
            if weight is not None and not vespo:
                l_t = l_t * float(weight[i, t])
            if keep is not None and not keep[i][t]:
                l_t = 0.0 * l_t
            if beta > 0:
                d = ref[i, t] - logp[i, t]
                l_t = l_t + beta * (torch.exp(d) - d - 1) * (rho if kl_correction else 1.0)
            s, n = s + l_t, n + 1
        seq_terms.append(s / max(n, 1))
        total, tokens = total + s, tokens + n
    if loss_type == "grpo":
        return sum(seq_terms) / N
    if loss_type == "bnpo":
        return total / tokens / micro_batches
    if loss_type == "dr_grpo":
        return total / (N * max_len)
    return total / tokens  # dapo


def random_batch(N=6, C=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(N, C, generator=g) * 3).requires_grad_()
    old = (logp.detach() + 0.3 * torch.randn(N, C, generator=g))
    ref = (logp.detach() + 0.2 * torch.randn(N, C, generator=g))
    adv = torch.randn(N, generator=g)
    lengths = torch.randint(1, C + 1, (N,), generator=g)
    mask = (torch.arange(C)[None] < lengths[:, None]).float()
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_each_loss_type_matches_the_per_token_loop_in_value_and_gradient(loss_type, beta):
    logp, old, ref, adv, mask = random_batch()
    N, C = logp.shape
    norm = LossNorm(loss_type, N, int(mask.sum()), C, 1)
    loss, _ = grpo.grpo_loss(logp, old, ref, adv, mask, norm, S(0.2, 0.28, beta))
    (g,) = torch.autograd.grad(loss, logp)
    logp2 = logp.detach().clone().requires_grad_()
    expected = reference_loss(logp2, old, ref, adv, mask, loss_type, 0.2, 0.28, beta, C)
    (g2,) = torch.autograd.grad(expected, logp2)
    assert torch.allclose(loss, expected, atol=1e-6)
    assert torch.allclose(g, g2, atol=1e-6)
    assert g.abs().sum() > 0


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("variant", [{"delta": 1.5}, {"cispo_cap": 1.2}])
def test_two_sided_clip_and_cispo_match_the_per_token_loop_in_value_and_gradient(
        loss_type, beta, variant):
    """delta and CISPO against the loop; both act on this batch (ratios up to ~2.5), so each gives
    another gradient than the plain clipped objective."""
    logp, old, ref, adv, mask = random_batch(seed=1)
    N, C = logp.shape
    norm = LossNorm(loss_type, N, int(mask.sum()), C, 1)
    loss, _ = grpo.grpo_loss(logp, old, ref, adv, mask, norm, S(0.2, 0.28, beta, **variant))
    (g,) = torch.autograd.grad(loss, logp)
    lp = logp.detach().clone().requires_grad_()
    expected = reference_loss(lp, old, ref, adv, mask, loss_type, 0.2, 0.28, beta, C, **variant)
    (g2,) = torch.autograd.grad(expected, lp)
    assert torch.allclose(loss, expected, atol=1e-6) and torch.allclose(g, g2, atol=1e-6)
    plain, _ = grpo.grpo_loss(logp, old, ref, adv, mask, norm, S(0.2, 0.28, beta))
    (g0,) = torch.autograd.grad(plain, logp)
    assert not torch.allclose(g, g0, atol=1e-4)


def test_two_sided_clip_zeroes_the_gradient_of_negative_advantages_past_delta_only():
    """rho = 3 > delta = 2: with A < 0 no gradient (plain clip: -A rho, a gradient); with A > 0 the
    upper clip already held it; rho = 1.5 < delta with A < 0: unchanged. clip_delta counts the
    first."""
    logp = torch.zeros(4, 1, requires_grad=True)
    # rho = 3, 3, 1.5, 3
    old = torch.log(torch.tensor([[1 / 3.0], [1 / 3.0], [1 / 1.5], [1 / 3.0]]))
    adv, mask = torch.tensor([-1.0, 1.0, -1.0, 1.0]), torch.ones(4, 1)
    norm = LossNorm("dapo", 4, 4, 1, 1)
    grads = []
    for delta in (0.0, 2.0):
        loss, stats = grpo.grpo_loss(logp, old, None, adv, mask, norm, S(0.2, 0.28, delta=delta))
        grads.append(torch.autograd.grad(loss, logp)[0].flatten().tolist())
    assert grads[0] == pytest.approx([0.75, 0.0, 0.375, 0.0]) \
        and grads[1] == pytest.approx([0.0, 0.0, 0.375, 0.0])
    assert stats["clip_delta_sum"] == 1.0  # row 0 only: rows 1 and 3 pass delta with A > 0


def test_cispo_keeps_the_gradient_where_the_clip_drops_it_and_equals_it_on_policy():
    """rho = 2, A > 0: the clip gives no gradient, CISPO a capped one (weight min(2, 1.5) = 1.5);
    on-policy both give -A per token. CISPO's cap counts as clip_high."""
    logp = torch.zeros(2, 1, requires_grad=True)
    # rho = 2, 0.5
    old, adv, mask = torch.log(torch.tensor([[0.5], [2.0]])), \
        torch.tensor([1.0, -1.0]), torch.ones(2, 1)
    norm = LossNorm("dapo", 2, 2, 1, 1)
    clip, clip_stats = grpo.grpo_loss(logp, old, None, adv, mask, norm, S(0.2, 0.28))
    cispo, stats = grpo.grpo_loss(logp, old, None, adv, mask, norm, S(0.2, 0.28, cispo_cap=1.5))
    # both outside the clip
    assert torch.autograd.grad(clip, logp)[0].flatten().tolist() == [0.0, 0.0]
    # weights 1.5, 0.5; / 2
    assert torch.autograd.grad(cispo, logp)[0].flatten().tolist() == pytest.approx([-0.75, 0.25])
    assert (clip_stats["clip_high_sum"], clip_stats["clip_low_sum"]) == (1.0, 1.0)
    # only the cap clips under CISPO
    assert (stats["clip_high_sum"], stats["clip_low_sum"]) == (1.0, 0.0)
    lp, _, _, adv, mask = random_batch()
    norm = LossNorm("grpo", 6, int(mask.sum()), 7, 1)
    g = [torch.autograd.grad(grpo.grpo_loss(lp, None, None, adv, mask, norm, S(cispo_cap=cap))[0],
                             lp)[0] for cap in (None, 5.0)]
    assert torch.allclose(g[0], g[1], atol=1e-7) and g[0].abs().sum() > 0


def test_dr_grpo_divides_by_max_completion_length_not_by_tokens():
    logp, old, ref, adv, mask = random_batch()
    a = grpo.aggregate(torch.ones_like(logp), mask, LossNorm("dr_grpo", 6, int(mask.sum()), 100, 1))
    assert math.isclose(float(a), float(mask.sum()) / (6 * 100), rel_tol=1e-6)


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo"])
def test_gradient_does_not_depend_on_micro_batch_size(loss_type):
    logp, old, ref, adv, mask = random_batch(N=8, C=9, seed=3)
    grads = []
    for size in (8, 3, 1):
        lp = logp.detach().clone().requires_grad_()
        slices = [slice(s, min(s + size, 8)) for s in range(0, 8, size)]
        norm = LossNorm(loss_type, 8, int(mask.sum()), 9, len(slices))
        total = 0.0
        for sl in slices:
            loss, _ = grpo.grpo_loss(lp[sl], old[sl], ref[sl], adv[sl], mask[sl], norm,
                                     S(0.2, 0.28, 0.04))
            loss.backward()
            total += float(loss.detach())
        grads.append((lp.grad.clone(), total))
    for g, total in grads[1:]:
        assert torch.allclose(g, grads[0][0], atol=1e-6)
        assert math.isclose(total, grads[0][1], rel_tol=1e-5, abs_tol=1e-7)


def test_bnpo_does_depend_on_micro_batch_size_as_documented():
    logp, old, ref, adv, mask = random_batch(N=8, C=9, seed=3)
    values = []
    for size in (8, 3):
        slices = [slice(s, min(s + size, 8)) for s in range(0, 8, size)]
        norm = LossNorm("bnpo", 8, int(mask.sum()), 9, len(slices))
        values.append(sum(float(grpo.grpo_loss(logp[s], old[s], ref[s], adv[s], mask[s],
                                               norm)[0].detach()) for s in slices))
        slow = sum(reference_loss(logp[s], old[s], ref[s], adv[s], mask[s], "bnpo", 0.2, 0.2, 0.0,
                                  9, len(slices)) for s in slices)
        # the mean of the micro-batches' token means
        assert values[-1] == pytest.approx(float(slow.detach()), rel=1e-5)
    assert not math.isclose(values[0], values[1], rel_tol=1e-4)


def test_on_policy_ratio_is_one_but_still_carries_the_gradient():
    logp, _, _, adv, mask = random_batch()
    norm = LossNorm("dapo", 6, int(mask.sum()), 7, 1)
    loss, stats = grpo.grpo_loss(logp, None, None, adv, mask, norm)
    assert stats["ratio_sum"] == pytest.approx(stats["tokens"])
    (g,) = torch.autograd.grad(loss, logp)
    # d/dlogp of -A * exp(logp - sg(logp)) is -A: every unmasked token gets -A_i / tokens
    expected = -(adv[:, None] * mask) / mask.sum()
    assert torch.allclose(g, expected, atol=1e-7)


def test_clip_fractions_count_tokens_where_the_clip_is_active():
    logp = torch.zeros(4, 2)
    # rho = .5, 1.5
    old = torch.log(torch.tensor([[1 / 0.5, 1.0], [1 / 1.5, 1.0], [1 / 0.5, 1.0], [1 / 1.5, 1.0]]))
    adv = torch.tensor([-1.0, 1.0, 1.0, -1.0])
    mask = torch.ones(4, 2)
    _, s = grpo.grpo_loss(logp, old, None, adv, mask, LossNorm("dapo", 4, 8, 2, 1), S(0.2, 0.28))
    # row 0: rho .5 < .8 with A < 0 -> low; row 1: rho 1.5 > 1.28 with A > 0 -> high;
    # rows 2, 3: the same ratios, the other sign of A: not clipped (min picks the unclipped term)
    assert (s["clip_low_sum"], s["clip_high_sum"], s["tokens"]) == (1.0, 1.0, 8.0)
    for row, low, high in ((0, 1.0, 0.0), (1, 0.0, 1.0), (2, 0.0, 0.0), (3, 0.0, 0.0)):
        # each row on its own
        _, s = grpo.grpo_loss(logp[row:row + 1], old[row:row + 1], None, adv[row:row + 1],
                              mask[row:row + 1], LossNorm("dapo", 1, 2, 2, 1), S(0.2, 0.28))
        assert (s["clip_low_sum"], s["clip_high_sum"]) == (low, high), row


def test_kl_is_zero_when_policy_equals_reference_and_positive_otherwise():
    logp, _, _, adv, mask = random_batch()
    norm = LossNorm("dapo", 6, int(mask.sum()), 7, 1)
    _, same = grpo.grpo_loss(logp, None, logp.detach(), adv, mask, norm, S(beta=0.1))
    assert same["kl_sum"] == 0.0
    _, diff = grpo.grpo_loss(logp, None, logp.detach() + 0.5, adv, mask, norm, S(beta=0.1))
    assert diff["kl_sum"] > 0
    d = torch.tensor(0.5)
    assert diff["kl_sum"] / diff["tokens"] == pytest.approx(float(torch.exp(d) - d - 1), rel=1e-5)


@pytest.mark.parametrize("old_given", [False, True])
def test_extreme_log_probs_outside_the_mask_leave_the_gradient_finite(old_given):
    # a padding token's log-prob can be anything: exp(ref - logp) overflows to inf there, and
    # masking the loss afterwards still gives it a 0 * inf = NaN gradient, spreading to every weight
    logp = torch.tensor([[-1.0, -1.0, -95.0]], requires_grad=True)
    ref = torch.tensor([[-1.1, -0.9, -2.0]])
    old = torch.tensor([[-1.0, -1.0, -300.0]]) if old_given else None
    mask, adv = torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([1.0])
    loss, stats = grpo.grpo_loss(logp, old, ref, adv, mask, LossNorm("dapo", 1, 2, 3, 1),
                                 S(beta=0.04))
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(g).all() and g[0, 2] == 0
    expected = reference_loss(logp.detach().clone().requires_grad_(),
                              logp.detach() if old is None else old,
                              ref, adv, mask, "dapo", 0.2, 0.2, 0.04, 3)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), abs=1e-6)
    assert stats["kl_sum"] == pytest.approx(sum(math.exp(d) - d - 1 for d in (-0.1, 0.1)), rel=1e-5)


def test_group_advantages_in_the_three_scale_modes():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])  # group 2 has zero std
    g = torch.tensor([1.0, 0.0, 0.0, 0.0])
    std = g.std()  # unbiased: sqrt(1/4 * 4/3)
    adv = grpo.group_advantages(r, 4, "group")
    assert torch.allclose(adv[:4], (g - 0.25) / (std + 1e-4))
    assert torch.equal(adv[4:], torch.zeros(4))
    none = grpo.group_advantages(r, 4, "none")
    assert torch.allclose(none, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))
    batch = grpo.group_advantages(r, 4, "batch")
    assert torch.allclose(batch, none / (r.std() + 1e-4))
    with pytest.raises(ValueError):
        grpo.group_advantages(r, 4, "bogus")


def test_skipped_rewards_are_left_out_of_their_groups_advantages():
    """fallback: skip leaves NaN rewards: each group's mean and std are over its other rewards (a
    slow per-group reference), a skipped completion gets 0, a group with < 2 rewards gets 0."""
    nan = float("nan")
    r = torch.tensor([1.0, nan, 0.0, 0.0, nan, nan, nan, 3.0, 0.5, nan, 1.5, 1.0])  # G=4: B=3
    for scale in ("group", "batch", "none"):
        adv = grpo.group_advantages(r, 4, scale)
        kept = torch.tensor([x for x in r.tolist() if x == x])
        want = []
        for g in range(3):
            vals = [x for x in r[4 * g:4 * g + 4].tolist() if x == x]
            for x in r[4 * g:4 * g + 4].tolist():
                if x != x or len(vals) < 2:
                    want.append(0.0)
                    continue
                mean = sum(vals) / len(vals)
                std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
                div = {"group": std + 1e-4, "batch": float(kept.std()) + 1e-4, "none": 1.0}[scale]
                want.append((x - mean) / div)
        assert torch.allclose(adv, torch.tensor(want), atol=1e-6), scale
    # group 2 has one reward left
    assert grpo.zero_std_groups(r, 4).tolist() == [False, True, False]
    assert torch.equal(grpo.group_advantages(torch.full((4,), nan), 4, "batch"), torch.zeros(4))


def test_equal_rewards_get_exactly_zero_advantage_despite_rounding_in_the_mean():
    r = torch.full((8,), 1.4583333730697632)  # fp32 mean of these is off by an ulp
    assert torch.equal(grpo.group_advantages(r, 8, "group"), torch.zeros(8))
    noisy = torch.tensor([0.5, 0.5 + 1e-7, 0.5, 0.5], dtype=torch.float64)
    assert torch.equal(grpo.group_advantages(noisy, 4, zero_std_tol=1e-6),
                       torch.zeros(4, dtype=torch.float64))


def test_zero_std_groups_use_a_tolerance_for_noisy_judge_scores():
    r = torch.tensor([0.7, 0.7 + 1e-9, 0.7, 0.7, 0.1, 0.9, 0.5, 0.5], dtype=torch.float64)
    assert grpo.zero_std_groups(r, 4, tol=1e-6).tolist() == [True, False]
    assert grpo.zero_std_groups(r, 4, tol=0.0).tolist() == [False, False]
    # exactly equal is equal at tol 0
    assert grpo.zero_std_groups(torch.ones(4), 4, tol=0.0).tolist() == [True]


def slow_normalize_then_sum(rewards, weights, G, eps=1e-4, tol=1e-6):
    """GDPO's sum, a group, a reward and a completion at a time, in plain Python."""
    N, K = len(rewards), len(weights)
    out = [0.0] * N
    for lo in range(0, N, G):
        for k in range(K):
            vals = [rewards[i][k] for i in range(lo, lo + G) if not math.isnan(rewards[i][k])]
            if len(vals) < 2 or max(vals) - min(vals) <= tol:
                continue  # no spread: this reward adds nothing to the group
            mean = sum(vals) / len(vals)
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
            for i in range(lo, lo + G):
                if not math.isnan(rewards[i][k]):
                    out[i] += weights[k] * (rewards[i][k] - mean) / (std + eps)
    return out


def test_normalize_then_sum_matches_the_per_group_loop_with_missing_and_flat_rewards():
    torch.manual_seed(0)
    r = torch.randn(12, 3) * torch.tensor([1.0, 10.0, 0.1])  # (N=12, K=3): B=3 groups of G=4
    r[1, 0] = r[6, 2] = math.nan  # no value (does not apply, or skipped)
    r[4:8, 1] = 2.5  # reward 1 flat in group 1
    r[8:12, 2] = math.nan  # reward 2 absent from group 2
    r[9, 2] = 0.3  # ... but for one completion: fewer than 2 values, no spread
    w = torch.tensor([1.0, 0.5, 2.0])
    got = grpo.normalize_then_sum(r, w, 4)
    assert torch.allclose(got, torch.tensor(slow_normalize_then_sum(r.tolist(), w.tolist(), 4)),
                          atol=1e-5)
    assert torch.isfinite(got).all()


def test_normalize_then_sum_keeps_apart_what_the_weighted_sum_merges():
    """Completions 0 and 2 each meet one reward (sum 1 both); normalised, meeting the reward that
    one completion in four meets counts for more than meeting the one two in four meet (GDPO's
    point: the sum collapses distinct combinations). Each reward's scale divides out."""
    r = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # (4, 2)
    w = torch.tensor([1.0, 1.0])
    assert (r * w).sum(1)[0] == (r * w).sum(1)[2]
    got = grpo.normalize_then_sum(r, w, 4)
    assert got[2] > got[0] > got[3]
    assert torch.allclose(got, grpo.normalize_then_sum(r * torch.tensor([1.0, 100.0]), w, 4),
                          atol=1e-3)


def test_completion_mask_keeps_the_real_eos_when_pad_equals_eos():
    eos = 2  # pad is also 2
    ids = torch.tensor([[5, 6, 2, 2, 2],    # EOS at 2, then padding that looks like EOS
                        [2, 2, 2, 2, 2],    # immediate EOS
                        [5, 6, 7, 8, 9]])   # no EOS: truncated
    mask, truncated = grpo.completion_mask(ids, [eos])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]


def test_completion_mask_accepts_several_eos_ids():
    mask, truncated = grpo.completion_mask(torch.tensor([[5, 7, 9, 3]]), [3, 7])
    assert mask.tolist() == [[1, 1, 0, 0]] and truncated.tolist() == [False]


def test_importance_weights_scale_the_policy_gradient_term_only():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    adv, w = torch.tensor([2.0]), torch.tensor([[0.5, 3.0]])
    plain, _, kl = grpo.per_token_loss(logp, logp, ref, adv, torch.ones_like(logp), S(beta=0.1))
    weighted, _, _ = grpo.per_token_loss(logp, logp, ref, adv, torch.ones_like(logp), S(beta=0.1),
                                         is_weight=w)
    pg = plain - 0.1 * kl  # rho = 1: the policy-gradient term is -A per token
    assert torch.allclose(pg, torch.tensor([[-2.0, -2.0]]))
    assert torch.allclose(weighted, w * pg + 0.1 * kl)


def reference_sequence_loss(logp, old, ref, adv, mask, loss_type, eps_lo, eps_hi, beta, weight,
                            keep=None, kl_correction=True):
    """GSPO from its formula, one completion at a time: s_i = exp(mean over its tokens of logp -
    old), l_it = -k_it w_it min(s_i A_i, clip(s_i, 1 - eps_lo, 1 + eps_hi) A_i) + beta s_i KL_it on
    each of its tokens (s_i without kl_correction; k_it 0/1 from keep). LUSPO (loss_type luspo):
    the completions' sums, averaged."""
    N, C = logp.shape
    per_seq, total, tokens = [], 0.0, 0
    for i in range(N):
        ts = [t for t in range(C) if mask[i, t] > 0]
        if not ts:  # nothing to train on (masked out): no loss, no ratio
            per_seq.append(0.0)
            continue
        s = torch.exp(sum(logp[i, t] - old[i, t] for t in ts) / len(ts))
        pg = -torch.minimum(s * adv[i], torch.clamp(s, 1 - eps_lo, 1 + eps_hi) * adv[i])
        terms = [pg * weight[i, t] * (1.0 if keep is None else float(keep[i, t]))
                 + beta * (s if kl_correction else 1.0) * (
                     torch.exp(ref[i, t] - logp[i, t]) - (ref[i, t] - logp[i, t]) - 1) for t in ts]
        per_seq.append(sum(terms) / len(ts))
        total, tokens = total + sum(terms), tokens + len(ts)
    if loss_type == "luspo":
        return total / N
    return sum(per_seq) / N if loss_type == "grpo" else total / tokens


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("beta, weighted", [(0.0, False), (0.04, True)])
def test_sequence_level_ratio_matches_gspo_formula_in_value_and_gradient(loss_type, beta, weighted):
    logp, old, ref, adv, mask = random_batch(N=16, seed=3)
    # ratios near 1, so that a small clip cuts some and not all
    old = logp.detach() + 0.05 * (old - logp.detach())
    mask[5] = 0  # a completion masked out whole (truncated, or its reward skipped)
    weight = (0.5 + torch.rand(logp.shape, generator=torch.Generator().manual_seed(1))) \
        if weighted else torch.ones_like(logp)
    N, C = logp.shape
    norm = LossNorm(loss_type, N, int(mask.sum()), C, 1)
    loss, stats = grpo.grpo_loss(logp, old, ref, adv, mask, norm,
                                 S(3e-3, 4e-3, beta, sequence=True),
                                 is_weight=weight if weighted else None)
    (g,) = torch.autograd.grad(loss, logp)
    logp2 = logp.detach().clone().requires_grad_()
    expected = reference_sequence_loss(logp2, old, ref, adv, mask, loss_type, 3e-3, 4e-3, beta,
                                       weight)
    (g2,) = torch.autograd.grad(expected, logp2)
    assert torch.allclose(loss, expected, atol=1e-6) and torch.allclose(g, g2, atol=1e-6) \
        and torch.isfinite(g).all()
    lengths = mask.sum(1)
    s = torch.exp(((logp.detach() - old) * mask).sum(1) / lengths.clamp(min=1))  # (N,)
    # each token counts its completion's
    assert stats["ratio_sum"] == pytest.approx(float((lengths * s).sum()), rel=1e-6)
    low, high = (s < 1 - 3e-3) & (adv < 0), (s > 1 + 4e-3) & (adv > 0)
    assert stats["clip_low_sum"] == float(lengths[low].sum()) \
        and stats["clip_high_sum"] == float(lengths[high].sum())
    assert (low | high).any() and not (low | high).all()
    if beta == 0 and not weighted:
        # a clipped completion gets no gradient at all, an unclipped one the same on each token
        for i in range(N):
            kept = g[i][mask[i] > 0]
            assert kept.numel() == 0 or (kept.abs().sum() == 0) == bool(low[i] | high[i])
            assert torch.allclose(kept, kept[:1].expand_as(kept), atol=1e-7)


def test_a_nan_log_prob_at_a_masked_position_stays_out_of_the_sequence_ratio():
    logp, old, _, adv, mask = random_batch(seed=5)
    mask[0, -1] = 0
    with torch.no_grad():
        logp[0, -1] = float("nan")
    norm = LossNorm("grpo", logp.shape[0], int(mask.sum()), logp.shape[1], 1)
    loss, _ = grpo.grpo_loss(logp, old, None, adv, mask, norm, S(sequence=True))
    assert torch.isfinite(loss) and torch.isfinite(torch.autograd.grad(loss, logp)[0]).all()


def test_on_policy_the_sequence_ratio_gives_the_token_level_gradient():
    """rho = 1 exactly: GSPO's gradient with loss_type grpo is the token-level grpo gradient."""
    logp, _, _, adv, mask = random_batch(seed=4)
    norm = LossNorm("grpo", logp.shape[0], int(mask.sum()), logp.shape[1], 1)
    grads = [torch.autograd.grad(grpo.grpo_loss(logp, None, None, adv, mask, norm,
                                                S(sequence=lv == "sequence"))[0], logp)[0]
             for lv in ("token", "sequence")]
    assert torch.allclose(grads[0], grads[1], atol=1e-7) and grads[0].abs().sum() > 0


def test_high_entropy_mask_keeps_the_masked_tokens_at_or_above_the_quantile():
    """Against numpy's quantile (linear interpolation) of masked entropies; padding never counts."""
    import numpy as np
    g = torch.Generator().manual_seed(7)
    h = torch.rand(6, 9, generator=g) * 4  # (N, C) distinct values
    mask = (torch.arange(9)[None] < torch.tensor([9, 3, 5, 1, 9, 7])[:, None]).float()
    values = h[mask.bool()].numpy()
    for q in (0.2, 0.5, 0.9):
        tau = np.quantile(values, 1 - q)
        expected = mask.bool() & (h >= float(tau))
        got = grpo.high_entropy_mask(h, mask, q)
        assert torch.equal(got, expected), q
        assert abs(int(got.sum()) - q * len(values)) <= 1  # about that share of the tokens
        # huge entropies in the padding
        padded = torch.where(mask.bool(), h, torch.full_like(h, 1e9))
        assert torch.equal(grpo.high_entropy_mask(padded, mask, q), got)
    assert torch.equal(grpo.high_entropy_mask(h, mask, 1.0), mask.bool())
    top = grpo.high_entropy_mask(h, mask, 0.0)
    assert int(top.sum()) == 1 and h[top].item() == values.max()
    assert not grpo.high_entropy_mask(h, torch.zeros_like(mask), 0.2).any()


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_tokens_left_out_by_keep_lose_their_policy_gradient_only(loss_type, beta):
    """keep drops a token's clipped-surrogate term; its KL term and place in the normaliser stay."""
    logp, old, ref, adv, mask = random_batch(seed=11)
    keep = torch.rand(logp.shape, generator=torch.Generator().manual_seed(2)) < 0.4  # (N, C)
    N, C = logp.shape
    norm = LossNorm(loss_type, N, int(mask.sum()), C, 1)
    loss, _ = grpo.grpo_loss(logp, old, ref, adv, mask, norm, S(0.2, 0.28, beta), keep=keep)
    (g,) = torch.autograd.grad(loss, logp)
    logp2 = logp.detach().clone().requires_grad_()
    expected = reference_loss(logp2, old, ref, adv, mask, loss_type, 0.2, 0.28, beta, C, keep=keep)
    (g2,) = torch.autograd.grad(expected, logp2)
    assert torch.allclose(loss, expected, atol=1e-6) and torch.allclose(g, g2, atol=1e-6)
    dropped = mask.bool() & ~keep
    if beta == 0:
        assert g[dropped].abs().sum() == 0 and g[mask.bool() & keep].abs().sum() > 0
    else:
        assert g[dropped].abs().sum() > 0  # the KL still pulls


# ------------------------------------------- the objectives beyond the clip, and their knobs

OBJECTIVE_CASES = {  # LossSettings' fields -> reference_loss's arguments
    "sapo": ({"sapo": (1.0, 1.05)}, {"sapo": (1.0, 1.05)}),
    "sapo_steep": ({"sapo": (8.0, 10.0)}, {"sapo": (8.0, 10.0)}),
    "vespo": ({"vespo": (2.0, 3.0, 3.0, 2.0)}, {"vespo": (2.0, 3.0, 3.0, 2.0)}),
    "dppo": ({"dppo": (0.05, 0.05, 1e-2)}, {"dppo": (0.05, 0.05, 1e-2)}),
    "off_policy_mask": ({"off_policy_mask": 0.05}, {"off_policy": 0.05}),
    "no_kl_correction": ({"kl_bias_correction": False}, {"kl_correction": False}),
}


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("case", sorted(OBJECTIVE_CASES))
@pytest.mark.parametrize("weighted", [False, True])
def test_each_objective_matches_the_per_token_loop_in_value_and_gradient(loss_type, beta, case,
                                                                        weighted):
    """SAPO, VESPO, DPPO + KL, the off-policy mask and the uncorrected KL against the loop,
    off-policy (ratios up to ~2.5), with and without a sampler's importance weights; each gives
    another gradient than the plain clip (the uncorrected KL only with beta > 0)."""
    logp, old, ref, adv, mask = random_batch(seed=1)
    weight = 0.5 + torch.rand(logp.shape, generator=torch.Generator().manual_seed(3)) \
        if weighted else None
    N, C = logp.shape
    norm = LossNorm(loss_type, N, int(mask.sum()), C, 1)
    ours, theirs = OBJECTIVE_CASES[case]
    loss, _ = grpo.grpo_loss(logp, old, ref, adv, mask, norm, S(0.2, 0.28, beta, **ours),
                             is_weight=weight)
    (g,) = torch.autograd.grad(loss, logp)
    lp = logp.detach().clone().requires_grad_()
    expected = reference_loss(lp, old, ref, adv, mask, loss_type, 0.2, 0.28, beta, C,
                              weight=weight, **theirs)
    (g2,) = torch.autograd.grad(expected, lp)
    assert torch.allclose(loss, expected, atol=1e-6) and torch.allclose(g, g2, atol=1e-6)
    plain, _ = grpo.grpo_loss(logp, old, ref, adv, mask, norm, S(0.2, 0.28, beta),
                              is_weight=weight)
    (g0,) = torch.autograd.grad(plain, logp)
    assert torch.allclose(g, g0, atol=1e-4) == (case == "no_kl_correction" and beta == 0)


@pytest.mark.parametrize("case", sorted(OBJECTIVE_CASES))
def test_on_policy_every_objective_gives_the_clips_gradient(case):
    """rho = 1 exactly: SAPO's gate has slope 1, VESPO's weight is 1, DPPO masks nothing and its
    log^2 term has no gradient, the off-policy mask drops nothing (beta 0)."""
    logp, _, _, adv, mask = random_batch(seed=4)
    norm = LossNorm("dapo", logp.shape[0], int(mask.sum()), logp.shape[1], 1)
    grads = [torch.autograd.grad(grpo.grpo_loss(logp, None, None, adv, mask, norm, S(**ours))[0],
                                 logp)[0] for ours in ({}, OBJECTIVE_CASES[case][0])]
    assert torch.allclose(grads[0], grads[1], atol=1e-7) and grads[0].abs().sum() > 0


def test_the_corrected_kl_has_the_reverse_kl_gradient_and_the_plain_one_the_forward():
    """By hand, A = 0 so only the KL term acts, on-policy (rho = 1) and at rho = 2, with
    d = ref_t - logp_t: corrected, d(rho KL_t)/d logp_t = rho (e^d - d - 1) + rho (1 - e^d) =
    -rho d (the ratio's own derivative is rho); plain, d KL_t / d logp_t = 1 - e^d."""
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref, adv, mask = torch.tensor([[-1.5, -0.5]]), torch.tensor([0.0]), torch.ones(1, 2)
    norm = LossNorm("dr_grpo", 1, 2, 1, 1)  # the sum of the terms, undivided
    d = ref - logp.detach()
    for rho in (1.0, 2.0):
        old = logp.detach() - math.log(rho)
        for corrected, want in ((True, rho * -d), (False, 1 - torch.exp(d))):
            loss, _ = grpo.grpo_loss(logp, old, ref, adv, mask, norm,
                                     S(beta=1.0, kl_bias_correction=corrected))
            (g,) = torch.autograd.grad(loss, logp)
            assert torch.allclose(g, want, atol=1e-6), (rho, corrected)


def test_sapo_vespo_and_dppo_by_hand():
    """SAPO at rho = 1: the value -2A/tau, the gradient -A; VESPO's weight is 1 at w = 1 and peaks
    at w = k / lambda; DPPO drops an A > 0 token whose probability rose by more than mask_high
    (0.6 -> 0.8) and keeps one that rose less (0.6 -> 0.7)."""
    logp = torch.log(torch.tensor([[0.6]])).requires_grad_()
    adv, mask, norm = torch.tensor([2.0]), torch.ones(1, 1), LossNorm("dapo", 1, 1, 1, 1)
    loss, _ = grpo.grpo_loss(logp, None, None, adv, mask, norm, S(sapo=(4.0, 4.0)))
    assert float(loss.detach()) == pytest.approx(-2 * 2.0 / 4.0)
    assert float(torch.autograd.grad(loss, logp)[0]) == pytest.approx(-2.0)
    s = S(vespo=(2.0, 3.0, 3.0, 2.0))

    def phi(w):  # a one-token completion with ratio w and A > 0
        return float(grpo.vespo_weight(torch.log(torch.tensor([[w]])), torch.zeros(1, 1),
                                       torch.tensor([[1.0]]), mask, s, None))
    assert phi(1.0) == pytest.approx(1.0)
    assert phi(2 / 3) == pytest.approx(math.exp(3) * (2 / 3) ** 2 * math.exp(-2))
    assert phi(2 / 3) > phi(0.6) and phi(2 / 3) > phi(0.7)  # the peak, k / lambda
    for new, kept in ((0.8, False), (0.7, True)):
        lp = torch.log(torch.tensor([[new]])).requires_grad_()
        loss = grpo.dppo(lp, torch.log(torch.tensor([[0.6]])), torch.tensor([[new / 0.6]]),
                         torch.tensor([[1.0]]), mask, S(dppo=(0.15, 0.15, 0.0)), None)
        assert (float(loss.detach()) != 0) == kept


def test_the_off_policy_mask_drops_only_stale_negative_completions():
    """Row 0: A < 0, mean(old - logp) = 0.3 > 0.2: dropped. Row 1: A < 0, 0.1: kept. Row 2: A > 0,
    0.3: kept (a positive sample is never stale in this sense). Padding does not count (row 1's
    masked token would push its mean past 0.2)."""
    logp = torch.zeros(3, 2)
    old = torch.tensor([[0.3, 0.3], [0.1, 5.0], [0.3, 0.3]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    keep = grpo.off_policy_keep(logp, old, torch.tensor([-1.0, -1.0, 1.0]), mask, 0.2)
    assert keep.flatten().tolist() == [0.0, 1.0, 1.0]


@pytest.mark.parametrize("weighted", [False, True])
def test_luspo_and_top_entropy_at_sequence_level_match_the_gspo_loop(weighted):
    """loss_type luspo: each completion's summed terms (GSPO's ratio times its length), averaged;
    top_entropy_quantile with GSPO's one ratio a completion, as TRL: the dropped tokens' terms are
    0 (the completion's ratio still takes their log-probs), and the pairing now runs."""
    logp, old, ref, adv, mask = random_batch(N=12, seed=6)
    old = logp.detach() + 0.05 * (old - logp.detach())
    keep = torch.rand(logp.shape, generator=torch.Generator().manual_seed(8)) < 0.5
    weight = 0.5 + torch.rand(logp.shape, generator=torch.Generator().manual_seed(9)) \
        if weighted else torch.ones_like(logp)
    N, C = logp.shape
    for loss_type, k in (("luspo", None), ("grpo", keep), ("luspo", keep)):
        norm = LossNorm(loss_type, N, int(mask.sum()), C, 1)
        loss, _ = grpo.grpo_loss(logp, old, ref, adv, mask, norm,
                                 S(3e-3, 4e-3, 0.04, sequence=True),
                                 is_weight=weight if weighted else None, keep=k)
        (g,) = torch.autograd.grad(loss, logp)
        lp = logp.detach().clone().requires_grad_()
        expected = reference_sequence_loss(lp, old, ref, adv, mask, loss_type, 3e-3, 4e-3, 0.04,
                                           weight, keep=k)
        (g2,) = torch.autograd.grad(expected, lp)
        assert torch.allclose(loss, expected, atol=1e-6) and torch.allclose(g, g2, atol=1e-6)


def test_the_sampler_weights_floor_raises_or_masks_low_ratios():
    """tis_min: truncate modes clip the ratio to [floor, cap], mask modes zero it outside; 'capped'
    counts both ends. Ratios 0.1, 0.5, 1, 4 with floor 0.3 and cap 2."""
    rho = torch.tensor([[0.1, 0.5, 1.0, 4.0]])
    mask = torch.ones_like(rho)
    for mode, want in (("token_truncate", [0.3, 0.5, 1.0, 2.0]),
                       ("token_mask", [0.0, 0.5, 1.0, 0.0])):
        sums = dict.fromkeys(grpo.TIS_SUMS, 0.0)
        w = grpo.sampler_weight(torch.log(rho), torch.zeros_like(rho), mask, 2.0, sums, mode, 0.3)
        assert w.flatten().tolist() == pytest.approx(want) and sums["capped"] == 2.0, mode
    seq = grpo.sampler_weight(torch.log(rho), torch.zeros_like(rho), mask, 2.0, None,
                              "sequence_truncate", 0.3)  # product 0.2: raised to 0.3
    assert seq.flatten().tolist() == pytest.approx([0.3] * 4)


def slow_entropy_bonus(entropy, mask, keep, coef, micro_batches):
    """coef x the mean entropy over the tokens in the policy term, / M, by a loop."""
    total, n = 0.0, 0
    for i in range(entropy.shape[0]):
        for t in range(entropy.shape[1]):
            if mask[i, t] and (keep is None or keep[i, t]):
                total, n = total + entropy[i, t], n + 1
    return coef * total / max(n, 1) / micro_batches


@pytest.mark.parametrize("with_keep", [False, True])
def test_the_entropy_bonus_subtracts_the_mean_entropy_of_the_policy_terms_tokens(with_keep):
    logp, _, _, adv, mask = random_batch(seed=12)
    entropy = (torch.rand(logp.shape, generator=torch.Generator().manual_seed(5)) * 3
               ).requires_grad_()
    keep = (torch.rand(logp.shape, generator=torch.Generator().manual_seed(6)) < 0.5) \
        if with_keep else None
    norm = LossNorm("dapo", logp.shape[0], int(mask.sum()), logp.shape[1], 2)
    plain, _ = grpo.grpo_loss(logp, None, None, adv, mask, norm, S(), keep=keep)
    loss, stats = grpo.grpo_loss(logp, None, None, adv, mask, norm, S(entropy_coef=0.1),
                                 keep=keep, entropy=(entropy, 0.1))
    want = slow_entropy_bonus(entropy, mask, keep, 0.1, 2)
    assert torch.allclose(plain - loss, want, atol=1e-6)
    (g,) = torch.autograd.grad(loss, entropy)
    (g2,) = torch.autograd.grad(-want, entropy)
    assert torch.allclose(g, g2) and g.abs().sum() > 0
    assert stats["entropy_tokens"] == float((mask if keep is None else mask * keep).sum())


def test_adaptive_entropy_control_follows_skywork_or1s_rule():
    """The coefficient applies only once an update's entropy was <= target (none measured yet: not),
    steps by delta within [min, max]; replayed against a slow simulation of the rule."""
    s = S(entropy_coef=0.01, adaptive_entropy=(0.0, 0.02, 0.005, 0.5))
    state, applied = {}, []
    entropies = [0.9, 0.4, 0.3, 0.2, 0.1, 0.7, 0.8, 0.9, 0.4]
    for h in entropies:
        applied.append(grpo.entropy_coef_now(s, state))
        grpo.control_entropy(s, state, {"entropy_sum": 2 * h, "entropy_tokens": 2.0})
    coef, last, want = 0.01, math.inf, []
    for h in entropies:
        want.append(coef if last <= 0.5 else 0.0)
        coef = min(coef + 0.005, 0.02) if h <= 0.5 else max(coef - 0.005, 0.0)
        last = h
    assert applied == pytest.approx(want) and applied[0] == 0.0 and max(applied) == 0.02
    grpo.control_entropy(s, state, {"entropy_sum": 0.0, "entropy_tokens": 0.0})  # nothing measured
    assert state["entropy_coef"] == pytest.approx(coef) and state["entropy_last"] == 0.4
    assert grpo.entropy_coef_now(S(entropy_coef=0.3), {}) == 0.3  # static: the config's


def test_one_objective_at_a_time():
    with pytest.raises(ValueError, match="one objective at a time"):
        S(sapo=(1.0, 1.0), dppo=(0.2, 0.2, 1e-3))
    assert S().objective == "clip" and S(cispo_cap=5.0).objective == "cispo" \
        and S(vespo=(2.0, 3.0, 3.0, 2.0)).objective == "vespo"
