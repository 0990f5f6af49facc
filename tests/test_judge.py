"""Tests for client.py and judge.py against the local fake server (tests/fake_openai_server.py); no
real network."""

import asyncio
import json
import logging
import math
import re
import time
from pathlib import Path

import pytest
import yaml

from api.client import Judge, JudgeConfig, cache_key
from config import Config, JudgeUnusable, RewardSpec, from_dict
from fake_openai_server import (
    Behaviour,
    FakeOpenAIServer,
    malformed,
    ok,
    out_of_range,
    rate_limited,
    server_error,
    stall,
)
from judge import (
    POINTWISE_CRITERIA,
    JudgeScore,
    judge_reward,
    load_template,
    parse_score,
    render,
    rubric_alignment,
)
from rewards import _LOGGED, compute_rewards

SECRET = "sk-test-SECRET123"
# not OPENAI_API_KEY, so a developer's real key is never picked up
KEY_ENV = "MINIGRPO_TEST_JUDGE_KEY"


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)


@pytest.fixture
def server():
    with FakeOpenAIServer(reply=lambda body: '{"score": 7}') as s:
        yield s


def make_judge(server, **overrides) -> Judge:
    # Tiny backoff so retry tests run in milliseconds.
    cfg = dict(base_url=server.url, model="judge-model", api_key_env=KEY_ENV, backoff_s=0.01,
               backoff_max_s=0.5, timeout_s=5.0, max_retries=2)
    return Judge(JudgeConfig(**{**cfg, **overrides}))


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --- retries, timeouts, failures ------------------------------------------------------------------
def test_429_with_retry_after_is_retried_after_waiting_that_long(server):
    judge = make_judge(server, backoff_s=0.001)
    server.script(rate_limited(retry_after="0.4"))
    t0 = time.monotonic()
    assert judge.complete_many([chat("q")]) == ['{"score": 7}']
    assert time.monotonic() - t0 >= 0.4  # our own backoff would have been ~1 ms
    assert [r.status for r in server.requests] == [429, 200]
    stats = judge.pop_step_stats()
    assert (stats["judge_sent"], stats["judge_retries"], stats["judge_failures"]) == (2, 1, 0)
    assert stats["judge_requests"] == 1  # one call, answered by a request of its own


def test_retry_after_is_capped_by_retry_after_max(server):
    judge = make_judge(server, retry_after_max_s=0.05)
    server.script(rate_limited(retry_after="30"))
    t0 = time.monotonic()
    assert judge.complete_many([chat("q")]) == ['{"score": 7}']
    assert time.monotonic() - t0 < 3


def test_500_is_retried_then_succeeds(server):
    judge = make_judge(server)
    server.script(server_error(500), server_error(502))
    assert judge.complete_many([chat("q")]) == ['{"score": 7}']
    assert [r.status for r in server.requests] == [500, 502, 200]
    assert judge.pop_step_stats()["judge_retries"] == 2


def test_final_failure_yields_none_and_counts_without_raising(server):
    judge = make_judge(server, max_retries=2)
    server.default = server_error(503)
    assert judge.complete_many([chat("a"), chat("b")]) == [None, None]
    assert len(server.requests) == 6  # 2 calls x (1 try + 2 retries)
    stats = judge.pop_step_stats()
    assert (stats["judge_failures"], stats["judge_retries"], stats["judge_sent"]) == (2, 4, 6)
    assert stats["judge_requests"] == 0  # no call got a reply


@pytest.mark.parametrize("status", [400, 401, 404])
def test_client_errors_other_than_429_are_not_retried(server, status, caplog):
    """400 is one request's problem (a content filter): a failure. 401/403/404 are the key, the
    model or the URL, which no later call fixes either: JudgeUnusable, so that a run stops."""
    judge = make_judge(server)
    server.default = server_error(status)
    if status == 400:
        assert judge.complete_many([chat("a"), chat("b")]) == [None, None]
    else:
        with pytest.raises(JudgeUnusable, match=f"HTTP {status}.*check judge's base_url, model and "
                                                f"the key in \\${KEY_ENV}"):
            judge.complete_many([chat("a"), chat("b")])
    assert len(server.requests) == 2
    assert judge.pop_step_stats()["judge_failures"] == 2
    # one line, not one per call
    assert len([r for r in caplog.records if f"HTTP {status}" in r.getMessage()]) == 1


def test_once_the_key_is_refused_no_further_request_is_sent(server):
    judge = make_judge(server, max_concurrent=1)
    server.default = server_error(401)
    with pytest.raises(JudgeUnusable):
        judge.complete_many([chat(f"p{i}") for i in range(10)])
    assert len(server.requests) == 1 and judge.pop_step_stats()["judge_failures"] == 10


def test_endpoint_and_model_may_come_from_the_environment(server, monkeypatch):
    """GRubrics read AZURE_OPENAI_ENDPOINT and JUDGE_MODEL from the environment: ${NAME} in
    base_url, azure_endpoint or model is filled in when the client is built; the config keeps the
    reference."""
    monkeypatch.setenv("MINIGRPO_TEST_URL", server.url)
    monkeypatch.setenv("MINIGRPO_TEST_MODEL", "judge-from-env")
    cfg = JudgeConfig(base_url="${MINIGRPO_TEST_URL}", model="${MINIGRPO_TEST_MODEL}",
                      api_key_env=KEY_ENV, max_retries=0)
    judge = Judge(cfg)
    server.default = ok(text='{"score": 7}')
    assert judge.complete_many([chat("a")]) == ['{"score": 7}']
    assert server.requests[-1].body["model"] == "judge-from-env" \
        and cfg.model == "${MINIGRPO_TEST_MODEL}"
    monkeypatch.delenv("MINIGRPO_TEST_MODEL")
    with pytest.raises(ValueError,
                       match=r"model reads \$\{MINIGRPO_TEST_MODEL\}, which is not set"):
        Judge(cfg)


@pytest.mark.parametrize("field", ["base_url", "azure_endpoint", "model", "header"])
def test_each_env_form_means_what_it_means_in_every_other_field(server, monkeypatch, field,
                                                                tmp_path):
    """${NAME} and ${NAME:-default} read the same in a judge's base_url, azure_endpoint, model and
    headers as in a reward's weight (settings.typed_config.expand_env): the default when the
    variable is unset or empty, its value when set; a bare ${NAME} unset is an error naming it.
    ${JUDGE_MODEL:-gpt-4o-mini} was sent as the literal model name, and in base_url failed as "not
    an http(s) URL" (issue 46)."""
    from config import load_config
    value = {"base_url": server.url, "azure_endpoint": server.url.removesuffix("/v1"),
             "model": "judge-from-env", "header": "Bearer t0k-from-env"}[field]
    default = {"base_url": "http://127.0.0.1:9/v1", "azure_endpoint": "http://127.0.0.1:9",
               "model": "gpt-4o-mini", "header": "Bearer none"}[field]
    var = "MINIGRPO_TEST_FORM"

    def built(text: str) -> Judge:
        where = {"header": {"extra_headers": {"Authorization": text}},
                 "azure_endpoint": {"azure_endpoint": text,
                                    "api_version": "${MINIGRPO_NO_V:-2024-06-01}"}}.get(field,
                                                                                  {field: text})
        return make_judge(server, **where)

    def resolved(judge: Judge) -> str:
        return judge.headers["Authorization"] if field == "header" else getattr(judge.cfg, field)

    monkeypatch.delenv(var, raising=False)
    assert resolved(built(f"${{{var}:-{default}}}")) == default
    monkeypatch.setenv(var, "")
    assert resolved(built(f"${{{var}:-{default}}}")) == default
    monkeypatch.setenv(var, value)
    judge = built(f"${{{var}:-{default}}}")
    assert resolved(judge) == value == resolved(built(f"${{{var}}}"))
    if field == "azure_endpoint":
        assert judge.cfg.api_version == "2024-06-01"
    # the same form in a reward's weight, read by the typed config
    monkeypatch.setenv(var, "0.5")
    (tmp_path / "c.yaml").write_text(f"rewards: [{{name: answer_match, weight: '${{{var}:-1}}'}}]")
    assert load_config(tmp_path / "c.yaml").rewards[0].weight == 0.5
    monkeypatch.delenv(var)
    with pytest.raises(ValueError, match=rf"^judge: [\w.]+ reads \$\{{{var}\}}, which is not set"):
        built(f"${{{var}}}")


def test_a_dry_run_resolves_every_reference_the_judge_will_use(tmp_path, tiny_llama, monkeypatch,
                                                               capsys):
    """--dry-run builds the judge as the run will: a ${JUDGE_MODEL:-...} model, base_url or header
    is resolved there, and one that cannot be is one line and exit 2 before any step (the model
    field used to pass the dry run and fail at the first judge call)."""
    import train
    monkeypatch.delenv("MINIGRPO_NO_JUDGE_MODEL", raising=False)
    path = tmp_path / "judged.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name": str(tiny_llama)}, "run": {"out_dir": str(tmp_path / "run")},
        "judge": {"base_url": "${MINIGRPO_NO_JUDGE_URL:-http://127.0.0.1:9/v1}",
                  "model": "${MINIGRPO_NO_JUDGE_MODEL:-gpt-4o-mini}", "api_key_env": KEY_ENV,
                  "extra_headers": {"X-Team": "${MINIGRPO_NO_TEAM:-ml}"}},
        "rewards": [{"name": "judge", "args": {"template": "pointwise_criteria"}}]}))
    assert train.main(["--config", str(path), "--dry-run", "--run.threads=1"]) == 0
    assert "judges: judge" in capsys.readouterr().out
    for override, name in [("--judge.model=${MINIGRPO_NO_JUDGE_MODEL}", "model"),
                           ("--judge.extra_headers={X-Team: '${MINIGRPO_NO_TEAM}'}",
                            "extra_headers.X-Team")]:
        assert train.main(["--config", str(path), "--dry-run", "--run.threads=1", override]) == 2
        err = capsys.readouterr().err.strip()
        assert f"judge: {name} reads $" in err and len(err.splitlines()) == 1, err


