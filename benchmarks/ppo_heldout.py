"""Held-out exact match and reward-model score of a policy's answers: what PPO's "Measured" table in
docs/post_training.md reports for the starting and the trained policy.

    python benchmarks/ppo_heldout.py --policy outputs/debug_ppo/checkpoint/step-32 \
        --reward-model outputs/debug_reward/hf

The policy (a titanium checkpoint of the debug Llama) answers the first ``--prompts`` rows of the held-out file
twice: greedily, and ``--samples`` times each at ``--temperature`` (the rollouts' temperature; generator seeded with
0, so two policies draw alike). Each answer is scored by exact match with the reference and by the reward model
(an HF sequence-classification folder) on prompt + answer, read at the answer's last token (its stop id when it
has one), as PPO reads it. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch

from titanium.checkpoint.hf import hf_model_args
from titanium.config.sections import DataSection, EvalSection
from titanium.data.chat import build_chat_template
from titanium.data.tokenizer import TiktokenTokenizer
from titanium.evaluation.exact_match import load_eval_samples
from titanium.generation.generate import generate
from titanium.generation.sampling import SamplingParams
from titanium.model_builder import ModelBuilder, WeightSource
from titanium.models import build_model_args, get_model_spec
from titanium.models.reward import reward_spec

SEQ_LEN = 64
CHUNK = 64


def scores_at_last_token(reward_model: torch.nn.Module, sequences: list[list[int]], pad_id: int) -> list[float]:
    """The reward model's score of each sequence at its last token (right-padded, causal: padding is not seen)."""
    out: list[float] = []
    for start in range(0, len(sequences), CHUNK):
        chunk = sequences[start : start + CHUNK]
        tokens = torch.full((len(chunk), max(len(s) for s in chunk)), pad_id, dtype=torch.long)
        for row, seq in enumerate(chunk):
            tokens[row, : len(seq)] = torch.tensor(seq)
        last = torch.tensor([len(s) - 1 for s in chunk])
        out += reward_model(tokens).squeeze(-1).gather(1, last[:, None]).squeeze(1).tolist()
    return out


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True, help="titanium checkpoint folder (step-N) of the debug Llama")
    p.add_argument("--reward-model", required=True, help="HF sequence-classification folder (num_labels = 1)")
    p.add_argument("--path", default="assets/tasks/arithmetic/test.jsonl")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-new-tokens", type=int, default=16)
    a = p.parse_args()
    tokenizer = TiktokenTokenizer("assets/tokenizer/titanium_debug.tiktoken")
    template = build_chat_template("llama3", tokenizer, "llama3")
    samples = load_eval_samples(
        EvalSection(path=a.path, max_samples=a.prompts), DataSection(kind="chat"), template, tokenizer
    )
    spec = get_model_spec("llama3")
    builder = ModelBuilder(torch.device("cpu"), seed=0)
    args = build_model_args(spec, "debugmodel", max_seq_len=SEQ_LEN)
    policy = builder.build(spec, args, weights=WeightSource(dcp_folder=a.policy)).model.eval()
    scalar = reward_spec(spec, pad_token_id=tokenizer.pad_id)
    reward_args = hf_model_args(scalar, a.reward_model, max_seq_len=SEQ_LEN)
    reward_model = builder.build(scalar, reward_args, weights=WeightSource(hf_folder=a.reward_model)).model.eval()
    result: dict[str, object] = {"policy": a.policy, "reward_model": a.reward_model, "prompts": len(samples)}
    for name, temperature, k in (("greedy", 0.0, 1), ("sampled", a.temperature, a.samples)):
        prompts = [s.prompt for s in samples for _ in range(k)]
        references = [s.reference.strip() for s in samples for _ in range(k)]
        generator = torch.Generator().manual_seed(0)
        params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=temperature)
        answers: list[list[int]] = []
        for start in range(0, len(prompts), CHUNK):
            out = generate(policy, prompts[start : start + CHUNK], params, template.stop_ids, tokenizer.pad_id,
                           generator=generator)  # fmt: skip
            answers += out.token_lists(keep_stop=True)
        texts = [tokenizer.decode([t for t in ans if t not in template.stop_ids]).strip() for ans in answers]
        scores = scores_at_last_token(reward_model, [q + ans for q, ans in zip(prompts, answers)], tokenizer.pad_id)
        result[name] = {
            "exact_match": sum(t == r for t, r in zip(texts, references)) / len(references),
            "reward_model_score": sum(scores) / len(scores),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
