"""Collaborative training: the ``CollaborativeOptimizer`` and its parts.

Progress tracking, target-batch accumulation, gradient and parameter
averaging, checkpoints. Filled in by the trainer issue.
"""
