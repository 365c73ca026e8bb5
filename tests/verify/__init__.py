"""Tests of ckptctl/verify (the package layout mirrors ckptctl's)."""
