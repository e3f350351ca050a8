"""A run's examples and what is written from them: loading data sets (examples.py, sources.py), reference solutions in
the run's format (solutions.py), the system prompt with its worked examples (prompts.py), demonstrations placed in a
group (demonstrations.py) and the built-in offline image task `shapes` (shapes.py)."""
