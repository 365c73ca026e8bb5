"""Tests of ckptctl/planners (the package layout mirrors ckptctl's)."""