def test_header_secrets_come_from_the_environment_and_are_masked_wherever_they_would_show(
        server, monkeypatch, caplog):
    from config import redacted
    monkeypatch.setenv("MINIGRPO_TEST_HEADER_TOKEN", "hdr-SECRET-456789")
    judge = make_judge(server,
                       extra_headers={"Authorization": "Bearer ${MINIGRPO_TEST_HEADER_TOKEN}",
                                      "X-Team": "ml"})
    server.default = ok(text='{"score": 7}')
    judge.complete_many([chat("a")])
    assert server.requests[0].headers["authorization"] == "Bearer hdr-SECRET-456789"
    assert server.requests[0].headers["x-team"] == "ml"
    # the fake echoes the presented Authorization value in its error
    server.default = server_error(401)
    with pytest.raises(JudgeUnusable) as err:
        judge.complete_many([chat("b")])
    assert "Incorrect API key provided: ***" in str(err.value)
    assert "hdr-SECRET-456789" not in str(err.value) + caplog.text
    # a saved config keeps the reference (no secret) and masks a literal value; '***' is refused
    # when a client is built
    saved = redacted(
        {"judge": {"extra_headers": {"Authorization": "Bearer ${MINIGRPO_TEST_HEADER_TOKEN}",
                                     "K": "lit"}}})
    assert saved["judge"]["extra_headers"] == \
        {"Authorization": "Bearer ${MINIGRPO_TEST_HEADER_TOKEN}", "K": "***"}
    with pytest.raises(ValueError, match="masked when a run saved its config"):
        make_judge(server, extra_headers={"K": "***"})
    with pytest.raises(ValueError, match=r"reads \$\{MINIGRPO_NO_SUCH_VAR\}, which is not set"):
        make_judge(server, extra_headers={"K": "${MINIGRPO_NO_SUCH_VAR}"})
    with pytest.raises(ValueError, match="the NAME of the environment variable"):
        make_judge(server, api_key_env="sk-proj-LITERALKEY999")


def test_stall_beyond_timeout_is_a_failure_after_retries_and_does_not_hang(server):
    judge = make_judge(server, timeout_s=0.3, max_retries=1)
    server.default = stall(20)
    t0 = time.monotonic()
    assert judge.complete_many([chat("q")]) == [None]
    assert time.monotonic() - t0 < 3
    assert len(server.requests) == 2
    stats = judge.pop_step_stats()
    assert (stats["judge_failures"], stats["judge_retries"]) == (1, 1)


def test_stall_then_success_on_retry(server):
    judge = make_judge(server, timeout_s=0.3)
    server.script(stall(20))
    assert judge.complete_many([chat("q")]) == ['{"score": 7}']


# --- concurrency and rate ------------------------------------------------------------------------
def test_max_concurrent_is_never_exceeded_and_is_reached(server):
    judge = make_judge(server, max_concurrent=4)
    server.default = ok(delay_s=0.15)
    replies = judge.complete_many([chat(f"prompt {i}") for i in range(16)])
    assert replies == ['{"score": 7}'] * 16
    assert len(server.requests) == 16
    assert server.max_in_flight == 4


def test_complete_many_preserves_order_when_replies_arrive_out_of_order(server):
    def reply(body):
        i = int(body["messages"][0]["content"])
        time.sleep((8 - i) * 0.02)  # later prompts answer first
        return f"reply {i}"
    server.reply = reply
    judge = make_judge(server, memory_cache=False)
    for _ in range(3):  # repeated calls from sync code each get a fresh event loop
        server.reset()
        assert judge.complete_many([chat(str(i)) for i in range(8)]) == \
            [f"reply {i}" for i in range(8)]
        assert len(server.requests) == 8


def test_complete_many_works_inside_a_running_event_loop(server):
    judge = make_judge(server)

    async def notebook_cell():
        return judge.complete_many([chat("q")])
    assert asyncio.run(notebook_cell()) == ['{"score": 7}']


def test_complete_many_closes_its_http_client_with_the_loop_it_ran_in(server):
    judge = make_judge(server)
    assert judge.complete_many([chat("a"), chat("b")]) == ['{"score": 7}'] * 2
    # its connections belonged to asyncio.run's loop, which is gone: none is kept for the next call
    assert judge._client is None and judge._loop is None


def test_identical_prompts_in_flight_share_one_request(server):
    judge = make_judge(server)
    server.default = ok(delay_s=0.1)
    assert judge.complete_many([chat("same")] * 5) == ['{"score": 7}'] * 5
    assert len(server.requests) == 1
    stats = judge.pop_step_stats()
    assert (stats["judge_calls"], stats["judge_requests"], stats["judge_cache_hits"]) == (5, 1, 4)


def test_n_samples_of_one_request_are_distinct_requests_each_cached_under_its_own_index(
        server, tmp_path):
    count = iter(range(100))
    server.reply = lambda body: f"answer {next(count)}"
    path = tmp_path / "answers.jsonl"
    first = make_judge(server, cache_path=str(path), temperature=1.0)
    # request-major: q1's three, then q2's
    replies = first.complete_many([chat("q1"), chat("q2")], n=3)
    assert len(set(replies)) == 6 and len(server.requests) == 6
    server.reset()
    restarted = make_judge(server, cache_path=str(path), temperature=1.0, memory_cache=False)
    assert restarted.cached([chat("q1"), chat("q2")], n=4) == 6  # what a rerun would get for free
    again = restarted.complete_many([chat("q1"), chat("q2")], n=4)
    assert again[:3] == replies[:3] and again[4:7] == replies[3:]
    assert len(server.requests) == 2  # the fourth sample of each: all others came from the cache
    key = cache_key("m", chat("q"), 1.0, 512)  # sample 0 keeps the key caches were written with
    assert cache_key("m", chat("q"), 1.0, 512, sample=0) == key != \
        cache_key("m", chat("q"), 1.0, 512, sample=1)


def test_an_interrupted_batch_cancels_its_requests_and_keeps_what_arrived(server, tmp_path, caplog):
    """Ctrl-C during complete_many: the requests still out are cancelled before the loop closes
    (no 'unhandled exception during shutdown'), and replies that arrived are in the cache."""
    path = tmp_path / "c.jsonl"
    judge = make_judge(server, cache_path=str(path), max_concurrent=1)
    server.script(ok())  # the first answers at once, the rest stall
    server.default = stall(5)

    async def main():
        task = asyncio.ensure_future(judge._gather([chat(f"p{i}") for i in range(4)], None))
        for _ in range(200):
            # until the first reply is cached (a cold `import openai` takes a while)
            await asyncio.sleep(0.05)
            if path.exists() and path.read_text().count("\n") == 1:
                break
        await asyncio.sleep(0.1)  # the second request is out, stalled
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())
    assert not judge._requests and len(path.read_text().splitlines()) == 1
    assert "unhandled" not in caplog.text


def test_a_data_file_given_as_the_cache_is_refused_not_appended_to(server, tmp_path):
    answers = tmp_path / "grubrics_open.jsonl"  # paid answers, say
    answers.write_text(json.dumps({"question": "q", "answers": ["a", "b"], "gold_scores": [1, 0]})
                       + "\n")
    before = answers.read_bytes()
    with pytest.raises(ValueError, match="holds lines but no cache records"):
        make_judge(server, cache_path=str(answers))
    assert answers.read_bytes() == before
    # a pretty-printed JSON array, or a CSV: no line is a cache record either
    pretty = tmp_path / "rows.json"
    pretty.write_text(json.dumps([{"question": "q"}], indent=1) + "\n")
    with pytest.raises(ValueError, match="holds lines but no cache records"):
        make_judge(server, cache_path=str(pretty))
    torn = tmp_path / "torn.jsonl"  # a cache whose only line was cut by a kill is still a cache
    torn.write_text('{"key": "k", "rep')
    make_judge(server, cache_path=str(torn))


def test_requests_per_minute_spaces_request_starts(server):
    judge = make_judge(server, requests_per_minute=600)  # one every 0.1 s
    t0 = time.monotonic()
    judge.complete_many([chat(f"p{i}") for i in range(5)])
    assert time.monotonic() - t0 >= 0.4


def test_requests_per_minute_holds_when_a_busy_connection_frees():
    """Two slow requests hold both connections past the time the next ones' turns come: those must
    still start a turn apart, not all at once when the connections free."""
    starts = []
    with FakeOpenAIServer(reply=lambda body: starts.append(time.monotonic()) or "x") as s:
        s.script(ok("slow", delay_s=1.0), ok("slow", delay_s=0.9))
        make_judge(s, max_concurrent=2, requests_per_minute=600,
                   max_retries=0).complete_many([chat(f"q{i}") for i in range(6)])
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) == 4 and min(gaps) >= 0.08, gaps


@pytest.mark.parametrize("bad", [{"timeout_s": 0}, {"timeout_s": -1}, {"requests_per_minute": -5}])
def test_a_timeout_or_rate_that_could_never_send_is_refused(server, bad):
    with pytest.raises(ValueError, match="need timeout_s > 0"):
        make_judge(server, **bad)
    # 0: no limit
    assert make_judge(server, requests_per_minute=0).complete_many([chat("a")]) == ['{"score": 7}']


