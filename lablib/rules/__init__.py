"""The rules exercise code is held to: read from its text for the notebook's messages (policy.py, constructs.py),
enforced as it runs under grading (guards.py), and the namespace and builtins it runs with (namespace.py)."""
