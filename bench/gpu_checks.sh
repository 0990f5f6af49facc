#!/bin/sh
# The GPU checks of the defaults (issues 35, 43, 48), prepared for the lent GPU machine: 10 minutes
# a call, about 15 minutes of device time a session, 64 MiB carried a call, no network.
#
# Here, first: sh bench/gpu_kit.sh bench   (~21 MiB: wheels in .whl, tokenizer and commit in .gpu)
# On the device, one call, carrying .whl and .gpu (the script installs the wheels itself):
#   OUT=$OUT sh bench/gpu_checks.sh STAGE [STAGE ...]
# Every stage runs under `timeout`: its own limit, and never past DEADLINE seconds from the start
# (default 560, so the call returns before the device's 600 s); a stage that is cut says so, and
# keeps what it finished. Logs go to $OUT; bring each to its study's folder (bench/README.md),
# named <device>_<date>_<what> (e.g. bench/t4_profile/h200_2026-11-28_t4_budget.log).
#
# The call plan (minutes are estimates from the 2026-11-27 H100 and 2026-11-28 H200 logs, not
# measurements of this script: a child's fixed cost ~28 s; TRL ~13 s a step at 128 new tokens,
# ~50 s at 512; minigrpo's first step compiles for 40-60 s):
#   first GPU session:  call 1: trl-0.6b colab   (~6.5 + ~2.5 min)
#                       call 2: tests            (~3 min), if the session has time left
#   next GPU session:   call 1: trl-1.5b          (~9 min; the JSON keeps what finished if cut)
#                       call 2: defaults decode   (~3 + ~2 min)
#   then:               trl512 (Qwen3-0.6B at 512 new tokens, 3 measured steps, 1 alternation)
#                       t4 (~4 min; its own call with the t4 kit, which bitsandbytes fills)
# Stages (limit in seconds; outputs to bench/speed_vs_trl, t4_profile, gpu_defaults, gpu_tests):
#   trl-0.6b  (420) bench/speed_vs_trl/vs_trl.py --preset gpu, random Qwen3-0.6B shape: minigrpo
#             with no setting written against TRL's GRPOTrainer, STEPS (3: the first is warm-up,
#             left out) a run, ALTERNATIONS (2), TOKENS (128) new tokens; the JSON is written after
#             each run
#   trl-1.5b  (540) the same on Qwen2.5-1.5B's shape;  trl: both shapes in one call (540; cut)
#   trl512    (540) Qwen3-0.6B at 512 new tokens, 4 steps a run, 1 alternation: the headline
#             length, which at 2 alternations does not fit a call (TRL alone: ~4 x 200 s)
#   colab     (240) configs/colab_t4.yaml as a T4 chooses it (fp16, no compiled or merged sampler)
#             under a 13.9 GiB cap, random Qwen3-0.6B, completions that end, gradients that flow
#             (bench/t4_profile/colab_check.yaml says how), 5 steps; then
#             bench/t4_profile/t4_check.py: the fp16 loss scale, skipped updates and whether the
#             adapter moved
#   t4        (300) configs/t4.yaml (NF4 base, fp16, as a T4 runs it) under the 13.9 GiB cap, random
#             Qwen2.5-1.5B, bench/t4_profile/t4_check.yaml's fixed-length rollouts, 3 steps; then
#             bench/t4_profile/t4_check.py. Needs the t4 kit (sh bench/gpu_kit.sh t4:
#             bitsandbytes), not bench's
#   defaults  (240) train.py with no speed or memory setting (bench/gpu_defaults/gpu_defaults.yaml)
#             on a random Qwen3-0.6B: what auto chose, the first step's cost, step times, the peak,
#             the sampler-vs-trainer log-prob gap step by step; TORCH_LOGS recompiles and CUDA
#             graphs
#   decode    (180) bench/gpu_defaults/decode_speed.py at 128 rows, 64 + 512 positions: sdpa
#             against the folded GQA decode, compiled, as a share of the KV-inclusive bound
#   tests     (300) the GPU tests (tests/test_gpu*.py; tests/test_rollout.py's cuda ones)
#   vllm      (300) the vLLM rollout against HF generate, where vllm imports (it cannot be carried)
set -u
OUT=${OUT:-/tmp/out}
DEADLINE=${DEADLINE:-560}
STEPS=${STEPS:-3}
ALTERNATIONS=${ALTERNATIONS:-2}
TOKENS=${TOKENS:-128}
TOK=.gpu/tokenizer
export PYTHONUNBUFFERED=1 OUT STEPS ALTERNATIONS TOKENS TOK
mkdir -p "$OUT"
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.."

