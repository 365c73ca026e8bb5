"""The executor: carry out a ``Plan``, one tensor at a time, and commit by writing markers last.

Memory holds one target tensor (plus the source box being copied into it) at a time: each target
file is streamed (safetensors header or torch pickle first, then tensor bytes in order), so peak
memory follows the largest tensor, not the checkpoint.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from ckptctl.checksums.manifest import MANIFEST, RunLog, new_digest, write_manifest
from ckptctl.formats import registry
from ckptctl.formats.base import Checkpoint, WriteJob
from ckptctl.io.runs import write_in_slices
from ckptctl.io.storage import Storage
from ckptctl.model.plan import COPY, Plan
from ckptctl.pipeline.assembler import Assembler, JobStopped
from ckptctl.pipeline.distributed import Group
from ckptctl.pipeline.job_report import Report, Sources, peak_rss_bytes
from ckptctl.pipeline.replicas import check_replicas
from ckptctl.pipeline.source_checks import SourceChecks
from ckptctl.progress import NoProgress, Progress
from planners.shares import split_files

DEFAULT_MEMORY_BUDGET = 1 << 30


def execute(
    plan: Plan,
    source: Checkpoint | Sources,
    target: Storage,
    progress: Progress | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    workers: int = 1,
    checksum: str = "xxh3_64",
    group: Group | None = None,
    files_at_once: int = 1,
) -> Report:
    """Write every file of ``plan`` to ``target``, then its finalize files in order.

    Tensor data in flight stays within about ``memory_budget`` bytes, whatever the tensor sizes.
    ``workers`` > 1 builds that many bands at once, ahead of the writer (object stores: GETs in
    flight; local disks: reading overlaps hashing and writing). ``files_at_once`` > 1 writes
    that many files at once, each thread taking the next file in plan order
    (they share the budget; the outputs are the same bytes). With a process ``group``, this
    process writes its share of the files (``planners.shares``); rank 0 commits once every rank
    has sent what it wrote, and its report covers the whole job (``ranks``: each one's).
    """
    progress = progress or NoProgress()
    if not isinstance(source, Sources):
        source = Sources(source)
    if target.is_s3 and target.uploads_directly:  # runs of its objects: copied by the server
        source.server_copy_to = target
    report = Report()
    started = time.perf_counter()
    checks = SourceChecks([source.primary, *source.extra.values()])
    checked_before = checks.read_again()
    sizes = [source.file_bytes(plan, f) for f in plan.files]
    rank, world = (group.rank, group.world) if group else (0, 1)
    mine = split_files(plan.files, sizes, world)[rank]
    progress.start(sum(sizes), f"{plan.operation} -> {plan.target_url}")
    if group is not None:
        progress = _GroupProgress(progress, group)
    target_format = registry.named(str(plan.target_format))
    finish_paths = target_format.finish_paths(plan) if target_format.finish_paths else ()
    if rank == 0:
        target.begin_writing()  # on S3, aborts stale uploads: before any rank starts its own
        log = RunLog(target, plan, checksum, finish_paths, rank, world)
    if group is not None:
        group.agree(None)  # rank 0's log holds every finished file before the others look
    if rank:
        log = RunLog(target, plan, checksum, finish_paths, rank, world)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="ckptctl-read") if workers > 1 else None
    writers = max(1, min(files_at_once, len(mine)))
    counting, stop = threading.Lock(), threading.Event()
    share_budget = memory_budget // writers
    assemblers = [
        Assembler(plan, source, report, progress, share_budget, pool, workers, counting, stop)
        for _ in range(writers)
    ]
    jobs = [WriteJob(plan, source, assemble, report) for assemble in assemblers]
    failure: Exception | None = None
    marks = _Marks(log, len(jobs), checks)
    try:
        _write_shares(jobs, mine, sizes, target, marks)
        marks.finish(_checked_sources(jobs[0]))
        target.drain()  # every rank's files are durable before rank 0 commits
    except Exception as err:  # the other ranks must hear of it, or they wait for this one
        failure = err
        _keep_finished(log, marks)
    except BaseException:  # interrupted: a rerun reuses every file finished so far
        _keep_finished(log, marks)
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    own_written = report.bytes_written
    checked_after = checks.read_again()
    report.read_for_checks = [a - b for a, b in zip(checked_after, checked_before, strict=True)]
    own_read = report.bytes_read + report.read_for_checks[1]  # (records, bytes)
    if group is not None:
        group.agree(None if failure is None else str(failure) or type(failure).__name__)
        _gather(group, report, log)
    if failure is not None:
        raise failure
    if rank == 0:
        for ckpt in (source.primary, *source.extra.values()):
            report.bytes_read += check_replicas(ckpt)
        _commit(jobs[0], target, log, target_format, checksum)
    if group is not None:
        group.agree(None)  # every rank returns once the job is committed
    progress.finish()
    report.seconds = time.perf_counter() - started
    report.peak_rss_bytes = peak_rss_bytes()
    if group is not None:
        report.ranks = _rank_figures(group, report, own_written, own_read)
    return report


def _keep_finished(log: RunLog, marks: _Marks) -> None:
    """Write the run log as it stands, with the files written whole but not yet marked (it
    is otherwise rewritten at most once a second, and a job stopped within that second would
    leave its last finished files unrecorded)."""
    with contextlib.suppress(Exception):  # the job's own error is the one to report
        marks.keep_unchecked()
        log.flush()


def _commit(job: WriteJob, target: Storage, log: RunLog, target_format: Any, checksum: str) -> None:
    """Files written after every data file, then the finalize texts, then the manifest."""
    plan, report = job.plan, job.report
    extra_files: list[str] = []
    for path, payload in target_format.finish(job) if target_format.finish else ():
        with target.open_write(path, new_digest(checksum)) as out:
            out.write(payload)
        log.finished(path, {}, size=out.size, checksum=out.digest.hexdigest())
        extra_files.append(path)
    target.drain()  # staged uploads land before anything that says "complete"
    for text in plan.finalize:
        target.write_text(text.path, text.content)
        report.files_written.append(text.path)
    target.drain()  # and every file is on the device before the manifest vouches for it
    write_manifest(
        target,
        plan,
        report.tensor_checksums,
        log.done,
        algorithm=checksum,
        extra=extra_files,
        quantized=_largest_errors(report.quantized),
    )
    log.clear_rank_logs()
    report.files_written.append(MANIFEST)


def _gather(group: Group, report: Report, log: RunLog) -> None:
    """Rank 0 takes in what every rank wrote: checksums, DCP records, counts."""
    target = group.all_gather(
        {
            "done": log.done,
            "tensors": report.tensor_checksums,
            "quantized": report.quantized,
            "records": report.records,
            "files": report.files_written,
            "read": report.bytes_read,
            "requests": report.read_requests,
            "written": report.bytes_written,
            "copied": report.copied,
            "checks": report.read_for_checks,
        }
    )
    if group.rank:
        return
    for r, part in enumerate(target):
        if r == 0:
            continue
        log.done.update(part["done"])
        report.tensor_checksums.update(part["tensors"])
        report.quantized.update(part["quantized"])
        report.records.update(part["records"])
        report.files_written.extend(part["files"])
        report.bytes_read += part["read"]
        report.read_requests += part["requests"]
        report.bytes_written += part["written"]
        checks = zip(report.read_for_checks, part["checks"], strict=True)
        report.read_for_checks = [a + b for a, b in checks]
        for how, n in part["copied"].items():
            report.copied[how] = report.copied.get(how, 0) + n


def _rank_figures(group: Group, report: Report, written: int, read: int) -> list[dict[str, Any]]:
    """Each rank's own figures (rank 0's report sums them); ``read`` counts the source bytes
    read for checks too (a record that several ranks read parts of is checked whole)."""
    mine = {
        "rank": group.rank,
        "seconds": round(report.seconds, 3),
        "peak_rss_bytes": report.peak_rss_bytes,
        "bytes_written": written,
        "bytes_read": read,
    }
    return group.all_gather(mine)


class _GroupProgress:
    """This rank's progress sent to the group; rank 0 shows the whole job's."""

    def __init__(self, inner: Progress, group: Group, every: int = 64 << 20) -> None:
        self.inner, self.group, self.every = inner, group, every
        self.done = self.sent = self.others = 0

    def start(self, total: int, label: str) -> None:
        self.inner.start(total, label)

    def advance(self, n: int) -> None:
        self.done += n
        self.inner.advance(n)
        if self.done - self.sent >= self.every:
            self.sent = self.done
            self.group.report_progress(self.done)
            if self.group.rank == 0:
                others = sum(self.group.progress()[1:])
                self.inner.advance(others - self.others)
                self.others = others

    def finish(self) -> None:
        self.group.report_progress(self.done)
        self.inner.finish()


def _write_shares(
    jobs: list[WriteJob], share: tuple[int, ...], sizes: list[int], target: Storage, marks: _Marks
) -> None:
    """Write the files of ``share``, ``len(jobs)`` at a time: each writer (the calling thread
    and one helper per further job) takes the next file in plan order until none is left.
    Kernel copies and writes into one file take its inode's lock, so one file's bytes move on
    one core however many threads feed it; a second file lets the kernel copy on another.
    A failure, or an interrupt of the calling thread, stops the other writers at their next
    tensor; the first failure is raised."""
    if len(jobs) == 1:
        for i in share:
            _write_file(jobs[0], i, sizes, target, marks)
        return
    queue, taking = iter(share), threading.Lock()
    stop = jobs[0].assemble.stop

    def write_files(job: WriteJob) -> None:
        while not stop.is_set():
            with taking:
                i = next(queue, None)
            if i is None:
                return
            try:
                _write_file(job, i, sizes, target, marks)
            except BaseException:
                stop.set()
                raise

    with ThreadPoolExecutor(len(jobs) - 1, thread_name_prefix="ckptctl-file") as helpers:
        others = [helpers.submit(write_files, job) for job in jobs[1:]]
        stopped: JobStopped | None = None
        try:
            write_files(jobs[0])
        except JobStopped as err:  # a helper failed: its failure is the one to report
            stopped = err
        except BaseException:  # an interrupt, too: the helpers stop at their next tensor
            stop.set()
            raise
        finally:
            wait(others)
    failures = [f.exception() for f in others if f.exception() is not None]
    first = next((e for e in failures if not isinstance(e, JobStopped)), None)
    if first is not None:
        raise first
    if stopped is not None:
        raise stopped
    # Files are listed in plan order, as one writer would have listed them.
    order = {plan_file.path: n for n, plan_file in enumerate(jobs[0].plan.files)}
    jobs[0].report.files_written.sort(key=lambda path: order.get(path, len(order)))


def _largest_errors(quantized: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each canonical tensor's largest quantization error over the files holding its parts."""
    out: dict[str, float] = {}
    for errors in quantized.values():
        for canonical, error in errors.items():
            out[canonical] = max(out.get(canonical, 0.0), error)
    return out


