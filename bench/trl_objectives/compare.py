"""minigrpo's loss against TRL 1.16's own GRPOTrainer, objective by objective (issue 54).

Not part of the test suite: it needs TRL, which the tests never import (they read this script's
numbers from tests/fixtures/trl_objectives.json). Run from the repository root, in a scratch venv:

    python3 -m venv /tmp/trlvenv
    /tmp/trlvenv/bin/pip install trl==1.16.0 torch==2.13.0 transformers==5.23.0 pytest pyyaml
    OMP_NUM_THREADS=1 /tmp/trlvenv/bin/python bench/trl_objectives/compare.py \\
        --fixtures tests/fixtures/trl_objectives.json | tee bench/trl_objectives/compare.log

How. For each TRL configuration a real GRPOTrainer is built (its own __init__ reads the config) on
the tests' tiny Llama; its compute_loss runs on inputs made here, with only its log-prob forward
(_get_per_token_logps_and_entropies) replaced: it returns the sampled tokens' log-probs and the
entropies, both computed from one float64 leaf of logits (N, C, V), so both carry their gradient.
minigrpo's grpo.grpo_loss gets the same tensors, with its settings built from minigrpo's own config
keys (config.GrpoConfig -> grpo.LossSettings.of), as a run builds them. Compared: the two losses
and the two gradients with respect to the logits. The importance-sampling bounds
(vllm_importance_sampling_clip_min) go one step further back: TRL's _generate_and_score_completions
runs with use_vllm on and its sampler, rewards and forward replaced, so that TRL's own code makes
the importance_sampling_ratio from the sampler's log-probs, against grpo.sampler_weight on the same
log-probs; that ratio then enters both losses (VESPO's included). Adaptive entropy control is
compared over several updates: TRL's coefficient after each against grpo.control_entropy's.

The grid: every loss TRL has (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo) x beta 0 and
0.04, with and without use_bias_correction_kl x off_policy_mask_threshold x entropy_coef x
top_entropy_quantile (at sequence level too, under luspo and GSPO) x on- and off-policy x seeds,
then the importance-sampling modes with and without a lower bound. A case agrees when both the
loss and every gradient entry are within 1e-12 (float64); the log gives the largest differences.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import grpo  # noqa: E402  (the repository's, after the path)
from config import GrpoConfig  # noqa: E402

N, C, V, P, G = 4, 5, 7, 3, 4  # completions, completion length, vocabulary, prompt length, group
TOL = 1e-12


# ----------------------------------------------------------------------------- the inputs


def make_inputs(seed: int, off_policy: bool, sampler_noise: float = 0.4) -> dict:
    """One micro-batch, float64: logits (N, C, V) (the leaf both losses differentiate), sampled ids,
    a mask of uneven lengths (one completion of a single token), advantages, old, reference and
    sampler log-probs."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, C, V, generator=g, dtype=torch.float64) * 1.5
    ids = torch.randint(0, V, (N, C), generator=g)
    lengths = torch.tensor([C, 3, 1, 4])[torch.randperm(N, generator=g)]
    mask = (torch.arange(C)[None] < lengths[:, None]).long()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old = logp + 0.35 * torch.randn(N, C, generator=g, dtype=torch.float64) if off_policy else None
    return {"seed": seed, "off_policy": off_policy, "logits": logits, "ids": ids, "mask": mask,
            "adv": torch.randn(N, generator=g, dtype=torch.float64),
            "old": old, "ref": logp + 0.3 * torch.randn(N, C, generator=g, dtype=torch.float64),
            "sampler": ((logp if old is None else old)  # float32 values: TRL's pipeline holds
                        + sampler_noise * torch.randn(N, C, generator=g, dtype=torch.float64)  # so
                        ).float().double()}


def forward(logits: torch.Tensor, ids: torch.Tensor) -> tuple:
    """The log-prob forward both sides get: a fresh leaf -> (leaf, log-probs, entropies)."""
    leaf = logits.clone().requires_grad_()
    logp_all = torch.log_softmax(leaf, -1)  # (N, C, V)
    return leaf, logp_all.gather(-1, ids[..., None])[..., 0], -(logp_all.exp() * logp_all).sum(-1)


