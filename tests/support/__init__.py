"""What the test lanes stand on: their switches (settings.py) and the infrastructure each lane
needs (VMs, Kubernetes, Slurm), kept out of the test modules so that no test module imports
another."""
