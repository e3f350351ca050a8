"""What a run keeps on disk: its directory (run_dir.py: lock, cleanup after a killed write, old logs set aside) and
its checkpoints (checkpoint.py: written atomically, found, read back, and what a resume may continue)."""
