"""MoE blocks of backend models computed by titanium's MoE feed-forward (``titanium/models/transformers/moe.py``).

Qwen3-MoE (softmax, ``norm_topk_prob``), Mixtral (softmax, always renormalized) and DeepSeek-V3 (sigmoid, group-limited
choice on scores plus a random correction bias, routed scaling, shared experts, a dense first layer) get titanium's MoE
in their MoE layers, with transformers' weights mapped exactly: the logits equal ``transformers``' (fp32 <= 1e-5; the
matrix checks the gradients too), and DeepSeek-V3's group limit and correction bias both matter at this size. The
auxiliary loss titanium's ``[moe]`` hook adds equals the one ``transformers`` trains Qwen3-MoE and Mixtral with; the
correction bias is titanium's routing bias both ways. GPT-OSS (a router with a bias and softmax after the top-k,
biased clamped-SwiGLU experts) keeps its own blocks: expert parallelism and load balancing are refused for it.
Checkpoints that keep one tensor per expert are read and exported in their own names, into titanium's MoE and into
the blocks that run as transformers wrote them (Qwen2-MoE, Qwen3.5-MoE, Qwen3-Next, PhiMoE) alike.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.backend_matrix.cells import Architecture
from titanium.models.common.moe import MoE, MoEArgs, moe_layers, switch_aux_loss
from titanium.models.transformers import TransformersModel
from titanium.models.transformers.hf import TRANSFORMERS_HF_ADAPTER
from titanium.models.transformers.moe import BackendMoE

transformers = pytest.importorskip("transformers")

TOL = dict(atol=1e-5, rtol=1e-5)


def arch(model_type: str, tmp_path: Path) -> Architecture:
    made = Architecture(model_type, tmp_path)
    assert made.cell_load().status == "yes"
    made.make_reference()
    return made


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("qwen3_moe", MoEArgs(8, 2, 32, "softmax", norm_topk_prob=True)),
        ("mixtral", MoEArgs(8, 2, 128, "softmax", norm_topk_prob=True)),
        ("deepseek_v3", MoEArgs(8, 2, 32, "sigmoid", norm_topk_prob=True, route_scale=2.5, n_groups=2, topk_groups=1)),
    ],
)
def test_moe_blocks_are_titaniums_with_transformers_logits(model_type: str, expected: MoEArgs, tmp_path: Path) -> None:
    made = arch(model_type, tmp_path)
    model = made.twin()
    layers = moe_layers(model)
    sparse = {1} if model_type == "deepseek_v3" else {0, 1}  # (DeepSeek-V3's first layer is dense)
    assert set(layers) == sparse and model.moe_layers == frozenset(sparse) and not model.own_moe_blocks
    assert all(isinstance(model.layers[str(i)].mlp, BackendMoE) for i in sparse)
    assert next(iter(layers.values())).args == expected
    assert model.args.decoder_args().moe == expected
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(made.x), made.reference, **TOL)
    if model_type == "deepseek_v3":  # the group limit and the correction bias each change the routing here
        for change in ({"n_groups": 1, "topk_groups": 1}, {"bias": 0.0}):
            other = copy.deepcopy(model)
            for moe in moe_layers(other).values():
                if "bias" in change:
                    moe.expert_bias.zero_()
                else:
                    moe.args = moe.router.args = MoEArgs(**{**vars(expected), **change})
            with torch.no_grad():
                assert (other(made.x) - made.reference).abs().max() > 1e-3, change


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_the_aux_loss_is_the_one_transformers_trains_with(model_type: str, tmp_path: Path) -> None:
    """The Switch loss over all MoE layers from the routing statistics titanium's MoE keeps for the ``[moe]`` hook
    (``titanium/moe_balance.py``), against ``transformers``' ``aux_loss`` (output_router_logits)."""
    made = arch(model_type, tmp_path)
    model = made.twin().train()
    layers = list(moe_layers(model).values())
    for layer in layers:
        layer.keep_routing_stats = True
    model(made.x)
    stats = [layer.routing_stats for layer in layers]
    counts = torch.stack([s.counts for s in stats]).sum(0)
    sums = torch.stack([s.score_sums for s in stats]).sum(0)
    ours = switch_aux_loss(counts, sums, float(sum(s.tokens for s in stats)))
    reference = made.hf(input_ids=made.x, output_router_logits=True).aux_loss
    torch.testing.assert_close(ours, reference.float(), rtol=1e-6, atol=1e-6)
    assert model.args.router_aux_loss_coef == made.hf.config.router_aux_loss_coef


