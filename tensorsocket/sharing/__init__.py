"""share(): one producer elected among the training jobs (election), forked from a job
(shared_producer)."""
