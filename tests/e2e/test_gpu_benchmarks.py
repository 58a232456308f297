"""The GPU suite and its benchmarks, checked on a CPU: the suite's commands name scripts and flags that exist and fit
its time budget; each GPU benchmark runs end to end in its ``--device cpu --smoke`` form and writes its table beside
the papers' numbers; the helpers they share give what they promise."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, env, load_script
from titanium.config.loader import tomllib

SUITE = REPO / "benchmarks/gpu_suite.sh"


Step = tuple[str, str, int, list[str]]
"""(part, step, budget in seconds, command as argv)."""
WORKS = ("pretrain", "sft", "grpo", "dpo")
"""benchmarks/peers.py's works, each run by one step of the peers part."""
LEASE_SECONDS = 480
"""What one part may take: 8 minutes of a 15-minute device lease, install included."""


def suite_steps() -> list[Step]:
    result = subprocess.run(["bash", str(SUITE), "--list"], capture_output=True, text=True, check=True)
    rows = [line.split("\t") for line in result.stdout.strip().splitlines()]
    return [(part, name, int(budget), shlex.split(cmd)) for part, name, budget, cmd in rows]


def test_gpu_suite_parts_fit_a_lease_and_their_commands_exist():
    """``gpu_suite.sh --list``: parts 1..N, "peers", "peers_post" and "backend", listed in the order to run them (the
    parts no GPU has run yet first, then the peers, then the rest), each starting with the install and within 480 s of
    budgets; part 1 has the CUDA tests and the headline; each benchmark's script has every flag the suite gives it
    and writes ``$R/<step>_$TAG.md`` (its results folder and the device's name), once in the suite (the peers'
    steps add their works to one ``$R/peers_$TAG.md``); a part returns at most 8 files (its results, its summary
    and one tar of logs)."""
    subprocess.run(["bash", "-n", str(SUITE)], check=True)
    steps = suite_steps()
    parts = list(dict.fromkeys(part for part, *_ in steps))
    numbered = sorted(int(p) for p in parts if p.isdigit())
    assert numbered == list(range(1, len(numbered) + 1))
    assert parts[:6] == ["7", "2", "4", "peers", "peers_post", "backend"], parts
    for part in parts:
        names = [name for p, name, _, _ in steps if p == part]
        assert names[0] == "install" and names.count("install") == 1, names
        assert sum(budget for p, _, budget, _ in steps if p == part) <= LEASE_SECONDS, part
        assert len(names) - 1 + 2 <= 8, names  # (install writes no results file)
    assert [name for p, name, _, _ in steps if p == "1"][1:3] == ["cuda_tests", "pretrain_8b"]
    names = {name for _, name, _, _ in steps}
    assert {"sft_ladder", "float8_linear", "pretrain_1b", "generation", "chunked_ce", "dpo_memory"} <= names
    assert {"moe_layer", "pretrain_moe", "grpo", "side_stream_tests", "grpo_lag1", "backend_8b"} <= names
    outs, works = [], []
    for part, name, _, argv in steps:
        if name == "install":
            continue
        if name in ("cuda_tests", "side_stream_tests"):
            assert argv[1:5] == ["-m", "pytest", "-m", "cuda"] and (REPO / argv[-1]).exists(), argv
            continue
        script = REPO / argv[1]
        source = script.read_text()
        for flag in (a for a in argv[2:] if a.startswith("--")):
            assert f'"{flag}"' in source, f"{script.name} has no {flag}"
        out = argv[argv.index("--out") + 1]
        if part.startswith("peers"):
            assert out == "$R/peers_$TAG.md" and script.name == "peers.py", argv
            works += argv[argv.index("--work") + 1 : argv.index("--work") + 1 + sum(1 for a in argv if a in WORKS)]
        else:
            outs.append(out)
            assert out == f"$R/{name}_$TAG.md", out
    assert len(outs) == len(set(outs))
    assert sorted(works) == sorted(WORKS), works  # (each work once)


