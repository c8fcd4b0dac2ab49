"""vLLM backend logic without a server: config building, classification from per-step arrays (and the n-gram
replay that places steps without drafts), the near-tie evidence read from hand-written stream chunks. Its /metrics
counters: tests/test_server_counters.py."""

import json
import logging
import math
import os

import pytest

from engine.events import RunResult, TokenKind
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.vllm.backend import VLLMBackend
from engine.vllm.client import parse_chunk, request_body
from engine.vllm.config import speculative_config
from engine.vllm.server import ServerConfig, VLLMError
from engine.vllm.steps import classify, kinds, ngram_proposal, replay_ngram

A, B, REC, BASE = TokenKind.ACCEPTED, TokenKind.BONUS, TokenKind.RECOVERED, TokenKind.BASELINE


def test_speculative_configs():
    assert speculative_config("ngram", 4) == {"method": "ngram", "num_speculative_tokens": 4,
                                              "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    assert speculative_config("draft_model", 6, "/m/draft")["model"] == "/m/draft"
    assert speculative_config("eagle3", 3, "/m/eagle") == {"method": "eagle3", "num_speculative_tokens": 3,
                                                          "model": "/m/eagle"}
    with pytest.raises(VLLMError, match="needs a draft"):
        speculative_config("draft_model", 4)
    with pytest.raises(VLLMError, match="unknown"):
        speculative_config("magic", 4)
    with pytest.raises(VLLMError, match="K must"):
        speculative_config("ngram", 0)


def test_server_commands():
    spec = ServerConfig("speculative", "/m", 8102, "/venv/bin/python", {"method": "ngram", "num_speculative_tokens": 4},
                        gpu=False, cpu_core=1)
    cmd = spec.command()
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert json.loads(cmd[cmd.index("--speculative-config") + 1])["num_speculative_tokens"] == 4
    assert "--per-request-spec-decode-metrics" in cmd and "--enforce-eager" in cmd
    assert spec.env()["VLLM_CPU_OMP_THREADS_BIND"] == "1" and spec.env()["VLLM_CPU_KVCACHE_SPACE"] == "1"
    base = ServerConfig("baseline", "/m", 8101, gpu=True, gpu_memory_utilization=0.4).command()
    assert "--per-request-spec-decode-metrics" not in base  # vLLM refuses it without speculation
    assert base[base.index("--gpu-memory-utilization") + 1] == "0.4"


def test_a_managed_server_gets_only_the_environment_it_needs(monkeypatch):
    secrets = {"SPECCONSOLE_AUTH": "me:pw", "VLLM_API_KEY": "console-key", "AWS_SECRET_ACCESS_KEY": "s3",
               "HF_TOKEN": "hf", "GITHUB_TOKEN": "gh", "OPENAI_API_KEY": "oa"}
    needed = {"HF_HOME": "/hf", "TRANSFORMERS_CACHE": "/tc", "VLLM_LOGGING_LEVEL": "DEBUG", "CUDA_VISIBLE_DEVICES": "1",
              "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8",
              "PYTHONPATH": "/p", "TMPDIR": "/t", "LD_PRELOAD": "/lib/libtcmalloc.so", "TOKENIZERS_PARALLELISM": "0",
              "TORCHINDUCTOR_CACHE_DIR": "/ti", "XDG_CACHE_HOME": "/xc"}
    for name, value in (secrets | needed).items():
        monkeypatch.setenv(name, value)
    env = ServerConfig("baseline", "/m", 8101).env()
    assert not set(secrets) & set(env)
    assert {name: env.get(name) for name in [*needed, "PATH", "HOME"]} == needed | {
        "PATH": os.environ["PATH"], "HOME": os.environ["HOME"]}
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    keyed = ServerConfig("baseline", "/m", 8101, api_key="k-123")
    assert keyed.env()["VLLM_API_KEY"] == "k-123"
    assert "k-123" not in " ".join(keyed.command()) + repr(keyed)  # the command is logged and shown by ps


def test_classify_all_kinds():
    # prefill token, step 1: 2 of 3 accepted, step 2: 3 of 3 accepted (+bonus), step 3: nothing drafted
    steps = classify(1 + 3 + 4 + 1, [2, 3, 0], [3, 3, 0])
    placed = kinds(steps, 9)
    assert [k for k, _, _ in placed] == [BASE, A, A, REC, A, A, A, B, BASE]
    assert [(s, p) for _, s, p in placed][:4] == [(0, 0), (1, 0), (1, 1), (1, 2)]


def test_classify_last_step_cut_by_a_stop():
    steps = classify(1 + 5 + 2, [4, 4], [4, 4])  # EOS among the second step's accepted drafts
    assert [k for k, _, _ in kinds(steps, 8)] == [BASE, A, A, A, A, B, A, A]


def test_classify_refuses_counts_that_do_not_add_up():
    assert classify(20, [1, 1], [4, 4]) is None  # too few steps for 20 tokens (steps without drafts are missing)
    assert classify(3, [4, 4], [4, 4]) is None  # the second step would have produced nothing


NGRAM = speculative_config("ngram", 3)


def test_ngram_proposal_is_vllms_lookup():
    assert ngram_proposal([5, 6, 7, 8, 5, 6], 1, 4, 3, 2048) == [7, 8, 5]  # suffix "5 6" occurred: what followed
    assert ngram_proposal([5, 6, 7, 9], 1, 4, 3, 2048) == []  # 9 never occurred before
    assert ngram_proposal([5, 6, 7, 8, 5, 6], 1, 4, 3, 7) == [7]  # one position left before max_model_len
    assert ngram_proposal([1, 2, 3, 1, 2], 3, 4, 3, 2048) == []  # a match shorter than prompt_lookup_min


def test_replay_places_steps_without_drafts():
    prompt = [10, 11, 12, 13]
    # prefill -> 20; 20 never seen: plain step -> 10; "10" seen: drafts [11, 12, 13], 2 accepted, recovered 99;
    # 99 unseen: plain step -> 21
    output = [20, 10, 11, 12, 99, 21]
    steps = replay_ngram(prompt, output, [2], [3], NGRAM, 2048)
    assert steps == [(0, 0), (0, 0), (3, 2), (0, 0)]
    assert [k for k, _, _ in kinds(steps, len(output))] == [BASE, BASE, A, A, REC, BASE]
    assert classify(len(output), [2], [3]) is None  # the arrays alone cannot place them


def test_replay_refuses_what_the_arrays_contradict():
    prompt, output = [10, 11, 12, 13], [20, 10, 11, 12, 99, 21]
    assert replay_ngram(prompt, output, [2], [2], NGRAM, 2048) is None  # the proposer drafted 3, not 2
    assert replay_ngram(prompt, output, [3], [3], NGRAM, 2048) is None  # 99 is not the draft 13
    assert replay_ngram(prompt, [20, 10, 11, 12, 99], [1], [3], NGRAM, 2048) is None  # "recovered" 12 = its draft
    assert replay_ngram(prompt, output, [2, 0], [3, 3], NGRAM, 2048) is None  # a step the replay never saw


# --- near-tie evidence: a greedy request asks for the top 2 logprobs, each token gets its runner-up and margin ---

def chat_chunk(*tokens) -> str:
    """A vLLM chat chunk: each token (id, text, logprob, top entries as (text, logprob) pairs, or None for none)."""
    content = [{"token": text, "logprob": lp, "bytes": list(text.encode())}
               | ({"top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top]}
                  if top is not None else {}) for _, text, lp, top in tokens]
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": [
        {"index": 0, "delta": {"content": "".join(t[1] for t in tokens)}, "logprobs": {"content": content},
         "finish_reason": None, "token_ids": [t[0] for t in tokens]}]})


