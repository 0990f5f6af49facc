"""gpu/memory.py: the micro-batch and gradient checkpointing chosen from the traced estimate and a
GPU's free memory (tests pass the number), explicit settings kept, and checkpointing switched on
after loading still training the LoRA weights. On the CPU, with small LoRA models."""
import pytest
import torch

from config import Config, LoraConfig, ModelConfig
from gpu.memory import (
    BUSY_TOKENS,
    GiB,
    allocatable_bytes,
    choose_levers,
    enable_checkpointing,
    is_checkpointing,
    margin_bytes,
    micro_batch_peak,
    sampling_bytes,
    weight_bytes,
)
from model import load_policy

PROMPT = 8  # tokens of the longest prompt


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A LoRA model whose decoder layers hold more than its logits (4 layers of width 128, the
    tests' 400-token vocabulary), so checkpointing saves much: as on real models."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import make_tokenizer
    path, tok = tmp_path_factory.mktemp("deep"), make_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)).save_pretrained(path)
    tok.save_pretrained(path)
    model, _ = load_policy(ModelConfig(name=str(path), dtype="bfloat16"), LoraConfig(r=4, alpha=8),
                           torch.device("cpu"))
    return model


@pytest.fixture(scope="module", autouse=True)
def trace_once():
    """choose_levers traces each setting it reaches; the same setting traces the same: here, once
    for all the tests (a trace of `deep` takes ~0.5 s on a CPU)."""
    import gpu.memory
    traced, trace = {}, gpu.memory.micro_batch_peak

    def once(model, *args, **kwargs):
        key = (id(model), args, tuple(sorted(kwargs.items())))
        if key not in traced:
            traced[key] = trace(model, *args, **kwargs)
        return traced[key]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu.memory, "micro_batch_peak", once)
        yield


def run_config(**rollout) -> Config:
    cfg = Config()
    cfg.rollout.prompts_per_step, cfg.rollout.num_generations, cfg.rollout.max_new_tokens = 4, 8, 56
    cfg.rollout.prompts_per_generate = 1  # a small sampling term: training decides
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


def trained_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def free_for(budget: int, model) -> int:
    """The least free memory whose budget (free - margin - AdamW state) is `budget`."""
    adam = 2 * trained_bytes(model)
    free = (budget + GiB + adam) * 10 // 9 - 10  # just below
    while free - margin_bytes(free) - adam < budget:
        free += 1
    return free


def need(model, cfg, rows: int, ckpt: bool) -> int:
    """The estimate for a setting, as an explicit one reports it."""
    return choose_levers(model, cfg, PROMPT, 10**15, rows, ckpt).peak_bytes


def test_a_huge_budget_takes_16_rows_without_checkpointing(deep):
    levers = choose_levers(deep, run_config(), PROMPT, 80 * GiB)
    assert (levers.micro_batch_size, levers.checkpointing) == (16, False)
    assert levers.peak_bytes <= levers.budget_bytes
    assert levers.budget_bytes == 80 * GiB - 8 * GiB - GiB - 2 * trained_bytes(deep)
    assert levers.why.startswith("micro-batch 16, no checkpointing: ~0.0 of 80.0 GiB free")


def test_the_need_is_the_traced_micro_batch_and_its_gradients_or_sampling(deep):
    cfg, trained = run_config(), trained_bytes(deep)
    traced = micro_batch_peak(deep, 4, PROMPT, 56, checkpointing=True)[1]
    assert need(deep, cfg, 4, True) == traced + trained
    cfg = run_config(prompts_per_generate=0)  # all 32 rows in one generate call
    sample = sampling_bytes(deep.config, 32, PROMPT + 56, torch.bfloat16)
    assert need(deep, cfg, 1, True) == max(sample, micro_batch_peak(
        deep, 1, PROMPT, 56, checkpointing=True)[1] + trained)


