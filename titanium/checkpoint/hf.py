"""Hugging Face safetensors in and out, "state-dict invariant".

Loading reads a folder as ``transformers`` writes it (``config.json`` plus ``model.safetensors``, or
shards listed in ``model.safetensors.index.json``), checks it against the configured model before
reading any tensor (every rank reads only the file headers, so all ranks fail alike), translates names
and layouts with the family's adapter (``titanium/models/<family>/hf.py``) and loads into any parallel
layout: a sharded (DTensor) model gets the full state dict from rank 0 through
``set_model_state_dict(..., broadcast_from_rank0=True)``, which also side-steps DTensor's missing CPU
RNG support. Saving writes the same keys into the same files with the same index as the source
checkpoint, plus its ``config.json`` and the tokenizer / generation files next to it, so any tool that
read the original reads ours. Only safetensors are read: nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from titanium.config.sections import CheckpointSection
from titanium.errors import UserError
from titanium.files import replace_folder
from titanium.models.hf_adapter import HFAdapter
from titanium.peft.lora import is_lora_param
from titanium.peft.merge import merged_full_state_dict

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


def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of an HF checkpoint folder, with a clear error if absent or malformed."""
    path = Path(folder) / CONFIG_FILE
    if not Path(folder).is_dir():
        raise HFCheckpointError(f"Hugging Face checkpoint folder not found: {folder}")
    if not path.is_file():
        raise HFCheckpointError(f"{path} not found; a Hugging Face checkpoint folder needs its config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HFCheckpointError(f"cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise HFCheckpointError(f"{path} is not a JSON object")
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

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    @classmethod
    def open(cls, folder: str | os.PathLike) -> HFCheckpoint:
        folder = Path(folder)
        config = read_hf_config(folder)
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
        return cls(folder, config, weight_map, index_metadata, shapes)

    def read(self, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Load tensors (all, or ``keys``) to CPU, file by file."""
        wanted = set(self.weight_map if keys is None else keys)
        out: dict[str, torch.Tensor] = {}
        for name in self.files:
            path = self.folder / name
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for key in f.keys():
                        if key in wanted:
                            out[key] = f.get_tensor(key)
            except (SafetensorError, OSError) as e:
                raise HFCheckpointError(f"{path}: cannot read tensors (truncated or corrupt?): {e}") from e
        return out


def hf_model_args(spec: Any, args: Any, cfg: CheckpointSection, *, flavor: str, tokenizer_vocab: int) -> Any:
    """The trainer's model args, checked against the ``[checkpoint]`` Hugging Face settings.

    Without ``initial_load_in_hf`` only checks that an export is possible. With it, the flavor must
    match ``config.json`` field by field (the error lists each mismatch) and the vocabulary becomes
    the checkpoint's, since its embedding table is loaded as is; the tokenizer may have fewer ids
    (Qwen pads its table) but never more. What the adapter lets the checkpoint decide (an MoE model's
    dense layers, its router settings) is taken from ``config.json`` too.
    """
    if spec.hf_adapter is None and (cfg.initial_load_in_hf or cfg.last_save_in_hf):
        raise HFCheckpointError(
            f"--model.name {spec.name} has no Hugging Face adapter; unset --checkpoint.initial_load_in_hf "
            "and --checkpoint.last_save_in_hf"
        )
    if not cfg.initial_load_in_hf or cfg.initial_load_path is None:
        return args
    folder = cfg.initial_load_path
    config = read_hf_config(folder)
    adapter = spec.hf_adapter
    adapter.check_hf_config(config, args, source=str(Path(folder) / CONFIG_FILE), flavor=flavor)
    vocab = int(config["vocab_size"])
    if tokenizer_vocab > vocab:
        raise HFCheckpointError(
            f"the tokenizer has {tokenizer_vocab} ids but {Path(folder) / CONFIG_FILE} has vocab_size {vocab}: "
            "ids past the embedding table cannot be trained; use the checkpoint's own tokenizer "
            f"(--tokenizer.kind hf --tokenizer.path {Path(folder) / 'tokenizer.json'})"
        )
    if tokenizer_vocab < vocab:
        logger.info("tokenizer has %d ids, the checkpoint's embedding %d rows (padding)", tokenizer_vocab, vocab)
    return dataclasses.replace(args, vocab_size=vocab, **adapter.checkpoint_overrides(config))


def check_hf_keys(ckpt: HFCheckpoint, adapter: HFAdapter, args: Any, expected: Mapping[str, tuple[int, ...]]) -> None:
    """Fail, naming keys, unless ``ckpt`` holds exactly the weights ``expected`` (ours -> shape)."""
    wanted = adapter.hf_shapes(expected, args)
    tied = adapter.tied(args)
    # A tied checkpoint may store lm_head anyway (it is ignored on load).
    unknown = [k for k in ckpt.shapes if k not in wanted and not (tied and adapter.our_key(k) == adapter.output_key)]
    missing = [k for k in wanted if k not in ckpt.shapes]
    wrong = [
        f"{k} {list(ckpt.shapes[k])} (model expects {list(shape)})"
        for k, shape in wanted.items()
        if k in ckpt.shapes and tuple(ckpt.shapes[k]) != tuple(shape)
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


def load_hf_weights(model: nn.Module, folder: str | os.PathLike, adapter: HFAdapter, args: Any) -> HFCheckpoint:
    """Load an HF checkpoint folder into ``model`` (plain or DTensor-sharded); returns its description.

    Collective when the model is sharded: every rank must call it. The checks run on every rank from
    the headers; only rank 0 reads tensor data, which ``set_model_state_dict`` then scatters. LoRA
    adapters (``*.lora_a/b.*``) are not in HF base checkpoints and keep their values, as does state the format
    has no slot for (an MoE's routing bias).
    """
    ckpt = HFCheckpoint.open(folder)
    model_state = model.state_dict()
    base = {k: tuple(v.shape) for k, v in model_state.items() if not is_lora_param(k) and adapter.has_hf_slot(k)}
    check_hf_keys(ckpt, adapter, args, base)
    strict = len(base) == len(model_state)
    sharded = any(isinstance(v, DTensor) for v in model_state.values())
    rank = dist.get_rank() if dist.is_initialized() else 0
    full: dict[str, torch.Tensor] = {}
    if rank == 0 or not sharded:
        full = adapter.from_hf(ckpt.read(), args)
        full = {k: v.to(model_state[k].dtype) for k, v in full.items()}
    if sharded:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
        set_model_state_dict(model, full, options=options)
    else:
        with torch.no_grad():
            model.load_state_dict(full, strict=strict)
    logger.info(
        "loaded Hugging Face weights from %s (%d tensors, %d file(s))", folder, len(ckpt.shapes), len(ckpt.files)
    )
    return ckpt


# ----- saving -----


def _default_layout(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> dict[str, str]:
    """Greedy shards of at most ``max_shard_bytes`` named as ``transformers`` names them."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    if len(shards) == 1:
        return dict.fromkeys(shards[0], SINGLE_FILE)
    n = len(shards)
    return {key: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, keys in enumerate(shards) for key in keys}


def _copy_side_files(source: Path, out: Path) -> list[str]:
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


def save_hf_weights(
    state_dict: Mapping[str, torch.Tensor],
    out: str | os.PathLike,
    adapter: HFAdapter,
    args: Any,
    *,
    dtype: torch.dtype = torch.float32,
    source: HFCheckpoint | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write our full (unsharded, CPU) ``state_dict`` as an HF checkpoint folder ``out``.

    With ``source`` (the checkpoint the run started from) the keys, files and index are the source's
    and its ``config.json`` and side files (tokenizer, generation config...) are copied; otherwise
    the files are cut at ``max_shard_bytes`` and ``config.json`` comes from the adapter.
    """
    out = Path(out)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in adapter.to_hf(state_dict, args).items()}
    if source is not None:
        layout = dict(source.weight_map)
        # A tied checkpoint that stored lm_head anyway gets it back (the same values, its own storage).
        for hf_key in set(layout) - set(tensors):
            if adapter.our_key(hf_key) == adapter.output_key and adapter.tied(args):
                tensors[hf_key] = tensors[adapter.hf_key(adapter.embedding_key)].clone()
        missing, extra = set(layout) - set(tensors), set(tensors) - set(layout)
        if missing or extra:
            raise HFCheckpointError(
                f"cannot save in the layout of {source.folder}: "
                f"model lacks {_names(missing) or 'nothing'}, source lacks {_names(extra) or 'nothing'}"
            )
        with_index = source.index_metadata is not None
        config = dict(source.config)
    else:
        layout = _default_layout(tensors, max_shard_bytes)
        with_index = len(set(layout.values())) > 1
        config = adapter.to_hf_config(args)
    dtype_name = str(dtype).removeprefix("torch.")
    for key in ("torch_dtype", "dtype"):
        if key in config or (key == "torch_dtype" and "dtype" not in config):
            config[key] = dtype_name

    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    by_file: dict[str, dict[str, torch.Tensor]] = {}
    for key, name in layout.items():
        by_file.setdefault(name, {})[key] = tensors[key]
    for name, part in sorted(by_file.items()):
        save_file(part, str(partial / name), metadata={"format": "pt"})
    if with_index:
        metadata = dict(source.index_metadata or {}) if source is not None else {}
        metadata["total_size"] = sum(t.numel() * t.element_size() for t in tensors.values())
        if "total_parameters" in metadata or source is None:
            metadata["total_parameters"] = sum(t.numel() for t in tensors.values())
        index = {"metadata": metadata, "weight_map": dict(sorted(layout.items()))}
        (partial / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    copied = _copy_side_files(source.folder, partial) if source is not None else []
    replace_folder(partial, out)
    logger.info(
        "saved Hugging Face checkpoint %s (%d tensors in %d file(s), %s%s)",
        out,
        len(tensors),
        len(by_file),
        dtype_name,
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
    """Gather ``model`` (any layout; collective when distributed) and save it on rank 0 as HF.

    LoRA adapters are merged into their base weights (a plain model any HF tool loads). With pipeline
    parallelism pass this rank's ``pp_group``: each stage is gathered on its ranks of rank 0's pipeline
    group, which send their stages to rank 0. Returns the folder on rank 0, None elsewhere.
    """
    source = HFCheckpoint.open(source_folder) if source_folder is not None else None
    rank = dist.get_rank() if dist.is_initialized() else 0
    stage_holder = pp_group is not None and 0 in dist.get_process_group_ranks(pp_group)
    state = merged_full_state_dict(model, keep=rank == 0 or stage_holder)
    if stage_holder:
        assert state is not None
        state = _gather_stages(state, pp_group)
    path = None
    if rank == 0:
        assert state is not None
        path = save_hf_weights(state, out, adapter, args, dtype=dtype, source=source, max_shard_bytes=max_shard_bytes)
    if dist.is_initialized():
        dist.barrier()
    return path


def _gather_stages(state: dict[str, torch.Tensor], pp_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Rank 0 of ``pp_group`` receives the other ranks' stages tensor by tensor (through the GPU with NCCL, on
    CPU with gloo; one tensor in flight) and returns the whole model on CPU in the order one process holds it
    (embedding, layers by number, the rest); the others return {}.
    """
    me, size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    layouts: list[Any] = [None] * size
    dist.all_gather_object(layouts, {key: (value.shape, value.dtype) for key, value in state.items()}, group=pp_group)
    first = dist.get_global_rank(pp_group, 0)
    for sender in range(1, size):
        for key, (shape, dtype) in layouts[sender].items():
            if me == sender:
                dist.send(state[key].to(device).contiguous(), dst=first, group=pp_group)
            elif me == 0:
                received = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(received, src=dist.get_global_rank(pp_group, sender), group=pp_group)
                state[key] = received.cpu()
    if me != 0:
        return {}
    leading = set(itertools.takewhile(lambda key: not key.startswith("layers."), layouts[0]))  # the embedding

    def model_order(key: str) -> tuple[int, int]:
        match = re.match(r"layers\.(\d+)\.", key)
        if match:
            return 1, int(match.group(1))
        return (0, 0) if key in leading else (2, 0)

    return {key: state[key] for key in sorted(state, key=model_order)}


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
    in the layout of ``initial_load_path`` when the run started from a Hugging Face folder."""
    source = cfg.initial_load_path if cfg.initial_load_in_hf else None
    if source is None:
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