def test_gpu_suite_installs_only_the_carried_wheels():
    """Every part's install step is pip without an index or dependencies, given nothing but the wheels of the
    folder that scripts/gpu_wheels.sh fills (and git ignores, so it travels only when carried): it cannot fetch or
    pull in anything else. The wheels pinned there are the project's dependencies (or theirs), and the peers of
    benchmarks/peers.py with what they import (each listed once, one version)."""
    wheels_script = (REPO / "scripts/gpu_wheels.sh").read_text()
    folder = re.search(r"-d (\S+) ", wheels_script).group(1)
    assert f"{folder}/" in (REPO / ".gitignore").read_text().splitlines()
    installs = [argv for _, name, _, argv in suite_steps() if name == "install"]
    assert installs
    for argv in installs:
        assert argv[1:4] == ["-m", "pip", "install"] and {"--no-index", "--no-deps"} <= set(argv), argv
        options_with_a_value = {"--target"}
        given = [
            a for i, a in enumerate(argv[4:], 4) if not a.startswith("-") and argv[i - 1] not in options_with_a_value
        ]
        assert given == [f"{folder}/*.whl"], argv

    from importlib.metadata import requires

    pinned = re.findall(r"([\w.-]+)==", re.search(r"WHEELS=\((.*?)\)", wheels_script).group(1))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {_name(r) for r in project}
    wanted |= {_name(r) for dep in wanted & {_name(p) for p in pinned} for r in requires(dep) or [] if ";" not in r}
    assert {_name(p) for p in pinned} <= wanted, pinned
    peers = [_name(p) for p in re.findall(r"([\w.-]+)==", re.search(r"PEERS=\((.*?)\)", wheels_script, re.S).group(1))]
    assert {"torchtitan", "torchtune", "trl", "datasets"} <= set(peers) and len(set(peers + pinned)) == len(
        peers
    ) + len(pinned)


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized (``Docstring_Parser>=0.1`` -> ``docstring-parser``)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


def smoke(script: str, tmp_path: Path, *extra: str) -> str:
    out = tmp_path / f"{Path(script).stem}.md"
    cmd = [sys.executable, script, "--device", "cpu", "--smoke", "--out", str(out), *extra]
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out.read_text()


def table_rows(text: str) -> dict[str, list[str]]:
    """First cell -> the other cells, for every data row of the markdown tables in ``text``."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and not set(cells[0]) <= set("-:") and cells[0] not in ("variant", "row", "M"):
            rows[cells[0]] = cells[1:]
    return rows


def test_gpu_benchmarks_run_on_cpu_and_write_their_tables(tmp_path):
    """Each variant trained (a number, not 'failed' or 'timed out') and the papers' rows are quoted beside it."""
    pretrain = smoke("benchmarks/pretrain_speed.py", tmp_path)
    rows = table_rows(pretrain)
    assert set(rows) == {"eager", "compile + float8 tensorwise"}
    for cells in rows.values():
        assert float(cells[0].replace(",", "")) > 0  # tokens/s
    assert "6,258 tok/s, 81.9" in rows["eager"] and "9,409 tok/s, 76.8" in rows["compile + float8 tensorwise"]
    assert "7,689.5 tok/s, 47.77" in rows["compile + float8 tensorwise"]
    backend = table_rows(smoke("benchmarks/pretrain_speed.py", tmp_path, "--variants", "eager", "backend"))
    assert set(backend) == {"eager", "transformers backend"}  # (part "backend": the same model built by transformers)
    assert float(backend["transformers backend"][0].replace(",", "")) > 0

    ladder = table_rows(smoke("benchmarks/sft_ladder.py", tmp_path))
    assert set(ladder) == {"baseline", "+ LCE"}
    for name, paper in (("baseline", "8.6 GB, 5,213 tok/s (Table 2)"), ("+ LCE", "8.41 GB, 5,454 tok/s (Table 2)")):
        tps, padding, useful = (float(c.rstrip("%").replace(",", "")) for c in ladder[name][:3])
        assert tps > 0 and useful == pytest.approx(tps * (1 - padding / 100), rel=0.01, abs=1)
        assert paper in ladder[name]

    linear = table_rows(smoke("benchmarks/float8_linear.py", tmp_path))
    assert list(linear) == ["64"]
    bf16_ms, tensorwise_ms, tensorwise_speedup = (float(c) for c in linear["64"][2:5])
    assert tensorwise_speedup == pytest.approx(bf16_ms / tensorwise_ms, rel=0.05)  # (of the rounded times)


