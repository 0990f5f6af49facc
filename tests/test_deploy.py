"""tools/deploy.py through `python -m tools.export`: an Inference Endpoint created on a fake hub
with the seed's settings and the token kept secret; a served model (the fake OpenAI-compatible
server) compared with its adapter's greedy replies on held-out prompts."""
import inspect
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch

import eval as ev
from config import load_config
from fake_openai_server import FakeOpenAIServer, server_error
from model import load_inference
from test_export import error_line, run_export, trained_run
from tools import export

SECRET = "hf_s3cretTOKENvalue"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_llama):
    """test_export.py's run: one checkpoint of a LoRA adapter with random weights."""
    return trained_run(tmp_path_factory.mktemp("deploy"), tiny_llama)


@pytest.fixture
def hub(monkeypatch):
    """A fake hub: the upload answers commit abc123, create_inference_endpoint records its
    arguments (and raises hub.fail when set)."""
    fake = SimpleNamespace(calls=[], fail=None)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder",
                        lambda self, **kw: SimpleNamespace(oid="abc123"))

    def create(name, **kw):
        fake.calls.append((name, kw))
        if fake.fail:
            raise fake.fail
        return SimpleNamespace(name=name, status="pending", url=None)
    monkeypatch.setattr(huggingface_hub, "create_inference_endpoint", create)
    return fake


def test_create_endpoint_serves_the_upload_with_vllm_on_a_t4_scaled_to_zero(trained, tmp_path,
                                                                           capsys, hub):
    out = tmp_path / "merged"
    assert run_export(trained, out, "--dtype", "float16", "--push-to-hub", "me/tiny-grpo",
                      "--create-endpoint", "tiny-grpo-t4") == 0
    [(name, kw)] = hub.calls
    assert name == "tiny-grpo-t4" and kw == {
        "repository": "me/tiny-grpo", "revision": "abc123", "framework": "pytorch",
        "task": "text-generation", "accelerator": "gpu", "instance_type": "nvidia-t4",
        "instance_size": "x1", "vendor": "aws", "region": "us-east-1", "min_replica": 0,
        "max_replica": 1, "scale_to_zero_timeout": 60,
        "custom_image": {"vLLM": {"url": "vllm/vllm-openai:v0.30.0", "port": 8000}},
        # the run's longest prompt + reply, and the name `check --model` asks for
        "container_args": ["--max-model-len", "576", "--served-model-name", "tiny-grpo"],
        "token": SECRET}
    # the installed huggingface_hub takes each of them
    inspect.signature(huggingface_hub.HfApi.create_inference_endpoint).bind(None, name, **kw)
    captured = capsys.readouterr()
    assert "endpoint tiny-grpo-t4 created (pending)" in captured.out
    assert "python -m tools.export check" in captured.out \
        and "--model tiny-grpo --api-key-env HF_TOKEN" in captured.out
    assert SECRET not in captured.out + captured.err
    hub.calls.clear()
    assert run_export(trained, tmp_path / "l4", "--push-to-hub", "me/tiny-grpo",
                      "--create-endpoint", "tiny-grpo-l4", "--endpoint-instance", "nvidia-l4:x4",
                      "--endpoint-region", "gcp/us-central1", "--endpoint-idle-minutes", "15") == 0
    [(_, kw)] = hub.calls
    assert (kw["instance_type"], kw["instance_size"], kw["vendor"], kw["region"],
            kw["scale_to_zero_timeout"]) == ("nvidia-l4", "x4", "gcp", "us-central1", 15)


def test_a_refused_endpoint_exits_1_keeps_the_export_and_hides_the_token(trained, tmp_path,
                                                                        capsys, hub):
    hub.fail = RuntimeError(f"402 Client Error: no payment method (token {SECRET})\ndetails")
    out = tmp_path / "merged"
    assert run_export(trained, out, "--dtype", "float16", "--push-to-hub", "me/tiny-grpo",
                      "--create-endpoint", "tiny-grpo-t4") == 1
    captured = capsys.readouterr()
    err = error_line(captured.err)
    assert "creating endpoint tiny-grpo-t4 failed (RuntimeError: 402" in err \
        and "uploaded to me/tiny-grpo" in err
    assert SECRET not in captured.out + captured.err and (out / "model.safetensors").is_file()


@pytest.mark.parametrize("extra, says", [
    (["--create-endpoint", "tiny-grpo-t4"], "add --push-to-hub"),
    (["--push-to-hub", "me/m", "--create-endpoint", "Tiny_GRPO"], "is not an endpoint name"),
    (["--push-to-hub", "me/m", "--create-endpoint", "tiny-grpo"], "export with --dtype float16"),
    (["--push-to-hub", "me/m", "--create-endpoint", "tiny-grpo", "--dtype", "float16",
      "--endpoint-instance", "t4"], "give a GPU instance"),
    (["--push-to-hub", "me/m", "--create-endpoint", "tiny-grpo", "--dtype", "float16",
      "--endpoint-region", "us-east-1"], "give VENDOR/REGION"),
    # the run's prompts + replies reach 576 tokens; the tiny model's positions end at 256
    (["--max-model-len", "100"], "under the training run's longest prompt + reply (576 tokens)"),
    (["--max-model-len", "1000"], "over the model's max_position_embeddings (256)"),
])
def test_bad_endpoint_settings_exit_2_before_anything_is_written_or_created(
        trained, tmp_path, capsys, hub, extra, says):
    out = tmp_path / "merged"
    assert run_export(trained, out, *extra) == 2
    assert says in error_line(capsys.readouterr().err)
    assert not out.exists() and not hub.calls


