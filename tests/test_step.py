"""step.py's bookkeeping, each pinned by a test that a plausible bug would fail (written after a
mutation audit of the step found these unguarded): what the step logs, what it keeps from one
iteration to the next, what the reference is, which temperature the loss uses, and the small
helpers (micro-batches, clipping, importance weights, dynamic sampling, rows behind completions)."""
import inspect
import json
import math
from types import SimpleNamespace

import pytest
import torch

import grpo
import logprobs
import rewards
import rollout
import step
import train
from conftest import write_run_config
from run import lifecycle


def metrics_run(G: int) -> SimpleNamespace:
    """What step_metrics reads of a Run: G, the grpo settings it names, one data source."""
    grpo_cfg = SimpleNamespace(zero_std_tol=1e-6, beta=0.04, tis_cap=0.0, delta=0.0)
    return SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(num_generations=G),
                                               grpo=grpo_cfg), source_labels=["data"])


def make_run(tmp_path, tiny_llama, *overrides, **sections):
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = write_run_config(tmp_path, tiny_llama, run={"out_dir": str(tmp_path / "run")}, **sections)
    args, extra = train.parse_args(["--config", str(cfg), *overrides])
    return lifecycle.setup(args, extra)


def test_the_logged_loss_and_grad_norm_are_means_over_every_micro_batch_and_iteration(
        tmp_path, tiny_llama, monkeypatch):
    """loss = (sum of every micro-batch's loss share) / num_iterations, grad_norm = mean of the
    iterations' norms; each iteration starts from zeroed gradients (so with lr 0 both iterations see
    the same gradient)."""
    losses, norms, real_loss, real_step = [], [], grpo.grpo_loss, step.optimizer_step

    def loss(*a, **k):
        out = real_loss(*a, **k)
        losses.append(float(out[0].detach()))
        return out

    def opt(r):
        out = real_step(r)
        norms.append(out[0])
        return out
    monkeypatch.setattr(grpo, "grpo_loss", loss)
    monkeypatch.setattr(step, "optimizer_step", opt)
    r = make_run(tmp_path, tiny_llama, "--grpo.num_iterations=2", "--optim.micro_batch_size=3",
                 "--rollout.max_new_tokens=12", "--optim.lr=0.0", "--optim.max_grad_norm=0")
    m, _ = step.train_step(r)
    assert len(losses) == 2 * 3 and len(norms) == 2  # 8 completions in micro-batches of 3, twice
    assert m["loss"] == pytest.approx(sum(losses) / 2, rel=1e-6, abs=1e-12)
    assert m["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-6) and norms[0] > 0
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)  # not the sum of two iterations' gradients


def test_a_second_iteration_is_off_policy_and_the_reference_is_the_policy_without_its_update(
        tmp_path, tiny_llama):
    """num_iterations > 1 compares with the sampling policy's log-probs (ratio != 1 after an
    update); beta > 0 compares with the reference (KL > 0 once the policy moved), for LoRA (the
    adapter switched off) and for full fine-tuning (a frozen copy)."""
    r = make_run(tmp_path, tiny_llama, "--grpo.num_iterations=2", "--optim.lr=0.5")
    m, _ = step.train_step(r)
    assert abs(m["ratio_mean"] - 1) > 1e-4  # exactly 1 if the second iteration compared with itself
    for lora in ("true", "false"):
        r = make_run(tmp_path / lora, tiny_llama, "--grpo.beta=0.1", "--optim.lr=0.05",
                     f"--lora.enabled={lora}")
        first, _ = step.train_step(r)
        second, _ = step.train_step(r)
        assert first["kl"] == pytest.approx(0, abs=1e-9) and second["kl"] > 1e-7, lora


def test_gspo_sequence_ratios_reach_the_loss(tmp_path, tiny_llama, monkeypatch):
    """grpo.importance_sampling_level: sequence gives each completion one ratio in the second
    iteration."""
    ratios, real = [], grpo.per_token_loss

    def spy(*a, **k):
        out = real(*a, **k)
        args = inspect.signature(real).bind(*a, **k).arguments
        # rho, its mask
        ratios.append((out[1].detach(), args["mask"] if args["s"].sequence else None))
        return out
    monkeypatch.setattr(grpo, "per_token_loss", spy)
    r = make_run(tmp_path, tiny_llama, "--grpo.num_iterations=2", "--optim.lr=0.5",
                 "--grpo.loss_type=grpo",
                 "--grpo.importance_sampling_level=sequence", "--optim.micro_batch_size=8")
    m, _ = step.train_step(r)
    rho, mask = ratios[-1]
    assert abs(m["ratio_mean"] - 1) > 1e-4 and mask is not None
    for i in range(rho.shape[0]):
        kept = rho[i][mask[i] > 0]
        assert torch.allclose(kept, kept[0].expand_as(kept))  # one ratio a completion


