"""torchtune 0.6.1's full fine-tune recipe (``full_finetune_single_device``) on titanium's rows, for
``benchmarks/peers.py``: the parts its YAML config names and the launcher that runs the recipe.

    python benchmarks/peer_torchtune.py --config <run folder>/torchtune.yaml   # (peers.py writes the config)

torchtune 0.6.1 (its last release) predates Qwen3, so ``qwen3`` builds the Qwen3 shape from torchtune's own modules
(``TransformerDecoder``, ``MultiHeadAttention`` with q/k RMSNorm, ``Qwen2RotaryPositionalEmbeddings``, tied output).
One difference stays: torchtune 0.6.1 normalizes q and k after the rotary embedding, Qwen3 (and titanium) before it;
the two are equal while the norms' weights are all ones (as at the start) and cost the same.

The data is the packed rows titanium trains on (``peers.py`` builds them with titanium's own packer and saves them),
each row given as torchtune's packed samples are (``tokens``, ``labels`` unshifted, ``input_pos``, ``seq_lens``): both
libraries see the same token ids in the same rows and order. The weights are the Hugging Face folder titanium loads,
renamed to torchtune's keys. The metric logger writes each step's numbers as a JSON line with the time.

torchtune 0.6.1 imports things at start that torchao 0.18 no longer has where it looks: ``torchao.dtypes.nf4tensor``
(moved to ``torchao.quantization.quantize_.workflows.nf4.nf4_tensor``: the launcher maps the old name to it), and
``TensorCoreTiledLayout``, ``int4_weight_only`` and ``int8_dynamic_activation_int4_weight`` (gone; only torchtune's
int4 post-training quantizers use them, which a full fine-tune never builds: the launcher puts stand-ins there that
raise if called).
"""

from __future__ import annotations

import argparse
import importlib
import json
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import torch

IGNORE_INDEX = -100


GONE_FROM_TORCHAO = {
    "torchao.dtypes": ["TensorCoreTiledLayout"],
    "torchao.quantization": ["int4_weight_only", "int8_dynamic_activation_int4_weight"],
}
"""What torchtune 0.6.1's quantization module imports and torchao 0.18 removed (module -> names)."""


def _gone(name: str):
    def stand_in(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"torchao 0.18 has no {name}: torchtune's int4 quantizers do not run with it")

    return stand_in


def shim_torchao() -> None:
    """Let torchtune 0.6.1 import with torchao 0.18 (see the module's docstring)."""
    try:
        importlib.import_module("torchao.dtypes.nf4tensor")
    except ModuleNotFoundError:
        moved = importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
        sys.modules["torchao.dtypes.nf4tensor"] = moved
    for module, names in GONE_FROM_TORCHAO.items():
        found = importlib.import_module(module)
        for name in names:
            if not hasattr(found, name):
                setattr(found, name, _gone(name))


def qwen3(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    head_dim: int,
    max_seq_len: int,
    rope_base: float,
    norm_eps: float,
    tie_word_embeddings: bool,
):
    """A Qwen3-shaped ``TransformerDecoder`` of torchtune's modules (no biases, q/k norms, SwiGLU MLP)."""
    from torch import nn
    from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
    from torchtune.modules import (
        FeedForward,
        MultiHeadAttention,
        RMSNorm,
        TiedLinear,
        TransformerDecoder,
        TransformerSelfAttentionLayer,
    )

    rope = Qwen2RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    layers = nn.ModuleList()
    for _ in range(num_layers):
        attn = MultiHeadAttention(
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            q_proj=nn.Linear(embed_dim, num_heads * head_dim, bias=False),
            k_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False),
            v_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False),
            output_proj=nn.Linear(num_heads * head_dim, embed_dim, bias=False),
            pos_embeddings=rope,
            q_norm=RMSNorm(head_dim, eps=norm_eps),
            k_norm=RMSNorm(head_dim, eps=norm_eps),
            max_seq_len=max_seq_len,
        )
        mlp = FeedForward(
            gate_proj=nn.Linear(embed_dim, intermediate_dim, bias=False),
            down_proj=nn.Linear(intermediate_dim, embed_dim, bias=False),
            up_proj=nn.Linear(embed_dim, intermediate_dim, bias=False),
        )
        layers.append(
            TransformerSelfAttentionLayer(
                attn=attn, mlp=mlp, sa_norm=RMSNorm(embed_dim, eps=norm_eps), mlp_norm=RMSNorm(embed_dim, eps=norm_eps)
            )
        )
    embeddings = nn.Embedding(vocab_size, embed_dim)
    output = TiedLinear(embeddings) if tie_word_embeddings else nn.Linear(embed_dim, vocab_size, bias=False)
    return TransformerDecoder(
        tok_embeddings=embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=head_dim,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output,
    )


