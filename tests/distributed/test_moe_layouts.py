"""Expert parallelism trains Qwen3-MoE like one process, alone and with FSDP (+ full activation checkpointing, whose
recomputed forwards must not count routed tokens twice), HSDP, TP, CP and PP (fp32, gloo).

All layouts run in one 4-process launch (``moe_worker``), the references in one single-process launch, each job
5 steps of ``debugmodel_moe`` from the seeded initialization on the same synthetic windows. Per step: losses to
1e-5 relative, and the tokens routed to every expert of every layer *identical* (routing is discontinuous: a
wrong gate or exchange shows there first). Gradients of every parameter at steps 1 and 5 to 1e-5 absolute
(they are up to ~1). The auxiliary loss (its statistics summed over the data-parallel ranks) equals one process's
to 1e-5 relative. Layouts with pipeline parallelism use the aux-loss-free bias (the aux loss needs all layers at
once), with a large update rate so the bias changes the routing within the 5 steps; so do two others. One
trains LoRA adapters on the stacked experts (and ``wq``) under EP 2 x FSDP 2, the adapters sharded by expert.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run_train, scalars, tiny_args

STEPS = 5
BIAS = ("--moe.load_balance", "bias", "--moe.bias_update_rate", "0.05")
LORA = ("--lora.rank", "4", "--lora.target_modules", "wq", "experts", "--optimizer.lr", "1e-2")
TWO_EXPERTS = ("--model.hf_config", "{two_experts}")
"""debugmodel_moe with 2 experts, top-1 (a config.json the fixture writes): under EP 2 x FSDP 2 a rank group holds
one expert, fewer rows than FSDP's 2 shards, so FSDP splits it along another dimension (``parallel/fsdp.py``
``shard_dim``, read from the rank's local experts)."""
REFERENCES = {"aux": (), "bias": BIAS, "lora": LORA, "two_experts": TWO_EXPERTS}
"""Each layout's one-process reference: its flags beyond the layout's."""
LAYOUTS = {  # name -> (reference, layout flags)
    "ep4": ("aux", ("--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "4")),
    "ep2_fsdp2_ac": (
        "aux",
        ("--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "2",
         "--activation_checkpoint.mode", "full"),
    ),
    "ep2_cp2": (
        "aux",
        ("--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2",
         "--parallelism.context_parallel_degree", "2"),
    ),
    "ep2_tp2": (
        "aux",
        ("--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2",
         "--parallelism.tensor_parallel_degree", "2"),
    ),
    "ep2_pp2": (
        "bias",
        ("--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2",
         "--parallelism.pipeline_parallel_degree", "2"),
    ),
    "hsdp2_ep2": (
        "bias",
        ("--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "2",
         "--parallelism.data_parallel_replicate_degree", "2"),
    ),
    "ep2_fsdp2_lora": ("lora", ("--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "2")),
    "ep2_fsdp2_one_expert": (
        "two_experts", ("--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "2"),
    ),
}  # fmt: skip


def moe_job(
    folder: Path, *extra: str, data: tuple[str, ...] = ("--data.kind", "synthetic"), steps: int = STEPS
) -> list[str]:
    model = ("--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe")
    return tiny_args(folder, *model, *data, "--training.steps", str(steps), *extra)


def launch(nproc: int, jobs: list[list[str]], module: str = "tests.distributed.moe_worker") -> None:
    """Run ``jobs`` one after the other in one launch of ``nproc`` processes (by moe_worker, or a ``module`` that
    patches it)."""
    args = [arg for i, job in enumerate(jobs) for arg in (["--then"] if i else []) + job]
    run_train(args, nproc=nproc, module=module, timeout=1200)


def loads(folder: Path) -> dict[int, dict[int, list[float]]]:
    """step -> layer -> tokens per expert, merged over the ranks (pipeline stages hold different layers)."""
    merged: dict[int, dict[int, list[float]]] = {}
    for path in (folder / "probe").glob("loads_rank*.json"):
        for step, layers in json.loads(path.read_text()).items():
            merged.setdefault(int(step), {}).update({int(k): v for k, v in layers.items()})
    return merged


def grads(folder: Path, step: int) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for path in (folder / "probe").glob(f"grads_step{step}_rank*.pt"):
        merged.update(torch.load(path))
    return merged


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe_layouts")
    two_experts = write_two_experts(root / "two_experts")
    refs = {name: [flag.format(two_experts=two_experts) for flag in flags] for name, flags in REFERENCES.items()}
    single = ("--training.local_batch_size", "4")
    launch(1, [moe_job(root / f"single_{name}", *single, *flags) for name, flags in refs.items()])
    launch(4, [moe_job(root / name, *extra, *refs[reference]) for name, (reference, extra) in LAYOUTS.items()])
    return root


def write_two_experts(folder: Path) -> str:
    from titanium.models import get_model_spec

    spec = get_model_spec("qwen3_moe")
    config = {**spec.hf_adapter.to_hf_config(spec.flavors["debugmodel_moe"]), "num_experts": 2}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 1}))
    return str(folder)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layout_matches_one_process(runs, name):
    kind = LAYOUTS[name][0]
    reference, got = runs / f"single_{kind}", runs / name
    ref_losses, losses = scalars(reference / "tb"), scalars(got / "tb")
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-5), (step, losses, ref_losses)
    ref_loads, got_loads = loads(reference), loads(got)
    assert sorted(got_loads) == list(range(1, STEPS + 1)) and sorted(got_loads[1]) == [0, 1, 2, 3]
    assert got_loads == ref_loads
    if kind != "bias":
        ref_aux, aux = scalars(reference / "tb", "moe/aux_loss"), scalars(got / "tb", "moe/aux_loss")
        for step in aux:
            assert aux[step] == pytest.approx(ref_aux[step], rel=1e-5), (step, aux, ref_aux)
    for step in (1, STEPS):
        expected, actual = grads(reference, step), grads(got, step)
        assert set(actual) == set(expected)
        worst = max((actual[k] - v).abs().max().item() for k, v in expected.items())
        assert worst <= 1e-5, (step, worst)


def test_bias_changed_routing(runs):
    """The bias runs really moved their biases enough to route differently from the aux-loss run."""
    assert loads(runs / "single_bias")[STEPS] != loads(runs / "single_aux")[STEPS]