def test_a_key_with_a_trailing_newline_is_sent_without_it(server, monkeypatch):
    """A key read from a secret file often ends in a newline; sent with it, no request leaves the
    client."""
    monkeypatch.setenv(KEY_ENV, SECRET + "\n")
    assert make_judge(server).complete_many([chat("a")]) == ['{"score": 7}']
    assert server.requests[0].headers["authorization"] == f"Bearer {SECRET}"


def test_out_of_credit_stops_the_run_instead_of_being_retried(server):
    """OpenAI's 429 insufficient_quota is a bill to pay, not a rate to wait out: no retry,
    JudgeUnusable."""
    server.default = Behaviour(status=429, code="insufficient_quota")
    with pytest.raises(JudgeUnusable, match="HTTP 429"):
        make_judge(server, max_retries=3).complete_many([chat("a")])
    assert len(server.requests) == 1
    server.default = rate_limited("0")  # a plain 429 is still retried
    assert make_judge(server, max_retries=1).complete_many([chat("b")]) == [None] \
        and len(server.requests) == 3


def test_what_real_providers_send_besides_a_reply(server, caplog):
    """A body that is not JSON is retried; retry-after-ms is honoured; OpenRouter's 402 (no credit)
    stops the run while its 403 for one flagged input is that request's failure; a 400 for a
    parameter a reasoning model rejects stops it with the settings to change."""
    judge = make_judge(server, max_retries=1)
    server.script(Behaviour(raw='{"id": "cut'))  # content-type JSON, body cut (a proxy)
    assert judge.complete_many([chat("a")]) == ['{"score": 7}'] and len(server.requests) == 2
    server.script(Behaviour(status=429, headers={"retry-after-ms": "400", "Retry-After": "0"}))
    t0 = time.monotonic()
    assert make_judge(server, backoff_s=0.001).complete_many([chat("b")]) == ['{"score": 7}']
    assert time.monotonic() - t0 >= 0.4
    server.script(Behaviour(status=403, message="Input was flagged by moderation: violence"))
    judge = make_judge(server, max_concurrent=1)
    assert judge.complete_many([chat("c"), chat("d")]) == [None, '{"score": 7}']
    server.default = Behaviour(status=402, message="Insufficient credits")
    with pytest.raises(JudgeUnusable, match="HTTP 402"):
        make_judge(server).complete_many([chat("e")])
    server.default = Behaviour(status=400, code="unsupported_parameter",
                               message="Unsupported parameter: 'max_tokens' is not supported with "
                                       "this model.")
    with pytest.raises(JudgeUnusable, match="judge.token_param: max_completion_tokens and "
                                            "judge.temperature: null"):
        make_judge(server).complete_many([chat("f")])


def test_a_reply_cut_before_any_answer_is_a_failure_never_cached(server, tmp_path, caplog):
    """A reasoning model that spends max_tokens thinking: GPT-5 sends "" with finish_reason length,
    vLLM's reasoning parser null; neither is an answer, and neither may come back from the cache."""
    cache = tmp_path / "cache.jsonl"
    judge = make_judge(server, cache_path=str(cache), max_tokens=64)
    server.script(Behaviour(text="", finish_reason="length"),
                  Behaviour(null_content=True, finish_reason="length"))
    with caplog.at_level(logging.WARNING):
        assert judge.complete_many([chat("a"), chat("b")]) == [None, None]
    assert "cut at max_tokens=64 before any answer" in caplog.text \
        and "raise judge.max_tokens" in caplog.text
    assert not cache.exists() and judge.complete_many([chat("a")]) == ['{"score": 7}']


def test_a_judge_that_never_answers_stops_the_run(server):
    """FAILED_LIMIT requests failed after their retries, none answered (a 400 for every request, a
    server that is down): JudgeUnusable instead of a run trained on fallbacks. Once one has
    answered, failures are only counted."""
    from api.client import FAILED_LIMIT
    server.default = server_error(400)
    judge = make_judge(server)
    assert judge.complete_many([chat(f"a{i}") for i in range(FAILED_LIMIT - 1)]) == \
        [None] * (FAILED_LIMIT - 1)
    with pytest.raises(JudgeUnusable, match=f"none of its first {FAILED_LIMIT} requests .* got a "
                                            "reply .*HTTP 400"):
        judge.complete_many([chat("last")])
    server.reset()
    with pytest.raises(JudgeUnusable):
        # stopped: nothing more is sent (eval.py's next model scored by it)
        judge.complete_many([chat("again")])
    assert server.requests == []
    judge = make_judge(server)
    server.script(ok())
    judge.complete_many([chat("first")])
    assert judge.complete_many([chat(f"b{i}") for i in range(FAILED_LIMIT + 2)]) == \
        [None] * (FAILED_LIMIT + 2)


def test_a_key_pasted_as_api_key_env_is_refused_without_echoing_it(server):
    for key in ("gsk_4fT9aQ2xLmN8pR3s", "a8Fk2LmQ9zP4rT7vW1xY3bN6"):
        with pytest.raises(ValueError, match="NAME of the environment variable") as err:
            make_judge(server, api_key_env=key)
        assert key not in str(err.value)
    for name in ("OPENAI_API_KEY_gpt4o", "AZURE_OPENAI_KEY_eastus2", "hf_token", "sk_key"):
        # names people do use
        assert make_judge(server, api_key_env=name).cfg.api_key_env == name


def test_a_proxy_s_html_page_is_retried_and_a_request_that_cannot_be_built_is_not(
        server, monkeypatch):
    server.script(Behaviour(raw="<html>502 Bad Gateway</html>",
                            headers={"Content-Type": "text/html"}))
    judge = make_judge(server, max_retries=1)
    assert judge.complete_many([chat("a")]) == ['{"score": 7}'] and len(server.requests) == 2
    # a key the HTTP header cannot carry: our error, not the server's, said when the client is
    # built (issue 47), without the key
    monkeypatch.setenv(KEY_ENV, "sk-caf\u00e9")
    with pytest.raises(ValueError, match="cannot build a request to .* a character HTTP cannot "
                       f"carry.* the key in \\${KEY_ENV}$") as err:
        make_judge(server)
    assert "caf" not in str(err.value) and len(server.requests) == 2


def test_provider_cached_prompt_tokens_are_priced_at_their_own_rate(server):
    server.default = Behaviour(text='{"score": 7}',
                               usage={"prompt_tokens": 1000, "completion_tokens": 10,
                                      "prompt_tokens_details": {"cached_tokens": 900}})
    judge = make_judge(server, price_prompt_per_m=1.0, price_cached_prompt_per_m=0.1,
                       price_completion_per_m=4.0)
    judge.complete_many([chat("a")])
    assert judge.pop_step_stats()["judge_cost_usd"] == \
        pytest.approx((100 * 1.0 + 900 * 0.1 + 10 * 4.0) / 1e6)
    # no cached price: the prompt price
    judge = make_judge(server, price_prompt_per_m=1.0, price_completion_per_m=4.0)
    judge.complete_many([chat("b")])
    assert judge.pop_step_stats()["judge_cost_usd"] == pytest.approx((1000 * 1.0 + 10 * 4.0) / 1e6)


def test_a_long_key_echoed_in_a_refusal_is_masked_whole(server, monkeypatch, caplog):
    """The refusal is cut to 300 characters after masking: cut first, a long key (a JWT, a gateway
    token) would no longer be found whole and its start would show."""
    secret = "sk-" + "LONGsecret" * 40
    monkeypatch.setenv(KEY_ENV, secret)
    server.default = server_error(401)
    with pytest.raises(JudgeUnusable) as err:
        make_judge(server).complete_many([chat("a")])
    assert secret[:12] not in str(err.value) + caplog.text and "***" in str(err.value)


# --- cache ---------------------------------------------------------------------------------------
def test_disk_cache_hit_after_restart_makes_no_request(server, tmp_path):
    path = tmp_path / "cache" / "judge.jsonl"
    prompts = [chat(f"p{i}") for i in range(3)]
    first = make_judge(server, cache_path=str(path))
    assert first.complete_many(prompts) == ['{"score": 7}'] * 3
    assert len(path.read_text().splitlines()) == 3

    server.reset()
    restarted = make_judge(server, cache_path=str(path), memory_cache=False)
    assert restarted.complete_many(prompts) == ['{"score": 7}'] * 3
    assert server.requests == []
    stats = restarted.pop_step_stats()
    assert (stats["judge_cache_hits"], stats["judge_requests"]) == (3, 0)


def test_cache_key_covers_model_and_sampling_settings(server, tmp_path):
    path = str(tmp_path / "c.jsonl")
    make_judge(server, cache_path=path).complete_many([chat("q")])
    make_judge(server, cache_path=path, temperature=0.7).complete_many([chat("q")])
    make_judge(server, cache_path=path, model="other").complete_many([chat("q")])
    assert len(server.requests) == 3


