"""`m3eagle bench-serve --dataset tools | json | prefix`: the chat requests the first two build (a tools list with
tool_choice auto; a response_format json_schema), whatever --endpoint says; the prefix workload's prompts (one
shared prefix, then each request's own window); and the flags parse."""

from __future__ import annotations

import argparse

import pytest

from m3eagle.bench.serve import BENCH_SCHEMA, BENCH_TOOLS, CHAT_ENDPOINT, endpoint_of, make_prompts, payload
from m3eagle.entrypoints import cli
from m3eagle.entrypoints.tools import check_tools


def args(dataset: str, endpoint: str = "/v1/completions") -> argparse.Namespace:
    return argparse.Namespace(dataset=dataset, endpoint=endpoint, output_len=8, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("dataset", ["tools", "json"])
def test_chat_workloads_build_chat_requests(dataset):
    a = args(dataset)
    assert endpoint_of(a) == CHAT_ENDPOINT
    body = payload(endpoint_of(a), "m", [1, 2], "def f(): pass", a)
    assert "prompt" not in body and body["messages"][0]["role"] == "user"
    assert body["messages"][0]["content"].endswith("def f(): pass") and body["stream"] and body["max_tokens"] == 8
    if dataset == "tools":
        assert body["tools"] == BENCH_TOOLS and body["tool_choice"] == "auto" and "response_format" not in body
        assert check_tools(body["tools"]) == BENCH_TOOLS  # what the server accepts
    else:
        assert body["response_format"] == {"type": "json_schema", "json_schema": {
            "name": "code_summary", "schema": BENCH_SCHEMA, "strict": True}} and "tools" not in body


def test_plain_workloads_unchanged():
    a = args("stdlib")
    assert endpoint_of(a) == "/v1/completions"
    body = payload(endpoint_of(a), "m", [1, 2], "", a)
    assert body["prompt"] == [1, 2] and "tools" not in body and "response_format" not in body
    chat = payload(CHAT_ENDPOINT, "m", [1, 2], "text", args("random", CHAT_ENDPOINT))
    assert chat["messages"] == [{"role": "user", "content": "text"}]


def test_dataset_flag_parses():
    parser = cli.build_parser()
    for d in ("tools", "json"):
        assert parser.parse_args(["bench-serve", "--dataset", d]).dataset == d
    assert parser.parse_args(["bench-serve", "--dataset", "prefix", "--prefix-len", "512"]).prefix_len == 512


def test_prefix_workload_shares_one_prefix_then_differs():
    from m3eagle.bench.serve import load_tokenizer

    tok = load_tokenizer(None)  # the embedded model's, as bench-serve loads it
    prompts = make_prompts(tok, "prefix", 6, 40, seed=3, prefix_len=100)
    assert len(prompts) == 6 and all(len(p) == 140 for p in prompts)
    assert all(p[:100] == prompts[0][:100] for p in prompts)  # one shared prefix
    assert len({tuple(p[100:]) for p in prompts}) == 6  # each request its own suffix
    assert prompts[0][100:] != prompts[0][:40]  # the suffix is not the prefix again
    assert make_prompts(tok, "prefix", 6, 40, seed=3, prefix_len=100) == prompts  # seeded
    with pytest.raises(ValueError, match="--prefix-len"):
        make_prompts(tok, "prefix", 2, 40, seed=3)
