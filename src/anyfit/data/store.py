"""The token store: a data set tokenized once into flat memory-mapped arrays, reused by every process of
every later run that would tokenize it the same way.

Layout of one store (a folder named by its key, under ``data.cache_dir``, default ``~/.cache/anyfit/tokens``)::

    input_ids.bin       int32, every kept example's token ids, back to back
    loss_mask.bin       uint8, 1 where the token is a label (labels are the ids there, -100 elsewhere)
    offsets.bin         int64, example i is [offsets[i], offsets[i + 1])
    trainable.bin       int32, trained tokens per example (what the window sampler weighs the loss by)
    part_record.bin     int64, per part: its source record. A record is one part, or several when a chat template
                        makes it several examples (``anyfit.data.chat``); a dropped record is one part
    part_fate.bin       uint8, per part: kept, cut, or why it was dropped (``tokenization.Fate``)
    part_example.bin    int64, per part: its example's index, -1 when dropped
    part_cut.bin        int32, per part: the tokens the cut to data.max_length removed (0 when not cut)
    record_digest.bin   uint64, per source record: a digest of the record (what a checkpoint keeps to tell a
                        resumed run which records changed: ``anyfit.data.fingerprint``)
    example_source.bin  int16, per example: its record's ``data.source_column`` value, numbered (the names are in
                        the manifest's ``sources``); empty without a source column
    vision.bin          uint8, per image example: its rendered text and image references as JSON
                        (``image_tokens.vision_json``), back to back; empty for a store without images
    vision_offsets.bin  int64, example i's JSON is vision[vision_offsets[i]:vision_offsets[i + 1]] (empty: a text
                        example); empty for a store without images
    image_bytes.bin     uint8, the bytes of images embedded in the data (base64, the hub's Image feature), once each;
                        images in files are kept as their paths, never as pixels
    example_images.bin  int32, per example: its images; example_image_tokens.bin the tokens they take,
                        example_images_shrunk.bin those the processor shrinks to its size limit (empty without
                        images)
    manifest.json       written last: format, key, counts, dtypes, the data report, size and sha256 of each file

Why NumPy memory maps rather than Arrow through ``datasets``: the loop reads an example as two slices of two
flat arrays, which a memory map serves straight from the page cache (one copy per machine, shared by every
process, nothing deserialised); an Arrow table would add a per-row conversion, and nothing here needs Arrow's
columns of nested types. The labels are stored as a 1-byte mask because in every format anyfit reads a label is
either the token itself or -100 (checked while building): 5 bytes per token instead of 8.

The key is the content: the data source (``sources.source_fingerprint``: file contents or the hub data set's
fingerprint), the tokenizer (its whole serialised state and chat template), every ``data.*`` setting that changes
tokens, the source code of the modules that turn records into tokens, and ``FORMAT``. A changed input never
finds a stale store; an unchanged one always finds its own.

Exactly one process per store location builds it: the others wait on a file lock (not on a collective with a
timeout), then every process maps the same files. A store is built in a temporary folder and renamed when its
manifest is written, so an interrupted build (Ctrl-C, SIGKILL, a full disk) never leaves a folder that looks
complete; a store whose files do not match its manifest is rebuilt, never trusted (the lock, the rename and the
manifest's file table are ``anyfit.durable``'s).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import io
import itertools
import json
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import shutil
import signal
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from anyfit import durable, faults
from anyfit.cache import cache_root, digest_memo
from anyfit.config import DataConfig
from anyfit.data import (
    answers,
    audit,
    chat,
    formats,
    image_tokens,
    images,
    messages,
    reasoning_layout,
    source_names,
    stopping,
    template_probes,
    templates,
    tokenization,
)
from anyfit.data.audit import Findings
from anyfit.data.chat import use_chat_template
from anyfit.data.formats import resolve_fields, to_examples
from anyfit.data.image_tokens import ImageTokens
from anyfit.data.sources import DataError, Records, iter_records, source_fingerprint
from anyfit.data.store_writer import ARRAYS, FORMAT, Packed, Writer
from anyfit.data.tokenization import (
    IGNORE_INDEX,
    DataReport,
    Fate,
    TokenizedExample,
    report_of,
    tokenize_each,
)
from anyfit.units import GIB

# data.* keys that do not change the tokens (where the store lives, how many processes build it).
NOT_TOKENS = ("cache_dir", "num_proc", "allow_stop_only")
# The modules whose code turns records into tokens: a change in any of them is a new key.
TOKENIZING_CODE = (formats, messages, chat, template_probes, reasoning_layout, templates, stopping, audit,
                   tokenization, answers, source_names, images, image_tokens)
BATCH_RECORDS = 1024  # records rendered and tokenized per task: bounded memory, enough work per task
PARALLEL_FROM = 20_000  # records; below this a worker pool costs more to start than it saves


def default_dir() -> Path:
    return cache_root() / "tokens"


def store_key(cfg: DataConfig, tokenizer, images: ImageTokens | None = None) -> str:
    """The content key of the store ``cfg`` + ``tokenizer`` (+ the processor of ``images``) make (see the module
    docstring)."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_TOKENS}
    code = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in TOKENIZING_CODE)).hexdigest()
    parts = {"format": FORMAT, "code": code, "source": source_fingerprint(cfg),
             "tokenizer": tokenizer_fingerprint(tokenizer), "data": settings,
             "processor": images.fingerprint() if images is not None else None}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything in a tokenizer that decides token ids: its serialised model, normaliser,
    pre-tokenizer and post-processor (fast tokenizers), the chat template and the special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = {"class": type(tokenizer).__name__, "chat_template": getattr(tokenizer, "chat_template", None),
             "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
             "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id], "size": len(tokenizer)}
    return hashlib.sha256(state.encode() + json.dumps(extra, sort_keys=True).encode()).hexdigest()


@dataclass
class TokenStore:
    """A complete store, memory-mapped. ``store[i]`` is example i as ``{"input_ids": [...], "labels": [...]}``
    (lists, as the collator takes them); ``lengths`` and ``trainable`` are arrays over all examples."""

    folder: Path
    arrays: dict[str, np.ndarray]
    manifest: dict[str, Any]

    @staticmethod
    def open(folder: Path, verify: bool = False) -> TokenStore:
        """Map a complete store; a ``DataError`` when it is not one (``problem`` says why)."""
        problem = store_problem(folder, verify)
        if problem:
            raise DataError(f"token store {folder}: {problem}")
        manifest = durable.read_manifest(folder)
        arrays = {name: _map(folder / f"{name}.bin", dtype, manifest["counts"][name])
                  for name, dtype in ARRAYS.items()}
        return TokenStore(folder, arrays, manifest)

    def __reduce__(self):
        # Sent to another process (a spawned DataLoader worker): it maps the same files, nothing is copied.
        return TokenStore.open, (self.folder,)

    def __len__(self) -> int:
        return len(self.arrays["trainable"])

    def __getitem__(self, i: int) -> TokenizedExample:
        start, stop = int(self.arrays["offsets"][i]), int(self.arrays["offsets"][i + 1])
        ids = self.arrays["input_ids"][start:stop]
        labels = np.where(self.arrays["loss_mask"][start:stop] != 0, ids, IGNORE_INDEX)
        example = {"input_ids": ids.tolist(), "labels": labels.tolist()}
        if len(self.sources) > 1:  # data.source_column: the loss is summed per source too (training.loss)
            example.update(source=int(self.arrays["example_source"][i]), sources=len(self.sources))
        if len(self.arrays["vision_offsets"]):
            a, b = int(self.arrays["vision_offsets"][i]), int(self.arrays["vision_offsets"][i + 1])
            if b > a:  # an image example: its text and images, for the batch workers (anyfit.data.image_batches)
                example["vision"] = image_tokens.vision_of(self.arrays["vision"][a:b].tobytes(),
                                                           self.arrays["image_bytes"])
        return example

    @property
    def sources(self) -> list[str]:
        """``data.source_column``'s values, in the order their numbers give ([] without a source column)."""
        return self.manifest.get("sources", [])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.arrays["offsets"])

    @property
    def records(self) -> int:
        return int(self.manifest["report"]["loaded"])

    @property
    def report(self) -> DataReport:
        return DataReport(**self.manifest["report"])

    def view(self, records: Sequence[int] | None = None) -> Examples:
        """The examples of the given source records (all by default), in record order, with their report."""
        if records is None:
            index = np.arange(len(self))
            return Examples(self, index, self.report)
        records = np.asarray(records, dtype=np.int64)
        # Parts are written in record order, so part_record is sorted: the parts of each chosen record, in the order
        # the records are given.
        first = np.searchsorted(self.arrays["part_record"], records, side="left")
        last = np.searchsorted(self.arrays["part_record"], records, side="right")
        parts = np.concatenate([np.arange(a, b) for a, b in zip(first, last)]) if len(records) else \
            np.zeros(0, np.int64)
        chosen = self.arrays["part_example"][parts]
        index = chosen[chosen >= 0]
        findings = Findings()  # the unread fields and audit of the whole store: they are not kept per record
        findings.unused.update(self.report.unused)
        report = report_of([Fate(int(f)) for f in self.arrays["part_fate"][parts]], self.lengths[index].tolist(),
                           self.arrays["trainable"][index].tolist(), self.manifest["max_length"],
                           self.manifest["overlong"], cut=self.arrays["part_cut"][parts].tolist(),
                           records=len(records), findings=findings)
        if len(self.arrays["example_images"]):
            report.images = int(self.arrays["example_images"][index].sum())
            report.image_tokens = int(self.arrays["example_image_tokens"][index].sum())
            report.images_shrunk = int(self.arrays["example_images_shrunk"][index].sum())
        return Examples(self, index, report)


