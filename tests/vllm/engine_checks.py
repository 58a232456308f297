"""``python -m tests.vllm.engine_checks OUT.json [--family llama3|qwen3]``: the vLLM engine against titanium on CPU.

Run in a process of its own (vLLM changes process-wide state: thread count, memory binding, torch.distributed).
A tiny policy with head_dim 32 (vLLM's CPU attention has no 16) in float32; A is its initialization, B is A after
one AdamW step at a large learning rate (3e-3) on a cross-entropy batch. The engine is started, synced and probed:

- teacher-forced log-probs of fixed sequences (``prompt_logprobs``) against titanium's forward of the same weights,
  after syncing A, after syncing B, and, for contrast, the engine at B against titanium at A (what a skipped or
  stale sync would leave);
- a sync per block equals one load of the whole state, bitwise; syncing A again restores the start, bitwise;
- the prefix cache: long prompts generated at A, then B loaded without ``finish_sync`` (no reset) vs with it;
- sampled tokens' log-probs at temperature 0.7 and 1.3 against ``log_softmax(logits / T)`` of titanium's forward,
  the same seed giving the same tokens, and the engine's ``logprobs_mode``.

Every measurement goes to OUT.json (max and mean absolute differences); tests/vllm/test_vllm_engine.py asserts.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time
from typing import Any

import torch

from titanium.checkpoint.full_blocks import full_blocks
from titanium.config.sections import RolloutSection
from titanium.generation.engine import build_engine
from titanium.generation.sampling import SamplingParams, token_logprobs
from titanium.models import get_model_spec

VOCAB, STOP = 512, set(range(2, 24))
SMALL = {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}  # head_dim 32
FAMILIES = {  # family -> its debug flavor made small (Qwen3's keeps tied embeddings)
    "llama3": lambda args: dataclasses.replace(args, **SMALL),
    "qwen3": lambda args: dataclasses.replace(args, **SMALL, head_dim=32, ffn_dim=256),
}


def policy(family: str) -> tuple[Any, Any, torch.nn.Module]:
    spec = get_model_spec(family)
    base = spec.flavors["debugmodel"]
    args = dataclasses.replace(FAMILIES[family](base), vocab_size=VOCAB, max_seq_len=512)
    model = spec.model_cls(args)
    model.init_weights(seed=0)
    assert args.decoder_args().head_dim == 32
    return spec, args, model


def fsdp_policy(family: str) -> tuple[int, Any, Any, torch.nn.Module, torch.nn.Module]:
    """For the checks run under torchrun: join the job's gloo group; this rank, ``policy``'s spec, args and
    (unsharded) model, and a copy of that model sharded by FSDP over every rank (the trained policy)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from titanium.parallel.fsdp import apply_fsdp

    dist.init_process_group("gloo")
    spec, args, reference = policy(family)
    model = copy.deepcopy(reference)
    apply_fsdp(model, init_device_mesh("cpu", (dist.get_world_size(),)), torch.float32, torch.float32, True)
    return dist.get_rank(), spec, args, reference, model


def vllm_engine(spec: Any, args: Any, seed: int, stop_ids: set[int], **rollout: Any) -> Any:
    """A vLLM engine on CPU for the test policy (float32, prompts plus answers up to 512 tokens); ``rollout``:
    [rollout] keys (mode, server_per)."""
    return build_engine(
        RolloutSection(engine="vllm", max_num_batched_tokens=4096, **rollout),
        spec,
        args,
        stop_ids=stop_ids,
        pad_id=0,
        max_model_len=512,
        device=torch.device("cpu"),
        training_dtype=torch.float32,
        seed=seed,
    )


def one_large_step(model: torch.nn.Module) -> None:
    """B = A after one AdamW step at lr 3e-3: moves log-probs by ~1 (a skipped sync cannot hide)."""
    tokens = torch.randint(3, VOCAB, (8, 64), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)


def sequences() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, VOCAB, (48,), generator=g).tolist() for _ in range(16)]


