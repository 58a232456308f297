"""One dataclass per TOML section. Each component receives its own section, never the whole job.

Every field has a default and a docstring; the docstrings are what `--help` and
`docs/configuration.md` show, so write them for users. Range checks live in `validate.py`. The job config is
``CoreConfig`` plus the sections of the registered components (titanium/config/components.py); component sections
live here too because the loader must read them before anything heavy is imported.
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
    print_config: bool = False
    """Also print the whole resolved config on rank 0 at start-up. It is always saved to dump_folder/config.toml (the
    log names the file) and logged at debug level (TITANIUM_LOG_LEVEL=DEBUG)."""


@dataclass
class ModelSection:
    name: str = "auto"
    """Model family, a key of the model registry: llama3 (Llama 3.1/3.2/3.3), qwen3 (Qwen3 dense), qwen3_moe
    (Qwen3-MoE), qwen2 (Qwen2/2.5), mistral (Mistral 7B, NeMo), phi3 (Phi-3, Phi-4), gemma2 (Gemma 2), or
    transformers (the transformers backend: any causal LM the installed transformers knows, built from its
    config.json). auto: what the Hugging Face config.json the run builds from says (checkpoint.initial_load_in_hf,
    or hf_config; see backend), else llama3."""
    flavor: str = "debugmodel"
    """Size preset of the family, with its parameter count: llama3: debugmodel (5.68M), 1B (1.24B), 3B (3.21B),
    8B (8.03B), 70B (70.6B), 405B (406B); qwen3: debugmodel (6.48M), 0.6B (596M), 1.7B (1.72B), 4B (4.02B),
    8B (8.19B), 14B (14.8B), 32B (32.8B); qwen3_moe: debugmodel_moe (9.03M), 30B-A3B (30.5B), 235B-A22B (235B);
    qwen2: debugmodel (5.11M), 0.5B (494M), 1.5B (1.54B), 3B (3.09B),
    7B (7.62B), 14B (14.8B), 32B (32.8B), 72B (72.7B); mistral: debugmodel (5.68M), 7B (7.25B), NeMo-12B (12.2B);
    phi3: debugmodel (5.88M), mini (3.82B), medium (14B), phi4-14B (14.7B); gemma2: debugmodel (5.3M), 2B (2.61B),
    9B (9.24B), 27B (27.2B). Not used when the model is built from a Hugging Face config.json
    (checkpoint.initial_load_in_hf, or hf_config): that file gives the shape."""
    backend: Literal["auto", "native", "transformers"] = "auto"
    """What builds a model from a Hugging Face config.json. native: the titanium family that reads its model_type
    (the fast path). transformers: transformers' own model code (any causal-LM model_type it knows) under
    titanium's parallelism, attention, objectives and checkpoints. auto: native where a family reads the
    model_type, else transformers. The start-up log says which was chosen and why."""
    hf_config: str = ""
    """A Hugging Face model folder (or its config.json) whose architecture to build when the run does not start from
    Hugging Face weights (the weights then start from the seeded initialization). Empty: the flavor, or the
    config.json of checkpoint.initial_load_path with initial_load_in_hf."""
    trust_remote_code: bool = False
    """Let the transformers backend run modeling code that a config.json names of its own (auto_map), from the
    folder it lies in. Only for folders whose code you trust: it runs with your permissions. Off: such a model is
    refused unless transformers itself knows its model_type."""
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    """Kernel for masked attention (packed documents, context parallelism); rows without documents always use
    causal SDPA. flex: FlexAttention with block masks built once per batch, so masked blocks cost nothing (CUDA
    only: its backward does not run on CPU). sdpa: SDPA with a dense boolean mask (exact, O(seq_len^2) memory).
    auto: flex on CUDA, sdpa elsewhere."""


@dataclass
class TokenizerSection:
    kind: Literal["tiktoken", "byte", "hf"] = "tiktoken"
    """tiktoken: a BPE ranks file in the Llama 3 format. hf: a Hugging Face tokenizer folder (or its
    tokenizer.json), tokenized exactly as transformers' AutoTokenizer does; BOS/EOS/PAD and the chat template come
    from its tokenizer_config.json. byte: 256 byte tokens plus specials (tests). A run that starts from a Hugging
    Face folder with tokenizer files (checkpoint.initial_load_in_hf) uses that folder's tokenizer unless this
    section is set; a tokenizer set here must then be the folder's own (same ids)."""
    path: str = "assets/tokenizer/titanium_debug.tiktoken"
    """Tokenizer file or folder (for kind=tiktoken or hf). Relative paths are resolved from the working
    directory."""


