"""The options every command takes (storage, ``--debug``, how checkpoints are read), declared
once and accepted both before the command and after it (``ckptctl inspect X --tag T``, as
the aws and hf CLIs take theirs): the root command records what it was given, each command
declares the same options, and a value given after the command adds to or replaces the one
given before. Nothing is parsed until the command's own error boundary asks for the settings,
so a bad value is a one-line error like any other.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Annotated, Any

import typer

from ckptctl.settings import Settings

Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")]
AllowIncomplete = Annotated[
    bool,
    typer.Option("--allow-incomplete", help="Read checkpoints a ckptctl job never finished."),
]
EndpointUrl = Annotated[
    str | None,
    typer.Option(
        "--endpoint-url",
        help="S3-compatible endpoint (MinIO, Ceph RGW); default: AWS config, AWS_ENDPOINT_URL.",
    ),
]
StorageOption = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option",
        help="fsspec option for remote URLs as key=value (repeatable), e.g. anon=true.",
    ),
]
PartSize = Annotated[
    str | None,
    typer.Option("--part-size", help="Multipart upload part size (>= 5MiB; default 8MiB)."),
]
UploadParallel = Annotated[
    int | None,
    typer.Option("--upload-parallel", help="Parts of one object uploaded at once (default 8)."),
]
HfConfig = Annotated[
    str | None,
    typer.Option(
        "--hf-config",
        help="config.json (or its directory) of the HF model a DCP or DeepSpeed checkpoint "
        "holds; looked for beside the checkpoint too.",
    ),
]
TrustField = Annotated[
    list[str] | None,
    typer.Option(
        "--trust-field",
        help="A field of the model description (Megatron args, config.json) that ckptctl "
        "does not know, vouched for as not changing the tensors' layout or meaning "
        "(repeatable). Unknown fields are refused otherwise.",
    ),
]
Tag = Annotated[
    str | None,
    typer.Option(
        "--tag",
        help="DeepSpeed checkpoint tag directory to read instead of the one 'latest' names.",
    ),
]
TextOnly = Annotated[
    bool,
    typer.Option(
        "--text-only",
        help="Read the text decoder of a vision-language model (Qwen3.5, Gemma 3; HF "
        "safetensors or an FSDP DCP save) alone, leaving its vision tower out.",
    ),
]
AllowRounding = Annotated[
    bool,
    typer.Option(
        "--allow-rounding",
        help="Round weights HF stores shifted from Megatron's (Qwen3.5's gated norm: one plus "
        "Megatron's zero-centred weight) to their dtype where the shift is not exact, reading "
        "or writing, instead of refusing (as Megatron-Bridge rounds them); each weight's "
        "largest error recorded and held by verify --against.",
    ),
]


@dataclass(frozen=True)
class GlobalRequest:
    """The global options as given (before the command, after it, or merged)."""

    debug: bool = False
    allow_incomplete: bool = False
    endpoint_url: str | None = None
    storage_options: tuple[str, ...] = ()
    part_size: str | None = None
    upload_parallel: int | None = None
    hf_config: str | None = None
    trust_fields: tuple[str, ...] = ()
    tag: str | None = None
    text_only: bool = False
    allow_rounding: bool = False

    def then(self, later: GlobalRequest) -> GlobalRequest:
        """These options with ``later`` ones (given after the command) applied: flags add,
        lists extend, a value replaces."""
        return GlobalRequest(
            debug=self.debug or later.debug,
            allow_incomplete=self.allow_incomplete or later.allow_incomplete,
            endpoint_url=later.endpoint_url or self.endpoint_url,
            storage_options=self.storage_options + later.storage_options,
            part_size=later.part_size or self.part_size,
            upload_parallel=later.upload_parallel or self.upload_parallel,
            hf_config=later.hf_config or self.hf_config,
            trust_fields=self.trust_fields + later.trust_fields,
            tag=later.tag or self.tag,
            text_only=self.text_only or later.text_only,
            allow_rounding=self.allow_rounding or later.allow_rounding,
        )


def global_request(
    debug: Debug = False,
    allow_incomplete: AllowIncomplete = False,
    endpoint_url: EndpointUrl = None,
    storage_option: StorageOption = None,
    part_size: PartSize = None,
    upload_parallel: UploadParallel = None,
    hf_config: HfConfig = None,
    trust_field: TrustField = None,
    tag: Tag = None,
    text_only: TextOnly = False,
    allow_rounding: AllowRounding = False,
) -> GlobalRequest:
    return GlobalRequest(
        debug,
        allow_incomplete,
        endpoint_url,
        tuple(storage_option or ()),
        part_size,
        upload_parallel,
        hf_config,
        tuple(trust_field or ()),
        tag,
        text_only,
        allow_rounding,
    )


@dataclass
class CliState:
    """What the global options decide for one command: ``debug`` at once, the settings when
    first asked for (inside the command's error boundary: reading them may fail)."""

    request: GlobalRequest = field(default_factory=GlobalRequest)
    _settings: Settings | None = None

    @property
    def debug(self) -> bool:
        return self.request.debug

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            from ckptctl.cli.option_values import read_hf_config, storage_config

            r = self.request
            storage = storage_config(
                r.endpoint_url,
                list(r.storage_options),
                r.part_size or "8MiB",
                r.upload_parallel or 8,
            )
            self._settings = Settings(
                storage=storage,
                allow_incomplete=r.allow_incomplete,
                hf_config=read_hf_config(r.hf_config, storage) if r.hf_config else None,
                trusted_fields=frozenset(n.removeprefix("args.") for n in r.trust_fields),
                tag=r.tag,
                text_only=r.text_only,
                allow_rounding=r.allow_rounding,
            )
        return self._settings


def state(ctx: typer.Context) -> CliState:
    return ctx.obj if isinstance(ctx.obj, CliState) else CliState()


def with_global_options(command: Any) -> Any:
    """``command`` taking the global options too; what it is given after the command name is
    applied over what the root command was given (``state(ctx)`` then holds both)."""
    from ckptctl.cli.option_values import with_options

    signature = inspect.signature(command, eval_str=True)

    @functools.wraps(command)
    def run(*args: Any, given_globals: GlobalRequest | None = None, **kwargs: Any) -> Any:
        ctx = kwargs.get("ctx") or next(a for a in args if isinstance(a, typer.Context))
        before = state(ctx).request
        ctx.obj = CliState(before.then(given_globals or GlobalRequest()))
        return command(*args, **kwargs)

    extra = inspect.Parameter(
        "given_globals",
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        default=None,
        annotation=GlobalRequest | None,
    )
    params = [*signature.parameters.values(), extra]
    run.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return with_options(global_request, "given_globals")(run)
