"""The transformers backend in one process: a backend model computes what ``transformers`` computes (logits and
gradients, fp32 <= 1e-5), its attention keeps packed documents, shared prompts and sliding windows apart exactly as
separate rows would, decoding (titanium's KV cache, or transformers' own cache for models running their own
attention) equals the full forward, its initialization is the same
whole or unit by unit (the sharded path), and its checkpoints load into ``transformers``' own class."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.objectives.tiny_backend import ARCHITECTURES, VOCAB, save_tiny_hf, tiny_hf_model
from titanium.checkpoint.hf import export_hf, load_hf_weights
from titanium.models.common.kv_cache import PAD_DOCUMENT
from titanium.models.transformers import TRANSFORMERS_SPEC, TransformersArgs, TransformersModel
from titanium.models.transformers.hf import TRANSFORMERS_HF_ADAPTER
from titanium.parallel.pipeline import keep_only

transformers = pytest.importorskip("transformers")

TOL = dict(atol=1e-5, rtol=1e-5)


def backend_twin(hf_model) -> TransformersModel:
    """A backend model of ``hf_model``'s config holding its weights (through the backend's HF adapter)."""
    args = TransformersArgs.from_config(hf_model.config.to_dict())
    with torch.device("meta"):
        model = TransformersModel(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    model.load_state_dict(TRANSFORMERS_HF_ADAPTER.from_hf(hf_model.state_dict(), args))
    return model


def tokens(rows: int = 2, seq: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_logits_and_gradients_equal_transformers(model_type: str) -> None:
    hf = tiny_hf_model(model_type)
    ours = backend_twin(hf)
    assert ours.attention == "titanium", ours.fallback_reasons
    x = tokens()
    reference = hf(input_ids=x).logits
    logits = ours(x)
    torch.testing.assert_close(logits, reference, **TOL)
    # The same gradients for every weight, through the same loss.
    reference.float().logsumexp(-1).sum().backward()
    logits.logsumexp(-1).sum().backward()
    grads = TRANSFORMERS_HF_ADAPTER.to_hf({k: p.grad for k, p in ours.named_parameters()}, ours.args)
    for name, param in hf.named_parameters():
        if name in grads:  # (a tied head: the embedding's gradient holds both)
            torch.testing.assert_close(grads[name], param.grad, **TOL, msg=name)


def test_chunked_losses_see_the_logit_transforms() -> None:
    """Granite divides its logits by logits_scaling, Gemma 3 soft-caps them: the hidden states a chunked loss
    projects by itself carry the scaling, and the projection names the cap."""
    for model_type in ("granite", "gemma3_text"):
        ours = backend_twin(tiny_hf_model(model_type)).eval()
        x = tokens()
        hidden = ours(x, project=False)
        logits = hidden @ ours.output.weight.t()
        cap = ours.output.logit_softcap
        logits = logits if cap is None else torch.tanh(logits / cap) * cap
        torch.testing.assert_close(logits, ours(x), **TOL)


def test_packed_documents_and_shared_prompts_stay_apart() -> None:
    """Gemma 3 (a sliding window of 8 < the documents, and a global layer): a packed row equals each document
    alone, and a shared-prompt row (prompt, chosen, rejected) equals prompt + chosen and prompt + rejected."""
    hf = tiny_hf_model("gemma3_text")
    ours = backend_twin(hf).eval()
    x = tokens(rows=1, seq=30)
    sizes = [11, 9, 10]
    positions = torch.cat([torch.arange(n) for n in sizes])[None]
    documents = torch.cat([torch.full((n,), d) for d, n in enumerate(sizes)])[None]
    with torch.no_grad():
        packed = ours(x, positions=positions, document_ids=documents)
        alone = torch.cat([hf(input_ids=part).logits for part in x.split(sizes, dim=1)], dim=1)
        torch.testing.assert_close(packed, alone, **TOL)
        # Shared prompt: the responses' positions continue the prompt's; each sees the prompt, not the other.
        prompt, chosen, rejected = x[:, :11], x[:, 11:20], x[:, 20:]
        positions = torch.cat([torch.arange(11), torch.arange(11, 20), torch.arange(11, 21)])[None]
        parents = torch.cat([torch.zeros(11), torch.zeros(9), torch.zeros(10)]).long()[None]
        shared = ours(x, positions=positions, document_ids=documents, parent_ids=parents)
        first = hf(input_ids=torch.cat([prompt, chosen], 1)).logits
        second = hf(input_ids=torch.cat([prompt, rejected], 1)).logits
        torch.testing.assert_close(shared[:, :20], first, **TOL)
        torch.testing.assert_close(shared[:, 20:], second[:, 11:], **TOL)


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_5_text", "gpt_oss"])
def test_generation_equals_the_full_forward(model_type: str) -> None:
    """Left-padded prompts through titanium's sampler (prefill, then one token a step from the cache): each sampled
    token's log-prob equals transformers' full forward over its prompt and what came before (fp32, 1e-5), and the
    greedy tokens are that forward's argmax. Gemma 3 decodes on titanium's attention and KV cache; Qwen3.5
    (linear-attention layers: convolution and recurrent states) and GPT-OSS (sinks, sliding windows) run their own
    attention and decode with transformers' cache (own_cache.py), the padding masked out of both. Measured: 9.5e-7,
    2.9e-6 (Qwen3.5's chunked prefill against its recurrent steps), 9.5e-7."""
    from titanium.generation.generate import generate
    from titanium.generation.sampling import SamplingParams

    hf = tiny_hf_model(model_type).eval()
    ours = backend_twin(hf).eval()
    assert (ours.attention == "titanium") == (model_type == "gemma3_text"), ours.fallback_reasons
    prompts = [tokens(1, 5, seed=1)[0].tolist(), tokens(1, 12, seed=2)[0].tolist(), tokens(1, 2, seed=3)[0].tolist()]
    for temperature in (1.0, 0.0):
        out = generate(
            ours, prompts, SamplingParams(max_new_tokens=8, temperature=temperature), stop_ids=set(), pad_id=0,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        for prompt, generated, logprobs in zip(prompts, out.tokens.tolist(), out.logprobs):
            with torch.no_grad():
                full = hf(input_ids=torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
            if temperature == 0.0:
                assert generated == full.argmax(-1).tolist()
            else:
                expected = full.log_softmax(-1).gather(1, torch.tensor(generated)[:, None])[:, 0]
                torch.testing.assert_close(logprobs, expected, **TOL)


def test_initialization_is_the_same_whole_or_unit_by_unit() -> None:
    """The sharded materialization initializes one unit at a time (``keep_only``); it draws what the whole model
    draws, and the rotary and embedding-scale buffers are transformers' own."""
    hf = tiny_hf_model("gemma3_text")
    args = TransformersArgs.from_config(hf.config.to_dict())
    with torch.device("meta"):
        template = TransformersModel(args)
    whole = copy.deepcopy(template)
    whole.to_empty(device="cpu")
    whole.init_weights(seed=5)
    expected = whole.state_dict()
    units = [([key], False, False) for key in template.layers] + [([], True, True)]
    for layers, first, last in units:
        unit = keep_only(template, layers, first, last)
        unit.to_empty(device="cpu")
        unit.init_weights(seed=5)
        for name, value in unit.state_dict().items():
            assert torch.equal(value, expected[name]), name
    reference = dict(hf.named_buffers())
    for name, buffer in whole.named_buffers():
        hf_name = TRANSFORMERS_HF_ADAPTER.hf_key(name)
        torch.testing.assert_close(buffer, reference[hf_name], rtol=0, atol=0, msg=name)
    # A whole-model cast leaves the derived buffers in float32, exact.
    cast = copy.deepcopy(whole).to(torch.bfloat16)
    for name, buffer in cast.named_buffers():
        assert buffer.dtype == torch.float32 and torch.equal(buffer, dict(whole.named_buffers())[name]), name
    # Another seed draws other weights; the same seed the same ones.
    again = copy.deepcopy(template)
    again.to_empty(device="cpu")
    again.init_weights(seed=6)
    assert not torch.equal(again.layers["0"].mlp.up_proj.weight, whole.layers["0"].mlp.up_proj.weight)


@pytest.mark.parametrize("model_type", ["gemma3_text", "granite"])
def test_hf_checkpoint_round_trip_loads_in_transformers(tmp_path: Path, model_type: str) -> None:
    """Loaded from a transformers folder (per-rank streaming reader), exported back in its layout and names:
    transformers' own class loads the export and computes the same logits."""
    hf = save_tiny_hf(tmp_path / "source", model_type)
    args = TRANSFORMERS_HF_ADAPTER.from_hf_config(hf.config.to_dict())
    with torch.device("meta"):
        ours = TRANSFORMERS_SPEC.model_cls(args)
    ours.to_empty(device="cpu")
    ours.init_weights(seed=0)
    load_hf_weights(ours, tmp_path / "source", TRANSFORMERS_HF_ADAPTER, args)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(input_ids=x).logits, **TOL)
    export_hf(ours, tmp_path / "export", TRANSFORMERS_HF_ADAPTER, args, source_folder=tmp_path / "source")
    reloaded = type(hf).from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=x).logits, hf(input_ids=x).logits, rtol=0, atol=0)


