"""Options as TRL / transformers' TrainingArguments name them, and titanium's for the same setting.

A user coming from TRL types ``--learning_rate 1e-4``; the CLI parser would only say the option is unrecognized.
``check_trl_names`` turns that into one message naming titanium's option. Only bare names (no section) are
looked at, so nothing titanium accepts is touched.
"""

from __future__ import annotations

from titanium.config.errors import ConfigError

TRL_NAMES = {
    "learning_rate": "--optimizer.lr",
    "weight_decay": "--optimizer.weight_decay",
    "per_device_train_batch_size": "--training.local_batch_size",
    "gradient_accumulation_steps": (
        "--training.global_batch_size (the whole step's rows: local_batch_size x data-parallel degree x the "
        "accumulation steps)"
    ),
    "max_steps": "--training.steps",
    "num_train_epochs": "--training.steps (titanium counts optimizer steps, not epochs)",
    "max_length": "--training.seq_len",
    "max_seq_length": "--training.seq_len",
    "max_grad_norm": "--training.max_norm",
    "bf16": "--training.mixed_precision_param bfloat16",
    "gradient_checkpointing": "--activation_checkpoint.mode full",
    "warmup_steps": "--lr_scheduler.warmup_steps",
    "lr_scheduler_type": "--lr_scheduler.decay_type",
    "output_dir": "--job.dump_folder",
    "seed": "--debug.seed",
    "logging_steps": "--metrics.log_freq",
    "report_to": "--metrics.enable_tensorboard / --metrics.enable_wandb",
    "save_steps": "--checkpoint.interval",
    "save_total_limit": "--checkpoint.keep_latest_k",
    "eval_steps": "--validation.interval",
    "model_name_or_path": "--checkpoint.initial_load_path FOLDER --checkpoint.initial_load_in_hf",
    "dataset_name": "--data.path",
    "beta": "--dpo.beta (DPO) or --grpo.beta (GRPO)",
    "loss_type": "--dpo.loss_type (DPO) or --grpo.loss_type (GRPO)",
    "label_smoothing": "--dpo.sigmoid.label_smoothing (robust and simpo: --dpo.<loss_type>.label_smoothing)",
    "simpo_gamma": "--dpo.simpo.gamma",
    "cpo_alpha": "--dpo.simpo.cpo_alpha",
    "rpo_alpha": "--dpo.rpo_alpha",
    "precompute_ref_log_probs": "--dpo.precompute_reference",
    "num_generations": "--grpo.group_size",
    "max_completion_length": "--rl.max_new_tokens",
    "max_prompt_length": "--dpo.max_prompt_length (DPO), --sft.max_prompt_length (SFT prompt/completion rows) or "
    "--rl.max_prompt_len (GRPO, which skips a longer prompt rather than cutting it)",
    "temperature": "--rl.temperature",
    "epsilon": "--grpo.epsilon_low and --grpo.epsilon_high",
    "reward_funcs": "--rl.rewards",
    "log_completions": "--rl.log_completions N (every N steps)",
    "num_completions_to_print": "--rl.log_completions_count",
    # PEFT's options as TRL's ModelConfig takes them (trl/trainer/model_config.py)
    "use_peft": "--lora.rank R (a rank above 0 turns LoRA on)",
    "lora_r": "--lora.rank",
    "lora_alpha": "--lora.alpha",
    "lora_dropout": "--lora.dropout",
    "lora_target_modules": "--lora.target_modules (PEFT's names are accepted: q_proj v_proj, all-linear)",
    "lora_target_parameters": "--lora.target_modules experts (the MoE experts' stacked weights)",
    "lora_modules_to_save": "nothing: titanium trains only the adapters with LoRA (full fine-tuning without it)",
    "lora_task_type": "nothing: the objective sets it (the reward objective exports a sequence classifier)",
    "use_rslora": "--lora.use_rslora",
    "use_dora": "--lora.use_dora",
    "load_in_4bit": "--lora.quantize_base nf4 (QLoRA)",
    "bnb_4bit_quant_type": "--lora.quantize_base nf4 (the only 4-bit type)",
    "load_in_8bit": "nothing: titanium's QLoRA stores the base in 4-bit NF4 (--lora.quantize_base nf4)",
    "dtype": "--training.mixed_precision_param",
    "torch_dtype": "--training.mixed_precision_param",
    "attn_implementation": "--model.attention",
    "dataset_config": "--data.hub_config",
    "dataset_train_split": "--data.split",
    "chat_template_path": "--chat.chat_template tokenizer, with the template in the tokenizer's chat_template.jinja",
}
"""TRL's option name -> titanium's option (with a word where the two differ in meaning)."""


def check_trl_names(argv: list[str]) -> None:
    """ConfigError naming titanium's option for the first ``--name`` in ``argv`` that is TRL's name for it."""
    for arg in argv:
        if not arg.startswith("--") or "." in arg.split("=", 1)[0]:
            continue
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        if name in TRL_NAMES:
            raise ConfigError(
                f"--{name} is TRL's name; titanium's is {TRL_NAMES[name]} (python -m titanium.train --help lists "
                "every option)"
            )