def test_delta_and_cispo_reach_the_loss_from_the_config(tmp_path, tiny_llama, monkeypatch):
    """grpo.delta and grpo.policy_loss: cispo (with its cap) are what per_token_loss receives; a run
    with delta logs clip_ratio/delta_mean, and one without does not."""
    seen, sums, real, real_loss = [], [], grpo.per_token_loss, grpo.grpo_loss

    def spy(*a, **k):
        s = inspect.signature(real).bind(*a, **k).arguments["s"]
        seen.append((s.delta, s.cispo_cap))
        return real(*a, **k)

    def loss_spy(*a, **k):
        out = real_loss(*a, **k)
        sums.append((out[1]["clip_delta_sum"], out[1]["tokens"]))
        return out
    monkeypatch.setattr(grpo, "per_token_loss", spy)
    monkeypatch.setattr(grpo, "grpo_loss", loss_spy)
    for name, flags, want in (("delta", ["--grpo.delta=1.06"], (1.06, None)),
                              ("cispo", ["--grpo.policy_loss=cispo", "--grpo.cispo_cap=2.5"],
                               (0.0, 2.5)), ("clip", [], (0.0, None))):
        seen.clear()
        sums.clear()
        r = make_run(tmp_path / name, tiny_llama, "--grpo.num_iterations=2", "--optim.lr=0.5",
                     "--grpo.epsilon_high=0.05", *flags)
        m, _ = step.train_step(r)
        assert seen and set(seen) == {want}, name
        assert ("clip_ratio/delta_mean" in m) == (name == "delta") and math.isfinite(m["loss"])
        if name == "delta":  # the share of the step's tokens that passed delta with A < 0
            assert m["clip_ratio/delta_mean"] == \
                pytest.approx(sum(d for d, _ in sums) / sum(t for _, t in sums))
            assert m["clip_ratio/delta_mean"] > 0


def test_the_loss_scores_tokens_at_the_sampling_temperature(tmp_path, tiny_llama, monkeypatch):
    seen, real = [], logprobs.sequence_log_probs

    def recording(model, ids, attn, C, temperature, *a, **k):
        seen.append(temperature)
        return real(model, ids, attn, C, temperature, *a, **k)
    monkeypatch.setattr(logprobs, "sequence_log_probs", recording)
    r = make_run(tmp_path, tiny_llama, "--rollout.temperature=0.7")
    step.train_step(r)
    assert seen and set(seen) == {0.7}


def test_each_completion_is_scored_against_its_own_row(tmp_path, tiny_llama, monkeypatch):
    """Rows i*G .. i*G+G-1 are prompt i's: a reward reading the row's answer gives each group its
    row's value."""
    monkeypatch.setitem(rewards.REGISTRY, "test_row_answer",
                        (lambda completion, sample: float(sample["answer"]), False))
    r = make_run(tmp_path, tiny_llama, "--rewards=[{name: test_row_answer}]",
                 "--rollout.prompts_per_step=3")
    idx = [5, 0, 7]
    s = step.score(r, idx)
    G = r.cfg.rollout.num_generations
    assert s.samples == [r.rows[i] for i in idx for _ in range(G)]
    assert s.total.tolist() == [float(r.rows[i]["answer"]) for i in idx for _ in range(G)]


@pytest.mark.parametrize("opens, forced, expected",
                         [(False, "", ""), (False, "<think>", "<think>"), (True, "", "<think>\n")])
def test_rewards_see_the_think_block_the_template_or_the_forced_prefix_opens(
        tmp_path, tiny_llama, monkeypatch, opens, forced, expected):
    seen = set()

    def reward(completion, sample, assistant_prefix="", forced_prefix=None):
        # forced_prefix: ratings.py's queue, which exports replies
        seen.add((assistant_prefix, forced_prefix))
        return 0.0
    monkeypatch.setitem(rewards.REGISTRY, "test_prefix", (reward, False))
    r = make_run(tmp_path, tiny_llama, "--rewards=[{name: test_prefix}]",
                 f"--data.assistant_prefix={forced}")
    if opens:  # DeepSeek-R1's template ends its generation prompt inside a think block
        r.tokenizer.chat_template = r.tokenizer.chat_template.replace("assistant\n'",
                                                                      "assistant\n<think>\n'")
        lifecycle.prepare(r)  # the reply prefix is read once, at setup
    step.score(r, [0, 1])
    assert seen == {(expected, forced)}


def test_dynamic_sampling_trains_on_the_groups_with_signal_first(tmp_path, tiny_llama, monkeypatch):
    G = 4
    flat = rollout.Rollout(torch.ones(G, 2, dtype=torch.long), torch.ones(G, 2),
                           torch.ones(G, 3, dtype=torch.long),
                           torch.ones(G, 3), torch.zeros(G, dtype=torch.bool), ["flat"] * G)
    varied = rollout.Rollout(torch.ones(G, 2, dtype=torch.long), torch.ones(G, 2),
                             torch.ones(G, 3, dtype=torch.long),
                             torch.ones(G, 3), torch.zeros(G, dtype=torch.bool), ["varied"] * G)
    draws = iter([(flat, [1.0] * G), (varied, [0.0, 1.0, 0.0, 1.0])])

    def fake_score(run, idx):
        ro, total = next(draws)
        return step.Scored(ro, [{}] * G, torch.tensor(total), {}, {})
    monkeypatch.setattr(step, "score", fake_score)
    r = make_run(tmp_path, tiny_llama, "--rollout.prompts_per_step=1",
                 "--rollout.resample_zero_std=true", "--rollout.max_prompts_per_step=2")
    kept, drawn = step.collect(r)
    assert kept.rollout.texts == ["varied"] * G and len(drawn.rollout.texts) == 2 * G


