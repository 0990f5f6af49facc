"""Optional vLLM rollouts (`rollout.engine: vllm`): vLLM samples on the training GPU, the trainer's
LoRA adapter reaches it after each step's updates (before the next rollout), and the trainer
recomputes every log-prob.

    engine = VllmEngine(cfg, base_path, run_dir, dtype, model, device)  # LLM(enable_lora=True)
    engine.sync(model)                                                 # the new adapter
    rollout = engine.generate(tokenizer, prompts, eos_ids, device)     # sampler_logp: vLLM's

Weight sync uses vLLM's documented LoRA API, not its internals: the adapter (a few MB) is saved to
run_dir/vllm_adapter/vN/ and the next generate() passes LoRARequest("minigrpo-vN", N, path), a new
id for every version, so vLLM never serves a stale adapter from its cache. Only LoRA runs can use
vLLM (full fine-tuning would need vLLM's internal weight loader), and a merged init adapter must be
exported first (`python -m tools.export`) and used as model.name, since vLLM serves the base from a
directory.

vLLM's sampler and the trainer's forward differ slightly (kernels, precision), so the samples are
a little off-policy. The trainer recomputes log-probs (the loss never uses vLLM's), and with
`grpo.tis_cap > 0` each token's policy-gradient term is weighted by the truncated importance ratio
min(exp(logp_trainer - logp_vllm), tis_cap) (truncated importance sampling, as in Yao et al. 2025,
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"). vLLM must report the
log-probs of the distribution it samples from (after temperature, top-k and top-p; settings/
checks.py refuses tis_cap with the last two): `logprobs_mode="processed_logprobs"`.

Installed from requirements-vllm.txt (vllm>=0.32.0,<0.33.0 with the torch 2.13.0 and transformers
5.19.0 that vLLM 0.32 declares and tested); engines/vllm_startup.py checks what it can before
LLM(...) starts, which runs in this process on run.device's GPU as TRL's colocate mode runs it.
Not run on real vLLM: the development machine has no GPU and cannot install it. The sync logic and
the conversion of vLLM's outputs are tested against tests/fake_vllm.py, bound to the signatures of
vLLM 0.32.0's source (engines/vllm_surface.json), and each call was checked by reading vLLM's
source (wheels 0.8.5-0.12.0, 0.27.0, 0.30.0, 0.32.0 and 0.33.0): the engine arguments,
SamplingParams, logprobs=0 (the sampled token's entry comes first), sleep level 1 (the LoRA slots
live in the weights pool), no prefix-cache reset (its block hashes include the LoRA), and where
vLLM differs from the HF path (truncation at a final EOS, text cut inside a stop string,
min_tokens' renormalisation) the code follows the HF path.
"""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import torch

import rollout
from config import Config, ConfigError
from engines import vllm_startup
from sources.adapters import save_adapter


def check_config(cfg: Config) -> None:
    """The combinations vLLM rollouts cannot serve, as one-line errors before anything loads."""
    if cfg.rollout.engine != "vllm":
        return
    if not cfg.lora.enabled:
        raise ConfigError("rollout.engine: vllm syncs LoRA adapters; full fine-tuning "
                          "(lora.enabled: false) needs rollout.engine: hf")
    if cfg.model.init_adapter and cfg.model.merge_init_adapter:
        raise ConfigError("rollout.engine: vllm serves the base from a directory: export the "
                          "merged init adapter with python -m tools.export and set model.name to "
                          "the export "
                          "(and model.init_adapter: null)")
    if cfg.model.quant:
        raise ConfigError("rollout.engine: vllm would sample from full-precision weights while the "
                          "trainer uses 4-bit ones; use rollout.engine: hf with model.quant")
    if cfg.rollout.temperature > 2:  # SamplingParams' own limit
        raise ConfigError(f"rollout.engine: vllm samples at temperatures up to 2, got "
                          f"rollout.temperature={cfg.rollout.temperature}")


