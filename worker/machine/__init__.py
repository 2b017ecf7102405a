"""Placement on the machine: CPU pinning and NUMA memory binding."""
