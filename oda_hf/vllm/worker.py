"""Workers that build ODA's model runner (`worker_cls` of the engine; `engine_args` picks the right one)."""

from __future__ import annotations

import torch

from .runner import OdaRunnerMixin


def _require_v1_runner(worker) -> None:
    if getattr(worker, "use_v2_model_runner", False):
        raise RuntimeError("ODA runs on vLLM's V1 model runner: set VLLM_USE_V2_MODEL_RUNNER=0 before starting "
                           "the engine (oda_hf.vllm.engine_args and `oda serve` do).")


def discarded_generators(runner) -> dict:
    """The seeded generators (batch row -> torch.Generator) of the rows whose sampled token this step discards."""
    rows = runner.discard_request_mask.np[:runner.input_batch.num_reqs].nonzero()[0]
    generators = runner.input_batch.generators
    return {int(row): generators[int(row)] for row in rows if int(row) in generators}


def _cpu_classes():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    class OdaCPUModelRunner(OdaRunnerMixin, CPUModelRunner):
        # vLLM samples a token for a request whose prompt chunk does not end its prompt (chunked prefill), discards
        # it, and rewinds a seeded request's generator with `set_offset`, which CPU generators lack: the engine died
        # ("CPU Generator does not use offset") on any seeded request whose prompt was split, e.g. a prompt past
        # `oda serve`'s default 2,048 batched tokens. Here the generator's state is put back instead.
        def _sample(self, logits, spec_decode_metadata):
            self.oda_discarded = held = discarded_generators(self)   # for _bookkeeping_sync, later in this step
            states = {row: generator.get_state() for row, generator in held.items()}
            output = super()._sample(logits, spec_decode_metadata)
            for row, generator in held.items():
                generator.set_state(states[row])
            return output

        def _bookkeeping_sync(self, *args, **kwargs):
            # rewound by _sample: kept from vLLM's set_offset (a step that sampled nothing: computed here)
            held = self.__dict__.pop("oda_discarded", None)
            if held is None:
                held = discarded_generators(self)
            for row in held:
                del self.input_batch.generators[row]
            try:
                return super()._bookkeeping_sync(*args, **kwargs)
            finally:
                self.input_batch.generators.update(held)

    class OdaCPUWorker(CPUWorker):
        def init_device(self):
            super().init_device()
            _require_v1_runner(self)
            self.model_runner = OdaCPUModelRunner(self.vllm_config, torch.device("cpu"))

        def oda_routing_stats(self, *args, **kwargs):
            return self.model_runner.oda_routing_stats(*args, **kwargs)

    return OdaCPUModelRunner, OdaCPUWorker


def _gpu_classes():
    """The CUDA worker (written for vLLM's GPU build; it has never run here: no GPU in this project)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    class OdaGPUModelRunner(OdaRunnerMixin, GPUModelRunner):
        pass

    class OdaGPUWorker(Worker):
        def _make_model_runner(self):
            # vLLM's hook for a worker's runner: building its own first would allocate a second runner's GPU buffers
            _require_v1_runner(self)
            return OdaGPUModelRunner(self.vllm_config, self.device)

        def init_device(self):
            super().init_device()
            if not isinstance(self.model_runner, OdaGPUModelRunner):   # a vLLM without the hook
                _require_v1_runner(self)
                self.model_runner = OdaGPUModelRunner(self.vllm_config, self.device)

        def oda_routing_stats(self, *args, **kwargs):
            return self.model_runner.oda_routing_stats(*args, **kwargs)

    return OdaGPUModelRunner, OdaGPUWorker


def __getattr__(name):
    if name in ("OdaCPUModelRunner", "OdaCPUWorker"):
        runner, worker = _cpu_classes()
        globals().update(OdaCPUModelRunner=runner, OdaCPUWorker=worker)
        return globals()[name]
    if name in ("OdaGPUModelRunner", "OdaGPUWorker"):
        runner, worker = _gpu_classes()
        globals().update(OdaGPUModelRunner=runner, OdaGPUWorker=worker)
        return globals()[name]
    raise AttributeError(name)
