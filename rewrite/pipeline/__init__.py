"""Pipeline parallelism: carving this rank's stage out of a model, point-to-point
transfers, the runner that executes a schedule, and the timeline it records.
"""
