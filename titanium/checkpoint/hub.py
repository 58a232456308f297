"""Hugging Face hub helpers: fetch a model folder to train from, publish an export.

Thin wrappers over ``huggingface_hub`` (needs network and, for private repos or uploads, a token
from ``huggingface-cli login`` or ``HF_TOKEN``). Training itself never touches the network: download
first, then point ``[checkpoint] initial_load_path`` at the folder.
"""

from __future__ import annotations

from pathlib import Path

# What a titanium run needs from a model repository: safetensors weights, configs, tokenizer files.
# Pickled weights (*.bin, *.pth) and Meta's original/ folder are skipped: titanium never loads them.
DEFAULT_PATTERNS = ("*.safetensors", "*.json", "*.txt", "*.model", "*.jinja", "*.md", "LICENSE*")


def download(
    repo_id: str,
    local_dir: str | Path,
    *,
    revision: str | None = None,
    allow_patterns: tuple[str, ...] = DEFAULT_PATTERNS,
) -> Path:
    """Download ``repo_id`` (e.g. ``Qwen/Qwen3-0.6B``) into ``local_dir`` and return the folder."""
    from huggingface_hub import snapshot_download

    path = snapshot_download(repo_id, revision=revision, local_dir=str(local_dir), allow_patterns=list(allow_patterns))
    return Path(path)


def upload(folder: str | Path, repo_id: str, *, private: bool = True, message: str = "Upload titanium export") -> str:
    """Create ``repo_id`` if needed (private by default) and upload an exported HF folder; returns its URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message=message)
    return f"https://huggingface.co/{repo_id}"
