"""minigrpo's loss against numbers TRL 1.16's own GRPOTrainer produced (TRL is not imported here).

tests/fixtures/trl_objectives.json holds cases bench/trl_objectives/compare.py ran through TRL's
compute_loss (and, for the importance weights, its _generate_and_score_completions): the inputs, the
minigrpo config keys of the same setting, and TRL's loss and gradient with respect to the logits.
Each test recomputes minigrpo's side from the repository's grpo.py, as the bench does; a formula
that drifts from TRL's fails here without TRL installed. Regenerate with the bench's command.
"""
import json
from pathlib import Path

import pytest
import torch

import grpo
from config import GrpoConfig

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "trl_objectives.json").read_text())
CASES = {c["name"]: c for c in FIXTURES["cases"]}
TOL = 1e-10  # float64 throughout; the bench itself agrees to ~1e-16


def tensors(case: dict) -> dict:
    x = case["inputs"]
    out = {k: None if x[k] is None else torch.tensor(x[k], dtype=torch.float64)
           for k in ("logits", "adv", "old", "ref", "sampler")}
    mask = torch.tensor(x["mask"], dtype=torch.float64)
    return out | {"ids": torch.tensor(x["ids"]), "mask": mask}


def ours(case: dict, is_weight=None, state=None) -> tuple[float, torch.Tensor, dict]:
    """minigrpo's loss and gradient on the case, its settings from its config keys."""
    x, s = tensors(case), grpo.LossSettings.of(GrpoConfig(**case["ours"]))
    leaf = x["logits"].clone().requires_grad_()
    logp_all = torch.log_softmax(leaf, -1)  # (N, C, V)
    logp = logp_all.gather(-1, x["ids"][..., None])[..., 0]  # (N, C)
    ent = -(logp_all.exp() * logp_all).sum(-1)  # (N, C)
    N, C = logp.shape
    keep = grpo.high_entropy_mask(ent.detach(), x["mask"], case["top"]) \
        if case.get("top", 1.0) < 1 else None
    norm = grpo.LossNorm(case["ours"].get("loss_type", "dapo"), N, int(x["mask"].sum()), C, 1)
    entropy = (ent, grpo.entropy_coef_now(s, {} if state is None else state)) \
        if s.entropy_bonus else None
    loss, stats = grpo.grpo_loss(logp, x["old"], x["ref"] if s.beta else None, x["adv"], x["mask"],
                                 norm, s, is_weight=is_weight, keep=keep, entropy=entropy)
    loss.backward()
    return float(loss.detach()), leaf.grad, stats


def assert_matches_trl(case: dict, got: tuple):
    assert got[0] == pytest.approx(case["trl_loss"], abs=TOL, rel=0)
    trl_grad = torch.tensor(case["trl_grad"], dtype=torch.float64)
    assert torch.allclose(got[1], trl_grad, atol=TOL, rtol=0) and trl_grad.abs().sum() > 0


LOSS_CASES = [n for n, c in CASES.items() if "trl_grad" in c and "trl_weight" not in c]


def test_the_fixtures_cover_every_variant_trl_has_that_minigrpo_lacked():
    names = " | ".join(CASES)
    for variant in ("sapo ", "sapo_steep", "luspo", "vespo", "corr=False", "opm=0.02", "ent=0.05",
                    "gspo beta=0.0 corr=True opm=None ent=0.0 top=0.5", "is=token_truncate min=0.8",
                    "is=token_mask min=0.8", "is=sequence_truncate min=0.8",
                    "is=sequence_mask min=0.8", "adaptive"):
        assert variant in names, variant
    assert FIXTURES["trl"] == "1.16.0"


@pytest.mark.parametrize("name", LOSS_CASES)
def test_the_loss_and_gradient_equal_trls(name):
    assert_matches_trl(CASES[name], ours(CASES[name]))


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "trl_weight" in c])
def test_the_importance_weights_with_a_floor_equal_trls_and_so_does_the_loss(name):
    """TRL's importance_sampling_ratio (its own code, vllm_importance_sampling_clip_min 0.8) against
    grpo.sampler_weight with tis_min; then the loss with it (VESPO takes it into its weight)."""
    case = CASES[name]
    x, s = tensors(case), grpo.LossSettings.of(GrpoConfig(**case["ours"]))
    old = x["old"] if x["old"] is not None else torch.log_softmax(x["logits"], -1).gather(
        -1, x["ids"][..., None])[..., 0]
    weight = grpo.sampler_weight(old, x["sampler"], x["mask"], s.tis_cap, None, s.tis_mode,
                                 s.tis_min)
    m = x["mask"].bool()
    assert torch.allclose(weight[m], torch.tensor(case["trl_weight"], dtype=torch.float64)[m],
                          atol=TOL, rtol=0)
    assert_matches_trl(case, ours(case, is_weight=weight))
    if case["ours"]["tis_mode"] == "token_truncate":  # the floor acted on this draw
        assert (weight[m] == s.tis_min).any()


def test_adaptive_entropy_control_follows_trls_coefficient_update_by_update():
    """Six updates whose entropy crosses the target both ways: the loss, the gradient and the
    coefficient after each update, as TRL's trainer had them."""
    case, state = CASES["adaptive"], {}
    s = grpo.LossSettings.of(GrpoConfig(**case["ours"]))
    coefs = []
    for step in case["steps"]:
        got = ours(step, state=state)
        assert_matches_trl(step, got)
        grpo.control_entropy(s, state, got[2])
        assert state["entropy_coef"] == pytest.approx(step["trl_coef_after"], abs=1e-12)
        coefs.append(state["entropy_coef"])
    assert len(set(coefs)) > 2  # it moved both ways