def test_below_8_rows_without_checkpointing_it_checkpoints_the_most_rows_that_fit(deep):
    cfg = run_config()
    plain8, ckpt16, ckpt8 = need(deep, cfg, 8, False), need(deep, cfg, 16, True), \
        need(deep, cfg, 8, True)
    assert ckpt8 < ckpt16 < plain8  # this model: checkpointing 16 rows costs less than 8 plain
    for budget, rows in ((plain8 - 1, 16), (ckpt16 - 1, 8)):
        levers = choose_levers(deep, cfg, PROMPT, free_for(budget, deep))
        assert (levers.micro_batch_size, levers.checkpointing) == (rows, True)
        assert levers.peak_bytes <= levers.budget_bytes < plain8
        assert "likely out of memory" not in levers.why


def test_nothing_fits_gives_1_row_with_checkpointing_and_says_what_to_do(deep):
    cfg = run_config()
    levers = choose_levers(deep, cfg, PROMPT, free_for(need(deep, cfg, 1, True) - 1, deep))
    assert (levers.micro_batch_size, levers.checkpointing) == (1, True)
    assert levers.peak_bytes > levers.budget_bytes
    assert "likely out of memory" in levers.why and "rollout.max_new_tokens" in levers.why
    assert "prompts_per_generate" not in levers.why  # sampling fits: training is what does not
    # a GPU with less free than the margin: sampling alone cannot fit, and the line says so
    levers = choose_levers(deep, run_config(prompts_per_generate=0), PROMPT, GiB)
    assert (levers.micro_batch_size, levers.checkpointing) == (1, True)
    assert "a lower rollout.prompts_per_generate (32 rows sampled" in levers.why


