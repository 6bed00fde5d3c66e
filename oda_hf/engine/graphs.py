"""Length buckets, the device-side branch, and captured step graphs.

Graph reuse follows the paper (App. "Length-compatible graph reuse"): steps are grouped by
``ceil(L / bucket_size)`` where ``L`` is the effective attention length including the current token
(``n + 1`` for ``n`` committed columns). Within a bucket every host-side value a step depends on is
the same (the Full attention reads the bucket's first ``bucket * bucket_size`` columns with a device
length mask), so one graph captured at any length of the bucket replays at all of them; replay only
changes device tensors (position, counters, the current token).

A step branches to Full in one of two ways. With ``conditional="cond"`` the branch is a `torch.cond`,
captured as a CUDA-graph conditional (IF) node: one graph per key, nothing read back (needs torch >= 2.13).
With ``conditional="host"`` the step is split into three graphs per key (``part``): ``route`` (Local,
head, decision), ``full`` (the Full pass) and ``finish`` (select, commit, advance); the host reads the
decision between ``route`` and ``full`` (one sync per step) and skips ``full`` when no row recalls.
That runs on any torch with CUDA graphs.

Only two calls here need a GPU: `torch.cuda.graph(...)` capture and ``graph.replay()``. Everything
around them (which key, when to warm up and capture, the state transaction, replay bookkeeping) is
shared with the ``emulate`` mode, whose "graph" re-runs the step eagerly, so CPU tests exercise it.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .routing import StepPlan

DEFAULT_BUCKET_SIZE = 128
GRAPH_MODES = ("eager", "emulate", "cuda")
CONDITIONALS = ("eager", "cond", "host")
STEP_PARTS = ("route", "full", "finish")  # the graphs of one key with conditional="host"


# The dispatch modes that turn torch.cond into CUDA-graph IF nodes. torch 2.13 has them; 2.11 does not (seen on an
# H200 with torch 2.11.0+cu130), and without them a step cannot branch to Full inside a captured graph.
CONDITIONAL_NODES_MODULE = "torch._higher_order_ops.cudagraph_conditional_nodes"


def cuda_graph_conditionals_available() -> bool:
    """Whether this torch can capture `torch.cond` as a CUDA-graph conditional node."""
    try:
        return importlib.util.find_spec(CONDITIONAL_NODES_MODULE) is not None
    except ModuleNotFoundError:
        return False


def bucket_index(length: int, bucket_size: int) -> int:
    """``ceil(L / bucket_size)`` for an effective attention length ``L >= 1``."""
    if length < 1 or bucket_size < 1:
        raise ValueError(f"need length >= 1 and bucket_size >= 1; got {length}, {bucket_size}.")
    return -(-length // bucket_size)


def bucket_columns(bucket: int, bucket_size: int, capacity: int) -> int:
    """Full-attention columns read by every step of a bucket (its upper length, within the capacity)."""
    return min(bucket * bucket_size, capacity)


@dataclass(frozen=True)
class GraphKey:
    bucket: int
    plan: StepPlan
    part: str = "step"  # "step": the whole step (one graph); else one of STEP_PARTS

    def with_part(self, part: str) -> "GraphKey":
        return GraphKey(self.bucket, self.plan, part)


def conditional(kind: str, pred: torch.Tensor, true_fn: Callable, false_fn: Callable, operands: tuple):
    """Run `true_fn` or `false_fn` on `operands` according to a one-element bool tensor.

    ``cond`` is `torch.cond`: captured under `torch.cuda.graph` with torch's control-flow dispatch
    mode it becomes a CUDA-graph conditional (IF) node, so the branch is chosen on the device. Run
    eagerly (CPU), `torch.cond` traces both branches with dynamo and reads `pred` to pick one.
    ``eager`` is a plain Python ``if`` on `pred` (a host read: only for eager execution, where the
    device is the host or a sync is acceptable). ``host`` splits the step around this point instead
    (the engine's business), so it never reaches here.
    """
    if kind == "cond":
        return torch.cond(pred, true_fn, false_fn, operands)
    if kind == "eager":
        return true_fn(*operands) if bool(pred) else false_fn(*operands)
    raise ValueError(f"conditional must be one of {CONDITIONALS}; got {kind!r}.")


class StepGraphs:
    """Captured step graphs keyed by `GraphKey`, with replay counts.

    ``mode="cuda"``: `torch.cuda.CUDAGraph` captured with conditional nodes, sharing one memory pool
    (graphs run one at a time; their outputs all land in the engine's persistent buffers).
    ``mode="emulate"``: the "graph" is the step body itself, re-run on replay (CPU stand-in that
    exercises the same bookkeeping). Warm-up runs are the engine's business (`OdaStaticEngine`
    wraps them and the capture in a state transaction); this class only captures and replays.
    """

    def __init__(self, mode: str, device: torch.device, conditional_nodes: bool = True):
        if mode not in ("emulate", "cuda"):
            raise ValueError(f"StepGraphs mode must be 'emulate' or 'cuda'; got {mode!r}.")
        if mode == "cuda" and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the engine runs on {device}.")
        # conditional_nodes: capture torch.cond as IF nodes (conditional="cond"); without, bodies hold no torch.cond
        # and capture needs nothing beyond torch.cuda.graph (so it works on torch < 2.13).
        self.mode, self.device, self.conditional_nodes = mode, device, conditional_nodes
        self.graphs: dict[GraphKey, object] = {}
        self.captures: list[GraphKey] = []  # capture order (tests and the benchmark report it)
        self.replays: dict[GraphKey, int] = {}
        self._pool = None
        self._stream = None

    def __contains__(self, key: GraphKey) -> bool:
        return key in self.graphs

    def __len__(self) -> int:
        return len(self.graphs)

    def warm_up(self, run: Callable[[], None]) -> None:
        """Run eager warm-up work where capture will happen (CUDA: a side stream, then join)."""
        if self.mode != "cuda":
            run()
            return
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), self._warm_up_mode():
            run()
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def capture(self, key: GraphKey, body: Callable[[], None]) -> None:
        if key in self.graphs:
            raise RuntimeError(f"A graph for {key} is already captured.")
        if self.mode == "cuda":
            self.graphs[key] = self._cuda_capture(body)
        else:
            self.graphs[key] = body
        self.captures.append(key)
        self.replays[key] = 0

    def replay(self, key: GraphKey) -> None:
        graph = self.graphs[key]
        if self.mode == "cuda":
            graph.replay()
        else:
            graph()
        self.replays[key] += 1

    def clear(self) -> None:
        self.graphs.clear()
        self.captures.clear()
        self.replays.clear()

    # -- CUDA only -----------------------------------------------------------------------------------
    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _warm_up_mode(self):
        if not self.conditional_nodes:
            return contextlib.nullcontext()
        # As inductor's cudagraph trees do: under this mode a torch.cond is also stream-captured into a
        # throwaway graph (both branches), so dynamo's trace of it exists before the real capture.
        from torch._higher_order_ops.cudagraph_conditional_nodes import ControlFlowOpWarmupDispatchMode

        return ControlFlowOpWarmupDispatchMode()

    def _capture_mode(self):
        if not self.conditional_nodes:
            return contextlib.nullcontext()
        # torch's dispatch mode turns torch.cond into IF nodes of the graph being captured
        # (the mechanism inductor's cudagraph trees use). Needs CUDA >= 12.4 conditional nodes.
        from torch._higher_order_ops.cudagraph_conditional_nodes import CUDAGraphCaptureControlFlowOpDispatchMode

        return CUDAGraphCaptureControlFlowOpDispatchMode()

    def _cuda_capture(self, body: Callable[[], None]):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph, pool=self._pool, stream=self._side_stream(), capture_error_mode="thread_local"):
            with self._capture_mode():
                body()
        return graph
