"""The Slurm backend: one ``ft_launcher`` per node of an sbatch allocation, the job folder on a shared
disk."""

from .backend import SlurmBackend

__all__ = ["SlurmBackend"]