def check_argv(tiny_llama, trained, *extra):
    """`check` on configs/qgen.yaml as shipped, shrunk to the tiny model and the fixture roles."""
    return ["check", "--config", "configs/qgen.yaml", "--adapter", str(trained["run"]),
            f"--model.name={tiny_llama}", f"--data.name={FIXTURES / 'backend_roles.json'}",
            "--data.select=[0,32]", "--eval.select=[32,40]", "--limit", "3",
            "--max-new-tokens", "8", "--model", "tiny-grpo", *extra]


def adapter_replies(tiny_llama, trained) -> dict[str, str]:
    """Held-out prompt -> the adapter's greedy 8-token reply, as eval.py generates it."""
    cfg = load_config("configs/qgen.yaml", [f"--model.name={tiny_llama}",
                                            f"--data.name={FIXTURES / 'backend_roles.json'}",
                                            "--data.select=[0,32]", "--eval.select=[32,40]",
                                            "--eval.max_new_tokens=8", "--eval.temperature=0"])
    model, tok = load_inference(cfg.model, torch.device("cpu"), adapter=str(trained["run"]))
    rows = ev.held_out_rows(cfg)[:3]
    return dict(zip([r["prompt"] for r in rows], ev.generate_rows(model, tok, rows, cfg).texts))


def test_check_reports_how_many_served_replies_are_the_adapters_own(trained, tiny_llama, capsys,
                                                                    monkeypatch):
    replies = adapter_replies(tiny_llama, trained)
    first, second, third = replies
    served = {**replies, third: "How would you shard a Postgres table?"}  # one differs
    monkeypatch.setenv("HF_TOKEN", SECRET)
    with FakeOpenAIServer(reply=lambda body: served[body["messages"][-1]["content"]]) as server:
        assert export.main(check_argv(tiny_llama, trained, "--url", server.url, "--api-key-env",
                                      "HF_TOKEN", "--min-agreement", "0.6")) == 0
        out = capsys.readouterr()
        assert "2 of 3 prompts get the adapter's greedy reply from tiny-grpo (67%" in out.out
        assert "prompt 2: they part at token 0" in out.out
        assert SECRET not in out.out + out.err
        request = server.requests[0]
        assert request.headers["authorization"] == f"Bearer {SECRET}"
        assert (request.body["model"], request.body["temperature"],
                request.body["max_tokens"]) == ("tiny-grpo", 0.0, 8)
        assert {r.messages[-1]["content"] for r in server.requests} == set(replies)
        # all three wanted; and without --api-key-env no key is sent
        assert export.main(check_argv(tiny_llama, trained, "--url", server.url,
                                      "--min-agreement", "1")) == 1
        assert server.requests[-1].headers["authorization"] == "Bearer EMPTY"
    with FakeOpenAIServer(reply=lambda body: replies[body["messages"][-1]["content"]]) as server:
        assert export.main(check_argv(tiny_llama, trained, "--url", server.url,
                                      "--min-agreement", "1")) == 0
    assert "3 of 3 prompts" in capsys.readouterr().out


@pytest.mark.parametrize("extra, says", [
    (["--url", "127.0.0.1:8000/v1"], "is not an http(s) URL"),
    (["--url", "http://127.0.0.1:9/v1", "--eval.select=null"], "eval.select is not set"),
    (["--url", "http://127.0.0.1:9/v1", "--limit", "0"], "need --limit >= 1"),
    (["--url", "http://127.0.0.1:9/v1", "--adapter", "nowhere"], "--adapter nowhere: no such run"),
])
def test_check_with_bad_input_is_one_line_and_exit_2(trained, tiny_llama, capsys, extra,
                                                     says):
    assert export.main(check_argv(tiny_llama, trained, *extra)) == 2
    assert says in error_line(capsys.readouterr().err)


def test_check_against_a_server_that_refuses_every_request_is_one_line_and_exit_2(
        trained, tiny_llama, capsys):
    with FakeOpenAIServer(default=server_error(404)) as server:
        assert export.main(check_argv(tiny_llama, trained, "--url", server.url)) == 2
    assert "404" in error_line(capsys.readouterr().err)


def test_the_served_length_is_the_seeds_8192_within_the_models_positions_or_the_flags():
    """The seed served its question generator with --max_model_len 8192; --create-endpoint served
    the run's 768 tokens (its prompt + reply) with no flag to change it (issue 46)."""
    cfg = load_config("configs/qgen.yaml")
    assert export.run_length(cfg) < 1024
    assert export.max_model_len(cfg, positions=262144) == 8192  # Qwen3-4B-Instruct-2507's
    assert export.max_model_len(cfg, positions=4096) == 4096  # a model of shorter reach
    assert export.max_model_len(cfg, asked=16384, positions=262144) == 16384
    assert "--max-model-len 8192 " in export.serve_command("exported/qgen", cfg, 8192)
    export.check_serve_len(16384, cfg, 262144)  # within both bounds: no error
