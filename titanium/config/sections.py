"""One dataclass per TOML section. Each component receives its own section, never the whole job.

Every field has a default and a docstring; the docstrings are what `--help` and
`docs/configuration.md` show, so write them for users. Range checks live in `validate.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class JobSection:
    config_file: str | None = None
    """TOML job config to load; its values override the defaults, and CLI flags override it."""
    dump_folder: str = "./outputs"
    """Folder for everything the run writes: resolved config, TensorBoard events, checkpoints."""
    description: str = ""
    """Free text describing the run; printed at start-up and saved with the config."""
    print_config: bool = True
    """Print the resolved config on rank 0 at start-up."""


@dataclass
class ModelSection:
    name: str = "llama3"
    """Model family, a key of the model registry (titanium.models)."""
    flavor: str = "debugmodel"
    """Size preset of the family, e.g. debugmodel, 1B, 8B, 70B, 405B for llama3."""


@dataclass
class TokenizerSection:
    kind: Literal["tiktoken", "byte"] = "tiktoken"
    """tiktoken: a BPE ranks file in the Llama 3 format. byte: 256 byte tokens plus specials (tests)."""
    path: str = "assets/tokenizer/titanium_debug.tiktoken"
    """Tokenizer file (for kind=tiktoken). Relative paths are resolved from the working directory."""


@dataclass
class DataSection:
    kind: Literal["text", "synthetic"] = "text"
    """text: documents read through the `datasets` library. synthetic: random tokens, no I/O (benchmarks)."""
    path: str = "assets/corpus/train.jsonl"
    """A local file, glob or folder (.json, .jsonl, .parquet, .txt), or a hub dataset name (needs network)."""
    hub_config: str | None = None
    """Configuration name for a hub dataset (e.g. 'en' for allenai/c4); ignored for local files."""
    split: str = "train"
    """Dataset split to read (hub datasets; local files always form the 'train' split)."""
    text_column: str = "text"
    """Column holding the document text."""
    on_bad_row: Literal["skip", "fail"] = "skip"
    """What to do with a row whose text column is missing or not a string: skip it (counted in the
    log) or stop with an error naming the file and row."""


@dataclass
class TrainingSection:
    objective: Literal["pretrain"] = "pretrain"
    """Training objective (see titanium/trainers/)."""
    steps: int = 1000
    """Number of optimizer steps to train for."""
    local_batch_size: int = 8
    """Sequences per microbatch on each data-parallel rank."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks. -1 means local_batch_size x data-parallel degree;
    a larger multiple turns on gradient accumulation."""
    seq_len: int = 2048
    """Tokens per sequence."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Parameter dtype for forward/backward under FSDP (weights are kept in float32 for the optimizer).
    A single process without FSDP trains in float32."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter under FSDP."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    gc_freq: int = 50
    """Run Python's garbage collector every N steps (automatic GC is disabled during training)."""


@dataclass
class OptimizerSection:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer class from torch.optim."""
    lr: float = 8e-4
    """Peak learning rate (reached at the end of warmup)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay for matrices (AdamW)."""
    decay_norms_and_embeddings: bool = False
    """Also apply weight decay to norm weights, biases and embeddings (off by default, as is usual)."""
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """Kernel choice: fused (one kernel, CPU and CUDA), foreach (multi-tensor), or plain for-loop."""


@dataclass
class LRSchedulerSection:
    warmup_steps: int = 200
    """Linear warmup from ~0 to optimizer.lr over this many steps."""
    decay_ratio: float | None = None
    """Fraction of the steps spent decaying, at the end (warmup-stable-decay, WSD). None decays over
    every step after warmup."""
    decay_type: Literal["linear", "cosine", "sqrt"] = "linear"
    """Shape of the decay phase."""
    min_lr_factor: float = 0.0
    """The LR decays to optimizer.lr x min_lr_factor."""


@dataclass
class ParallelismSection:
    data_parallel_replicate_degree: int = 1
    """Replicas in HSDP (each replica holds a full copy, sharded over data_parallel_shard_degree)."""
    data_parallel_shard_degree: int = -1
    """FSDP sharding degree. -1 takes what is left of the world size."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward (saves memory, costs an all-gather in backward).
    default = always, except under pipeline parallelism."""


@dataclass
class CheckpointSection:
    enable: bool = False
    """Save training state (DCP) during and at the end of the run, and resume from the newest one."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder; one sub-folder step-N per save."""
    interval: int = 500
    """Save every N steps (the last step is always saved)."""
    keep_latest_k: int = 0
    """Keep only the newest K complete checkpoints; 0 keeps all."""
    load_step: int = -1
    """Resume from this step's checkpoint; -1 resumes from the newest complete one, if any."""


@dataclass
class MetricsSection:
    log_freq: int = 10
    """Log a line (and TensorBoard / W&B scalars) every N steps, plus the first and last step."""
    enable_tensorboard: bool = True
    """Write TensorBoard event files."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""
    enable_wandb: bool = False
    """Log to Weights & Biases (pip install 'titanium[wandb]'); set WANDB_MODE=offline to stay local."""
    wandb_project: str = "titanium"
    """W&B project name."""
    disable_color_printing: bool = False
    """Plain console lines without ANSI colors."""
    save_for_all_ranks: bool = False
    """Every rank writes its own TensorBoard folder (default: rank 0 only)."""


@dataclass
class CommSection:
    init_timeout_seconds: int = 300
    """Timeout for collectives during start-up (process group creation, first step)."""
    train_timeout_seconds: int = 100
    """Timeout for collectives after the first step; a hung collective fails after this long."""


@dataclass
class DebugSection:
    seed: int = 0
    """Seed for weight init, data order and dropout; the same seed gives the same run."""
    deterministic: bool = False
    """Use deterministic algorithms only (slower); with the same seed, runs are bitwise repeatable."""


@dataclass
class JobConfig:
    """The whole job. Built from dataclass defaults < TOML file < CLI flags."""

    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    comm: CommSection = field(default_factory=CommSection)
    debug: DebugSection = field(default_factory=DebugSection)