@dataclass
class Examples:
    """Some examples of a store (``rows``: their indices in it): what the window sampler, the collator and
    validation read, as a sequence of ``{"input_ids", "labels"}``."""

    store: TokenStore
    rows: np.ndarray
    report: DataReport

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):  # validation splits held-out examples over processes: a small list
            return [self.store[int(j)] for j in self.rows[i]]
        return self.store[int(self.rows[i])]

    def __iter__(self) -> Iterator[TokenizedExample]:
        return (self.store[int(j)] for j in self.rows)

    @property
    def lengths(self) -> np.ndarray:
        return self.store.lengths[self.rows]

    @property
    def trainable(self) -> np.ndarray:
        return self.store.arrays["trainable"][self.rows]

    @property
    def names(self) -> list[str]:
        """What each source's loss is logged under (``data.source_column``; [] without one)."""
        return source_names.metric_names(self.store.sources)

    def trained_by_source(self, indices: np.ndarray) -> np.ndarray:
        """Trained tokens per source of the examples ``indices`` (int64, one per source)."""
        rows = self.rows[indices]
        return np.bincount(self.store.arrays["example_source"][rows], weights=self.store.arrays["trainable"][rows],
                           minlength=len(self.store.sources)).astype(np.int64)


def open_or_build(cfg: DataConfig, tokenizer, echo=print, images: ImageTokens | None = None) -> TokenStore:
    """The store of ``cfg`` + ``tokenizer``: mapped when it exists and is intact, else built (by exactly one
    process per location; the others wait on the lock, then map it). ``images``: the model's processor, for
    records with images (``anyfit.data.image_tokens``)."""
    use_chat_template(tokenizer, cfg.chat_template)  # before the key: the tokenizer's fingerprint holds its template
    root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_dir()
    root.mkdir(parents=True, exist_ok=True)
    key = store_key(cfg, tokenizer, images)
    folder = root / key
    stamp = root / f"{key}.verified"
    launch = _launch_id()
    with durable.FileLock(root / f"{key}.lock"):
        # The processes of one launch share one check of every file's hash (N processes would otherwise pay for
        # hashing in turn under the lock); the sizes are checked by each. A run of its own checks all.
        shared = launch is not None and stamp.is_file() and stamp.read_text() == launch
        problem = store_problem(folder, verify=not shared) if folder.exists() else "missing"
        if problem is None:
            echo(f"[anyfit] token store: {folder} (reused, nothing tokenized)")
        else:
            if folder.exists():
                echo(f"[anyfit] token store {folder} is damaged ({problem}): building it again")
                shutil.rmtree(folder)
            # Only the lock holder builds this key, so a temporary folder of it is what a killed build left.
            for stale in root.glob(f".{key}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            build(cfg, tokenizer, folder, echo=echo, images=images)
        if launch is not None:
            stamp.write_text(launch)
    return TokenStore.open(folder)


def _launch_id() -> str | None:
    """The launcher process (torchrun's agent) of this process when it has siblings on this machine, else None."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= 1:
        return None
    import psutil  # a dependency of accelerate, declared by anyfit

    parent = psutil.Process().parent()
    return f"{parent.pid}:{parent.create_time()}" if parent is not None else None


def store_problem(folder: Path, verify: bool = False) -> str | None:
    """What is wrong with a store folder (None when it is complete): sizes always, hashes with ``verify``."""
    manifest = durable.read_manifest(folder)
    if manifest is None:
        return f"no readable {durable.MANIFEST} (an interrupted build)"
    if manifest.get("format") != FORMAT:
        return f"format {manifest.get('format')}, this anyfit writes {FORMAT}"
    return durable.manifest_problem(folder, manifest["files"], verify, memo=digest_memo())


def build(cfg: DataConfig, tokenizer, folder: Path, echo=print, images: ImageTokens | None = None) -> None:
    """Stream the records of ``cfg``, render and tokenize them in batches (in ``data.num_proc`` worker processes
    for large sets), and write the store into a temporary folder that is renamed when complete."""
    batches = _tokenized_batches(cfg, tokenizer, images)
    writer: Writer | None = None
    try:
        with durable.building(folder) as tmp:
            writer = Writer(tmp, cfg.source_column)
            for results in batches:
                writer.add(results)
            if not writer.kept:
                raise DataError(tokenization.nothing_left(writer.report(cfg)))
            writer.findings.check(cfg)
            writer.finish(cfg, key=folder.name)
    except BaseException as e:
        batches.close()  # its progress bar clears its line before anything is printed
        done = writer.records if writer is not None else 0
        for file in vars(writer).values() if writer is not None else ():  # open, they hold the removed files' space
            if isinstance(file, io.IOBase):
                with contextlib.suppress(OSError):  # a full disk fails the flush; the file is closed all the same
                    file.close()
        if isinstance(e, KeyboardInterrupt):
            raise KeyboardInterrupt(f"stopped while tokenizing {cfg.path}, after {done:,} records; nothing was kept: "
                                    "the next run (or anyfit prepare) tokenizes it again") from None
        place = {"data.cache_dir" if cfg.cache_dir else "ANYFIT_CACHE": folder.parent}
        if isinstance(e, OSError) and (e.filename is None or faults.setting_of(e.filename, place)):
            # the store's own disk: full, read-only, gone (a data file's error is the reader's to name)
            written = (writer.offsets[-1] * 5 if writer is not None else 0) / 2**20  # int32 id + uint8 mask a token
            raise faults.FileFault(
                faults.os_problem(e, place, doing=f"the token store of {cfg.path} was not written", where=folder.parent)
                + f" Nothing was kept (it failed after {done:,} records, {written:.1f} MiB of tokens).") from None
        raise
    echo(f"[anyfit] token store: {folder} (built: {writer.records:,} records, {writer.kept:,} examples)")


def _tokenized_batches(cfg: DataConfig, tokenizer, images: ImageTokens | None = None) -> Iterator[Packed]:
    """Per-record tokenization results, batch by batch, in record order. The format is detected (and the mapped
    fields checked) on the data set's first record, as when it is read whole; later batches take that format."""
    batches = iter_records(cfg, BATCH_RECORDS)
    first = next(batches, None)
    if first is None:
        raise DataError(f"{cfg.path} holds no records (split {cfg.split!r}); check data.path and data.split.")
    # Read ahead up to PARALLEL_FROM records: a smaller data set is tokenized here, without a worker pool.
    ahead: list[Records] = []
    while sum(map(len, ahead)) + len(first) < PARALLEL_FROM and (batch := next(batches, None)) is not None:
        ahead.append(batch)
    first_examples = to_examples(first, cfg)
    rest_cfg = resolve_fields(first[0], cfg)
    bar = tqdm(desc="tokenize", unit="record", leave=False, disable=not ahead)

    def first_batch() -> Packed:
        bar.update(len(first))
        return Packed.of(tokenize_each(first_examples, tokenizer, cfg, images), first, cfg.source_column)

    try:
        yield from _rest(rest_cfg, tokenizer, first, first_batch, ahead, batches, bar, images)
    finally:
        bar.close()


def _rest(rest_cfg: DataConfig, tokenizer, first: Records, first_batch, ahead: list[Records],
          batches: Iterator[Records], bar, images: ImageTokens | None = None):
    """``first_batch()`` (tokenized here), then the batches after it (``rest_cfg``: the format found in the first):
    in this process, or over a pool of ``data.num_proc`` workers. With a pool, the first batch is tokenized here
    while the workers start: while the fork server imports their modules (before any is asked), or, spawned, while
    each imports and loads the tokenizer (seconds; after they are asked)."""
    small = sum(map(len, ahead)) + len(first) < PARALLEL_FROM  # everything is read already
    workers = 1 if small and rest_cfg.num_proc == "auto" else _workers(rest_cfg)

    def numbered():  # (batch, index of its first record in the data set)
        start = len(first)
        for batch in itertools.chain(ahead, batches):
            yield batch, start
            start += len(batch)

    if workers <= 1 or not ahead:
        yield first_batch()
        for batch, start in numbered():
            bar.update(len(batch))
            yield Packed.of(tokenize_each(to_examples(batch, rest_cfg, start), tokenizer, rest_cfg, images), batch,
                             rest_cfg.source_column)
        return
    context = _start_method(tokenizer)
    if context.get_start_method() == "forkserver":
        # The fork server imports the workers' modules (0.5-0.7 s of a 2-core VM) before it forks the first one, and
        # the first submit waits for it: started here, it imports while this process tokenizes the first batch.
        # It must start with SIGINT blocked, as the workers it forks (see _sigint_deferred). The resource tracker
        # first: started inside that window, it would unblock SIGINT on its way out (its own start blocks and then
        # unblocks it), and the fork server and every worker would take a Ctrl-C as a traceback.
        multiprocessing.resource_tracker.ensure_running()
        with _sigint_deferred(True):
            multiprocessing.forkserver.ensure_running()
        head = first_batch()
        first_batch = lambda: head  # noqa: E731 - tokenized already, yielded where the pool's loop asks for it
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                             initargs=(tokenizer, rest_cfg, images)) as pool:
        queue: collections.deque = collections.deque()
        submitted = 0
        try:
            for batch, start in numbered():
                with _sigint_deferred(submitted < workers):  # (spawn) each of the first submits starts a worker
                    queue.append((len(batch), pool.submit(_tokenize_in_worker, list(batch), _places(batch), start)))
                submitted += 1
                if submitted == 2 * workers:  # the workers are starting: the first batch meanwhile, here
                    yield first_batch()
                if len(queue) >= 2 * workers:  # bounded: at most two batches per worker in flight
                    n, future = queue.popleft()
                    bar.update(n)
                    yield future.result()
            if submitted < 2 * workers:
                yield first_batch()
            for n, future in queue:
                bar.update(n)
                yield future.result()
        except BaseException:  # Ctrl-C, a bad record: the batches not started are dropped, not tokenized first
            pool.shutdown(wait=False, cancel_futures=True)
            raise


