"""The generation thread's CUDA stream (titanium/generation/side_stream.py): off CUDA a job is the call itself; the
hand-overs find every tensor a GRPO generation job returns; on a GPU (cuda mark) each hand-over holds with the
loop's stream held up so that a missing one would show, lag 1 on the side stream serves bitwise what generating in
the loop serves, and generation runs beside the loop's GPU work instead of after it."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import types

import pytest
import torch

from tests.helpers import REPO
from tests.unit.test_grpo_async import _rows
from tests.unit.test_grpo_objective import _model, _objective
from tests.unit.test_rollout_engines import ARGS, PAD, SPEC, policy, prompts
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer
from titanium.generation.background import GenerationWorker
from titanium.generation.sampling import SamplingParams
from titanium.generation.side_stream import SideStream, device_tensors
from titanium.generation.titanium_engine import TitaniumEngine
from titanium.objectives.base import Prepared
from titanium.objectives.grpo import GRPOObjective

CUDA = torch.device("cuda", 0)  # (with its index: the generation thread sets it as its device)


@pytest.fixture(scope="module")
def tokenizer() -> TiktokenTokenizer:
    return TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH))


def test_off_cuda_a_job_is_the_call_itself() -> None:
    def call() -> int:
        return 1

    for device in (None, torch.device("cpu")):
        side = SideStream(device)
        assert side.stream is None and side.bind(call) is call
    assert GenerationWorker(True, torch.device("cpu")).submit(call).result() == 1


class _LoggedStream:
    """A stand-in for a CUDA stream that logs what is asked of it (the device is the CPU, where the tensors are)."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.device = name, log, torch.device("cpu")

    def record_event(self) -> str:
        self.log.append(("record", self.name))
        return f"event of {self.name}"

    def wait_event(self, event: str) -> None:
        self.log.append(("wait", self.name, event))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


def test_a_job_on_the_side_stream_makes_each_hand_over(monkeypatch) -> None:
    """The order of the hand-overs on CUDA, with streams that log (the GPU tests below run them for real): the
    loop's stream records an event when the job is bound, the side stream waits for it before the call runs on it,
    the thread waits for the side stream after the call (after a failure too), and every tensor of the result is
    marked as used by the loop's stream."""
    log: list = []
    loop = _LoggedStream("loop", log)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority: _LoggedStream("side", log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: loop)

    @contextlib.contextmanager
    def on(stream: _LoggedStream):
        log.append(("enter", stream.name))
        yield
        log.append(("exit", stream.name))

    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: log.append(("uses", id(t), stream.name)))
    side = SideStream(CUDA)
    a, b = torch.zeros(2), torch.ones(3)
    job = side.bind(lambda: log.append(("call",)) or (a, {"b": [b]}, "text"))
    assert log == [("record", "loop")]
    assert job() == (a, {"b": [b]}, "text")
    waits = [("wait", "side", "event of loop"), ("enter", "side"), ("call",), ("exit", "side"), ("synchronize", "side")]
    assert log[1:6] == waits and sorted(log[6:]) == sorted([("uses", id(a), "loop"), ("uses", id(b), "loop")])

    def fails() -> None:
        raise ValueError("bad")

    log.clear()
    with pytest.raises(ValueError, match="bad"):
        side.bind(fails)()
    assert log == [("record", "loop"), ("wait", "side", "event of loop"), ("enter", "side"), ("synchronize", "side")]