@dataclass
class DataSection:
    kind: Literal["auto", "text", "synthetic", "chat", "instruct", "preference", "unpaired"] = "auto"
    """auto: told from the dataset's columns at start-up, as TRL does (and said in the log): messages_column or
    prompt_column (+ completion_column) -> chat, chosen_column + rejected_column -> preference, completion_column +
    label_column -> unpaired, instruction_column + output_column -> instruct, text_column -> text; pretraining
    always reads text. text: documents read through the `datasets` library (pretraining windows; under the sft
    objective, one sample per document: text completion). synthetic: random tokens, no I/O (benchmarks).
    chat: conversations (a list of role/content messages per row), or, in a row with completion_column, TRL's
    prompt/completion rows (two strings: plain text; two message lists: through the chat template; loss on
    the completion only). instruct: instruction/input/output rows. chat and instruct need training.objective =
    "sft". preference: a prompt with a chosen and a rejected response per row (DPO; see prompt_column,
    chosen_column, rejected_column). unpaired: a prompt, one completion and a true/false label per row (KTO; see
    prompt_column, completion_column, label_column)."""
    path: str = "assets/corpus/train.jsonl"
    """A local file, glob or folder (.json, .jsonl, .parquet, .txt), or a hub dataset name (needs network)."""
    hub_config: str | None = None
    """Configuration name for a hub dataset (e.g. 'en' for allenai/c4); ignored for local files."""
    split: str = "train"
    """Dataset split to read (hub datasets; local files always form the 'train' split)."""
    text_column: str = "text"
    """Column holding the document text."""
    on_bad_row: Literal["skip", "fail"] = "skip"
    """What to do with a malformed row (a line that is not UTF-8 or not JSON, missing column, wrong type,
    unknown role, empty content, a conversation the chat template rejects): skip it (counted in the log)
    or stop with an error naming the file and row."""
    messages_column: str = "messages"
    """kind=chat: column with the list of messages (e.g. "messages", or "conversations" for ShareGPT data)."""
    role_key: str = "role"
    """kind=chat: key of a message's role ("from" in ShareGPT data). Roles: system, user, assistant
    (ShareGPT's human and gpt are accepted too)."""
    content_key: str = "content"
    """kind=chat: key of a message's text ("value" in ShareGPT data)."""
    instruction_column: str = "instruction"
    """kind=instruct: column with the instruction (the user's request)."""
    input_column: str = "input"
    """kind=instruct: optional column with extra input, appended to the instruction when not empty."""
    output_column: str = "output"
    """kind=instruct: column with the response the model learns to give."""
    prompt_column: str = "prompt"
    """kind=preference: column with the prompt both responses answer: a string (one user message; plain text with
    --chat.chat_template none) or a list of messages. A row without it must hold whole conversations in
    chosen_column and rejected_column; their shared first messages are then the prompt (Anthropic-HH style).
    kind=chat: the prompt of a prompt/completion row (see completion_column)."""
    chosen_column: str = "chosen"
    """kind=preference: column with the preferred response: a string (the assistant's answer) or a list of
    messages (the answer's turns, or the whole conversation starting with the prompt, as in UltraFeedback)."""
    rejected_column: str = "rejected"
    """kind=preference: column with the dispreferred response, in the same forms as chosen_column."""
    completion_column: str = "completion"
    """kind=chat: the column with what the model learns to write after prompt_column's prompt (TRL's
    prompt/completion rows): a string after a string prompt (plain text), a list of messages after a list. A row
    with this column is a prompt/completion row; one without it a conversation in messages_column. kind=unpaired:
    the completion (a string: the assistant's answer, or the answer's messages)."""
    label_column: str = "label"
    """kind=unpaired: column saying whether the completion is desirable (true) or undesirable (false)."""
    tools_column: str = "tools"
    """kind=chat and preference: column with the tool (function) schemas the conversation may call: a list of
    JSON objects, or that list as a JSON string. The tokenizer's chat template renders them, as
    transformers' apply_chat_template(tools=...) does; rows without it have no tools."""
    shards: int = 0
    """How many byte ranges each local .jsonl/.txt file is cut into; data-parallel rank r of W reads ranges r,
    r+W, r+2W... in turn and never another rank's lines. 0: one range per rank. A fixed value that every
    data-parallel degree you use divides makes each step read the same rows at any of those degrees (e.g. 8
    to compare 1, 2, 4 and 8 ranks). Parquet files, JSON arrays and hub datasets: every rank streams them
    and keeps every W-th row."""
    prefetch_batches: int = 2
    """Batches each rank prepares ahead in a background thread (reading, tokenizing, packing; in pinned memory
    on CUDA) while the model trains. 0: read inline, in the training loop. Resume stays exact either way."""


