"""Tests of ckptctl/io (the package layout mirrors ckptctl's)."""
