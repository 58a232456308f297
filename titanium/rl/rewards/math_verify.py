"""``--rl.rewards math_verify``: Hugging Face's Math-Verify as a reward for math answers, as TRL's ``accuracy_reward``
(and open-r1's) scores them (``pip install math-verify``).

The reference answer is parsed as Math-Verify parses a solution; the response's first LaTeX answer (a ``\\boxed{}``
first, only with an anchor: no bare numbers) is parsed with units normalized; the reward is 1.0 when they are
equivalent (sympy), else 0.0. A reference Math-Verify cannot parse scores 0.0 (TRL returns None and skips the
response for that function; its total treats it as 0). Math-Verify's time limits use ``signal.alarm``, which only
the main thread may set: elsewhere (a generation thread, with a policy lag) they are off, as in TRL.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from latex2sympy2_extended import NormalizationConfig
from math_verify import LatexExtractionConfig, parse, verify

from titanium.errors import UserError


def math_verify(completion: str, answer: str | None, row: Mapping[str, Any]) -> float:
    if answer is None:
        raise UserError("the math_verify reward needs reference answers: point --rl.answer_column at them")
    main = threading.current_thread() is threading.main_thread()
    if not main:
        logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
        logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
    gold = parse(answer, parsing_timeout=10 if main else None)
    if not gold:
        return 0.0
    extraction = LatexExtractionConfig(
        normalization_config=NormalizationConfig(units=True), boxed_match_priority=0, try_extract_without_anchor=False
    )
    parsed = parse(
        completion, extraction_config=[extraction], extraction_mode="first_match", parsing_timeout=10 if main else None
    )
    return float(verify(gold, parsed, timeout_seconds=5 if main else None))
