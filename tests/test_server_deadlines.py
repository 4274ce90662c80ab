"""Deadlines through a real `cobatch serve` and the official openai client: body field and header, a
request ended at its deadline, one refused at once (429 deadline_unreachable), the metrics."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_process import ServerProcess, metric, tiny_server
from tests.test_server import metrics_text, slow_steps, wait_idle

NO_EOS = {"ignore_eos": True}
HEADER = "x-cobatch-deadline-ms"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from tiny_server(tiny_model_dir, tmp_path_factory.mktemp("deadlines") / "server.log", 2)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def http(server: ServerProcess, client: openai.OpenAI) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30.0) as c:
        # Enough steps for the engine's step-time model to be fitted (it predicts 0 before).
        for _ in range(4):
            client.completions.create(model="tiny", prompt="warm up", max_tokens=6, extra_body=NO_EOS)
        yield c


def deadline_counter(text: str, name: str) -> float:
    return metric(text, f"cobatch:{name}_total")


def num_finished(text: str, reason: str) -> float:
    match = re.search(rf'^cobatch:request_success_total{{[^}}]*finished_reason="{reason}"[^}}]*}} (\S+)$',
                      text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_body_deadline_ends_a_long_completion_with_finish_reason_deadline(
        client: openai.OpenAI, http: httpx.Client) -> None:
    before = metrics_text(http)
    with slow_steps(http, 0.02):
        out = client.completions.create(model="tiny", prompt="count", max_tokens=200,
                                        extra_body={**NO_EOS, "deadline_ms": 400})
    choice = out.choices[0]
    assert choice.finish_reason == "deadline"
    assert 0 < out.usage.completion_tokens < 200 and choice.text
    after = wait_idle(http)
    assert deadline_counter(after, "request_deadline_missed") == \
        deadline_counter(before, "request_deadline_missed") + 1
    assert num_finished(after, "deadline") == num_finished(before, "deadline") + 1


def test_the_header_sets_a_deadline_and_the_tighter_of_header_and_body_wins(
        client: openai.OpenAI, http: httpx.Client) -> None:
    with slow_steps(http, 0.02):
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=200, stream=True,
            extra_headers={HEADER: "400"}, extra_body={**NO_EOS, "deadline_ms": 600_000})
        reasons = [c.choices[0].finish_reason for c in stream if c.choices]
    assert reasons[-1] == "deadline" and reasons.count("deadline") == 1
    out = client.completions.create(model="tiny", prompt="x", max_tokens=3, extra_body=NO_EOS,
                                    extra_headers={HEADER: "600000"})
    assert out.choices[0].finish_reason == "length"


def test_a_queued_request_whose_deadline_passes_ends_without_a_token(
        client: openai.OpenAI, http: httpx.Client) -> None:
    with slow_steps(http, 0.02):
        # Both seats (max_num_seqs 2) taken by long streams: the deadline request waits for one.
        hogs = [client.completions.create(model="tiny", prompt="hog", max_tokens=60, stream=True,
                                          extra_body=NO_EOS) for _ in range(2)]
        for hog in hogs:
            next(iter(hog))  # both admitted
        out = client.completions.create(model="tiny", prompt="patient", max_tokens=5,
                                        extra_body={**NO_EOS, "deadline_ms": 150})
        for hog in hogs:
            hog.close()
    assert out.choices[0].finish_reason == "deadline"
    assert out.usage.completion_tokens == 0 and out.choices[0].text == ""
    wait_idle(http)


def test_an_unreachable_deadline_is_refused_at_once_before_any_prefill(
        client: openai.OpenAI, http: httpx.Client) -> None:
    before = metrics_text(http)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="tiny", prompt="too late " * 20, max_tokens=5,
                                  extra_body={"deadline_ms": 0.001})
    error = info.value.body
    assert info.value.status_code == 429
    assert error["code"] == "deadline_unreachable" and error["param"] == "deadline_ms"
    assert "deadline" in error["message"] and "predicted" in error["message"]
    after = metrics_text(http)
    assert deadline_counter(after, "request_deadline_refused") == \
        deadline_counter(before, "request_deadline_refused") + 1
    # It never reached the engine: no prompt token of it was counted, no step ran for it.
    assert metric(after, "cobatch:prompt_tokens_total") == metric(before, "cobatch:prompt_tokens_total")
    assert metric(after, "cobatch:iteration_tokens_total_count") == \
        metric(before, "cobatch:iteration_tokens_total_count")


def test_a_streaming_request_is_refused_with_a_status_too(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", headers={HEADER: "0.001"}, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True})
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "deadline_unreachable"


@pytest.mark.parametrize("header, body", [("0", None), ("-5", None), ("soon", None), ("nan", None),
                                          ("inf", None), (None, 0), (None, -1), (None, "100")])
def test_a_bad_deadline_is_an_openai_shaped_400(http: httpx.Client, header: str | None,
                                                 body: object) -> None:
    payload: dict[str, object] = {"prompt": "x", "max_tokens": 2}
    if body is not None:
        payload["deadline_ms"] = body
    response = http.post("/v1/completions", json=payload, headers={HEADER: header} if header else {})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == (HEADER if header else "deadline_ms")
