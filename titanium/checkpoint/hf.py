"""Hugging Face safetensors in and out, "state-dict invariant".

Loading reads a folder as ``transformers`` writes it (``config.json`` plus ``model.safetensors``, or
shards listed in ``model.safetensors.index.json``), checks it against the configured model before
reading any tensor (every rank reads only the file headers, so all ranks fail alike), translates names
and layouts with the family's adapter (``titanium/models/<family>/hf.py``) and loads into any parallel
layout: each rank reads only the slices of the tensors it holds (``hf_stream``). Saving writes the
same keys into the same files with the same index as the source checkpoint, plus its ``config.json``
and the tokenizer / generation files next to it, so any tool that read the original reads ours. Only
safetensors are read: nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from titanium.checkpoint.full_blocks import full_blocks
from titanium.checkpoint.hf_quantized import QUANTIZATION, Quantized, quantization_problem, quantized
from titanium.checkpoint.hf_stream import SliceReader, stream_into
from titanium.config.sections import CheckpointSection
from titanium.data.tokenizer import has_tokenizer
from titanium.errors import UserError
from titanium.files import replace_folder
from titanium.models import hf_family, list_models
from titanium.models.hf_adapter import HFAdapter, HFConfigError
from titanium.peft.lora import is_lora_param

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".h5", ".msgpack", ".gguf")
_SIDE_FILE_MAX_BYTES = 100 * 1024**2

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFCheckpointError(UserError, RuntimeError):
    """A Hugging Face checkpoint folder that cannot be used; the message names the file and keys."""


def _names(keys: list[str] | set[str], limit: int = 8) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def named_by(option: str | None) -> str:
    """How an error starts when ``option`` (a flag, ``"--kd.teacher_path"``, or a tool's argument) named the folder:
    the user fixes that option, not whichever other one would fix another folder."""
    return f"{option}: " if option else ""


def read_hf_config(folder: str | os.PathLike, option: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of an HF checkpoint folder, with a clear error if absent or malformed (naming
    ``option``, the setting that pointed at the folder)."""
    path, by = Path(folder) / CONFIG_FILE, named_by(option)
    if not Path(folder).is_dir():
        raise HFCheckpointError(f"{by}Hugging Face checkpoint folder not found: {folder}")
    if not path.is_file():
        raise HFCheckpointError(f"{by}{path} not found; a Hugging Face checkpoint folder needs its config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HFCheckpointError(f"{by}cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise HFCheckpointError(f"{by}{path} is not a JSON object")
    return config


@dataclass
class HFCheckpoint:
    """What an HF checkpoint folder holds, read from its headers only (no tensor data).

    ``weight_map`` (key -> file name) is the shard layout that saving reproduces; ``index_metadata``
    is None for a single ``model.safetensors`` without an index.
    """

    folder: Path
    config: dict[str, Any]
    weight_map: dict[str, str]
    index_metadata: dict[str, Any] | None
    shapes: dict[str, tuple[int, ...]]
    quantized: Quantized | None = None
    """How a quantized checkpoint stores its weights (``hf_quantized``: FP8, MXFP4), which are read dequantized.
    ``weight_map`` and ``shapes`` name the weights it stands for (in memory's shapes, each in the file of its first
    stored tensor); the stored tensors are in ``stored_files``."""
    stored_files: dict[str, str] = field(default_factory=dict)

    def reader(self) -> SliceReader:
        """A reader of this checkpoint's weights (dequantized, for a quantized one)."""
        return SliceReader(self.folder, {**self.weight_map, **self.stored_files}, self.quantized)

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    @classmethod
    def open(cls, folder: str | os.PathLike, option: str | None = None) -> HFCheckpoint:
        """The folder's config and file headers; errors name ``option``, the setting that pointed at it."""
        try:
            return cls._open(Path(folder), option)
        except HFCheckpointError as e:
            by = named_by(option)
            raise HFCheckpointError(str(e) if str(e).startswith(by) else f"{by}{e}") from None

    @classmethod
    def _open(cls, folder: Path, option: str | None) -> HFCheckpoint:
        config = read_hf_config(folder, option)
        index_path = folder / INDEX_FILE
        if index_path.is_file():
            try:
                index = json.loads(index_path.read_text())
                weight_map = dict(index["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise HFCheckpointError(f"cannot read {index_path} (needs a 'weight_map'): {e}") from e
            index_metadata = dict(index.get("metadata") or {})
        elif (folder / SINGLE_FILE).is_file():
            weight_map, index_metadata = {}, None
        else:
            pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(_PICKLE_SUFFIXES))
            hint = (
                f" (found {', '.join(pickles)}: pickled weights are never loaded; convert them to safetensors "
                "first, e.g. transformers' save_pretrained(safe_serialization=True))"
                if pickles
                else ""
            )
            raise HFCheckpointError(f"{folder}: neither {INDEX_FILE} nor {SINGLE_FILE} found{hint}")

        shapes: dict[str, tuple[int, ...]] = {}
        files = sorted(set(weight_map.values())) if index_metadata is not None else [SINGLE_FILE]
        for name in files:
            path = folder / name
            if not path.is_file():
                raise HFCheckpointError(f"{path}: listed in {INDEX_FILE} but missing")
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        shapes[key] = tuple(f.get_slice(key).get_shape())
                        if index_metadata is None:
                            weight_map[key] = name
            except (SafetensorError, OSError) as e:
                raise HFCheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from e
            listed = {k for k, v in weight_map.items() if v == name}
            absent = listed - set(shapes)
            if absent:
                raise HFCheckpointError(f"{path} lacks tensors that {INDEX_FILE} places there: {_names(absent)}")
        problem = quantization_problem(config)
        if problem is not None:
            raise HFCheckpointError(f"{folder / CONFIG_FILE}: {problem}")
        try:
            stored = quantized(config, shapes)
        except ValueError as e:
            raise HFCheckpointError(f"{folder}: {e}") from None
        if stored is None:
            return cls(folder, config, weight_map, index_metadata, shapes)
        parts = {part for group in stored.parts.values() for part in group}
        stored_files = {part: weight_map[part] for part in parts}
        weight_map = {key: name for key, name in weight_map.items() if key not in parts}
        weight_map.update({key: stored_files[group[0]] for key, group in stored.parts.items()})
        shapes = {key: shape for key, shape in shapes.items() if key not in parts} | dict(stored.shapes)
        return cls(folder, config, weight_map, index_metadata, shapes, stored, stored_files)

    def read(self, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Load tensors (all, or ``keys``) to CPU."""
        try:
            with self.reader() as reader:
                return {key: reader.read(key) for key in (self.weight_map if keys is None else keys)}
        except OSError as e:
            raise HFCheckpointError(f"cannot read tensors (truncated or corrupt?): {e}") from e


def require_hf_adapter(spec: Any, cfg: CheckpointSection) -> None:
    """Refuse ``[checkpoint]`` Hugging Face settings for a family without an adapter."""
    if spec.hf_adapter is None and (cfg.initial_load_in_hf or cfg.last_save_in_hf):
        raise HFCheckpointError(
            f"--model.name {spec.name} has no Hugging Face adapter; unset --checkpoint.initial_load_in_hf "
            "and --checkpoint.last_save_in_hf"
        )


PADDING_ROWS = 1024
"""How many more embedding rows than tokenizer ids padding explains: published models round their table up to a
multiple of 64 to 1,024 (Qwen2.5: 151,665 ids, 151,936 rows). A tokenizer further short is another model's."""


def hf_model_args(
    spec: Any,
    folder: str | os.PathLike,
    *,
    tokenizer_vocab: int | None = None,
    option: str | None = None,
    family_option: str | None = None,
    tokenizer_origin: str | os.PathLike | None = None,
    **overrides: Any,
) -> Any:
    """The family args that a Hugging Face folder's ``config.json`` describes: the one way the trainer, the dry
    run and every tool learn the architecture of an HF model (a flavor is a preset for fresh models, never a
    requirement, so a fine-tuned, pruned or unlisted size loads as it is).

    ``overrides`` replace args (the trainer's ``max_seq_len``). With ``tokenizer_vocab`` the tokenizer (read from
    ``tokenizer_origin``, a file or folder) must fit the checkpoint's embedding table: never more ids, and fewer
    only by padding (``PADDING_ROWS``) unless it is the folder's own. Errors name ``option`` (the setting that
    pointed at the folder) and the file and field: another family's checkpoint, a feature the family does not
    implement, a shape its args refuse. For another family's checkpoint the fix is ``family_option`` (the setting
    that picks this folder's family, e.g. ``--kd.teacher_model``), or, when none does (a value model is the
    policy's family), another folder.
    """
    source, by = Path(folder) / CONFIG_FILE, named_by(option)
    adapter = spec.hf_adapter
    if adapter is None:
        raise HFCheckpointError(f"{by}model {spec.name!r} has no Hugging Face adapter")
    config = read_hf_config(folder, option)
    problem = quantization_problem(config)
    if problem is not None:
        raise HFConfigError(f"{by}{source}: {problem}")
    model_type = config.get("model_type")
    if not adapter.reads(model_type):
        hint = hf_family(model_type)
        if hint is None:
            fix = (
                f"no native family reads it (families: {', '.join(list_models())}); leave --model.name out (auto) or "
                "use --model.backend transformers to build it with transformers' own code"
            )
        elif family_option is not None:
            fix = f"use {family_option} {hint}"
        else:
            fix = f"point {option or 'it'} at a {spec.name} checkpoint (this one is {hint})"
        raise HFConfigError(
            f"{by}{source}: model_type {model_type!r} is not a {spec.name} checkpoint ({adapter.model_type!r}); {fix}"
        )
    try:
        args = adapter.from_hf_config(config, **overrides)
    except (ValueError, KeyError) as e:  # (HFConfigError is a ValueError)
        what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise HFConfigError(f"{by}{source}: {what}") from None
    if tokenizer_vocab is not None:
        check_tokenizer_fits(tokenizer_vocab, args.vocab_size, folder, tokenizer_origin)
    return args


def check_tokenizer_fits(
    tokenizer_vocab: int, rows: int, folder: str | os.PathLike, origin: str | os.PathLike | None
) -> None:
    """A tokenizer of ``tokenizer_vocab`` ids (from ``origin``) fits the ``rows`` of the embedding of the model in
    ``folder``: never more ids, and fewer only by padding unless it is the folder's own (a run that trains another
    tokenizer's ids into a model is refused, not noted)."""
    source = Path(folder) / CONFIG_FILE
    named = f"the tokenizer {str(origin)!r}" if origin is not None else "the tokenizer"
    own = origin is not None and Path(folder).resolve() in (Path(origin).resolve(), Path(origin).resolve().parent)
    fix = (
        f"use the folder's own tokenizer (leave the --tokenizer flags out, or --tokenizer.kind hf --tokenizer.path "
        f"{folder})"
        if has_tokenizer(folder)
        else f"{folder} has no tokenizer files: point --tokenizer.kind hf --tokenizer.path at the tokenizer the "
        "model was trained with (or save it into the folder)"
    )
    if tokenizer_vocab > rows:
        raise HFCheckpointError(
            f"{named} has {tokenizer_vocab} ids but {source} has vocab_size {rows}: ids past the embedding table "
            f"cannot be trained; {fix}"
        )
    if tokenizer_vocab < rows - PADDING_ROWS + 1 and not own:
        raise HFCheckpointError(
            f"{named} has {tokenizer_vocab} ids but {source} has vocab_size {rows}: {rows - tokenizer_vocab} rows "
            f"more than ids is not padding (published models pad by fewer than {PADDING_ROWS}), so it is not this "
            f"model's tokenizer; {fix}"
        )
    if tokenizer_vocab < rows:
        logger.info("tokenizer has %d ids, the checkpoint's embedding %d rows (padding)", tokenizer_vocab, rows)


def check_hf_keys(ckpt: HFCheckpoint, adapter: HFAdapter, args: Any, expected: Mapping[str, tuple[int, ...]]) -> None:
    """Fail, naming keys, unless ``ckpt`` holds exactly the weights ``expected`` (ours -> shape).

    The expected Hugging Face keys and shapes are what the adapter makes of empty (meta) tensors of ours, so
    renamed, permuted and fused tensors (Phi-3's ``qkv_proj``) are checked alike. A tied checkpoint may hold
    ``lm_head`` anyway (some exporters store it), and a reward model started from a causal LM skips its
    ``lm_head``: the adapter's ``ignored_hf_keys``.
    """
    meta = {key: torch.empty(shape, device="meta") for key, shape in expected.items()}
    wanted = {key: tuple(value.shape) for key, value in adapter.to_hf(meta, args).items()}
    tolerated = adapter.ignored_hf_keys(args, expected)
    missing = set(wanted) - set(ckpt.shapes)
    unknown = {key for key in set(ckpt.shapes) - set(wanted) - tolerated if not adapter.skips(key, args)}
    wrong = [
        f"{key} {list(ckpt.shapes[key])} (model expects {list(shape)})"
        for key, shape in wanted.items()
        if key in ckpt.shapes and tuple(ckpt.shapes[key]) != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys: {_names(missing)}")
    if unknown:
        problems.append(f"unexpected keys: {_names(unknown)}")
    if wrong:
        problems.append(f"shape mismatch: {'; '.join(wrong[:8])}")
    if problems:
        raise HFCheckpointError(f"{ckpt.folder} does not fit the model: " + "; ".join(problems))


def load_hf_weights(
    model: nn.Module,
    folder: str | os.PathLike,
    adapter: HFAdapter,
    args: Any,
    whole: Mapping[str, tuple[int, ...]] | None = None,
    option: str | None = None,
) -> HFCheckpoint:
    """Load an HF checkpoint folder into ``model`` (plain or DTensor-sharded, any layout); returns its description.

    Every rank checks the checkpoint from the file headers, then reads only the parts of the tensors it holds
    (``hf_stream``): no rank reads the whole checkpoint and nothing is sent between ranks. LoRA adapters
    (``*.lora_a/b.*``) are not in HF base checkpoints and keep their values, as does state the format has no
    slot for (an MoE's routing bias).

    ``whole`` (ours -> shape): the whole model's weights, when ``model`` holds only some of them (this rank's
    pipeline stages). The checkpoint is checked against the whole model. Errors name ``option``, the setting that
    pointed at the folder.
    """
    ckpt = HFCheckpoint.open(folder, option)
    base = {k: v for k, v in model.state_dict().items() if not is_lora_param(k) and adapter.has_hf_slot(k)}
    if whole is not None:
        whole = {k: shape for k, shape in whole.items() if adapter.has_hf_slot(k)}
    try:
        check_hf_keys(ckpt, adapter, args, {k: tuple(v.shape) for k, v in base.items()} if whole is None else whole)
    except HFCheckpointError as e:
        raise HFCheckpointError(f"{named_by(option)}{e}") from None
    try:
        with ckpt.reader() as reader:
            stream_into(base, reader, adapter, args)
    except OSError as e:
        raise HFCheckpointError(
            f"{named_by(option)}cannot read tensors of {folder} (truncated or corrupt?): {e}"
        ) from e
    stored = ckpt.quantized
    dequantized = "" if stored is None else f", {len(stored.parts)} of them {stored.method}, dequantized"
    logger.info(
        "loaded Hugging Face weights from %s (%d tensors%s, %d file(s); this rank read %.1f MiB of them)",
        folder,
        len(ckpt.shapes),
        dequantized,
        len(ckpt.files),
        reader.bytes_read / 2**20,
    )
    return ckpt


# ----- saving -----


class _FileWriter:
    """Writes Hugging Face tensors into a folder's safetensors files as they arrive, so a model can be written block
    by block: with a source ``layout`` (key -> file) a file is written as soon as all its tensors are there; without
    one, files are cut greedily at ``max_shard_bytes`` in arrival order (as ``transformers`` cuts them) and named
    once their count is known. Only files not yet complete are held in memory.
    """

    def __init__(self, folder: Path, layout: Mapping[str, str] | None, max_shard_bytes: int) -> None:
        self.folder, self.layout, self.max_shard_bytes = folder, layout, max_shard_bytes
        self.waiting: dict[str, set[str]] = {}  # (layout) file -> its keys not yet added
        for key, name in (layout or {}).items():
            self.waiting.setdefault(name, set()).add(key)
        self.filling: dict[str, dict[str, torch.Tensor]] = {}  # file -> its tensors added so far
        self.cut: list[list[str]] = []  # (no layout) the keys of each file written so far
        self.cut_bytes = 0  # (no layout) of the file being filled
        self.extra: list[str] = []
        self.total_size = self.total_parameters = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.total_size += nbytes
        self.total_parameters += tensor.numel()
        if self.layout is None:
            if self.filling and self.cut_bytes + nbytes > self.max_shard_bytes:
                self._cut()
            self.filling.setdefault("", {})[key] = tensor
            self.cut_bytes += nbytes
            return
        name = self.layout.get(key)
        if name is None:
            self.extra.append(key)
            return
        self.filling.setdefault(name, {})[key] = tensor
        self.waiting[name].discard(key)
        if not self.waiting[name]:
            save_file(self.filling.pop(name), str(self.folder / name), metadata={"format": "pt"})

    def _cut(self) -> None:
        shard = self.filling.pop("", {})
        if shard:
            save_file(shard, str(self.folder / f".shard-{len(self.cut)}"), metadata={"format": "pt"})
            self.cut.append(list(shard))
        self.cut_bytes = 0

    def finish(self) -> dict[str, str]:
        """The files' layout (key -> file), every file written; with a source layout, an error naming the keys
        that the model and the layout do not share."""
        if self.layout is not None:
            missing = {key for keys in self.waiting.values() for key in keys}
            if missing or self.extra:
                raise HFCheckpointError(
                    f"model lacks {_names(missing) or 'nothing'}, source lacks {_names(self.extra) or 'nothing'}"
                )
            return dict(self.layout)
        self._cut()
        n, layout = len(self.cut), {}
        for i, keys in enumerate(self.cut):
            name = SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.folder / f".shard-{i}").rename(self.folder / name)
            layout.update(dict.fromkeys(keys, name))
        return layout


def copy_side_files(source: Path, out: Path) -> list[str]:
    """Tokenizer, generation config, license, README...: small top-level files that are not weights."""
    copied = []
    for path in sorted(source.iterdir()):
        name = path.name
        if (
            not path.is_file()
            or name in (CONFIG_FILE, INDEX_FILE)
            or name.endswith(".safetensors")
            or name.endswith(_PICKLE_SUFFIXES)
            or path.stat().st_size > _SIDE_FILE_MAX_BYTES
        ):
            continue
        shutil.copy2(path, out / name)
        copied.append(name)
    return copied


def config_with_dtype(config: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` with the weights' dtype, under ``torch_dtype`` and/or ``dtype`` (transformers 5's name)."""
    out = dict(config)
    for key in ("torch_dtype", "dtype"):
        if key in out or (key == "torch_dtype" and "dtype" not in out):
            out[key] = str(dtype).removeprefix("torch.")
    return out


def save_hf_weights(
    weights: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]],
    out: str | os.PathLike,
    adapter: HFAdapter,
    args: Any,
    *,
    dtype: torch.dtype = torch.float32,
    source: HFCheckpoint | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write our full (unsharded) state dict, or the model as such full blocks in model order (a block holds whole
    layers, so fused and stacked tensors convert), as an HF checkpoint folder ``out``, each file as soon as it is
    complete.

    With ``source`` (the checkpoint the run started from) the keys, files and index are the source's
    and its ``config.json`` and side files (tokenizer, generation config...) are copied; otherwise
    the files are cut at ``max_shard_bytes`` and ``config.json`` comes from the adapter. The folder appears
    complete or not at all.
    """
    out = Path(out)
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    # (The source's tensors of no part of the model, which loading skipped, are not written: as transformers saves.)
    kept = None if source is None else {k: f for k, f in source.weight_map.items() if not adapter.skips(k, args)}
    writer = _FileWriter(partial, kept, max_shard_bytes)
    # A tied checkpoint that stored lm_head anyway gets it back (the same values, its own storage).
    lm_head = adapter.hf_key(adapter.output_key) if adapter.tied(args) else None
    lm_head = lm_head if source is not None and lm_head in source.weight_map else None
    for block in [weights] if isinstance(weights, Mapping) else weights:
        for key, value in adapter.to_hf(block, args).items():
            tensor = value.detach().to("cpu", dtype).contiguous()
            writer.add(key, tensor)
            if lm_head is not None and key == adapter.hf_key(adapter.embedding_key):
                writer.add(lm_head, tensor.clone())
    try:
        layout = writer.finish()
    except HFCheckpointError as e:
        raise HFCheckpointError(f"cannot save in the layout of {source.folder}: {e}") from None  # type: ignore[union-attr]
    if source is not None:  # (an FP8 source's export holds the dequantized weights: no quantization_config)
        with_index, config = source.index_metadata is not None, dict(source.config)
        config.pop(QUANTIZATION, None)
    else:
        with_index, config = len(set(layout.values())) > 1, adapter.to_hf_config(args)
    config = config_with_dtype(config, dtype)
    if with_index:
        metadata = dict(source.index_metadata or {}) if source is not None else {}
        metadata["total_size"] = writer.total_size
        if "total_parameters" in metadata or source is None:
            metadata["total_parameters"] = writer.total_parameters
        index = {"metadata": metadata, "weight_map": dict(sorted(layout.items()))}
        (partial / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    copied = copy_side_files(source.folder, partial) if source is not None else []
    replace_folder(partial, out)
    logger.info(
        "saved Hugging Face checkpoint %s (%d tensors in %d file(s), %s%s)",
        out,
        len(layout),
        len(set(layout.values())),
        str(dtype).removeprefix("torch."),
        f"; copied {', '.join(copied)}" if copied else "",
    )
    return out


def export_hf(
    model: nn.Module,
    out: str | os.PathLike,
    adapter: HFAdapter,
    args: Any,
    *,
    dtype: torch.dtype = torch.float32,
    source_folder: str | os.PathLike | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    pp_group: dist.ProcessGroup | None = None,
) -> Path | None:
    """Save ``model`` (any layout; collective when distributed) on rank 0 as HF, gathered one block at a time
    (``full_blocks``: no rank holds the whole model; rank 0 holds one block and the files not yet written).

    LoRA adapters are merged into their base weights (a plain model any HF tool loads). With pipeline
    parallelism pass this rank's ``pp_group``: each stage's blocks are sent over it. Returns the folder on rank 0,
    None elsewhere.
    """
    source = HFCheckpoint.open(source_folder) if source_folder is not None else None
    blocks = full_blocks(model, pp_group)
    path = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = save_hf_weights(blocks, out, adapter, args, dtype=dtype, source=source, max_shard_bytes=max_shard_bytes)
    else:
        for _ in blocks:  # (the gathers are collective)
            pass
    if dist.is_initialized():
        dist.barrier()
    return path


def shard_size_bytes(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"20KB"`` or a plain byte count -> bytes (decimal units, like HF)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit):
            return math.floor(float(upper[: -len(unit)]) * factor)
    return int(upper)


def export_final_hf(
    model: nn.Module,
    spec: Any,
    args: Any,
    cfg: CheckpointSection,
    *,
    dump_folder: str,
    flavor: str,
    pp_group: dist.ProcessGroup | None = None,
) -> Path | None:
    """The ``[checkpoint] last_save_in_hf`` export to ``{dump_folder}/{hf_folder}`` in ``export_dtype``:
    in the layout of ``initial_load_path`` when the run started from a Hugging Face folder of the same kind of
    model."""
    source = cfg.initial_load_path if cfg.initial_load_in_hf else None
    if source is not None and not spec.hf_adapter.exports_in_source_layout():
        # Another kind of model than its source (a reward model from a causal LM): a fresh layout and config.json,
        # with the source's context length.
        length = read_hf_config(source).get("max_position_embeddings", args.max_seq_len)
        args, source = dataclasses.replace(args, max_seq_len=length), None
    elif source is None and flavor in spec.flavors:
        # A fresh config.json states the flavor's context length, not this run's training seq_len.
        args = dataclasses.replace(args, max_seq_len=spec.flavors[flavor].max_seq_len)
    return export_hf(
        model,
        Path(dump_folder) / cfg.hf_folder,
        spec.hf_adapter,
        args,
        dtype=EXPORT_DTYPES[cfg.export_dtype],
        source_folder=source,
        pp_group=pp_group,
    )
