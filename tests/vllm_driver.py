"""Runs request batches on one vLLM engine (stock or ODA) and prints the results as JSON.

Run by `run_vllm` in tests/vllm_harness.py with the vLLM environment's Python (vLLM pins an older transformers than oda_hf's
own environment, see README): ``python vllm_driver.py spec.json out.json``. Spec: ``{"engine": {...}, "oda": {...}
or null, "batches": [[{"prompt": [ids], "max_tokens": n, "extra_args": {...}, "logprobs": k, "ignore_eos": bool (default true),
"sampling": {"temperature": t, "top_p": p, "seed": s, "n": n} (default greedy), "lora": [name, id, folder] (default
none)}, ...], ...]}``. Instead of "prompt", "prompt_parts" joins token lists and ``{"output_of": [batch, row]}``,
an earlier batch's output tokens on this engine (a request that extends an earlier one's prompt and output). Each
batch is one ``LLM.generate`` call; a batch that fails (e.g. a bad request) records its error and the next batch runs
on the same engine. ``"one_process": true`` runs the engine core and its worker inside this process (vLLM's
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor): the same scheduler, runner and model, without the two
process starts (about 50 s of each engine's 100 s on a 2-core machine).

``"sessions": [[{"prompt": [ids], "max_tokens": n, "extra_args": {...}}, ...], ...]`` instead of "batches": streaming-
input sessions (vLLM's `StreamingInput`: one request id, turn after turn; greedy, logprobs 1, ignore_eos), all at once
on an `AsyncLLM`, with each session's tokens, logprobs and routing record.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    engine = dict(spec["engine"])
    if spec.get("one_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # read when the engine starts; set before vLLM loads
        engine["distributed_executor_backend"] = "uni"

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from oda_hf.vllm import engine_args, routing_stats

    if spec.get("oda") is not None:
        engine = engine_args(engine.pop("model"), **spec["oda"], **engine)
    if "sessions" in spec:
        import asyncio

        results = asyncio.run(run_sessions(engine, spec["sessions"], spec.get("oda") is not None))
        with open(out_path, "w") as f:
            json.dump(results, f)
        return
    llm = LLM(**engine)
    results = []
    for batch in spec["batches"]:
        params = [SamplingParams(max_tokens=req["max_tokens"], logprobs=req.get("logprobs"),
                                 ignore_eos=req.get("ignore_eos", True), extra_args=req.get("extra_args"),
                                 **(req.get("sampling") or {"temperature": 0.0}))
                  for req in batch]
        try:
            loras = [LoRARequest(*req["lora"]) if req.get("lora") else None for req in batch]
            outputs = llm.generate([{"prompt_token_ids": prompt_of(req, results)} for req in batch], params,
                                   use_tqdm=False, lora_request=loras if any(loras) else None)
        except Exception as err:  # a rejected request: recorded, and the engine must go on serving
            results.append({"error": f"{type(err).__name__}: {err}"})
            continue
        routing = routing_stats(llm, outputs)["requests"] if spec.get("oda") is not None else {}
        rows = []
        for out in outputs:
            completion = out.outputs[0]
            logprobs = None
            if completion.logprobs is not None:
                logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
            rows.append({"tokens": list(completion.token_ids), "logprobs": logprobs,
                         "num_cached_tokens": out.num_cached_tokens,
                         "routing": routing.get(out.request_id),
                         # every sample of an n > 1 request, and its routing record (vLLM ids it <k>_<id>)
                         "samples": [list(c.token_ids) for c in out.outputs],
                         "sample_routing": [routing.get(f"{k}_{out.request_id}") for k in range(len(out.outputs))]})
        results.append({"outputs": rows})
    with open(out_path, "w") as f:
        json.dump(results, f)


async def run_sessions(engine: dict, sessions: list, oda: bool) -> dict:
    import asyncio

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from oda_hf.vllm import external_request_id

    def params(turn):
        return SamplingParams(max_tokens=turn["max_tokens"], temperature=0.0, ignore_eos=True, logprobs=1,
                              extra_args=turn.get("extra_args"), output_kind=RequestOutputKind.DELTA)

    async def session(turns, request_id):
        async def inputs():
            for turn in turns:
                # a copy: vLLM 0.32's front end appends later turns' prompts to the first turn's list in place
                ids = list(turn["prompt"])
                yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=ids), sampling_params=params(turn))

        tokens, logprobs = [], []
        async for out in llm.generate(inputs(), params(turns[0]), request_id=request_id):
            completion = out.outputs[0]
            tokens += completion.token_ids
            logprobs += [step[token].logprob for step, token in zip(completion.logprobs or [], completion.token_ids)]
        return {"tokens": tokens, "logprobs": logprobs}

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine))
    try:
        rows = await asyncio.gather(*(session(turns, f"session-{i}") for i, turns in enumerate(sessions)))
        records = (await llm.collective_rpc("oda_routing_stats"))[0]["requests"] if oda else {}
    finally:
        llm.shutdown()
    records = {external_request_id(rid): record for rid, record in records.items()}
    for i, row in enumerate(rows):
        row["routing"] = records.get(f"session-{i}")
    return rows


def prompt_of(req: dict, results: list) -> list:
    if "prompt_parts" not in req:
        return req["prompt"]
    ids = []
    for part in req["prompt_parts"]:
        if isinstance(part, dict):
            batch, row = part["output_of"]
            part = results[batch]["outputs"][row]["tokens"]
        ids += part
    return ids


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