def test_micro_batches_hold_at_most_size_rows_with_or_without_a_token_budget():
    n = 6
    batch = rollout.Rollout(torch.ones(n, 2, dtype=torch.long), torch.ones(n, 2),
                            torch.ones(n, 3, dtype=torch.long),
                            torch.ones(n, 3), torch.zeros(n, dtype=torch.bool), [""] * n)
    for budget in (0, 10_000):
        assert logprobs.micro_batches(batch, 2, budget) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    # 2 rows x 5 tokens
    assert logprobs.micro_batches(batch, 6, 10) == [slice(0, 2), slice(2, 4), slice(4, 6)]


def test_optimizer_step_clips_the_gradient_to_max_grad_norm():
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([w], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    run = SimpleNamespace(scaler=None, optimizer=opt, scheduler=sched, params=[w],
                          cfg=SimpleNamespace(optim=SimpleNamespace(max_grad_norm=1.0)))
    w.grad = torch.tensor([3.0, 4.0, 0.0])
    norm, lr = step.optimizer_step(run)
    assert norm == pytest.approx(5.0) and lr == 1.0
    # one step along the clipped gradient
    assert w.detach().tolist() == pytest.approx([-0.6, -0.8, 0.0])


def test_fp16_loss_scaling_that_skips_every_update_stops_the_run_instead_of_training_nothing(
        recwarn):
    """A T4's float16 pass that overflows: GradScaler skips each update and halves its scale, and
    the run went on silently, training nothing (its step line just lost loss and grad_norm)."""
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([w], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)  # the CPU's GradScaler behaves as CUDA's
    run = SimpleNamespace(scaler=scaler, optimizer=opt, scheduler=sched, params=[w],
                          cfg=SimpleNamespace(optim=SimpleNamespace(max_grad_norm=1.0)))
    for scale in (4.0, 2.0):  # skipped while the scale can still be found: the run goes on, quietly
        scaler.scale(torch.tensor(float("inf"), requires_grad=True) * w.sum()).backward()
        norm, _ = step.optimizer_step(run)
        assert not math.isfinite(norm) and w.detach().tolist() == [0.0, 0.0, 0.0] \
            and scaler.get_scale() == scale / 2
        w.grad = None
    # torch's warning for a skipped step
    assert not [x for x in recwarn if "lr_scheduler.step" in str(x.message)]
    scaler.scale(torch.tensor(float("inf"), requires_grad=True) * w.sum()).backward()
    with pytest.raises(rollout.NonFiniteLogits,
                       match="float16 loss scaling has halved its scale below 1"):
        step.optimizer_step(run)  # the scale fell below 1: not a scale still to find


def test_importance_weights_are_capped_and_counted():
    sums = dict.fromkeys(("tokens", "abs_diff", "units", "weight", "capped"), 0.0)
    old, sampler, mask = torch.tensor([[0.0, 0.0]]), torch.tensor([[-5.0, 0.0]]), torch.ones(1, 2)
    w = grpo.sampler_weight(old, sampler, mask, 2.0, sums)
    assert w.tolist() == [[2.0, 1.0]] and sums["capped"] == 1 and sums["abs_diff"] == 5.0 \
        and sums["tokens"] == 2
    assert grpo.sampler_weight(old, sampler, mask, 0.0, None) is None  # cap 0: off


@pytest.mark.parametrize("mode", grpo.TIS_MODES)
def test_each_tis_mode_matches_a_loop_over_tokens_and_completions(mode):
    """TRL's four modes: the ratio per token or per completion (the product over its tokens, padding
    left out), capped at tis_cap or masked past it; `capped` counts tokens at or past the cap."""
    # a draw with completions on both sides of the cap in every mode
    g = torch.Generator().manual_seed(1)
    old, sampler = (torch.randn(5, 6, generator=g) * 0.6 for _ in range(2))
    mask = (torch.arange(6)[None] < torch.tensor([6, 3, 1, 5, 4])[:, None]).float()
    sums = dict.fromkeys(("tokens", "abs_diff", "units", "weight", "capped"), 0.0)
    w = grpo.sampler_weight(old, sampler, mask, 1.5, sums, mode)
    want, past, weights = torch.zeros(5, 6), 0, 0.0
    seq_mode = mode.startswith("sequence")
    for i in range(5):
        ts = [t for t in range(6) if mask[i, t]]
        seq = math.exp(sum(float(old[i, t] - sampler[i, t]) for t in ts))
        for t in range(6):
            rho = seq if seq_mode else math.exp(float(old[i, t] - sampler[i, t]))
            want[i, t] = min(rho, 1.5) if mode.endswith("truncate") else (0.0 if rho > 1.5 else rho)
            # sequence modes count completions, as TRL
            counted = t == ts[0] if seq_mode else t in ts
            past += counted and (rho >= 1.5 if mode.endswith("truncate") else rho > 1.5)
            weights += float(want[i, t]) if counted else 0.0
    # padding: any weight, the loss masks it
    torch.testing.assert_close(w[mask.bool()], want[mask.bool()])
    assert sums["units"] == (5 if seq_mode else mask.sum()) and sums["tokens"] == mask.sum()
    assert sums["capped"] == past and 0 < past < sums["units"] \
        and sums["weight"] == pytest.approx(weights, rel=1e-6)
    if seq_mode:
        # one weight a completion
        assert all(len(set(w[i][mask[i].bool()].tolist())) == 1 for i in range(5))
    nan = sampler.clone()
    # a log-prob vLLM did not give: ratio 1 there, as TRL, not a NaN weight
    nan[0, 1] = float("nan")
    assert torch.isfinite(grpo.sampler_weight(old, nan, mask, 1.5, None, mode)).all()
    with pytest.raises(ValueError, match="tis_mode"):
        grpo.sampler_weight(old, sampler, mask, 1.5, None, "sequence_clip")


def test_bnpo_counts_only_micro_batches_with_a_scored_completion(tmp_path, tiny_llama, monkeypatch):
    """bnpo divides by the micro-batches that train; dapo by the tokens that train (not skipped)."""
    monkeypatch.setitem(rewards.REGISTRY, "test_first_two_fail", (
        lambda completions, samples: [math.nan if i < 2 else float(i % 3)
                                      for i in range(len(completions))], True))
    seen, real = [], grpo.grpo_loss

    def recording(logp, old_logp, ref_logp, adv, mask, norm, *a, **k):
        seen.append((mask.clone(), norm))
        return real(logp, old_logp, ref_logp, adv, mask, norm, *a, **k)
    monkeypatch.setattr(grpo, "grpo_loss", recording)
    for loss_type in ("bnpo", "dapo"):
        r = make_run(tmp_path / loss_type, tiny_llama,
                     "--rewards=[{name: test_first_two_fail, fallback: skip}]",
                     "--optim.micro_batch_size=2", f"--grpo.loss_type={loss_type}")
        step.train_step(r)
        norm = seen[0][1]
        # 4 micro-batches, the first all skipped
        assert norm.num_micro_batches == 3 and norm.num_sequences == 6
        assert norm.num_tokens == sum(int(m.sum()) for m, _ in seen) and int(seen[0][0].sum()) == 0
        seen.clear()



def test_entropy_is_the_mean_over_the_drawn_completions_tokens(tmp_path, tiny_llama):
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    h = torch.tensor([[2.0, 4.0, 99.0], [6.0, 99.0, 99.0]])  # 99: past the completion, left out
    ro = rollout.Rollout(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                         torch.zeros(2, 3, dtype=torch.long), mask,
                         torch.zeros(2, dtype=torch.bool), ["", ""], entropy=h)
    drawn = step.Scored(ro, [{}, {}], torch.tensor([0.0, 1.0]), {}, {})
    sums = dict.fromkeys(("loss", "tokens", "kl_sum", "ratio_sum", "clip_low_sum", "clip_high_sum",
                          "grad_norm"), 1.0)
    m = step.step_metrics(metrics_run(2), drawn, drawn.rollout,
                          step.Updates(sums, {}, applied=1))
    assert m["entropy"] == pytest.approx(4.0)
    r = make_run(tmp_path, tiny_llama)
    m, _ = step.train_step(r)
    # a random model: near log(vocab) at temperature 1.5
    assert 0 < m["entropy"] < math.log(r.tokenizer.vocab_size * 2)


def test_a_skipped_update_is_counted_and_left_out_of_grad_norm(tmp_path, tiny_llama, monkeypatch):
    """fp16's GradScaler skips updates with an inf or NaN gradient while it finds its scale: the
    step's grad_norm is the mean of the applied ones, skipped_updates counts the rest, and the
    metrics line stays JSON (no Infinity, no NaN)."""
    given = iter([float("inf"), 2.0, float("nan"), float("nan")])
    monkeypatch.setattr(step, "optimizer_step", lambda r: (next(given), 1e-5))
    r = make_run(tmp_path, tiny_llama, "--grpo.num_mini_batches=2")
    m, _ = step.train_step(r)
    assert m["grad_norm"] == 2.0 and m["skipped_updates"] == 1
    m, _ = step.train_step(r)
    assert "grad_norm" not in m and m["skipped_updates"] == 2
    json.dumps(m, allow_nan=False)


def test_num_mini_batches_splits_the_batch_into_mini_batches_each_its_own_update(
        tmp_path, tiny_llama, monkeypatch):
    """grpo.num_mini_batches: k = 2 takes two optimizer steps per pass, each on half the groups with
    its loss normalised over that half: with lr 0 and loss_type grpo the two gradients average to
    the one-update gradient; each update's LossNorm counts only its half. With a real lr the second
    half is off-policy (ratios leave 1); grad_norm is the mean over the updates."""
    grads, norms, calls, real_step, real_loss = [], [], [], step.optimizer_step, grpo.grpo_loss

    def capture(r):
        grads.append([p.grad.clone() for p in r.params])
        out = real_step(r)
        norms.append(out[0])
        calls.append(None)  # an update ends here
        return out

    def loss(logp, old_logp, ref_logp, adv, mask, norm, *a, **k):
        calls.append((float(mask.sum()), mask.shape[0], norm))
        return real_loss(logp, old_logp, ref_logp, adv, mask, norm, *a, **k)
    monkeypatch.setattr(step, "optimizer_step", capture)
    monkeypatch.setattr(grpo, "grpo_loss", loss)
    common = ["--optim.lr=0.0", "--grpo.loss_type=grpo", "--optim.max_grad_norm=0",
              "--optim.micro_batch_size=3"]
    r = make_run(tmp_path / "one", tiny_llama, *common)
    whole, _ = step.train_step(r)
    r = make_run(tmp_path / "two", tiny_llama, *common, "--grpo.num_mini_batches=2")
    halves, _ = step.train_step(r)
    assert len(grads) == 3  # one update, then two
    for g, g1, g2 in zip(*grads):
        torch.testing.assert_close(g, (g1 + g2) / 2, rtol=1e-4, atol=1e-7)
    assert halves["reward"] == whole["reward"] \
        and halves["grad_norm"] == pytest.approx(sum(norms[1:]) / 2)
    updates, current = [], []
    for c in calls:
        if c is None:
            updates.append(current)
            current = []
        else:
            current.append(c)
    # 8 rows in micro-batches of 3; then 4 + 4 rows: 3 + 1 each
    assert [len(u) for u in updates] == [3, 2, 2]
    for u in updates:  # each update's normaliser counts its own rows and tokens only
        norm = u[0][2]
        assert all(c[2] is norm for c in u) and norm.num_micro_batches == len(u)
        assert norm.num_tokens == sum(c[0] for c in u) \
            and norm.num_sequences == sum(c[1] for c in u)
    grads.clear()
    olds, real_old = [], logprobs.batch_log_probs
    monkeypatch.setattr(logprobs, "batch_log_probs", lambda *a: olds.append(1) or real_old(*a))
    r = make_run(tmp_path / "lr", tiny_llama, "--optim.lr=0.5", "--grpo.num_mini_batches=2")
    m, _ = step.train_step(r)
    # one pass, yet the second half is off-policy: the old log-probs count
    assert len(grads) == 2 and len(olds) == 1
    r.cfg.grpo.num_iterations = 3
    assert lifecycle.updates_per_step(r.cfg) == 6  # what the lr schedule and --resume count
    with pytest.raises(train.ConfigError,
                       match="num_mini_batches=3 must divide rollout.prompts_per_step=2"):
        make_run(tmp_path / "bad", tiny_llama, "--grpo.num_mini_batches=3")


def test_the_lr_schedule_counts_every_mini_batch_update(tmp_path, tiny_llama):
    """2 steps x 2 mini-batches = 4 updates of a cosine from lr to 0: the last runs at lr x (1 +
    cos(3 pi / 4)) / 2."""
    cfg = write_run_config(tmp_path, tiny_llama, run={"out_dir": str(tmp_path / "run")})
    assert train.main(["--config", str(cfg), "--grpo.num_mini_batches=2", "--optim.warmup_steps=0",
                       "--optim.min_lr_ratio=0", "--optim.lr=0.01"]) == 0
    m = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert m[-1]["learning_rate"] == pytest.approx(0.01 * (1 + math.cos(3 * math.pi / 4)) / 2)

def test_top_entropy_quantile_picks_the_steps_high_entropy_tokens_whatever_the_micro_batches(
        tmp_path, tiny_llama, monkeypatch):
    """The kept tokens are chosen once over the whole step from the sampling entropy (not per
    micro-batch, as in TRL), so the gradient is the same for micro-batches of 2 or 8 rows; and it is
    not the all-token gradient."""
    seen, real, real_collect, batches = [], grpo.grpo_loss, step.collect, []

    def spy(*a, **k):
        seen.append(inspect.signature(real).bind(*a, **k).arguments.get("keep"))
        return real(*a, **k)
    monkeypatch.setattr(grpo, "grpo_loss", spy)
    monkeypatch.setattr(step, "collect", lambda *a, **k: (batches[0],) * 2)
    norms = {}
    for q, size in ((0.3, 2), (0.3, 8), (1.0, 8)):
        r = make_run(tmp_path / f"{q}_{size}", tiny_llama, f"--grpo.top_entropy_quantile={q}",
                     f"--optim.micro_batch_size={size}",
                     "--optim.lr=0.0", "--optim.max_grad_norm=0", "--rollout.max_new_tokens=12")
        if q == 0.3 and size == 2:  # one rollout for all three runs
            batches.append(real_collect(r)[0])
        seen.clear()
        norms[q, size] = step.train_step(r)[0]["grad_norm"]
        if q < 1:
            batch = batches[0].rollout
            keep = torch.zeros_like(batch.completion_mask, dtype=torch.bool)
            for mb, k in zip(logprobs.micro_batches(batch, size), seen):
                keep[mb, :k.shape[1]] = k
            mask = batch.completion_mask.bool()
            assert torch.equal(keep, grpo.high_entropy_mask(batch.entropy, mask, q))
            assert abs(int(keep.sum()) - q * int(mask.sum())) <= 1
        else:
            assert seen and all(k is None for k in seen)
    assert norms[0.3, 2] == pytest.approx(norms[0.3, 8], rel=1e-5)
    assert norms[0.3, 8] != pytest.approx(norms[1.0, 8], rel=1e-3)
    # tokens left out of the loss (masked truncated completions) are left out of the quantile too
    batch = batches[0].rollout
    batch.truncated = torch.arange(len(batch.truncated)) < 3  # (N,) the first three
    r = make_run(tmp_path / "masked", tiny_llama, "--grpo.top_entropy_quantile=0.3",
                 "--grpo.mask_truncated_completions=true",
                 "--optim.micro_batch_size=8", "--rollout.max_new_tokens=12")
    seen.clear()
    step.train_step(r)
    # one micro-batch of all rows, trimmed to the longest completion
    keep = torch.cat([k for k in seen])
    mask = batch.completion_mask.bool().clone()
    mask[:3] = False
    assert torch.equal(keep, grpo.high_entropy_mask(batch.entropy, mask, 0.3)[:, :keep.shape[1]]) \
        and not keep[:3].any()


def test_old_and_reference_log_probs_are_taken_in_the_loss_s_micro_batches(tmp_path, tiny_llama,
                                                                           monkeypatch):
    """With mini-batches whose size micro_batch_size does not divide, the old (and reference)
    log-probs were computed in other micro-batches than the loss's: other padding, other
    half-precision rounding, so the first, truly on-policy mini-batch got ratios != 1 (bf16, lr 0:
    exactly 1 now)."""
    seen, real = [], grpo.grpo_loss

    def spy(logp, old_logp, ref_logp, adv, mask, norm, *a, **k):
        if old_logp is not None:
            m = mask.bool()
            seen.append(float((logp.detach() - old_logp)[m].abs().max()) if m.any() else 0.0)
            seen.append(float((logp.detach() - ref_logp)[m].abs().max())
                        if m.any() and ref_logp is not None else 0.0)
        return real(logp, old_logp, ref_logp, adv, mask, norm, *a, **k)
    monkeypatch.setattr(grpo, "grpo_loss", spy)
    # the reference: the adapter off, which lr 0 left at 0
    r = make_run(tmp_path, tiny_llama, "--model.dtype=bfloat16", "--optim.lr=0.0",
                 "--grpo.num_iterations=2", "--grpo.num_mini_batches=2",
                 "--optim.micro_batch_size=3", "--rollout.prompts_per_step=2",
                 "--rollout.max_new_tokens=12", "--grpo.beta=0.1")
    m, _ = step.train_step(r)
    assert seen and max(seen) == 0.0 and m["ratio_mean"] == 1.0 and m["kl"] == 0.0


def test_an_update_skipped_for_a_non_finite_gradient_leaves_the_logged_loss_finite(
        tmp_path, tiny_llama, monkeypatch):
    """One micro-batch's forward overflowing (NaN log-probs): its update is skipped and counted, and
    the step's loss, ratio and clip metrics are those of the updates that were applied."""
    real, calls = logprobs.sequence_log_probs, [0]

    def overflowing(*a, **k):
        out = real(*a, **k)
        calls[0] += torch.is_grad_enabled()
        return out + float("nan") * out.sum() if torch.is_grad_enabled() and calls[0] == 1 else out
    monkeypatch.setattr(logprobs, "sequence_log_probs", overflowing)
    losses, real_loss = [], grpo.grpo_loss

    def shifted(*a, **k):
        # on-policy the loss value is ~0; + 1 (no change to the gradient) makes it tell
        loss, stats = real_loss(*a, **k)
        losses.append(float(loss.detach()) + 1.0)
        return loss + 1.0, stats
    monkeypatch.setattr(grpo, "grpo_loss", shifted)
    r = make_run(tmp_path, tiny_llama, "--optim.micro_batch_size=4", "--grpo.num_mini_batches=2")
    m, _ = step.train_step(r)
    assert m["skipped_updates"] == 1
    json.dumps(m, allow_nan=False)  # no NaN in the metrics line
    assert math.isfinite(m["loss"]) and m["ratio_mean"] == pytest.approx(1.0)
    # two updates of one micro-batch each; the first skipped: the logged loss is the second's, not
    # half of it
    assert len(losses) == 2 and math.isnan(losses[0])
    assert m["loss"] == pytest.approx(losses[1], rel=1e-6)


def test_scale_rewards_reaches_the_advantages(tmp_path, tiny_llama, monkeypatch):
    """grpo.scale_rewards: none gives each completion r - mean of its group (Dr. GRPO), group
    divides by the group's std too; the advantages shown in the samples are those the loss used."""
    monkeypatch.setitem(rewards.REGISTRY, "test_length",
                        (lambda completion, sample: float(len(completion) % 7), False))
    for scale in ("none", "group"):
        r = make_run(tmp_path / scale, tiny_llama, "--rewards=[{name: test_length}]",
                     f"--grpo.scale_rewards={scale}", "--rollout.max_new_tokens=12")
        shown = train.completions_shown(step.train_step(r)[1], 10**6)  # as samples.jsonl has them
        rew = torch.tensor([s["reward"] for s in shown]).view(-1, 4)
        adv = torch.tensor([s["advantage"] for s in shown]).view(-1, 4)
        centered = rew - rew.mean(1, keepdim=True)
        want = centered if scale == "none" else centered / (rew.std(1, keepdim=True) + 1e-4)
        assert (rew.std(1) - 1).abs().max() > 0.1, "a group std of 1 would not tell the modes apart"
        torch.testing.assert_close(adv, torch.where(rew.std(1, keepdim=True) > 0, want, 0.0),
                                   rtol=1e-4, atol=1e-5)


def test_reward_std_is_the_mean_of_the_groups_stds():
    """As in TRL: the spread within groups (what the advantages see), not the spread of the whole
    batch."""
    n = 8
    ro = rollout.Rollout(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                         torch.zeros(n, 2, dtype=torch.long), torch.ones(n, 2),
                         torch.zeros(n, dtype=torch.bool), [""] * n)
    drawn = step.Scored(ro, [{}] * n,
                        torch.tensor([0.0, 1.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0]), {}, {})
    sums = dict.fromkeys(("loss", "tokens", "kl_sum", "ratio_sum", "clip_low_sum", "clip_high_sum"),
                         1.0)
    m = step.step_metrics(metrics_run(4), drawn, drawn.rollout,
                          step.Updates(sums, {}, applied=1))
    assert m["reward_std"] == pytest.approx(float(torch.tensor([0.0, 1.0, 0.0, 1.0]).std()) / 2)
    assert m["reward"] == pytest.approx(2.75) and m["frac_reward_zero_std"] == 0.5


def test_sampler_weights_compare_the_sampling_policy_in_every_iteration(tmp_path, tiny_llama,
                                                                        monkeypatch):
    """vLLM's importance weight is pi_old / pi_sampler: with num_iterations 2, the second
    iteration's weight uses the same old log-probs as the first, not the policy the first update
    moved."""
    seen, real_w, real_collect = [], grpo.sampler_weight, step.collect

    def weight(old, *a, **k):
        seen.append(old.clone())
        return real_w(old, *a, **k)

    def collect(*a, **k):
        kept, drawn = real_collect(*a, **k)
        # as vLLM would give them
        kept.rollout.sampler_logp = torch.full(kept.rollout.completion_mask.shape, -6.0)
        return kept, drawn
    monkeypatch.setattr(grpo, "sampler_weight", weight)
    monkeypatch.setattr(step, "collect", collect)
    r = make_run(tmp_path, tiny_llama, "--grpo.num_iterations=2", "--optim.lr=0.5",
                 "--optim.micro_batch_size=8")
    # the config asks for rollout.engine: vllm; the weights need only sampler_logp
    r.cfg.grpo.tis_cap = 2.0
    lifecycle.prepare(r)  # the loss settings are read once
    m, _ = step.train_step(r)
    assert abs(m["ratio_mean"] - 1) > 1e-4  # the policy did move between the iterations
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])


