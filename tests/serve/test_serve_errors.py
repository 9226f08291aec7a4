"""Error answers in the OpenAI shape: 400 (bad parameters, validation remapped from 422), 401, 404, 503, and
an error during a stream as a `data: {"error": ...}` event."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from serve_helpers import running_server


def assert_error(response: httpx.Response, status: int, kind: str, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == kind and error["message"]
    if param is not None:
        assert error["param"] == param
    return str(error["message"])


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),  # FastAPI's 422, remapped
        ({"temperature": "hot"}, "temperature", "number"),
        ({"seed": -3}, "seed", "seed must be an integer in [0, 2**64)"),  # refused by SamplingParams
        ({"max_tokens": 100000}, None, "exceeds the scheduler's max_seq_len"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"extra": 1, "loops": 0}, "loops", "loops"),
        ({"regex": "(unclosed"}, "regex", ""),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
        ({"prompt": [1, 999]}, "prompt", "[0, 256)"),
    ],
)
def test_invalid_parameters_are_400(base_url: str, body: dict[str, object], param: str | None, says: str) -> None:
    request = {"model": "tiny", "prompt": "a", "max_tokens": 2, **body}
    message = assert_error(httpx.post(f"{base_url}/v1/completions", json=request), 400, "invalid_request_error", param)
    assert says in message


def test_malformed_json_and_unknown_model_and_route(base_url: str) -> None:
    json_type = {"content-type": "application/json"}
    bad = httpx.post(f"{base_url}/v1/chat/completions", content=b"{not json", headers=json_type)
    assert_error(bad, 400, "invalid_request_error")
    unknown = httpx.post(f"{base_url}/v1/completions", json={"model": "gpt-9", "prompt": "a"})
    assert "gpt-9" in assert_error(unknown, 404, "not_found_error", "model")
    assert_error(httpx.get(f"{base_url}/v1/nothing"), 404, "not_found_error")


def test_openai_client_raises_its_typed_errors(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="a", max_tokens=2, temperature=9)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "a"}])


def test_an_error_during_a_stream_is_an_event(base_url: str) -> None:
    # tiny has no exit gate: Ouro's exit rule is refused when the request starts, after the stream has begun
    body = {"model": "tiny", "prompt": "a", "max_tokens": 3, "stream": True, "exit_threshold": 0.5}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "invalid_request_error" and "gate" in error["message"]
    whole = httpx.post(f"{base_url}/v1/completions", json=dict(body, stream=False), timeout=60)
    assert "gate" in assert_error(whole, 400, "invalid_request_error")
    gate = dict(body, stream=False, exit_threshold=None, exit_criterion="gate")  # refused at submission
    assert "gate" in assert_error(httpx.post(f"{base_url}/v1/completions", json=gate), 400, "invalid_request_error")


def test_wrong_api_key_is_401_and_a_full_queue_503(tiny_model) -> None:
    with running_server(tiny_model, api_key="secret", max_batch=1, max_queue=1) as url:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
        assert_error(httpx.post(f"{url}/v1/completions", json=body), 401, "authentication_error")
        wrong = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert_error(wrong, 401, "authentication_error")
        auth = {"Authorization": "Bearer secret"}
        assert httpx.get(f"{url}/v1/models", headers=auth).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key

        long = dict(body, max_tokens=300, stream=True)
        first_tokens = threading.Barrier(2)

        def hold() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=long, headers=auth, timeout=60) as r:
                lines = r.iter_lines()  # held: a dropped iterator closes the connection
                next(line for line in lines if line.startswith("data: "))
                first_tokens.wait(30)
                first_tokens.wait(30)  # the slot stays busy until the test is done

        holder = threading.Thread(target=hold)
        holder.start()
        first_tokens.wait(30)  # one request running
        with httpx.stream("POST", f"{url}/v1/completions", json=long, headers=auth, timeout=60) as queued:
            assert queued.status_code == 200  # waits in the queue (its one place)
            full = httpx.post(f"{url}/v1/completions", json=body, headers=auth)
            assert "queue" in assert_error(full, 503, "service_unavailable_error")
        first_tokens.wait(30)
        holder.join(30)
