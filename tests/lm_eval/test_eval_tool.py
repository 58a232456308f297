"""``python -m titanium.tools.eval`` as users run it (subprocesses): two FSDP ranks score like one process, an SFT
run with LoRA logs lm-eval metrics to TensorBoard that equal the tool's on its (unmerged) checkpoint and lm-eval's
``HFLM`` on its merged export, and bad input is one message with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, env, run_train, scalars
from tests.lm_eval.conftest import TASKS

TASK_ARGS = ["--tasks", "arithmetic_mc,arithmetic_gen", "--include_path", TASKS, "--limit", "16", "--batch_size", "4"]


def eval_cmd(*args: str, nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "titanium.tools.eval", *args]
    launch = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d"]
    return [sys.executable, *launch, "--rdzv_endpoint=localhost:0", "-m", "titanium.tools.eval", *args]


def run_eval(*args: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(eval_cmd(*args, nproc=nproc), cwd=REPO, env=env(), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(f"titanium.tools.eval failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def results_of(folder: Path) -> dict:
    """The results file the tool wrote under ``--output_path folder`` (lm-eval's layout: a folder per model)."""
    (path,) = folder.rglob("results_*.json")
    return json.loads(path.read_text())


def samples_of(folder: Path, task: str) -> list[dict]:
    (path,) = folder.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_same_scores(a: dict, b: dict) -> None:
    for task in ("arithmetic_mc", "arithmetic_gen"):
        numbers = {k: v for k, v in a["results"][task].items() if "stderr" not in k}
        assert numbers == {k: v for k, v in b["results"][task].items() if "stderr" not in k}, task


def test_without_lm_eval_says_how_to_install(tmp_path):
    """(Runs where lm-eval is not installed too: it is hidden from the tool.)"""
    hide = "import sys; sys.modules['lm_eval'] = None; from titanium.tools.eval import main; sys.exit(main())"
    cmd = [sys.executable, "-c", hide, str(tmp_path), "--tasks", "arithmetic_mc"]
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert "lm-evaluation-harness is not installed" in result.stderr and "[eval]" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.lm_eval
@pytest.mark.parametrize(
    "case, message",
    [
        ("unknown_task", "unknown lm-eval task 'no_such_task'"),
        ("needs_network", "must be downloaded from the Hugging Face Hub"),
        ("no_config", "pass --config"),
    ],
)
def test_bad_input_is_one_message(tiny_hf, tmp_path, case, message):
    if case == "no_config":
        step = tmp_path / "checkpoint" / "step-1"
        step.mkdir(parents=True)
        (step / ".metadata").write_bytes(b"")
        args = [str(step), "--tasks", "arithmetic_mc", "--include_path", TASKS]
    else:
        args = [str(tiny_hf), "--tasks", "no_such_task" if case == "unknown_task" else "hellaswag"]
    result = run_eval(*args, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.lm_eval
def test_two_fsdp_ranks_score_like_one_process(tiny_hf, tmp_path):
    tasks = [*TASK_ARGS[:-4], "--limit", "15", "--batch_size", "4"]  # (15: uneven shares, placeholder forwards)
    common = [str(tiny_hf), *tasks, "--training.mixed_precision_param", "float32", "--bootstrap_iters", "0"]
    run_eval(*common, "--log_samples", "--output_path", str(tmp_path / "one"))
    two = run_eval(*common, "--log_samples", "--output_path", str(tmp_path / "two"), nproc=2)
    assert "arithmetic_mc" in two.stdout  # (the table, printed once)
    assert two.stdout.count("arithmetic_mc") == 1
    assert_same_scores(results_of(tmp_path / "one"), results_of(tmp_path / "two"))
    for task in ("arithmetic_mc", "arithmetic_gen"):
        one = {s["doc_id"]: s for s in samples_of(tmp_path / "one", task)}
        for sample in samples_of(tmp_path / "two", task):
            for a, b in zip(sample["filtered_resps"], one[sample["doc_id"]]["filtered_resps"]):
                assert a == b if isinstance(a, str) else abs(float(a[0]) - float(b[0])) <= 1e-5


@pytest.mark.lm_eval
def test_sft_lora_run_logs_lm_eval_like_the_tool_and_hflm(tiny_hf, task_manager, tmp_path):
    """An SFT run with LoRA from the tiny HF folder, lm-eval every 2 steps: the metrics are in TensorBoard at steps
    0, 2 and 4, and the losses are those of the same run without them; the tool on the step-4 checkpoint (adapters
    not merged) gives the same scores, and so does lm-eval's HFLM on the run's merged Hugging Face export."""
    run = tmp_path / "run"
    sft = [
        "--job.config_file", str(REPO / "train_configs/debug_sft.toml"),
        "--job.no_print_config",
        "--training.steps", "4", "--training.local_batch_size", "2", "--training.seq_len", "128",
        "--training.mixed_precision_param", "float32",
        "--checkpoint.initial_load_path", str(tiny_hf), "--checkpoint.initial_load_in_hf",
        "--tokenizer.kind", "hf", "--tokenizer.path", str(tiny_hf / "tokenizer.json"),
        "--chat.chat_template", "tokenizer", "--eval.interval", "0", "--lora.rank", "4",
        "--metrics.log_freq", "1",
    ]  # fmt: skip
    run_train(
        [
            *sft, "--job.dump_folder", str(run),
            "--checkpoint.interval", "4", "--checkpoint.last_save_in_hf",
            "--lm_eval.interval", "2", "--lm_eval.tasks", "arithmetic_mc", "arithmetic_gen",
            "--lm_eval.include_path", TASKS, "--lm_eval.limit", "16", "--lm_eval.apply_chat_template",
        ]
    )  # fmt: skip
    run_train([*sft, "--job.dump_folder", str(tmp_path / "plain"), "--checkpoint.no_enable"])
    assert scalars(run / "tb") == scalars(tmp_path / "plain" / "tb")  # (evaluating changes nothing in training)
    logged = {
        tag: scalars(run / "tb", tag)
        for tag in ("lm_eval/arithmetic_mc/acc", "lm_eval/arithmetic_gen/exact_match/strip")
    }
    assert all(sorted(steps) == [0, 2, 4] for steps in logged.values()), logged

    run_eval(str(run / "checkpoint/step-4"), *TASK_ARGS, "--apply_chat_template", "--output_path", str(tmp_path / "t"))
    tool = results_of(tmp_path / "t")["results"]
    assert tool["arithmetic_mc"]["acc,none"] == pytest.approx(logged["lm_eval/arithmetic_mc/acc"][4], abs=1e-6)
    assert tool["arithmetic_gen"]["exact_match,strip"] == pytest.approx(
        logged["lm_eval/arithmetic_gen/exact_match/strip"][4], abs=1e-6
    )

    from lm_eval.models.huggingface import HFLM

    from titanium.evaluation.harness import TaskRun, run_tasks

    merged = HFLM(pretrained=str(run / "hf"), device="cpu", batch_size=4, dtype="float32")
    hf = run_tasks(merged, TaskRun(tasks=TASK_ARGS[1].split(","), limit=16, apply_chat_template=True), task_manager)
    assert_same_scores(results_of(tmp_path / "t"), hf)