# ----------------------------------------------------------------------------- TRL's side


def zero_reward(completions, **kwargs) -> list[float]:
    return [0.0] * len(completions)


def build_trainer(trl_kwargs: dict, model_dir: Path, out: Path):
    """A real GRPOTrainer of these GRPOConfig settings, quiet, in train mode."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=N, num_generations=G,
                      max_completion_length=C, use_cpu=True, bf16=False, report_to="none",
                      logging_strategy="no", save_strategy="no", disable_tqdm=True,
                      log_completions=False, **trl_kwargs)
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=zero_reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["hi"] * 8}))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # HF's training loop sets it
    return trainer


def trl_inputs(x: dict, trl_kwargs: dict, is_ratio: torch.Tensor | None) -> dict:
    inputs = {"prompt_ids": torch.ones(N, P, dtype=torch.long),
              "prompt_mask": torch.ones(N, P, dtype=torch.long), "completion_ids": x["ids"],
              "completion_mask": x["mask"], "advantages": x["adv"],
              "num_items_in_batch": x["mask"].sum()}
    if x["old"] is not None:
        inputs["old_per_token_logps"] = x["old"]
    if trl_kwargs.get("beta"):
        inputs["ref_per_token_logps"] = x["ref"]
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return inputs


def trl_loss(trainer, x: dict, trl_kwargs: dict, is_ratio=None) -> tuple[float, torch.Tensor]:
    """TRL's compute_loss on x -> (loss, d loss / d logits)."""
    leaf, logp, ent = forward(x["logits"], x["ids"])
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, ent, None)
    loss = trainer.compute_loss(trainer.model, trl_inputs(x, trl_kwargs, is_ratio))
    loss.backward()
    return float(loss.detach()), leaf.grad


def trl_importance_ratio(trainer, x: dict) -> torch.Tensor:
    """TRL's own importance_sampling_ratio: _generate_and_score_completions with use_vllm on, its
    sampler returning x's ids and sampler log-probs, its forward x's old log-probs."""
    lengths = x["mask"].sum(1).tolist()
    ids = [x["ids"][i, :n].tolist() for i, n in enumerate(lengths)]
    samp = [x["sampler"][i, :n].tolist() for i, n in enumerate(lengths)]
    old = x["old"] if x["old"] is not None else forward(x["logits"], x["ids"])[1].detach()
    trainer.use_vllm = True
    trainer._generate = lambda prompts: ([[1] * P] * N, ids, None, ["x"] * N, samp, {}, None, None)
    trainer._calculate_rewards = lambda *a, **k: torch.zeros(N, 1)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (old.clone(), None, None)
    with contextlib.redirect_stderr(io.StringIO()):
        out = trainer._generate_and_score_completions([{"prompt": "hi"}] * N)
    ratio = out["importance_sampling_ratio"]
    return ratio.expand(N, C) if ratio.shape[1] == 1 else ratio


# ----------------------------------------------------------------------------- minigrpo's side


def settings_of(ours: dict) -> grpo.LossSettings:
    """grpo.LossSettings as a run builds it, from minigrpo's config keys."""
    return grpo.LossSettings.of(GrpoConfig(**ours))


def minigrpo_loss(x: dict, ours: dict, is_weight=None, state: dict | None = None,
                  top: float = 1.0) -> tuple[float, torch.Tensor, dict]:
    """grpo.grpo_loss on x (one micro-batch, the whole step) -> (loss, d loss / d logits, stats)."""
    s = settings_of(ours)
    leaf, logp, ent = forward(x["logits"], x["ids"])
    mask = x["mask"].to(torch.float64)
    keep = grpo.high_entropy_mask(ent.detach(), mask, top) if top < 1 else None
    norm = grpo.LossNorm(ours.get("loss_type", "dapo"), N, int(mask.sum()), C, 1)
    entropy = (ent, grpo.entropy_coef_now(s, state if state is not None else {})) \
        if s.entropy_bonus else None
    loss, stats = grpo.grpo_loss(logp, x["old"], x["ref"] if s.beta else None, x["adv"], mask,
                                 norm, s, is_weight=is_weight, keep=keep, entropy=entropy)
    loss.backward()
    return float(loss.detach()), leaf.grad, stats