def completion_chunk(*tokens) -> str:
    """A vLLM completion chunk: its top logprobs are a {text: logprob} dict per token."""
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [
        {"index": 0, "text": "".join(t[1] for t in tokens), "finish_reason": None, "stop_reason": None,
         "token_ids": [t[0] for t in tokens],
         "logprobs": {"text_offset": list(range(len(tokens))), "tokens": [t[1] for t in tokens],
                      "token_logprobs": [t[2] for t in tokens],
                      "top_logprobs": [dict(top) if top is not None else None for *_, top in tokens]}}]})


def evidence(payload: str) -> list[tuple]:
    return [(t.token_id, t.text, t.runner_up_text, t.margin) for t in parse_chunk(payload, set()).tokens]


def test_a_greedy_request_asks_for_the_top_two_and_a_sampled_one_does_not():
    greedy, sampled = SamplingParams(0.0, 0, 1.0, 0), SamplingParams(0.7, 0, 1.0, 1)
    for chat in (True, False):
        key = "top_logprobs" if chat else "logprobs"
        for params, top in ((greedy, 2), (sampled, 0)):
            path, body = request_body(Request(prompt="hi", sampling=params, chat=chat), "m")
            assert path.endswith("chat/completions" if chat else "/v1/completions")
            assert body[key] == top and body["return_token_ids"] is True
        assert "return_tokens_as_token_ids" not in body  # it would turn every token's text into "token_id:N"


