"""The published big models the transformers backend plans without their hardware (assets/hf_configs/, written from
the published config.json files): each builds, on meta, the parameter count its publisher states, and the dry run
plans DeepSeek-V3 671B on 256 GPUs of 80 GB (expert parallelism 64, FSDP) and finds it fits. The other two configs'
dry runs (train_configs/gemma3_27b_sft.toml on 16, gpt_oss_120b.toml on 64) are in docs/models.md."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import REPO
from titanium.models.flops import count_params
from titanium.models.transformers import TransformersArgs, TransformersModel

pytest.importorskip("transformers")

PUBLISHED = {  # folder: (total, active) parameters in billions, and the tolerance of the published rounding
    "gemma-3-27b": (27.01, 27.01, 0.01),  # (the 27.4B of the hub's card includes the 0.4B vision tower)
    "gpt-oss-120b": (116.83, 5.71, 0.01),  # (OpenAI's card: 116.8B total, 5.1B active without the input embedding)
    "deepseek-v3": (671.03, 37.55, 0.01),  # (DeepSeek-V3's card: 671B total, 37B activated; MTP layer not included)
}


@pytest.mark.parametrize("folder", sorted(PUBLISHED))
def test_configs_build_the_published_sizes(folder: str) -> None:
    config = json.loads((REPO / "assets" / "hf_configs" / folder / "config.json").read_text())
    args = TransformersArgs.from_config(config)
    with torch.device("meta"):
        model = TransformersModel(args)
    total, active, tol = PUBLISHED[folder]
    assert count_params(model) / 1e9 == pytest.approx(total, abs=tol)
    assert per_token(model) / 1e9 == pytest.approx(active, abs=tol)


def per_token(model: TransformersModel) -> float:
    """The parameters one token computes with: titanium's count (its MoE blocks' experts count top_k / E of their
    size), and the same share of the experts of MoE blocks the model runs itself (GPT-OSS)."""
    own = [p.numel() for name, p in model.named_parameters() if any(name.startswith(b) for b in model.own_moe_blocks)]
    config = model.args.hf_config
    share = config.num_experts_per_tok / config.num_local_experts if own else 0.0
    return count_params(model, active_only=True) - sum(own) * (1 - share)


def test_the_dry_run_fits_deepseek_v3_on_256_gpus(capsys, monkeypatch) -> None:
    from titanium.tools.dry_run import main as dry_run

    monkeypatch.chdir(REPO)
    assert dry_run(["--job.config_file", "train_configs/deepseek_v3_671b.toml", "--world_size", "256"]) == 0
    out = capsys.readouterr().out
    assert "expert parallel 64" in out and "per rank: 2.622B parameters" in out
    assert "model transformers from assets/hf_configs/deepseek-v3" in out and ": fits" in out