def test_reasoning_models_get_max_completion_tokens_no_temperature_and_extra_fields(
        server, tmp_path):
    """OpenAI's o-series and GPT-5 answer HTTP 400 to max_tokens or a non-default temperature."""
    make_judge(server).complete_many([chat("q")])
    assert server.requests[-1].body["max_tokens"] == 512 \
        and server.requests[-1].body["temperature"] == 0.0
    path = str(tmp_path / "c.jsonl")
    judge = make_judge(server, cache_path=path, temperature=None,
                       token_param="max_completion_tokens", extra_body={"reasoning_effort": "low"})
    judge.complete_many([chat("q")])
    body = server.requests[-1].body
    assert body["max_completion_tokens"] == 512 and "max_tokens" not in body \
        and "temperature" not in body
    assert body["reasoning_effort"] == "low"
    make_judge(server, cache_path=path, temperature=None,
               token_param="max_completion_tokens").complete_many([chat("q")])
    # another extra_body is another reply: not answered from the cache
    assert len(server.requests) == 3
    make_judge(server, cache_path=path, temperature=None, token_param="max_completion_tokens",
               extra_body={"reasoning_effort": "low"}).complete_many([chat("q")])
    assert len(server.requests) == 3


def test_torn_last_line_is_skipped_and_later_appends_stay_readable(server, tmp_path, caplog):
    path = tmp_path / "judge.jsonl"
    first = make_judge(server, cache_path=str(path))
    first.complete_many([chat("a"), chat("b")])
    with open(path, "ab") as f:  # a kill mid-write leaves half a record and no newline
        f.write(b'{"key": "abc", "reply": "half a rec')

    server.reset()
    second = make_judge(server, cache_path=str(path))
    assert len([r for r in caplog.records if "skipped 1 unreadable" in r.getMessage()]) == 1
    assert second.complete_many([chat("a"), chat("b"), chat("c")]) == ['{"score": 7}'] * 3
    assert len(server.requests) == 1  # only "c" was asked

    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""  # file ends with a newline
    readable = [json.loads(line) for line in lines
                if line.startswith(b'{"key": "') and line.endswith(b"}")]
    assert len(readable) == 3  # a, b, and c on its own line, not glued to the torn record

    server.reset()
    third = make_judge(server, cache_path=str(path), memory_cache=False)
    assert third.complete_many([chat("a"), chat("b"), chat("c")]) == ['{"score": 7}'] * 3
    assert server.requests == []


def test_memory_cache_is_a_bounded_lru_and_can_be_turned_off(server):
    off = make_judge(server, memory_cache=False)
    off.complete_many([chat("a")])
    off.complete_many([chat("a")])
    assert len(server.requests) == 2

    server.reset()
    lru = make_judge(server, memory_cache_size=2)
    for p in ["a", "b", "a", "c", "a", "b"]:  # "b" is the least recent when "c" arrives
        lru.complete_many([chat(p)])
    assert [r.prompt_text for r in server.requests] == ["a", "b", "c", "b"]


def test_a_malformed_reply_is_a_failure_and_is_cached_so_a_rerun_gets_its_fallback_for_free(
        server, tmp_path):
    """Issue 30: unusable replies were not cached, and a rerun paid for them again."""
    path = tmp_path / "c.jsonl"
    judge = make_judge(server, cache_path=str(path))
    server.script(malformed())
    assert judge.score_many([chat("q")], parse_score) == [None]
    assert len(server.requests) == 1  # not retried: same prompt at temperature 0
    assert judge.pop_step_stats()["judge_failures"] == 1
    rerun = make_judge(server, cache_path=str(path))  # a new process over the same cache
    assert rerun.score_many([chat("q")], parse_score) == [None]  # the same fallback, not paid again
    stats = rerun.pop_step_stats()
    assert len(server.requests) == 1 and (stats["judge_sent"], stats["judge_failures"]) == (0, 1)
    def fixed(reply, lo, hi):  # a parser that reads it now
        return JudgeScore(0.0, {}) if "not sure" in reply else None
    # the cached reply, parsed anew
    assert rerun.score_many([chat("q")], fixed) == [JudgeScore(0.0, {})]
    assert len(server.requests) == 1


def test_every_call_lands_in_exactly_one_of_requests_cache_hits_and_failures(server, tmp_path):
    """Issue 30: calls sharing a request that failed were in neither requests nor cache hits."""
    judge = make_judge(server, max_retries=1, cache_path=str(tmp_path / "c.jsonl"))
    server.script(server_error(503), server_error(503))
    # one request, failed twice
    assert judge.score_many([chat("a"), chat("a"), chat("a")], parse_score) == [None] * 3
    server.script(malformed())
    replies = judge.score_many([chat("b")], parse_score) \
        + judge.score_many([chat("c"), chat("c")], parse_score)
    judge.score_many([chat("c"), chat("b")], parse_score)  # from the cache: one usable, one not
    stats = judge.pop_step_stats()
    assert replies[0] is None and replies[1] == replies[2] == JudgeScore(7.0, {})
    calls, requests, hits, failures = (stats[f"judge_{k}"]
                                       for k in ("calls", "requests", "cache_hits", "failures"))
    assert calls == requests + hits + failures == 8
    assert (requests, hits, failures) == (1, 2, 5)  # c; c's twin and c cached; a x3, b, b cached
    assert stats["judge_sent"] == len(server.requests) == 4  # a twice, b, c


def test_a_judge_whose_first_replies_never_score_stops_and_a_later_bad_reply_does_not(
        server, monkeypatch):
    """16 unusable replies before any usable one: a wrong template or score range, not noise."""
    from api import client
    monkeypatch.setattr(client, "UNPARSED_LIMIT", 4)
    judge = make_judge(server)
    server.default = ok(text="A thoughtful answer, well argued.")
    # 3 < 4: the fallback
    assert judge.score_many([chat("a"), chat("b"), chat("c")], parse_score) == [None] * 3
    with pytest.raises(JudgeUnusable, match=r"none of its first 4 replies held a usable score "
                                            r"\(want a number in \[0, 10\]; "
                                            r"the first was 'A thoughtful answer, well argued.'\); "
                                            r"fix its template"):
        judge.score_many([chat("d")], parse_score)
    from judge import parse_met
    # a criterion_met reply on the judge's 0-10 scale: what it wants, said
    server.default = ok(text='{"met": 5}')
    with pytest.raises(JudgeUnusable, match=r'want \{"met": 1\} or \{"met": 0\}'):
        make_judge(server).score_many([chat(x) for x in "hijk"], parse_met)
    scored = make_judge(server)
    server.default = ok(text='{"score": 7}')
    assert scored.score_many([chat("e")], parse_score) == [JudgeScore(7.0, {})]
    server.default = ok(text="no score here")
    for i in range(3):  # once a reply has scored, unusable ones are counted, never fatal
        assert scored.score_many([chat(f"f{i}"), chat(f"g{i}")], parse_score) == [None, None]
    assert scored.pop_step_stats()["judge_failures"] == 6


def test_out_of_range_score_is_rejected(server):
    judge = make_judge(server)
    server.script(out_of_range(42))
    assert judge.score_many([chat("q"), chat("r")], parse_score) in ([None, JudgeScore(7.0, {})],
                                                                     [JudgeScore(7.0, {}), None])
    assert judge.pop_step_stats()["judge_failures"] == 1


# --- parsing --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ('{"score": 7}', 7.0),
    ('{"score": 7.5, "reason": "ok"}', 7.5),
    ('Here is my verdict: {"score": 3} hope that helps', 3.0),
    ('```json\n{"score": 9}\n```', 9.0),
    ('```\n{"Score": 2}\n```', 2.0),
    ('Score: 7/10', 7.0),
    ('**Score**: 6', 6.0),
    ('The answer is decent. 8/10', 8.0),
    ('5', 5.0),
    ('<think>maybe 2, maybe 9</think>\n{"score": 4}', 4.0),
    ('I give it 11 points, score: 3', 3.0),
    ('A final score of 6.5.', 6.5),
    ('{"score": "7"}', 7.0),  # small judges quote it
    ('**8**', 8.0), ('8 out of 10', 8.0),
    ('Score (0-10): 7', 7.0), ('Score (1–10): 7', 7.0),  # the range is not the score
    # a template opened <think>: only the close comes back
    ('a score of 3 seems harsh</think>\n\nScore: 8', 8.0),
    ('Initially a score of 5; on reflection, final score: 7', 7.0),  # the last one is the verdict
    # an object quoted in prose is not a verdict
    ('The code returns {"a": 1, "b": 3}. Score: 9', 9.0),
    # a labelled score beats a hypothetical one
    ('Score: 7\nTo reach a score of 9 it would need citations.', 7.0),
    # a bullet on the next line is not a range "8 - 2"
    ('Score: 8\n- 2 citations are missing', 8.0),
    ('3 out of 5 claims are supported. Overall: 8/10', 8.0),
    ('Here is my evaluation:\n{"accuracy": 8, "clarity": 6}', 7.0),
    ('{"accuracy": 8, "clarity": 6}\nThat is all.', 7.0),
])
def test_parse_score_accepts(text, expected):
    assert parse_score(text, 0, 10).score == expected


@pytest.mark.parametrize("text", [
    '{"score": true}', '{"score": false}', '{"score": "7 points"}', '{"score": NaN}',
    '{"score": Infinity}',
    '{"score": 11}', '{"score": -1}', 'Score: 12/10', 'no number here', '', '{"score": null}',
    '{"reason": "fine"}',  # JSON with no score and no numbers
    '{"reason": "scored 7"}',  # a JSON verdict never falls back to numbers inside it
    'On a score of 1-10, I give it 8',  # a range only: a failure, not 1 or 10
    '<think>Score: 9, I think', '…</think>',  # thinking cut short: no verdict
])
def test_parse_score_rejects(text):
    assert parse_score(text, 0, 10) is None