def _reachable_tensors(root: object) -> dict[int, torch.Tensor]:
    """Every tensor ``root`` refers to, through any object (the garbage collector's references)."""
    found, seen, pending = {}, set(), [root]
    while pending:
        item = pending.pop()
        if id(item) in seen or isinstance(item, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found[id(item)] = item
        else:
            pending.extend(gc.get_referents(item))
    return found


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_hand_over_finds_every_tensor_of_a_grpo_generation_job(tokenizer, dynamic) -> None:
    """What GRPO's generation job returns (prompts, the scored rollout, the rewards per function, the seconds; with
    dynamic sampling a batch put together from rounds): ``device_tensors`` finds each tensor it refers to, as the
    garbage collector sees them, so each gets ``record_stream`` on CUDA."""
    settings = {"dynamic_sampling": True, "dynamic_sampling_max_rounds": 2} if dynamic else {}
    objective = _objective(tokenizer, _model(tokenizer.vocab_size), max_policy_lag=1, **settings)
    result = objective.source._start_batch(1).generation.result()
    objective.close()
    reachable = _reachable_tensors(result)
    found = {id(t): t for t in device_tensors(result, torch.device("cpu"))}
    assert len(reachable) >= 8 and found.keys() == reachable.keys()
    assert device_tensors(result, torch.device("meta")) == []


# ----- on a GPU -----


def _spin_cycles(seconds: float) -> int:
    """Clock cycles of ``torch.cuda._sleep`` (a one-thread spin kernel) that hold a stream for about ``seconds``."""
    cycles = 100_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds / (start.elapsed_time(end) / 1000))


@pytest.mark.cuda
def test_cuda_hand_overs_between_the_loops_stream_and_the_side_stream() -> None:
    """Each hand-over of side_stream.py, with a stream held up by a spin kernel (0.2 s) so that a missing one would
    show: (1) a job reads what the loop's stream wrote before it was handed over, even when those kernels have not
    run yet; (2) a tensor a job made, freed by the loop while the loop's stream still reads it, is not given to the
    next job's allocations before that read; (3) after ``wait`` the job's reads are done, so the weight sync may
    overwrite what it read."""
    worker = GenerationWorker(True, CUDA)
    n, hold = 1 << 24, _spin_cycles(0.2)  # (64 MiB of float32: a block of its own)
    torch.cuda.synchronize()

    weights = torch.zeros(n, device=CUDA)
    torch.cuda._sleep(hold)
    weights.fill_(1.0)  # (queued behind the spin on the loop's stream)
    assert bool((worker.submit(weights.clone).result() == 1).all()), "(1) the job ran before the loop's writes"

    made = worker.submit(lambda: torch.ones(n, device=CUDA))
    first = made.result()
    del made
    go = threading.Event()

    def next_job() -> torch.Tensor:
        assert go.wait(60)
        return torch.full((n,), 2.0, device=CUDA)  # (allocated on the side stream, written at once)

    following = worker.submit(next_job)
    torch.cuda._sleep(hold)
    copy = first.clone()  # (the loop's read, queued behind the spin)
    del first  # (freed while that read waits)
    go.set()
    following.result()
    assert bool((copy == 1).all()), "(2) the freed result's memory went to the next job before the loop read it"

    torch.cuda.synchronize()

    def slow_read() -> torch.Tensor:
        torch.cuda._sleep(hold)
        return weights.clone()  # (queued behind the spin on the side stream)

    read = worker.submit(slow_read)
    worker.wait()
    weights.fill_(2.0)  # the weight sync's copy, on the loop's stream
    assert bool((read.result() == 1).all()), "(3) the sync overwrote weights the side stream had not read yet"
    worker.close()


def _busy_steps(objective: GRPOObjective, model: torch.nn.Module, steps: int) -> list[Prepared]:
    """``steps`` steps as the loop runs them, the optimizer step replaced by a deterministic one (training's
    kernels are not bitwise reproducible on a GPU, generation's are): 40 fp32 4096 x 4096 matmuls on the loop's
    stream while the next batch generates, then every weight moved by seeded noise scaled by the step's tokens (the
    rows the side stream made, read on the loop's stream), then the weight sync."""
    a = torch.randn(4096, 4096, device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    noise = torch.Generator(CUDA).manual_seed(1)
    served = []
    for step in range(1, steps + 1):
        prepared = objective.prepare([objective.next_microbatch()])
        with torch.no_grad():
            for _ in range(40):
                torch.mm(a, a)
            scale = 0.05 * (1 + sum(mb.tokens.sum() % 7 for mb in prepared.batches) / 7)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, device=CUDA, generator=noise) * scale)
        objective.source.policy.updated(step)  # the loop's after_optimizer_step: the sync
        served.append(prepared)
    objective.close()
    return served


