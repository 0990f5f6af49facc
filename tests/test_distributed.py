"""parallel/distributed.py: data-parallel GRPO under torchrun, on CPU with gloo. One update on two
processes equals one process's on the same global batch (each loss_type, micro-batches, two
mini-batches, a KL term), and the processes take their decisions together (a time limit, a judge
down, counters); a torchrun run writes one run directory and resumes as it would have
gone on; what cannot run data-parallel is refused in one line; the judge cache takes two writers.

The two-process parts start this file as a worker (`python tests/test_distributed.py worker DIR`,
with torchrun's environment variables set by hand) or torchrun itself.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import step  # noqa: E402
import train  # noqa: E402
from api.reply_cache import ReplyCache  # noqa: E402
from conftest import write_run_config  # noqa: E402
from data import PromptSampler  # noqa: E402
from files import jsonl  # noqa: E402
from parallel import distributed  # noqa: E402
from run import lifecycle  # noqa: E402

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
B, G, K, WORLD = 4, 4, 2, 2  # prompts, completions each, mini-batches, processes
# micro-batches of 2 rows: each process's micro-batches are the single process's, split between
# them (bnpo's token mean is per micro-batch by definition); a KL term and a real lr, so the second
# mini-batch is off-policy and clipped
SETTINGS = ["--optim.micro_batch_size=2", f"--grpo.num_mini_batches={K}", "--grpo.beta=0.04",
            "--optim.lr=0.05", "--grpo.epsilon=0.05", "--grpo.epsilon_high=0.05"]
TIMING = {"step_time", "rollout_time", "rollout_tokens_per_s", "peak_memory_mb", "eval/seconds"}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def rank_groups(rank: int) -> list[int]:
    """The global batch's groups rank `rank` trains on: its share of each mini-batch, so that mini-
    batch j over the ranks is the single process's mini-batch j (no shuffling in this test)."""
    per = B // (K * WORLD)
    return [j * (B // K) + rank * per + i for j in range(K) for i in range(per)]


def one_update(tmp: Path, config: Path, loss_type: str, batch: dict, groups: list[int]):
    """A fresh run (the same LoRA init on every process) takes one step on `groups` of the fixed
    rollouts -> (the trained LoRA weights, the step's metrics)."""
    r = lifecycle.setup(*train.parse_args(["--config", str(config), *SETTINGS,
                                      f"--grpo.loss_type={loss_type}",
                                      f"--run.out_dir={tmp / loss_type}"]))
    kept = batch["kept"]
    rows = [i * G + j for i in groups for j in range(G)]
    part = step.take_rows(kept, rows)
    part.samples = [r.rows[batch["rows"][i]] for i in rows]
    real_collect, real_shuffle = step.collect, step.shuffle_groups
    step.collect = lambda *a, **k: (part, part)
    step.shuffle_groups = lambda p, G: p  # the order the mini-batches are cut from, kept
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the processes run (ENV): a thread count changes float sums, and
    try:  # Adam's first step turns a near-zero gradient's rounding into lr-sized differences
        metrics, trained = step.train_step(r)
        shown = train.completions_shown(trained, 10**6)  # every process's (a collective)
    finally:
        step.collect, step.shuffle_groups = real_collect, real_shuffle
        torch.set_num_threads(threads)
    return {n: p.detach().clone() for n, p in r.model.named_parameters() if p.requires_grad}, \
        metrics, shown


@pytest.fixture(scope="module")
def fixed_batch(tmp_path_factory, tiny_llama):
    """B x G completions sampled once, with rewards that vary within groups, saved for the
    processes -> (folder, config)."""
    tmp = tmp_path_factory.mktemp("ddp")
    config = write_run_config(tmp, tiny_llama, rollout={"prompts_per_step": B,
                                                        "num_generations": G})
    r = lifecycle.setup(*train.parse_args(["--config", str(config),
                                           f"--run.out_dir={tmp / 'draw'}"]))
    kept, _ = step.collect(r)
    index = {id(row): i for i, row in enumerate(r.rows)}
    torch.save({"kept": kept, "rows": [index[id(s)] for s in kept.samples]}, tmp / "batch.pt")
    return tmp, config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_update_on_two_processes_equals_one_process_on_the_same_global_batch(fixed_batch):
    tmp, config = fixed_batch
    port = free_port()
    # each rank's output to a file: a pipe nobody reads while the reference runs fills, and a rank
    # blocked on its write leaves the other in a collective until gloo gives up
    logs = [tmp / f"rank{k}.log" for k in range(WORLD)]
    files = [log.open("w") for log in logs]
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(tmp), str(config)],
                              env=ENV | {"RANK": str(k), "LOCAL_RANK": str(k),
                                         "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
                                         "MASTER_PORT": str(port)},
                              stdout=files[k], stderr=subprocess.STDOUT, text=True)
             for k in range(WORLD)]
    batch = torch.load(tmp / "batch.pt", weights_only=False)
    assert batch["kept"].total.unique().numel() > 1  # rewards vary: the advantages are not all 0
    one = {t: one_update(tmp / "one", config, t, batch, list(range(B))) for t in LOSS_TYPES}
    for p, f in zip(procs, files):  # meanwhile, the two processes ran
        p.wait(timeout=300)
        f.close()
    assert [p.returncode for p in procs] == [0, 0], [log.read_text()[-3000:] for log in logs]
    two = torch.load(tmp / "two.pt", weights_only=False)
    for loss_type in LOSS_TYPES:
        (weights, metrics, shown), (w2, m2, shown2) = one[loss_type], two[loss_type]
        for name, p in weights.items():
            torch.testing.assert_close(w2[name], p, atol=1e-6, rtol=0, msg=f"{loss_type} {name}")
        # metrics over the global batch: the same as one process's (sums in another order)
        assert set(m2) == set(metrics), loss_type
        for k, v in metrics.items():
            if k not in TIMING:
                assert m2[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (loss_type, k)
        assert metrics["prompts_drawn"] == B and metrics["clip_ratio/region_mean"] > 0
        assert sorted(s["completion"] for s in shown2) == sorted(s["completion"] for s in shown)
    assert two["helpers"] == [{"agree": True, "sum": {"x": 1.0, "n": 4}, "down": ["b"]}] * WORLD
    assert isinstance(two["helpers"][0]["sum"]["n"], int)
    lora_b = [n for n in weights if "lora_B" in n]
    assert lora_b and all(float(weights[n].abs().max()) > 0 for n in lora_b)  # the update moved B


def worker(tmp: Path, config: Path) -> None:
    """One of the WORLD processes: one update per loss_type on its groups; rank 0 saves them."""
    batch = torch.load(tmp / "batch.pt", weights_only=False)
    distributed.BUCKET = 300  # many all-reduces of a few LoRA matrices each, not one
    out = {t: one_update(tmp / f"rank{distributed.rank()}", config, t, batch,
                         rank_groups(distributed.rank())) for t in LOSS_TYPES}
    # the decisions taken together: a time limit one rank sees, counters, a judge down on rank 1
    judges, me = {"a": object(), "b": object()}, distributed.rank()
    down = distributed.down_anywhere([judges["b"]] if me == 1 else [], judges)
    out["helpers"] = distributed.gather({
        "agree": distributed.agree(me == 1), "sum": distributed.all_sum({"x": 0.5, "n": 2}),
        "down": [n for n, j in judges.items() if any(j is d for d in down)]})
    if me == 0:
        torch.save(out, tmp / "two.pt")
    distributed.stop()


def test_the_ranks_draw_together_the_prompts_one_process_draws_each_with_its_own_state():
    one = PromptSampler([10], seed=3)
    ranks = [PromptSampler([10], seed=3, rank=k, world=2) for k in range(2)]
    for _ in range(3):  # steps of B = 4: 2 a rank
        assert sorted(one.draw(4)) == sorted(ranks[0].draw(2) + ranks[1].draw(2))
    ranks[1].draw(3)  # resample_zero_std on one rank only
    assert ranks[0].state()["position"] == 6 and ranks[1].state()["position"] == 9


@pytest.mark.parametrize("override, says", [
    ("--grpo.scale_rewards=batch", "grpo.scale_rewards: batch divides by the std of the whole"),
    ("--rollout.prompts_per_step=3", "rollout.prompts_per_step=3 (the global B) must be a "
                                     "multiple of the 2 processes"),
    ("--grpo.num_mini_batches=2", "grpo.num_mini_batches=2 must divide each process's 1 prompts"),
    ("--rollout.engine=vllm", "rollout.engine: vllm (one engine per rank) is not data-parallel"),
    ("--mode=sft", "mode: sft is not data-parallel; run it with python train.py"),
])
def test_what_cannot_run_on_several_processes_stops_before_loading_with_one_line(
        tmp_path, tiny_llama, monkeypatch, capsys, override, says):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; refused before joining a group
    config = write_run_config(tmp_path, tiny_llama, run={"out_dir": str(tmp_path / "run")})
    overrides = [override] + {"--grpo.num_mini_batches=2": ["--rollout.prompts_per_step=2"],
                              "--mode=sft": ["--data.target=answer"]}.get(override, [])
    assert train.main(["--config", str(config), *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: torchrun with 2 processes: ") \
        and says in err[0], err
    assert not (tmp_path / "run").exists()


def test_torchrun_writes_one_run_and_a_resume_after_a_kill_goes_on_as_it_would_have(
        tmp_path, tiny_llama, capsys):
    config = write_run_config(tmp_path, tiny_llama, data={"select": [0, 8]},
                              eval={"select": [8, 12]},
                              rollout={"prompts_per_step": 4, "resample_zero_std": True},
                              run={"out_dir": str(tmp_path / "run"), "steps": 4, "save_every": 2,
                                   "sample_every": 1, "threads": 1, "eval_every": 2},
                              grpo={"num_iterations": 2})
    run = tmp_path / "run"

    def torchrun(*extra):
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node=2",
               f"--master_port={free_port()}", str(ROOT / "train.py"), "--config", str(config),
               *extra]
        done = subprocess.run(cmd, env=ENV, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr
    err = torchrun()
    assert err.count("[minigrpo] done") == 1  # rank 0 speaks for the run
    whole = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in whole] == [1, 2, 3, 4]
    # the global B (2 prompts a process), more where resample_zero_std drew more
    assert all(m["prompts_drawn"] >= 4 for m in whole) and any(
        0 < m["frac_reward_zero_std"] < 1 for m in whole)
    assert [m["eval/n"] for m in whole if "eval/n" in m] == [4, 4]  # rank 0's held-out scoring
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    state = torch.load(run / "checkpoints/step_000002/trainer_state.pt", weights_only=False)
    assert state["world_size"] == 2 and len(state["ranks"]) == 2
    positions = [s["data_position"]["position"] for s in state["ranks"]]  # each rank its own
    assert min(positions) >= 4 and sum(positions) == whole[0]["prompts_drawn"] + \
        whole[1]["prompts_drawn"]
    assert not torch.equal(state["ranks"][0]["rng"]["torch"], state["ranks"][1]["rng"]["torch"])
    # a kill during step 4: its checkpoint never landed, its log line is torn
    shutil.rmtree(run / "checkpoints/step_000004")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss"')
    # another number of processes is refused, in one line, before anything is written
    assert train.main(["--config", str(config), "--resume"]) == 2
    refused = capsys.readouterr().err.strip().splitlines()[-1]
    assert refused.startswith("error: --resume: ") and "written by 2 process(es), this run has " \
        "1; resume with torchrun --nproc_per_node=2" in refused
    torchrun("--resume")
    resumed = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(whole, resumed):
        assert {k: v for k, v in a.items() if k not in TIMING} == \
            {k: v for k, v in b.items() if k not in TIMING}


WRITER = """
import sys, time
from pathlib import Path
from api.reply_cache import ReplyCache
path, who, n, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
cache = ReplyCache(path, memory_size=0, label="judge")
while not go.exists():  # both start writing at once
    time.sleep(0.001)
for i in range(n):  # long replies: a line is more than one write of a buffered file
    cache.put(f"{who}-{i}", f"{who}-{i} " + "x" * (5000 + 37 * i), {"prompt_tokens": i})
    cache.put(f"shared-{i}", f"shared-{i}", {"prompt_tokens": i})  # both ranks ask it
"""


def test_the_judge_cache_under_two_writing_processes_loses_nothing_and_tears_no_line(tmp_path):
    """Two ranks append to one judge cache file at once: jsonl.append holds an exclusive lock
    (flock) from the end-of-file check to the fsync, so every line is whole and every reply kept."""
    path, n, go = str(tmp_path / "judge_cache.jsonl"), 150, tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, path, str(who), str(n), str(go)],
                              env=ENV, cwd=ROOT) for who in range(2)]
    go.touch()
    assert [p.wait(120) for p in procs] == [0, 0]
    records = [rec for _, _, rec in jsonl.read(path)]
    assert None not in records and os.path.getsize(path) == sum(
        len(json.dumps(r)) + 1 for r in records)  # every byte in a whole line
    cache = ReplyCache(path, memory_size=0, label="judge")
    for who in range(2):
        for i in range(n):
            assert cache.get(f"{who}-{i}") == f"{who}-{i} " + "x" * (5000 + 37 * i)
    assert all(cache.get(f"shared-{i}") == f"shared-{i}" for i in range(n))


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(Path(sys.argv[2]), Path(sys.argv[3]))


