"""Each DPO loss owns its parameters ([dpo.<loss_type>], titanium/config/dpo_losses.py): TRL's flat [dpo] keys and
flags still load into them with a warning naming the new place, and a loss's parameters set for a job whose loss does
not read them are refused, naming the loss."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import tomli_w
import torch

from titanium.config import ConfigError, load_config, to_toml_dict
from titanium.config.components import DPO_LOSSES
from titanium.config.dpo_losses import LOSS_KNOBS
from titanium.objectives.losses.dpo import as_pair_loss, dpo_loss, pair_loss

REPO = Path(__file__).resolve().parents[2]
DPO_JOB = ["--training.objective", "dpo", "--data.kind", "preference"]


def load(tmp_path: Path, toml: str, *flags: str):
    path = tmp_path / "job.toml"
    path.write_text(toml)
    return load_config(["--job.config_file", str(path), *DPO_JOB, *flags])


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_each_loss_names_its_own_parameters():
    """A registered loss's parameters sit under its own name, and exactly the losses with parameters have a section."""
    owners = {name: as_pair_loss(DPO_LOSSES.load(name)).knobs for name in DPO_LOSSES.names()}
    assert {knobs for knobs in owners.values() if knobs} == set(LOSS_KNOBS)
    assert all(knobs in ("", name) for name, knobs in owners.items())


@pytest.mark.parametrize(
    ("loss", "old", "new", "flags"),
    [
        (
            "simpo",
            "simpo_gamma = 1.5\ncpo_alpha = 0.3\nlabel_smoothing = 0.1\n",
            "[dpo.simpo]\ngamma = 1.5\ncpo_alpha = 0.3\nlabel_smoothing = 0.1\n",
            ["--dpo.simpo_gamma", "1.5", "--dpo.cpo-alpha=0.3", "--dpo.label_smoothing", "0.1"],
        ),
        (
            "robust",
            "label_smoothing = 0.2\n",
            "[dpo.robust]\nlabel_smoothing = 0.2\n",
            ["--dpo.label_smoothing", "0.2"],
        ),
        ("sigmoid", "label_smoothing = 0.2\n", "[dpo.sigmoid]\nlabel_smoothing = 0.2\n", ["--dpo.label_smoothing=0.2"]),
    ],
)
def test_flat_knobs_load_as_the_losss_own_with_a_warning(tmp_path, caplog, loss, old, new, flags):
    """The same loss parameters, and the same losses, from TRL's flat keys (TOML and flags) and from the section."""
    head = f'[dpo]\nloss_type = "{loss}"\nbeta = 2.0\n'
    new_style = load(tmp_path, head + new).dpo
    assert not caplog.text
    old_toml, old_flags = load(tmp_path, head + old).dpo, load(tmp_path, head, *flags).dpo
    assert old_toml == new_style == old_flags
    assert getattr(new_style, loss) != LOSS_KNOBS[loss]()  # (the knobs did arrive)
    flat = old.split(" = ")[0]
    key = "gamma" if flat == "simpo_gamma" else flat
    assert f"[dpo] {flat} is deprecated and will be removed: use [dpo.{loss}] {key}" in caplog.text
    assert f"--dpo.{flags[0].split('=')[0][6:]} is deprecated and will be removed: use --dpo.{loss}." in caplog.text

    loss_fn = pair_loss(new_style)
    assert loss_fn.parameters(old_toml) == loss_fn.parameters(new_style) == getattr(new_style, loss)
    pc, pr, rc, rr = torch.randn(4, 5) * 3 - 20
    lengths = torch.tensor([3.0, 1.0, 4.0, 2.0, 5.0])
    out = [dpo_loss(pc, pr, rc, rr, cfg, lengths, lengths).losses for cfg in (old_toml, new_style, old_flags)]
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)
    torch.testing.assert_close(out[2], out[1], rtol=0, atol=0)


def test_the_saved_config_loads_back(tmp_path):
    """config.toml holds [dpo.simpo] as a table, which loads as it was saved."""
    cfg = load(tmp_path, '[dpo]\nloss_type = "simpo"\n[dpo.simpo]\ngamma = 1.5\n')
    saved = tmp_path / "config.toml"
    saved.write_bytes(tomli_w.dumps(to_toml_dict(cfg)).encode())
    assert "[dpo.simpo]" in saved.read_text()
    assert load_config(["--job.config_file", str(saved)]).dpo == cfg.dpo


def test_knobs_of_another_loss_are_refused_naming_the_loss(tmp_path, caplog):
    """A loss's parameters given to a job of another loss: refused, naming both (old style at its default: dropped)."""
    with pytest.raises(ConfigError, match="--dpo.loss_type ipo reads no label_smoothing; the losses that do"):
        load(tmp_path, '[dpo]\nloss_type = "ipo"\nlabel_smoothing = 0.1\n')
    with pytest.raises(ConfigError, match="--dpo.loss_type hinge reads no label_smoothing"):
        load(tmp_path, "", "--dpo.loss_type", "hinge", "--dpo.label_smoothing", "0.1")
    only_simpo = "--dpo.simpo.gamma is read by --dpo.loss_type simpo only, and this job's loss is sigmoid"
    with pytest.raises(ConfigError, match=only_simpo):
        load(tmp_path, "[dpo.simpo]\ngamma = 2.0\n")
    with pytest.raises(ConfigError, match=only_simpo):
        load(tmp_path, "[dpo]\nsimpo_gamma = 2.0\n")  # (old style: moved to simpo's, then refused there)
    with pytest.raises(ConfigError, match="--dpo.sigmoid.label_smoothing is read by --dpo.loss_type sigmoid only"):
        load(tmp_path, "", "--dpo.loss_type", "orpo", "--dpo.sigmoid.label_smoothing", "0.1")
    cfg = load(tmp_path, '[dpo]\nloss_type = "ipo"\nlabel_smoothing = 0.0\nsimpo_gamma = 0.5\n')  # (defaults: fine)
    assert dataclasses.asdict(cfg.dpo.sigmoid) == {"label_smoothing": 0.0}
    assert "--dpo.loss_type ipo reads none (dropped)" in caplog.text
    with pytest.raises(ConfigError, match=r"\[dpo\] label_smoothing and \[dpo.sigmoid\] label_smoothing are the same"):
        load(tmp_path, "[dpo]\nlabel_smoothing = 0.1\n[dpo.sigmoid]\nlabel_smoothing = 0.1\n")


def test_a_loss_flag_moves_the_files_flat_knob_to_that_loss(tmp_path):
    """label_smoothing goes to the loss the job trains with: the command line's, over the file's."""
    cfg = load(tmp_path, '[dpo]\nloss_type = "sigmoid"\nlabel_smoothing = 0.2\n', "--dpo.loss_type", "robust")
    assert (cfg.dpo.robust.label_smoothing, cfg.dpo.sigmoid.label_smoothing) == (0.2, 0.0)
