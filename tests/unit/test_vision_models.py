"""Image-text models through the transformers backend (``titanium/models/transformers/vision.py``): a tiny random
Qwen2.5-VL, Qwen3-VL, Llama 3.2 Vision, Gemma 3 and Llama 4, loaded from their Hugging Face folders, give
``transformers``' own logits and gradients on the same images and text (fp32, 1e-5 / 1e-6), for a batch of rows made
by titanium's data path (the processor, per-row image tensors, padding); the export keeps the source's names and
reloads in ``transformers`` with the trained logits. Llama 4's image processor needs torchvision: it is fed
preprocessed pixel values."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.objectives.tiny_vlm import random_image, tiny_config, tiny_processor, tiny_vlm, token_id, vlm_folder
from titanium.batch import ImageInputs
from titanium.checkpoint.hf import HFCheckpoint, export_hf
from titanium.config.sections import LoRASection, ModelSection, OptimizerSection
from titanium.config.vision_section import VisionSection
from titanium.data.packing import padded_rows
from titanium.data.vision import ImageData, images_of, padded_image_rows, place_images
from titanium.model_builder import ModelBuilder, resolve_spec
from titanium.models.converter import set_trainable
from titanium.optim.optimizer import build_optimizer
from titanium.peft.export import export_peft_adapter
from titanium.peft.lora import apply_lora, init_lora, is_lora_param
from titanium.peft.vision_freeze import VisionFreezeConverter, is_projector

pytest.importorskip("transformers")

WITH_PROCESSOR = ["qwen2_5_vl", "qwen3_vl", "mllama", "gemma3"]
CONVERSATIONS = [
    ([28, 56], [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7 w8 w9"}]),
    ([56], [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2 w3 w4 w5 w6"}]),
]
"""Two rows of different lengths, with two images and one (widths of 28-pixel-high images)."""


def load(folder: Path):
    spec, _ = resolve_spec(ModelSection(), str(folder))
    return spec, ModelBuilder(torch.device("cpu")).load_hf(spec, folder, max_seq_len=256)


def titanium_rows(model_type: str):
    """The two conversations as titanium's SFT data makes them (every token learned), and the processor's texts
    and images of the same rows."""
    data = ImageData(tiny_processor(model_type), VisionSection())
    samples, texts, images = [], [], []
    for i, (widths, messages) in enumerate(CONVERSATIONS):
        pictures = [random_image(10 * i + k, w, 28) for k, w in enumerate(widths)]
        pieces = data.pieces(place_images([dict(m) for m in messages], len(pictures)))
        ids, kinds, fields = data.tokens(pieces, pictures)
        samples.append({"tokens": ids, "labels": ids[1:] + [-100], "images": fields})
        texts.append("".join(p for p, _ in pieces))
        images.append(pictures)
    pad = partial(padded_rows, seq_len=256, pad_id=0, pad_to="longest", pad_multiple=1)
    return padded_image_rows(pad, samples, data.layout), data.processor, texts, images


def grads_by_hf_name(model, adapter) -> dict[str, torch.Tensor]:
    return {adapter.module_key(adapter.hf_key(n)): p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", WITH_PROCESSOR)
def test_logits_and_gradients_equal_transformers(model_type: str, tmp_path: Path) -> None:
    folder = vlm_folder(model_type, tmp_path / model_type, seed=3)
    spec, built = load(folder)
    model = built.model
    hf = tiny_vlm(model_type, seed=3).train()
    rows, processor, texts, images = titanium_rows(model_type)
    reference = processor(text=texts, images=images, return_tensors="pt", padding=True, add_special_tokens=False)
    real = reference["attention_mask"].bool()
    width = real.shape[1]
    assert torch.equal(rows["input"][:, :width][real], reference["input_ids"][real])
    ours = model(rows["input"], rows["positions"], rows["document_ids"], images=images_of(rows))[:, :width]
    theirs = hf(**reference).logits
    assert (ours[real] - theirs[real]).abs().max() < 1e-5
    labels = rows["label"][:, :width]
    torch.nn.functional.cross_entropy(ours[real], labels[real], ignore_index=-100, reduction="sum").backward()
    torch.nn.functional.cross_entropy(theirs[real], labels[real], ignore_index=-100, reduction="sum").backward()
    ours_grads = grads_by_hf_name(model, spec.hf_adapter)
    theirs_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    assert set(ours_grads) == set(theirs_grads)
    worst = max((ours_grads[n] - theirs_grads[n]).abs().max().item() for n in theirs_grads)
    assert worst < 1e-6, worst
    tower = spec.hf_adapter.module_key(spec.hf_adapter.hf_key(f"{model.vision_names[0]}.weight")).removesuffix("weight")
    assert any(name.startswith(tower) for name in ours_grads)  # (the vision tower has gradients)


def test_llama4_moe_on_titaniums_experts_equals_transformers_and_exports(tmp_path: Path) -> None:
    """Llama 4 (pixel shuffle; its image processor needs torchvision: pixel values made here, two tiles) with its MoE
    block on titanium's MoE (``moe.py``: top-1 sigmoid routing, the score scaling the expert's input, the shared
    expert added): logits equal ``transformers``' (1e-5; measured 0.0), gradients by the checkpoint's names within
    1e-6 of the largest (measured 2.9e-6 absolute on the embedding, whose gradient reaches 10.1). The checkpoint's
    transposed stacked experts (``gate_up_proj [E, H, 2I]``) map both ways: the export keeps the source's keys and
    reloads in ``transformers`` with the changed weights' logits, and a shard's box reads as the whole tensor's."""
    from transformers import AutoModelForImageTextToText

    from titanium.checkpoint.hf_stream import read_transposed
    from titanium.models.transformers.moe import BackendMoE

    hf = tiny_vlm("llama4", seed=4)
    hf.save_pretrained(tmp_path / "source")
    spec, built = load(tmp_path / "source")
    model, adapter = built.model, spec.hf_adapter
    assert isinstance(model.layers["1"].feed_forward, BackendMoE) and not model.own_moe_blocks
    pixels = torch.randn(2, 3, 28, 28)
    patch = token_id("llama4", "<|patch|>")
    with torch.no_grad():
        features = hf.get_image_features(pixels, return_dict=True).pooler_output.reshape(-1, 32).shape[0]
    ids = torch.tensor([[1, token_id("llama4", "<|image_start|>"), *[patch] * features, 20, 21, 22, 23, 30, 31, 5]])
    images = ImageInputs({"pixel_values": pixels[None]}, {"pixel_values": torch.tensor([2])})
    ours, theirs = model(ids, images=images), hf.train()(input_ids=ids, pixel_values=pixels).logits
    assert (ours - theirs).abs().max() < 1e-5
    assert model.layers["1"].feed_forward.moe.tokens_per_expert.min() > 0  # (both experts ran)
    for logits in (ours, theirs):
        torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    ours_grads = {adapter.module_key(k): v for k, v in adapter.to_hf(grads, built.args).items()}
    theirs_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(ours_grads) == set(theirs_grads)
    largest = max(g.abs().max().item() for g in theirs_grads.values())
    assert max((ours_grads[n] - g).abs().max().item() for n, g in theirs_grads.items()) < 1e-6 * largest
    whole = adapter.from_hf(dict(hf.state_dict()), built.args)  # (a shard of the experts: a box, transposed back)
    index = [torch.tensor([1]), torch.tensor([3, 5, 20]), torch.tensor([0, 30])]
    with HFCheckpoint.open(tmp_path / "source").reader() as reader:
        for leaf in ("w1", "w3", "w2"):
            key = f"layers.1.feed_forward.moe.experts.{leaf}"
            rows = read_transposed(reader, adapter.hf_source(key, built.args), index, whole[key].shape[1])
            assert torch.equal(rows, whole[key][index[0]][:, index[1]][:, :, index[2]]), leaf
    with torch.no_grad():
        for p in model.parameters():  # (as if trained)
            p.add_(0.01 * torch.randn_like(p))
    export_hf(model, tmp_path / "export", adapter, built.args)
    assert set(HFCheckpoint.open(tmp_path / "export").shapes) == set(HFCheckpoint.open(tmp_path / "source").shapes)
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        trained = model.eval()(ids, images=images)
        assert (trained - reloaded(input_ids=ids, pixel_values=pixels).logits).abs().max() < 1e-5
        assert (trained - load(tmp_path / "export")[1].model.eval()(ids, images=images)).abs().max() < 1e-5


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_export_keeps_the_source_names_and_reloads_in_transformers(model_type: str, tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    folder = vlm_folder(model_type, tmp_path / "source", seed=5)
    spec, built = load(folder)
    with torch.no_grad():
        for p in built.model.parameters():  # (as if trained)
            p.add_(0.01 * torch.randn_like(p))
    export_hf(built.model, tmp_path / "export", spec.hf_adapter, built.args)
    assert set(HFCheckpoint.open(tmp_path / "export").shapes) == set(HFCheckpoint.open(folder).shapes)
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    rows, processor, texts, pictures = titanium_rows(model_type)
    first = {k: v[:1] for k, v in rows.items()}
    inputs = processor(text=texts[:1], images=pictures[:1], return_tensors="pt", add_special_tokens=False)
    length = inputs["input_ids"].shape[1]
    with torch.no_grad():
        ours = built.model.eval()(first["input"], first["positions"], first["document_ids"], images=images_of(first))
        theirs = reloaded(**inputs).logits
    assert (ours[:, :length] - theirs).abs().max() < 1e-5


def loss_and_grads(model, rows) -> dict[str, torch.Tensor]:
    """Backward of the summed cross-entropy on ``rows``; the gradients by parameter name (None: no gradient)."""
    logits = model(rows["input"], rows["positions"], rows["document_ids"], images=images_of(rows))
    flat = logits.flatten(0, 1)
    torch.nn.functional.cross_entropy(flat, rows["label"].flatten(), ignore_index=-100, reduction="sum").backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(("tower", "projector"), [(True, False), (False, True)])
def test_frozen_vision_parts_get_no_gradient_and_no_optimizer_state(tower: bool, projector: bool, tmp_path) -> None:
    """[vision] freeze_vision_tower / freeze_projector: the frozen parameters get no gradient, no optimizer state and
    keep their values over a step; every other parameter's gradient equals the unfrozen model's (1e-6)."""
    folder = vlm_folder("qwen2_5_vl", tmp_path, seed=3)
    rows = titanium_rows("qwen2_5_vl")[0]
    full = loss_and_grads(load(folder)[1].model, rows)
    model = load(folder)[1].model
    converter = VisionFreezeConverter(VisionSection(freeze_vision_tower=tower, freeze_projector=projector))
    converter.convert(model)
    set_trainable([converter], model)
    frozen = {
        name
        for name, _ in model.named_parameters()
        if name.split(".", 1)[0] in model.vision_names and (projector if is_projector(name) else tower)
    }
    assert frozen and any(is_projector(name) for name in frozen) == projector
    before = {name: p.detach().clone() for name, p in model.named_parameters() if name in frozen}
    grads = loss_and_grads(model, rows)
    assert all(grads[name] is None for name in frozen)
    trained = set(grads) - frozen
    assert all(grads[name] is not None for name in trained)
    assert max((grads[n] - full[n]).abs().max().item() for n in trained) < 1e-6
    optimizer = build_optimizer(model, OptimizerSection(lr=1e-2))
    optimizer.step()
    with_state = {name for name, p in model.named_parameters() if optimizer.state.get(p)}
    assert with_state == trained
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters() if name in frozen)


