"""Tests of ckptctl/compression (the package layout mirrors ckptctl's)."""
