"""Tests of ckptctl/formats/hf (the package layout mirrors ckptctl's)."""