@dataclass
class TrainingSection:
    objective: str = "pretrain"
    """Training objective (see titanium/objectives/): pretrain (next-token cross-entropy on text windows),
    sft (supervised fine-tuning on chat/instruct/text samples; see [sft]), dpo (preference pairs against
    a frozen reference; see [dpo]), kto (completions labelled desirable or not, against a frozen reference; see
    [kto]) or grpo (rollouts scored by reward functions; see [grpo]); or your own
    objective class as 'package.module:ClassName', whose config section comes with it (see docs/extending.md)."""
    steps: int = 1000
    """Number of optimizer steps to train for. 0: evaluate only: run the evaluations the config turns on
    ([validation], [eval]) once on the weights as loaded (the run's checkpoint, checkpoint.initial_load_path, or a
    Hugging Face folder with initial_load_in_hf), log them and exit."""
    evaluate_untrained: bool = False
    """With steps 0 and no weights to load (no checkpoint.initial_load_path, no checkpoint of this run), evaluate
    the seeded initialization anyway (a baseline). Off: such a run is refused, as it is almost always a forgotten
    checkpoint.initial_load_path and would report an untrained model's scores."""
    local_batch_size: int = 8
    """Sequences per microbatch on each data-parallel rank."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks. -1 means local_batch_size x data-parallel degree;
    a larger multiple turns on gradient accumulation."""
    seq_len: int = 2048
    """Tokens per sequence."""
    mixed_precision_param: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype of forward and backward. auto: bfloat16 on CUDA and on a CPU with native bf16 (AVX512-BF16
    or AMX on x86, BF16 on Arm); float32 on other CPUs, which only emulate bf16 (the debug model trained 33x
    slower in bf16 than in float32 on an AVX2 CPU; an explicit bfloat16 there runs, with a warning). The
    start-up log names the dtype and why. Weights, optimizer state and the gradients the optimizer sees stay
    float32 in every layout. With FSDP (data-parallel or context-parallel degree > 1, alone or with TP/PP) each
    block's weights are all-gathered in this dtype and the block computes in it; without FSDP (one process,
    TP-only, PP-only) torch.autocast runs matmuls and attention in it on float32 weights (under PP around the
    whole schedule, backward included)."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter under FSDP."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    gc_freq: int = 50
    """Run Python's garbage collector every N steps (automatic GC is disabled during training)."""
    loss_chunk_size: int = 0
    """Chunked linear cross-entropy (pretrain and sft objectives): project the final hidden states onto the
    vocabulary and take the cross-entropy this many tokens at a time, recomputing each chunk's logits in the
    backward, so the full [tokens, vocab] logits never exist; tokens without a label are dropped before the
    projection. 0: the model computes all logits at once. Try 1024-4096 for large vocabularies. Not with
    pipeline parallelism."""


