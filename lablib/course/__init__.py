"""The instructor side: releasing learner notebooks from the sources, and grading submissions."""
