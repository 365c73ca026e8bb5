"""Tests of ckptctl/checksums (the package layout mirrors ckptctl's)."""
