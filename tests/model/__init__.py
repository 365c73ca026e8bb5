"""Tests of ckptctl/model (the package layout mirrors ckptctl's)."""