def test_grpo_benchmark_runs_on_cpu(tmp_path):
    """Part 6's script in its smoke form (Qwen3's debug flavor): generation in the loop and on the generation thread
    both train and give every column a number (sync may round to 0 s)."""
    rows = table_rows(smoke("benchmarks/grpo_gpu.py", tmp_path))
    assert set(rows) == {"lag0", "lag1"}, rows
    for cells in rows.values():
        generate, tps, waited, old, reference, sync, train, step, memory = (float(c.replace(",", "")) for c in cells)
        assert min(generate, tps, old, reference, train, step, memory) > 0 and min(waited, sync) >= 0, cells


def test_dpo_memory_benchmark_runs_on_cpu(tmp_path):
    """Part 4's DPO memory script in its smoke form: all four variants train and give a peak and a wall time, and
    the cached run finds the first precompute run's cache (it is not refused as missing)."""
    rows = table_rows(smoke("benchmarks/dpo_memory.py", tmp_path))
    assert len(rows) == 4 and list(rows)[0] == "online reference", rows
    for cells in rows.values():
        peak, vs_online, seconds = (float(c) for c in cells)
        assert peak > 0 and seconds > 0, cells
    assert float(rows["online reference"][1]) == 0


def test_dpo_memory_writes_its_table_after_each_variant(tmp_path, monkeypatch):
    """A run stopped in its last variant (by a suite's time limit) leaves the rows that finished in ``--out``; a
    first precompute run that gives no cache leaves the cached row saying so instead of computing the cache itself."""
    script = load_script("benchmarks/dpo_memory.py")
    out = tmp_path / "dpo.md"
    opts = script.parser().parse_args(["--device", "cpu", "--out", str(out)])
    calls = []

    def measure(job, folder, opts):
        calls.append(folder)
        if len(calls) == 3:
            raise KeyboardInterrupt  # (stopped in the LoRA variant: the cached one was not run)
        return {"peak": 1.0 + len(calls), "seconds": 5.0} if len(calls) == 1 else "failed (exit 1; its log is above)"

    monkeypatch.setattr(script, "measure", measure)
    with pytest.raises(KeyboardInterrupt):
        script.run(opts)
    rows = table_rows(out.read_text())
    assert list(rows) == [script.ONLINE, script.FIRST, script.CACHED], rows
    assert rows[script.ONLINE][:2] == ["2.00", "+0.00"] and rows[script.FIRST][0].startswith("failed")
    assert rows[script.CACHED][0] == "not run: the first precompute run left no cache"


def test_moe_benchmarks_run_on_cpu(tmp_path):
    """Part 5's two scripts on CPU shapes: the MoE model (``--models 30B-A3B``, smoke: its debug flavor) trains and
    logs tokens/s; the layer benchmark times all three grouped GEMMs, which agree with the loop."""
    rows = table_rows(smoke("benchmarks/pretrain_speed.py", tmp_path, "--models", "30B-A3B"))
    assert set(rows) == {"eager"} and float(rows["eager"][0].replace(",", "")) > 0

    layer = load_script("benchmarks/moe_layer.py")
    (row,) = layer.measure("128,32,32,8,2", torch.float32, torch.device("cpu"), repeats=1)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "128x32, F 32, E 8, top-2" and cells[1] == "float32"
    assert all(float(ms.replace(",", "")) > 0 for ms in cells[2:5]), cells  # (a failing kind writes "fails: ...")
    assert float(cells[5]) < 1e-5 and cells[7] == "padded_bmm"


