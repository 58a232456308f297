"""The sections of the objectives trained on samples ([sft], [kd]), each with the checks of its own settings
(``problems``), run when the job's objective reads the section."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

PadToOption = Literal["auto", "longest", "seq_len"]
"""How wide an objective's rows are (``[sft]``, ``[dpo]``, ``[rl]`` pad_to; titanium.data.packing.row_width)."""


@dataclass
class SFTSection:
    train_on_input: bool = False
    """Also put loss on system/user (prompt) tokens. Off by default: only assistant tokens are learned."""
    on_long_sample: Literal["truncate", "drop"] = "truncate"
    """A sample longer than training.seq_len is cut to fit (truncate) or left out (drop); either is
    counted in the log."""
    packing: bool = True
    """Pack several samples into each training.seq_len row, with attention masked so that no token
    sees another sample and positions restarting per sample. Off: one sample per row, padded."""
    pack_buffer: int = 64
    """Samples held while packing (best fit in a bounded buffer; data is streamed, never loaded whole)."""
    pad_to: PadToOption = "auto"
    """Without packing: how wide a microbatch's rows are. longest: its longest sample rounded up to a bucket (a
    few widths per doubling, so compile sees few shapes); short samples stop paying for seq_len, with the same
    loss. seq_len: every row seq_len wide (fixed shapes). auto: longest, but seq_len under pipeline parallelism
    (whose schedule needs fixed shapes; longest asked for there is overridden with a warning). Packed rows are
    always seq_len wide."""
    pad_multiple: int = 8
    """With pad_to longest: every row width is a multiple of this (8 suits tensor cores); under context or
    tensor parallelism it is raised to a multiple of 2 x cp and cp x tp as the sequence split needs."""
    max_prompt_length: int = 0
    """Prompt/completion rows: a prompt longer than this many tokens keeps only its last max_prompt_length tokens
    (cut from the left, BOS included, as TRL's max_prompt_length); counted as data/truncated_prompts. 0: no
    limit."""

    def problems(self, job: Any) -> Iterator[str]:
        """This section's ranges (``job``: the whole config, for what it needs of the rest of the job)."""
        if self.pack_buffer < 1:
            yield f"--sft.pack_buffer must be >= 1, got {self.pack_buffer}"
        if self.max_prompt_length < 0:
            yield f"--sft.max_prompt_length must be >= 0 (0: no limit), got {self.max_prompt_length}"
        yield from pad_multiple_problems("sft", self.pad_multiple)


@dataclass
class KDSection:
    teacher_path: str = ""
    """The teacher's weights: a Hugging Face folder (its config.json gives the shape) or a titanium checkpoint step
    folder (``.../checkpoint/step-N``; shape from teacher_model and teacher_flavor). Required."""
    teacher_model: str = ""
    """The teacher's model family (registry name); empty: the student's ([model] name)."""
    teacher_flavor: str = ""
    """The teacher's flavor, for a titanium checkpoint teacher (a Hugging Face teacher's config.json wins)."""
    alpha: float = 0.5
    """Weight of the divergence: loss = (1 - alpha) * CE + alpha * T^2 * D, in [0, 1]; 0 is SFT."""
    temperature: float = 1.0
    """Softens both distributions in D (softmax(logits / T)); > 0."""
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    """D: KL(teacher || student), KL(student || teacher), or the generalized Jensen-Shannon divergence with beta."""
    beta: float = 0.5
    """The generalized JSD's interpolation (divergence jsd only), in [0, 1]."""
    chunk_size: int = 1024
    """Tokens projected at once by both models (the [tokens, vocab] logits never exist whole)."""
    train_on_input: bool = False
    """As [sft] train_on_input: also learn (and distill) the prompt tokens."""
    packing: bool = True
    """As [sft] packing: several samples per row, attention kept inside each."""

    def problems(self, job: Any) -> Iterator[str]:
        """This section's ranges, and the teacher it needs."""
        if not 0 <= self.alpha <= 1:
            yield f"--kd.alpha must be in [0, 1] (0: SFT, 1: distillation alone), got {self.alpha}"
        if not self.temperature > 0:
            yield f"--kd.temperature must be > 0, got {self.temperature}"
        if not 0 <= self.beta <= 1:
            yield f"--kd.beta must be in [0, 1], got {self.beta}"
        if self.chunk_size < 1:
            yield f"--kd.chunk_size must be >= 1, got {self.chunk_size}"
        if not self.teacher_path:
            yield "--kd.teacher_path is required: the teacher's Hugging Face folder or titanium checkpoint step folder"


def pad_multiple_problems(section: str, pad_multiple: int) -> Iterator[str]:
    """``[section] pad_multiple``'s range (the sections whose rows are padded: [sft], [dpo], [rl])."""
    if pad_multiple < 1:
        yield f"--{section}.pad_multiple must be >= 1 (8 suits tensor cores), got {pad_multiple}"
