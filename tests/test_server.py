"""The OpenAI-compatible server, end to end: a real server process, the official client and httpx."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_process import ServerProcess, metric

API_KEY = "sk-test-do-not-log-7f3a"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess(tiny_model_dir, log, "--max-num-seqs", "8", "--num-kv-blocks", "64",
                         "--max-model-len", "256", "--served-model-name", "tiny",
                         "--api-key", API_KEY, "--enable-fault-injection", "--max-body-mb", "1")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30.0,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def sse_events(response: httpx.Response) -> list[str]:
    """The data payloads of an SSE response, in order ([DONE] included)."""
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def metrics_text(http: httpx.Client) -> str:
    return http.get("/metrics").text


def wait_idle(http: httpx.Client, timeout_s: float = 5.0) -> str:
    """Poll /metrics until nothing runs or waits and the KV cache is empty; return the text."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = metrics_text(http)
        busy = (metric(text, "cobatch:num_requests_running"),
                metric(text, "cobatch:num_requests_waiting"), metric(text, "cobatch:kv_cache_usage_perc"))
        if busy == (0.0, 0.0, 0.0) or time.monotonic() > deadline:
            assert busy == (0.0, 0.0, 0.0), f"engine still busy: running, waiting, kv = {busy}"
            return text
        time.sleep(0.05)


@contextmanager
def slow_steps(http: httpx.Client, seconds: float = 0.02) -> Iterator[None]:
    """Every engine step sleeps `seconds` (the tiny model would finish anything in milliseconds)."""
    http.post("/debug/fault", json={"kind": "stall", "seconds": seconds, "num_steps": 100_000})
    try:
        yield
    finally:
        http.post("/debug/fault", json={"kind": "clear"})


def num_aborted(http: httpx.Client) -> float:
    match = re.search(r'^cobatch:request_success_total{[^}]*finished_reason="abort"[^}]*} (\S+)$',
                      metrics_text(http), re.MULTILINE)
    return float(match.group(1)) if match else 0.0


# ---- basics --------------------------------------------------------------------------------------

def test_models_health_and_openapi(client: openai.OpenAI, http: httpx.Client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert http.get("/health").status_code == 200
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= set(paths)


def test_completion_usage_counts_tokens(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "The quick brown fox"
    num_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0,
                                    extra_body=NO_EOS)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == num_prompt
    assert out.usage.completion_tokens == 7 and out.usage.total_tokens == num_prompt + 7


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client: openai.OpenAI) -> None:
    prompt = [11 + i % 50 for i in range(37)]  # token ids: 37 tokens, ending inside a block
    first, again = (client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                              extra_body=NO_EOS) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 36  # all but the last, computed for its logits
    assert again.choices[0].text == first.choices[0].text


def test_completion_token_prompt_and_echo(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(model="tiny", prompt="Hello there", max_tokens=4,
                                        temperature=0, echo=True)
    assert by_text.choices[0].text == "Hello there" + by_ids.choices[0].text


def test_chat_non_stream(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi!"}],
        max_completion_tokens=5, temperature=0, extra_body=NO_EOS, user="alice")
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens > 5


def test_chat_stream_shape(http: httpx.Client) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count to ten"}],
            "max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    finishes = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert [f["finish_reason"] for f in finishes] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_stream_text_equals_non_stream(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
                  extra_body=NO_EOS)
    whole = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs)
              if c.choices]
    assert "".join(pieces) == whole


def test_n2_and_seed_reproducibility(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Tell a story"}],
                  max_tokens=8, temperature=1.0, n=2, extra_body=NO_EOS)
    first = client.chat.completions.create(seed=1234, **kwargs)
    again = client.chat.completions.create(seed=1234, **kwargs)
    other = client.chat.completions.create(seed=999, **kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert first.usage.completion_tokens == 16
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert texts != [c.message.content for c in other.choices]


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0.0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    # greedy: the sampled token is the most likely one
    assert all(e.token == e.top_logprobs[0].token for e in content)


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0,
                                    logprobs=2, extra_body=NO_EOS)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == out.choices[0].text


