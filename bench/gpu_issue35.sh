#!/bin/sh
# Issue 35's GPU checks ("fast by default"), prepared as one script for the lent GPU machine. Each
# stage writes its log under $OUT and says how long it took; stages run in the order given. With
# the kit installed first (bench/RESULTS.md, "For the next session with a GPU"), one call each:
#   sh bench/gpu_issue35.sh trl                     # ~9 min: both shapes against TRL
#   sh bench/gpu_issue35.sh tests decode defaults   # ~6 min
#   sh bench/gpu_issue35.sh vllm                    # says whether vLLM can run here at all
# The minutes are estimates from the 2026-11-27 H100 logs (TRL: ~50 s a step at 512 new tokens,
# ~0.1 s a decoded token; minigrpo's first step compiles for ~40-70 s), not measurements of this
# script. Stages:
#   trl       bench/vs_trl.py --preset gpu on Qwen3-0.6B's and Qwen2.5-1.5B's shapes: minigrpo with
#             no setting written against TRL, 4 steps a run (the first left out), 2 alternations,
#             at $TOKENS new tokens (default 128: at the preset's 512, TRL's runs alone take over
#             10 minutes); trl-0.6b, trl-1.5b: one shape
#   tests     the GPU tests: tests/test_gpu*.py, and tests/test_rollout.py's cuda/gpu ones
#   decode    bench/decode_speed.py at 128 rows, 64 + 512 positions: sdpa against the folded GQA
#             attention, compiled, as a share of the KV-inclusive bound; TORCH_LOGS shows the CUDA
#             graphs and recompiles
#   defaults  train.py with no speed or memory setting (bench/gpu_defaults.yaml) on a random
#             Qwen3-0.6B: what "auto" chose, the first step's one-time cost, the step times, the
#             peak, and the sampler-vs-trainer log-prob gap (sampler_logp_abs_diff) step by step
#   vllm      the vLLM rollout against HF generate on bench/gpu_defaults.yaml, when vllm imports
set -e
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
TOK=.gpu/tokenizer
TOKENS=${TOKENS:-128}
if ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "bench/gpu_issue35.sh measures a CUDA GPU: none here" >&2
  exit 2
fi
HBM=$(python3 -c "import torch; n = torch.cuda.get_device_name(0); \
print('4.8e12' if 'H200' in n else '3.35e12')")
python3 -c "import torch, transformers, peft; print('[gpu35]', torch.cuda.get_device_name(0), \
'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" \
  | tee -a "$OUT/machine.txt"
git log -1 --format='[gpu35] commit %H' 2>/dev/null | tee -a "$OUT/machine.txt" || true
for stage in "$@"; do
  t0=$(date +%s)
  case $stage in
    tests)
      python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py tests/test_gpu_attention.py \
        tests/test_gpu_memory.py tests/test_gpu_auto.py 2>&1 | tail -25 | tee "$OUT/tests.log"
      python3 -m pytest -q -rs -p no:cacheprovider tests/test_rollout.py -k "cuda or gpu" 2>&1 \
        | tail -10 | tee -a "$OUT/tests.log" ;;
    decode)
      TORCH_LOGS=cudagraphs,recompiles python3 bench/decode_speed.py --modes compiled \
        --new 512 --hbm "$HBM" > "$OUT/decode.log" 2>&1 || true
      grep -v "^\s*$" "$OUT/decode.log" | tail -12 ;;
    defaults)
      rm -rf /tmp/defaults
      TORCH_LOGS=recompiles,cudagraphs python3 bench/memory_cap.py --budget-gb 70 \
        --model random:qwen3-0.6b --tokenizer $TOK -- --config bench/gpu_defaults.yaml \
        --run.out_dir=/tmp/defaults > "$OUT/defaults.log" 2>&1 || true
      grep -E "^\[minigrpo\] (chosen|step [0-9]+/)|^\[memory_cap\]|[Rr]ecompil|cudagraph" \
        "$OUT/defaults.log" | cut -c1-300 | tail -30
      cp /tmp/defaults/metrics.jsonl "$OUT/defaults_metrics.jsonl" 2>/dev/null || true
      python3 - <<'PY' | tee -a "$OUT/defaults.log"
import json
for line in open("/tmp/defaults/metrics.jsonl"):
    m = json.loads(line)
    print(f"[gpu35] step {m['step']}: step {m['step_time']:.1f} s, rollout "
          f"{m['rollout_time']:.1f} s, peak {m['peak_memory_mb'] / 1024:.2f} GiB, "
          f"sampler_logp_abs_diff {m.get('sampler_logp_abs_diff', float('nan')):.4f}, "
          f"grad_norm {m.get('grad_norm', float('nan')):.3f}")
PY
      ;;
    trl|trl-0.6b|trl-1.5b)
      models="--model random:qwen3-0.6b --model random:qwen2.5-1.5b"
      [ "$stage" = trl-0.6b ] && models="--model random:qwen3-0.6b"
      [ "$stage" = trl-1.5b ] && models="--model random:qwen2.5-1.5b"
      rm -rf "/tmp/vs-$stage"
      python3 bench/vs_trl.py --preset gpu $models --max-new-tokens "$TOKENS" --tokenizer $TOK \
        --workdir "/tmp/vs-$stage" --json "$OUT/vs_trl_$stage.json" \
        > "$OUT/vs_trl_$stage.log" 2>&1 || true
      grep -E "^\[bench\]|^==|x$|^[a-z].*[0-9]$|^steps|^first|^targets|^per run" \
        "$OUT/vs_trl_$stage.log" | cut -c1-300 | tail -40
      for log in /tmp/vs-"$stage"/*-minigrpo-1/child.log; do
        grep -m1 "chosen for this GPU" "$log" | cut -c1-400 || true
      done ;;
    vllm)
      if python3 -c "import vllm" 2>/dev/null; then
        for engine in hf vllm; do
          rm -rf "/tmp/engine-$engine"
          python3 bench/memory_cap.py --budget-gb 70 --model random:qwen3-0.6b --tokenizer $TOK \
            -- --config bench/gpu_defaults.yaml --run.steps=3 --rollout.engine=$engine \
            --run.out_dir="/tmp/engine-$engine" > "$OUT/engine_$engine.log" 2>&1 || true
          grep "^\[memory_cap\]" "$OUT/engine_$engine.log" | tail -5
        done
      else
        echo "[gpu35] vllm: not installed here, and its wheel (hundreds of MB) cannot travel in" \
          "a device call (64 MiB): the vLLM rollout could not be run" | tee "$OUT/vllm.log"
      fi ;;
    *) echo "usage: sh bench/gpu_issue35.sh [trl|trl-0.6b|trl-1.5b] [tests] [decode] [defaults]" \
         "[vllm]" >&2; exit 2 ;;
  esac
  echo "[gpu35] $stage took $(( $(date +%s) - t0 )) s" | tee -a "$OUT/machine.txt"
done