stage() {  # one stage's commands (run through `timeout` by the loop at the bottom)
  case $1 in
    trl|trl-0.6b|trl-1.5b|trl512)
      models="--model random:qwen3-0.6b --model random:qwen2.5-1.5b"
      [ "$1" = trl-1.5b ] && models="--model random:qwen2.5-1.5b"
      [ "$1" = trl-0.6b ] && models="--model random:qwen3-0.6b"
      [ "$1" = trl512 ] && models="--model random:qwen3-0.6b" TOKENS=512 STEPS=4 ALTERNATIONS=1
      rm -rf "/tmp/vs-$1"
      python3 bench/speed_vs_trl/vs_trl.py --preset gpu $models --max-new-tokens "$TOKENS" \
        --steps "$STEPS" --alternations "$ALTERNATIONS" --tokenizer $TOK --workdir "/tmp/vs-$1" \
        --json "$OUT/vs_trl_$1.json" 2>&1 | tee "$OUT/vs_trl_$1.log" | grep -E "^\[bench\]" \
        | cut -c1-300 ;;
    colab)
      rm -rf /tmp/colab
      python3 bench/memory_cap.py --budget-gb 13.9 --model random:qwen3-0.6b --tokenizer $TOK \
        -- --config bench/t4_profile/colab_check.yaml 2>&1 | tee "$OUT/colab.log" \
        | grep -E "^\[memory_cap\]|^\[minigrpo\] (chosen|warning)|^step " | cut -c1-300
      cp /tmp/colab/metrics.jsonl "$OUT/colab_metrics.jsonl"
      python3 bench/t4_profile/t4_check.py /tmp/colab 2>&1 | tee -a "$OUT/colab.log"
      python3 bench/gpu_steps.py /tmp/colab/metrics.jsonl | tee -a "$OUT/colab.log" ;;
    t4)
      rm -rf /tmp/t4
      python3 bench/memory_cap.py --budget-gb 13.9 --model random:qwen2.5-1.5b --tokenizer $TOK \
        -- --config bench/t4_profile/t4_check.yaml --run.steps=3 --run.save_every=3 \
        --run.out_dir=/tmp/t4 \
        2>&1 | tee "$OUT/t4.log" | grep -E "^\[memory_cap\]|^\[minigrpo\] (chosen|warning)|^step " \
        | cut -c1-300
      cp /tmp/t4/metrics.jsonl "$OUT/t4_metrics.jsonl"
      python3 bench/t4_profile/t4_check.py /tmp/t4 2>&1 | tee -a "$OUT/t4.log" ;;
    defaults)
      rm -rf /tmp/defaults
      TORCH_LOGS=recompiles,cudagraphs python3 bench/memory_cap.py --budget-gb 70 \
        --model random:qwen3-0.6b --tokenizer $TOK \
        -- --config bench/gpu_defaults/gpu_defaults.yaml \
        --run.out_dir=/tmp/defaults > "$OUT/defaults.log" 2>&1
      grep -E "^\[minigrpo\] (chosen|step [0-9]+/)|^\[memory_cap\]|[Rr]ecompil|cudagraph" \
        "$OUT/defaults.log" | cut -c1-300 | tail -30
      cp /tmp/defaults/metrics.jsonl "$OUT/defaults_metrics.jsonl"
      python3 bench/gpu_steps.py /tmp/defaults/metrics.jsonl | tee -a "$OUT/defaults.log" ;;
    decode)
      hbm=$(python3 -c "import torch; n = torch.cuda.get_device_name(0); \
print('4.8e12' if 'H200' in n else '3.35e12' if 'H100' in n else '0.6e12')")
      TORCH_LOGS=cudagraphs,recompiles python3 bench/gpu_defaults/decode_speed.py --modes compiled \
        --new 512 --hbm "$hbm" > "$OUT/decode.log" 2>&1
      grep -v "^\s*$" "$OUT/decode.log" | tail -12 ;;
    tests)  # the whole output is kept; the summary's counts and FAILED lines end it
      python3 -m pytest -rfEs -p no:cacheprovider tests/test_gpu.py tests/test_gpu_attention.py \
        tests/test_gpu_memory.py tests/test_gpu_auto.py 2>&1 | tee "$OUT/tests.log" | tail -15
      python3 -m pytest -rfEs -p no:cacheprovider tests/test_rollout.py -k "cuda or gpu" 2>&1 \
        | tee -a "$OUT/tests.log" | tail -5 ;;
    vllm)
      if ! python3 -c "import vllm" 2>/dev/null; then
        echo "[gpu] vllm: not installed here, and its wheel (hundreds of MB) cannot travel in a" \
          "device call (64 MiB): the vLLM rollout could not be run" | tee "$OUT/vllm.log"
        return 0
      fi
      for engine in hf vllm; do
        rm -rf "/tmp/engine-$engine"
        python3 bench/memory_cap.py --budget-gb 70 --model random:qwen3-0.6b --tokenizer $TOK \
          -- --config bench/gpu_defaults/gpu_defaults.yaml --run.steps=3 --rollout.engine=$engine \
          --run.out_dir="/tmp/engine-$engine" > "$OUT/engine_$engine.log" 2>&1
        grep "^\[memory_cap\]" "$OUT/engine_$engine.log" | tail -5
      done ;;
    *) return 64 ;;
  esac
}