@dataclass
class OptimizerSection:
    name: Literal["AdamW", "Adam", "AdamW8bit", "AdamW4bit", "AdamWFp8"] = "AdamW"
    """AdamW or Adam from torch.optim, or AdamW from torchao.optim with its two moments stored in 8-bit,
    4-bit or FP8 blocks (about 1/4, 1/8 and 1/4 of AdamW's state bytes for tensors of 4096+ values)."""
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
    """Kernel choice of AdamW/Adam: fused (one kernel, CPU and CUDA), foreach (multi-tensor), or plain for-loop.
    (The torchao optimizers compile their own step.)"""
    tensor_lr: bool = False
    """Keep the LR in a tensor on the parameters' device that the LR schedule updates in place, so a step
    captured in a CUDA graph or compiled never meets a new Python number (nor syncs). AdamW/Adam with fused on
    any device, or any implementation on CUDA (foreach/for-loop then run capturable); otherwise the LR stays a
    float, with a warning. The torchao optimizers always keep their LR in a tensor."""
    early_step_in_backward: bool = False
    """Optimizer-in-backward: step each parameter as soon as its gradient is complete in backward and free the
    gradient at once, so the whole model's gradients never exist together (saves their memory). Needs one
    microbatch per step (--training.global_batch_size -1), --training.max_norm 0 and no pipeline parallelism.
    The logged grad_norm is 0 (the gradients are gone before the loop could measure them)."""


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
    tensor_parallel_degree: int = 1
    """Tensor (and sequence) parallel degree: each block's matrices are split over this many ranks,
    which exchange activations twice per block. Keep it within one node (fast links); it must divide
    the model's attention heads, KV heads and vocabulary, and training.seq_len."""
    enable_loss_parallel: bool = True
    """With tensor parallelism, compute the cross-entropy on vocabulary-sharded logits instead of
    gathering the full [batch, seq, vocab] logits on every rank."""
    pipeline_parallel_degree: int = 1
    """Pipeline parallel degree: the layers are cut into stages held by this many ranks, which pass
    activations point to point. The least communication of all degrees; costs pipeline bubbles."""
    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule, by torch's name: GPipe, 1F1B (one stage per rank); Interleaved1F1B,
    LoopedBFS, InterleavedZeroBubble (several stages per rank, looped placement); ZBVZeroBubble,
    DualPipeV (two stages per rank, V-shaped placement)."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline microbatch; training.local_batch_size must be a multiple of it."""
    pipeline_parallel_layers_per_stage: int = -1
    """Transformer blocks per stage. -1: one stage per rank for single-stage schedules, two per rank
    for multi-stage ones, layers spread evenly."""
    pipeline_parallel_split_points: list[str] = field(default_factory=list)
    """Explicit cuts: the first block of every stage but the first, e.g. ["layers.4", "layers.8"].
    Overrides pipeline_parallel_layers_per_stage."""
    context_parallel_degree: int = 1
    """Context parallel degree: each sequence is split over this many ranks (head-tail load balanced);
    attention all-gathers keys and values. For long sequences; training.seq_len must divide by 2 x this."""
    expert_parallel_degree: int = 1
    """Expert parallel degree (MoE models): each MoE layer's experts are divided over this many ranks, which
    send every token to the ranks holding its experts and back (two all-to-alls per layer). The ranks are
    borrowed from the data-parallel shard dimension (data_parallel_shard_degree x context_parallel_degree
    must be a multiple of it), so it needs no extra GPUs; FSDP shards the experts over what is left."""


@dataclass
class MoESection:
    load_balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    """How an MoE model keeps its experts evenly loaded (dense models ignore [moe]). aux_loss: the Switch-style
    auxiliary loss transformers trains Qwen3-MoE with, weighted by aux_loss_coef and added to the objective's
    loss (its statistics are summed over the data-parallel ranks first, so any layout gives one process's value;
    not with pipeline parallelism). bias: DeepSeek-V3's aux-loss-free balancing, a per-expert bias added to the
    router scores only to choose experts, moved after every optimizer step towards an even load (Qwen3-MoE's
    Hugging Face format has no slot for it, so such a model cannot be exported there). none: neither."""
    aux_loss_coef: float | None = None
    """Weight of the auxiliary loss; unset: the model's own (router_aux_loss_coef of its config.json, 0.001
    for the Qwen3-MoE flavors)."""
    bias_update_rate: float = 0.001
    """Step of the aux-loss-free bias update, per layer: bias += rate x sign(mean load - expert load), from the
    tokens each expert received in the optimizer step (summed over all ranks)."""