def test_when_only_sampling_does_not_fit_training_keeps_its_levers_and_the_line_says_why(deep):
    cfg = run_config(prompts_per_step=64, prompts_per_generate=0)  # 512 rows in one call
    sample = sampling_bytes(deep.config, 512, PROMPT + 56, torch.bfloat16)
    plain16 = need(deep, run_config(), 16, False)  # sampling 8 rows: training's need
    assert plain16 < sample
    levers = choose_levers(deep, cfg, PROMPT, free_for((plain16 + sample) // 2, deep))
    assert (levers.micro_batch_size, levers.checkpointing) == (16, False)
    assert levers.peak_bytes == sample > levers.budget_bytes
    assert "likely out of memory: try a lower rollout.prompts_per_generate (512 rows" in levers.why
    assert "micro_batch_size" not in levers.why and "fused_lm_head" not in levers.why


def test_explicit_settings_are_kept_and_still_estimated(deep):
    cfg = run_config()
    plain8 = need(deep, cfg, 8, False)
    for free in (80 * GiB, GiB):  # fits; does not
        levers = choose_levers(deep, cfg, PROMPT, free, micro_batch_size=3, checkpointing=False)
        assert (levers.micro_batch_size, levers.checkpointing) == (3, False)
        assert levers.peak_bytes == micro_batch_peak(deep, 3, PROMPT, 56)[1] + trained_bytes(deep)
        assert levers.why.startswith("micro-batch 3 (set), no checkpointing (set): ~")
        assert ("likely out of memory" in levers.why) == (free == GiB)
    tight = free_for(plain8 - 1, deep)
    # one set, the other chosen: 8 rows checkpointed; no checkpointing with fewer rows
    levers = choose_levers(deep, cfg, PROMPT, tight, micro_batch_size=8)
    assert (levers.micro_batch_size, levers.checkpointing) == (8, True)
    levers = choose_levers(deep, cfg, PROMPT, tight, checkpointing=False)
    assert (levers.micro_batch_size, levers.checkpointing) == (4, False)
    assert levers.peak_bytes <= levers.budget_bytes


def test_never_more_rows_than_a_step_trains(deep):
    cfg = run_config(prompts_per_step=3, num_generations=4)
    cfg.grpo.num_mini_batches = 3  # 4 completions a mini-batch
    levers = choose_levers(deep, cfg, PROMPT, 80 * GiB)
    assert (levers.micro_batch_size, levers.checkpointing) == (4, False)
    cfg = run_config()
    cfg.optim.micro_batch_tokens = 6 * (PROMPT + 56)  # also a cap: 6 rows of this length
    levers = choose_levers(deep, cfg, PROMPT, 80 * GiB)
    assert levers.micro_batch_size == 6 and levers.peak_bytes <= levers.budget_bytes
    # unset, a micro-batch holds at most BUSY_TOKENS, in a power of two of rows: 8 of 64 + 512
    cfg = run_config(max_new_tokens=576 - PROMPT)
    assert choose_levers(deep, cfg, PROMPT, 80 * GiB).micro_batch_size == 8
    assert BUSY_TOKENS // 576 == 14


def test_checkpointing_switched_on_after_loading_still_trains_the_lora_weights(
        tiny_llama, monkeypatch):
    import logprobs
    from model import is_peft
    model, _ = load_policy(ModelConfig(name=str(tiny_llama)), LoraConfig(r=4, alpha=8),
                           torch.device("cpu"))
    assert is_peft(model) and not is_checkpointing(model)
    with torch.no_grad():  # B = 0 at the start would give A no gradient to compare
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    ids = torch.randint(3, 300, (3, 12))
    calls, mlp = [], model.get_base_model().model.layers[0].mlp  # called inside the checkpoint
    mlp_forward = mlp.forward
    # (not a forward hook: torch's recompute skips those)
    monkeypatch.setattr(mlp, "forward", lambda *a: calls.append(1) or mlp_forward(*a))

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        calls.clear()
        logprobs.sequence_log_probs(model.train(), ids, torch.ones_like(ids), 6).sum().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    plain = grads()
    assert len(calls) == 1
    enable_checkpointing(model)
    assert is_checkpointing(model)
    ckpt = grads()
    assert len(calls) == 2  # the layer ran again in the backward: recomputed
    assert plain.keys() == ckpt.keys() and all("lora_" in n for n in ckpt)
    for n, g in ckpt.items():
        assert g.abs().sum() > 0, n
        torch.testing.assert_close(g, plain[n], msg=n)
    micro_batch_peak(model, 2, 5, 7, checkpointing=False)  # a trace leaves it as it found it
    assert is_checkpointing(model) and model.training


def test_the_moved_functions_give_the_numbers_bench_memory_estimate_gave(tiny_llama):
    """Computed by bench/memory_estimate.py's own copies (commit 4a8af13) on this model."""
    model, _ = load_policy(ModelConfig(name=str(tiny_llama), dtype="bfloat16"),
                           LoraConfig(r=4, alpha=8), torch.device("cpu"))
    assert micro_batch_peak(model, 2, 5, 16) == (186528, 209544)
    assert micro_batch_peak(model, 4, 5, 16, checkpointing=True) == (183744, 223784)
    assert micro_batch_peak(model, 4, 5, 16, fused_head=True, chunk=8) == (248256, 264648)
    # 4-bit: 75364 then, and since each of the 14 layers' code books (NF4_LAYER_BYTES) count too
    assert (weight_bytes(model, None), weight_bytes(model, "4bit")) == (102720, 75364 + 14 * 1092)
    assert sampling_bytes(model.config, 8, 21, torch.bfloat16) == 58368


def test_a_per_process_cap_bounds_the_free_memory_auto_reads(monkeypatch):
    """bench/memory_cap.py's --budget-gb caps the process: auto must size its levers for the cap,
    not for the whole card's free memory (torch.cuda faked: no GPU needed)."""
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "mem_get_info", lambda d: (100 * GiB, 140 * GiB))
    monkeypatch.setattr(cuda, "memory_reserved", lambda d: 3 * GiB)
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda d: 1.0, raising=False)
    assert allocatable_bytes(0) == 100 * GiB  # no cap: the card's free memory
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda d: 0.1, raising=False)
    assert allocatable_bytes(0) == 14 * GiB - 3 * GiB  # the cap, less what is reserved already
    monkeypatch.setattr(cuda, "mem_get_info", lambda d: (5 * GiB, 140 * GiB))
    assert allocatable_bytes(0) == 5 * GiB  # another process holds the rest of the card
