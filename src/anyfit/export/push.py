"""The exported folder uploaded to the Hugging Face Hub: the repository id and the token checked before the
export starts (``check_push``), the upload after it is done (``push_folder``)."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import HFValidationError, validate_repo_id

from anyfit.export.errors import ExportError


def check_push(repo: str, api) -> None:
    """``repo`` is a valid repository id and a token is at hand (``api``'s, the environment's or the login's)."""
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise ExportError(f"--push {repo!r} is not a Hub repository id (owner/name): {e}") from None
    token = getattr(api, "token", None) if api is not None else None
    if not (token or get_token()):
        raise ExportError("--push needs a Hugging Face token with write access: set HF_TOKEN or run "
                          "`hf auth login`.")


def push_folder(folder: Path, repo: str, private: bool = False, api=None, echo=print) -> str:
    """Create ``repo`` (if it does not exist; ``private`` as asked) and upload ``folder`` in one commit.
    Returns the repository's URL."""
    api = api or HfApi()
    try:
        url = api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model",
                          commit_message=f"anyfit export of {folder.name}")
    except HfHubHTTPError as e:
        raise ExportError(f"pushing {folder} to {repo} failed: {str(e).splitlines()[0]} (the export itself is in "
                          f"{folder}; is the token allowed to write to {repo}?)") from None
    except Exception as e:  # no network, refused connection, README metadata the Hub rejects: one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise ExportError(f"pushing {folder} to {repo} failed: {type(e).__name__}: {first} (the export itself is in "
                          f"{folder}).") from None
    echo(f"[anyfit] export: pushed {folder} to {url}")
    return str(url)
