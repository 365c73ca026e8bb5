"""Pure policy: from what is stored and the wanted target to a ``ckptctl.model.plan.Plan``.

No I/O, no torch, no rich or typer: planners test in milliseconds and can be swapped without
touching the core. They depend only on ckptctl's pure model (layout, geometry, stored, plan).
"""
