"""The one-process cells of the compatibility matrix: what one architecture's tiny random model does in titanium's
transformers backend, each cell compared with what ``transformers`` (and ``peft``) compute.

- ``load``: the backend builds the model from its ``config.json`` (or refuses it with its message);
- ``step``: a model built by titanium's ``ModelBuilder`` (seeded initialization) takes one AdamW step on a batch
  and its loss on that batch goes down;
- ``logits`` / ``grads``: with the weights of a ``transformers`` model whose every weight is random, its logits
  and the gradients of every weight equal ``transformers``' own forward and backward (fp32, <= 1e-5);
- ``packing``: a row of two packed samples equals each sample alone in ``transformers`` (or the refusal);
- ``lora``: LoRA on the attention and MLP projections with random adapters, exported in PEFT layout, loaded by
  ``peft`` onto the ``transformers`` model: the same logits (<= 1e-5);
- ``hf``: loaded from the ``transformers`` folder by titanium's streaming reader, exported back: ``transformers``
  loads the export with its own class and computes the source's logits.

A cell is ``yes``, ``no`` (it ran and differed or failed: the detail says how), ``refused`` (titanium refuses it
before any process group, with the message a user sees) or ``untested`` (an earlier cell failed, or
``transformers`` itself cannot build the tiny model).
"""

from __future__ import annotations

import dataclasses
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.backend_matrix.configs import VOCAB, tiny_config, tiny_config_dict
from tests.parity.harness import randomize_

YES, NO, REFUSED, UNTESTED = "yes", "no", "refused", "untested"
STATUS_RANK = {YES: 3, REFUSED: 2, NO: 1, UNTESTED: 0}
"""Better is higher: a cell may move up the ranking, never down (``not_worse``)."""
SINGLE_CELLS = ("load", "step", "logits", "grads", "packing", "lora", "hf")
LAYOUT_CELLS = ("fsdp", "tp", "pp")
CELLS = ("load", "step", "logits", "grads", "fsdp", "tp", "pp", "packing", "lora", "hf")
"""Every cell, in the table's order."""
TOL = 1e-5
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass
class Cell:
    status: str
    detail: str = ""

    def to_json(self) -> list[str]:
        return [self.status, self.detail]


class Skip(Exception):
    """The tiny model cannot be made at all (``transformers`` refuses its own config): every cell is untested."""


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def compared(name: str, got: torch.Tensor, expected: torch.Tensor) -> Cell:
    """``yes`` where every element is within 1e-5 + 1e-5 x the expected value (``torch.testing.assert_close``'s
    rule at those tolerances), with the largest absolute difference."""
    close = bool(torch.isclose(got.detach().float(), expected.detach().float(), rtol=TOL, atol=TOL).all())
    return Cell(YES if close else NO, f"{name} max abs diff {diff(got, expected):.1e}")


def run_cell(fn: Callable[[], Cell]) -> Cell:
    """``fn``'s cell; a titanium refusal (``UserError``) as ``refused``, any other exception as ``no``."""
    from titanium.errors import UserError

    try:
        return fn()
    except UserError as e:
        return Cell(REFUSED, str(e))
    except Exception as e:  # noqa: BLE001 (a cell that fails records why and the matrix goes on)
        return Cell(NO, describe(e))


def describe(error: BaseException) -> str:
    """An exception in one line: its type, message and where it was raised."""
    where = traceback.extract_tb(error.__traceback__)[-1]
    return f"{type(error).__name__}: {str(error)[:300]} ({Path(where.filename).name}:{where.lineno})"