@torch.no_grad()
def titanium_logprobs(model: torch.nn.Module, seqs: list[list[int]], temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor(seqs)
    return token_logprobs(model(ids)[:, :-1], ids[:, 1:], temperature)


def engine_logprobs(engine: Any, seqs: list[list[int]]) -> torch.Tensor:
    """Teacher-forced: the engine's log-prob of each token after its prefix (``prompt_logprobs``)."""
    from vllm import SamplingParams as VLLMSampling

    params = VLLMSampling(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = engine.llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    return torch.tensor([[o.prompt_logprobs[t][s[t]].logprob for t in range(1, len(s))] for o, s in zip(outs, seqs)])


def sampled_vs_titanium(model: torch.nn.Module, prompts: list[list[int]], out: Any) -> dict[str, float]:
    """The engine's log-probs of the tokens it sampled after ``prompts`` (of one length; ``out``: its
    ``Generation``) against titanium's forward of prompt plus answer, at temperature 1."""
    mask = out.mask()
    full = [prompt + out.tokens[row].tolist() for row, prompt in enumerate(prompts)]
    expected = titanium_logprobs(model, full)[:, len(prompts[0]) - 1 :]
    return diff(out.logprobs[mask], expected[mask])


def diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a - b).abs()
    return {"max": d.max().item(), "mean": d.mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--family", default="llama3", choices=sorted(FAMILIES))
    cli = parser.parse_args()
    spec, args, model = policy(cli.family)
    start = time.perf_counter()
    engine = vllm_engine(spec, args, seed=0, stop_ids=STOP)
    results: dict[str, Any] = {"engine_start_seconds": time.perf_counter() - start}
    results["logprobs_mode"] = engine.llm.llm_engine.model_config.logprobs_mode
    seqs = sequences()
    a = titanium_logprobs(model, seqs)
    results["sync_a"] = dataclasses.asdict(engine.sync_from(model, version=0))
    engine_a = engine_logprobs(engine, seqs)
    results["engine_a_vs_titanium_a"] = diff(engine_a, a)

    long_prompts = [s * 4 for s in seqs[:8]]  # 192 tokens: whole KV blocks that the prefix cache keeps
    first_token = SamplingParams(max_new_tokens=1, temperature=1.0)
    engine.generate(long_prompts, first_token, seed=0)  # cache them at A
    state_a = {k: v.clone() for k, v in model.state_dict().items()}
    one_large_step(model)
    b = titanium_logprobs(model, seqs)
    results["titanium_b_vs_a"] = diff(b, a)

    for block in full_blocks(model):  # B's weights, but no finish_sync: the prefix cache still holds A's
        engine.load_weights(block)
    stale = engine.generate(long_prompts, first_token, seed=0).generation
    long_b = titanium_logprobs(model, [p + [int(t)] for p, t in zip(long_prompts, stale.tokens[:, 0])])[:, -1]
    results["first_token_without_cache_reset"] = diff(stale.logprobs[:, 0], long_b)
    engine.finish_sync(version=1)
    fresh = engine.generate(long_prompts, first_token, seed=0).generation
    long_b = titanium_logprobs(model, [p + [int(t)] for p, t in zip(long_prompts, fresh.tokens[:, 0])])[:, -1]
    results["first_token_after_cache_reset"] = diff(fresh.logprobs[:, 0], long_b)

    results["sync_b"] = dataclasses.asdict(engine.sync_from(model, version=1))  # block by block
    engine_b = engine_logprobs(engine, seqs)
    results["engine_b_vs_titanium_b"] = diff(engine_b, b)
    results["engine_b_vs_titanium_a"] = diff(engine_b, a)
    engine.load_weights({k: v for block in full_blocks(model) for k, v in block.items()})  # all at once
    engine.finish_sync(version=1)
    results["per_block_equals_full_sync"] = torch.equal(engine_logprobs(engine, seqs), engine_b)

    for temperature in (0.7, 1.3):
        params = SamplingParams(max_new_tokens=24, temperature=temperature)
        out = engine.generate(seqs[:8], params, seed=5).generation
        again = engine.generate(seqs[:8], params, seed=5).generation
        expected = []
        for row, prompt in enumerate(seqs[:8]):
            n = int(out.lengths[row])
            full = titanium_logprobs(model, [prompt + out.tokens[row, :n].tolist()], temperature)[0]
            expected.append(torch.nn.functional.pad(full[len(prompt) - 1 :], (0, out.tokens.shape[1] - n)))
        mask = torch.arange(out.tokens.shape[1])[None] < out.lengths[:, None]
        results[f"sampled_t{temperature}"] = {
            **diff(out.logprobs[mask], torch.stack(expected)[mask]),
            "tokens": int(mask.sum()),
            "same_seed_same_tokens": torch.equal(out.tokens, again.tokens),
            "finished": int(out.finished.sum()),
        }

    model.load_state_dict(state_a)
    engine.sync_from(model, version=2)
    results["sync_a_again_restores_the_start"] = torch.equal(engine_logprobs(engine, seqs), engine_a)
    engine.close()
    with open(cli.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
