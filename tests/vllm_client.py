"""Talks to a running `oda serve` through the official openai client; prints what it saw as JSON.

Run by tests/test_vllm_plugin.py (the OpenAI server test) with the vLLM environment's Python: ``python vllm_client.py PORT MODEL IDS_JSON``.
The server runs with ``--api-key secret --root-path /api --allowed-origins '["http://example.com"]'
--enable-request-id-headers``: every request here carries the key unless it checks that one without it is refused.
"""

import json
import sys
import urllib.error
import urllib.request


API_KEY = "secret"


def call(url: str, body: dict | None = None, headers: dict | None = None, key: str | None = API_KEY) -> list:
    """[status, JSON answer, response headers] of a GET (`body` None) or a JSON POST."""
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    if body is not None:
        headers.setdefault("Content-Type", "application/json")
    request = urllib.request.Request(url, method="GET" if body is None else "POST", headers=headers,
                                     data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request) as response:
            return [response.status, json.load(response), dict(response.headers.items())]
    except urllib.error.HTTPError as err:
        return [err.code, json.load(err), dict(err.headers.items())]


def urlopen(url: str):
    return urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {API_KEY}"}))


def main(port: int, model: str, ids: list) -> None:
    import openai

    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY)
    seen = {}
    plain = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0,
                                      extra_body={"vllm_xargs": {"oda_policy": "local"}})
    seen["completion"] = {"text": plain.choices[0].text, "routing": plain.model_extra.get("oda_routing")}
    text, stream_id = "", None
    for chunk in client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0, stream=True,
                                           extra_body={"vllm_xargs": {"oda_policy": "local"}}):
        stream_id = chunk.id
        text += chunk.choices[0].text if chunk.choices else ""
    with urlopen(f"{base}/v1/oda/routing?request_id={stream_id}") as response:
        seen["stream"] = {"text": text, "routing": json.load(response)}
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": " ".join(f"w{i}" for i in ids)}], max_tokens=6,
        temperature=0, extra_body={"vllm_xargs": {"oda_policy": "schedule:1:2"}})
    seen["chat"] = {"text": chat.choices[0].message.content, "routing": chat.model_extra.get("oda_routing")}
    # Two prompts, two samples each: four engine requests (<k>_<id>-<i>), one routing record each.
    sampled = client.completions.create(model=model, prompt=[ids, ids[:-1]], max_tokens=6, temperature=0.8, seed=3,
                                        n=2, extra_body={"vllm_xargs": {"oda_policy": "schedule:1:2"}})
    seen["sampled"] = {"choices": len(sampled.choices), "routing": sampled.model_extra.get("oda_routing")}
    for name, xargs in {"bad_policy": {"oda_policy": "sometimes"}, "bad_threshold": {"oda_threshold": "high"}}.items():
        try:
            client.completions.create(model=model, prompt=ids, max_tokens=4, extra_body={"vllm_xargs": xargs})
            seen[name] = None
        except openai.BadRequestError as err:
            seen[name] = str(err)
    for name, body in {"top_level": {"oda_policy": "local"}, "beam": {"use_beam_search": True, "n": 2}}.items():
        try:
            client.completions.create(model=model, prompt=ids, max_tokens=4, extra_body=body)
            seen[name] = None
        except openai.BadRequestError as err:
            seen[name] = str(err)
    # vLLM's other generation paths ignore unknown top-level fields too
    status, answer, _ = call(f"{base}/v1/responses", {"model": model, "input": "hi", "oda_policy": "local"})
    seen["responses_top_level"] = [status, answer["error"]["message"]] if status != 200 else status
    # a stop string is matched outside the engine, which runs on meanwhile: the record counts returned tokens only
    stop = " " + seen["completion"]["text"].split()[4]
    stopped = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0, stop=[stop],
                                        extra_body={"vllm_xargs": {"oda_policy": "local"}})
    with urlopen(f"{base}/v1/oda/routing?request_id={stopped.id}") as response:
        listed = json.load(response)
    seen["stopped"] = {"finish_reason": stopped.choices[0].finish_reason, "tokens": stopped.usage.completion_tokens,
                       "routing": stopped.model_extra.get("oda_routing"), "listed": listed}
    # two prompts, two choices: the response's usage sums them, so only the front end's own count trims each record
    both = client.completions.create(model=model, prompt=[ids, ids], max_tokens=10, temperature=0, stop=[stop],
                                     extra_body={"vllm_xargs": {"oda_policy": "local"}})
    seen["stopped_n2"] = {"finish_reasons": [c.finish_reason for c in both.choices],
                          "tokens": both.usage.completion_tokens, "routing": both.model_extra.get("oda_routing")}
    after = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0,
                                      extra_body={"vllm_xargs": {"oda_policy": "local"}})
    seen["after_bad"] = after.choices[0].text
    # callers' ids that look like a part of another response (a chat's "<id>_<i>", a completion's "<id>-<i>"): each
    # response holds its own engine requests only
    for caller, policy, tokens in [("job_1", "local", 5), ("job", "full", 8), ("job", "schedule:1:2", 6)]:
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": " ".join(f"w{i}" for i in ids)}], max_tokens=tokens,
            temperature=0, extra_headers={"X-Request-Id": caller},
            extra_body={"ignore_eos": True, "vllm_xargs": {"oda_policy": policy}})
        seen[f"chat_{caller}" + ("_again" if f"chat_{caller}" in seen else "")] = chat.model_extra.get("oda_routing")
    for caller, prompts, policy, tokens in [("batch", [ids, ids], "local", 6), ("batch-1", [ids], "full", 4)]:
        completion = client.completions.create(
            model=model, prompt=prompts, max_tokens=tokens, temperature=0, extra_headers={"X-Request-Id": caller},
            extra_body={"ignore_eos": True, "vllm_xargs": {"oda_policy": policy}})
        seen[f"completion_{caller}"] = completion.model_extra.get("oda_routing")
    with urlopen(f"{base}/v1/oda/routing") as response:
        seen["every_record"] = json.load(response)
    # the Responses API passes a body's request_id to the engine as it is: "<k>_<id>" would read as a sample
    status, answer, _ = call(f"{base}/v1/responses", {"model": model, "input": "hi", "request_id": "7_foo",
                                                      "vllm_xargs": {"oda_policy": "random:0.5:3"}})
    seen["responses_sample_id"] = [status, answer["error"]["message"]] if status != 200 else status
    with urlopen(f"{base}/metrics") as response:
        seen["metrics"] = [line for line in response.read().decode().splitlines() if line.startswith("oda_")]
    # vLLM's batch chat endpoint (one choice and engine request "<id>_<i>" per conversation): a misplaced key is
    # refused as on the others, and the response carries its conversations' records
    words = " ".join(f"w{i}" for i in ids)
    for name, extra in {"batch_top_level": {"oda_policy": "full"},
                        "batch_chat": {"vllm_xargs": {"oda_policy": "schedule:1:2"}}}.items():
        status, answer, _ = call(f"{base}/v1/chat/completions/batch", {
            "model": model, "messages": [[{"role": "user", "content": words}],
                                         [{"role": "user", "content": words[: len(words) // 2]}]],
            "max_tokens": 5, "temperature": 0, "ignore_eos": True, **extra})
        seen[name] = ([status, len(answer["choices"]), answer.get("oda_routing")] if status == 200
                      else [status, answer["error"]["message"]])
    # ODA's own answers go through vLLM's middlewares (ODA's runs outside them): the API key guards the routing
    # records and ODA's refusals, and CORS / X-Request-Id headers reach every response
    # (vLLM reads a media type in any case; its API key does not guard /invocations: nor does ODA's refusal there)
    seen["content_type_case"] = call(f"{base}/v1/completions", {"model": model, "prompt": ids, "oda_policy": "local"},
                                     {"Content-Type": "Application/JSON; charset=utf-8"})[0]
    seen["unguarded_refusal"] = call(f"{base}/invocations", {"model": model, "prompt": ids, "oda_policy": "local"},
                                     key=None)[0]
    seen["unauthorized"] = [call(f"{base}/v1/oda/routing", key=None)[0],
                            call(f"{base}/v1/oda/routing?request_id={stopped.id}", key=None)[0],
                            call(f"{base}/v1/completions", {"model": model, "prompt": ids, "oda_policy": "local"},
                                 key=None)[0]]
    plain_body = {"model": model, "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                  "vllm_xargs": {"oda_policy": "local"}}
    cors = {"Origin": "http://example.com", "X-Request-Id": "hdrcheck"}
    seen["headers"] = {name: [answer[0], answer[2].get("access-control-allow-origin"), answer[2].get("x-request-id")]
                       for name, answer in {"completion": call(f"{base}/v1/completions", plain_body, cors),
                                            "refusal": call(f"{base}/v1/completions", {**plain_body, "n": 2,
                                                            "use_beam_search": True}, cors),
                                            "routing": call(f"{base}/v1/oda/routing", headers=cors)}.items()}
    # SageMaker's /invocations serves completion and chat bodies: the same refusals and records
    messages = [{"role": "user", "content": words}]
    seen["invocations"] = {name: call(f"{base}/invocations", body)[:2] for name, body in {
        "top_level": {"model": model, "prompt": ids, "max_tokens": 4, "oda_policy": "local"},
        "beam": {**plain_body, "use_beam_search": True, "n": 2},
        "completion": plain_body,
        "chat": {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                 "vllm_xargs": {"oda_policy": "full"}},
        # messages the chat handler cannot read: vLLM serves the prompt as a completion
        "fallback": {**plain_body, "messages": "not-a-list"}}.items()}
    # under --root-path: the same records and refusals
    prefixed = call(f"{base}/api/v1/completions", plain_body)
    seen["root_path"] = [prefixed[1].get("oda_routing"),
                         call(f"{base}/api/v1/oda/routing?request_id={prefixed[1]['id']}")[:2],
                         call(f"{base}/api/v1/completions", {**plain_body, "oda_policy": "full"})[0]]
    # the Responses API names its engine request "<id>_0": found by the response's id
    response = call(f"{base}/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 4,
                                             "vllm_xargs": {"oda_policy": "local"}})
    seen["responses_by_id"] = [response[0], call(f"{base}/v1/oda/routing?request_id={response[1]['id']}")[:2]]
    # ... also under a request_id of the caller's, which vLLM takes as given (a GET by it answered 404)
    response = call(f"{base}/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 4,
                                             "request_id": "myresp-x", "vllm_xargs": {"oda_policy": "local"}})
    seen["responses_by_own_id"] = [response[0], response[1].get("id"),
                                   call(f"{base}/v1/oda/routing?request_id=myresp-x")[:2]]
    print(json.dumps(seen))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]))
