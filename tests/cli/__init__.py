"""Tests of ckptctl/cli (the package layout mirrors ckptctl's)."""