@pytest.mark.parametrize("chunk", [chat_chunk, completion_chunk], ids=["chat", "completions"])
def test_the_top_two_give_each_token_its_runner_up_and_logit_margin(chunk):
    payload = chunk((278, " the", -0.25, [(" the", -0.25), (" a", -1.75)]),
                    (4, "<b>", -0.5, [("<i>", -0.5), ("<b>", -0.5)]))  # an exact tie, the other listed first
    assert evidence(payload) == [(278, " the", " a", 1.5), (4, "<b>", "<i>", 0.0)]
    assert parse_chunk(payload, set()).tokens[0].p == pytest.approx(math.exp(-0.25))
    # chat lists entries, so another token with the same text can be the runner-up (a completion's dict merges them)
    assert evidence(chat_chunk((9, " x", -1.0, [(" x", -1.0), (" x", -1.125)]))) == [(9, " x", " x", 0.125)]


@pytest.mark.parametrize("top", [
    None,  # not asked for (a sampled run): no entries
    [(" the", -0.25)],  # the token alone
    [(" the", -1.0), (" a", -1.75)],  # the token is not among them (its logprob differs)
    [(" a", -0.1), (" the", -0.25)],  # the token below the other: not the distribution greedy chose from
], ids=["none", "one entry", "token missing", "token below"])
def test_top_entries_that_give_no_runner_up_leave_it_unknown(top):
    for chunk in (chat_chunk, completion_chunk):
        assert evidence(chunk((278, " the", -0.25, top))) == [(278, " the", None, None)]


def test_a_completion_whose_top_tokens_share_a_text_is_unknown():
    """vLLM keys a completion's top logprobs by text: two tokens with the same text merge, the later logprob kept."""
    payload = json.loads(completion_chunk((9, "\ufffd", -0.5, [("\ufffd", -0.5)])))
    payload["choices"][0]["logprobs"]["top_logprobs"] = [{"\ufffd": -0.7}]
    assert evidence(json.dumps(payload)) == [(9, "\ufffd", None, None)]


@pytest.mark.parametrize("entries", [
    "two", 7, [" the", " a"], [{"token": " the", "logprob": -0.25}, {"token": 5, "logprob": -1.0}],
    [{"token": " the", "logprob": -0.25}, {"logprob": -1.0}],
    [{"token": " the", "logprob": -0.25}, {"token": " a", "logprob": "low"}],
    [{"token": " the", "logprob": -0.25}, {"token": " a", "logprob": float("nan")}],
    [{"token": " the", "logprob": -0.25}, {"token": " a", "logprob": 3.0}],
], ids=["a string", "a number", "not objects", "a text that is a number", "no text", "a word", "NaN", "above 0"])
def test_malformed_top_entries_leave_the_evidence_unknown_and_the_token_as_it_was(entries, caplog):
    payload = json.loads(chat_chunk((278, " the", -0.25, None), (5, " x", -0.5, [(" x", -0.5), (" y", -2.5)])))
    payload["choices"][0]["logprobs"]["content"][0]["top_logprobs"] = entries
    with caplog.at_level(logging.WARNING):
        got = evidence(json.dumps(payload))
    assert got == [(278, " the", None, None), (5, " x", " y", 2.0)]  # the next token's evidence is still read
    assert "near-tie evidence is unknown" in caplog.text or "a top logprob" in caplog.text
    # a token whose own logprob is unknown has no margin either
    payload["choices"][0]["logprobs"]["content"][0] |= {"logprob": None, "top_logprobs": [
        {"token": " the", "logprob": -0.25}, {"token": " a", "logprob": -1.0}]}
    assert evidence(json.dumps(payload))[0] == (278, " the", None, None)


def test_the_backends_token_events_carry_the_evidence():
    backend = VLLMBackend("http://127.0.0.1:1", "http://127.0.0.1:2", "m")
    streamed = parse_chunk(chat_chunk((278, " the", -0.25, [(" the", -0.25), (" a", -1.75)]),
                                      (5, " x", -0.5, None)), set()).tokens
    for engine in ("baseline", "speculative"):
        result = RunResult(engine, "none", 3)
        events = list(backend._tokens(engine, streamed, result, 0.1, None))
        assert [(e.runner_up, e.runner_up_text, e.margin) for e in events] == [(None, " a", 1.5), (None, None, None)]
        assert events == result.tokens