def test_an_environment_object_that_does_not_pickle_stays_on_its_rank(monkeypatch):
    """gather_drawn sends a rank's episodes to the others without their environment objects (a
    user's may hold a lock, a file, a client)."""
    import pickle
    from types import SimpleNamespace

    import rollout
    from engines import episodes
    monkeypatch.setattr(distributed, "world", lambda: 2)
    monkeypatch.setattr(distributed, "all_sum", lambda d: d)
    monkeypatch.setattr(distributed, "gather", lambda x: [pickle.loads(pickle.dumps(x))])
    env = SimpleNamespace(lock=threading.Lock(), tool_calls=1)
    ep = episodes.Episode(env=env, messages=[{"role": "user", "content": "q"}], prompt_ids=[1])
    z = torch.zeros(1, 1, dtype=torch.long)
    ro = rollout.Rollout(z, z, z, z, torch.zeros(1, dtype=torch.bool), ["a"], episodes=[ep])
    drawn = step.Scored(ro, [{"prompt": "q"}], torch.zeros(1), {}, {})
    r = SimpleNamespace(rows=drawn.samples, sampler=SimpleNamespace(counts=[1]))
    [back] = distributed.gather_drawn(r, drawn)
    assert back.rollout.episodes[0].env is None and back.rollout.episodes[0].messages == \
        ep.messages and back.samples[0] is r.rows[0] and ep.env is env  # the rank's own is kept
