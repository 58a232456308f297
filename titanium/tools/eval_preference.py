"""Held-out preference accuracy of a policy against its reference, on preference pairs (one process).

    python -m titanium.tools.eval_preference outputs/debug_dpo/checkpoint/step-100 \\
        outputs/debug_sft/checkpoint/step-200 --data assets/tasks/arithmetic/preference_test.jsonl \\
        --job.config_file train_configs/debug_dpo.toml

POLICY and REFERENCE are titanium checkpoint folders (step-N, with the whole model: not a LoRA run's,
whose merged Hugging Face export works instead) or Hugging Face folders. The job config (a TOML file and
--section.key overrides, as for training) gives the model, tokenizer, chat template ([chat]), seq_len,
the preference columns ([data]) and beta ([dpo]). It prints one JSON line of means over the pairs:

- reward_accuracy: share of pairs whose implicit reward beta x (log pi - log pi_ref) is higher for the
  chosen response (what DPO's loss raises; a tie counts as wrong, so a policy equal to its reference
  scores 0);
- margin: the mean reward margin, chosen minus rejected;
- policy_prefers_chosen, reference_prefers_chosen: share of pairs where the model alone gives the chosen
  response the higher summed log-prob.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from titanium.config.sections import DPOSection
from titanium.config.shipped import shipped
from titanium.data.chat import build_optional_chat_template
from titanium.data.preference import OnePass, PreferenceDataset
from titanium.data.preference_batch import PreferenceBatchLoader
from titanium.data.text import resolve_sources
from titanium.data.tokenizer import build_tokenizer
from titanium.errors import UserError
from titanium.inputs import load_job
from titanium.model_builder import ModelBuilder, WeightSource
from titanium.objectives.dpo import response_sums, token_logps
from titanium.objectives.losses.dpo import dpo_loss
from titanium.tools import requested_device


def weights_of(folder: Path, option: str) -> WeightSource:
    """The weights in ``folder``, which the argument ``option`` (POLICY, REFERENCE) named."""
    if (folder / "config.json").is_file():
        return WeightSource(hf_folder=str(folder), option=option)
    if (folder / ".metadata").is_file():
        return WeightSource(dcp_folder=str(folder), option=option)
    raise UserError(
        f"{option} {folder}: neither a titanium checkpoint (step-N with .metadata) nor a Hugging Face folder"
    )


@torch.no_grad()
def evaluate(
    policy: nn.Module, reference: nn.Module, loader: PreferenceBatchLoader, cfg: DPOSection
) -> dict[str, float]:
    """Means over every pair the loader gives (see the module docstring)."""
    totals = torch.zeros(5, dtype=torch.float64)  # pairs, reward accuracy, margin, policy / reference prefer chosen
    device = next(policy.parameters()).device
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        inputs = {"positions": batch["positions"], "document_ids": batch["document_ids"]}
        ids = batch["response_ids"]
        pol, ref = (
            response_sums(token_logps(model(batch["input"], **inputs), batch["label"]), ids, loader.slots)
            for model in (policy, reference)
        )
        lengths = response_sums((ids >= 0).float(), ids, loader.slots)
        present = lengths[:, 0] > 0
        out = dpo_loss(*pol.unbind(1), *ref.unbind(1), cfg, *lengths.unbind(1), mask=present)
        prefers = [((m[:, 0] > m[:, 1]) & present).sum() for m in (pol, ref)]
        totals += torch.stack([present.sum(), out.metrics["accuracy"], out.metrics["margin"], *prefers]).cpu()
    n = totals[0].item()
    if n == 0:
        raise UserError("no preference pairs to evaluate (check --data and the [data] columns)")
    names = ("reward_accuracy", "margin", "policy_prefers_chosen", "reference_prefers_chosen")
    return {"pairs": int(n), **{name: (value / n).item() for name, value in zip(names, totals[1:])}}


def run(args: argparse.Namespace, overrides: list[str]) -> dict[str, float]:
    cfg = load_job(overrides)
    device = requested_device(args.device)
    tokenizer = build_tokenizer(cfg.tokenizer)
    seq_len = cfg.training.seq_len
    builder = ModelBuilder(device, cfg.debug.seed)
    weights = [weights_of(args.policy, "POLICY"), weights_of(args.reference, "REFERENCE")]
    # The architecture of a Hugging Face folder is its config.json's (else the job's: flavor or start folder).
    hf = next((w for w in weights if w.hf_folder is not None), None)
    spec, model_args = builder.resolve(
        cfg.model,
        seq_len=seq_len,
        vocab_size=tokenizer.vocab_size,
        checkpoint=cfg.checkpoint,
        hf_folder=hf.hf_folder if hf is not None else None,
        hf_option=hf.option if hf is not None else None,
    )
    template = build_optional_chat_template(cfg.chat.chat_template, tokenizer, spec.chat_template or "")
    data = dataclasses.replace(cfg.data, kind="preference", path=shipped(args.data))
    resolve_sources(data, flag="--data")  # (a path that names no file: one message naming this tool's flag)
    chat, dpo = cfg.chat, cfg.dpo
    pairs = PreferenceDataset(
        data,
        template,
        seq_len,
        tokenizer.bos_id,
        chat.system_prompt,
        dpo.on_long_pair,
        tokenizer=tokenizer,
        max_prompt_length=dpo.max_prompt_length,
    )
    loader = PreferenceBatchLoader(OnePass(pairs, args.max_pairs), args.batch_size, seq_len, tokenizer.pad_id, False)
    policy, reference = (builder.build(spec, model_args, weights=w).model.eval() for w in weights)
    return evaluate(policy, reference, loader, cfg.dpo)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m titanium.tools.eval_preference",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("policy", type=Path, help="the trained policy: a step-N checkpoint or a Hugging Face folder")
    p.add_argument("reference", type=Path, help="its reference (where DPO started), in the same forms")
    p.add_argument(
        "--data",
        required=True,
        help="preference pairs to score: a file, folder or glob (from where you stand; the bundled assets/... from "
        "anywhere) or a hub dataset, as --data.path",
    )
    p.add_argument("--max-pairs", type=int, default=1000, help="score the first N pairs (default 1000)")
    p.add_argument("--batch-size", type=int, default=32, help="pairs per forward (default 32)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    return p


def main(argv: list[str] | None = None) -> int:
    args, overrides = parser().parse_known_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process on purpose
    try:
        if args.max_pairs < 1 or args.batch_size < 1:
            raise UserError("--max-pairs and --batch-size must be >= 1")
        result = run(args, overrides)
    except UserError as e:
        print(f"titanium.tools.eval_preference: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
