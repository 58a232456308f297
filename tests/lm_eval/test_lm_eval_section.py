"""``[lm_eval]``'s checks before any process group, and the metric names it logs (no lm-eval needed)."""

from __future__ import annotations

import pytest

from titanium.config import ConfigError, load_config
from titanium.config.lm_eval_section import LMEvalSection, check_lm_eval
from titanium.evaluation.harness import metric_scalars


def test_off_by_default_and_unchecked():
    assert load_config([]).lm_eval == LMEvalSection()
    assert list(check_lm_eval(LMEvalSection(tasks=[], limit=-5))) == []


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lm_eval.interval", "-1"], "--lm_eval.interval must be >= 0"),
        (["--lm_eval.interval", "10"], "--lm_eval.tasks is empty"),
        (["--lm_eval.interval", "10", "--lm_eval.tasks", "x", "--lm_eval.batch_size", "0"], "--lm_eval.batch_size"),
        (["--lm_eval.interval", "10", "--lm_eval.tasks", "x", "--lm_eval.num_fewshot", "-2"], "num_fewshot"),
    ],
)
def test_bad_values_are_config_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(flags)


def test_metric_names():
    results = {
        "results": {
            "arithmetic_mc": {"alias": "arithmetic_mc", "acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.25},
            "arithmetic_gen": {"exact_match,strip": 1.0, "exact_match_stderr,strip": "N/A"},
        },
        "groups": {"mmlu": {"acc,none": 0.3}},
    }
    assert metric_scalars(results) == {
        "lm_eval/arithmetic_mc/acc": 0.5,
        "lm_eval/arithmetic_mc/acc_norm": 0.25,
        "lm_eval/arithmetic_gen/exact_match/strip": 1.0,
        "lm_eval/mmlu/acc": 0.3,
    }
