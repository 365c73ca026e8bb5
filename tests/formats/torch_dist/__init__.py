"""Tests of ckptctl/formats/torch_dist (the package layout mirrors ckptctl's)."""
