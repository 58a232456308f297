"""titanium's built-in components, each registered with what implements it and its config section.

Adding one is a line here plus its file (and its section dataclass in sections.py, light enough to be read before
anything heavy is imported). Code that is not titanium's registers the same way (``OBJECTIVES.register(...)``
before the config is loaded), or needs no registration at all: an import path works wherever a name does.
"""

from __future__ import annotations

from titanium.config.lm_eval_section import LMEvalSection
from titanium.config.registry import Registry, SectionSpec, job_config_class
from titanium.config.sections import (
    DPOSection,
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

RL_SECTIONS = (SectionSpec("rl", RLSection), SectionSpec("rollout", RolloutSection))
"""What an RL objective reads besides its own section: the rollout source's prompts, sampling and rewards ([rl]) and
the engine that generates them ([rollout]); handed over by keyword as ``rl=`` and ``rollout=``."""

OBJECTIVES = Registry("objective", "--training.objective")
"""What to optimize (titanium/objectives/); the class takes ``(ObjectiveContext, DataSection, its section)`` and its
further sections by keyword (GRPO: ``rl=`` and ``rollout=``, its rollout source and engine)."""
OBJECTIVES.register("pretrain", "titanium.objectives.pretrain:PretrainObjective")
OBJECTIVES.register("sft", "titanium.objectives.sft:SFTObjective", SectionSpec("sft", SFTSection))
OBJECTIVES.register("dpo", "titanium.objectives.dpo:DPOObjective", SectionSpec("dpo", DPOSection))
OBJECTIVES.register(
    "grpo",
    "titanium.objectives.grpo:GRPOObjective",
    SectionSpec("grpo", GRPOSection),
    more_sections=RL_SECTIONS,
)
OBJECTIVES.register(
    "online_dpo",
    "titanium.objectives.online_dpo:OnlineDPOObjective",
    SectionSpec("online_dpo", OnlineDPOSection),
    more_sections=RL_SECTIONS,
)
OBJECTIVES.register("kd", "titanium.objectives.kd:KDObjective", SectionSpec("kd", KDSection))
OBJECTIVES.register("kto", "titanium.objectives.kto:KTOObjective", SectionSpec("kto", KTOSection))
OBJECTIVES.register("reward", "titanium.objectives.reward:RewardObjective", SectionSpec("reward", RewardSection))
OBJECTIVES.register(
    "ppo",
    "titanium.objectives.ppo:PPOObjective",
    SectionSpec("ppo", PPOSection),
    more_sections=RL_SECTIONS,
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

ENGINES = Registry("rollout engine", "--rollout.engine")
"""What generates an RL objective's rollouts: a ``titanium.generation.engine.EngineKind`` (how to build the engine
in a process, and its checks before start-up)."""
ENGINES.register("titanium", "titanium.generation.titanium_engine:TITANIUM")
ENGINES.register("vllm", "titanium.generation.vllm_modes:VLLM")

DPO_LOSSES = Registry("DPO loss", "--dpo.loss_type")
"""Per-pair preference losses ``(chosen, rejected, DPOSection) -> losses``, or a ``PairLoss`` that says what else
it needs (titanium/objectives/losses/dpo.py)."""
DPO_LOSSES.register("sigmoid", "titanium.objectives.losses.dpo:sigmoid_loss")
DPO_LOSSES.register("ipo", "titanium.objectives.losses.dpo:ipo_loss")
DPO_LOSSES.register("hinge", "titanium.objectives.losses.dpo:hinge_loss")
DPO_LOSSES.register("robust", "titanium.objectives.losses.dpo:robust_loss")
DPO_LOSSES.register("bco_pair", "titanium.objectives.losses.dpo:bco_pair_loss")
DPO_LOSSES.register("simpo", "titanium.objectives.losses.dpo:SIMPO")
DPO_LOSSES.register("orpo", "titanium.objectives.losses.dpo:ORPO")

JobConfig = job_config_class()
"""The job config with every built-in section (``load_config`` adds an import-path objective's)."""