def _write_file(job: WriteJob, i: int, sizes: list[int], target: Storage, marks: _Marks) -> None:
    plan, report = job.plan, job.report
    file = plan.files[i]
    reused = marks.log.reusable(file.path)
    if reused is not None:  # resuming: this file was finished and is intact
        report.tensor_checksums[file.path] = reused["tensors"]
        if "quantized" in reused:
            report.quantized[file.path] = reused["quantized"]
        report.records[file.path] = reused.get("records", [])
        with job.assemble.counting:
            job.assemble.progress.advance(sizes[i])
        report.files_written.append(file.path)
        if "unchecked_records" in reused:  # kept once the source records it read are checked
            entry = {k: v for k, v in reused.items() if k != "unchecked_records"}
            keys = {marks.checks.ask_again(d) for d in reused["unchecked_records"]}
            marks.add({key for key in keys if key is not None}, file.path, entry)
        return
    with target.open_write(file.path, new_digest(marks.log.algorithm)) as out:
        if file.kind == COPY:
            copied = plan.source_files[file.copy_of or 0]
            _copy_file(job.source, copied, out, job.assemble)
            job.source.check_copy(copied, marks.log.algorithm, out.digest.hexdigest())
        else:
            _, write = registry.writer_for(file.kind)
            try:
                write(job, file, out)
            finally:
                job.assemble.forget()
        # The records this file read in parts are checked before it counts as written (so
        # before the commit, too), once the other files being written have read on in them.
        waiting = marks.checks.settle(_checked_sources(job), leave_parts=True)
    entry = {
        "tensors": report.tensor_checksums.get(file.path, {}),
        "size": out.size,
        "checksum": out.digest.hexdigest(),
    }
    if file.path in report.records:
        entry["records"] = report.records[file.path]
    if file.path in report.quantized:
        entry["quantized"] = report.quantized[file.path]
    marks.add(waiting, file.path, entry)
    report.files_written.append(file.path)


