"""vLLM backend logic without a server: config building, classification from per-step arrays (and the n-gram
replay that places steps without drafts). Its /metrics counters: tests/test_server_counters.py."""

import json
import os

import pytest

from engine.events import TokenKind
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
