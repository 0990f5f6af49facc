"""Models of real shapes with random weights, for the benchmarks that need a GPU-sized model but
cannot reach the hub: `random:<shape>` in speed_vs_trl/vs_trl.py, memory_estimate.py,
memory_cap.py and gpu_training_pass/gpu_train_probe.py.

    from random_models import model_dir
    path = model_dir("random:qwen3-0.6b", "cuda", tokenizer=None, seed=0)  # built once, then cached

A shape is its published config.json written out by hand (RANDOM_MODELS); the weights are seeded
random, saved under ~/.cache/minigrpo/bench/ with the tokenizer (the built-in SmolLM2's, or
--tokenizer's) beside them, so every trainer loads the very same weights with from_pretrained.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Real shapes, written out by hand (from the models' published config.json), weights random.
RANDOM_MODELS = {
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       attention_bias=False, hidden_act="silu"),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True,
                         hidden_act="silu"),  # Qwen2 has q/k/v biases built in
    # the recipes' models, from their public config.json (Hugging Face hub)
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       attention_bias=False, hidden_act="silu"),
    "qwen3-4b-instruct-2507": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728,
                                   num_hidden_layers=36, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                   max_position_embeddings=262144, rope_theta=5_000_000.0,
                                   rms_norm_eps=1e-6, tie_word_embeddings=True,
                                   attention_bias=False, hidden_act="silu"),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       vocab_size=152064, max_position_embeddings=32768, rope_theta=1_000_000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=False,
                       hidden_act="silu"),  # Qwen2.5-7B-Instruct
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     attention_bias=False, hidden_act="silu"),
    # Qwen3-0.6B's depth and vocabulary at width 64: as many kernels per forward as the real model,
    # little arithmetic: a CPU counts what a GPU would launch
    # (bench/gpu_training_pass/gpu_train_probe.py --count-ops)
    "qwen3-0.6b-narrow": dict(model_type="qwen3", hidden_size=64, intermediate_size=128,
                              num_hidden_layers=28, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, vocab_size=151936, max_position_embeddings=40960,
                              rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                              attention_bias=False, hidden_act="silu"),
    "tiny": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=151936,
                 max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, attention_bias=False, hidden_act="silu"),
}
CACHE = Path("~/.cache/minigrpo").expanduser()



def random_config(name: str, tokenizer: str | None):
    """(transformers config of the RANDOM_MODELS shape `name`, the tokenizer whose special ids it
    takes)."""
    from transformers import AutoConfig, AutoTokenizer

    from sources.hub import builtin_model_dir
    tok = AutoTokenizer.from_pretrained(tokenizer or builtin_model_dir("smollm2-135m", str(CACHE)))
    d = dict(RANDOM_MODELS[name])
    cfg = AutoConfig.for_model(d.pop("model_type"), **d, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id,
                               pad_token_id=(tok.pad_token_id if tok.pad_token_id is not None
                                             else tok.eos_token_id))
    return cfg, tok


def model_dir(spec: str, device: str, tokenizer: str | None, seed: int) -> Path:
    """A transformers directory both trainers load: the built-in model, or a seeded random model."""
    from sources.hub import builtin_model_dir
    if not spec.startswith("random:"):
        return (builtin_model_dir(spec, str(CACHE)) if spec == "smollm2-135m"
                else Path(spec).expanduser())
    name = spec.split(":", 1)[1]
    dtype_name = "bfloat16" if device == "cuda" else "float32"
    target = CACHE / "bench" / f"{name}-random-seed{seed}-{dtype_name}"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM
    cfg, tok = random_config(name, tokenizer)
    print(f"[bench] building random {name} ({dtype_name}) in {target}", file=sys.stderr, flush=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype_name))
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tmp.replace(target)
    return target
