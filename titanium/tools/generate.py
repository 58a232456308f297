"""Generate from a Hugging Face checkpoint folder with titanium's sampler (one process).

    python -m titanium.tools.generate /data/Qwen3-0.6B --prompt "What is 17 * 3?" --max-new-tokens 64
    python -m titanium.tools.generate outputs/debug_sft/hf --prompts-file questions.jsonl \\
        --tokenizer assets/tokenizer/titanium_debug.tiktoken --temperature 0.7 --top-p 0.9 --seed 1

Prompts come from --prompt (repeatable) or --prompts-file: a .txt file (one prompt per line) or a
.jsonl file in TRL's formats: a "prompt" column holding a string or a conversation (a list of
{role, content} messages ending with a user or tool message, rendered with the chat template's
generation prompt as TRL's apply_chat_template does, with the row's "tools" if it has them; the
completion/chosen/rejected columns of prompt/completion and preference rows are not read), else chat
"messages" (a final assistant message is dropped). With a chat template a string prompt is a user
message; --chat-template none sends plain text after BOS (base models; TRL's reading of strings).
Each prompt's result is one JSON line on stdout (prompt, completion, finish_reason "stop" or
"length", tokens); the speed goes to stderr. Bad input exits with code 2.

    # a conversation: each line typed (or piped) is a user turn, answered with the conversation so far
    python -m titanium.tools.generate outputs/debug_sft/hf --chat --tokenizer assets/tokenizer/titanium_debug.tiktoken

--chat holds one multi-turn conversation: the user's turns come from --prompt (repeatable, in order) or
else from stdin, one line each, until EOF (Ctrl-D); every reply is printed as plain text and becomes the
assistant turn the next one sees (rendered by the chat template; the tokenizer's own with auto).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from titanium.config.sections import DataSection, ModelSection, TokenizerSection
from titanium.data.chat import (
    ChatTemplate,
    Message,
    RowError,
    Tools,
    build_chat_template,
    parse_tools,
    with_system_prompt,
)
from titanium.data.prompts import prompt_messages, trl_prompt
from titanium.data.tokenizer import Tokenizer, build_tokenizer
from titanium.errors import UserError
from titanium.generation.generate import check_room, generate
from titanium.generation.sampling import SamplingParams
from titanium.model_builder import ModelBuilder, resolve_spec
from titanium.models import list_models
from titanium.tools import requested_device


@dataclass(frozen=True)
class Conversation:
    """A prompt of messages (ending with the turn to answer) and the tool schemas its template may render."""

    messages: list[Message]
    tools: Tools | None = None


Prompt = str | Conversation


def row_prompt(row: Any) -> Prompt:
    """A .jsonl row's prompt, as GRPO reads it (``titanium.data.prompts.prompt_messages``: TRL's "prompt" column,
    a string or a conversation ending with the turn to answer, else the "messages" of a chat row without its final
    answer), a string kept as text (plain text after BOS under --chat-template none)."""
    data = DataSection(kind="chat")
    prompt = trl_prompt(row, data)
    if isinstance(prompt, str):
        return prompt
    return Conversation(prompt_messages(row, data), parse_tools(row, data))


def read_prompts(path: Path) -> list[Prompt]:
    """Lines of a .txt file, or the prompt of each row of a .jsonl file (``row_prompt``)."""
    if not path.is_file():
        raise UserError(f"--prompts-file {path}: not found")
    lines = path.read_text().splitlines()
    if path.suffix != ".jsonl":
        return [line for line in lines if line.strip()]
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompts.append(row_prompt(json.loads(line)))
        except (json.JSONDecodeError, RowError) as e:
            raise UserError(
                f"--prompts-file {path} line {number}: {e} (need a 'prompt': a string or a list of messages, "
                "or chat 'messages')"
            ) from e
    return prompts


def encode(prompt: Prompt, tokenizer: Tokenizer, template: ChatTemplate | None, system_prompt: str | None) -> list[int]:
    """A prompt's ids: a string is a user message under the chat template (plain text after BOS without one), a
    conversation its rendering with the generation prompt."""
    if template is None:
        text = prompt if isinstance(prompt, str) else "\n".join(m.content for m in prompt.messages)
        return tokenizer.encode(text, bos=True, eos=False)
    conversation = Conversation([Message("user", prompt)]) if isinstance(prompt, str) else prompt
    return template.prompt(with_system_prompt(conversation.messages, system_prompt), conversation.tools)


def _tokenizer(args: argparse.Namespace) -> Tokenizer:
    path = args.tokenizer or args.folder / "tokenizer.json"
    if not Path(path).is_file():
        raise UserError(f"tokenizer not found: {path} (pass --tokenizer: a tokenizer.json or .tiktoken file)")
    return build_tokenizer(TokenizerSection(kind="hf" if str(path).endswith(".json") else "tiktoken", path=str(path)))


@dataclass
class Generator:
    """The loaded model, tokenizer and chat template, and the sampling the command line asked for."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    template: ChatTemplate | None
    params: SamplingParams
    device: torch.device
    rng: torch.Generator
    compile: bool

    def complete(self, encoded: list[list[int]]) -> list[tuple[str, str, int]]:
        """(completion, finish reason, tokens) of each prompt, generated together."""
        stop_ids = self.template.stop_ids if self.template is not None else {self.tokenizer.eos_id}
        out = generate(
            self.model,
            encoded,
            self.params,
            stop_ids,
            self.tokenizer.pad_id,
            generator=self.rng,
            device=self.device,
            compile=self.compile,
        )
        return [
            (self.tokenizer.decode(ids), "stop" if out.finished[i] else "length", int(out.lengths[i]))
            for i, ids in enumerate(out.token_lists())
        ]


