"""DPO, GRPO and SFT with LoRA on Qwen3-MoE under expert parallelism 2 x FSDP 2 train as one process does (fp32,
gloo), and GRPO's rollout engine, synced from the expert-parallel layout, holds one process's weights.

One 4-process launch runs the three jobs (``moe_posttrain_worker``), one single-process launch their references,
each 3 steps of ``debugmodel_moe`` from the seeded initialization, 4 sequences (pairs, prompts) per step read in the
same order by both (``--data.shards 4``). Per step: losses to 1e-5 relative and the tokens routed to every expert
of every layer *identical*, which needs rows as wide at any layout (padding tokens are routed too: DPO pads to
seq_len, SFT's unpacked rows too (``--sft.pad_to seq_len``), and GRPO's microbatches keep their rollout batch's
width (``--rl.pad_to seq_len``; its prompts, left-padded to the widest of a rank's batch, are all as long): a
pad-to-longest row is as wide as its own microbatch's longest, which differs by layout); gradients of every
parameter at steps 1 and 3 to 1e-5 absolute; the auxiliary loss (DPO, SFT) to 1e-5 relative.

- DPO (aux-loss balancing): the frozen reference is a second expert-parallel model; its no-grad forwards must not
  count tokens nor feed the auxiliary loss, so the counts equal one process's and the first loss is log 2.
- GRPO (aux-loss-free bias at a large rate, so routing changes within the 3 steps; KL to a frozen reference): the
  responses are fixed in advance (``tests/objectives/fixed_rollouts.py``), a rollout batch per step; the engine's
  log-probs of them (its copy's forward) must equal the policy's recomputed ones to 1e-4, which needs the engine to
  route with the synced bias as the policy does. The engine's weights after the last sync equal one process's
  engine's to 1e-5 (before training: bitwise), every rank's the same bitwise, routing bias included.
- SFT with LoRA on ``wq`` and the stacked experts (the expert adapters sharded by expert).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.test_moe_layouts import grads, launch, loads, moe_job
from tests.helpers import REPO, scalars
from titanium.config.sections import TokenizerSection
from titanium.data.tokenizer import build_tokenizer

STEPS = 3
PAIRS = 16
"""The first pairs of the bundled set (3 steps read 12)."""
BIAS = ("--moe.load_balance", "bias", "--moe.bias_update_rate", "0.05")
GRPO = (
    "--training.objective", "grpo", "--chat.chat_template", "llama3",
    "--grpo.group_size", "4", "--rl.max_new_tokens", "8", "--rl.max_prompt_len", "40",
    "--grpo.minibatches", "1", "--training.global_batch_size", "16", "--optimizer.lr", "3e-4",
    "--rl.rewards", "tests.objectives.fixed_rollouts:characters", "--grpo.beta", "0.05", *BIAS,
    "--grpo.old_logprobs", "recompute", "--rl.pad_to", "seq_len",
)  # fmt: skip
SFT_LORA = (
    "--training.objective", "sft", "--chat.chat_template", "llama3", "--sft.no_packing", "--sft.pad_to", "seq_len",
    "--optimizer.lr", "1e-2",
    "--lora.rank", "4", "--lora.target_modules", "wq", "experts",
)  # fmt: skip
TASKS = REPO / "assets/tasks/arithmetic"
EP2_FSDP2 = ("--parallelism.expert_parallel_degree", "2")


def equal_prompts(path: Path, count: int = 16, tokens: int = 15) -> None:
    """The first ``count`` rows of the bundled chat task whose question is ``tokens`` tokens long."""
    tokenizer = build_tokenizer(
        TokenizerSection(kind="tiktoken", path=str(REPO / "assets/tokenizer/titanium_debug.tiktoken"))
    )
    rows = []
    for line in (TASKS / "train.jsonl").read_text().splitlines(keepends=True):
        question = json.loads(line)["messages"][0]["content"]
        if len(tokenizer.encode(question, bos=False, eos=False)) == tokens:
            rows.append(line)
        if len(rows) == count:
            break
    path.write_text("".join(rows))


def jobs(folder: Path) -> dict[str, tuple[tuple[str, ...], tuple[str, ...], int, int]]:
    """name -> (data flags, objective flags, local batch size of one process, of each of 4 ranks); data files
    written to ``folder``."""
    lines = (TASKS / "preference_train.jsonl").read_text().splitlines(keepends=True)
    (folder / "pairs.jsonl").write_text("".join(lines[:PAIRS]))
    equal_prompts(folder / "prompts.jsonl")
    shards = ("--data.shards", "4")
    pairs = ("--data.kind", "preference", "--data.path", str(folder / "pairs.jsonl"), *shards)
    prompts = ("--data.kind", "chat", "--data.path", str(folder / "prompts.jsonl"), *shards)
    chat = ("--data.kind", "chat", "--data.path", str(TASKS / "train.jsonl"), *shards)
    dpo = ("--training.objective", "dpo", "--chat.chat_template", "llama3", "--dpo.pad_to", "seq_len")
    return {"dpo": (pairs, dpo, 4, 1), "grpo": (prompts, GRPO, 8, 4), "sft_lora": (chat, SFT_LORA, 4, 1)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe_posttrain")
    made = jobs(root)

    def job(name: str, nproc: int) -> list[str]:
        data, objective, single, each = made[name]
        size = ("--training.local_batch_size", str(single if nproc == 1 else each))
        layout = EP2_FSDP2 if nproc > 1 else ()
        return moe_job(root / f"{name}_{nproc}", *objective, *size, *layout, data=data, steps=STEPS)

    for nproc in (1, 4):
        launch(nproc, [job(name, nproc) for name in made], module="tests.distributed.moe_posttrain_worker")
    return root


@pytest.mark.parametrize("name", ["dpo", "grpo", "sft_lora"])
def test_post_training_under_expert_parallelism_matches_one_process(runs, name):
    reference, got = runs / f"{name}_1", runs / f"{name}_4"
    ref_losses, losses = scalars(reference / "tb"), scalars(got / "tb")
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-5), (step, losses, ref_losses)
    assert len(set(losses.values())) == STEPS  # it trains
    if name == "dpo":
        assert losses[1] == pytest.approx(0.6931472, rel=1e-6)  # the policy starts as the reference: log 2
    ref_loads, got_loads = loads(reference), loads(got)
    assert sorted(got_loads) == list(range(1, STEPS + 1)) and sorted(got_loads[1]) == [0, 1, 2, 3]
    assert got_loads == ref_loads
    if name != "grpo":  # (aux-loss balancing) its value, statistics summed over the ranks
        ref_aux, aux = scalars(reference / "tb", "moe/aux_loss"), scalars(got / "tb", "moe/aux_loss")
        assert sorted(aux) == list(range(1, STEPS + 1))
        for step in aux:
            assert aux[step] == pytest.approx(ref_aux[step], rel=1e-5), (step, aux, ref_aux)
    if name == "grpo":  # the engine (its copy synced, routing bias included) and the policy agree on every batch
        for run in (reference, got):
            mismatch = scalars(run / "tb", "grpo/logprob_mismatch_max")
            assert sorted(mismatch) == list(range(1, STEPS + 1)) and max(mismatch.values()) < 1e-4, mismatch
    for step in (1, STEPS):
        expected, actual = grads(reference, step), grads(got, step)
        assert set(actual) == set(expected)
        worst = max((actual[k] - v).abs().max().item() for k, v in expected.items())
        assert worst <= 1e-5, (step, worst)


def test_engine_synced_from_expert_parallel_layout_holds_one_process_weights(runs):
    probe, reference = runs / "grpo_4" / "probe", runs / "grpo_1" / "probe"
    before, ref_before = torch.load(probe / "engine_v0_rank0.pt"), torch.load(reference / "engine_v0_rank0.pt")
    assert before.keys() == ref_before.keys() and "layers.0.moe.expert_bias" in before
    assert all(torch.equal(before[k], v) for k, v in ref_before.items())
    expected = torch.load(reference / f"engine_v{STEPS}_rank0.pt")
    ranks = [torch.load(probe / f"engine_v{STEPS}_rank{r}.pt") for r in range(4)]
    for rank in ranks[1:]:
        assert all(torch.equal(rank[k], v) for k, v in ranks[0].items())
    worst = max((ranks[0][k] - v).abs().max().item() for k, v in expected.items())
    assert worst <= 1e-5, worst
    bias = expected["layers.0.moe.expert_bias"]
    assert bias.abs().max() > 0 and torch.equal(ranks[0]["layers.0.moe.expert_bias"], bias)
