"""Capturing work into a CUDA graph and timing its replays: the demo's and the benchmarks' one timer.

    graph = capture_cuda_graph([lambda: kbit.matmul(x, qw)])
    seconds = replay_seconds(graph, timings=5, replays_per_timing=10)   # per replay, one entry per timing
    pairs, writes = in_step([lambda: kbit.matmul(x, qw)], x)   # as in a decoder step: a pair's time less a write's

A graph replay has no Python or launch overhead, so its time is the GPU's. Capture follows the usual recipe of
inference engines: every callable runs a few times on a side stream first (JIT builds, cuBLAS heuristics, kbit's
GEMM layouts and split-K workspaces, allocator pools), then the list is captured on that same stream.
"""

from __future__ import annotations

import time
from typing import Callable, List, Sequence

import torch


def capture_cuda_graph(calls: Sequence[Callable[[], object]], warmup_calls: int = 2,
                       warmup_first: int = 4, warm_seconds: float = 0.03) -> torch.cuda.CUDAGraph:
    """``calls`` captured in order into one CUDA graph, then replayed for at least ``warm_seconds`` (so its first
    timed replay is warm).

    Before capture, on the capture stream, the first ``warmup_first`` callables each run ``warmup_calls`` times (more
    would only repeat the same kernels) and every other one once: as in a model, where every weight has been read
    by the time a graph is captured, so each GEMM is captured reading its weights early (``kbit.ops.weights_settled``).
    The replays after capture: the first ~20 ms of a process's first graph of a shape ran up to 15% slower than the
    rest (H100, k = 4, M = 1, 28672->8192: 54 against 47 us, whatever the stream, early weights or dependent launch;
    the same graph 46.8 us from its second 20 replays on; H200 37.5 against 35.8), which a few replays alone would
    time.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i, call in enumerate(calls):
            for _ in range(warmup_calls if i < warmup_first else 1):
                call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    start = time.perf_counter()
    while True:
        graph.replay()
        torch.cuda.synchronize()
        if time.perf_counter() - start >= warm_seconds:
            return graph


def replay_seconds(graph: torch.cuda.CUDAGraph, timings: int = 5, replays_per_timing: int = 1) -> List[float]:
    """Seconds per replay of ``graph``, one entry per timing of ``replays_per_timing`` replays (CUDA events)."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    seconds = []
    for _ in range(timings):
        start.record()
        for _ in range(replays_per_timing):
            graph.replay()
        stop.record()
        stop.synchronize()
        seconds.append(start.elapsed_time(stop) / 1e3 / replays_per_timing)
    return seconds


def in_step(calls: Sequence[Callable[[], object]], written: torch.Tensor) -> tuple:
    """(pairs, writes): ``calls`` each just after an elementwise kernel that writes ``written`` (their input), and
    those writes alone. Timed as graphs, a call's time in a decoder step is a pair's less a write's: there a
    projection follows a norm, an activation or attention, none of which lets it start early (dependent launch),
    where in a graph of calls back to back each starts under the last one's tail."""
    source = written.clone()

    def write():
        torch.mul(source, 1, out=written)  # an elementwise kernel, as inductor's are (a copy_ may be a memcpy)

    return [step for call in calls for step in (write, call)], [write] * len(calls)


def in_step_time(pairs_per_call: float, writes_per_call: float) -> float:
    """A call's time in a step from ``in_step``'s two graphs timed per entry: a (write, call) pair's (two entries of
    the pairs' graph) less a write's."""
    return 2 * pairs_per_call - writes_per_call
