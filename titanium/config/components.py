"""titanium's built-in components, each registered with what implements it and its config section.

Adding one is a line here plus its file (and its section dataclass in sections.py, light enough to be read before
anything heavy is imported). Code that is not titanium's registers the same way (``OBJECTIVES.register(...)``
before the config is loaded), or needs no registration at all: an import path works wherever a name does.
"""

from __future__ import annotations

import dataclasses

from titanium.config.errors import ConfigError
from titanium.config.job import job_config_class
from titanium.config.lm_eval_section import LMEvalSection
from titanium.config.preference_sections import DPO_LOSSES as DPO_LOSSES  # (the [dpo] loss variants)
from titanium.config.registry import Needs, Registry, SectionSpec
from titanium.config.rl_sections import ENGINES as ENGINES  # (the [rollout] engines)
from titanium.config.sections import (
    DPOSection,
    EnvironmentSection,
    EvalSection,
    Float8Section,
    GRPOSection,
    KDSection,
    KTOSection,
    LoRASection,
    MoESection,
    OnlineDPOSection,
    PPOSection,
    QATSection,
    RewardSection,
    RLSection,
    RolloutSection,
    SFTSection,
    ValidationSection,
)
from titanium.config.vision_section import VisionSection

RL_SECTIONS = (
    SectionSpec("rl", RLSection),
    SectionSpec("rollout", RolloutSection),
    SectionSpec("environment", EnvironmentSection),
)
"""What an RL objective reads besides its own section: the rollout source's prompts, sampling and rewards ([rl]), the
engine that generates them ([rollout]) and the environment of multi-turn episodes ([environment]); handed over by
keyword as ``rl=``, ``rollout=`` and ``environment=``."""

OBJECTIVES = Registry("objective", "--training.objective")
"""What to optimize (titanium/objectives/); the class takes ``(ObjectiveContext, DataSection, its section)`` and its
further sections by keyword (GRPO: ``rl=`` and ``rollout=``, its rollout source and engine)."""
_SAMPLES = Needs(("chat", "instruct", "text"), "trains on samples: --data.kind chat, instruct or text", token_loss=True)
_PAIRS = Needs(("preference",), "needs preference pairs: --data.kind preference", rows="pairs")
_PROMPTS = Needs(
    ("chat", "instruct", "text"), "reads prompts: --data.kind chat, instruct or text", "prompts", held_out_loss=False
)
OBJECTIVES.register(
    "pretrain",
    "titanium.objectives.pretrain:PretrainObjective",
    needs=Needs(("text", "synthetic"), "reads text windows: --data.kind text or synthetic", "documents", True),
)
OBJECTIVES.register(
    "sft",
    "titanium.objectives.sft:SFTObjective",
    SectionSpec("sft", SFTSection),
    needs=dataclasses.replace(_SAMPLES, images=True),
)
OBJECTIVES.register(
    "dpo",
    "titanium.objectives.dpo:DPOObjective",
    SectionSpec("dpo", DPOSection),
    needs=dataclasses.replace(_PAIRS, images=True),  # (one image set shared by a pair's two sides)
)
OBJECTIVES.register(
    "grpo",
    "titanium.objectives.grpo:GRPOObjective",
    SectionSpec("grpo", GRPOSection),
    RL_SECTIONS,
    dataclasses.replace(_PROMPTS, images=True),  # (titanium's engine only: titanium.rl.source.image_refusals)
)
OBJECTIVES.register(
    "online_dpo",
    "titanium.objectives.online_dpo:OnlineDPOObjective",
    SectionSpec("online_dpo", OnlineDPOSection),
    RL_SECTIONS,
    dataclasses.replace(_PROMPTS, images=True),  # (as GRPO's: one image set shared by a pair's two responses)
)
OBJECTIVES.register(
    "kd",
    "titanium.objectives.kd:KDObjective",
    SectionSpec("kd", KDSection),
    needs=dataclasses.replace(_SAMPLES, token_loss=False, images=True),  # (its own --kd.chunk_size)
)
OBJECTIVES.register(
    "kto",
    "titanium.objectives.kto:KTOObjective",
    SectionSpec("kto", KTOSection),
    needs=Needs(("unpaired",), "needs completions labelled true/false: --data.kind unpaired", "pairs", images=True),
)
OBJECTIVES.register(
    "reward",
    "titanium.objectives.reward:RewardObjective",
    SectionSpec("reward", RewardSection),
    needs=dataclasses.replace(_PAIRS, score_head=True),
)
OBJECTIVES.register(
    "ppo",
    "titanium.objectives.ppo:PPOObjective",
    SectionSpec("ppo", PPOSection),
    RL_SECTIONS,
    dataclasses.replace(_PROMPTS, score_head=True),
)


def unread_sections(objective: str) -> list[str]:
    """The objectives' sections ``objective`` does not read: what a job of it leaves out of its saved config.toml,
    and where a setting it changes would have no effect."""
    names = {spec.name for c in OBJECTIVES for spec in (c.section, *c.more_sections) if spec is not None}
    return sorted(name for name in names if not OBJECTIVES.reads(objective, name))


def check_reads_images(objective: str) -> None:
    """An image-text model trains only with objectives whose rows carry images (``Needs.images``); the others would
    train on the rows' text and drop their images."""
    if not OBJECTIVES.needs(objective).images:
        readers = ", ".join(name for name in OBJECTIVES.names() if OBJECTIVES.needs(name).images)
        raise ConfigError(
            f"--training.objective {objective}: an image-text model trains on images with {readers} only so far; "
            "use one of those, or the language model alone from a text-only checkpoint"
        )


CONVERTERS = Registry("model converter", "model converter")
"""Rewrites of the model's modules (titanium/models/converter.py), applied in this order: quantization before
LoRA, so LoRA adapts the layers as they will run. Each class's ``from_config(section, ConverterContext)`` returns
the converter, or None when its section leaves it off; a section at its defaults is off (titanium.model_setup)."""
CONVERTERS.register("float8", "titanium.quantize.float8:Float8Converter", SectionSpec("float8", Float8Section))
CONVERTERS.register("qat", "titanium.quantize.qat:QATConverter", SectionSpec("qat", QATSection))
CONVERTERS.register("lora", "titanium.peft.converter:LoRAConverter", SectionSpec("lora", LoRASection))
CONVERTERS.register("vision", "titanium.peft.vision_freeze:VisionFreezeConverter", SectionSpec("vision", VisionSection))

EVALUATIONS = Registry("evaluation", "evaluation")
"""What runs every N steps besides training; ``build(section, EvaluationContext)`` returns a ``Periodic`` (or None
when its section leaves it off)."""
EVALUATIONS.register("eval", "titanium.evaluation.exact_match:build_evaluator", SectionSpec("eval", EvalSection))
EVALUATIONS.register(
    "validation", "titanium.evaluation.validation:build_validator", SectionSpec("validation", ValidationSection)
)
EVALUATIONS.register("lm_eval", "titanium.evaluation.lm_eval:build_lm_eval", SectionSpec("lm_eval", LMEvalSection))

TRAINING_HOOKS = Registry("training hook", "training hook")
"""Features that hook into the loop (titanium/hooks.py) without the loop knowing them; ``register(section,
HookContext, TrainingHooks)`` registers what its section turns on (nothing for a model it does not apply to)."""
TRAINING_HOOKS.register("moe", "titanium.moe_balance:register_load_balancing", SectionSpec("moe", MoESection))

JobConfig = job_config_class()
"""The job config with every built-in section (``load_config`` adds an import-path objective's)."""
