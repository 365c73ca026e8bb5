"""Tests of ckptctl/formats/deepspeed (the package layout mirrors ckptctl's)."""