def test_parse_score_per_criteria():
    names = ["relevance", "clarity", "discriminative_power"]
    s = parse_score('{"relevance": 6, "clarity": 8, "discriminative_power": 10, "notes": "x"}',
                    0, 10, names)
    assert s == JudgeScore(8.0, {"relevance": 6.0, "clarity": 8.0, "discriminative_power": 10.0})
    assert parse_score('{"relevance": 6, "clarity": 8}', 0, 10, names) is None  # one missing
    assert parse_score('{"relevance": 6, "clarity": true, "discriminative_power": 1}', 0, 10,
                       names) is None
    assert parse_score('{"relevance": 6, "clarity": 8, "discriminative_power": 11}', 0, 10,
                       names) is None
    # needs JSON
    assert parse_score('relevance 6, clarity 8, discriminative_power 10', 0, 10, names) is None
    assert parse_score('{"score": 9, "logic": 8, "novelty": 2}', 0, 10,
                       ["logic", "novelty"]).score == 9.0
    assert parse_score('{"logic": 8, "novelty": 2}', 0, 10) == \
        JudgeScore(5.0, {"logic": 8.0, "novelty": 2.0})
    # unnamed: bools skipped
    assert parse_score('{"a": 5, "ok": true}', 0, 10) == JudgeScore(5.0, {"a": 5.0})


# --- templates -----------------------------------------------------------------------------------
def test_render_fills_known_names_once_and_leaves_other_braces(tmp_path):
    out = render("Q: {prompt}\nA: {completion}\nReply {\"score\": n}",
                 {"prompt": "f({x}) {completion}", "completion": '{"k": 1}'})
    assert out == 'Q: f({x}) {completion}\nA: {"k": 1}\nReply {"score": n}'
    with pytest.raises(KeyError, match="prompt"):
        render("{prompt} {completion}", {"completion": "c"})


def test_load_template_accepts_name_path_or_text(tmp_path):
    assert load_template("pointwise_criteria") == POINTWISE_CRITERIA
    f = tmp_path / "t.txt"
    f.write_text("Rate {completion}")
    assert load_template(str(f)) == "Rate {completion}"
    assert load_template("Rate this: {completion}") == "Rate this: {completion}"
    with pytest.raises(ValueError, match="pointwise_critera"):
        load_template("pointwise_critera")  # a typo must not become the prompt


# --- rewards --------------------------------------------------------------------------------------
def rubric_reply(body):
    """Score answer k by the rubric's marker: GOOD -> k, REVERSED -> 9 - k, FLAT -> 5, PARTIAL swaps
    0 and 1."""
    text = body["messages"][-1]["content"]
    rubric = re.search(r"RUBRIC-(\w+)", text).group(1)
    k = int(re.search(r"ANSWER-(\d)", text).group(1))
    if rubric == "BROKEN" and k == 2:
        return "I cannot grade this."
    score = {"GOOD": k, "REVERSED": 9 - k, "FLAT": 5, "PARTIAL": [1, 0, 2, 3][k],
             "BROKEN": k}[rubric]
    return json.dumps({"score": score})


def test_rubric_alignment_is_spearman_of_judge_scores_against_gold(server):
    server.reply = rubric_reply
    server.default = ok(delay_s=0.2)
    judge = make_judge(server, max_concurrent=64)
    sample = {"question": "Is aspirin safe?", "answers": [f"ANSWER-{k}" for k in range(4)],
              "gold_scores": [1, 2, 3, 4]}
    rubrics = ["RUBRIC-GOOD", "RUBRIC-REVERSED", "RUBRIC-FLAT", "RUBRIC-PARTIAL", "RUBRIC-BROKEN"]
    rewards = rubric_alignment(rubrics, [sample] * 5, judge=judge)
    # PARTIAL: ranks (2,1,3,4) vs (1,2,3,4): d^2 sum = 2, rho = 1 - 6*2 / (4*(16-1)) = 0.8
    assert rewards[:4] == pytest.approx([1.0, -1.0, 0.0, 0.8])
    assert math.isnan(rewards[4])
    assert len(server.requests) == 20
    assert server.max_in_flight > 4  # answers of different rubrics were judged at the same time
    stats = judge.pop_step_stats()
    assert (stats["judge_constant_scores"], stats["judge_failures"]) == (1, 1)
    assert "Is aspirin safe?" in server.requests[0].prompt_text


def test_rubric_alignment_constant_gold_gives_zero(server):
    server.reply = rubric_reply
    judge = make_judge(server)
    sample = {"question": "q", "answers": ["ANSWER-0", "ANSWER-1"], "gold_scores": [3, 3]}
    assert rubric_alignment(["RUBRIC-GOOD"], [sample], judge=judge) == [0.0]
    assert judge.pop_step_stats()["judge_constant_scores"] == 1


@pytest.mark.parametrize("row, says", [
    ({"answers": ["a", "b"], "gold_scores": [1, None]},
     "2 numbers, one per answer (no null or NaN)"),
    ({"answers": ["a", "b"], "gold_scores": [1, float("nan")]}, "no null or NaN"),
    ({"answers": ["a", "b", "c"], "gold_scores": [1, 2]}, "must be 3 numbers"),
    ({"answers": ["a"], "gold_scores": [1]}, ">= 2 answers"),
    ({"answers": '["a", "b"]', "gold_scores": [1, 2]}, "a CSV cell holds text"),
    ({"answers": ["a", "b"], "gold_scores": "[1, 2]"}, "a CSV cell holds text"),
    ({"answers": [1, 2], "gold_scores": [1, 2]}, ">= 2 answers (text)"),
])
def test_a_row_rubric_alignment_cannot_score_stops_the_run_before_any_judge_call(row, says):
    """helper-49: one such row failed its whole batch, after the batch's judge calls were paid."""
    from config import ConfigError
    from scoring.checks import check_rows
    good = {"question": "q", "answers": ["a", "b"], "gold_scores": [1, 2]}
    check_rows([RewardSpec("rubric_alignment")], [good])
    with pytest.raises(ConfigError, match="reward 'rubric_alignment': data row 1 \\(id 'hb-7'\\): "
                                          f".*{re.escape(says)}"):
        check_rows([RewardSpec("rubric_alignment")], [good, {"question": "q", "id": "hb-7", **row}])


def test_gold_scores_rubric_alignment_reads_as_numbers_pass_the_row_check():
    """numpy ints from a data.map, Decimal from parquet, a tuple, 0/1 as booleans: float() reads
    them all."""
    from decimal import Decimal

    import numpy as np

    from scoring.checks import check_rows
    for gold in ([np.int64(1), np.int64(3)], [Decimal("0.5"), Decimal("1")], (1, 2), [True, False],
                 np.array([1.0, 2.0])):
        check_rows([RewardSpec("rubric_alignment")],
                   [{"question": "q", "answers": ["a", "b"], "gold_scores": gold}])


def test_judge_reward_normalizes_the_criteria_mean_to_unit_interval(server, caplog):
    server.reply = lambda body: '{"relevance": 6, "clarity": 8, "discriminative_power": 10}'
    judge = make_judge(server)
    samples = [{"prompt": "Backend role, {skills}: Go, Postgres"}] * 2
    rewards = judge_reward(["Explain MVCC.", "What is a goroutine?"], samples, judge=judge,
                           system="Be strict.")
    assert rewards == pytest.approx([0.8, 0.8])
    assert judge_reward(["Explain MVCC."], samples[:1], judge=judge, normalize=False) == \
        pytest.approx([8.0])
    # the two calls run concurrently, so find the request by its content, not its arrival order
    sent = next(r.messages for r in server.requests if "Explain MVCC." in r.messages[-1]["content"])
    assert sent[0] == {"role": "system", "content": "Be strict."}
    assert "Backend role, {skills}: Go, Postgres" in sent[1]["content"]

    server.reply = lambda body: '{"relevance": 6, "clarity": 8}'  # a criterion missing -> failure
    with caplog.at_level(logging.WARNING):
        assert [math.isnan(x) for x in judge_reward(["new"], samples[:1], judge=judge)] == [True]
    assert "want a number in [0, 10] for each of relevance, clarity, discriminative_power" \
        in caplog.text
    # through compute_rewards: the fallback, counted, and one line without a traceback (the judge
    # said why)
    caplog.clear()
    _LOGGED.discard("judge")  # each reward's first failure is logged once per process
    with caplog.at_level(logging.WARNING, logger="minigrpo.scoring"):
        res = compute_rewards(["newer"], samples[:1], [RewardSpec("judge", fallback=0.0)],
                              context={"judge": judge})
    assert res.total == [0.0] and res.errors == {"judge": 1}
    (rec,) = [r for r in caplog.records if r.name == "minigrpo.scoring"]
    assert "returned NaN" in rec.getMessage() and rec.exc_info is None


def test_judge_reward_with_custom_score_range(server):
    server.reply = lambda body: '{"logic": 4, "novelty": 2}'
    judge = make_judge(server, score_min=1, score_max=5)
    assert judge_reward(["r"], [{"prompt": "p"}], judge=judge, template="logic_novelty") == \
        pytest.approx([0.5])
    assert "from 1 to 5" in server.requests[0].prompt_text


