"""Probe: find out, read-only, what a URL holds and open it for planning and execution."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from ckptctl.checksums.manifest import refuse_incomplete
from ckptctl.compression.view import CompressedStorage, open_view
from ckptctl.errors import CheckpointError, CheckpointNotFoundError, CkptctlError, UsageError
from ckptctl.formats import registry
from ckptctl.formats.base import Checkpoint, CheckpointFormat, ProbeRequest, WeightsElsewhere
from ckptctl.formats.options import TEXT_ONLY, given
from ckptctl.io.storage import Storage
from ckptctl.model.lora import ADAPTER_CONFIG
from ckptctl.model.plan import Plan
from ckptctl.model.stored import CheckpointView
from ckptctl.settings import Settings

__all__ = ["Checkpoint", "fingerprint", "format_of", "identities", "open_checkpoint"]


def format_of(ckpt: Checkpoint) -> CheckpointFormat:
    """The registered format an opened checkpoint is in."""
    return registry.named(str(ckpt.view.format))


def open_checkpoint(
    url: str,
    settings: Settings | None = None,
    *,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
    allow_missing: bool = False,
    allow_incomplete: bool | None = None,
    with_adapter: bool = False,
    refuse_unread: bool = True,
) -> Checkpoint:
    """Probe ``url`` read-only and open it (its view for planners, lazy readers): each
    registered format is asked in turn whether it recognises what is stored. A checkpoint
    that holds a LoRA adapter trained in it opens only ``with_adapter`` (``merge-lora``):
    any other job would drop the adapter. A format option the user gave that its format does
    not read is refused; a job of several sources opens each ``refuse_unread=False`` and asks
    ``refuse_unread_options`` about them all."""
    settings = settings or Settings()
    request = ProbeRequest(
        allow_missing=allow_missing,
        options=given_options(settings, iteration, true_vocab_size),
    )
    # A source: never written, whatever happens.
    storage = Storage(url, settings.storage, read_only=True)
    if not storage.exists():
        raise CheckpointNotFoundError(f"{url}: no such checkpoint directory")
    if storage.isdir() and not (
        settings.allow_incomplete if allow_incomplete is None else allow_incomplete
    ):
        refuse_incomplete(storage)  # a compressed checkpoint's own marker, before its view
    storage = open_view(storage, settings.storage)  # a compressed checkpoint: what it stores
    if not storage.isdir():  # one file named directly (e.g. dcp_to_torch_save's output)
        parent, _, name = url.rstrip("/").rpartition("/")
        storage = Storage(parent or ".", settings.storage, read_only=True)
        request = replace(request, file=name)
        names = frozenset({name})
    else:
        if not (settings.allow_incomplete if allow_incomplete is None else allow_incomplete):
            refuse_incomplete(storage)
        names = frozenset(storage.listdir(""))
    for fmt in registry.formats():
        try:
            ckpt = _probe(fmt, storage, names, request, url)
        except WeightsElsewhere as moved:
            if isinstance(storage, CompressedStorage) or request.file is not None:
                raise
            ckpt, weights = _weights_from(
                moved, url, settings, iteration, true_vocab_size, allow_missing
            )
            if refuse_unread:
                inner = (f"{url.rstrip('/')}/{moved.directory}", format_of(weights))
                refuse_unread_options(request.options, [(url, fmt), inner])
            if (ckpt.adapter or weights.adapter) and not with_adapter:
                refuse_adapter(url, ckpt if ckpt.adapter else weights)
            return ckpt
        if ckpt is not None and isinstance(storage, CompressedStorage):
            ckpt.view = replace(ckpt.view, notes=(*ckpt.view.notes, storage.summary()))
        if ckpt is not None:
            if refuse_unread:
                refuse_unread_options(request.options, [(url, fmt)])
            if ckpt.adapter and not with_adapter:
                refuse_adapter(url, ckpt)
            return ckpt
    if ADAPTER_CONFIG in names:  # a PEFT adapter (an HF Trainer's checkpoint-N too)
        raise CheckpointNotFoundError(
            f"{url}: a PEFT adapter ({ADAPTER_CONFIG}), not a whole model",
            hint=f"merge it into its base with: ckptctl merge-lora BASE {url} DST",
        )
    known = "; ".join(
        f"{f.name} ({f.support.recognised_by})" for f in registry.formats() if f.support
    )
    raise CheckpointNotFoundError(
        f"{url}: neither a Megatron checkpoint nor any other checkpoint ckptctl reads",
        hint=f"it recognises {known}",
    )


def _weights_from(
    moved: WeightsElsewhere,
    url: str,
    settings: Settings,
    iteration: int | None,
    true_vocab_size: int | None,
    allow_missing: bool,
) -> tuple[Checkpoint, Checkpoint]:
    """The checkpoint in ``moved.directory`` of ``url``, which holds its weights, opened as
    ``url`` would be and joined with what ``url`` holds beside them (``moved.rest``), its view
    saying where the weights were read and what was not carried; and the weights' own."""
    inner = f"{url.rstrip('/')}/{moved.directory}"
    weights = ckpt = open_checkpoint(
        inner,
        settings,
        iteration=iteration,
        true_vocab_size=true_vocab_size,
        allow_missing=allow_missing,
        with_adapter=True,  # the caller refuses an adapter, naming the checkpoint asked for
        refuse_unread=False,  # the caller asks about both formats
    )
    if moved.rest is not None:
        ckpt = moved.rest.with_weights(ckpt, moved.directory)
    view = ckpt.view
    ckpt.view = replace(
        view,
        iteration=view.iteration if view.iteration is not None else moved.iteration,
        notes=(f"{moved}", *view.notes),
        warnings=(*moved.warnings, *view.warnings),
    )
    return ckpt, weights


