"""titanium's lm-eval LM against lm-eval's own Hugging Face model (``HFLM``) on the same tiny folder, float32, one
process: every request's log-likelihood (<= 1e-5) and greedy flag, rolling log-likelihoods over several windows,
greedy generations (equal strings) and the scores of whole tasks (equal), with and without the chat template."""

from __future__ import annotations

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.lm_eval

from lm_eval.api.instance import Instance  # noqa: E402

PAIRS = [
    ("What number comes after 940?", " 941"),
    ("Which is larger: 62 or 51?", " 62"),
    ("Which is larger: 62 or 51? ", "51"),  # (the context's trailing space moves to the continuation)
    ("", "Sort the digits: 6 0 4 8"),  # (an empty context: conditioned on BOS)
    ("Sort the digits: 6 0 4 8\n", "0 4 6 8\nWhat number comes after 12?\n13"),
    ("<|im_start|>user\nWhat number comes after 9?<|im_end|>\n<|im_start|>assistant\n", "10<|im_end|>"),
    ("What number comes after 940?" * 40, " 941"),  # (longer than the model: cut on the left)
]


def requests(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, args, i, ("probe", i, 1)) for i, args in enumerate(arguments)]


def test_loglikelihoods_equal_hflm(titanium_lm, hf_lm):
    ours = titanium_lm.loglikelihood(requests("loglikelihood", PAIRS))
    theirs = hf_lm.loglikelihood(requests("loglikelihood", PAIRS))
    for (a, greedy_a), (b, greedy_b), pair in zip(ours, theirs, PAIRS):
        assert a == pytest.approx(b, abs=1e-5), pair
        assert greedy_a == greedy_b, pair


def test_rolling_loglikelihoods_equal_hflm(titanium_lm, hf_lm):
    texts = [("What number comes after 940? 941\n" * n,) for n in (1, 40)]  # (40 lines: three 256-token windows)
    ours = titanium_lm.loglikelihood_rolling(requests("loglikelihood_rolling", texts))
    theirs = hf_lm.loglikelihood_rolling(requests("loglikelihood_rolling", texts))
    assert len(titanium_lm.tok_encode(texts[1][0])) > 2 * titanium_lm.max_length  # (a last window that slides back)
    for a, b in zip(ours, theirs):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-5)


def test_greedy_generations_equal_hflm(titanium_lm, hf_lm):
    arguments = [
        ("What number comes after 940?", {"until": ["\n"], "max_gen_toks": 12}),
        ("Sort the digits: 6 0 4 8", {"until": ["\n"], "max_gen_toks": 12}),
        ("Which is larger: 62 or 51?", {"until": ["1", "\n"], "max_gen_toks": 20}),
        ("Which", {"max_gen_toks": 30}),
        ("<|im_start|>user\nWhich is larger: 2 or 5?<|im_end|>\n<|im_start|>assistant\n", {"max_gen_toks": 16}),
    ]
    ours = titanium_lm.generate_until(requests("generate_until", arguments))
    theirs = hf_lm.generate_until(requests("generate_until", arguments))
    assert ours == theirs
    assert any(len(text) > 5 for text in theirs)


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat_template_1shot"])
def test_task_scores_equal_hflm(titanium_lm, hf_lm, task_manager, chat):
    from titanium.evaluation.harness import TaskRun, run_tasks

    run = TaskRun(
        tasks=["arithmetic_mc", "arithmetic_gen"],
        limit=24,
        num_fewshot=1 if chat else 0,
        apply_chat_template=chat,
        log_samples=True,
        bootstrap_iters=0,
    )
    ours, theirs = run_tasks(titanium_lm, run, task_manager), run_tasks(hf_lm, run, task_manager)
    for task in run.tasks:
        assert ours["results"][task] == theirs["results"][task], task
        for a, b in zip(ours["samples"][task], theirs["samples"][task]):
            assert a["arguments"] == b["arguments"]  # (the same prompts: chat template and few-shot rendered alike)
            for answer_a, answer_b in zip(a["filtered_resps"], b["filtered_resps"]):
                if isinstance(answer_a, str):  # a generation
                    assert answer_a == answer_b
                else:  # (log-likelihood, greedy)
                    assert answer_a[0] == pytest.approx(answer_b[0], abs=1e-5) and answer_a[1] == answer_b[1]
