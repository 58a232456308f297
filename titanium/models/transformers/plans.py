"""What a backend model's ``config.json`` says about parallelizing it: its tensor-parallel and pipeline plans.

``transformers`` configs carry their own plans: ``base_model_tp_plan`` (module pattern -> style name, e.g.
``layers.*.self_attn.q_proj: colwise``) and ``base_model_pp_plan`` (which modules a pipeline stage boundary may
cut between). ``parallelize.py`` turns the TP plan into torch's parallel styles; this module reads the plans and
says, before any process group exists, what a layout cannot have (no plan, or a style titanium does not
translate). Kept free of ``torch.distributed`` so the preflight checks can read it.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

TRANSLATED_STYLES = frozenset(
    {
        "colwise",
        "colwise_gather_output",
        "rowwise",
        "rowwise_split_input",
        "embedding_rowwise",
        "replicated_with_grad_allreduce",
    }
)
"""The ``transformers`` tensor-parallel styles titanium translates (``parallelize.py``)."""
PIPELINE_PARTS = ("embed_tokens", "layers", "norm")
"""The base model's parts a pipeline split needs the pp plan to name (titanium cuts between layers)."""


def tp_plan(config: Any) -> dict[str, str]:
    """The model's tensor-parallel plan, relative to its base model (``layers.*.self_attn.q_proj`` ...), or {}."""
    return dict(getattr(config, "base_model_tp_plan", None) or {})


def tensor_parallel_problems(config: Any, model: nn.Module | None = None) -> list[str]:
    """Why the model cannot be split by tensor parallelism as its plan says; empty when it can. With ``model`` (the
    backend's model, on meta), also the modules whose own parameters the plan leaves whole while it splits their
    sublayers (``parallelize.replicate_the_rest`` cannot replicate them: GPT-OSS's attention sinks)."""
    plan = tp_plan(config)
    if not plan:
        return [f"{config.model_type} has no tensor-parallel plan (base_model_tp_plan) in transformers"]
    untranslated = sorted({f"{style} ({pattern})" for pattern, style in plan.items() if style not in TRANSLATED_STYLES})
    outside = sorted(p for p in plan if not p.startswith("layers.") and p != "embed_tokens")
    problems = []
    if untranslated:
        problems.append(f"its plan uses styles titanium does not translate: {', '.join(untranslated)}")
    if outside:
        problems.append(f"its plan names modules outside the layers: {', '.join(outside)}")
    if not any(p.startswith("layers.") for p in plan):
        problems.append(f"its plan splits no layer ({', '.join(sorted(plan))} only)")
    if model is not None and getattr(model, "moe_layers", None):
        problems.append(
            "titanium's MoE feed-forward in its MoE blocks is not split by tensor parallelism; divide the experts "
            "with --parallelism.expert_parallel_degree instead"
        )
    if model is not None:
        mixed = sorted(
            {
                f"{type(module).__name__} ({name})"
                for name, module in model.layers.named_modules(prefix="layers")
                if next(module.children(), None) is not None
                and next(module.parameters(recurse=False), None) is not None
                and not any(fnmatch.fnmatchcase(name, pattern) for pattern in plan)
            }
        )
        if mixed:
            problems.append(
                f"its {', '.join(mixed[:3])} hold parameters of their own beside split sublayers, which titanium "
                "does not replicate"
            )
    return problems


def pipeline_problems(config: Any) -> list[str]:
    """Why the model cannot be cut into pipeline stages; empty when it can."""
    plan = getattr(config, "base_model_pp_plan", None) or {}
    if not plan:
        return [f"{config.model_type} has no pipeline plan (base_model_pp_plan) in transformers"]
    missing = [part for part in PIPELINE_PARTS if part not in plan]
    if missing:
        return [f"its pipeline plan lacks {', '.join(missing)}"]
    return []
