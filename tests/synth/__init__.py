"""Tests of ckptctl/synth (the package layout mirrors ckptctl's)."""