# --- accounting and secrets ----------------------------------------------------------------------
def test_token_and_cost_accounting_adds_up(server):
    judge = make_judge(server, price_prompt_per_m=2.0, price_completion_per_m=10.0)
    server.script(server_error(500))  # a failed try sends no usage
    judge.complete_many([chat("one two three"), chat("four five"), chat("one two three")])
    judge.complete_many([chat("four five")])  # memory cache hit: free
    sent = [r.usage for r in server.requests if r.status == 200]
    prompt, completion = sum(u["prompt_tokens"] for u in sent), \
        sum(u["completion_tokens"] for u in sent)
    assert prompt > 0 and completion > 0
    stats = judge.pop_step_stats()
    assert (stats["judge_prompt_tokens"], stats["judge_completion_tokens"]) == (prompt, completion)
    assert stats["judge_cost_usd"] == pytest.approx((prompt * 2.0 + completion * 10.0) / 1e6)
    counts = [stats[f"judge_{k}"] for k in ("calls", "requests", "cache_hits", "sent", "retries",
                                            "failures")]
    # 2 distinct prompts + 1 retry; a shared in-flight twin and a memory hit
    assert counts == [4, 2, 2, 3, 1, 0]

    judge.complete_many([chat("six")])
    step, total = judge.pop_step_stats(), server.requests[-1].usage
    assert step["judge_prompt_tokens"] == total["prompt_tokens"] and step["judge_requests"] == 1
    assert step["judge_prompt_tokens_total"] == prompt + total["prompt_tokens"]
    assert step["judge_cost_usd_total"] > stats["judge_cost_usd"]


def test_api_key_is_sent_as_bearer_but_never_leaks(server, tmp_path, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "c.jsonl"
    judge = make_judge(server, cache_path=str(path))
    # the fake echoes the presented key in its error, as OpenAI does
    server.script(server_error(401))
    print(judge, judge.cfg)
    with pytest.raises(JudgeUnusable) as err:
        judge.complete_many([chat("a")])
    print(err.value)
    judge.fatal = None  # (a caller would have stopped; carry on to fill the cache)
    judge.score_many([chat("b")], parse_score)

    assert server.requests[0].headers["authorization"] == f"Bearer {SECRET}"
    # the error was logged, redacted
    assert any("HTTP 401" in r.getMessage() for r in caplog.records)
    out = capsys.readouterr()
    stats = judge.pop_step_stats()
    for text in [caplog.text, out.out, out.err, path.read_text(), repr(judge), str(judge.cfg),
                 json.dumps(stats)]:
        assert SECRET not in text
    # the cache was written (the check above is not vacuous)
    assert path.read_text().count("\n") == 1


def test_missing_key_env_sends_a_placeholder(server, monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    make_judge(server).complete_many([chat("q")])
    assert server.requests[0].headers["authorization"] == "Bearer EMPTY"


def test_azure_endpoint_uses_deployment_path_and_api_key_header(server):
    judge = make_judge(server, azure_endpoint=server.root, api_version="2024-06-01",
                       model="gpt-judge")
    assert judge.complete_many([chat("q")]) == ['{"score": 7}']
    req = server.requests[0]
    assert req.path == "/openai/deployments/gpt-judge/chat/completions"
    assert "api-version=2024-06-01" in req.query
    assert req.headers["api-key"] == SECRET


# What Anthropic's OpenAI-compatible endpoint documents (docs.claude.com, "OpenAI SDK
# compatibility"): the request fields it supports; config.ANTHROPIC_IGNORES lists those it ignores.
ANTHROPIC_SUPPORTS = {"model", "messages", "max_tokens", "max_completion_tokens", "stream",
                      "stream_options", "top_p", "parallel_tool_calls", "stop", "temperature", "n",
                      "tools", "functions", "tool_choice"}


def anthropic_objections(body: dict) -> list[str]:
    """What Anthropic's compatibility layer would ignore, cap or refuse in this request body."""
    from config import ANTHROPIC_IGNORES
    out = [f"{k}: ignored" for k in body if k in ANTHROPIC_IGNORES]
    out += [f"{k}: not supported" for k in body
            if k not in ANTHROPIC_SUPPORTS and k not in ANTHROPIC_IGNORES]
    out += ["n must be 1"] * (body.get("n", 1) != 1)
    t = body.get("temperature")
    out += ["temperature above 1 is capped"] * (t is not None and t > 1)
    roles = [m["role"] for m in body["messages"]]
    out += ["a system message after the first is hoisted"] * ("system" in roles[1:])
    return out


def test_claude_through_anthropics_openai_endpoint_gets_only_requests_it_documents(server,
                                                                                  monkeypatch):
    # docs/rewards-and-judges.md's Claude judge, its base_url pointed at the fake server
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")
    judge = make_judge(server, model="claude-sonnet-4-5", api_key_env="ANTHROPIC_API_KEY")
    judge_reward(["Explain MVCC."], [{"prompt": "Backend role"}], judge=judge)
    sampler = make_judge(server, model="claude-sonnet-4-5", api_key_env="ANTHROPIC_API_KEY",
                         temperature=1.0, max_tokens=300)  # an answer policy: K samples
    system = {"role": "system", "content": "You are a clinician."}
    assert sampler.complete_many([[system, *chat("q")]], n=3) == ['{"score": 7}'] * 3
    assert len(server.requests) == 4  # three samples are three requests of n = 1
    for r in server.requests:
        assert r.path == "/v1/chat/completions"
        assert r.headers["authorization"] == "Bearer sk-ant-test"
        assert anthropic_objections(r.body) == [], r.body
    assert anthropic_objections({"messages": [system, system], "n": 2, "temperature": 1.5,
                                 "seed": 1}) == [  # the check itself can fail
        "seed: ignored", "n must be 1", "temperature above 1 is capped",
        "a system message after the first is hoisted"]


def test_judge_reward_returns_one_criterion_on_request_from_the_cache(server):
    server.reply = lambda body: '{"relevance": 6, "clarity": 8, "discriminative_power": 10}'
    judge = make_judge(server)
    samples = [{"prompt": "Backend role"}]
    assert judge_reward(["Explain MVCC."], samples, judge=judge) == pytest.approx([0.8])
    asked = len(server.requests)
    assert judge_reward(["Explain MVCC."], samples, judge=judge, criterion="clarity") == \
        pytest.approx([0.8])
    assert judge_reward(["Explain MVCC."], samples, judge=judge, criterion="relevance") == \
        pytest.approx([0.6])
    assert len(server.requests) == asked  # answered from the cache
    with pytest.raises(ValueError, match="criterion 'novelty' is not one of"):
        judge_reward(["x"], samples, judge=judge, criterion="novelty")


def test_open_judges_names_each_judge_in_its_counters_and_errors(tmp_path):
    from judge import judges_stats, open_judges
    judges = open_judges(JudgeConfig(model="a"),
                         {"second": JudgeConfig(model="b", cache_path=str(tmp_path / "b.jsonl"))})
    assert list(judges) == ["judge", "second"] and judges["second"].cfg.model == "b"
    judges["second"].add_stat("requests", 3)
    stats = judges_stats(judges)
    assert stats["judge_requests"] == 0 and stats["judges/second/requests"] == 3 \
        and stats["judges/second/requests_total"] == 3
    # counters restart each call; totals go on
    assert judges_stats(judges)["judges/second/requests"] == 0
    assert open_judges(None, {}) == {}
    with pytest.raises(ValueError, match=r"^judges.second: need max_concurrent >= 1"):
        open_judges(JudgeConfig(model="a"), {"second": JudgeConfig(max_concurrent=0)})


@pytest.mark.parametrize("template",
                         ["pointwise_criteria", "logic_novelty", "rubric_scoring", "criterion_met"])
def test_the_stand_alone_fake_judge_answers_every_built_in_template_in_its_shape(template):
    from fake_openai_server import shaped_score
    from judge import TEMPLATE_CRITERIA, parse_met
    prompt = render(load_template(template), {"prompt": "p", "completion": "c", "question": "q",
                                              "rubric": "r", "answer": "a", "score_min": 0,
                                              "score_max": 5, "criterion": "x", "points": "+5"})
    met = set()
    for extra in ("", "y"):  # two lengths: both of criterion_met's answers, 0 and 1
        reply = shaped_score({"messages": [{"role": "user", "content": prompt + extra}]}, top=5)
        if template == "criterion_met":
            # precompute.criteria_key's: met or not, whatever the score range
            met.add(parse_met(reply).score)
            continue
        parsed = parse_score(reply, 0, 5, criteria=TEMPLATE_CRITERIA.get(template))
        assert parsed is not None \
            and set(parsed.criteria) == set(TEMPLATE_CRITERIA.get(template, []))
    assert met == ({0.0, 1.0} if template == "criterion_met" else set())


def test_a_missing_key_for_a_remote_endpoint_is_said_before_any_call(monkeypatch, capsys):
    from judge import open_judges
    remote = JudgeConfig(base_url="https://api.example.com/v1", model="m",
                         api_key_env="MINIGRPO_TEST_UNSET_KEY")
    assert Judge(remote).key_missing \
        and not Judge(JudgeConfig(model="m", api_key_env="MINIGRPO_TEST_UNSET_KEY")).key_missing
    open_judges(remote, {})
    assert "$MINIGRPO_TEST_UNSET_KEY is not set" in capsys.readouterr().err
    monkeypatch.setenv("MINIGRPO_TEST_UNSET_KEY", "sk-x")
    assert not Judge(remote).key_missing


@pytest.mark.parametrize("url", ["not-a-url", "", "127.0.0.1:8931/v1", "ftp://host/v1"])
def test_a_base_url_that_is_not_an_http_url_is_refused_when_the_client_is_built(server, url):
    """Else every call fails to connect, each only counted, and the run trains on the fallback."""
    with pytest.raises(ValueError, match="is not an http\\(s\\) URL"):
        make_judge(server, base_url=url)


def test_a_cache_write_that_fails_keeps_the_paid_reply_and_says_so_once(server, tmp_path,
                                                                        monkeypatch, caplog):
    """A full disk under cache_path: each reply is still returned (it was paid for; raised, the
    whole batch fell back and its other requests were cancelled), with one warning a step that a
    rerun pays again."""
    import errno

    from files import jsonl
    judge = make_judge(server, cache_path=str(tmp_path / "judge.jsonl"))

    def full(path, records):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(jsonl, "append", full)
    with caplog.at_level(logging.WARNING, logger="client"):
        assert judge.complete_many([chat(f"p{i}") for i in range(3)]) == ['{"score": 7}'] * 3
    warned = [r.getMessage() for r in caplog.records if "cannot write its cache" in r.getMessage()]
    assert len(warned) == 1 and "No space left on device" in warned[0] \
        and "pays for them again" in warned[0]
    assert judge.pop_step_stats()["judge_failures"] == 0


def test_a_criterion_met_verdict_given_as_a_json_boolean_counts():
    """{"met": true} is how HealthBench's own grader answers ("criteria_met": true); read as no
    verdict, it failed the call and left the question out of precompute's gold (a parse failure is
    not retried)."""
    from judge import parse_met
    assert (parse_met('{"met": true}').score,
            parse_met('```json\n{"met": false}\n```').score) == (1.0, 0.0)
    assert parse_met('{"met": "maybe"}') is None


def test_a_password_in_the_judge_url_is_masked_in_warnings_errors_repr_and_saved_configs(
        monkeypatch, caplog, tmp_path):
    """Issue 30: http://user:${PASS}@host printed the password in the warning and exit-2 error."""
    from api import client
    from config import Config, save_config
    monkeypatch.setattr(client, "FAILED_LIMIT", 2)
    monkeypatch.setenv("MINIGRPO_TEST_PASS", "pw-SECRET123")
    with FakeOpenAIServer() as server:
        url = server.url.replace("http://", "http://judge:${MINIGRPO_TEST_PASS}@")
    judge = Judge(JudgeConfig(base_url=url, model="m", max_retries=0))  # nothing listens there now
    with pytest.raises(JudgeUnusable) as err:
        judge.complete_many([chat("a"), chat("b")])
    shown = [str(err.value), repr(judge), *(r.getMessage() for r in caplog.records)]
    assert all("pw-SECRET123" not in text for text in shown) \
        and "http://***@127.0.0.1" in str(err.value)
    cfg = Config()
    # written in clear
    cfg.judge = JudgeConfig(base_url="http://judge:pw-SECRET123@host/v1", model="m")
    save_config(cfg, tmp_path / "config.yaml")
    saved = (tmp_path / "config.yaml").read_text()
    assert "pw-SECRET123" not in saved and "http://***@host/v1" in saved
    with pytest.raises(ValueError, match=r"judge: base_url holds '\*\*\*', a secret masked"):
        Judge(JudgeConfig(base_url="http://***@host/v1", model="m"))  # a saved config given back


def test_a_step_is_down_only_when_its_calls_got_no_http_reply_and_the_probe_skips_the_cache(
        server):
    """Issue 30's review: a 400 (a prompt past the judge's context) is a reply, not an outage;
    the wait's probe sends its request past the cache and counts only in judge_sent."""
    judge = make_judge(server, max_retries=0)
    judge.complete_many([chat("first")])
    judge.pop_step_stats()
    server.default = server_error(400)
    judge.complete_many([chat(f"long {i}") for i in range(8)])
    judge.pop_step_stats()
    assert judge.down_steps == 0
    server.default = server_error(503)
    judge.complete_many([chat(f"q {i}") for i in range(8)])
    judge.pop_step_stats()
    assert judge.down_steps == 1 and not judge.probe()
    server.default = ok()
    sent = len(server.requests)
    assert judge.probe() and len(server.requests) == sent + 1
    stats = judge.pop_step_stats()
    assert (stats["judge_calls"], stats["judge_sent"]) == (0, 2)


def test_a_refused_connection_is_said_with_its_host_and_each_warning_has_the_prefix(caplog):
    """Issue 39: the outage line said only APIConnectionError; and the client's warnings lacked
    the [minigrpo] prefix every other line has."""
    with FakeOpenAIServer() as gone:
        url, port = gone.url, gone.url.split(":")[2].split("/")[0]
    judge = Judge(JudgeConfig(base_url=url, model="m", max_retries=0))
    with caplog.at_level(logging.WARNING):
        assert judge.complete_many([chat("q")]) == [None]
    assert judge.last_failure == f"1 try, the last connection refused by 127.0.0.1:{port}"
    (warned,) = [r.getMessage() for r in caplog.records]
    assert warned == (f"[minigrpo] warning: judge: {url} failed 1 try, last connection refused "
                      f"by 127.0.0.1:{port}")


def test_a_failed_judge_call_is_no_reward_by_default_and_a_numeric_fallback_still_scores(server):
    """Issue 39: the default fallback was 0.0, the worst score, for a call that never judged."""
    server.default = server_error(503)
    judge = make_judge(server, max_retries=0)
    args = {"template": "Rate {completion}", "criteria": []}
    context = {"judge": judge}
    res = compute_rewards(["a"], [{}], [RewardSpec("judge", args=args)], context=context)
    assert math.isnan(res.total[0]) and res.per_reward["judge"] == [None]
    res = compute_rewards(["b"], [{}], [RewardSpec("judge", args=args, fallback=0.0)],
                          context=context)
    assert res.total == [0.0] and res.errors["judge"] == 1


def small_judge_snippets() -> dict[str, dict]:
    """docs/rewards-and-judges.md's "Small local judges" YAML blocks, by the server they are for."""
    doc = (Path(__file__).parents[1] / "docs/rewards-and-judges.md").read_text()
    section = doc.split("### Small local judges")[1].split("\n## ")[0]
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.S)]
    return {"llama.cpp": blocks[0], "vllm": blocks[1]}


