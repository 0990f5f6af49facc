"""eval.py with a slow judge: each model scored while the next generates, vs scoring each in turn.

    .venv/bin/python bench/slow_judges/eval_overlap.py --judge-delay 5 --reps 2

One process, alternating the two ways (sequential first) on the same work: configs/quickstart.yaml's
held-out rows (the first --rows), built-in SmolLM2-135M as two entries (`base`, and `again`, the
same weights as a full model directory), --max-new-tokens, a judge reward answered by
tests/fake_openai_server.py after --judge-delay seconds (8 requests at a time). "Sequential" runs
eval.py's own code with its background scoring made synchronous. Reports each run's wall time, the
medians, and overlapped / sequential. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import eval as ev  # noqa: E402
from config import ModelConfig  # noqa: E402
from fake_openai_server import FakeOpenAIServer, length_score, ok  # noqa: E402
from rewards import in_background  # noqa: E402
from sources.hub import resolve_model_path


def synchronous(fn, after=None) -> concurrent.futures.Future:
    """ev.in_background, waited for: eval.py scoring each model before the next one generates."""
    future = in_background(fn, after)
    concurrent.futures.wait([future])
    return future


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--judge-delay", type=float, default=5.0,
                    help="seconds the fake judge takes per request")
    ap.add_argument("--reps", type=int, default=2, help="alternations (sequential, overlapped)")
    ap.add_argument("--rows", type=int, default=16, help="held-out rows per model")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    base = resolve_model_path(ModelConfig(name="smollm2-135m"))  # converted once, then cached
    times: dict[str, list[float]] = {"sequential": [], "overlapped": []}
    with FakeOpenAIServer(reply=length_score, default=ok(delay_s=args.judge_delay)) as judge, \
            tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for way in times:
                out = Path(tmp) / f"{way}{rep}"
                argv = ["--config", str(ROOT / "configs/quickstart.yaml"),
                        "--models", "base", f"again={base}",
                        f"--eval.limit={args.rows}", f"--eval.max_new_tokens={args.max_new_tokens}",
                        f"--eval.batch_size={args.rows}", f"--eval.out_dir={out}",
                        f"--judge.base_url={judge.url}", "--judge.model=fake-judge",
                        "--judge.api_key_env=MINIGRPO_BENCH_NO_KEY", "--judge.max_concurrent=8",
                        "--judge.max_retries=0",
                        "--judge.memory_cache=false",  # the same weights twice: no reply is reused
                        "--rewards=[{name: answer_match}, {name: judge, args: "
                        "{template: 'Score 0-10 as JSON: {completion}'}}]"]
                t0 = time.perf_counter()
                with (mock.patch.object(ev, "in_background", synchronous) if way == "sequential"
                      else contextlib.nullcontext()):
                    if ev.main(argv) != 0:
                        raise SystemExit(f"eval.py failed ({way}, rep {rep})")
                times[way].append(time.perf_counter() - t0)
                print(f"rep {rep} {way}: {times[way][-1]:.2f} s", file=sys.stderr, flush=True)
    seq, ovl = statistics.median(times["sequential"]), statistics.median(times["overlapped"])
    print(f"judge delay {args.judge_delay} s, {args.rows} rows x 2 models, "
          f"{args.max_new_tokens} new tokens, {args.reps} reps")
    print(f"sequential {seq:.2f} s (runs {', '.join(f'{t:.2f}' for t in times['sequential'])})")
    print(f"overlapped {ovl:.2f} s (runs {', '.join(f'{t:.2f}' for t in times['overlapped'])})")
    print(f"overlapped / sequential: {ovl / seq:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