class _Marks:
    """The run log's marks of finished files, each made once the records the file read in
    parts are checked. The other files being written read on in the same records (each new
    tensor-parallel rank reads its half): a file waits for them, up to ``patience`` files
    finished after it, before the bytes no file read are read for its checks (reading them at
    once would read the other files' halves twice)."""

    def __init__(self, log: RunLog, patience: int, checks: SourceChecks) -> None:
        self.log = log
        self.patience = patience
        self.checks = checks
        self._finished = 0
        """Files finished so far."""
        self._waiting: list[tuple[set[Any], str, dict[str, Any], int]] = []
        """Each file's records read in parts, its path and log entry, and by how many
        finished files its records are read for the check."""
        self._lock = threading.Lock()

    def add(self, keys: set[Any], path: str, entry: dict[str, Any]) -> None:
        with self._lock:
            self._finished += 1
            self._waiting.append((keys, path, entry, self._finished + self.patience))
            due: list[Any] = []
            waiting: list[Any] = []
            for w in self._waiting:
                ready = w[3] <= self._finished or self.checks.checked(w[0])
                (due if ready else waiting).append(w)
            self._waiting = waiting
        for keys_due, path_due, entry_due, _ in due:
            self.checks.check_now(keys_due)
            self.checks.checked(keys_due)  # waits for the check; raises its failure
            self.log.finished(path_due, **entry_due)

    def finish(self, sources: list[str]) -> None:
        """Check what no file read of the records read in parts, then mark the files left."""
        self.checks.settle(sources)
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for _, path, entry, _ in waiting:
            self.log.finished(path, **entry)

    def keep_unchecked(self) -> None:
        """A job stopping early: the files written whole while their source records were
        still being checked go to the log with those records, so a rerun checks them and
        keeps the files (records of objects in a store cannot be described: rewritten)."""
        with self._lock:
            waiting = list(self._waiting)
        for keys, path, entry, _ in waiting:
            described = self.checks.describe(keys)
            if described is not None:
                self.log.finished_unchecked(path, entry, described)