def test_the_documented_vllm_version_for_structured_outputs_is_the_first_server_that_reads_it():
    """Issue 45: a vLLM server ignores a structured-output field it does not know (the replies go
    unconstrained), so the docs name the version from which `structured_outputs` is read, as the
    servers' source says (engines/vllm_surface.json: vLLM 0.10.2, 0.11.0, 0.27.0, 0.30.0)."""
    from packaging.version import Version

    from engines.vllm_startup import SURFACE
    reads = {v: s["chat_request_fields"] for v, s in SURFACE.items()}
    first = min((v for v in reads if "structured_outputs" in reads[v]), key=Version)
    assert first == "0.11.0" and "guided_regex" in reads["0.10.2"]
    assert all("guided_regex" not in reads[v] for v in reads if Version(v) >= Version("0.27"))
    doc = (Path(__file__).parents[1] / "docs/rewards-and-judges.md").read_text()
    section = doc.split("### Small local judges")[1].split("\n## ")[0]
    assert f"`{{choice: [...]}}` from vLLM {first} on" in " ".join(section.split())
    assert f"# vLLM < {first}: {{guided_regex:" in section


@pytest.mark.parametrize("server_kind, sent", [
    ("llama.cpp", {"grammar": 'root ::= "Score: " [0-9]'}),
    ("vllm", {"structured_outputs": {"regex": "Score: [0-9]"}})])
def test_the_documented_small_judge_configs_send_their_grammar_and_a_score_reply_scores(
        server, server_kind, sent):
    """Issue 39: a grammar through extra_body made SmolLM2-135M a judge; the docs' configs send it
    in the request body, and the reply it forces ("Score: 7") scores 7 of score_max."""
    snippet = small_judge_snippets()[server_kind]
    cfg = from_dict(Config, {**snippet, "judge": {**snippet["judge"], "base_url": server.url,
                                                  "cache_path": None}})
    server.reply = lambda body: "Score: 7"
    judge = Judge(cfg.judge)
    spec = cfg.rewards[0]
    res = compute_rewards(["The sum is 4."], [{}], [spec], context={"judge": judge})
    assert res.total == [pytest.approx(7 / 9)] and res.errors["judge"] == 0
    body = server.requests[-1].body
    assert {k: body[k] for k in sent} == sent and body["max_tokens"] == 8
    assert "The sum is 4." in body["messages"][-1]["content"]


@pytest.mark.parametrize("url, says", [
    ("http://127.0.0.1:notaport/v1", "cannot build a request to http://127.0.0.1:notaport/v1/chat/"
     "completions (InvalidURL: Invalid port: 'notaport'); fix judge.base_url"),
    ("http://[::1/v1", "judge: base_url='http://[::1/v1' is not an http(s) URL")])
def test_a_judge_url_no_request_can_be_built_for_fails_the_dry_run(tmp_path, capsys, url, says):
    """Issue 47: --dry-run said the judges checked out, then every call raised before a request
    was sent (judge_calls 0, reward_errors/judge 32), and the run trained on nothing to `done`."""
    import train
    root = Path(__file__).parents[1]
    args = ["--config", str(root / "configs/quickstart.yaml"), "--dry-run", "--run.threads=1",
            f"--run.out_dir={tmp_path / 'run'}", f"--judge.base_url={url}", "--judge.model=m",
            "--rewards=[{name: answer_match}, {name: judge, args: {template: 'Rate {completion}', "
            "criteria: []}}]"]
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0]
    with pytest.raises(ValueError, match=re.escape(says)):
        Judge(JudgeConfig(base_url=url, model="m"))