# ----------------------------------------------------------------------------- the grid

LOSSES = {  # TRL's loss_type -> (its extra GRPOConfig settings, minigrpo's keys)
    "grpo": ({}, {"loss_type": "grpo"}),
    "bnpo": ({}, {"loss_type": "bnpo"}),
    "dr_grpo": ({}, {"loss_type": "dr_grpo"}),
    "dapo": ({}, {"loss_type": "dapo"}),
    "dapo+delta": ({"delta": 1.5}, {"loss_type": "dapo", "delta": 1.5}),
    "cispo": ({"epsilon_high": 1.3}, {"loss_type": "dapo", "policy_loss": "cispo",
                                      "cispo_cap": 1.3}),
    "sapo": ({"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05},
             {"loss_type": "grpo", "policy_loss": "sapo"}),
    "sapo_steep": ({"sapo_temperature_pos": 6.0, "sapo_temperature_neg": 9.0},
                   {"loss_type": "grpo", "policy_loss": "sapo", "sapo_temperature_pos": 6.0,
                    "sapo_temperature_neg": 9.0}),
    "luspo": ({"importance_sampling_level": "sequence"},
              {"loss_type": "luspo", "importance_sampling_level": "sequence"}),
    "gspo": ({"importance_sampling_level": "sequence"},
             {"loss_type": "grpo", "importance_sampling_level": "sequence"}),
    "vespo": ({}, {"loss_type": "dapo", "policy_loss": "vespo"}),
}
TRL_LOSS_TYPE = {"dapo+delta": "dapo", "sapo_steep": "sapo", "gspo": "grpo"}


def grid() -> list[dict]:
    """Every configuration: a loss x KL (beta, correction) x off-policy mask x entropy bonus x
    top-entropy quantile."""
    out = []
    for name, kl, opm, coef, top in itertools.product(
            LOSSES, [(0.0, True), (0.04, True), (0.04, False)], [None, 0.02], [0.0, 0.05],
            [1.0, 0.5]):
        trl_extra, ours = LOSSES[name]
        trl = {"loss_type": TRL_LOSS_TYPE.get(name, name), "beta": kl[0], "epsilon_high": 0.28,
               "use_bias_correction_kl": kl[1], "off_policy_mask_threshold": opm,
               "entropy_coef": coef, "top_entropy_quantile": top, **trl_extra}
        mine = {**ours, "beta": kl[0], "use_bias_correction_kl": kl[1], "entropy_coef": coef,
                "off_policy_mask_threshold": opm or 0.0}
        out.append({"name": f"{name} beta={kl[0]} corr={kl[1]} opm={opm} ent={coef} top={top}",
                    "trl": trl, "ours": mine, "top": top})
    return out


def is_grid() -> list[dict]:
    """The importance-sampling modes, without and with a lower bound, under the clip and VESPO."""
    out = []
    for mode, low, name in itertools.product(
            ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
            (None, 0.8), ("dapo", "vespo")):
        if name == "vespo" and mode.startswith("sequence"):
            continue  # TRL refuses it, as minigrpo does
        trl = {"loss_type": name, "epsilon_high": 0.28, "vllm_importance_sampling_mode": mode,
               "vllm_importance_sampling_clip_max": 1.5, "vllm_importance_sampling_clip_min": low}
        ours = {"loss_type": "dapo", "tis_cap": 1.5, "tis_mode": mode, "tis_min": low or 0.0,
                **({"policy_loss": "vespo"} if name == "vespo" else {})}
        out.append({"name": f"{name} is={mode} min={low}", "trl": trl, "ours": ours})
    return out


def compare(a: tuple, b: tuple) -> tuple[float, float]:
    return abs(a[0] - b[0]), float((a[1] - b[1]).abs().max())


def record(x: dict, case: dict, trl: tuple, extra: dict | None = None) -> dict:
    """A fixture: the inputs, minigrpo's keys and TRL's loss and gradient."""
    def t(v):
        return None if v is None else v.tolist()
    return {"name": case["name"], "ours": case["ours"], "top": case.get("top", 1.0),
            "inputs": {k: t(x[k]) for k in ("logits", "ids", "mask", "adv", "old", "ref",
                                            "sampler")},
            "trl_loss": trl[0], "trl_grad": t(trl[1]), **(extra or {})}


def run_grid(model_dir: Path, tmp: Path, seeds: int, fixtures: list, log,
             limit: int = 0) -> list[tuple]:
    results = []
    for k, case in enumerate(grid()[:limit or None]):
        trainer = build_trainer(case["trl"], model_dir, tmp / "out")
        for seed, off in itertools.product(range(seeds), (False, True)):
            x = make_inputs(1000 * k + seed, off)
            t = trl_loss(trainer, x, case["trl"])
            m = minigrpo_loss(x, case["ours"], top=case["top"])
            results.append((case["name"] + f" seed={seed} off_policy={off}", *compare(t, m)))
            if seed == 0 and off and want_fixture(case):
                fixtures.append(record(x, case, t))
        log(f"{case['name']}: {results[-1][1]:.1e} {results[-1][2]:.1e}")
    return results


def want_fixture(case: dict) -> bool:
    """The cases the tests keep: each variant TRL has that minigrpo did not, once."""
    n = case["name"]
    return n in {
        "sapo beta=0.0 corr=True opm=None ent=0.0 top=1.0",
        "sapo_steep beta=0.04 corr=True opm=None ent=0.0 top=1.0",
        "luspo beta=0.04 corr=True opm=None ent=0.0 top=1.0",
        "vespo beta=0.0 corr=True opm=None ent=0.0 top=1.0",
        "dapo beta=0.04 corr=True opm=None ent=0.0 top=1.0",
        "dapo beta=0.04 corr=False opm=None ent=0.0 top=1.0",
        "grpo beta=0.0 corr=True opm=0.02 ent=0.0 top=1.0",
        "dapo beta=0.0 corr=True opm=None ent=0.05 top=1.0",
        "bnpo beta=0.0 corr=True opm=None ent=0.05 top=0.5",
        "gspo beta=0.0 corr=True opm=None ent=0.0 top=0.5",
        "luspo beta=0.04 corr=True opm=0.02 ent=0.05 top=0.5",
    }


def run_is(model_dir: Path, tmp: Path, seeds: int, fixtures: list, log) -> list[tuple]:
    """TRL's importance ratio from its own code, then both losses with it."""
    results = []
    for k, case in enumerate(is_grid()):
        for seed, off in itertools.product(range(seeds), (False, True)):
            trainer = build_trainer(case["trl"], model_dir, tmp / "out")
            # a completion's ratio is a product: closer samplers, or every one is masked
            x = make_inputs(50_000 + 1000 * k + seed, off,
                            0.1 if case["ours"]["tis_mode"].startswith("sequence") else 0.4)
            ratio = trl_importance_ratio(trainer, x).detach()
            s = settings_of(case["ours"])
            old = x["old"] if x["old"] is not None else forward(x["logits"], x["ids"])[1].detach()
            ours_w = grpo.sampler_weight(old, x["sampler"], x["mask"].to(torch.float64), s.tis_cap,
                                         None, s.tis_mode, s.tis_min)
            m = x["mask"].bool()
            w_diff = float((ratio - ours_w)[m].abs().max())
            t = trl_loss(trainer, x, case["trl"], is_ratio=ratio)
            mine = minigrpo_loss(x, case["ours"], is_weight=ours_w)
            d_loss, d_grad = compare(t, mine)
            results.append((case["name"] + f" seed={seed} off_policy={off}", d_loss,
                            max(d_grad, w_diff)))
            if seed == 0 and off and case["trl"]["vllm_importance_sampling_clip_min"]:
                fixtures.append(record(x, case, t, {"trl_weight": ratio.tolist()}))
        log(f"{case['name']}: {results[-1][1]:.1e} {results[-1][2]:.1e}")
    return results


def run_adaptive(model_dir: Path, tmp: Path, fixtures: list, log) -> list[tuple]:
    """Adaptive entropy control over 6 updates, entropies falling then rising through the target:
    TRL's loss, gradient and coefficient after each against minigrpo's."""
    ours = {"loss_type": "dapo", "entropy_coef": 0.01, "use_adaptive_entropy": True,
            "entropy_coef_delta": 0.01, "entropy_coef_max": 0.03, "entropy_target": 1.0}
    trl_kw = {**ours, "epsilon_high": 0.28}
    trainer, state, results, steps = build_trainer(trl_kw, model_dir, tmp / "out"), {}, [], []
    s = settings_of(ours)
    for k, scale in enumerate((0.5, 4.0, 5.0, 6.0, 0.5, 0.3)):  # a large scale: a low entropy
        x = make_inputs(90_000 + k, True)
        x["logits"] = x["logits"] * scale
        t = trl_loss(trainer, x, trl_kw)
        mine = minigrpo_loss(x, ours, state=state)
        grpo.control_entropy(s, state, mine[2])
        d_coef = abs(trainer.entropy_coef - state["entropy_coef"])
        d_loss, d_grad = compare(t, mine)
        results.append((f"adaptive update {k + 1} (logits x {scale})", d_loss,
                        max(d_grad, d_coef)))
        steps.append({**record(x, {"name": f"adaptive {k + 1}", "ours": ours}, t),
                      "trl_coef_after": trainer.entropy_coef})
        log(f"adaptive update {k + 1}: coefficient TRL {trainer.entropy_coef:.3f}, minigrpo "
            f"{state['entropy_coef']:.3f}; {d_loss:.1e} {d_grad:.1e}")
    fixtures.append({"name": "adaptive", "ours": ours, "steps": steps})
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2, help="input draws per configuration")
    ap.add_argument("--fixtures", help="write the tests' fixture cases to this JSON file")
    ap.add_argument("--limit", type=int, default=0, help="only the first N of the main grid")
    args = ap.parse_args(argv)
    import transformers
    import trl

    from conftest import write_tiny_model
    torch.set_num_threads(1)
    print(f"[compare] trl {trl.__version__}, transformers {transformers.__version__}, torch "
          f"{torch.__version__}; float64, N={N} C={C} V={V}; tolerance {TOL:g}", flush=True)
    t0, fixtures = time.time(), []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir = write_tiny_model(tmp / "tiny")

        def log(line):
            print(f"[compare] {time.time() - t0:6.0f}s {line}", flush=True)
        results = run_grid(model_dir, tmp, args.seeds, fixtures, log, args.limit)
        results += run_is(model_dir, tmp, args.seeds, fixtures, log)
        results += run_adaptive(model_dir, tmp, fixtures, log)
    bad = [r for r in results if not (r[1] <= TOL and r[2] <= TOL)]
    worst_loss, worst_grad = max(r[1] for r in results), max(r[2] for r in results)
    for name, dl, dg in bad:
        print(f"[compare] DIFFERS {name}: loss {dl:.3e}, gradient {dg:.3e}")
    print(f"[compare] {len(results) - len(bad)} of {len(results)} cases agree within {TOL:g}; "
          f"largest difference: loss {worst_loss:.2e}, gradient {worst_grad:.2e} "
          f"({time.time() - t0:.0f} s)")
    if args.fixtures:
        Path(args.fixtures).write_text(json.dumps({
            "made_by": "bench/trl_objectives/compare.py", "trl": trl.__version__,
            "cases": fixtures}, separators=(",", ":")) + "\n")
        print(f"[compare] wrote {len(fixtures)} fixture cases to {args.fixtures}")
    return 0 if not bad and not math.isnan(worst_loss) else 1


if __name__ == "__main__":
    sys.exit(main())