def test_lora_on_vision_modules_equals_peft(tmp_path) -> None:
    """--lora.vision_modules with all-linear adapts the layers PEFT's all-linear adapts on the transformers model
    (vision tower and projector included); the exported adapter loads with ``peft`` and gives titanium's logits
    (1e-5). Without vision_modules only the language model's layers are adapted, in titanium and in the PEFT model
    its exported adapter makes."""
    from peft import LoraConfig, PeftModel, get_peft_model

    folder = vlm_folder("qwen2_5_vl", tmp_path / "base", seed=3)
    spec, built = load(folder)
    model, adapter = built.model, spec.hf_adapter
    text_model, text_cfg = load(folder)[1].model, LoRASection(rank=2, target_modules=["all-linear"])
    language_only = apply_lora(text_model, text_cfg, adapter)
    export_peft_adapter(text_model, adapter, built.args, text_cfg, tmp_path / "text_adapter")
    text_peft = PeftModel.from_pretrained(tiny_vlm("qwen2_5_vl", seed=3), tmp_path / "text_adapter")
    assert {n.removeprefix("base_model.model.") for n, m in text_peft.named_modules() if hasattr(m, "lora_A")} == {
        adapter.module_key(adapter.hf_key(f"{name}.weight")).removesuffix(".weight") for name in language_only
    }  # (the vision tower's gate_proj/up_proj/down_proj too were adapted by a list of leaf names)
    cfg = LoRASection(rank=2, alpha=4.0, target_modules=["all-linear"], vision_modules=True)
    adapted = apply_lora(model, cfg, spec.hf_adapter)
    wrapped = get_peft_model(tiny_vlm("qwen2_5_vl", seed=3), LoraConfig(r=2, target_modules="all-linear"))
    peft_layers = {n.removeprefix("base_model.model.") for n, m in wrapped.named_modules() if hasattr(m, "lora_A")}
    hf_layers = {adapter.module_key(adapter.hf_key(f"{name}.weight")).removesuffix(".weight") for name in adapted}
    assert hf_layers == peft_layers  # (by the transformers model's module names)
    assert not any(name.split(".", 1)[0] in model.vision_names for name in language_only)
    assert set(language_only) < set(adapted) and any(name.split(".", 1)[0] in model.vision_names for name in adapted)
    init_lora(model, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_lora_param(name):  # (lora_b starts at zero: give the adapters an update to compare)
                p.copy_(0.1 * torch.randn_like(p))
    export_peft_adapter(model, spec.hf_adapter, built.args, cfg, tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(tiny_vlm("qwen2_5_vl", seed=3), tmp_path / "adapter").eval()
    rows, processor, texts, pictures = titanium_rows("qwen2_5_vl")
    inputs = processor(text=texts, images=pictures, return_tensors="pt", padding=True, add_special_tokens=False)
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        ours = model.eval()(rows["input"], rows["positions"], rows["document_ids"], images=images_of(rows))
        theirs = reloaded(**inputs).logits
    assert (ours[:, : real.shape[1]][real] - theirs[real]).abs().max() < 1e-5


def test_llama4_scout_spreads_its_16_experts_over_64_ranks(tmp_path, monkeypatch) -> None:
    """The shipped Llama 4 Scout config on 64 ranks (the dry run's fake process group): FSDP splits each layer's 16
    stacked experts along a dimension with >= 64 rows, so a rank holds 1/64 of the model (1.70B of 109B
    parameters), not a whole expert of every layer (6.2B; FSDP's row split left 48 ranks no expert)."""
    import torch.distributed as dist

    from titanium.tools.dry_run import dry_run

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    try:
        run = dry_run(["--job.config_file", "train_configs/llama4_scout_sft.toml", "--data.path", str(rows)], 64)
    finally:
        dist.destroy_process_group()
    total = sum(math.prod(p.global_shape) for p in run.params)
    assert 108e9 < total < 109e9 and run.local_numel < 1.02 * total / 64, (total, run.local_numel)
    experts = {p.name: p for p in run.params if ".experts." in p.name and p.name.startswith("layers.0.")}
    assert experts and all(p.local_shape[0] == 16 for p in experts.values()), experts


def test_context_and_pipeline_parallelism_are_refused(tmp_path) -> None:
    """Layouts not made to work with images: each refused by a message naming its flag (preflight: exit 2); tensor
    parallelism is not refused by the image-text checks (tests/distributed/test_vision_fsdp.py trains it)."""
    from titanium.models.spec import ModelUse
    from titanium.models.transformers.vision import image_text_refusals

    built = load(vlm_folder("gemma3", tmp_path, seed=1))[1]
    use = ModelUse(tensor_parallel=2, context_parallel=2, pipeline_parallel=2)
    problems = image_text_refusals(built.args, built.model, use)
    flags = ("context_parallel_degree 2", "pipeline_parallel_degree 2")
    assert len(problems) == 2 and all(flag in problem for flag, problem in zip(flags, problems, strict=True))


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "mllama", "gemma3", "llama4"])
def test_tensor_parallelism_is_refused_where_the_language_model_has_no_translated_plan(model_type: str) -> None:
    """TP splits the language model by its config's plan (the vision parts computed whole on every rank): Gemma 3
    and Qwen2.5-VL have one; Llama 3.2 Vision's text model has none, Qwen3-VL's splits only the embedding and
    Llama 4's splits its MoE experts in styles titanium does not translate (and its MoE blocks are titanium's,
    which TP does not split), each refused naming the flag."""
    from titanium.models.spec import ModelUse
    from titanium.models.transformers.args import TransformersArgs
    from titanium.models.transformers.checks import backend_refusals

    args = TransformersArgs.from_config(tiny_config(model_type).to_dict())
    problems = backend_refusals(args, ModelUse(tensor_parallel=2))
    if model_type in ("qwen2_5_vl", "gemma3"):
        assert problems == []
    else:
        flag = "--parallelism.tensor_parallel_degree 2: "
        assert len(problems) == 1 + (model_type == "llama4") and all(p.startswith(flag) for p in problems), problems