@pytest.mark.cuda
def test_cuda_lag_1_on_the_side_stream_serves_what_the_loop_generates(tokenizer) -> None:
    """GRPO at lag 1 on a GPU, with the next batch generated on the side stream while the loop's stream is busy:
    every step's rows (tokens, recomputed old log-probs, advantages, loss mask, importance weights) and lag are
    bitwise those of generating in the loop (the synchronous path, as at lag 0), through weight changes large
    enough that a batch made from stale or half-synced weights would differ."""
    settings = {"max_policy_lag": 1, "minibatches": 2, "old_logprobs": "recompute", "is_correction": "token_truncate"}
    runs = []
    for background in (True, False):
        model = _model(tokenizer.vocab_size).to(CUDA)
        model.attention_backend = "sdpa"  # (the trainer's forwards: flex would compile for every row width)
        objective = _objective(tokenizer, model, device=CUDA, **settings)
        assert (objective.source.worker.side_stream.stream is not None) and objective.source.worker.background
        if not background:
            objective.source.worker = GenerationWorker(background=False)
        runs.append(_busy_steps(objective, model, 6))
    for threaded, inline in zip(*runs):
        assert torch.equal(threaded.metrics["grpo/policy_lag"][0], inline.metrics["grpo/policy_lag"][0])
        for a, b in zip(_rows(threaded), _rows(inline), strict=True):
            assert torch.equal(a, b)
    lags = [p.metrics["grpo/policy_lag"][0].item() / p.metrics["grpo/policy_lag"][1].item() for p in runs[0]]
    assert max(lags) >= 1  # (batches were generated while a step ran)


@pytest.mark.cuda
def test_cuda_generation_overlaps_the_loops_work() -> None:
    """The generation thread's kernels run beside the loop's GPU work: with the loop's stream held by a kernel as
    long as a generation job (four batches of 48 tokens from a small model), both take at most 75% of the sum of
    each alone (about 50% when they overlap; 100% on one stream, where the job's first host sync waits for the
    loop's kernel). The loop's work is a one-thread spin kernel, so the check is about the streams, not about
    sharing the GPU's cores: what training's kernels leave to generation is measured by benchmarks/grpo_gpu.py
    (lag1's waited seconds)."""
    engine = TitaniumEngine(SPEC, ARGS, stop_ids=set(), pad_id=PAD, device=CUDA)  # (no stop id: 48 tokens a row)
    engine.sync_from(policy().to(CUDA), version=0)
    params = SamplingParams(max_new_tokens=48, temperature=0.8)
    worker = GenerationWorker(True, CUDA)
    loop = torch.cuda.current_stream()

    def generation() -> list:
        return [engine.generate(prompts(), params, seed) for seed in range(4)]

    def seconds(work: bool, generate: bool) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        job = worker.submit(generation) if generate else None
        if work:
            torch.cuda._sleep(cycles)
            loop.synchronize()
        if job is not None:
            job.result()
        return time.perf_counter() - start

    cycles = 0
    for _ in range(2):  # (warm-up: the side stream's memory, the kernels)
        seconds(work=False, generate=True)
    generating = min(seconds(work=False, generate=True) for _ in range(3))
    cycles = _spin_cycles(generating)
    cycles = int(cycles * generating / seconds(work=True, generate=False))  # (the clock under load)
    working = min(seconds(work=True, generate=False) for _ in range(2))
    both = min(seconds(work=True, generate=True) for _ in range(2))
    worker.close()
    numbers = f"generation {generating:.3f} s, loop's work {working:.3f} s, both {both:.3f} s"
    assert both < 0.75 * (generating + working), numbers
