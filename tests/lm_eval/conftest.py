"""Fixtures of the lm-eval tests: the tiny Hugging Face folder, titanium's LM on it and lm-eval's own ``HFLM``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers import REPO
from tests.lm_eval.tiny_model import make_tiny_hf

TASKS = str(REPO / "assets/tasks/arithmetic/lm_eval")


def pytest_collection_modifyitems(config, items):
    """Skip the tests marked ``lm_eval`` where lm-evaluation-harness is not installed (CI installs it for them)."""
    if importlib.util.find_spec("lm_eval") is not None:
        return
    skip = pytest.mark.skip(reason="needs lm-evaluation-harness (pip install -e '.[eval]'; marked lm_eval)")
    for item in items:
        if item.get_closest_marker("lm_eval") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("tiny_hf"))


@pytest.fixture(scope="session")
def titanium_lm(tiny_hf):
    """titanium's LM on the folder, one process, float32, the tokenizer's own chat template."""
    from titanium.data.chat import build_chat_template
    from titanium.data.tokenizer import HFTokenizer
    from titanium.evaluation.lm import TitaniumLM
    from titanium.model_builder import ModelBuilder
    from titanium.models import get_model_spec

    model = ModelBuilder(torch.device("cpu")).load_hf(get_model_spec("llama3"), tiny_hf).model.eval()
    tokenizer = HFTokenizer(str(tiny_hf / "tokenizer.json"))
    template = build_chat_template("tokenizer", tokenizer, "llama3")
    return TitaniumLM(model, tokenizer, max_length=model.args.max_seq_len, batch_size=4, template=template)


@pytest.fixture(scope="session")
def hf_lm(tiny_hf):
    """lm-eval's ``hf`` model on the same folder."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(tiny_hf), device="cpu", batch_size=4, dtype="float32")


@pytest.fixture(scope="session")
def task_manager():
    from titanium.evaluation.harness import task_manager

    return task_manager(["arithmetic_mc", "arithmetic_gen"], TASKS)
