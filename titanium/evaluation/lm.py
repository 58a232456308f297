"""titanium's model as an lm-evaluation-harness ``LM``: log-likelihoods from its forward, generations from its KV-cache
sampler (titanium.generation.generate), prompts rendered by its chat templates.

It reads and answers like lm-eval's own Hugging Face model (``HFLM``), so scores compare with published ones: text is
encoded with the tokenizer's special-token strings read as specials and BOS first where the tokenizer has one
(unless the text already starts with it); a log-likelihood request is scored right-padded, its context and
continuation cut on the left to the model's length; a document's rolling log-likelihood is summed over lm-eval's
windows; generation is greedy unless a task asks to sample, until a stop string or the end-of-text token, the
stop string cut off. The evaluator hands each data-parallel rank its share of the requests (``rank``,
``world_size``); under FSDP every forward is a collective, so the ranks first agree on how many batches to run (and
how many tokens each generation may take) and a rank with fewer runs placeholder batches.

Importing this module imports lm_eval (the optional ``[eval]`` dependency); titanium.evaluation.harness checks first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn
from torch.distributed.tensor import DTensor

from titanium.data.chat import ChatTemplate, JinjaTemplate, Message, SpecialTextEncoder
from titanium.data.tokenizer import Tokenizer
from titanium.errors import UserError
from titanium.generation.generate import all_ranks_done, generate
from titanium.generation.sampling import SamplingParams

logger = logging.getLogger(__name__)

ScoredRequest = tuple[Any, list[int], list[int]]
"""What ``TemplateLM`` hands ``_loglikelihood_tokens``: (the request's strings or None, context ids, continuation
ids)."""


class TitaniumLM(TemplateLM):
    """``model`` (a titanium decoder, sharded or not, in eval mode) as an lm-eval ``LM``.

    ``group`` is the data-parallel process group the evaluator splits requests over (None: one process).
    ``forward_context`` is the context the model runs in (the builder's autocast for mixed precision).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        *,
        max_length: int,
        batch_size: int = 1,
        max_gen_toks: int = 256,
        template: ChatTemplate | None = None,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
        forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        add_bos_token: bool | None = None,
        name: str = "titanium",
    ) -> None:
        super().__init__()
        self.model, self.tok, self.template, self.name = model, tokenizer, template, name
        self.max_length, self.batch_size, self.max_gen_toks = max_length, batch_size, max_gen_toks
        self.forward_context = forward_context
        self._device = torch.device(device)
        self.group = group
        if group is not None:
            self._rank, self._world_size = dist.get_rank(group), dist.get_world_size(group)
        self.add_bos_token = tokenizer.bos_id is not None if add_bos_token is None else add_bos_token
        self._encoder = SpecialTextEncoder(tokenizer)
        self._bos_text = tokenizer.decode([tokenizer.bos_id]) if tokenizer.bos_id is not None else None
        self._special_ids = set(tokenizer.special_tokens.values())
        self._stop_ids = {tokenizer.eos_id} | (template.stop_ids if template is not None else set())

    # ----- text and ids -----

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and the first rolling window) is conditioned on: BOS, else end-of-text."""
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Special-token strings become their ids; BOS first when ``add_special_tokens`` (None: where the tokenizer
        has one and ``string`` does not already start with it)."""
        add_bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and self._bos_text is not None and string.startswith(self._bos_text):
            add_bos = False
        ids = self._encoder.encode(string)
        if add_bos and self.tok.bos_id is not None:
            ids.insert(0, self.tok.bos_id)
        return ids

    def tok_decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens (as lm-eval decodes generations)."""
        return self.tok.decode([i for i in ids if i not in self._special_ids])

    # ----- chat -----

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the model's chat template renders it, ending in the assistant's header (or, without
        ``add_generation_prompt``, in the last assistant message's text, for the model to continue)."""
        if self.template is None:
            raise UserError("--apply_chat_template needs a chat template: the tokenizer's own or --chat.chat_template")
        messages = [Message(m["role"], m["content"]) for m in chat_history]
        if add_generation_prompt:
            return self.tok.decode(self.template.prompt(messages))
        *before, last = messages
        return self.tok.decode(self.template.prompt(before)) + last.content

    @property
    def tokenizer_name(self) -> str:
        return repr(self.tok)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """What renders chat prompts (logged with the results): the tokenizer's Jinja source or the format's name."""
        if not chat_template or self.template is None:
            return None
        return self.tok.chat_template if isinstance(self.template, JinjaTemplate) else type(self.template).__name__

    # ----- the data-parallel ranks -----

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.group is None:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, dst), group=self.group)
        return out

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _agreed(self, values: list[int]) -> list[int]:
        """Per position, the largest of every rank's ``values`` (a shorter list counts as 0s there): the plan of
        forwards all ranks run together."""
        if self.group is None:
            return values
        count = torch.tensor([len(values)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        padded = torch.zeros(int(count.item()), dtype=torch.long, device=self.device)
        padded[: len(values)] = torch.tensor(values, dtype=torch.long)
        dist.all_reduce(padded, op=dist.ReduceOp.MAX, group=self.group)
        return padded.tolist()

    # ----- log-likelihoods -----

    @torch.no_grad()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """``[B, L, vocab]`` float32 logits of ``rows`` right-padded to the longest (causal: padding is never seen)."""
        width = max(map(len, rows))
        tokens = torch.full((len(rows), width), self.tok.pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        with self.forward_context():
            out = self.model(tokens.to(self.device))
        return (out.full_tensor() if isinstance(out, DTensor) else out).float()

    def _loglikelihood_tokens(
        self, requests: list[ScoredRequest], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(log-prob of the continuation, whether greedy decoding would produce it) per request. Requests whose model
        input is the same (the choices of a multiple-choice question that differ only in their last token) share one
        row; rows run longest first in batches of ``batch_size``."""
        inputs: dict[tuple[int, ...], list[int]] = {}  # model input (context + continuation, cut) -> its requests
        for i, (_, context, continuation) in enumerate(requests):
            inputs.setdefault(tuple((context + continuation)[-(self.max_length + 1) :][:-1]), []).append(i)
        rows = sorted(inputs, key=len, reverse=True)
        batches = [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for b in range(len(self._agreed([1] * len(batches)))):
            batch = batches[b] if b < len(batches) else []
            logits = self._logits([list(row) for row in batch] or [[self.eot_token_id]])  # (placeholder: none here)
            for k, row in enumerate(batch):
                for i in inputs[row]:
                    continuation = requests[i][2]
                    logprobs = logits[k, len(row) - len(continuation) : len(row)].log_softmax(-1)
                    target = torch.tensor(continuation, device=logprobs.device)
                    score = logprobs.gather(-1, target[:, None]).sum().item()
                    results[i] = (score, bool((logprobs.argmax(-1) == target).all()))
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over lm-eval's windows of ``max_length`` tokens, every token scored once."""
        windows: list[ScoredRequest] = []
        owners: list[int] = []
        for i, request in enumerate(requests):
            (text,) = request.args
            token_windows = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(make_disjoint_window, token_windows):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (score, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[i] += score
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ----- generation -----

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each context continued until one of its stop strings (or end-of-text), the stop string cut off. Requests
        with the same generation arguments are generated together, longest first."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        encoded = [self.tok_encode(request.args[0]) for request in requests]
        plan: list[tuple[list[int], _GenerationSettings]] = []
        for members in groups.values():
            settings = _GenerationSettings.of(requests[members[0]].args[1], self)
            members.sort(key=lambda i: -len(encoded[i]))
            plan += [(members[i : i + self.batch_size], settings) for i in range(0, len(members), self.batch_size)]
        results = [""] * len(requests)
        all_done = all_ranks_done(self.group, self.device) if self.group is not None else None
        for b, steps in enumerate(self._agreed([settings.max_gen_toks for _, settings in plan])):
            if b >= len(plan):  # a placeholder generation where this rank has none: it stops at once
                self._generate([[self.eot_token_id]], _GenerationSettings([], 0, None), steps, all_done)
                continue
            batch, settings = plan[b]
            room = self.max_length - steps  # (the context cut on the left to leave room for every rank's answers)
            prompts = [encoded[i][-room:] for i in batch]
            for i, text in zip(batch, self._generate(prompts, settings, steps, all_done)):
                results[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    def _generate(
        self,
        prompts: list[list[int]],
        settings: _GenerationSettings,
        steps: int,
        all_done: Callable[[bool], bool] | None,
    ) -> list[str]:
        """Up to ``steps`` new tokens per prompt (what every rank runs), each row ending at its own limit or stop."""
        stops = _StopStrings(self, settings.until, settings.max_gen_toks, len(prompts))
        generation = generate(
            self.model,
            prompts,
            dataclasses.replace(settings.sampling or SamplingParams(0, temperature=0.0), max_new_tokens=steps),
            self._stop_ids,
            self.tok.pad_id,
            device=self.device,
            all_done=all_done,
            also_stop=stops,
            generator=settings.generator(self.device),
        )
        texts = []
        for ids in generation.token_lists(keep_stop=True):
            ids = ids[: settings.max_gen_toks]
            if ids and ids[-1] in self._stop_ids:
                ids = ids[:-1]
            texts.append(postprocess_generated_text(self.tok_decode(ids), settings.until, None))
        return texts


class _GenerationSettings:
    """A task's generation arguments as titanium's sampler takes them."""

    def __init__(self, until: list[str], max_gen_toks: int, sampling: SamplingParams | None, seed: int = 0) -> None:
        self.until, self.max_gen_toks, self.sampling, self.seed = until, max_gen_toks, sampling, seed

    @classmethod
    def of(cls, kwargs: dict[str, Any], lm: TitaniumLM) -> _GenerationSettings:
        kwargs = dict(kwargs)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=lm.tok_decode([lm.eot_token_id]) or None)
        max_gen_toks = int(kwargs.pop("max_gen_toks", lm.max_gen_toks))
        if max_gen_toks >= lm.max_length:
            raise UserError(
                f"a task asks for {max_gen_toks} new tokens but the model holds {lm.max_length} positions in all"
            )
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        do_sample = bool(kwargs.pop("do_sample", False))
        top_p, top_k = float(kwargs.pop("top_p", 1.0) or 1.0), int(kwargs.pop("top_k", 0) or 0)
        seed = int(kwargs.pop("seed", 0) or 0)
        sampling = SamplingParams(max_gen_toks, temperature, top_p, top_k) if do_sample and temperature > 0 else None
        if kwargs:
            logger.warning("lm_eval: generation arguments %s are not used", sorted(kwargs))
        return cls(until, max_gen_toks, sampling, seed)

    def generator(self, device: torch.device) -> torch.Generator | None:
        return torch.Generator(device).manual_seed(self.seed) if self.sampling is not None else None


class _StopStrings:
    """``generate``'s ``also_stop``: a row ends once its text holds a stop string or it has its own number of
    tokens (the batch may run longer, for ranks whose tasks allow more)."""

    def __init__(self, lm: TitaniumLM, until: list[str], limit: int, rows: int) -> None:
        self.lm, self.until, self.limit = lm, [s for s in until if s], limit
        self.tokens: list[list[int]] = [[] for _ in range(rows)]

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        ended = []
        for row, t in zip(self.tokens, token.tolist()):
            row.append(t)
            text = self.lm.tok_decode(row) if self.until else ""
            ended.append(len(row) >= self.limit or any(s in text for s in self.until))
        return torch.tensor(ended, device=token.device)
