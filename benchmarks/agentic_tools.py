"""The bundled tool task before and after GRPO: held-out accuracy and tool calls of the debug model.

    python benchmarks/agentic_tools.py --seeds 0 1 2     # after ./run_train.sh and the tool SFT job (see below)

Chain (train_configs/debug_tools_grpo.toml says it too): the default job (pretraining), then
train_configs/debug_tools_sft.toml (the calculator task's conversations; 60% call the tool), then GRPO with the
calculator environment from that checkpoint, once per seed (``--debug.seed``), the seeds' runs at once (and the
SFT policy's evaluation beside them). Each policy,
the SFT one ("before") and each GRPO one ("after"), plays the first ``--prompts`` held-out questions
(assets/tasks/calculator/test.jsonl) as GRPO's episodes are played (titanium's engine, the environment, up to 3
turns), greedily and sampled at temperature 1 (seed 0). Reported: exact match of the final answer, tool calls per
episode and the share of calls that succeeded, and from each GRPO run's log the first and last steps' training
accuracy and tool calls. Writes a markdown table (``--out``) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from titanium.config.sections import EnvironmentSection
from titanium.data.chat import Message, build_chat_template
from titanium.data.prompts import PromptSample
from titanium.data.tokenizer import TiktokenTokenizer
from titanium.generation.sampling import SamplingParams
from titanium.generation.titanium_engine import TitaniumEngine
from titanium.model_builder import ModelBuilder, WeightSource
from titanium.models import build_model_args, get_model_spec
from titanium.rl.env.base import environment_spec
from titanium.rl.episodes import EpisodeRunner
from titanium.rl.rewards.functions import RewardSet, exact_match

CONFIG = "train_configs/debug_tools_grpo.toml"
SFT = "outputs/debug_tools_sft/checkpoint/step-300"
SEQ_LEN, MAX_NEW, MAX_PROMPT, CHUNK = 128, 96, 32, 50


def environment() -> EnvironmentSection:
    """The [environment] of debug_tools_grpo.toml."""
    return EnvironmentSection(
        name="calculator", tool_parser="pythonic", describe_tools=False, max_turns=3, max_turn_tokens=40
    )


@torch.no_grad()
def evaluate(checkpoint: str, prompts: int) -> dict[str, dict[str, float]]:
    """Greedy and sampled episodes of the policy in ``checkpoint`` (a titanium step folder) on held-out questions."""
    tokenizer = TiktokenTokenizer("assets/tokenizer/titanium_debug.tiktoken")
    template = build_chat_template("llama3", tokenizer, "llama3")
    spec = get_model_spec("llama3")
    args = build_model_args(spec, "debugmodel", max_seq_len=SEQ_LEN, vocab_size=tokenizer.vocab_size)
    model = ModelBuilder(torch.device("cpu"), seed=0).build(spec, args, weights=WeightSource(dcp_folder=checkpoint))
    engine = TitaniumEngine(spec, args, stop_ids=template.stop_ids, pad_id=tokenizer.pad_id, device=torch.device("cpu"))
    engine.sync_from(model.model.eval(), version=0)
    cfg = environment()
    spec_env = environment_spec(cfg)
    assert spec_env is not None
    runner = EpisodeRunner(spec_env, cfg, template, tokenizer, MAX_NEW, MAX_PROMPT)
    rows = [json.loads(line) for line in Path("assets/tasks/calculator/test.jsonl").read_text().splitlines()][:prompts]
    samples = []
    for row in rows:
        messages = (Message("user", row["messages"][0]["content"]),)
        samples.append(PromptSample(template.prompt(list(messages)), row["answer"], row, messages=messages))
    out: dict[str, dict[str, float]] = {}
    try:
        for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            correct = calls = ok = 0.0
            for start in range(0, len(samples), CHUNK):
                chunk = samples[start : start + CHUNK]
                episodes, _ = runner.run(engine, chunk, SamplingParams(MAX_NEW, temperature), seed=start)
                rollout = runner.rollout(episodes, RewardSet(["exact_match"]))
                correct += sum(exact_match(c, s.answer, {}) for c, s in zip(rollout.completions, chunk))
                calls += float(rollout.stats["tool_calls"].sum())
                ok += float(rollout.stats["tool_ok"].sum())
            n = len(samples)
            out[name] = {"accuracy": correct / n, "calls_per_episode": calls / n, "call_success": ok / max(calls, 1)}
    finally:
        runner.close()
    return out


def start_grpo(seeds: list[int], steps: int) -> dict[int, tuple[Path, subprocess.Popen]]:
    """The GRPO runs of ``seeds``, started at once (a process each): their folders and processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for seed in seeds:
        folder = Path(f"outputs/debug_tools_grpo_seed{seed}")
        folder.parent.mkdir(exist_ok=True)
        options = {"--debug.seed": seed, "--training.steps": steps, "--checkpoint.interval": steps}
        command = [
            sys.executable,
            "-m",
            "titanium.train",
            "--job.config_file",
            CONFIG,
            "--job.dump_folder",
            str(folder),
        ]
        command += [str(part) for option in options.items() for part in option]
        log = open(folder.with_suffix(".log"), "w")
        runs[seed] = (folder, subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    return runs


def finish_grpo(runs: dict[int, tuple[Path, subprocess.Popen]]) -> dict[int, Path]:
    for folder, process in runs.values():
        if process.wait():
            raise SystemExit(f"a GRPO run failed; see {folder.with_suffix('.log')}")
    return {seed: folder for seed, (folder, _) in runs.items()}


def logged(folder: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted((folder / "tb").glob("*")) or [folder / "tb"]
    acc = EventAccumulator(str(runs[-1]))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompts", type=int, default=100)
    p.add_argument("--out", default="benchmarks/results/agentic_tools_cpu.md")
    a = p.parse_args()
    start = time.time()
    runs = start_grpo(a.seeds, a.steps)
    before = evaluate(SFT, a.prompts)  # (while they train)
    folders = finish_grpo(runs)
    after = {
        seed: evaluate(str(folder / "checkpoint" / f"step-{a.steps}"), a.prompts) for seed, folder in folders.items()
    }
    lines = [
        f"# The calculator tool task before and after GRPO (debug model, {a.prompts} held-out questions)",
        "",
        f"`python benchmarks/agentic_tools.py --seeds {' '.join(map(str, a.seeds))} --steps {a.steps} "
        f"--prompts {a.prompts}` on a shared 2-core CPU ({time.time() - start:.0f} s in all), from "
        f"{SFT} (train_configs/debug_tools_sft.toml), GRPO by {CONFIG}.",
        "",
        "| policy | greedy accuracy | greedy calls / episode | greedy call success | sampled accuracy | "
        "sampled calls / episode | sampled call success |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def row(name: str, r: dict[str, dict[str, float]]) -> str:
        g, s = r["greedy"], r["sampled"]
        cells = [g["accuracy"], g["calls_per_episode"], g["call_success"], s["accuracy"], s["calls_per_episode"]]
        return f"| {name} | " + " | ".join(f"{v:.3f}" for v in [*cells, s["call_success"]]) + " |"

    lines.append(row("SFT (before)", before))
    lines += [row(f"GRPO seed {seed} (after {a.steps} steps)", r) for seed, r in after.items()]
    header = "| seed | accuracy | tool calls / episode | tool ok / episode | reward |"
    lines += [
        "",
        "Training (each run's rollouts, temperature 1): first and last step",
        "",
        header,
        "|---|---|---|---|---|",
    ]
    for seed, folder in folders.items():
        cells = []
        for tag in ("grpo/accuracy", "grpo/env/tool_calls", "grpo/env/tool_ok", "grpo/reward"):
            values = logged(folder, tag)
            cells.append(f"{values[min(values)]:.3f} -> {values[max(values)]:.3f}")
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
