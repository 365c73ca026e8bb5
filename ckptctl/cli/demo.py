"""``ckptctl demo``: build a small sharded checkpoint, plan, consolidate and check it end to end."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from ckptctl.cli.commands import describe, run_consolidate
from ckptctl.cli.output import Output
from ckptctl.errors import UsageError
from ckptctl.probe import open_checkpoint
from ckptctl.stored import Format


def register(app: typer.Typer, boundary) -> None:  # type: ignore[no-untyped-def]
    @app.command("demo")
    def demo_cmd(
        out_dir: Annotated[
            Path | None, typer.Option("--out", help="Where to write (default: a temp directory).")
        ] = None,
        tp: Annotated[int, typer.Option(help="Tensor parallel size of the example.")] = 2,
        pp: Annotated[int, typer.Option(help="Pipeline parallel size of the example.")] = 2,
    ) -> None:
        """Make a tiny Llama as a sharded Megatron checkpoint, then consolidate and verify it."""
        out = Output()
        with boundary(out):
            try:
                import torch
                import transformers

                from ckptctl import synth
            except ImportError as err:
                raise UsageError(
                    f"the demo needs transformers ({err}); pip install 'ckptctl[examples]'"
                ) from None
            root = out_dir or Path(tempfile.mkdtemp(prefix="ckptctl-demo-"))
            if root.exists() and any(root.iterdir()):
                shutil.rmtree(root)
            root.mkdir(parents=True, exist_ok=True)
            src = root / f"megatron-tp{tp}-pp{pp}"
            out.show("[bold]1.[/] building a tiny Llama (GQA, SwiGLU, vocab 1100) + one Adam step")
            model = synth.make_model(synth.tiny_llama_config(), seed=0)
            states = synth.adam_step(model, seed=0)
            synth.write_megatron(model, states, src, tp=tp, pp=pp)
            info = describe(open_checkpoint(str(src)))
            out.show(
                f"[bold]2.[/] wrote {src}: Megatron legacy, TP{tp} PP{pp}, {len(info['files'])} "
                f"rank files, {info['tensors']} tensors (weights {info['weight_bytes']} B, "
                f"optimizer {info['optimizer_bytes']} B)"
            )
            hf = root / "hf"
            plan, report = run_consolidate(out, str(src), str(hf), Format.HF, quiet=True)
            out.show(
                f"[bold]3.[/] consolidate -> {hf}: plan '{plan.strategy}' ({plan.reason}); "
                f"{plan.estimates.read_requests} reads, {report.bytes_written} B written"
            )
            full = root / "megatron-full"
            plan, report = run_consolidate(out, str(src), str(full), Format.MEGATRON, quiet=True)
            out.show(
                f"[bold]4.[/] consolidate --format megatron -> {full}: TP1 PP1 with optimizer "
                f"state, {report.bytes_written} B written"
            )
            transformers.logging.disable_progress_bar()
            loaded = transformers.AutoModelForCausalLM.from_pretrained(
                hf, dtype=torch.float32, attn_implementation="eager"
            )
            ids = torch.randint(0, 1100, (2, 17), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                same = torch.equal(loaded(ids).logits, model(ids).logits)
            weights = all(
                torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items()
            )
            verdict = "[green]identical[/]" if same and weights else "[red]DIFFERENT[/]"
            out.show(f"[bold]5.[/] transformers loads {hf}: weights and logits {verdict}")
            if not (same and weights):
                raise typer.Exit(1)
