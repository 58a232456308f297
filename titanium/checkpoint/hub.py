"""Hugging Face hub helpers: fetch a model folder to train from, publish an export.

Thin wrappers over ``huggingface_hub`` (needs network and, for private repos or uploads, a token
from ``hf auth login`` or ``HF_TOKEN``). Training itself never touches the network: download first, then point
``[checkpoint] initial_load_path`` at the folder. Its end may: ``[checkpoint] push_to_hub`` uploads the export, as
does the conversion tool's ``--push-to-hub``, both checked (``check_push``) before any work starts.
"""

from __future__ import annotations

import importlib
import importlib.util
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


def network_errors() -> tuple[type[BaseException], ...]:
    """What ``huggingface_hub`` raises when the hub cannot be reached or refuses a request: its HTTP error, OS-level
    connection errors, and its HTTP client's transport errors (httpx2 from huggingface_hub 2.x, httpx in 1.x,
    requests before), none of which is an ``OSError``."""
    from huggingface_hub.utils import HfHubHTTPError

    errors: list[type[BaseException]] = [HfHubHTTPError, OSError]
    for module, name in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")):
        if importlib.util.find_spec(module) is not None:
            errors.append(getattr(importlib.import_module(module), name))
    return tuple(errors)


def upload(folder: str | Path, repo_id: str, *, private: bool = True, message: str = "Upload titanium export") -> str:
    """Create ``repo_id`` if needed (private by default) and upload an exported folder with ``upload_folder``;
    returns the repository's URL. A failed upload (no network, no permission) raises ``UserError`` saying where the
    complete folder is and the command that uploads it later."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message=message)
    except network_errors() as e:
        raise UserError(
            f"uploading to the hub repository {repo_id} failed ({type(e).__name__}: {e}); nothing is lost: the "
            f"export is complete in {Path(folder).resolve()}; upload it later with `hf upload {repo_id} {folder}`"
        ) from None
    logger.info("uploaded %s to %s", folder, repo)
    return str(repo)
