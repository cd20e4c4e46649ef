"""Tests on a private Slurm cluster (ci/slurm.sh)."""