@pytest.mark.parametrize("flags, want", [
    (["--grpo.policy_loss=sapo", "--grpo.loss_type=grpo"], ("sapo", None)),
    (["--grpo.policy_loss=vespo"], ("vespo", None)),
    (["--grpo.policy_loss=dppo", "--grpo.kl_tau=0.01"], ("dppo", None)),
    (["--grpo.loss_type=luspo", "--grpo.importance_sampling_level=sequence"], ("clip", None)),
    (["--grpo.off_policy_mask_threshold=0.01"], ("clip", None)),
    (["--grpo.entropy_coef=0.05"], ("clip", 0.05)),
])
def test_each_objective_reaches_the_loss_from_the_config(tmp_path, tiny_llama, monkeypatch, flags,
                                                         want):
    """What per_token_loss receives and the entropy coefficient grpo_loss applies, from the config;
    the second iteration is off-policy, so every objective acts; the step's metrics are finite and
    the entropy bonus logs its coefficient and the training entropy."""
    seen, coefs, real, real_loss = [], [], grpo.per_token_loss, grpo.grpo_loss

    def spy(*a, **k):
        seen.append(inspect.signature(real).bind(*a, **k).arguments["s"].objective)
        return real(*a, **k)

    def loss_spy(*a, **k):
        entropy = k.get("entropy")
        coefs.append(None if entropy is None else entropy[1])
        assert entropy is None or entropy[0].requires_grad  # the training forward's, with grad
        return real_loss(*a, **k)
    monkeypatch.setattr(grpo, "per_token_loss", spy)
    monkeypatch.setattr(grpo, "grpo_loss", loss_spy)
    r = make_run(tmp_path, tiny_llama, "--grpo.num_iterations=2", "--optim.lr=0.5", *flags)
    m, _ = step.train_step(r)
    assert set(seen) == {want[0]} and set(coefs) == {want[1]}
    assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
    assert ("entropy_coef" in m) == (want[1] is not None)
    if want[1]:
        assert m["entropy_coef"] == pytest.approx(0.05) and m["entropy_bonus/entropy"] > 0


