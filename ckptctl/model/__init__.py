"""The pure model: what a checkpoint is (layout, geometry, catalog, stored view), what to do
(plan) and what storage costs (profile). Values only: nothing here imports torch, fsspec, rich
or typer, so planners and tests use it without touching a file."""
