"""A local HTTP stand-in for the Hugging Face Hub, for huggingface_hub's real client in the launch tests: the Jobs
protocol (whoami, job creation, status, logs as server-sent events, cancel) and the repo protocol (create, info,
tree, preupload, the LFS batch API and its uploads, NDJSON commits, resolve) as the client speaks them, with the
repos in memory. Not a Hub: only what the client sends for anyfit's calls, enough to count what was sent.

The client's Xet upload path needs Xet's own storage service, which is not stood in for: the tests turn it off
(``HF_HUB_DISABLE_XET``), so files go through the LFS protocol the Hub still serves; the real Hub deduplicates
Xet uploads by content the same way (``huggingface_hub``'s own documentation), which these tests cannot see."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_FROM = 1024  # files of this size or more go through LFS (the Hub decides by size and content; a smaller threshold)


@dataclass
class Repo:
    private: bool
    files: dict[str, bytes] = field(default_factory=dict)
    lfs: set[str] = field(default_factory=set)  # the paths stored as LFS pointers
    commits: int = 0
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex)  # a revision never seen by an earlier test's cache

    @property
    def sha(self) -> str:
        return hashlib.sha1(f"{self.nonce}:{self.commits}".encode()).hexdigest()


@dataclass
class Hub:
    """The stand-in's state: repos by (type, id), LFS objects by sha256, jobs, and what was sent."""

    repos: dict[tuple[str, str], Repo] = field(default_factory=dict)
    objects: dict[str, bytes] = field(default_factory=dict)
    jobs: dict[str, dict] = field(default_factory=dict)
    lfs_puts: list[str] = field(default_factory=list)  # the sha256 of every LFS object uploaded, in order
    regular_sent: list[str] = field(default_factory=list)  # the paths of every file sent inline in a commit
    fail_commits: int = 0  # the next N commits fail (500) after their content is uploaded: an interrupted upload
    fail_commit_of: str | None = None  # the next commit that adds this path fails (500)

    def files(self, repo_id: str, repo_type: str = "model") -> dict[str, bytes]:
        repo = self.repos.get((repo_type, repo_id))
        return {} if repo is None else {p: b for p, b in repo.files.items() if p != ".gitattributes"}


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Handler(BaseHTTPRequestHandler):
    hub: Hub  # set by serve()

    def log_message(self, *args):
        pass

    def _send(self, code: int, body=None, kind="application/json", headers=None, head=False):
        data = b"" if body is None else body if isinstance(body, bytes) else (
            body.encode() if isinstance(body, str) else json.dumps(body).encode())
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def _not_found(self, head=False):
        self._send(404, {"error": "Repository not found"}, headers={"X-Error-Code": "RepoNotFound"}, head=head)

    def _repo(self, parts: list[str]) -> tuple[tuple[str, str], Repo | None]:
        """parts: ['api', 'models'|'datasets', ns, name, ...]"""
        key = (parts[1].removesuffix("s"), f"{parts[2]}/{parts[3]}")
        return key, self.hub.repos.get(key)

    # --- GET / HEAD ---------------------------------------------------------------------------------------
    def do_HEAD(self):
        self._resolve(head=True)

    def do_GET(self):
        path = urlsplit(self.path).path
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if path.startswith("/api/whoami-v2"):
            return self._send(200, {"name": "me", "type": "user"})
        if parts[:2] == ["api", "jobs"]:
            return self._jobs_get(parts)
        if parts[0] == "api" and parts[1] in ("models", "datasets") and len(parts) >= 6:
            key, repo = self._repo(parts)
            if repo is None:
                return self._not_found()
            if parts[4] == "revision":
                return self._send(200, {"id": key[1], "sha": repo.sha, "private": repo.private,
                                        "siblings": [{"rfilename": p} for p in sorted(repo.files)]})
            if parts[4] == "tree":
                prefix = "/".join(parts[6:])
                return self._send(200, [self._entry(repo, p) for p in sorted(repo.files)
                                        if not prefix or p.startswith(prefix + "/")])
        return self._resolve()

    def _entry(self, repo: Repo, p: str) -> dict:
        data = repo.files[p]
        entry = {"type": "file", "oid": _git_oid(data), "size": len(data), "path": p}
        if p in repo.lfs:
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}
        return entry

    def _resolve(self, head=False):
        """``/{datasets/}ns/name/resolve/rev/path``: a file's content, with the headers hf_hub_download reads."""
        parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
        kind = "model"
        if parts and parts[0] == "datasets":
            kind, parts = "dataset", parts[1:]
        if len(parts) < 5 or parts[2] != "resolve":
            return self._send(404, {"error": "not found"}, head=head)
        repo = self.hub.repos.get((kind, f"{parts[0]}/{parts[1]}"))
        name = "/".join(parts[4:])
        if repo is None or name not in repo.files:
            return self._send(404, {"error": "Entry not found"}, headers={"X-Error-Code": "EntryNotFound"},
                              head=head)
        data = repo.files[name]
        etag = hashlib.sha256(data).hexdigest() if name in repo.lfs else _git_oid(data)
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{etag}"'}
        if name in repo.lfs:
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
        self._send(200, data, "application/octet-stream", headers, head=head)

    # --- POST / PUT ---------------------------------------------------------------------------------------
    def do_PUT(self):
        parts = urlsplit(self.path).path.strip("/").split("/")
        if parts[0] == "lfs-upload":
            data = self._body()
            assert hashlib.sha256(data).hexdigest() == parts[1]
            self.hub.objects[parts[1]] = data
            self.hub.lfs_puts.append(parts[1])
            return self._send(200, {})
        self._send(404, {"error": "not found"})

    def do_POST(self):
        path = urlsplit(self.path).path
        parts = [unquote(p) for p in path.strip("/").split("/")]
        body = self._body()
        if parts[:2] == ["api", "jobs"] or parts[-1] == "cancel":
            return self._jobs_post(parts, json.loads(body or b"{}"))
        if path == "/api/repos/create":
            req = json.loads(body)
            repo_id = f"{req.get('organization') or 'me'}/{req['name']}"
            key = (req.get("type") or "model", repo_id)
            if key in self.hub.repos:
                prefix = "datasets/" if key[0] == "dataset" else ""
                return self._send(409, {"error": "You already created this repo",
                                        "url": f"http://{self.headers['Host']}/{prefix}{repo_id}"})
            self.hub.repos[key] = Repo(private=req.get("visibility", "private" if req.get("private") else "public") != "public", files={".gitattributes": b"*.bin lfs\n"})
            prefix = "datasets/" if key[0] == "dataset" else ""
            return self._send(200, {"url": f"http://{self.headers['Host']}/{prefix}{repo_id}", "name": repo_id})
        if path.endswith(".git/info/lfs/objects/batch"):
            req = json.loads(body)
            objects = [{"oid": o["oid"], "size": o["size"]} | (
                {} if o["oid"] in self.hub.objects else  # already stored: no action, nothing sent again
                {"actions": {"upload": {"href": f"http://{self.headers['Host']}/lfs-upload/{o['oid']}"}}})
                for o in req["objects"]]
            return self._send(200, {"transfer": "basic", "objects": objects})
        if parts[0] == "api" and parts[1] in ("models", "datasets") and len(parts) >= 6:
            _, repo = self._repo(parts)
            if repo is None:
                return self._not_found()
            if parts[4] == "preupload":
                files = json.loads(body)["files"]
                return self._send(200, {"files": [
                    {"path": f["path"], "uploadMode": "lfs" if f["size"] >= LFS_FROM else "regular",
                     "shouldIgnore": False, "oid": _git_oid(repo.files[f["path"]]) if f["path"] in repo.files
                     else None} for f in files]})
            if parts[4] == "commit":
                prefix = "datasets/" if parts[1] == "datasets" else ""
                return self._commit(repo, body, f"http://{self.headers['Host']}/{prefix}{parts[2]}/{parts[3]}")
        self._send(404, {"error": "not found"})

    def _commit(self, repo: Repo, body: bytes, url: str):
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        adds = {item["value"].get("path") for item in lines if item["key"] in ("file", "lfsFile")}
        if self.hub.fail_commits or self.hub.fail_commit_of in adds:
            self.hub.fail_commits = max(0, self.hub.fail_commits - 1)
            self.hub.fail_commit_of = None
            return self._send(500, {"error": "Internal Error: the connection was lost"})
        for item in lines:
            key, value = item["key"], item["value"]
            if key == "file":
                repo.files[value["path"]] = base64.b64decode(value["content"])
                repo.lfs.discard(value["path"])
                self.hub.regular_sent.append(value["path"])
            elif key == "lfsFile":
                repo.files[value["path"]] = self.hub.objects[value["oid"]]
                repo.lfs.add(value["path"])
            elif key == "deletedFile":
                repo.files.pop(value["path"], None)
            elif key == "deletedFolder":
                for p in [p for p in repo.files if p.startswith(value["path"].rstrip("/") + "/")]:
                    del repo.files[p]
        repo.commits += 1
        self._send(200, {"commitUrl": f"{url}/commit/{repo.sha}", "commitOid": repo.sha})

    # --- Jobs ---------------------------------------------------------------------------------------------
    def _job(self, job_id):
        job = self.hub.jobs[job_id]
        return {"id": job_id, "owner": {"id": "1", "name": "me", "type": "user"}, "flavor": job["flavor"],
                "dockerImage": job["dockerImage"], "command": job["command"], "status": {"stage": job["stage"]},
                "createdAt": "2026-11-28T10:00:00Z", "startedAt": "2026-11-28T10:00:00Z",
                "finishedAt": "2026-11-28T11:00:00Z" if job["stage"] != "RUNNING" else None, "labels": job["labels"]}

    def _jobs_get(self, parts):
        if len(parts) == 4:
            return self._send(200, self._job(parts[3])) if parts[3] in self.hub.jobs else self._not_found()
        if parts[-1] == "logs":
            lines = ["[anyfit launch] run r: a fresh start", "train: done"]
            return self._send(200, "".join(f"data: {json.dumps({'data': t, 'timestamp': '2026-11-28T10:00:01.000Z'})}"
                                           "\n\n" for t in lines), "text/event-stream")
        self._send(404, {"error": "not found"})

    def _jobs_post(self, parts, body):
        if parts[:2] == ["api", "jobs"] and len(parts) == 3:
            if body["flavor"] == "h200x8":
                return self._send(403, {"error": "flavor not allowed"})
            job_id = f"job{len(self.hub.jobs)}"
            self.hub.jobs[job_id] = {**body, "stage": "COMPLETED"}
            return self._send(200, self._job(job_id))
        if parts[-1] == "cancel":
            self.hub.jobs[parts[3]]["stage"] = "CANCELED"
            return self._send(200, {})
        self._send(404, {"error": "not found"})


def serve() -> tuple[ThreadingHTTPServer, Hub]:
    """A stand-in on a free local port, serving in a thread; ``server.shutdown()`` stops it."""
    hub = Hub()
    handler = type("BoundHandler", (Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, hub