def one_process_launch(device: torch.device) -> dict[str, str]:
    """The environment of a one-process torchrun that vLLM's external launcher reads: rank 0 of
    1, its GPU cuda:LOCAL_RANK (run.device's index), a local rendezvous (an existing one kept)."""
    env = {"RANK": "0", "LOCAL_RANK": str(device.index or 0), "WORLD_SIZE": "1",
           "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1")}
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
    return env


class VllmEngine:
    def __init__(self, cfg: Config, base_path: str, run_dir: Path, dtype: torch.dtype, model,
                 device: torch.device, start: int = 0):
        """model: the trainer's policy (its adapter's rank: a continued init adapter keeps its own;
        its base's size, for the memory check). device: the trainer's GPU, vLLM's too. start: the
        step a resumed run goes on from; vLLM's seed is run.seed + start, so a resumed run draws
        new samples instead of replaying the sampling noise of step 1."""
        lora_rank = model.peft_config["default"].r
        version = vllm_startup.check_install(lora_rank)
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        self.cfg, self.SamplingParams, self.LoRARequest = cfg, SamplingParams, LoRARequest
        self.dir = Path(run_dir) / "vllm_adapter"
        self.version, self.request = 0, None
        ro, m = cfg.rollout, cfg.model
        # as TRL: vLLM's batch is a step's completions, B x G (its default, 1024 on an H100, sizes
        # the sampler's buffers and CUDA graphs for that many); a profiling batch of 4096 tokens
        # (vLLM's 8192-16384 would take much of a small share for activations)
        seqs = ro.prompts_per_step * ro.num_generations
        tokens = max(4096, seqs)  # vLLM refuses fewer batched tokens than sequences
        length = ro.max_prompt_tokens + ro.max_new_tokens
        rank = vllm_startup.served_rank(lora_rank, version)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # what the trainer's allocator caches is free to vLLM too
            free, total = torch.cuda.mem_get_info(device)
            costs = vllm_startup.startup_costs(model, dtype.itemsize, rank, seqs, tokens, length)
            vllm_startup.check_memory(ro.vllm_gpu_memory_utilization, free, total, str(device),
                                      costs)
        os.environ.update(one_process_launch(device))
        try:
            self.llm = LLM(
                model=base_path, tokenizer=base_path, revision=m.revision,
                tokenizer_revision=m.revision, trust_remote_code=m.trust_remote_code,
                dtype=str(dtype).removeprefix("torch."), seed=cfg.run.seed + start,
                gpu_memory_utilization=ro.vllm_gpu_memory_utilization,
                enable_sleep_mode=ro.vllm_sleep, max_model_len=length, enable_prefix_caching=True,
                enable_lora=True, max_loras=1, max_lora_rank=rank,
                logprobs_mode="processed_logprobs", max_num_seqs=seqs,
                # as TRL's colocate mode: the engine in this process, on LOCAL_RANK's GPU
                distributed_executor_backend="external_launcher", max_num_batched_tokens=tokens)
        # a model vLLM cannot serve with LoRA, too little free GPU memory, ...
        except Exception as e:
            raise ConfigError(f"rollout.engine: vllm could not start on {base_path} "
                              f"({vllm_startup.reason(e)}); rollout.engine: hf samples with any "
                              "model") from None
        if ro.vllm_sleep:
            self.llm.sleep(level=1)  # frees the KV cache (offloads weights) until the first rollout

    def sync(self, model) -> None:
        """Hand the policy's current adapter to vLLM: saved as a new version with a new LoRA id."""
        self.version += 1
        path = self.dir / f"v{self.version}"
        shutil.rmtree(path, ignore_errors=True)
        save_adapter(model, path)
        self.request = self.LoRARequest(f"minigrpo-v{self.version}", self.version, str(path))
        for old in self.dir.glob("v*"):  # vLLM has read older versions (max_loras=1 evicts them)
            if old != path:
                shutil.rmtree(old, ignore_errors=True)

    def generate(self, tokenizer, prompts: list[str], eos_ids: list[int],
                 device: torch.device) -> rollout.Rollout:
        """G samples of each rendered prompt -> a Rollout shaped like rollout.generate_rollout's,
        with sampler_logp (N, C): vLLM's log-prob of each sampled token (0 past the end)."""
        if self.request is None:
            raise RuntimeError("VllmEngine.generate before sync(): vLLM would sample from the "
                               "bare base")
        ro = self.cfg.rollout
        G = ro.num_generations
        params = self.SamplingParams(
            n=G, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
            max_tokens=ro.max_new_tokens, min_tokens=ro.max_new_tokens if ro.ignore_eos else 0,
            ignore_eos=ro.ignore_eos, stop=list(ro.stop_strings) or None,
            include_stop_str_in_output=True,  # as the HF path: the text keeps the stop
            stop_token_ids=eos_ids, logprobs=0)
        # token ids, not text: vLLM would re-tokenize and may add a BOS the template already has
        ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        if max(map(len, ids)) > ro.max_prompt_tokens:  # as the HF path: vLLM would cut the answer
            raise ValueError(f"a prompt has {max(map(len, ids))} tokens > "
                             f"rollout.max_prompt_tokens={ro.max_prompt_tokens}")
        if self.cfg.rollout.vllm_sleep:
            self.llm.wake_up()
        try:
            outputs = self.llm.generate([{"prompt_token_ids": x} for x in ids], params,
                                        lora_request=self.request, use_tqdm=False)
        finally:
            if self.cfg.rollout.vllm_sleep:
                self.llm.sleep(level=1)
        return to_rollout(tokenizer, ids, [c for o in outputs for c in o.outputs], G, device,
                          eos_ids)