def test_models_with_their_own_attention() -> None:
    """GPT-OSS (attention sinks, sliding windows of 8) runs its own eager attention: its logits are transformers',
    and titanium's document and shared-prompt masks, given to it as explicit masks per layer type, keep packed
    samples apart and let two responses see one prompt. Qwen3.5's linear-attention layers cannot keep samples apart,
    but mask a rollout row's left padding out."""
    hf = tiny_hf_model("gpt_oss")
    ours = backend_twin(hf).eval()
    assert ours.attention == "eager" and ours.fallback_reasons == ["its attention has sinks"]
    x = tokens(rows=1, seq=30)
    sizes = [11, 19]
    documents = torch.cat([torch.full((n,), d) for d, n in enumerate(sizes)])[None]
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(input_ids=x).logits, **TOL)
        positions = torch.cat([torch.arange(n) for n in sizes])[None]
        alone = torch.cat([hf(input_ids=part).logits for part in x.split(sizes, dim=1)], dim=1)
        torch.testing.assert_close(ours(x, positions=positions, document_ids=documents), alone, **TOL)
        # One response after a prompt, as a shared-prompt row holds it: the same as the two as one sequence.
        shared = ours(x, positions=torch.arange(30)[None], document_ids=documents, parent_ids=torch.zeros_like(x))
        torch.testing.assert_close(shared, hf(input_ids=x).logits, **TOL)
    hf = tiny_hf_model("qwen3_5_text")
    qwen = backend_twin(hf).eval()
    assert qwen.attention == "sdpa" and qwen.mixes_documents
    with torch.no_grad():
        torch.testing.assert_close(qwen(x), hf(input_ids=x).logits, **TOL)
        with pytest.raises(ValueError, match="no shared prompts"):
            qwen(x, positions=torch.arange(30)[None], document_ids=documents, parent_ids=torch.zeros_like(x))
        # A rollout row: left padding (PAD_DOCUMENT) then one sample, which computes as transformers computes a
        # left-padded row (its padding mask: out of the attention, zeroed before the linear-attention layers). That
        # is the sample alone up to 2.5e-5 (measured; 2.0e-5 in float64 too: transformers' chunked delta rule over
        # the zeroed padding, not rounding).
        padded = torch.cat([torch.full((7,), PAD_DOCUMENT), torch.ones(23, dtype=torch.long)])[None]
        positions = torch.cat([torch.zeros(7, dtype=torch.long), torch.arange(23)])[None]
        rollout_row = qwen(x, positions=positions, document_ids=padded)[:, 7:]
        theirs = hf(
            input_ids=x, attention_mask=(padded != PAD_DOCUMENT).long(), position_ids=positions, use_cache=False
        )
        torch.testing.assert_close(rollout_row, theirs.logits[:, 7:], **TOL)
        torch.testing.assert_close(rollout_row, hf(input_ids=x[:, 7:]).logits, atol=1e-4, rtol=1e-4)


def test_the_generate_tool_runs_backend_folders(tmp_path: Path, capsys) -> None:
    """``python -m titanium.tools.generate FOLDER`` on a Gemma 3 folder (no native family): the backend's greedy
    completion is transformers' (its full forwards' argmax, token by token)."""
    import json

    from tests.helpers import REPO
    from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer
    from titanium.tools.generate import main

    hf = save_tiny_hf(tmp_path / "gemma3", "gemma3_text")
    tokenizer = str(REPO / DEFAULT_TOKENIZER_PATH)
    argv = [str(tmp_path / "gemma3"), "--prompt", "abc", "--chat-template", "none", "--max-new-tokens", "4"]
    assert main([*argv, "--tokenizer", tokenizer, "--device", "cpu"]) == 0
    completion = json.loads(capsys.readouterr().out.splitlines()[-1])["completion"]
    words = TiktokenTokenizer(tokenizer)
    sequence = words.encode("abc", bos=True, eos=False)
    for _ in range(4):
        with torch.no_grad():
            sequence.append(hf(input_ids=torch.tensor([sequence])).logits[0, -1].argmax().item())
    assert completion == words.decode(sequence[-4:])