def load(args: argparse.Namespace) -> Generator:
    """The model of ``args.folder`` with its tokenizer and template, after checking the sampling options."""
    try:
        params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.top_k)
    except ValueError:
        raise UserError("--max-new-tokens must be >= 0, --temperature >= 0, --top-p in (0, 1], --top-k >= 0") from None
    device = requested_device(args.device)
    spec, _ = resolve_spec(ModelSection(name=args.model or "auto"), args.folder)  # (the family, or the backend)
    tokenizer = _tokenizer(args)
    fmt = spec.chat_template or ""
    template = None if args.chat_template == "none" else build_chat_template(args.chat_template, tokenizer, fmt)
    model = ModelBuilder(device).load_hf(spec, args.folder, option="FOLDER", family_option="--model").model
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model = model.to(getattr(torch, dtype)).eval()
    rng = torch.Generator(device).manual_seed(args.seed)
    return Generator(model, tokenizer, template, params, device, rng, args.compile)


def _check_room(gen: Generator, length: int, fix: str) -> None:
    try:
        check_room(gen.model, length, gen.params.max_new_tokens)
    except ValueError as e:
        raise UserError(f"{e}: lower --max-new-tokens or {fix}") from None


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Generate for every prompt; one result dict per prompt."""
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    prompts: list[Prompt] = list(args.prompt or [])
    if args.prompts_file is not None:
        prompts += read_prompts(args.prompts_file)
    if not prompts:
        raise UserError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    gen = load(args)
    encoded = []
    for number, prompt in enumerate(prompts, 1):
        try:
            encoded.append(encode(prompt, gen.tokenizer, gen.template, args.system_prompt))
        except RowError as e:  # (tools under a template that cannot render them, a template's raise_exception)
            raise UserError(f"prompt {number} (--prompt ones first, then the file's): {e}") from None
    _check_room(gen, max(map(len, encoded)), "shorten the prompts")

    results, generated, start = [], 0, time.perf_counter()
    for first in range(0, len(encoded), args.batch_size):
        for i, (completion, reason, tokens) in enumerate(gen.complete(encoded[first : first + args.batch_size])):
            prompt = prompts[first + i]
            results.append(
                {
                    "prompt": prompt if isinstance(prompt, str) else [m.as_dict() for m in prompt.messages],
                    "completion": completion,
                    "finish_reason": reason,
                    "tokens": tokens,
                }
            )
            generated += tokens
    seconds = time.perf_counter() - start
    speed = f"{generated / seconds:,.0f} tokens/s"
    print(f"{generated} tokens in {seconds:.2f}s ({speed}) on {gen.device}", file=sys.stderr)
    return results


def chat(args: argparse.Namespace, turns: Iterable[str], out: TextIO) -> list[Message]:
    """One conversation (``--chat``): each user turn is answered with the whole conversation so far rendered by the
    chat template; each reply is written to ``out`` as plain text. Returns the conversation."""
    if args.prompts_file is not None:
        raise UserError("--chat reads the user's turns from --prompt (repeatable) or stdin, not --prompts-file")
    if args.chat_template == "none":
        raise UserError("--chat needs a chat template; drop --chat-template none")
    gen = load(args)
    assert gen.template is not None
    interactive = turns is sys.stdin and sys.stdin.isatty()
    if interactive:
        print("chat: type a message and press Enter; Ctrl-D ends the conversation\n> ", end="", file=sys.stderr)
    messages: list[Message] = []
    for turn in turns:
        if not turn.strip():
            continue
        messages.append(Message("user", turn.rstrip("\n")))
        encoded = gen.template.prompt(with_system_prompt(messages, args.system_prompt))
        _check_room(gen, len(encoded), "start a new conversation")
        (reply, _, _), *_ = gen.complete([encoded])
        messages.append(Message("assistant", reply))
        print(reply, file=out, flush=True)
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
    return messages


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m titanium.tools.generate",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("folder", type=Path, help="Hugging Face folder: config.json + *.safetensors")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument(
        "--prompts-file", type=Path, help=".txt (one prompt per line) or .jsonl (TRL's prompt: text or messages)"
    )
    p.add_argument(
        "--model",
        choices=list_models(),
        help="model family, or transformers (default: the family that reads config.json's model_type, else "
        "the transformers backend)",
    )
    p.add_argument("--tokenizer", type=Path, help="tokenizer.json or .tiktoken file (default: FOLDER/tokenizer.json)")
    p.add_argument(
        "--chat-template",
        default="auto",
        choices=["auto", "llama3", "chatml", "tokenizer", "none"],
        help="as --chat.chat_template; none: plain text prompts (default: auto)",
    )
    p.add_argument("--system-prompt", help="system message for chat prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    p.add_argument("--batch-size", type=int, default=16, help="prompts generated together")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--compile", action="store_true", help="compile the decode step (GPU)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="one conversation: each --prompt, else each line of stdin until EOF, is a user turn answered with the "
        "conversation so far; replies print as plain text (default: off, independent prompts as JSON lines)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process on purpose
    try:
        if args.chat:
            chat(args, args.prompt or sys.stdin, sys.stdout)
            return 0
        results = run(args)
    except UserError as e:
        print(f"titanium.tools.generate: error: {e}", file=sys.stderr)
        return 2
    for result in results:
        print(json.dumps(result, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
