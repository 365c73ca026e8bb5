"""A job from URL to committed output: probe the source, plan (the planners decide), check
and lease the destination, assemble each target tensor from source boxes, execute (on one
process or many), report."""