def open_sources(
    src: str,
    others: Sequence[str],
    settings: Settings,
    allow_missing: bool,
    *,
    iteration: int | None,
    true_vocab_size: int | None,
) -> tuple[Checkpoint, list[Checkpoint]]:
    """A job's source (``allow_missing``: rank files may be lost) and its other stored copies
    (``--full``, ``--replica``), opened with the same options; an option none of them reads
    is refused (one that only some read is theirs)."""
    ckpts = [
        open_checkpoint(
            url,
            settings,
            allow_missing=allow_missing and url == src,
            iteration=iteration,
            true_vocab_size=true_vocab_size,
            refuse_unread=False,
        )
        for url in (src, *others)
    ]
    opened = [(url, format_of(c)) for url, c in zip((src, *others), ckpts, strict=True)]
    refuse_unread_options(given_options(settings, iteration, true_vocab_size), opened)
    return ckpts[0], ckpts[1:]


def given_options(
    settings: Settings, iteration: int | None = None, true_vocab_size: int | None = None
) -> dict[str, Any]:
    """The format options of a job (``FormatOption.name``: value), those given only."""
    return given(
        {
            "iteration": iteration,
            "true_vocab_size": true_vocab_size,
            "hf_config": settings.hf_config,
            "trusted_fields": settings.trusted_fields,
            "tag": settings.tag,
            "text_only": settings.text_only,
            "allow_rounding": settings.allow_rounding,
        }
    )


def refuse_unread_options(
    options: Mapping[str, Any], opened: Sequence[tuple[str, CheckpointFormat]]
) -> None:
    """Refuse an option no opened source's format reads (by its flag): it would change
    nothing, and a user who gave it meant something else (options a target or an adapter
    may read too are left to the job)."""
    for name in options:
        if any(o.name == name for _, fmt in opened for o in fmt.options):
            continue
        option = registry.option(name)
        if option is None or not option.refused_unread:
            continue
        url, fmt = opened[0]
        if len(opened) == 1:
            what = f"{url}: {option.flag} {option.about}, but this is a {fmt.name} checkpoint"
            instead = option.instead.get(fmt.name)
            what += f" (use {instead})" if instead else ""
        else:
            held = ", ".join(f"{u} is {f.name}" for u, f in opened)
            what = f"{option.flag} {option.about}, but no source of the job reads it ({held})"
        raise UsageError(what + (f"; {option.hint}" if option.hint else ""))


def open_against(url: str, other: str, settings: Settings) -> tuple[Checkpoint, Checkpoint]:
    """``verify URL --against OTHER``'s two checkpoints. ``--text-only`` reads the reference's
    text decoder (a release's) alone, never the one checked; the other options either side."""
    checked = open_checkpoint(url, replace(settings, text_only=False), refuse_unread=False)
    reference = open_checkpoint(other, settings, refuse_unread=False)
    options = given_options(settings)
    text = {k: v for k, v in options.items() if k == TEXT_ONLY.name}
    refuse_unread_options(text, [(other, format_of(reference))])
    rest = {k: v for k, v in options.items() if k not in text}
    refuse_unread_options(rest, [(url, format_of(checked)), (other, format_of(reference))])
    return checked, reference