HF_TO_TUNE = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}
HF_LAYER_TO_TUNE = {
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "self_attn.q_norm.weight": "attn.q_norm.scale",
    "self_attn.k_norm.weight": "attn.k_norm.scale",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "mlp_norm.scale",
}


def tune_key(hf_key: str) -> str:
    """A Hugging Face Qwen3 weight's name in torchtune's decoder."""
    if hf_key in HF_TO_TUNE:
        return HF_TO_TUNE[hf_key]
    _, _, index, rest = hf_key.split(".", 3)  # model.layers.<i>.<rest>
    return f"layers.{index}.{HF_LAYER_TO_TUNE[rest]}"


class HFFolderCheckpointer:
    """Loads a Hugging Face folder's safetensors under torchtune's names; saves nothing (a timed run)."""

    def __init__(self, folder: str, tie_word_embeddings: bool, should_load_recipe_state: bool = False) -> None:
        self.folder, self.tied = Path(folder), tie_word_embeddings

    def load_checkpoint(self) -> dict[str, Any]:
        from safetensors.torch import load_file

        state = {}
        for file in sorted(self.folder.glob("*.safetensors")):
            for key, value in load_file(file).items():
                if not (self.tied and key == "lm_head.weight"):
                    state[tune_key(key)] = value
        return {"model": state}

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        pass


class RowsTokenizer:
    """What the recipe asks of a tokenizer when the data comes as token ids: the padding id and the row width."""

    def __init__(self, pad_id: int, max_seq_len: int) -> None:
        self.pad_id, self.max_seq_len = pad_id, max_seq_len


def tune_row(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A titanium packed row (``input``, ``label`` already shifted, ``positions``, ``document_ids``) as a torchtune
    packed sample: labels unshifted (the recipe shifts them), each document's length in ``seq_lens``."""
    labels = torch.cat([torch.tensor([IGNORE_INDEX]), row["label"][:-1]])
    _, counts = torch.unique_consecutive(row["document_ids"], return_counts=True)
    return {"tokens": row["input"], "labels": labels, "input_pos": row["positions"], "seq_lens": counts}


class TitaniumRows(torch.utils.data.Dataset):
    """The rows ``peers.py`` saved (``torch.save`` of a list of titanium rows), in order."""

    def __init__(self, path: str) -> None:
        self.rows = [tune_row(r) for r in torch.load(path)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def titanium_rows(tokenizer: RowsTokenizer, path: str, packed: bool = True) -> TitaniumRows:
    """The recipe's ``dataset`` component: called with the tokenizer (unused: the rows are token ids already)."""
    return TitaniumRows(path)


class JsonlLogger:
    """torchtune's metric logger interface, writing one JSON line per step: the recipe's numbers and the time."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a")  # noqa: SIM115 (closed by close(), as the recipe calls it)

    def log_config(self, config: Any) -> None:
        pass

    def log(self, name: str, data: float, step: int) -> None:
        self.log_dict({name: data}, step)

    def log_dict(self, payload: dict[str, Any], step: int) -> None:
        numbers = {k: float(v) for k, v in payload.items()}
        self.file.write(json.dumps({"step": step, "time": time.perf_counter(), **numbers}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def run_recipe(config: str) -> None:
    """The recipe as ``tune run full_finetune_single_device --config <config>`` runs it."""
    shim_torchao()
    import torchtune

    recipe = Path(torchtune.__file__).resolve().parents[1] / "recipes" / "full_finetune_single_device.py"
    sys.argv = [str(recipe), "--config", config]
    runpy.run_path(str(recipe), run_name="__main__")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the recipe's YAML config")
    run_recipe(parser.parse_args().config)
