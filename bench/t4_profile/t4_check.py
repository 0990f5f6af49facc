"""The T4 budget check (issue 26): configs/t4.yaml's work, with a reward that varies on a random
model's text so that every step has non-zero advantages, then what the run left behind: the fp16
loss scale, skipped updates, and whether the LoRA weights moved and stayed finite.

    python bench/memory_cap.py --budget-gb 13.9 --model random:qwen2.5-1.5b -- \
        --config bench/t4_profile/t4_check.yaml --run.out_dir=/tmp/t4 ...      # on the GPU
    python bench/t4_profile/t4_check.py /tmp/t4                                 # then this
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def vowel_share(completion: str, sample: dict) -> float:
    """The share of letters that are vowels: random text varies in it, so groups have spread."""
    letters = [c for c in completion.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / max(len(letters), 1)


def main(out: Path) -> int:
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    ckpt = sorted((out / "checkpoints").glob("step_*"))[-1]
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    lora = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    b = [v for k, v in lora.items() if "lora_B" in k]
    print(f"[t4] {len(steps)} steps; skipped_updates per step "
          f"{[m.get('skipped_updates', 0) for m in steps]}; grad_norm "
          f"{[round(m['grad_norm'], 4) for m in steps if 'grad_norm' in m]}")
    print(f"[t4] fp16 loss scale at the end: {(state.get('scaler') or {}).get('scale')}; "
          f"LoRA B (zero at start): max |B| {max(x.abs().max().item() for x in b):.3e}, "
          f"all finite: {all(torch.isfinite(x).all().item() for x in lora.values())}, "
          f"{len(lora)} tensors, dtypes {sorted({str(x.dtype) for x in lora.values()})}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
