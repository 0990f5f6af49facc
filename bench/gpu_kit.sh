#!/bin/sh
# Packs what the lent GPU machine lacks for the GPU benchmarks (it has torch, accelerate, rich,
# scipy, pyyaml and older transformers/peft, and no network): wheels into .whl/ and the built-in
# model's tokenizer into .gpu/tokenizer (both git-ignored: name them in the device run's `carry`).
# It also writes the commit (and whether the tree differs from it) to .gpu/commit.txt, since the
# device gets no .git. At most 64 MiB travel per call (the repo is ~3 MiB of it), hence the kits:
#   sh bench/gpu_kit.sh bench   # every stage of bench/gpu_checks.sh: trl, datasets and the pinned
#                               # transformers/peft (~21 MiB with .gpu)
#   sh bench/gpu_kit.sh t4      # memory_cap.py with configs/t4.yaml (4-bit): bitsandbytes (43 MB) and
#                               # the pinned transformers/peft (~58 MB: just under the limit)
#   sh bench/gpu_kit.sh all     # both (~63 MiB: too close to the limit; use one of the two)
# (openai is not needed: judge.py imports it only when a judge is used.) bench/gpu_checks.sh
# installs .whl itself; by hand: python3 -m pip install -q --no-index --no-deps --no-compile
# --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -e
kit=${1:?usage: sh bench/gpu_kit.sh bench|t4|all}
cd "$(dirname "$0")/.."
# huggingface_hub stays the machine's (its 1.33 meets transformers' >=1.31; 2.x would need httpx2 and more)
pinned="transformers==5.23.0 peft==0.21.2 regex==2026.11.15"
case $kit in
  bench) pkgs="trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 $pinned" ;;
  t4) pkgs="bitsandbytes==0.50.2 $pinned" ;;
  all) pkgs="trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 bitsandbytes==0.50.2 $pinned" ;;
  *) echo "usage: sh bench/gpu_kit.sh bench|t4|all" >&2; exit 2 ;;
esac
rm -rf .whl && mkdir -p .whl .gpu
for p in $pkgs; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$p"
done
${PYTHON:-.venv/bin/python} - <<'PY'
import shutil, sys
from pathlib import Path
sys.path.insert(0, ".")
from sources.hub import builtin_model_dir
src, dst = builtin_model_dir("smollm2-135m", "~/.cache/minigrpo"), Path(".gpu/tokenizer")
dst.mkdir(parents=True, exist_ok=True)
for f in src.iterdir():
    if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) or f.name == "vocab.json" or f.name == "merges.txt":
        shutil.copy(f, dst / f.name)
print("tokenizer files:", sorted(p.name for p in dst.iterdir()))
PY
echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!.whl' ':!.gpu' 2>/dev/null \
  || echo ' (with uncommitted changes)')" > .gpu/commit.txt
cat .gpu/commit.txt
du -sh .whl .gpu