def _checked_sources(job: WriteJob) -> list[str]:
    """The job's source files as ``record_checks`` names them: local paths, object URLs."""
    paths = []
    for path in job.plan.source_files:
        ckpt, rel = job.source.owner(path)
        paths.append(ckpt.storage.checked_name(rel))
    return paths


def _copy_file(source: Sources, path: str, out: Any, assemble: Assembler) -> None:
    """A stored file as it is (direct strategy), streamed in bounded chunks."""
    ckpt, rel = source.owner(path)

    report = assemble.report

    def advance(n: int) -> None:
        with assemble.counting:
            report.bytes_read += n
            report.bytes_written += n
            assemble.progress.advance(n)

    def copied(how: str, n: int) -> None:
        with assemble.counting:
            report.copied[how] = report.copied.get(how, 0) + n

    # Bytes that do not change move by a kernel copy, or the object store's own copy, never
    # through Python.
    local = ckpt.storage.is_local and hasattr(out, "copy_file")
    if local and (n := out.copy_file(ckpt.storage.path(rel), advance)) is not None:
        copied("copy_file_range", n)
        return
    if hasattr(out, "copy_object") and (n := out.copy_object(ckpt.storage, rel, advance)):
        copied("upload_part_copy", n)
        return
    with ckpt.storage.open_read(rel) as f:
        while chunk := f.read(8 << 20):
            write_in_slices(out, chunk)
            advance(len(chunk))