def test_vocab_tokenizer_has_the_asked_size_and_encodes_text(tmp_path):
    common = load_script("benchmarks/bench_common.py")
    from titanium.data.tokenizer import TiktokenTokenizer

    tokenizer = TiktokenTokenizer(str(common.vocab_tokenizer(tmp_path, 70000)))
    assert tokenizer.vocab_size == 70000
    text = "What number comes after 771? 772 ✓"
    assert tokenizer.decode(tokenizer.encode(text, bos=False, eos=False)) == text


def test_full_depth_scale_and_the_papers_figure():
    """The cut 8B's FLOPs per token against the real 8B's (6N + 12 L H d S, counted by hand here), and the
    figure's 125 speedups as printed in the TorchAO paper."""
    speed = load_script("benchmarks/pretrain_speed.py")
    dim, ffn, vocab, heads, kv, seq = 4096, 14336, 128256, 32, 8, 8192
    block = 2 * dim * dim + 2 * dim * (dim // heads * kv) + 3 * dim * ffn + 2 * dim  # attention, FFN, 2 norms
    flops = {layers: 6 * (layers * block + dim + vocab * dim) + 12 * layers * dim * seq for layers in (8, 32)}
    model = speed.Model("8B cut", "8B", 2, layers=8)
    assert speed.flops_scale(model, seq) == pytest.approx(flops[8] / flops[32], rel=1e-6)
    # The table's full-depth tokens/s: fewer than measured, by that factor (the H200 tables had it multiplied).
    rows = table_rows("\n".join(speed.table(model, {"eager": {"tps": 30000.0, "mfu": 50.0, "memory": 70.0}}, seq)))
    assert float(rows["eager"][2].replace(",", "")) == pytest.approx(30000 * flops[8] / flops[32], abs=1)
    figure = load_script("benchmarks/float8_linear.py").paper_speedups()
    assert len(figure) == 125
    assert figure[(1024, 1024, 1024)] == 0.77 and figure[(4096, 8192, 1024)] == 1.03
    assert figure[(16384, 16384, 16384)] == 1.80


def test_every_benchmark_row_is_a_valid_job(tmp_path):
    """Each row's flags pass the config checks that run before training (a refused combination would cost a GPU
    run): every variant of pretrain_speed for its three models, every variant of the GRPO benchmark, every row of the
    SFT ladder (the rows differ by flags alone; their models by flavor, checked for the first and last rows)."""
    import argparse

    from titanium.config import load_config
    from titanium.preflight import check_job

    speed, ladder = load_script("benchmarks/pretrain_speed.py"), load_script("benchmarks/sft_ladder.py")
    tokenizer = REPO / "assets/tokenizer/titanium_debug.tiktoken"  # (the checks only look that it exists)
    for family, flavor in (("llama3", "8B"), ("llama3", "1B"), ("qwen3_moe", "30B-A3B")):
        for variant in speed.VARIANTS.values():
            flags = [*speed.BASE, "--model.name", family, "--model.flavor", flavor, "--tokenizer.path", str(tokenizer)]
            check_job(load_config([*flags, *variant]), 1)
    grpo = load_script("benchmarks/grpo_gpu.py")
    grpo.vocab_tokenizer = lambda folder, vocab: tokenizer
    grpo_opts = grpo.parser().parse_args([])
    for variant in grpo.VARIANTS.values():
        check_job(load_config([*grpo.flags(grpo_opts, tmp_path), *variant]), 1)
    opts = argparse.Namespace(smoke=False, data_kind="chat", data_path=ladder.DEFAULT_DATA, steps=4, log_freq=2)
    ladder.vocab_tokenizer = lambda folder, vocab: tokenizer
    rows = [*ladder.LADDER, *ladder.PACKED]
    for flavor in ladder.TORCHTUNE_TABLE2:
        for row in rows if flavor == "0.6B" else [rows[0], rows[-1]]:
            flags = [*ladder.base_flags(opts, tmp_path), "--model.name", "qwen3", "--model.flavor", flavor]
            check_job(load_config([*flags, *ladder.row_flags(row)]), 1)