def to_rollout(tokenizer, prompt_ids: list[list[int]], completions: list, G: int,
               device: torch.device, eos_ids: list[int] = ()) -> rollout.Rollout:
    """vLLM CompletionOutputs (prompt-major, G each) -> rollout.Rollout with sampler_logp.

    A completion is truncated when vLLM ended it for length and its last token is not an EOS (vLLM
    up to 0.11 says "length" for one whose last allowed token was EOS; the HF path and TRL look at
    the token). Its token ids include the EOS (or the stop string's tokens) otherwise, and the mask
    covers exactly those tokens. The texts are decoded from those ids, as the HF path decodes them
    (vLLM's own text stops inside the token that completed a stop string)."""
    pad = tokenizer.pad_token_id
    P, C = max(map(len, prompt_ids)), max(1, max(len(c.token_ids) for c in completions))
    N = len(completions)
    p_ids = torch.full((len(prompt_ids), P), pad, dtype=torch.long)  # (B, P) left-padded
    p_mask = torch.zeros((len(prompt_ids), P), dtype=torch.long)
    for i, x in enumerate(prompt_ids):
        p_ids[i, P - len(x):], p_mask[i, P - len(x):] = torch.tensor(x), 1
    c_ids = torch.full((N, C), pad, dtype=torch.long)  # (N, C) right-padded
    c_mask = torch.zeros((N, C))
    logp = torch.zeros((N, C))
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        c_ids[i, :n], c_mask[i, :n] = torch.tensor(list(c.token_ids), dtype=torch.long), 1.0
        if c.logprobs is not None:  # one {token_id: Logprob} per sampled token
            logp[i, :n] = torch.tensor([step[t].logprob
                                        for step, t in zip(c.logprobs, c.token_ids)])
    truncated = torch.tensor([c.finish_reason == "length"
                              and not (c.token_ids and c.token_ids[-1] in eos_ids)
                              for c in completions])
    texts = [tokenizer.decode(list(c.token_ids), skip_special_tokens=True) for c in completions]
    return rollout.Rollout(p_ids.repeat_interleave(G, 0).to(device),
                           p_mask.repeat_interleave(G, 0).to(device), c_ids.to(device),
                           c_mask.to(device), truncated.to(device), texts,
                           sampler_logp=logp.to(device))