def randomize_routing_biases(model: torch.nn.Module, seed: int) -> None:
    """DeepSeek-V3-style routing biases (buffers, which ``randomize_`` leaves at zero) random too, so they change which
    experts the tokens choose; and each embedding's padding row zero, as ``transformers`` initializes it (some models
    zero it again when they load a checkpoint, which would make a random one differ from the file)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand(buffer.shape, generator=generator) * 0.2 - 0.1)
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()


def tokens(rows: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


class Architecture:
    """One ``model_type``'s tiny model in ``transformers`` and in the backend; each cell a method."""

    def __init__(self, model_type: str, folder: Path) -> None:
        self.model_type, self.folder = model_type, folder
        try:
            self.config = tiny_config_dict(model_type)
            tiny_config(model_type)
        except Exception as e:  # noqa: BLE001
            raise Skip(f"transformers refuses the tiny config: {type(e).__name__}: {str(e)[:200]}") from None
        self.args: Any = None

    def make_reference(self) -> None:
        """The ``transformers`` model (every weight random) and its logits on a batch: built after ``load`` passed
        (a multimodal config refused there would build its full-size vision tower)."""
        from transformers import AutoModelForCausalLM

        try:
            torch.manual_seed(0)
            hf = AutoModelForCausalLM.from_config(tiny_config(self.model_type), dtype=torch.float32)
            randomize_(hf, 0)
            randomize_routing_biases(hf, 0)
            self.hf = hf.eval()
            self.x = tokens(2, 24)
            with torch.no_grad():
                self.reference = self.hf(input_ids=self.x).logits
        except Exception as e:  # noqa: BLE001
            raise Skip(f"transformers' own model fails: {type(e).__name__}: {str(e)[:200]}") from None

    # ----- helpers -----

    def refusals(self, **use: Any) -> list[str]:
        from titanium.models.spec import ModelUse
        from titanium.models.transformers.checks import backend_refusals

        return backend_refusals(self.args, ModelUse(**use))

    def twin(self, converters: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
        """A backend model holding the ``transformers`` model's weights (through the backend's adapter)."""
        from titanium.models.transformers import TransformersModel
        from titanium.models.transformers.hf import TRANSFORMERS_HF_ADAPTER

        with torch.device("meta"):
            model = TransformersModel(self.args)
        if converters is not None:
            converters(model)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
        weights = TRANSFORMERS_HF_ADAPTER.from_hf(self.hf.state_dict(), self.args)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if "lora_" not in k and not k.endswith("moe.expert_bias")]  # (no HF slot)
        if missing or unexpected:
            raise AssertionError(f"weights not mapped: missing {missing[:4]}, unexpected {unexpected[:4]}")
        return model

    # ----- cells -----

    def cell_load(self) -> Cell:
        from titanium.models.transformers import TransformersModel
        from titanium.models.transformers.hf import TRANSFORMERS_HF_ADAPTER

        self.args = TRANSFORMERS_HF_ADAPTER.from_hf_config(self.config, max_seq_len=64)
        with torch.device("meta"):
            model = TransformersModel(self.args)
        own = f"its own attention ({'; '.join(model.fallback_reasons)})" if model.fallback_reasons else ""
        return Cell(YES, own or "titanium attention")

    def cell_step(self) -> Cell:
        from titanium.model_builder import ModelBuilder
        from titanium.models.transformers import TRANSFORMERS_SPEC

        model = ModelBuilder(torch.device("cpu"), seed=0).build(TRANSFORMERS_SPEC, self.args).model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = tokens(2, 24, seed=1)

        def loss() -> torch.Tensor:
            logits = model(x[:, :-1])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())

        before = loss()
        before.backward()
        optimizer.step()
        with torch.no_grad():
            after = loss()
        ok = bool(torch.isfinite(before) and after < before)
        return Cell(YES if ok else NO, f"loss {before.item():.4f} -> {after.item():.4f}")

    def cell_logits(self) -> Cell:
        self.model = self.twin().eval()  # (as the reference: no dropout, no router jitter; gradients flow the same)
        self.logits_out = self.model(self.x)
        return compared("logits", self.logits_out, self.reference)

    def cell_grads(self) -> Cell:
        from titanium.models.transformers.hf import TRANSFORMERS_HF_ADAPTER

        hf_logits = self.hf(input_ids=self.x).logits
        hf_logits.float().logsumexp(-1).sum().backward()
        self.logits_out.logsumexp(-1).sum().backward()
        ours = {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}
        grads = TRANSFORMERS_HF_ADAPTER.to_hf(ours, self.args)
        worst, name, far = 0.0, "", []
        for hf_name, param in self.hf.named_parameters():
            if param.grad is None:
                continue
            if hf_name not in grads:  # (a tied head: the embedding's gradient holds both)
                if hf_name.endswith("lm_head.weight"):
                    continue
                return Cell(NO, f"no gradient for {hf_name}")
            if compared(hf_name, grads[hf_name], param.grad).status != YES:
                far.append(hf_name)
            value = diff(grads[hf_name], param.grad)
            if value > worst:
                worst, name = value, hf_name
        detail = f"grads max abs diff {worst:.1e}" + (f" ({name})" if name else "")
        return Cell(NO, f"{detail}; beyond 1e-5: {', '.join(far[:3])}") if far else Cell(YES, detail)

    def cell_packing(self) -> Cell:
        problems = self.refusals(packing="--sft.packing")
        if problems:
            return Cell(REFUSED, "; ".join(problems))
        x = tokens(1, 30, seed=2)
        sizes = [13, 17]
        positions = torch.cat([torch.arange(n) for n in sizes])[None]
        documents = torch.cat([torch.full((n,), d) for d, n in enumerate(sizes)])[None]
        with torch.no_grad():
            packed = self.model.eval()(x, positions=positions, document_ids=documents)
            alone = torch.cat([self.hf(input_ids=part).logits for part in x.split(sizes, dim=1)], dim=1)
        return compared("packed vs separate", packed, alone)

    def cell_lora(self) -> Cell:
        import peft
        from safetensors import safe_open

        from titanium.config.sections import LoRASection
        from titanium.models.transformers.hf import TRANSFORMERS_HF_ADAPTER
        from titanium.peft import apply_lora, export_peft_adapter, init_lora

        names = {name.rsplit(".", 1)[-1] for name, _ in self.hf.named_modules()}
        groups = ["attention", "mlp"] if names & set(MLP_PROJECTIONS) else ["attention"]  # (MoE-only: no MLP)
        cfg = LoRASection(rank=4, alpha=8.0, target_modules=groups)
        model = self.twin(lambda m: apply_lora(m, cfg))
        init_lora(model, seed=0)
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("lora_b.weight"):
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
            ours = model.eval()(self.x)
        if diff(ours, self.reference) < 1e-3:
            return Cell(NO, "the adapters do not change the logits")
        out = export_peft_adapter(model, TRANSFORMERS_HF_ADAPTER, self.args, cfg, self.folder / "adapter")
        adapted = peft.PeftModel.from_pretrained(self._hf_copy(), out).eval()
        loaded = {name.replace(".default", ""): p for name, p in adapted.named_parameters() if "lora_" in name}
        with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
            lost = {k for k in f.keys() if k not in loaded or not torch.equal(loaded[k], f.get_tensor(k))}
        if lost:  # (peft converts the names of models transformers converts on loading, and may lose ours)
            where = sorted({k.removesuffix(".weight").rsplit(".", 2)[0].rsplit(".", 1)[-1] for k in lost})
            return Cell(NO, f"peft does not load the adapters of {', '.join(where)} as written (it renames them)")
        with torch.no_grad():
            return compared("peft logits", adapted(input_ids=self.x).logits, ours)

    def cell_hf(self) -> Cell:
        problems = self.refusals(hf_checkpoint=True)
        if problems:
            return Cell(REFUSED, "; ".join(problems))
        from transformers import AutoModelForCausalLM

        from titanium.checkpoint.hf import export_hf, load_hf_weights
        from titanium.models.transformers import TransformersModel
        from titanium.models.transformers.hf import TRANSFORMERS_HF_ADAPTER

        source = self.folder / "source"
        self.hf.save_pretrained(source)
        adapter = TRANSFORMERS_HF_ADAPTER.for_config(self.config)  # (as the trainer's: per-expert checkpoints)
        args = adapter.from_hf_config(self.config, max_seq_len=64)
        with torch.device("meta"):
            model = TransformersModel(args)
        model.to_empty(device="cpu")
        model.init_weights(seed=3)
        load_hf_weights(model, source, adapter, args)

        def read_back(folder: Path) -> torch.Tensor:  # (what transformers itself makes of a folder)
            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(input_ids=self.x).logits

        with torch.no_grad():
            expected = read_back(source)  # (not self.hf: a model whose tie its own save drops reads back otherwise)
            loaded = compared("loaded logits", model.eval()(self.x), expected)
            if loaded.status != YES:
                return loaded
            export_hf(model, self.folder / "export", adapter, args, source_folder=source)
            return compared("export reloaded logits", read_back(self.folder / "export"), expected)

    def _hf_copy(self) -> Any:
        import copy

        return copy.deepcopy(self.hf)


def single_process_cells(model_type: str) -> dict[str, Cell]:
    """Every one-process cell of ``model_type`` (module docstring), in ``SINGLE_CELLS`` order."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            arch = Architecture(model_type, Path(folder))
        except Skip as e:
            return {name: Cell(UNTESTED, str(e)) for name in SINGLE_CELLS}
        cells: dict[str, Cell] = {"load": run_cell(arch.cell_load)}
        if cells["load"].status == YES:
            try:
                arch.make_reference()
            except Skip as e:
                return {**cells, **{name: Cell(UNTESTED, str(e)) for name in SINGLE_CELLS[1:]}}
        depends = {"step": "load", "logits": "load", "grads": "logits", "packing": "logits", "lora": "logits"}
        depends["hf"] = "load"
        for name in SINGLE_CELLS[1:]:
            before = depends.get(name)
            if before is not None and cells[before].status != YES:
                cells[name] = Cell(UNTESTED, f"{before} is {cells[before].status}")
                continue
            cells[name] = run_cell(getattr(arch, f"cell_{name}"))
        return cells
