"""Tests of ckptctl/formats/megatron (the package layout mirrors ckptctl's)."""
