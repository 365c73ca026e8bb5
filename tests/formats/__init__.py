"""Tests of ckptctl/formats (the package layout mirrors ckptctl's)."""