limit_of() {
  case $1 in
    trl-0.6b) echo 420 ;; trl|trl-1.5b|trl512) echo 540 ;; colab|defaults) echo 240 ;; t4) echo 300 ;;
    decode) echo 180 ;; tests|vllm) echo 300 ;; *) echo 0 ;;
  esac
}

if [ "${1:-}" = --stage ]; then  # this script again, under timeout, for one stage
  stage "$2"
  exit $?
fi
for s in "$@"; do
  if [ "$(limit_of "$s")" = 0 ]; then
    echo "usage: sh bench/gpu_checks.sh STAGE ...; stages: trl-0.6b trl-1.5b trl trl512 colab" \
      "t4 defaults decode tests vllm (see the header)" >&2
    exit 2
  fi
done
if ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "bench/gpu_checks.sh measures a CUDA GPU: none here" >&2
  exit 2
fi
start=$(date +%s)
if [ -d .whl ]; then  # a warm machine keeps the last call's /tmp/site: start clean
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site
fi
{
  python3 -c "import torch, transformers, peft; print('[gpu]', torch.cuda.get_device_name(0), \
'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, \
'peft', peft.__version__)"
  echo "[gpu] $(date -u '+%Y-%m-%d %H:%M UTC'); $(cat .gpu/commit.txt 2>/dev/null \
    || echo 'commit unknown: run bench/gpu_kit.sh here first')"
  echo "[gpu] stages: $*; DEADLINE=$DEADLINE STEPS=$STEPS ALTERNATIONS=$ALTERNATIONS TOKENS=$TOKENS"
} | tee -a "$OUT/machine.txt"
for s in "$@"; do
  t0=$(date +%s)
  left=$(( DEADLINE - (t0 - start) - 10 ))
  limit=$(limit_of "$s")
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 60 ]; then
    echo "[gpu] $s: not started, ${left} s left of DEADLINE=$DEADLINE" | tee -a "$OUT/machine.txt"
    continue
  fi
  timeout -k 10 "$limit" sh "$SELF" --stage "$s"
  rc=$?
  case $s in trl*)  # the summaries of whatever finished, and what auto chose on minigrpo's side
    python3 bench/speed_vs_trl/vs_trl.py --report "$OUT/vs_trl_$s.json" 2>&1 \
      | tee -a "$OUT/vs_trl_$s.log" \
      | grep -vE "^(rollout|generate|training) " | cut -c1-300
    for log in /tmp/vs-"$s"/*-minigrpo-1/child.log; do
      grep -m1 "chosen for this GPU" "$log" 2>/dev/null | cut -c1-400 | tee -a "$OUT/vs_trl_$s.log"
    done ;;
  esac
  what="exit $rc"
  [ $rc = 124 ] || [ $rc = 137 ] && what="CUT at its ${limit} s limit"
  echo "[gpu] $s: $what, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/machine.txt"
done