# --- the group judge (issue 47) -------------------------------------------------------------------
def group_batch(prompts=("What is 2 + 2?", "What is 3 + 5?"), g: int = 4):
    """A step's layout: g consecutive completions per prompt, each group one row object."""
    rows = [{"prompt": p, "answer": "x"} for p in prompts]
    samples = [row for row in rows for _ in range(g)]
    completions = [f"{p[8:13]} is {k}" for p in prompts for k in range(g)]
    return completions, samples


def test_the_group_judge_sends_one_request_a_prompt_with_its_completions_labelled(server):
    """One call a prompt instead of G: the prompt and its G completions, [Answer 1] .. [Answer G],
    and the G scores read back in that order, normalised by the judge's score range."""
    server.reply = lambda body: '{"scores": [0, 10, 5, 2.5]}'
    judge = make_judge(server)
    completions, samples = group_batch()
    res = compute_rewards(completions, samples, [RewardSpec("group_judge")],
                          context={"judge": judge})
    assert res.per_reward["group_judge"] == [0.0, 1.0, 0.5, 0.25] * 2
    assert len(server.requests) == 2
    (shown,) = [r.messages[-1]["content"] for r in server.requests if "2 + 2?" in r.prompt_text]
    assert "3 + 5" not in shown
    assert "[Answer 1]\n2 + 2 is 0\n\n[Answer 2]\n2 + 2 is 1" in shown and "[Answer 4]" in shown
    assert 'holding the 4 scores in the answers\' order: {"scores": [<number>, ...]}' in shown
    stats = judge.pop_step_stats()
    assert (stats["judge_calls"], stats["judge_requests"]) == (2, 2)


@pytest.mark.parametrize("reply", [
    '{"scores": [7, 3, 9]}',  # 3 scores for 4 answers
    '{"scores": [7, 3, 9, 4, 1]}',
    '{"scores": [7, 3, 9, 11]}',  # one out of range
    '{"scores": [7, 3, true, 4]}',
    "Answer 1: 7, Answer 2: 3, Answer 3: 9, Answer 4: 4",  # not the format asked for
    'They are all fine. {"scores": [7, 3, 9, 4]} is what I would give.'])
def test_a_group_reply_without_exactly_g_scores_skips_its_completions_never_scores_them_0(
        server, reply):
    server.reply = lambda body: reply if "2 + 2" in body["messages"][-1]["content"] \
        else '{"scores": [1, 2, 3, 4]}'
    judge = make_judge(server)
    completions, samples = group_batch()
    res = compute_rewards(completions, samples, [RewardSpec("group_judge")],
                          context={"judge": judge})
    assert res.per_reward["group_judge"] == [None] * 4 + [0.1, 0.2, 0.3, 0.4]
    assert res.errors["group_judge"] == 4 and all(math.isnan(t) for t in res.total[:4])
    stats = judge.pop_step_stats()
    assert (stats["judge_calls"], stats["judge_failures"], stats["judge_unusable"]) == (2, 1, 1)


def test_a_group_reply_may_think_first_or_fence_its_json():
    from judge import parse_group
    assert parse_group('<think>4 answers: 7 3 9</think>{"scores": [7, 3, 9, 4]}', n=4) \
        == [7.0, 3.0, 9.0, 4.0]
    assert parse_group('```json\n{"scores": ["8", 2]}\n```', n=2) == [8.0, 2.0]
    assert parse_group('{"scores": [8, 2]} and more', n=2) is None
    assert parse_group('{"score": [8, 2]}', n=2) is None


def test_identical_completions_in_a_group_get_one_score(server):
    """As a rule reward would: the mean of the scores the judge gave the same text."""
    server.reply = lambda body: '{"scores": [2, 5, 10]}'
    judge = make_judge(server)
    row = {"prompt": "What is 1 + 1?"}
    assert judge_group_values(judge, ["2", "two", "2"], [row] * 3) == pytest.approx([0.6, 0.5, 0.6])


def judge_group_values(judge, completions, samples, **args):
    from judge import group_judge
    return group_judge(completions, samples, judge=judge, **args)


def test_a_rerun_of_a_group_pays_nothing_and_another_group_pays_again(server, tmp_path):
    """The request holds the group's content: a new process over the same cache gets the reply
    free; a group with one completion changed is another request."""
    path = tmp_path / "judge.jsonl"
    server.reply = lambda body: '{"scores": [1, 2, 3, 4]}'
    completions, samples = group_batch()
    first = judge_group_values(make_judge(server, cache_path=str(path)), completions, samples)
    assert len(server.requests) == 2
    rerun = make_judge(server, cache_path=str(path), memory_cache=False)
    assert judge_group_values(rerun, completions, samples) == first
    assert len(server.requests) == 2 and rerun.pop_step_stats()["judge_cache_hits"] == 2
    judge_group_values(rerun, ["changed", *completions[1:]], samples)
    assert len(server.requests) == 3  # the first group only


def test_group_judge_steps_follow_the_failed_share_and_unusable_rules_per_request(server):
    """scoring/outage.py counts a group judge's requests: 3 of 4 groups without a reply skip the
    step; 3 of 4 unusable for 3 steps stop the run."""
    import types

    from fake_openai_server import dropped
    from scoring import outage
    cfg = Config()
    judge = make_judge(server, max_retries=0)
    opt = torch_optimizer()
    run = types.SimpleNamespace(judges={"judge": judge}, cfg=cfg, scheduler=opt, step=1, world=1)
    prompts = [f"What is {i} + 1?" for i in range(4)]
    server.script(ok('{"scores": [1, 2, 3, 4]}'))
    server.default = dropped()
    completions, samples = group_batch(prompts)
    values = judge_group_values(judge, completions, samples)
    assert sum(not math.isnan(v) for v in values) == 4  # one group of 4 scored
    assert outage.minis_to_train(run, ["mb"], errors={"group_judge": 12}, scored=16) == []
    judge.pop_step_stats()
    server.default = ok("These all look right to me.")
    server.script(ok('{"scores": [1, 2, 3, 4]}'))
    for step in range(3):
        completions, samples = group_batch([f"{p} ({step})" for p in prompts])
        judge_group_values(judge, completions, samples)
        if step < 2:
            assert outage.minis_to_train(run, ["mb"], errors={"group_judge": 12}, scored=16)
            judge.pop_step_stats()
            server.script(ok('{"scores": [1, 2, 3, 4]}'))
    with pytest.raises(JudgeUnusable, match="judge: 3 of 4 replies held no usable score this step"):
        outage.minis_to_train(run, ["mb"], errors={"group_judge": 12}, scored=16)


def torch_optimizer():
    import torch
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0)


def test_the_group_judge_is_checked_before_a_run_like_the_judge():
    from scoring.checks import check_rows, check_specs
    with pytest.raises(ValueError, match="reward 'group_judge' needs a judge"):
        check_specs([RewardSpec("group_judge")], judges=())
    with pytest.raises(ValueError, match="is not one of"):
        check_specs([RewardSpec("group_judge", args={"template": "no_such_template"})])
    with pytest.raises(ValueError, match="prompt"):
        check_rows([RewardSpec("group_judge")], [{"question": "q"}])


def group_judge_snippets() -> dict[str, dict]:
    """docs/rewards-and-judges.md's "A group judge" YAML blocks for small local judges."""
    doc = (Path(__file__).parents[1] / "docs/rewards-and-judges.md").read_text()
    section = doc.split("### A group judge")[1].split("\n### ")[0]
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.S)]
    return {"llama.cpp": blocks[1], "vllm": blocks[2]}


def gbnf_regex(grammar: str) -> str:
    """A one-rule GBNF grammar of literals, character classes, groups and {m} as a regex."""
    body = grammar.split("::=", 1)[1]
    tokens = re.findall(r'"(?:[^"\\]|\\.)*"|\[[^\]]*\]|\{\d+\}|[()]|\s+', body)
    assert "".join(tokens) == body, "a GBNF construct this test does not read"
    return "".join(re.escape(json.loads(t)) if t.startswith('"') else "" if t.isspace() else t
                   for t in tokens)


@pytest.mark.parametrize("server_kind", ["llama.cpp", "vllm"])
def test_the_documented_group_judge_configs_send_their_constraint_and_its_replies_score(
        server, server_kind):
    """The docs' grammar and JSON schema allow exactly G scores in the judge's range, reach the
    request, and a reply they allow scores each of the G completions."""
    from judge import parse_group
    snippet = group_judge_snippets()[server_kind]
    cfg = from_dict(Config, {**snippet, "judge": {**snippet["judge"], "base_url": server.url,
                                                  "cache_path": None}})
    g, top = cfg.rollout.num_generations, cfg.judge.score_max
    reply = json.dumps({"scores": [k % 10 for k in range(g)]})
    sent = cfg.judge.extra_body
    if server_kind == "llama.cpp":
        allowed = gbnf_regex(sent["grammar"])
        assert re.fullmatch(allowed, reply) and not re.fullmatch(allowed, '{"scores": [1, 2]}')
    else:
        scores = sent["structured_outputs"]["json"]["properties"]["scores"]
        assert scores["minItems"] == scores["maxItems"] == g
        assert (scores["items"]["minimum"], scores["items"]["maximum"]) == (0, top)
    assert parse_group(reply, 0, top, n=g) is not None
    server.reply = lambda body: reply
    row = {"prompt": "What is 2 + 2?"}
    res = compute_rewards([f"answer {k}" for k in range(g)], [row] * g, cfg.rewards,
                          context={"judge": Judge(cfg.judge)})
    assert res.total == pytest.approx([(k % 10) / top for k in range(g)])
    body = server.requests[-1].body
    assert {k: body[k] for k in sent} == sent and body["max_tokens"] == cfg.judge.max_tokens