@contextlib.contextmanager
def _sigint_deferred(active: bool):
    """SIGINT blocked while this thread starts worker processes, which inherit the blocked signal across exec and so
    never see it: a Ctrl-C in the terminal reaches the whole process group, and it is the parent's to handle (it
    stops the build and says so in one line), not each worker's to print a traceback. In the parent a Ctrl-C in
    that instant is kept and raised once the workers are started: raised inside the pool's bookkeeping it would
    leave a started worker unknown to the pool, which then never shuts down."""
    if not active:
        yield
        return
    caught: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum)) if main else None
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a Ctrl-C held back arrives now, and is kept
        if main:
            signal.signal(signal.SIGINT, handler)
    if caught:
        raise KeyboardInterrupt


def _start_method(tokenizer):
    """How the workers start. Not fork: the parent may hold a process group and torch's threads. A fork server
    where the platform has one (Linux, macOS): one fresh process imports the workers' modules once and each worker
    is forked from it, instead of each spawned worker importing them anew (about 1 s of a 2-core VM's start-up:
    BENCHMARKS.md, 'Data preparation at the physical limit (issue 55)'); spawn elsewhere."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # Taken by the fork server when it starts (the first pool of this process); a module that fails to import
    # there is skipped, and the worker imports it itself.
    context.set_forkserver_preload([__name__, type(tokenizer).__module__])
    return context


def _workers(cfg: DataConfig) -> int:
    """``data.num_proc``; auto: the cores, at most one per GiB of available memory, at most 8."""
    if cfg.num_proc != "auto":
        return int(cfg.num_proc)
    import psutil

    gib = psutil.virtual_memory().available / GIB
    return max(1, min(os.cpu_count() or 1, int(gib), 8))


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer, cfg: DataConfig, images: ImageTokens | None = None) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _WORKER.update(tokenizer=tokenizer, cfg=cfg, images=images)


def _places(batch: Records) -> list[str]:
    return [batch.locate(i) for i in range(len(batch))]


def _tokenize_in_worker(records: list[dict], places: list[str], start: int) -> Packed:
    cfg = _WORKER["cfg"]
    batch = Records(records, places.__getitem__)
    return Packed.of(tokenize_each(to_examples(batch, cfg, start), _WORKER["tokenizer"], cfg, _WORKER["images"]),
                      batch, cfg.source_column)


def _map(path: Path, dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))