@dataclass
class ActivationCheckpointSection:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in the backward instead of keeping them: none; full (each block keeps
    only its input); selective (see selective_ac_option)."""
    selective_ac_option: str = "op"
    """For mode=selective: "op" keeps the outputs of matmuls, attention and TP reduce-scatters and
    recomputes the cheap ops in between; an integer N ("2") fully checkpoints every N-th block."""


@dataclass
class CompileSection:
    enable: bool = False
    """torch.compile each transformer block (fullgraph), after activation checkpointing and before FSDP.
    All blocks share one graph, so compile time does not grow with depth."""
    enable_async_tensor_parallel: bool = False
    """Overlap tensor-parallel communication with the matmuls (inductor micro-pipelining over symmetric
    memory). Needs compile.enable, tensor_parallel_degree > 1 and CUDA."""


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
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """disabled: the loop waits for each save. async: copy the state to CPU memory, write in a
    background thread. async_with_pinned_mem: stage into pinned shared memory (in the background
    on GPU) and write from a separate process; the next optimizer step waits only for staging."""
    create_seed_checkpoint: bool = False
    """Initialize the model, save it as step-0 (model only) and exit; any layout may write it (every layout
    initializes the same weights). Any parallel layout that resumes from it starts from exactly these weights."""
    last_save_model_only: bool = False
    """The final save holds only the model weights (smaller; enough for evaluation or export)."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts of a checkpoint not to restore on resume, e.g. ["optimizer", "lr_scheduler", "data"]
    (valid: model, optimizer, lr_scheduler, train_state, data, rng; ppo's value_model, value_optimizer)."""
    initial_load_path: str | None = None
    """Weights to start from when this run has no checkpoint of its own yet (resuming one always
    wins). With initial_load_in_hf: a Hugging Face folder (config.json + *.safetensors)."""
    initial_load_model_only: bool = True
    """With initial_load_path (a titanium step-N folder): load only the model weights, not the
    optimizer, schedule and data position (fine-tuning from a pretrained run)."""
    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face checkpoint folder. Its config.json gives the family ([model] name, which
    may be left out), the architecture and the vocabulary size ([model] flavor is not used), and its tokenizer files
    the tokenizer and chat template (unless [tokenizer] is set). A tokenizer from elsewhere must fit the embedding:
    never more ids, and fewer only by padding (under 1,024). Only safetensors are read."""
    last_save_in_hf: bool = False
    """At the end of training, also write the model as a Hugging Face checkpoint to hf_folder. A run
    that started from a Hugging Face folder is written with its keys, files, index and config.json,
    and its tokenizer and generation_config.json are copied (any HF tool can load the result)."""
    hf_folder: str = "hf"
    """Where last_save_in_hf writes, relative to job.dump_folder."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the weights in the Hugging Face export (last_save_in_hf); also the default of
    `python -m titanium.tools.convert to-hf --dtype`. float32 keeps the trained weights exactly."""
    export_at_saves: bool = False
    """Every checkpoint save before the last also writes the end-of-training exports of the run as they are at
    that step, each in a folder of its own: the LoRA adapter in PEFT layout ([lora] save_adapter) to
    {adapter_folder}-step-N and, with last_save_in_hf, the Hugging Face model to {hf_folder}-step-N (as TRL's
    save_steps). Nothing removes them (keep_latest_k removes only checkpoints)."""
    push_to_hub: str = ""
    """A Hugging Face hub repository ("user/repo"): at the end of training, upload the Hugging Face export
    (needs last_save_in_hf) with huggingface_hub's upload_folder, creating the repository (private) if it does
    not exist. The token comes from HF_TOKEN (or `hf auth login`) and is checked before training starts. "": no
    upload. (A LoRA adapter: python -m titanium.tools.convert to-peft ... --push-to-hub user/repo.)"""


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
    run_name: str = ""
    """This run's name: the W&B run's name, and a TensorBoard folder of its own under save_tb_folder
    (tb/<run_name>), so runs sharing a tb folder show side by side. "": W&B's generated name, and save_tb_folder
    itself."""
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
    trace_buf_size: int = 20000
    """Flight Recorder: each rank keeps its last N collectives (op, sizes, process group, Python stack).
    When a collective times out every rank writes them to save_traces_folder (NCCL does it itself;
    on gloo a titanium watchdog); `torchfrtrace` then names the collective and the ranks that did not
    join it (docs/debugging.md). 0 turns the recorder off."""
    save_traces_folder: str = "comm_traces"
    """Flight Recorder traces, relative to job.dump_folder: one file rank_<N> per rank."""


@dataclass
class ProfilingSection:
    enable_profiling: bool = False
    """Record torch.profiler traces (CPU, and CUDA kernels on GPUs) of profiler_active steps every
    profile_freq steps, one file per rank (open in https://ui.perfetto.dev)."""
    save_traces_folder: str = "profile_traces"
    """Profiler traces, relative to job.dump_folder: iteration_<step>/rank<N>_trace.json."""
    profile_freq: int = 10
    """Trace (and snapshot memory) every N steps: the traces end at steps N, 2N, ..."""
    profiler_warmup: int = 3
    """Steps the profiler runs unrecorded before each trace, so its own start-up stays out."""
    profiler_active: int = 1
    """Steps recorded in each trace (the last of each profile_freq window)."""
    enable_memory_snapshot: bool = False
    """CUDA only (a CPU run warns and goes on): record allocator history and write a memory snapshot
    every profile_freq steps and when CUDA runs out of memory (view at https://pytorch.org/memory_viz)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshots, relative to job.dump_folder: iteration_<step>/rank<N>_memory_snapshot.pickle,
    and oom_rank<N>_memory_snapshot.pickle on out-of-memory."""


@dataclass
class DebugSection:
    seed: int = 0
    """Seed for weight init, data order and dropout; the same seed gives the same run."""
    deterministic: bool = False
    """Use deterministic algorithms only (slower); with the same seed, runs are bitwise repeatable."""


@dataclass
class ChatSection:
    chat_template: Literal["auto", "llama3", "chatml", "qwen3", "tokenizer", "none"] = "auto"
    """How messages become tokens, for every objective that reads conversations (SFT samples, DPO pairs, GRPO
    prompts) and for evaluation. llama3: <|start_header_id|>role<|end_header_id|>... <|eot_id|>. chatml:
    <|im_start|>role ... <|im_end|> (Qwen). qwen3: ChatML as Qwen3's own template renders chats without reasoning
    (the last answer opens with an empty <think></think> block, not learned). tokenizer: the HF tokenizer's own
    Jinja chat_template (the only one that renders tools, tool calls and tool messages). auto: the tokenizer's
    template if it has one, else the model family's format (llama3, qwen3). none (SFT and DPO, for base models):
    no template; string rows are plain text as TRL tokenizes them (BOS + prompt + response + EOS), and preference
    rows of strings too (with a template they are a user turn and assistant answers); rows of messages stop
    the run. Formerly [sft] chat_template, which is still read (with a deprecation warning)."""
    system_prompt: str | None = None
    """Replace (or add) the system message of every conversation (SFT samples, DPO pairs, GRPO and evaluation
    prompts). Formerly [sft] system_prompt, which is still read (with a deprecation warning)."""


@dataclass
class LoRASection:
    rank: int = 0
    """LoRA rank r; 0 turns LoRA off (full fine-tuning). With LoRA the base weights are frozen and
    only the low-rank adapters train."""
    alpha: float = 16.0
    """LoRA scaling numerator: the adapter's update is (alpha / rank) * B @ A (alpha / sqrt(rank) with
    use_rslora)."""
    dropout: float = 0.0
    """Dropout on the adapter's input."""
    target_modules: list[str] = field(default_factory=lambda: ["wq", "wk", "wv", "wo"])
    """Linear layers that get adapters, by name: wq, wk, wv, wo (attention), w1, w2, w3 (MLP), output, or their
    Hugging Face names (q_proj, k_proj, v_proj, o_proj, gate_proj, down_proj, up_proj, lm_head; either name finds
    the layer in models of both backends), or DeepSeek's latent-attention q_a_proj, q_b_proj, kv_a_proj_with_mqa,
    kv_b_proj; "attention" and "mlp" stand for those of their layers a model has; experts: the stacked w1, w2, w3
    of every MoE layer's routed experts (one adapter per expert, sharded with them; no dropout, DoRA or nf4
    base). PEFT's spellings work too, matched against the layers' Hugging Face names as PEFT matches them:
    self_attn.o_proj, all-linear (the blocks' linear layers), or a regular expression over the whole name."""
    vision_modules: bool = False
    """Image-text models: adapt the layers of the vision tower and projector that target_modules matches too (as PEFT
    adapts every layer its target_modules match; all-linear: every linear layer of them); off: the language model's
    layers only."""
    quantize_base: Literal["none", "nf4"] = "none"
    """QLoRA: store the frozen base weights of adapted layers as 4-bit NF4 (torchao)."""
    use_dora: bool = False
    """DoRA (weight-decomposed LoRA, PEFT's use_dora): each adapted weight becomes a trainable magnitude per
    output row times the unit-norm direction of W + scale * B @ A. Composes with NF4 (QLoRA), not with QAT."""
    use_rslora: bool = False
    """rsLoRA (PEFT's use_rslora): scale the update by alpha / sqrt(rank) instead of alpha / rank, so its size
    does not shrink as the rank grows."""
    save_adapter: bool = True
    """At the end of training, write the adapter in PEFT layout (adapter_config.json,
    adapter_model.safetensors with Hugging Face key names) to job.dump_folder/adapter_folder."""
    adapter_folder: str = "adapter"
    """Where save_adapter writes, relative to job.dump_folder."""


@dataclass
class Float8Section:
    enable: bool = False
    """Train the linear layers in float8 (torchao): each matmul's inputs are scaled and cast to float8 on the
    fly, while weights, gradients and optimizer state stay in high precision. Needs float8 tensor cores (CUDA
    compute capability 8.9+, e.g. H100) unless emulate is on."""
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """torchao's scaling recipe. tensorwise: one scale per tensor (fastest). rowwise: one scale per row, e4m3
    everywhere (more accurate; needs compute capability 9.0). rowwise_with_gw_hp: rowwise, with the weight
    gradient computed in high precision (most accurate)."""
    enable_fsdp_float8_all_gather: bool = False
    """tensorwise only: FSDP gathers the weights already cast to float8 (half the bytes of bf16)."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With enable_fsdp_float8_all_gather: compute the scales of all float8 weights after each optimizer step
    in one all-reduce, instead of one small all-reduce per layer in the forward."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Layers left in high precision: a linear layer whose name contains any of these strings (e.g. "output",
    "layers.0."). Layers whose dimensions are not multiples of 16 (a float8 kernel requirement) always are."""
    auto_filter_small_kn: bool = False
    """Also leave in high precision the layers torchao's benchmarks show too small to gain from float8 (per
    recipe; not available for rowwise_with_gw_hp)."""
    emulate: bool = False
    """Emulate the float8 matmuls in high precision (values still rounded to float8): runs on CPU and on GPUs
    without float8 tensor cores, for tests; no speed-up."""


@dataclass
class QATSection:
    enable: bool = False
    """Quantization-aware training (torchao): the chosen linear layers fake-quantize their weights (and
    activations) during training, so the model learns to work quantized; at the end they are quantized for
    real and saved (save_quantized). Composes with LoRA (the adapters learn around the quantized base)."""
    scheme: Literal["int8_dynamic_activation_int4_weight", "int4_weight_only"] = "int8_dynamic_activation_int4_weight"
    """int8_dynamic_activation_int4_weight: int4 weights in groups of group_size along the input (symmetric),
    activations quantized per token to int8 at run time (the ExecuTorch/XNNPACK "8da4w" scheme).
    int4_weight_only: the same int4 weights, activations in high precision."""
    group_size: int = 32
    """Input features that share one weight scale; must divide the input size of every quantized layer."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Layers left in high precision: a linear layer whose name contains any of these strings."""
    save_quantized: bool = True
    """At the end of training, write the quantized model to job.dump_folder/quantized_folder
    (model.safetensors in torchao's tensor-subclass layout, plus quantization.json; see docs/quantization.md)."""
    quantized_folder: str = "quantized"
    """Where save_quantized writes, relative to job.dump_folder."""


@dataclass
class EvalSection:
    interval: int = 0
    """Every N steps (and after the last), measure exact-match accuracy of greedy answers on a held-out
    set; 0 turns evaluation off."""
    path: str = "assets/tasks/arithmetic/test.jsonl"
    """Held-out chat data (same columns as [data] kind=chat); each row's last message is the assistant
    answer to match, everything before it is the prompt."""
    max_samples: int = 128
    """Evaluate on the first N rows (over all data-parallel ranks)."""
    max_new_tokens: int = 16
    """Tokens generated per answer (greedy); generation stops early at the end-of-turn token."""
    batch_size: int = 32
    """Prompts generated together on each data-parallel rank."""
    temperature: float = 0.0
    """0: greedy answers. > 0: answers sampled at this temperature, e.g. the policy GRPO trains (its
    grpo.temperature), from the same seed at every evaluation; the score is over all samples_per_prompt."""
    samples_per_prompt: int = 1
    """Sampled answers per held-out prompt (temperature > 0), for a less noisy score."""


@dataclass
class GuardsSection:
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """What to do when a step's loss or gradient norm is NaN or infinite. It is detected on the device every step,
    without waiting for the device. stop: the run ends at the next log or checkpoint step with an error naming the
    first bad step (exit code 2); no checkpoint is written after it, and fused Adam/AdamW hold the weights and their
    state at the last good step meanwhile. skip: the optimizer leaves the weights and its state untouched for that
    step (fused Adam/AdamW inside their kernel; other optimizers read the flag every step, one host sync; not with
    optimizer.early_step_in_backward) and training goes on; the console line counts the skipped steps. A skipped
    step still uses up its data and its learning-rate step."""
    max_skipped_steps: int = 10
    """With on_nonfinite = "skip": stop (as "stop" would) once more than this many steps were skipped in this run,
    checked at log and checkpoint steps; 0 sets no limit."""
    loss_spike_ratio: float = 1.5
    """Log a warning naming the step when a step's loss is more than this multiple of its running mean (the worst
    spike since the last log line, and how many there were); 0 turns spike logging off. Objectives whose loss sits
    near 0 with either sign (grpo) have no spike logging: a ratio to their mean is noise."""
    loss_spike_window: int = 100
    """The running mean of the loss for spike logging is an exponential average over about this many steps."""


@dataclass
class ValidationSection:
    interval: int = 0
    """Every N steps (and after the last), compute the loss on held-out data: the training objective's data
    pipeline on validation.path, its loss, forward only, under the same parallel plan (FSDP, TP, PP, CP). Logged as
    validation/loss, the number of loss units it averages (validation/tokens; validation/pairs for DPO), for a
    token loss validation/perplexity, and the objective's own metrics over the same data (validation/reward/accuracy:
    a reward model's held-out pair accuracy; validation/dpo/accuracy, validation/kd/divergence, ...). 0 turns
    validation off."""
    path: str = "assets/corpus/validation.jsonl"
    """Held-out data in the training data's format ([data] kind and columns). Every validation reads it from its
    start, so the numbers are comparable over the run. With data.kind synthetic the windows are drawn from another
    seed than training's and this path is not read."""
    steps: int = 10
    """Microbatches per validation, each of training.local_batch_size sequences on every data-parallel rank."""


@dataclass
class FaultToleranceSection:
    enable: bool = False
    """Train as one of several replica groups coordinated by a torchft lighthouse (needs the `ft` extra). Each group
    is its own torchrun job (FSDP/TP inside it); gradients are averaged across the live groups every step, a step
    commits only when the quorum agrees, a dead group is dropped and a restarted one copies the weights, optimizer
    and LR schedule from a live peer. See docs/fault_tolerance.md."""
    replica_id: int = 0
    """This group's index, 0 .. group_size - 1. It picks the group's data shard; only group 0 writes checkpoints."""
    group_size: int = 1
    """Number of replica groups. The data is split group_size x (data-parallel degree) ways."""
    lighthouse: str = ""
    """Address of the torchft lighthouse, e.g. http://127.0.0.1:29510; empty: the TORCHFT_LIGHTHOUSE variable."""
    hostname: str = ""
    """Host name or IP this group's manager tells its peers to reach it at (they fetch weights from it when they
    heal); empty: this machine's host name. Use 127.0.0.1 when every group runs on one machine."""
    min_replica_size: int = 1
    """A step commits only when at least this many replica groups took part in it; otherwise it is retried."""
    timeout_seconds: int = 60
    """Timeout of the cross-group gradient all-reduce, the commit vote and the weight transfer when healing."""
    quorum_timeout_seconds: int = 120
    """How long a step waits for the lighthouse to form a quorum of replica groups (with local_sgd: a sync)."""
    semi_sync_method: Literal["none", "local_sgd"] = "none"
    """none: average the gradients over the groups every step. local_sgd: each group steps on its own gradients
    and the groups average their weights every sync_steps steps (torchft.local_sgd.LocalSGD); a group that
    rejoins heals at the next sync."""
    sync_steps: int = 10
    """With semi_sync_method = "local_sgd": optimizer steps between weight averages."""


@dataclass
class CoreConfig:
    """The job: the loop's own sections. Each component registered in titanium/config/components.py adds its
    section after these (titanium/config/registry.py); built from dataclass defaults < TOML file < CLI flags."""

    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: DataSection = field(default_factory=DataSection)
    chat: ChatSection = field(default_factory=ChatSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    activation_checkpoint: ActivationCheckpointSection = field(default_factory=ActivationCheckpointSection)
    compile: CompileSection = field(default_factory=CompileSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    comm: CommSection = field(default_factory=CommSection)
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
    debug: DebugSection = field(default_factory=DebugSection)
    guards: GuardsSection = field(default_factory=GuardsSection)
    fault_tolerance: FaultToleranceSection = field(default_factory=FaultToleranceSection)


# The objectives' sections live beside their checks; imported here too, the one place every section is found.
from titanium.config.preference_sections import DPOSection as DPOSection  # noqa: E402
from titanium.config.preference_sections import KTOSection as KTOSection  # noqa: E402
from titanium.config.preference_sections import RewardSection as RewardSection  # noqa: E402
from titanium.config.rl_objective_sections import GRPOSection as GRPOSection  # noqa: E402
from titanium.config.rl_objective_sections import OnlineDPOSection as OnlineDPOSection  # noqa: E402
from titanium.config.rl_objective_sections import PPOSection as PPOSection  # noqa: E402
from titanium.config.rl_sections import EnvironmentSection as EnvironmentSection  # noqa: E402
from titanium.config.rl_sections import RLSection as RLSection  # noqa: E402
from titanium.config.rl_sections import RolloutSection as RolloutSection  # noqa: E402
from titanium.config.sample_sections import KDSection as KDSection  # noqa: E402
from titanium.config.sample_sections import PadToOption as PadToOption  # noqa: E402
from titanium.config.sample_sections import SFTSection as SFTSection  # noqa: E402
