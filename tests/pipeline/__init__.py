"""Tests of ckptctl/pipeline (the package layout mirrors ckptctl's)."""