def test_the_entropy_bonus_changes_the_gradient_by_its_own_term_only(tmp_path, tiny_llama,
                                                                    monkeypatch):
    """lr 0, the same sampled batch: the gradient with entropy_coef 0.5 differs from the one
    without, and the loss differs by the bonus's value, 0.5 x the training entropy."""
    grads, out = [], []
    real = step.optimizer_step

    def grab(run):
        grads.append(torch.cat([p.grad.flatten() for p in run.params if p.grad is not None]))
        return real(run)
    monkeypatch.setattr(step, "optimizer_step", grab)
    for coef in (0.0, 0.5):
        torch.manual_seed(0)
        r = make_run(tmp_path / str(coef), tiny_llama, "--optim.lr=0.0",
                     f"--grpo.entropy_coef={coef}", "--run.seed=3")
        torch.manual_seed(0)
        out.append(step.train_step(r)[0])
    assert not torch.allclose(grads[0], grads[1])
    assert out[0]["loss"] - out[1]["loss"] == pytest.approx(
        0.5 * out[1]["entropy_bonus/entropy"], rel=1e-4)


def test_adaptive_entropy_control_keeps_its_coefficient_in_the_optimizer_state(tmp_path,
                                                                              tiny_llama):
    """After each update the controller's coefficient and last entropy sit in the optimizer's first
    param group: a checkpoint's optimizer state carries them to a resumed run."""
    r = make_run(tmp_path, tiny_llama, "--grpo.use_adaptive_entropy=true",
                 "--grpo.entropy_coef=0.02", "--grpo.entropy_target=100", "--optim.lr=0.0")
    m, _ = step.train_step(r)
    group = r.optimizer.param_groups[0]
    assert m["entropy_coef"] == 0.0  # nothing measured before the first update: not applied
    assert group["entropy_coef"] == pytest.approx(0.025) and group["entropy_last"] < 100
    saved = r.optimizer.state_dict()
    fresh = torch.optim.AdamW(r.params, lr=0.0)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["entropy_coef"] == pytest.approx(0.025)
    m, _ = step.train_step(r)
    assert m["entropy_coef"] == pytest.approx(0.025)


