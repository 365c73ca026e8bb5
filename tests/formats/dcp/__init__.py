"""Tests of ckptctl/formats/dcp (the package layout mirrors ckptctl's)."""