def test_initialization_is_the_same_whole_or_unit_by_unit_and_a_cast_keeps_it() -> None:
    """FSDP and TP materialize a model one unit at a time (``keep_only``), each drawing what the whole model draws, so
    a layout started from the seed equals one process: recomputing the buffers draws no parameter again (SigLIP's
    embeddings' ``_init_weights`` draws their position table, a child's; it was drawn again from the unseeded
    generator, measured: FSDP 2 from the seed then differed from one process), nor does a whole-model cast, which
    recomputes them."""
    import copy

    from titanium.models.transformers.args import TransformersArgs
    from titanium.models.transformers.vision import build_transformers_model
    from titanium.parallel.pipeline import keep_only

    with torch.device("meta"):
        template = build_transformers_model(TransformersArgs.from_config(tiny_config("gemma3").to_dict()))
    whole = copy.deepcopy(template)
    whole.to_empty(device="cpu")
    whole.init_weights(seed=5)
    expected = {name: value.clone() for name, value in whole.state_dict().items()}
    for layers, first, last in [([key], False, False) for key in template.layers] + [([], True, True)]:
        unit = keep_only(template, layers, first, last)
        unit.to_empty(device="cpu")
        unit.init_weights(seed=5)
        for name, value in unit.state_dict().items():
            assert torch.equal(value, expected[name]), name
    cast = whole.to(torch.bfloat16)
    for name, value in cast.state_dict().items():
        assert torch.equal(value, expected[name].to(value.dtype)), name