def test_sync_ref_model_mixes_the_reference_towards_the_policy_and_resumes_it(tmp_path,
                                                                              tiny_llama):
    """TR-DPO with alpha 0.5 every step: as step 2 takes its reference log-probs the reference is
    0.5 x (the policy after step 1) + 0.5 x the base; the checkpoint of step 2 saves it, and a run
    resumed from it takes that reference back before mixing again."""
    over = ["--lora.enabled=false", "--grpo.beta=0.1", "--grpo.sync_ref_model=true",
            "--grpo.ref_model_sync_steps=1", "--grpo.ref_model_mixup_alpha=0.5",
            "--optim.lr=0.05"]
    r = make_run(tmp_path, tiny_llama, *over)
    base = [p.detach().clone() for p in r.ref_copy.parameters()]
    r.step = 1
    step.train_step(r)
    after_1 = [p.detach().clone() for p in r.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(base, r.ref_copy.parameters()))  # not yet
    r.step = 2
    step.train_step(r)
    mixed = [0.5 * a + 0.5 * b for a, b in zip(after_1, base)]
    assert all(torch.allclose(m, p) for m, p in zip(mixed, r.ref_copy.parameters()))
    assert any(not torch.allclose(m, b) for m, b in zip(mixed, base))
    from run.checkpoint import save_checkpoint
    save_checkpoint(r, 2)
    policy_2 = [p.detach().clone() for p in r.model.parameters()]
    resumed = make_run(tmp_path, tiny_llama, *over, "--resume", "--run.steps=3")
    assert resumed.start == 2
    resumed.step = 3
    ref = step.reference(resumed)
    want = [0.5 * p + 0.5 * m for p, m in zip(policy_2, mixed)]
    assert all(torch.allclose(w, p, atol=1e-6) for w, p in zip(want, ref.parameters()))
