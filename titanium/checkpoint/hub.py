"""Hugging Face hub helpers: fetch a model folder to train from, publish an export.

Thin wrappers over ``huggingface_hub`` (needs network and, for private repos or uploads, a token
from ``hf auth login`` or ``HF_TOKEN``). Training itself never touches the network: download first, then point
``[checkpoint] initial_load_path`` at the folder. Its end may: ``[checkpoint] push_to_hub`` uploads the export, as
does the conversion tool's ``--push-to-hub``, both checked (``check_push``) before any work starts.
"""

from __future__ import annotations

import logging
from pathlib import Path

from titanium.errors import UserError

logger = logging.getLogger(__name__)

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


def check_push(repo_id: str, flag: str) -> None:
    """Refuse an upload that cannot work before any work is done: ``repo_id`` must be ``namespace/name`` and a
    token must be at hand (``HF_TOKEN``, or the one ``hf auth login`` stored). Raises ``UserError`` naming ``flag``."""
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        if repo_id.count("/") != 1:
            raise HFValidationError("expected namespace/name, e.g. my-user/my-model")
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UserError(f"{flag} {repo_id!r} is not a Hugging Face repository id: {e}") from None
    if not get_token():
        raise UserError(
            f"{flag} {repo_id}: no Hugging Face token; set HF_TOKEN to a token with write access (or run "
            "`hf auth login`)"
        )


def upload(folder: str | Path, repo_id: str, *, private: bool = True, message: str = "Upload titanium export") -> str:
    """Create ``repo_id`` if needed (private by default) and upload an exported folder with ``upload_folder``;
    returns the repository's URL. A failed upload raises ``UserError`` with the command that retries it (the folder
    itself is complete)."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError

    api = HfApi()
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message=message)
    except (HfHubHTTPError, OSError) as e:
        raise UserError(
            f"uploading {folder} to the hub repository {repo_id} failed: {e}; the folder is complete, retry with "
            f"`hf upload {repo_id} {folder}`"
        ) from None
    logger.info("uploaded %s to %s", folder, repo)
    return str(repo)
