"""/v1/completions as OpenAI's clients use it: prompt lists in all four forms, choice order, usage,
a bad prompt in a list, echo with logprobs (prompt logprobs), logprobs 0, vLLM's prompt_logprobs, and
special tokens in logprobs; a real server process, the official client, HF as the logprob reference."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.server_process import ServerProcess, metric, openai_client, tiny_server
from tests.test_server import metrics_text, num_aborted, slow_steps, sse_events, wait_idle

COMPLETIONS = "/v1/completions"
GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 5, "extra_body": {"ignore_eos": True}}
PROMPTS = ["The quick brown fox", "Hello there", "Once upon a time"]
SPECIAL_ID = 2  # <|im_end|> in SmolLM2's vocabulary (the tiny model's tokenizer)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from tiny_server(tiny_model_dir, tmp_path_factory.mktemp("prompts") / "server.log", 16)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30.0) as c:
        yield c


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf_model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """[P, V] fp32 log_softmax of HF's logits: row p scores token p + 1."""
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


def tokenize(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def steps_and_rows(http: httpx.Client) -> tuple[float, float]:
    text = metrics_text(http)
    return metric(text, "cobatch:batch_size_count"), metric(text, "cobatch:batch_size_sum")


# ---- prompt lists ---------------------------------------------------------------------------------

def test_four_prompt_forms_give_the_single_prompt_answers(client: openai.OpenAI, http: httpx.Client) -> None:
    single = [client.completions.create(prompt=p, **GREEDY).choices[0].text for p in PROMPTS]
    ids = [tokenize(http, p) for p in PROMPTS]
    assert client.completions.create(prompt=ids[0], **GREEDY).choices[0].text == single[0]
    for prompt in (PROMPTS, ids):
        out = client.completions.create(prompt=prompt, **GREEDY)
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert [c.text for c in out.choices] == single
        assert out.usage.prompt_tokens == sum(map(len, ids))
        assert out.usage.completion_tokens == 3 * 5
        assert out.usage.total_tokens == sum(map(len, ids)) + 15


def test_a_list_joins_one_batch(client: openai.OpenAI, http: httpx.Client) -> None:
    wait_idle(http)
    steps, rows = steps_and_rows(http)
    client.completions.create(prompt=PROMPTS + ["Four"], **{**GREEDY, "max_tokens": 8})
    new_steps, new_rows = steps_and_rows(http)
    assert (new_rows - rows) / (new_steps - steps) > 3  # four rows in (almost) every step


def test_n_choices_are_indexed_prompt_then_sample(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", max_tokens=6, temperature=1.0, seed=7, n=2, extra_body={"ignore_eos": True})
    both = client.completions.create(prompt=PROMPTS[:2], **kwargs)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(PROMPTS[:2]):  # seeded: the same samples whatever shares the batch
        alone = client.completions.create(prompt=prompt, **kwargs)
        assert [c.text for c in both.choices[2 * i:2 * i + 2]] == [c.text for c in alone.choices]
    assert both.usage.completion_tokens == 4 * 6


def test_streamed_list_matches_non_stream_per_index(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt=PROMPTS, max_tokens=6, temperature=0, n=2,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    assert sorted(texts) == list(range(6)) and finishes == {i: ["length"] for i in range(6)}
    assert [texts[i] for i in range(6)] == [c.text for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


BAD_LISTS = [
    ("empty_string", ["fine", ""], "prompt 1 of 2"),
    ("empty_token_list", [[5, 6], []], "prompt 1 of 2"),
    ("token_out_of_range", [[5, 6], [7], [8, 10_000_000]], "prompt 2 of 3"),
    ("too_long", ["fine", "word " * 300], "prompt 1 of 2"),
    ("empty_list", [], "empty"),
]


@pytest.mark.parametrize("prompt,named", [b[1:] for b in BAD_LISTS], ids=[b[0] for b in BAD_LISTS])
def test_one_bad_prompt_fails_the_list_before_anything_runs(http: httpx.Client, prompt: list,
                                                            named: str) -> None:
    wait_idle(http)
    before = steps_and_rows(http)
    response = http.post(COMPLETIONS, json={"model": "tiny", "prompt": prompt, "max_tokens": 4})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert named in error["message"] and error["param"] in ("prompt", "max_tokens")
    assert set(error) == {"message", "type", "param", "code"}
    assert steps_and_rows(http) == before  # no step ran: nothing was submitted


def test_client_disconnect_aborts_every_prompt(http: httpx.Client) -> None:
    aborted = num_aborted(http)
    body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with slow_steps(http):
        with http.stream("POST", COMPLETIONS, json=body) as response:
            lines = response.iter_lines()
            for _ in range(4):
                next(line for line in lines if line.startswith("data: "))
        wait_idle(http, timeout_s=2.0)  # every sequence aborted, every KV block free
    assert num_aborted(http) == aborted + len(PROMPTS)


# ---- logprobs ------------------------------------------------------------------------------------

def test_echo_with_logprobs_returns_the_prompt_scored_like_hf(client: openai.OpenAI, http: httpx.Client,
                                                              hf_tiny: torch.nn.Module) -> None:
    prompt = PROMPTS[0]
    ids = tokenize(http, prompt)
    out = client.completions.create(prompt=prompt, echo=True, logprobs=2, **{**GREEDY, "max_tokens": 3})
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[len(ids)] == len(prompt)
    reference = hf_logprobs(hf_tiny, ids)
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(float(reference[p - 1, ids[p]]), abs=2e-4)
        top = lp.top_logprobs[p]
        assert lp.tokens[p] in top and 2 <= len(top) <= 3  # the top 2, and the prompt's own token
        assert max(top.values()) == pytest.approx(float(reference[p - 1].max()), abs=2e-4)
    streamed = list(client.completions.create(prompt=prompt, echo=True, logprobs=2, stream=True,
                                              **{**GREEDY, "max_tokens": 3}))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [v for c in streamed for v in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs


def test_echo_of_a_token_list_and_n2(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = [tokenize(http, p) for p in PROMPTS[:2]]
    out = client.completions.create(prompt=ids, echo=True, logprobs=0, n=2, **{**GREEDY, "max_tokens": 2})
    assert len(out.choices) == 4
    for choice in out.choices:
        prompt_ids = ids[choice.index // 2]
        assert choice.text.startswith(PROMPTS[choice.index // 2])
        assert len(choice.logprobs.tokens) == len(prompt_ids) + 2
        assert choice.logprobs.token_logprobs[0] is None
        assert all(v is not None for v in choice.logprobs.token_logprobs[1:])


def test_logprobs_zero_gives_the_sampled_token_per_position(client: openai.OpenAI) -> None:
    out = client.completions.create(prompt="Hi", logprobs=0, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == {token: value} and value <= 0.0
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=0,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(e.top_logprobs == [] and e.logprob <= 0.0 for e in content)


def test_vllm_prompt_logprobs_field(http: httpx.Client, hf_tiny: torch.nn.Module) -> None:
    ids = tokenize(http, PROMPTS[2])
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 2, "temperature": 0, "n": 2,
            "prompt_logprobs": 3}
    response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    reference = hf_logprobs(hf_tiny, ids)
    for choice in response.json()["choices"]:
        assert choice["logprobs"] is None  # only the prompt's were asked for
        entries = choice["prompt_logprobs"]
        assert len(entries) == len(ids) and entries[0] is None
        for p, entry in enumerate(entries[1:], start=1):
            own = entry[str(ids[p])]
            assert own["logprob"] == pytest.approx(float(reference[p - 1, ids[p]]), abs=2e-4)
            assert own["rank"] == int((reference[p - 1] > reference[p - 1, ids[p]]).sum()) + 1
            top_ids = reference[p - 1].topk(3).indices.tolist()
            assert [entry[str(t)]["rank"] for t in top_ids] == [1, 2, 3]
            assert set(entry) == {str(t) for t in top_ids} | {str(ids[p])}
            assert all(isinstance(e["decoded_token"], str) for e in entry.values())
    streamed = http.post(COMPLETIONS, json={**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_in_logprobs_follow_skip_special_tokens(http: httpx.Client, skip: bool) -> None:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "logit_bias": {str(SPECIAL_ID): 100}, "skip_special_tokens": skip}
    choice = http.post(COMPLETIONS, json=body).json()["choices"][0]
    expected = "" if skip else "<|im_end|>"
    assert choice["logprobs"]["tokens"] == [expected] * 3 and choice["text"] == expected * 3
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    chat_body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                 "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 1,
                 "logit_bias": {str(SPECIAL_ID): 100}, "skip_special_tokens": skip}
    message = http.post("/v1/chat/completions", json=chat_body).json()["choices"][0]
    assert [e["token"] for e in message["logprobs"]["content"]] == [expected] * 2
    assert message["message"]["content"] == expected * 2
    streamed = http.post(COMPLETIONS, json={**body, "stream": True})
    events = [json.loads(e) for e in sse_events(streamed)[:-1]]
    assert [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]] == [expected] * 3