def test_deepseek_correction_bias_is_the_routing_bias(tmp_path: Path) -> None:
    made = arch("deepseek_v3", tmp_path)
    model = made.twin()
    bias = made.hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().max() > 0 and torch.equal(model.layers["1"].mlp.moe.expert_bias, bias)
    exported = TRANSFORMERS_HF_ADAPTER.to_hf(model.state_dict(), model.args)
    reference = made.hf.state_dict()
    assert set(exported) == set(reference)
    for key, value in reference.items():
        assert torch.equal(exported[key], value), key
    qwen = arch("qwen3_moe", tmp_path / "qwen").twin()
    qwen.layers["0"].mlp.moe.expert_bias.fill_(0.5)
    with pytest.raises(ValueError, match="router has no routing bias"):
        TRANSFORMERS_HF_ADAPTER.to_hf(qwen.state_dict(), qwen.args)


def test_seeded_initialization_of_swapped_blocks(tmp_path: Path) -> None:
    """titanium's MoE in a backend model is initialized with the rest (std: the config's initializer_range), the same
    whole or unit by unit (the sharded path)."""
    from titanium.parallel.pipeline import keep_only

    made = arch("deepseek_v3", tmp_path)
    with torch.device("meta"):
        template = TransformersModel(made.args)
    whole = copy.deepcopy(template)
    whole.to_empty(device="cpu")
    whole.init_weights(seed=3)
    moe: MoE = whole.layers["1"].mlp.moe
    std = made.hf.config.initializer_range
    assert 0.5 * std < moe.experts.w1.std() < 1.5 * std and not moe.expert_bias.any()
    unit = keep_only(template, ["1"], False, False)
    unit.to_empty(device="cpu")
    unit.init_weights(seed=3)
    for name, value in unit.state_dict().items():
        assert torch.equal(value, whole.state_dict()[name]), name


def test_models_with_their_own_moe_blocks_refuse_parallelism_and_balancing(tmp_path: Path) -> None:
    made = arch("gpt_oss", tmp_path)
    model = made.twin()
    assert not model.moe_layers and model.own_moe_blocks == ["layers.0.mlp.experts", "layers.1.mlp.experts"]
    assert made.args.decoder_args().moe is None
    problems = "; ".join(made.refusals(expert_parallel=2, load_balance="aux_loss"))
    assert "--parallelism.expert_parallel_degree 2: gpt_oss's MoE blocks run as transformers wrote them" in problems
    assert "--moe.load_balance aux_loss: gpt_oss's MoE blocks" in problems and "--moe.load_balance none" in problems
    assert not made.refusals(load_balance="none")
    assert not arch("qwen3_moe", tmp_path / "qwen").refusals(expert_parallel=2, load_balance="bias")


PER_EXPERT = {  # model_type: (one expert's tensor in layer 1 of its checkpoint, whether its MoE blocks are its own)
    "mixtral": ("block_sparse_moe.experts.0.w1", False),
    "deepseek_v3": ("mlp.experts.0.gate_proj", False),
    "qwen2_moe": ("mlp.experts.0.gate_proj", True),
    "qwen3_5_moe_text": ("mlp.experts.0.gate_proj", True),
    "qwen3_next": ("mlp.experts.0.gate_proj", True),
    "phimoe": ("block_sparse_moe.experts.0.w1", True),
}


@pytest.mark.parametrize("model_type", list(PER_EXPERT))
def test_per_expert_checkpoints_load_and_export_in_their_own_names(model_type: str, tmp_path: Path) -> None:
    """A checkpoint that keeps one tensor per expert, which transformers stacks on loading (DeepSeek-V3's
    ``mlp.experts.E.gate_proj``; Mixtral's ``block_sparse_moe.experts.E.w1``, whose ``block_sparse_moe`` transformers
    also renames to ``mlp``), is read with transformers' logits, and exported with exactly the checkpoint's tensor
    names, which transformers loads back with the same logits (the matrix's HF round-trip cell): into titanium's MoE
    (Mixtral, DeepSeek-V3), and into the stacked ``gate_up_proj`` / ``down_proj`` of the MoE blocks that run as
    transformers wrote them (Qwen2-MoE, Qwen3.5-MoE, Qwen3-Next; PhiMoE, whose router ``gate`` transformers also
    renames ``router``)."""
    from titanium.checkpoint.hf import HFCheckpoint

    made = arch(model_type, tmp_path)
    expert, own = PER_EXPERT[model_type]
    assert bool(made.twin().own_moe_blocks) == own
    cell = made.cell_hf()
    assert cell.status == "yes", cell

    def names(folder: Path) -> set[str]:
        return set(HFCheckpoint.open(folder).shapes)

    source = names(tmp_path / "source")
    assert f"model.layers.1.{expert}.weight" in source
    assert names(tmp_path / "export") == source
