"""Hugging Face Jobs through huggingface_hub's own client: the bundle uploaded to a private dataset repo (each blob
once: those the repo already holds are not sent again), mounted read-only into the job as a volume; the job
created with ``run_job`` (the provider's ``attempts`` restart it after a failure: it resumes from the store),
followed with ``inspect_job`` / ``fetch_job_logs``, stopped with ``cancel_job``.

A refusal of the Hub (no token, no credit, a flavor the account cannot use) is turned into one line with the fix
(``hub_fault``)."""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from anyfit.config import ConfigError
from anyfit.launch.bundle import Bundle

IMAGE = "ghcr.io/astral-sh/uv:python3.11-bookworm"  # uv and Python 3.11 (the pins' Python); torch brings CUDA
MOUNT = "/anyfit"
WORK = "/tmp/anyfit-work"  # the job's writable disk (the flavor's ephemeral storage)
LAUNCHES = "anyfit-launches"  # the private dataset repo of a namespace's launches: bundles and records
RECORD = "record.json"


def hub_fault(e: Exception, what: str, flavor: str | None = None) -> ConfigError:
    """One line, with the fix, for an HTTP refusal of the Hub while ``what``."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    fixes = {401: "the Hub rejected the token: run `hf auth login` (or set HF_TOKEN) with a token that can write",
             402: "no credit for Jobs on this account: add credit at https://huggingface.co/settings/billing",
             403: (f"this account cannot use flavor {flavor} (or write to that namespace): pick another --gpu, or "
                   "ask the organization's admin"),
             404: "not found on the Hub: check the namespace (--namespace) and that Jobs are enabled for it",
             429: "the Hub's rate limit or the account's Jobs quota is reached: wait, or cancel running jobs"}
    said = " ".join(str(e).split())[:200]
    return ConfigError(f"{what}: {fixes.get(status, said)}" + (f" (HTTP {status})" if status else ""))


def has_token() -> bool:
    from huggingface_hub import get_token  # start-up time: only when launching

    return bool(get_token())


def token_or_refuse() -> str:
    from huggingface_hub import get_token  # start-up time: only when launching

    token = get_token()
    if not token:
        raise ConfigError("Not logged in to the Hugging Face Hub: run `hf auth login` (or set HF_TOKEN) first.")
    return token


@dataclass
class HfJobs:
    """The Jobs of one namespace (the user's by default) through ``huggingface_hub.HfApi``."""

    namespace: str | None = None

    def api(self):
        from huggingface_hub import HfApi  # start-up time: only when launching

        return HfApi(token=token_or_refuse())

    def owner(self) -> str:
        if self.namespace:
            return self.namespace
        try:
            self.namespace = self.api().whoami()["name"]
        except Exception as e:
            raise hub_fault(e, "asking the Hub who is logged in") from None
        return self.namespace

    def upload(self, bundle: Bundle, repo: str) -> list[str]:
        """Send the launch and the blobs ``repo`` lacks in one commit; the blob names sent."""
        from huggingface_hub import CommitOperationAdd  # start-up time: only when launching

        api = self.api()
        try:
            api.create_repo(repo, repo_type="dataset", private=True, exist_ok=True)
            have = set(api.list_repo_files(repo, repo_type="dataset"))
            new = [d for d in bundle.blobs if f"blobs/{d}" not in have]
            ops = [CommitOperationAdd(f"blobs/{d}", str(bundle.blobs[d])) for d in new]
            ops += [CommitOperationAdd(f"{bundle.launch_dir}/{name}", text.encode())
                    for name, text in bundle.texts.items()]
            api.create_commit(repo, ops, repo_type="dataset", commit_message=f"anyfit launch {bundle.run}")
        except ConfigError:
            raise
        except Exception as e:
            raise hub_fault(e, f"uploading the launch to {repo}") from None
        return new

    def put_record(self, repo: str, record: dict) -> None:
        """The launch record (no secret values: their names) beside the launch in ``repo``, so ``anyfit jobs``
        and ``--resume`` work from any machine logged in to the namespace."""
        api = self.api()
        try:
            api.create_repo(repo, repo_type="dataset", private=True, exist_ok=True)
            api.upload_file(path_or_fileobj=json.dumps(record, indent=1).encode(), repo_id=repo, repo_type="dataset",
                            path_in_repo=f"launches/{record['run']}/{RECORD}",
                            commit_message=f"anyfit launch {record['run']}: its record")
        except Exception as e:
            raise hub_fault(e, f"writing the launch record to {repo}") from None

    def get_record(self, repo: str, run: str) -> dict | None:
        """The launch record of ``run`` in ``repo`` (None when the repo or the launch is not there)."""
        from huggingface_hub import hf_hub_download  # start-up time: only when launching
        from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError

        try:
            path = hf_hub_download(repo, f"launches/{run}/{RECORD}", repo_type="dataset", token=token_or_refuse())
        except (EntryNotFoundError, RepositoryNotFoundError):
            return None
        except Exception as e:
            raise hub_fault(e, f"reading the launch record of {run} from {repo}") from None
        return json.loads(Path(path).read_text())

    def submit(self, run: str, command: list[str], repo: str, flavor: str, secrets: dict[str, str], timeout: str,
               retries: int):
        import huggingface_hub  # start-up time: only when launching

        api = self.api()
        # Restarts after a failure are the provider's (attempts), in huggingface_hub releases that have them.
        attempts = {"attempts": retries + 1} if "attempts" in inspect.signature(api.run_job).parameters else {}
        if retries and not attempts:
            raise ConfigError(f"--retries needs a huggingface_hub whose run_job restarts a job (this one is "
                              f"{huggingface_hub.__version__}): upgrade it, or launch without --retries and resume "
                              "with anyfit launch --resume RUN.")
        try:
            return api.run_job(
                image=IMAGE, command=command, env={"ANYFIT_WORK": WORK}, secrets=secrets,
                flavor=flavor, timeout=timeout, labels={"anyfit-run": run}, namespace=self.owner(),
                volumes=[huggingface_hub.Volume(type="dataset", source=repo, mount_path=MOUNT)], **attempts)
        except Exception as e:
            raise hub_fault(e, f"starting the job on {flavor}", flavor) from None

    def inspect(self, job_id: str):
        try:
            return self.api().inspect_job(job_id=job_id, namespace=self.owner())
        except Exception as e:
            raise hub_fault(e, f"reading job {job_id}") from None

    def logs(self, job_id: str, follow: bool) -> Iterable[str]:
        try:
            yield from self.api().fetch_job_logs(job_id=job_id, namespace=self.owner(), follow=follow)
        except Exception as e:
            raise hub_fault(e, f"reading the log of job {job_id}") from None

    def cancel(self, job_id: str) -> None:
        try:
            self.api().cancel_job(job_id=job_id, namespace=self.owner())
        except Exception as e:
            raise hub_fault(e, f"cancelling job {job_id}") from None