def refuse_adapter(url: str, ckpt: Checkpoint) -> None:
    """A checkpoint trained with a LoRA adapter in it: its base alone is not the trained
    model, so only merging or exporting the adapter is offered."""
    adapter = ckpt.adapter
    modules = adapter.modules if adapter is not None else frozenset()
    known = adapter is not None and adapter.trained is not None and adapter.trained.alpha
    alpha = "" if known else " --lora-alpha ALPHA"
    if adapter is not None and adapter.alone:
        raise CheckpointError(
            f"{url}: holds a LoRA adapter trained on {len(modules)} modules alone (saved "
            "without its base weights): there is no model to convert",
            hint=f"merge it into the model the run started from: ckptctl merge-lora BASE {url} "
            f"DST{alpha}; or export it: ckptctl merge-lora {url} DST --adapter-only{alpha}",
        )
    raise CheckpointError(
        f"{url}: holds a LoRA adapter trained on {len(modules)} modules beside its base "
        "weights; converting the base alone would drop it",
        hint=f"merge it: ckptctl merge-lora {url} DST{alpha}; or export it: "
        f"ckptctl merge-lora {url} DST --adapter-only{alpha}",
    )


UNREADABLE = (
    ArithmeticError,
    AttributeError,
    EOFError,
    IndexError,
    KeyError,
    MemoryError,
    RecursionError,
    TypeError,
    ValueError,
    struct.error,
)
"""What a format's parser raises when a file is not what it claims to be, past the checks it
makes on purpose: probing parses untrusted files, so any of these is a bad checkpoint."""


def _probe(
    fmt: CheckpointFormat, storage: Storage, names: frozenset[str], request: ProbeRequest, url: str
) -> Checkpoint | None:
    """``fmt``'s probe of the checkpoint; a model description that cannot exist, or a file
    its parser chokes on, is a bad checkpoint (exit 3) named by its URL, not a crash."""
    try:
        return fmt.probe(storage, names, request)
    except CkptctlError:
        raise
    except ValidationError as err:
        problems = "; ".join(
            (f"{'.'.join(map(str, e['loc']))}={e.get('input')!r}: " if e["loc"] else "")
            + e["msg"].removeprefix("Value error, ")
            for e in err.errors()[:5]
        )
        raise CheckpointError(f"{url}: its model description cannot be: {problems}") from err
    except UNREADABLE as err:
        raise CheckpointError(
            f"{url}: cannot be read as a {fmt.name} checkpoint ({type(err).__name__}: "
            f"{str(err)[:200]})",
            hint="ckptctl verify names the damaged files; --debug shows where reading failed",
        ) from err


def file_sizes(storage: Storage, view: CheckpointView, lost: frozenset[str]) -> dict[str, int]:
    return {f.path: storage.size(f.path) for f in view.files if f.path not in lost}


def identities(
    storage: Storage, view: CheckpointView, lost: frozenset[str] = frozenset()
) -> dict[str, str]:
    """Every file the checkpoint's content depends on -> its content identity."""
    files = [f.path for f in view.files if f.path not in lost]
    described = registry.named(str(view.format)).metadata_files(storage, view)
    return {p: storage.identity(p) for p in sorted({*files, *described})}


def fingerprint(storage: Storage, view: CheckpointView, lost: frozenset[str] = frozenset()) -> str:
    """A hash of what is stored (each file's content identity: size, times, inode or ETag) and
    how it was read (spec, layout): any change to a source file changes it."""
    body = {
        "files": sorted(identities(storage, view, lost).items()),
        "spec": view.spec.model_dump(mode="json") if view.spec else None,
        "layout": view.layout.model_dump(mode="json"),
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def with_identities(
    plan: Plan, storage: Storage, view: CheckpointView, lost: frozenset[str] = frozenset()
) -> Plan:
    """``plan`` recording the content identity of each source file it depends on."""
    found = tuple(identities(storage, view, lost).items())
    return plan.model_copy(update={"source_identities": found})


def changed_files(plan: Plan, storage: Storage) -> list[str]:
    """Source files whose identity differs from what ``plan`` recorded (or that are gone)."""
    changed = []
    for path, recorded in plan.source_identities:
        try:
            now = storage.identity(path)
        except OSError:  # gone (CheckpointNotFoundError is one)
            now = "missing"
        if now != recorded:
            changed.append(f"{path} ({'missing' if now == 'missing' else 'changed'})")
    return changed