def test_stop_string_trims_and_never_leaks(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="The weather today", max_tokens=20, temperature=0,
                  extra_body=NO_EOS)
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[5:12]  # spans token boundaries, somewhere in the middle
    cut = text[:text.index(stop)]
    out = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert (out.text, out.finish_reason) == (cut, "stop")
    streamed = list(client.completions.create(stop=[stop], stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "stop"


def test_tokenize_detokenize_roundtrip(http: httpx.Client) -> None:
    tokens = http.post("/tokenize", json={"prompt": "round trip"}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "round trip"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > 3 and chat["max_model_len"] == 256


# ---- errors --------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

BAD_REQUESTS = [
    ("invalid_json", COMPLETIONS, b'{"prompt": "x", ', 400),
    ("nan", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400),
    ("infinity", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', 400),
    ("wrong_type", COMPLETIONS, {"prompt": "x", "max_tokens": "ten"}, 400),
    ("unknown_field", CHAT, {"messages": MSG, "frobnicate": True}, 400),
    ("unsupported_tools", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400),
    ("temperature_range", CHAT, {"messages": MSG, "temperature": 3.5}, 400),
    ("n_zero", COMPLETIONS, {"prompt": "x", "n": 0}, 400),
    ("too_long", COMPLETIONS, {"prompt": "x", "max_tokens": 400}, 400),
    ("too_long_stream", CHAT, {"messages": MSG, "max_tokens": 300, "stream": True}, 400),
    ("oov_prompt", COMPLETIONS, {"prompt": [1, 2, 10_000_000]}, 400),
    ("negative_token", COMPLETIONS, {"prompt": [-1]}, 400),
    ("empty_stop", COMPLETIONS, {"prompt": "x", "stop": [""]}, 400),
    ("bad_logit_bias_key", COMPLETIONS, {"prompt": "x", "logit_bias": {"abc": 1.0}}, 400),
    ("oov_logit_bias", COMPLETIONS, {"prompt": "x", "logit_bias": {"99999999": 1.0}}, 400),
    ("logit_bias_range", COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 500.0}}, 400),
    ("batched_prompt_empty", COMPLETIONS, {"prompt": ["a", ""]}, 400),
    ("empty_messages", CHAT, {"messages": []}, 400),
    ("empty_prompt", COMPLETIONS, {"prompt": ""}, 400),
    ("image_part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400),
    ("unknown_model", CHAT, {"model": "gpt-9", "messages": MSG}, 404),
]


@pytest.mark.parametrize("path,body,status", [b[1:] for b in BAD_REQUESTS],
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(http: httpx.Client, path: str, body: object,
                                        status: int) -> None:
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_missing_api_key_is_401(server: ServerProcess) -> None:
    response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong",
                      max_retries=0).models.list()


def test_huge_body_is_refused_quickly(http: httpx.Client) -> None:
    start = time.monotonic()
    response = http.post(COMPLETIONS, content=b"x" * (4 * 1024 * 1024),
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["message"]
    assert time.monotonic() - start < 2.0


# ---- engine behaviour through the server --------------------------------------------------------

def _batch_counts(http: httpx.Client) -> tuple[float, float]:
    text = metrics_text(http)
    return metric(text, "cobatch:batch_size_sum"), metric(text, "cobatch:batch_size_count")


def test_request_joins_while_another_generates(http: httpx.Client, client: openai.OpenAI) -> None:
    wait_idle(http)
    rows_before, steps_before = _batch_counts(http)
    long_body = {"prompt": "A long story", "max_tokens": 60, "temperature": 0, "stream": True,
                 "ignore_eos": True}
    with slow_steps(http), http.stream("POST", COMPLETIONS, json=long_body) as long_stream:
        lines = long_stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the long one is generating
        short = client.completions.create(model="tiny", prompt="Short", max_tokens=3,
                                          extra_body=NO_EOS)
        assert short.choices[0].finish_reason == "length"
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"  # the long one finished after the short one
    rows, steps = _batch_counts(http)
    assert rows - rows_before > steps - steps_before  # some step ran both rows together


def test_stream_disconnect_frees_everything(http: httpx.Client) -> None:
    aborted = num_aborted(http)
    body = {"prompt": "Disconnect me", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with slow_steps(http):
        with http.stream("POST", COMPLETIONS, json=body) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(line for line in lines if line.startswith("data: "))
        wait_idle(http, timeout_s=1.0)  # a few steps of 20 ms: the abort landed within one
    assert num_aborted(http) == aborted + 1


def test_non_stream_disconnect_frees_everything(server: ServerProcess, http: httpx.Client) -> None:
    aborted = num_aborted(http)
    body = {"prompt": "Time me out", "max_tokens": 200, "ignore_eos": True}
    with slow_steps(http):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base_url}{COMPLETIONS}", json=body, timeout=0.5,
                       headers={"Authorization": f"Bearer {API_KEY}"})
        wait_idle(http, timeout_s=1.0)
    assert num_aborted(http) == aborted + 1


def test_step_failure_is_500_or_sse_error_and_server_goes_on(http: httpx.Client,
                                                             client: openai.OpenAI) -> None:
    assert http.post("/debug/fault", json={"kind": "step_error"}).status_code == 200
    response = http.post(COMPLETIONS, json={"prompt": "fail me", "max_tokens": 4})
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    http.post("/debug/fault", json={"kind": "step_error"})
    body = {"prompt": "fail me too", "max_tokens": 4, "stream": True}
    with http.stream("POST", COMPLETIONS, json=body) as stream:
        events = sse_events(stream)
    assert "error" in json.loads(events[-2]) and events[-1] == "[DONE]"
    assert client.completions.create(model="tiny", prompt="still here", max_tokens=2).choices
    assert http.get("/health").status_code == 200
    wait_idle(http)


def test_metrics_names(http: httpx.Client) -> None:
    text = metrics_text(http)
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped",
                 "kv_cache_usage_perc", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "request_time_per_output_token_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                 "iteration_tokens_total_bucket", "batch_size_bucket", "step_time_seconds",
                 "step_time_predicted_seconds", "prefix_cache_hit_rate"):
        assert f"cobatch:{name}" in text, name
    assert metric(text, "cobatch:generation_tokens_total") > 0


def test_logs_escape_control_characters_and_hide_the_key(client: openai.OpenAI,
                                                         server: ServerProcess) -> None:
    client.completions.create(model="tiny", prompt="x", max_tokens=1,
                              user="mallory\nINFO forged line\r\x1b[31m")
    log = server.log()
    assert "mallory\\nINFO forged line" in log
    assert "\nINFO forged line" not in log and "\x1b[31m" not in log
    assert API_KEY not in log
